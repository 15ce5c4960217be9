"""A scripted OpenAI-compatible HTTP server on 127.0.0.1 for the HTTP backend's tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = tuple[int, dict, Any, float]  # status, headers, body (dict/str), delay before answering


def ok_body(content: str, pt: int = 11, ct: int = 5) -> dict:
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
    }


class FakeServer:
    """Threaded HTTP server; ``script(n, body) -> Reply`` decides each answer (n: 0-based count)."""

    def __init__(self) -> None:
        self.script: Callable[[int, dict], Reply] = lambda n, body: (200, {}, ok_body("hi"), 0.0)
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with outer.lock:
                    n = len(outer.bodies)
                    outer.bodies.append(body)
                    outer.paths.append(self.path)
                    outer.auth.append(self.headers.get("Authorization"))
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:
                    status, headers, payload, delay = outer.script(n, body)
                    if delay:
                        time.sleep(delay)
                    data = (
                        payload
                        if isinstance(payload, bytes)
                        else (
                            payload.encode()
                            if isinstance(payload, str)
                            else json.dumps(payload).encode()
                        )
                    )
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with outer.lock:
                        outer.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

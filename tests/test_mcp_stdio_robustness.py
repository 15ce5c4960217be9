"""The MCP server over stdio, driven by raw JSON lines: a line that is no JSON-RPC message
gets an error reply and the next lines are served; a client going away, SIGINT and SIGTERM
each end the server cleanly (the store closed, exit status 0); ``timestamp: ""`` is now;
``--add-wait-s`` takes a finite number of seconds (hashing embedder, a subprocess each)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.server.mcp_server import _parser

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes and signals")


class Server:
    def __init__(self, tmp_path: Path) -> None:
        self.store = tmp_path / "store"
        self.err = tmp_path / "stderr.txt"
        env = {**os.environ, "MEMORYOS_GPU_EMBEDDER": "hashing"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "memoryos_gpu.server.mcp_server", "--store", str(self.store)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err.open("w"),
        )
        self._buf = b""

    def send(self, line: bytes | dict[str, Any]) -> None:
        data = json.dumps(line).encode() if isinstance(line, dict) else line
        assert self.proc.stdin is not None
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 15) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            if not ready:
                raise AssertionError(f"no reply in {timeout} s; stderr: {self.stderr()[-2000:]}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"stdout closed; stderr: {self.stderr()[-2000:]}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def initialize(self) -> None:
        self.send(
            {
                "jsonrpc": "2.0",
                "id": 0,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "t", "version": "1"},
                },
            }
        )
        assert self.recv(timeout=25)["id"] == 0
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def call(self, rid: int, name: str, **arguments: Any) -> dict[str, Any]:
        self.send(
            {
                "jsonrpc": "2.0",
                "id": rid,
                "method": "tools/call",
                "params": {"name": name, "arguments": arguments},
            }
        )
        reply = self.recv()
        assert reply["id"] == rid
        return reply

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait(self, timeout: float = 20) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the server did not exit in {timeout} s") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def store_closed(self) -> bool:
        """No SQLite -wal / -shm left: the engine closed the store."""
        return not [p for p in self.store.rglob("*") if p.name.endswith(("-wal", "-shm"))]


@pytest.fixture
def server(tmp_path: Path):
    s = Server(tmp_path)
    try:
        yield s
    finally:
        s.close()


def _ping(s: Server, rid: int) -> None:
    s.send({"jsonrpc": "2.0", "id": rid, "method": "ping"})
    assert s.recv() == {"jsonrpc": "2.0", "id": rid, "result": {}}


def test_lines_that_are_not_messages_get_an_error_reply_and_serving_goes_on(
    server: Server,
) -> None:
    server.initialize()
    server.send(b"{not json")
    reply = server.recv()
    assert reply["id"] is None and reply["error"]["code"] == -32700
    assert reply["error"]["message"].startswith("Parse error: ")
    _ping(server, 1)
    # a lone surrogate escape: the SDK's JSON parser refuses it, as any invalid JSON
    server.send(
        b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"add_memory",'
        b'"arguments":{"user_input":"ok","agent_response":"x","meta_data":{"k":"\\ud800"}}}}'
    )
    reply = server.recv()
    assert reply["id"] is None and reply["error"]["code"] == -32700
    _ping(server, 3)
    server.send(b'[{"jsonrpc":"2.0","id":4,"method":"ping"}]')  # a batch
    reply = server.recv()
    assert reply["id"] is None and reply["error"]["code"] == -32600
    server.send(b'{"jsonrpc":"2.0","id":5,"method":7}')  # JSON, not a request: its id
    reply = server.recv()
    assert reply["id"] == 5 and reply["error"]["code"] == -32600
    _ping(server, 6)
    server.proc.stdin.close()  # type: ignore[union-attr]
    assert server.wait() == 0


def test_an_empty_timestamp_is_now(server: Server) -> None:
    server.initialize()
    reply = server.call(1, "add_memory", user_input="hi", agent_response="yo", timestamp="")
    result = reply["result"]
    assert not result.get("isError"), result
    assert result["structuredContent"]["status"] == "success"
    assert result["structuredContent"]["timestamp"]  # now, printed


def test_a_client_dying_mid_session_is_a_clean_exit(server: Server) -> None:
    server.initialize()
    server.proc.stdout.close()  # type: ignore[union-attr]  # the client's end: gone
    try:  # the server may end at its first reply that meets the closed pipe
        for i in range(4):  # in flight: their replies meet a closed pipe
            server.send(
                {
                    "jsonrpc": "2.0",
                    "id": 100 + i,
                    "method": "tools/call",
                    "params": {
                        "name": "add_memory",
                        "arguments": {
                            "user_input": f"dying {i} " + "word " * 2000,
                            "agent_response": "ok",
                        },
                    },
                }
            )
            server.send({"jsonrpc": "2.0", "id": 200 + i, "method": "ping"})
    except BrokenPipeError:
        pass
    time.sleep(1)
    with contextlib.suppress(BrokenPipeError):  # the server may have ended already
        server.proc.stdin.close()  # type: ignore[union-attr]
    assert server.wait() == 0
    err = server.stderr()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert len(err.strip().splitlines()) <= 1, err
    assert server.store_closed()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_drains_and_exits_0(server: Server, sig: int) -> None:
    server.initialize()
    reply = server.call(1, "add_memory", user_input="remember me", agent_response="ok")
    assert not reply["result"].get("isError"), reply
    server.proc.send_signal(sig)  # stdin still open
    assert server.wait(20) == 0
    err = server.stderr()
    assert "Traceback" not in err, err
    assert server.store_closed()


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "-inf", "3601", "abc"])
def test_add_wait_s_must_be_a_finite_number_of_seconds(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--add-wait-s", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "python -m memoryos_gpu.server.mcp_server: error: argument --add-wait-s"
    )


@pytest.mark.parametrize(("value", "seconds"), [("0", 0.0), ("2.5", 2.5), ("3600", 3600.0)])
def test_add_wait_s_takes_0_to_an_hour(value: str, seconds: float) -> None:
    assert _parser().parse_args(["--add-wait-s", value]).add_wait_s == seconds


def test_the_calls_read_before_stdin_closed_are_answered(server: Server) -> None:
    """A client that writes its calls and closes its end of stdin (a pipe) got ``Connection
    closed`` for the calls in flight, while a write among them was committed all the same (a
    retry stored it twice): the calls are now answered, then the server ends."""
    server.initialize()
    for i in range(3):
        server.send(
            {
                "jsonrpc": "2.0",
                "id": 10 + i,
                "method": "tools/call",
                "params": {
                    "name": "add_memory",
                    "arguments": {"user_input": f"piped page {i}", "agent_response": "ok"},
                },
            }
        )
    server.proc.stdin.close()  # type: ignore[union-attr]
    replies = {r["id"]: r for r in (server.recv() for _ in range(3))}
    assert sorted(replies) == [10, 11, 12]
    for r in replies.values():
        assert "error" not in r and r["result"]["structuredContent"]["status"] == "success", r
    assert server.wait() == 0


def test_a_user_input_of_control_characters_only_is_blank(server: Server) -> None:
    """``"\\u0007"`` passed the not-blank check and was stored as an empty page (the engine
    drops control characters), one the HTTP API refuses."""
    server.initialize()
    for rid, text in ((1, "\u0007"), (2, "\u0000\u0000 ")):
        result = server.call(rid, "add_memory", user_input=text, agent_response="x")["result"]
        assert result.get("isError"), result
        assert "user_input" in result["content"][0]["text"], result
    assert not server.call(3, "add_memory", user_input="\u0007hi", agent_response="x")[
        "result"
    ].get("isError")


def test_a_call_the_client_cancelled_is_not_waited_for_at_the_end_of_stdin(
    server: Server,
) -> None:
    """The server answers no request the client cancelled: the end of stdin does not wait
    for one (its 30 s bound), it ends as soon as the other calls are answered."""
    server.initialize()
    server.send(
        {
            "jsonrpc": "2.0",
            "id": 7,
            "method": "tools/call",
            "params": {
                "name": "add_memory",
                "arguments": {"user_input": "cancel me", "agent_response": "ok"},
            },
        }
    )
    server.send(
        {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": 7, "reason": "the user gave up"},
        }
    )
    server.send({"jsonrpc": "2.0", "id": 8, "method": "ping"})
    t0 = time.monotonic()
    server.proc.stdin.close()  # type: ignore[union-attr]
    assert server.wait(timeout=25) == 0
    assert time.monotonic() - t0 < 20

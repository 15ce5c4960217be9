"""A request's headers have a deadline (``header_timeout_s``): a connection that sends nothing,
or its headers too slowly (slowloris), is closed, with a 408 once a request has begun; a
request whose headers arrived is not cut by it, nor is the next request on its connection."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from memoryos_gpu.server.header_timeout import header_timeout_protocol

DEADLINE_S = 0.5


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    config = uvicorn.Config(
        _app,
        host="127.0.0.1",
        port=free,
        http=header_timeout_protocol(DEADLINE_S),
        log_level="warning",
        timeout_keep_alive=10,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    yield free
    server.should_exit = True
    thread.join(10)


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when it closed it."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    got = b""
    while True:
        part = sock.recv(4096)
        if not part:
            return got, time.monotonic() - t0
        got += part


def test_a_connection_that_sends_nothing_is_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        got, took = _read_until_closed(s, 5)
    assert got == b"" and took < DEADLINE_S + 2


def test_headers_sent_too_slowly_get_a_408_and_the_connection_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        got, took = _read_until_closed(s, 5)
    assert got.startswith(b"HTTP/1.1 408") and took < DEADLINE_S + 2


def test_a_request_whose_headers_arrived_is_not_cut_nor_is_the_next_one(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(5)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(DEADLINE_S * 3)  # idle, kept alive: uvicorn's keep-alive timeout (10 s)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_the_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        header_timeout_protocol(0)

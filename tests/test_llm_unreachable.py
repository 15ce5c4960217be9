"""An OpenAI-compatible endpoint that cannot be reached: the circuit breaker and connect gate.

A firewalled host never answers the TCP SYN, so every connect waits out its timeout. Once the
endpoint is known unreachable the backend must fail at once (``LLMBackendError``) until a
cool-down passes, then try one probe; a batch must not pay ``requests x tries`` connects; a
server that answers errors, or answers slowly, is not unreachable (a batch it fails entirely
is refused as a failing server's: tests/llm/test_llm_server_outage.py).

Deterministic and local: scripted httpx transports (no network), an injectable clock for the
cool-down, and for the real-socket case a localhost listener whose accept queue is full (the
kernel drops further SYNs, as a firewall does).
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest

from memoryos_gpu.llm import ChatRequest, LLMBackendError, OpenAICompatBackend

#: The cool-down a refusal names, read a moment after the breaker opened (``.3g``: 29.9 once
#: 50 ms have passed on a loaded machine)
COOLING = r"not trying again for (30|29\.\d) s"
DEAD_URL = "http://10.255.255.1:8000"  # never contacted: the transports below answer instead
OK = {"choices": [{"message": {"role": "assistant", "content": "fine"}}]}
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Transport(httpx.AsyncBaseTransport):
    """Answers every request with ``handler``; counts the calls (each one a connect attempt:
    nothing is pooled) and records when each starts and ends."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.calls = 0
        self.events: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        self.events.append("start")
        try:
            return await self.handler(request)
        finally:
            self.events.append("end")


def drops(delay: float = 0.05) -> Handler:
    """A firewalled host: the connect times out after ``delay``."""

    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(delay)
        raise httpx.ConnectTimeout("timed out", request=request)

    return handler


async def refuses(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def answers(status: int, body: Any = OK) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body)

    return handler


class Clock:
    """The breaker's clock, moved by hand: the cool-down without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backend(transport: httpx.AsyncBaseTransport, **kw: Any) -> OpenAICompatBackend:
    kw.setdefault("max_retries", 2)
    kw.setdefault("timeout_s", 5.0)
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("backoff_max_s", 0.02)
    return OpenAICompatBackend(kw.pop("url", DEAD_URL), "m", transport=transport, **kw)


def req(text: str = "x") -> ChatRequest:
    return ChatRequest(messages=({"role": "user", "content": text},))


def batch(n: int) -> list[ChatRequest]:
    return [req(f"q{i}") for i in range(n)]


# ------------------------------------------------------------------ the breaker opens


def test_the_breaker_opens_after_the_configured_connect_failures() -> None:
    t = Transport(refuses)
    with backend(t, max_retries=2) as b:
        with pytest.raises(LLMBackendError):
            b.generate([req()])
        assert t.calls == 3  # 1 + max_retries
        with pytest.raises(LLMBackendError) as info:
            b.generate(batch(5))
        assert t.calls == 3  # open: the transport was not called again
        assert b.breaker.state == "open"
    assert "connection refused after 3 tries" in str(info.value)
    assert re.search(COOLING, str(info.value))


def test_an_open_breaker_fails_at_once_without_connecting() -> None:
    t = Transport(drops(0.5))
    with backend(t, max_retries=1, connect_timeout_s=0.5) as b:
        with pytest.raises(LLMBackendError):
            b.generate([req()])
        calls = t.calls
        t0 = time.monotonic()
        with pytest.raises(LLMBackendError, match="connect timed out after 2 tries"):
            b.generate(batch(10))
        elapsed = time.monotonic() - t0
    assert t.calls == calls == 2  # not one more connect attempt
    assert elapsed < 0.25  # half a connect timeout: nothing waited on the network


def test_the_message_says_what_happened_and_what_to_check_but_not_the_key() -> None:
    t = Transport(drops())
    url = "http://user:hunter2@10.255.255.1:8000"
    b = backend(t, url=url, api_key="sk-secret-123", breaker_cooldown_s=30)
    with b, pytest.raises(LLMBackendError) as info:
        b.generate([req()])
    message = str(info.value)
    assert (
        "LLM server at http://user:***@10.255.255.1:8000/v1: unreachable "
        "(connect timed out after 3 tries); not trying again for " in message
    )
    assert re.search(COOLING, message)
    assert "firewall" in message and "base_url" in message
    assert "sk-secret-123" not in message and "hunter2" not in message


# ------------------------------------------------------------------ a batch: one request's tries


def test_a_concurrent_batch_to_an_unreachable_endpoint_makes_one_requests_tries() -> None:
    t = Transport(drops(0.05))
    with backend(t, max_retries=2, max_concurrency=32) as b:
        t0 = time.monotonic()
        with pytest.raises(LLMBackendError, match="connect timed out after 3 tries"):
            b.generate(batch(20))
        elapsed = time.monotonic() - t0
    assert t.calls == 3  # max_retries + 1 in all, not 20 x 3
    assert elapsed < 3.0  # generous: three 0.05 s connects and two short backoffs


def test_an_async_batch_is_cut_short_too() -> None:
    t = Transport(drops(0.05))

    async def main(b: OpenAICompatBackend) -> None:
        await b.agenerate(batch(8))

    with backend(t, max_retries=1) as b, pytest.raises(LLMBackendError, match="2 tries"):
        asyncio.run(main(b))
    assert t.calls == 2


# ------------------------------------------------------------------ half-open after the cool-down


def _opened(t: Transport, clock: Clock, **kw: Any) -> OpenAICompatBackend:
    b = backend(t, breaker_cooldown_s=30, **kw)
    b.breaker.clock = clock
    t.handler = refuses
    with pytest.raises(LLMBackendError):
        b.generate([req()])
    return b


def test_after_the_cool_down_one_probe_goes_and_success_closes_the_breaker() -> None:
    clock, t = Clock(), Transport(refuses)
    with _opened(t, clock) as b:
        t.handler = answers(200)
        before = t.calls
        clock.now += 29  # still cooling down: no connect
        with pytest.raises(LLMBackendError, match="not trying again for 1 s"):
            b.generate(batch(5))
        assert t.calls == before
        assert b.breaker.state == "open"
        clock.now += 2
        assert b.breaker.state == "half_open"
        t.events.clear()
        res = b.generate(batch(5))
        assert [r.text for r in res] == ["fine"] * 5
        assert t.calls == before + 5
        assert t.events[:2] == ["start", "end"]  # the probe went alone, the rest after it
        assert b.breaker.state == "closed" and b.breaker.failures == 0


def test_a_failed_probe_reopens_the_breaker_after_one_try() -> None:
    clock, t = Clock(), Transport(refuses)
    with _opened(t, clock, max_retries=3) as b:
        before = t.calls
        clock.now += 31
        with pytest.raises(LLMBackendError) as info:
            b.generate(batch(5))
        assert t.calls == before + 1  # one probe, not 1 + max_retries, not one per request
        assert b.breaker.state == "open"
    assert "not trying again for 30 s" in str(info.value)


def test_without_a_cool_down_every_batch_probes_once() -> None:
    t = Transport(refuses)
    with backend(t, max_retries=2, breaker_cooldown_s=0) as b:
        for calls in (3, 4, 5):  # the first batch: 1 + max_retries; then one probe each
            with pytest.raises(LLMBackendError):
                b.generate(batch(6))
            assert t.calls == calls


def test_the_breaker_is_per_backend_instance() -> None:
    dead, alive = Transport(refuses), Transport(answers(200))
    with backend(dead) as b1, backend(alive) as b2:
        with pytest.raises(LLMBackendError):
            b1.generate([req()])
        assert b2.generate([req()])[0].text == "fine"
        with pytest.raises(LLMBackendError):
            b1.generate([req()])
    assert dead.calls == 3 and alive.calls == 1


# ------------------------------------------------------------------ not unreachable


def test_a_server_answering_500_is_not_a_connect_failure() -> None:
    t = Transport(answers(500, {"error": {"message": "engine crashed"}}))
    with backend(t, max_retries=2, breaker_cooldown_s=0) as b:
        for _ in range(3):
            with pytest.raises(LLMBackendError, match="answers but cannot serve") as info:
                b.generate(batch(4))
            assert "unreachable" not in str(info.value) and "HTTP 500" in str(info.value)
        assert b.breaker.failures == 0
    assert t.calls == 3 * 4 * 3  # every batch, every request, every retry reached the server


def test_read_timeouts_of_a_reachable_server_are_not_connect_failures() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    t = Transport(slow)
    with backend(t, max_retries=1, breaker_cooldown_s=0) as b:
        for _ in range(3):
            with pytest.raises(LLMBackendError, match=r"answers but cannot serve.*timeout"):
                b.generate(batch(3))
        assert b.breaker.failures == 0
    assert t.calls == 3 * 3 * 2


class _SilentServer:
    """Accepts every connection, reads the request and never answers: a slow model."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)  # held open, never answered

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_slow_server_on_a_real_socket_is_not_unreachable() -> None:
    """Through httpx's own transport: the overall deadline strikes after the connect, which
    the trace hook saw succeed, so it is a slow answer, not an unreachable server."""
    server = _SilentServer()
    try:
        with OpenAICompatBackend(
            server.url,
            "m",
            timeout_s=0.3,
            max_retries=1,
            backoff_base_s=0.01,
            backoff_max_s=0.02,
            breaker_cooldown_s=0,
        ) as b:
            for _ in range(2):
                with pytest.raises(LLMBackendError) as info:
                    b.generate(batch(3))
                assert "answers but cannot serve" in str(info.value)
                assert "timeout after 0.3s" in str(info.value)
            assert b.breaker.failures == 0
    finally:
        server.close()


# ------------------------------------------------------------------ a real dropped SYN


@pytest.fixture
def dropping_url() -> Iterator[str]:
    """A localhost port whose accept queue is full: the kernel drops new SYNs (Linux), so a
    connect hangs as it does to a firewalled host."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the queue, until a connect hangs
        s = socket.socket()
        s.settimeout(0.2)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            break
        fillers.append(s)
    else:
        listener.close()
        pytest.skip("this OS accepts connections past the listen backlog")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for s in fillers:
            s.close()
        listener.close()


class _CountingTransport(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        return await super().handle_async_request(request)


@pytest.mark.parametrize("connect_timeout", [{}, {"connect_timeout_s": 5.0}])
def test_dropped_syns_on_a_real_socket_open_the_breaker(
    dropping_url: str, connect_timeout: dict
) -> None:
    """httpx's connect timeout, or (``connect_timeout_s`` past ``timeout_s``) the overall
    deadline striking while connecting, are both connect failures."""
    t = _CountingTransport()
    with backend(t, url=dropping_url, timeout_s=0.3, max_retries=1, **connect_timeout) as b:
        t0 = time.monotonic()
        with pytest.raises(LLMBackendError, match="connect timed out after 2 tries"):
            b.generate(batch(8))
        elapsed = time.monotonic() - t0
        assert t.calls == 2 and b.breaker.state == "open"
        with pytest.raises(LLMBackendError, match="unreachable"):
            b.generate(batch(8))
        assert t.calls == 2
    assert elapsed < 3.0  # two 0.3 s connects, not 8 requests' worth in sequence

"""A real uvicorn server in a thread with an httpx client bound to it: the HTTP tests' harness
(and a fake engine process for the worker's channel to it)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.server.app import create_app
from memoryos_gpu.server.settings import ServerSettings

KEY_A, KEY_B = "key-acme-0123456789", "key-beta-9876543210"
KEY_ADMIN = "key-admin-5555555555"
KEYS = {KEY_A: "acme", KEY_B: "beta"}
ADMIN_KEYS = {**KEYS, KEY_ADMIN: "*"}  # an admin key: server-wide /v1/stats, nothing else
HA = {"Authorization": f"Bearer {KEY_A}"}
HB = {"Authorization": f"Bearer {KEY_B}"}
HADMIN = {"Authorization": f"Bearer {KEY_ADMIN}"}
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(
    proc: Any, base: str, said: Callable[[], str], timeout: float = 60, every: float = 0.05
) -> None:
    """Until the server subprocess ``proc`` at ``base`` answers ``/ready`` 200; fails with
    ``said()`` (its log, say) when it exits first or the ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, said()
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(every)
    raise AssertionError(f"not ready: {said()}")


def hashing(store: Path | str = ":memory:", **kw: Any) -> EngineConfig:
    return EngineConfig(embedder="hashing", store=str(store), auto_process=False, **kw)


@contextmanager
def running(app: Any) -> Iterator[tuple[int, uvicorn.Server]]:
    """An ASGI app on a real uvicorn server in a thread, started within 30 s; yields its port
    and the server, stopped (and its thread joined) on exit."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


@contextmanager
def serve(
    source: Any,
    *,
    keys: dict[str, str] | None = KEYS,
    wait_ready: bool = True,
    **settings: Any,
) -> Iterator[httpx.Client]:
    """The app over ``source`` (:func:`running`); yields an httpx client bound to it."""
    app = create_app(source, api_keys=keys, settings=ServerSettings(**settings), use_env_keys=False)
    with running(app) as (port, server):
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        client.app = app  # type: ignore[attr-defined]
        client.server = server  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        try:
            if wait_ready:
                while client.get("/ready").status_code != 200:
                    assert time.monotonic() < deadline, client.get("/ready").json()
                    time.sleep(0.02)
            yield client
        finally:
            client.close()


@asynccontextmanager
async def fake_engine(
    address: str, answer: Callable[[str, tuple[Any, ...]], tuple[bool, Any]]
) -> AsyncIterator[Any]:
    """An ``EngineClient`` connected to a fake engine process at ``address`` (``ipc://...``):
    a ROUTER socket answering each message's requests ``(id, method, args, kwargs)`` with
    ``answer(method, args) -> (ok, value)``, all of a message's answers in one message, as the
    engine process does. Yields the client once its socket has connected (a request of
    method ``"x"`` with argument 0 must answer 0)."""
    import zmq
    import zmq.asyncio

    from memoryos_gpu.server.ipc import EngineClient, EngineGone, dump, load

    ctx = zmq.asyncio.Context()
    engine = ctx.socket(zmq.ROUTER)
    engine.bind(address)

    async def serve_requests() -> None:
        while True:
            ident, payload = await engine.recv_multipart()
            out = [(rid, *answer(method, args)) for rid, method, args, _kw in load(payload)]
            await engine.send_multipart([ident, dump(out)])

    server = asyncio.get_running_loop().create_task(serve_requests())
    client = EngineClient(address)
    client.start()
    try:
        while True:  # until the client's socket has connected
            with contextlib.suppress(EngineGone):
                assert await client.request("x", 0) == 0
                break
            await asyncio.sleep(0.01)
        yield client
    finally:
        server.cancel()
        await client.close()
        engine.close(0)
        ctx.term()

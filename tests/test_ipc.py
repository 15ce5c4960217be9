"""The worker-engine channel's socket (:class:`memoryos_gpu.server.ipc.LoopSocket`).

ZeroMQ's descriptor is edge-triggered: a reader that stops before the socket is empty never
hears of the waiting messages again and the server stalls. These tests push bursts with answers
sent from inside the receive callback and from later loop iterations (the engine's patterns),
and require every message back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")

from memoryos_gpu.server.ipc import LoopSocket  # noqa: E402

Handler = Callable[[list[bytes]], None]


@contextlib.asynccontextmanager
async def _pair(
    tmp_path: Path, on_router: Handler, on_dealer: Handler
) -> AsyncIterator[tuple[LoopSocket, LoopSocket]]:
    """An engine-side ROUTER and a worker-side DEALER, connected and reading."""
    ctx = zmq.Context()
    router = LoopSocket(ctx, zmq.ROUTER, on_router)
    dealer = LoopSocket(ctx, zmq.DEALER, on_dealer)
    router.sock.bind(f"ipc://{tmp_path}/chan.sock")
    dealer.sock.connect(f"ipc://{tmp_path}/chan.sock")
    router.start()
    dealer.start()
    try:
        yield router, dealer
    finally:
        dealer.close()
        router.close()
        ctx.term()


async def _until(cond: Callable[[], bool], seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)


def test_every_message_of_interleaved_bursts_comes_back(tmp_path: Path) -> None:
    """Answers sent from inside the read callback, bursts of 40 requests: a wake-up that read
    one message only would leave the rest unread (checked: this test then fails)."""
    bursts, per_burst = 50, 40

    async def go() -> list[bytes]:
        got: list[bytes] = []
        done = asyncio.get_running_loop().create_future()

        def collect(frames: list[bytes]) -> None:
            got.append(frames[-1])
            if len(got) == bursts * per_burst and not done.done():
                done.set_result(None)

        def echo(frames: list[bytes]) -> None:
            router.send([frames[0], b"re:" + frames[1]])

        async with _pair(tmp_path, echo, collect) as (router, dealer):
            for b in range(bursts):
                for i in range(per_burst):
                    dealer.send([f"{b}.{i}".encode()])
                await asyncio.sleep(0)  # let some answers arrive between bursts
            await asyncio.wait_for(done, 10)
        return got

    got = asyncio.run(go())
    want = {f"re:{b}.{i}".encode() for b in range(bursts) for i in range(per_burst)}
    assert len(got) == len(want) and set(got) == want


def test_a_paused_socket_reads_nothing_but_still_sends(tmp_path: Path) -> None:
    """What the engine process does at shutdown: no new requests, the admitted ones answered."""

    async def go() -> tuple[list[bytes], list[bytes]]:
        seen: list[list[bytes]] = []
        back: list[bytes] = []
        async with _pair(tmp_path, seen.append, lambda f: back.append(f[-1])) as (router, dealer):
            dealer.send([b"first"])
            await _until(lambda: bool(seen))
            router.pause()
            dealer.send([b"after pause"])
            await asyncio.sleep(0.1)
            router.send([seen[0][0], b"answer"])
            await _until(lambda: bool(back))
        return [f[1] for f in seen], back

    seen, back = asyncio.run(go())
    assert seen == [b"first"]  # the message sent after the pause was not read
    assert back == [b"answer"]


def test_ping_pong_answered_from_a_later_loop_iteration(tmp_path: Path) -> None:
    """The serving pattern: the engine answers from a later loop iteration (``call_soon``, as
    ``EngineServer._post`` flushes), the worker sends its next request from the answer's
    callback, two in flight: any message the reader missed would stop the exchange (libzmq
    says a send can use up the descriptor's edge, hence :meth:`LoopSocket.send`'s re-check;
    this test did not catch its absence on Linux in three runs)."""

    total = 3000

    async def go() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        sent, answered = [0], [0]

        def send() -> None:
            sent[0] += 1
            dealer.send([b"next"])

        def engine(frames: list[bytes]) -> None:
            loop.call_soon(router.send, [frames[0], frames[1]])

        def worker(frames: list[bytes]) -> None:
            answered[0] += 1
            if sent[0] < total:
                send()
            elif answered[0] == total:
                done.set_result(None)

        async with _pair(tmp_path, engine, worker) as (router, dealer):
            for _ in range(2):  # two in flight: arrivals overlap the sends
                send()
            await asyncio.wait_for(done, 20)
            await asyncio.sleep(0.05)  # an answer nobody asked for would land here
        return sent[0], answered[0]

    # Every request answered once: the exchange stops only when the last answer came back.
    assert asyncio.run(go()) == (total, total)

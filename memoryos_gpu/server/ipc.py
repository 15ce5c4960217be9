"""The local channel between the HTTP workers and the engine process of ``serve --workers``.

ZeroMQ: each worker's :class:`EngineClient` is a DEALER socket connected to the engine
process's ROUTER socket on an ``ipc://`` path. A request is ``(id, method, args, kwargs)``, its
answer ``(id, ok, value)``; a worker keeps any number of requests in flight at once (its
socket's read callback matches answers to waiting futures), so the engine process sees every
worker's concurrent requests at the same time and its micro-batchers gather them into one
kernel pass. Both sides send what one event-loop iteration produced as one message (a list):
under load a message carries many requests or answers, so the per-message cost of crossing
processes (system calls, wake-ups of ZeroMQ's I/O threads) is shared by them.

Why plain sockets on the loop's reader callback (:class:`LoopSocket`) and not
``zmq.asyncio``: its sockets keep a future per receive and put every event mask through Python
``enum.Flag`` operators; under load that machinery was ~11 % of the engine process's
interpreter time (the process that bounds ``serve --workers``), and a ROUTER answering pickled
batches spent 1.8x the CPU a message that :class:`LoopSocket` spends
(``benchmarks/ipc_channel.py``; benchmarks/README.md, "Serving over worker processes").

Why pickle and not msgpack: the payloads are the engine's own objects (``PageInput``,
``Retrieval`` with its page dataclasses, ``AddResult``, rows holding numpy values, configs) and
its exceptions; msgpack would need a hand-written codec for each, pickle is C code that already
knows them all. Both ends are processes of one server, started by one supervisor, on a socket
file inside a directory only the server's user can open (mode 0700), so nothing another party
wrote is ever unpickled. Exceptions travel as
:class:`~memoryos_gpu.distributed.ray_common.BoxedError` (type, message, simple attributes)
and are raised again as their own type, so the HTTP error mapping answers exactly as in the
single process.
"""

from __future__ import annotations

import asyncio
import collections
import copyreg
import dataclasses
import io
import itertools
import logging
import operator
import pickle
import threading
from collections.abc import Callable
from typing import Any

import zmq

from memoryos_gpu.distributed.ray_common import BoxedError
from memoryos_gpu.engine.validation import InvalidInputError
from memoryos_gpu.server.batching import Unavailable
from memoryos_gpu.types import KnowledgeEntry, Retrieval, RetrievedPage

__all__ = ["EngineClient", "EngineGone", "LoopSocket", "dump", "load"]

#: Outstanding messages a socket buffers before a send would block (ZeroMQ's default is 1000):
#: far above what the bounded queues of the engine admit, so a send never waits for room.
HWM = 1_000_000
# plain ints: pyzmq's constants are enum flags, whose operators run in Python
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

log = logging.getLogger("memoryos_gpu.server")


#: A request as it travels: ``(id, method, args, kwargs)``.
_Request = tuple[int, str, tuple[Any, ...], dict[str, Any]]


def _by_fields(cls: type) -> Callable[[Any], tuple[type, tuple[Any, ...]]]:
    get = operator.attrgetter(*(f.name for f in dataclasses.fields(cls)))
    return lambda obj: (cls, get(obj))


#: Slotted dataclasses pickle through a Python-level ``__getstate__`` that calls
#: ``dataclasses.fields`` for every object (a retrieval holds ~17): sent as their fields'
#: tuple instead (C attrgetter; rebuilt by the constructor), pickling costs a fraction.
_DISPATCH = collections.ChainMap(
    {cls: _by_fields(cls) for cls in (Retrieval, RetrievedPage, KnowledgeEntry)},
    copyreg.dispatch_table,
)


def dump(obj: Any) -> bytes:
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(obj)
    return buf.getvalue()


def load(data: bytes) -> Any:
    return pickle.loads(data)  # our own engine process, over a 0700 socket dir


class LoopSocket:
    """A ZeroMQ socket driven by the running event loop: ``on_message(frames)`` is called, on
    the loop's thread, for every message that arrives; :meth:`send` never blocks.

    ZeroMQ's descriptor (``zmq.FD``) is edge-triggered and only says that the socket's events
    may have changed, so a wake-up reads messages until ``zmq.EVENTS`` says none is waiting,
    and so does the loop iteration after every send (a send can take in arrived messages and
    use up the edge that would have announced them; the sends of one iteration share that one
    re-check). All calls on the loop's thread (a ZeroMQ socket is not thread-safe)."""

    def __init__(self, ctx: zmq.Context, kind: int, on_message: Callable[[list[bytes]], None]):
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self._on_message = on_message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = self.sock.getsockopt(zmq.FD)
        self._reading = False
        self._drain_due = False  # a _drain is scheduled for the loop's next iteration

    def start(self) -> None:
        """Read on the running loop (messages that came before are read at once too)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._reading = True
        self._schedule_drain()

    def pause(self) -> None:
        """Stop reading (what arrives stays queued in the socket); sending goes on."""
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._reading = False

    def _schedule_drain(self) -> None:
        if self._reading and not self._drain_due and self._loop is not None:
            self._drain_due = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_due = False
        sock = self.sock
        while self._reading and sock.getsockopt(_EVENTS) & _POLLIN:
            frames = sock.recv_multipart(_NOBLOCK)
            try:
                self._on_message(frames)
            except Exception:  # one bad message must not leave the others unread
                log.exception("a message on %s could not be handled", self.sock)

    def send(self, frames: list[bytes]) -> None:
        """Queue a message without waiting; raises ``zmq.Again`` when it cannot be queued
        (a DEALER with ``IMMEDIATE`` and no peer connected, a full queue)."""
        try:
            self.sock.send_multipart(frames, _NOBLOCK)
        finally:
            self._schedule_drain()

    def close(self) -> None:
        self.pause()
        self.sock.close(0)


class EngineGone(Unavailable):
    """The engine process went away while a request waited for it (or none runs now): whether
    a write in flight was committed is unknown to the worker, so the client retries (503)."""


class EngineClient:
    """One worker's connection to the engine process: pipelined async requests.

    ``request`` is for the event loop; ``request_sync`` is for worker threads (the mem0 verbs
    run in a thread and call engine methods one by one)."""

    def __init__(self, address: str, retry_after: int = 1) -> None:
        self.address = address
        self.retry_after = retry_after
        self._ctx = zmq.Context()
        self._sock = LoopSocket(self._ctx, zmq.DEALER, self._answers)
        # queue only to a connected engine: a request sent while none runs fails at once
        # instead of waiting in the socket and reaching the next engine after its client gave up
        self._sock.sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.sock.connect(address)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._outbox: list[_Request] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._sock.start()

    def _answers(self, frames: list[bytes]) -> None:
        """One message of answers from the engine process: each to its waiting future."""
        for rid, ok, value in load(frames[-1]):
            fut = self._pending.pop(rid, None)
            if fut is None or fut.done():  # the caller gave up (client gone, engine restarted)
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value.exception() if isinstance(value, BoxedError) else value)

    async def request(self, method: str, *args: Any, **kw: Any) -> Any:
        """Send one request and wait for its answer (the engine's exception is raised here)."""
        assert self.loop is not None, "EngineClient.start() first"
        rid = next(self._ids)
        fut = self.loop.create_future()
        self._pending[rid] = fut
        self._outbox.append((rid, method, args, kw))
        if len(self._outbox) == 1:
            self.loop.call_soon(self._flush)
        try:
            return await fut
        finally:
            self._pending.pop(rid, None)

    def _flush(self) -> None:
        """Send what this loop iteration's requests queued, as one message: under load that is
        one ZeroMQ message (one wake-up of each side) for many requests.

        When the batch does not pickle, each request goes as its own message and one that
        cannot be pickled fails alone (:meth:`_one_by_one`); a send that fails fails the
        requests of its message (:class:`EngineGone`). Why: any exception but ``zmq.Again``
        used to drop the whole batch -- every request of the loop iteration, of any tenant --
        with nothing answered, and their clients waited until the server stopped (one page
        whose meta nested ~500 deep did it)."""
        batch, self._outbox = self._outbox, []
        try:
            messages = [(batch, dump(batch))]
        except Exception:  # a request pickle cannot carry (nested past the stack, ...)
            messages = self._one_by_one(batch)
        for sent, data in messages:
            try:
                self._sock.send([data])
            except zmq.Again:  # no engine process connected (restarting)
                self._fail(sent, "the engine process is not running (restarting); retry")
            except Exception as exc:  # the socket failed (closed, context ended): not sent
                log.warning("a message to the engine process could not be sent: %r", exc)
                self._fail(sent, f"the request could not be sent to the engine process: {exc}")

    def _one_by_one(self, batch: list[_Request]) -> list[tuple[list[_Request], bytes]]:
        """A message for each request of ``batch`` that pickles; each other one's caller gets
        the error: :class:`InvalidInputError` (a 422) for one nested past the interpreter's
        recursion limit -- only a client's data nests so deep -- else the pickling error
        itself (a server bug: a 500, logged)."""
        messages: list[tuple[list[_Request], bytes]] = []
        for request in batch:
            try:
                messages.append(([request], dump([request])))
            except Exception as exc:
                fut = self._pending.pop(request[0], None)
                if fut is None or fut.done():
                    continue
                if isinstance(exc, RecursionError):
                    exc = InvalidInputError(
                        f"the request to {request[1]!r} is nested too deeply to pass to the "
                        "engine process (objects and arrays within one another): flatten it"
                    )
                fut.set_exception(exc)
        return messages

    def _fail(self, batch: list[_Request], why: str) -> None:
        """Fail each request of ``batch`` that still waits with :class:`EngineGone` (a 503)."""
        for rid, *_ in batch:
            fut = self._pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(EngineGone(why, self.retry_after))

    def request_sync(self, method: str, *args: Any, timeout: float | None = None, **kw: Any) -> Any:
        """:meth:`request` from a thread other than the event loop's."""
        assert self.loop is not None, "EngineClient.start() first"
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError(f"{method}: a blocking engine call on the event loop; await it")
        return asyncio.run_coroutine_threadsafe(
            self.request(method, *args, **kw), self.loop
        ).result(timeout)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def fail_all(self, message: str) -> int:
        """Fail every waiting request with :class:`EngineGone` (the engine process died: its
        answers will never come). Returns how many there were."""
        waiting = [f for f in self._pending.values() if not f.done()]
        for fut in waiting:
            fut.set_exception(EngineGone(message, self.retry_after))
        self._pending.clear()
        return len(waiting)

    async def close(self) -> None:
        self.fail_all("the worker is shutting down")
        self._sock.close()  # stops reading first
        self._ctx.term()

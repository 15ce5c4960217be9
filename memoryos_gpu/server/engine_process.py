"""The engine process of ``serve --workers``: the real serving core behind the IPC channel.

One process per device runs :class:`~memoryos_gpu.server.service.MemoryService` (the engine,
its micro-batching queues, the derived-work thread) exactly as the single-process server does,
and answers the HTTP workers' requests from a ZeroMQ ROUTER socket
(:mod:`memoryos_gpu.server.ipc`). Every request becomes a task on this process's event loop, so
the retrievals and writes that all workers have in flight at a moment meet in the same queues
and leave in one ``retrieve_many`` / ``add_many`` call.

Guarantees kept across processes because they live here, in the one place every request
passes: an add is answered after its commit; ``wait_for_user`` sees every worker's queued
writes of the user; the tenant write-queue shares and the queue bounds are global; SIGTERM
(sent by the supervisor once the workers have stopped) drains every queue, finishes the derived
work and closes the store. SIGINT and SIGHUP are ignored: a Ctrl-C or a closed terminal's
SIGHUP reaches the whole process group, and the engine must outlive the workers that are still
answering their last requests (the supervisor stops it after them). A SIGTERM to the whole group
(systemd's ``KillMode=control-group``, ``timeout``, ``kill -TERM -PGID``) is not yet the
supervisor's word either: the engine goes on serving until the supervisor says the workers have
stopped (:func:`_on_sigterm`). The kernel sends
the same SIGTERM if the supervisor dies without stopping it (SIGKILL;
:mod:`memoryos_gpu.parent_death`), so no orphan keeps the store's writer claim.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import zmq

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.ray_common import BoxedError
from memoryos_gpu.log_setup import announce_loaded, setup_logging
from memoryos_gpu.server.batching import Unavailable
from memoryos_gpu.server.ipc import LoopSocket, dump, load
from memoryos_gpu.server.scope import with_known
from memoryos_gpu.server.service import MemoryService
from memoryos_gpu.server.settings import ServerSettings

__all__ = ["serve_engine"]

log = logging.getLogger("memoryos_gpu.server")
Handler = Callable[..., Awaitable[Any]]


def serve_engine(spec: dict[str, Any]) -> None:
    """Process entry point (``multiprocessing`` spawn target): serve until SIGTERM.

    ``spec``: ``config`` (the :class:`EngineConfig` itself, its key included), ``settings``
    (ServerSettings fields), ``address`` (the ``ipc://`` endpoint to bind), ``log_level``,
    ``argv`` (the command line the store's writer lock shows), ``shard`` (``[i, K]`` with
    ``--engines K``, else absent), ``parent`` (the supervisor's pid: its death is a SIGTERM
    here; absent: not watched), ``workers_gone`` (a shared flag the supervisor sets once its
    workers have stopped, before its SIGTERM; absent: any SIGTERM stops at once). A SIGTERM
    before the event loop handles it ends the process by default, which is harmless then:
    nothing is open yet."""
    from memoryos_gpu.parent_death import die_with_parent

    if spec.get("parent"):
        die_with_parent(int(spec["parent"]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # the store's writer lock records the command line: the server's, not multiprocessing's
    sys.argv = list(spec.get("argv") or sys.argv)
    shard = spec.get("shard")
    setup_logging(spec.get("log_level", "info"), tag=f"engine {shard[0]}" if shard else "engine")
    try:
        import uvloop

        uvloop.run(_serve(spec))
    except ImportError:  # pragma: no cover - uvloop is in the server extra
        asyncio.run(_serve(spec))


async def _serve(spec: dict[str, Any]) -> None:
    from memoryos_gpu.server.metrics import ServerMetrics

    stop = asyncio.Event()
    config = _config(spec["config"])
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, _on_sigterm(spec, stop, config.shutdown_drain_s)
    )
    metrics = ServerMetrics()
    service = MemoryService(
        _engine(config, spec.get("shard")), ServerSettings(**spec["settings"]), metrics=metrics
    )
    ctx = zmq.Context()
    server = EngineServer(service, ctx, spec["address"])
    started = time.monotonic()
    await service.start(wait=False)  # answers "starting" while the store loads
    announcing = asyncio.get_running_loop().create_task(announce_loaded(service, log, started))
    server.sock.start()
    await stop.wait()
    announcing.cancel()
    log.info("engine process: draining the queues and finishing derived work")
    server.refuse_new(service.settings.retry_after_s)  # those admitted are still answered
    await service.close()
    await server.finish()
    metrics.close()
    server.sock.close()
    ctx.term()
    # the last line says what the close left (N derived items pending), as a single-process
    # server's does: under --workers only this process knows it
    log.info("engine process: %s", service.closed_message)


def _on_sigterm(spec: dict[str, Any], stop: asyncio.Event, wait_s: float) -> Callable[[], None]:
    """The SIGTERM handler: ``stop`` set at once when the SIGTERM is the supervisor's (sent
    once its workers have stopped: ``spec["workers_gone"]`` is set), when the supervisor is
    gone (the kernel's parent-death SIGTERM) or when no supervisor watches this process.

    Otherwise the SIGTERM went to the whole process group (systemd's default
    ``KillMode=control-group``, ``timeout``, ``kill -TERM -PGID``): the workers got it at the
    same moment and are answering their requests in flight, which this process must serve;
    stopping at once answered them 503 "the engine process is stopping". So it goes on
    serving until the supervisor, which got the signal too, has stopped the workers and
    sends its own SIGTERM, for at most ``wait_s`` (``shutdown_drain_s``: a SIGTERM sent to
    this process alone stops it then), and then stops as always."""
    parent, gone = spec.get("parent"), spec.get("workers_gone")
    waiting = False

    def on_sigterm() -> None:
        nonlocal waiting
        if stop.is_set():
            return
        if not parent or gone is None or gone.value or os.getppid() != int(parent):
            stop.set()
        elif not waiting:
            waiting = True
            log.info(
                "engine process: SIGTERM while the supervisor runs (the process group's?): "
                "serving the workers until they have stopped (at most %g s)",
                wait_s,
            )
            asyncio.get_running_loop().call_later(wait_s, stop.set)

    return on_sigterm


def _config(config: EngineConfig) -> EngineConfig:
    """The engine's config, its derived work run by the service's thread (not inside adds).
    Only the config object itself is taken: a dump (a JSON one) carries the store key as
    ``**********``, and the engine would encrypt a new store under that."""
    if not isinstance(config, EngineConfig):
        raise TypeError(f"the engine spec's config must be an EngineConfig, not {type(config)}")
    return config.model_copy(update={"auto_process": False})


def _engine(config: EngineConfig, shard: Sequence[int] | None) -> Any:
    """What the service opens: the config's engine, or with ``shard`` = (i, K) the engine of
    shard i of K (``serve --engines K``: the users it owns, the assistant-fact outbox and the
    keyword exchange that the workers' router syncs, :mod:`memoryos_gpu.server.shard_router`)."""
    if shard is None:
        return config
    from memoryos_gpu.distributed.sharding import ShardEngine

    index, count = shard
    return lambda: ShardEngine(config, shard=index, count=count)


def _picklable(answer: tuple[int, bool, Any]) -> tuple[int, bool, Any]:
    """``answer``, or an error saying why it cannot travel."""
    try:
        dump(answer)
        return answer
    except Exception as exc:
        return (answer[0], False, BoxedError.of(exc))


class EngineServer:
    """Answers requests from the workers: one task per request, answer sent when it is done."""

    def __init__(self, service: MemoryService, ctx: zmq.Context, address: str) -> None:
        self.service = service
        self.sock = LoopSocket(ctx, zmq.ROUTER, self.on_message)  # read once started
        self.sock.sock.bind(address)
        self.tasks: set[asyncio.Task] = set()
        self.outbox: dict[bytes, list[tuple[int, bool, Any]]] = {}
        self.refusal: BoxedError | None = None  # set by refuse_new: the answer to new requests
        s = service
        self.handlers: dict[str, Handler] = {
            "add_pages": s.add_pages,
            "retrieve": self.retrieve,
            "respond": self.respond,
            "call": self.call,
            "delete_user": s.delete_user,
            "wait_for_user": s.wait_for_user,
            "known": s.known,
            "users": s.users,
            "status": self.status,
        }

    def refuse_new(self, retry_after: int) -> None:
        """From now on (the process is stopping) answer every request that arrives with
        ``Unavailable`` (the worker's 503 + Retry-After) instead of starting it.

        Why not stop reading: on a normal shutdown the workers have stopped before this
        process is told to, but when the supervisor is killed outright the kernel stops the
        workers and this process at once (:mod:`memoryos_gpu.parent_death`), and a request a
        worker sent to an engine that no longer reads hung until the worker's graceful
        shutdown gave up on it (a 500)."""
        self.refusal = BoxedError.of(
            Unavailable("the engine process is stopping; retry", retry_after)
        )

    def on_message(self, frames: list[bytes]) -> None:
        """One worker's message: its requests, each started at once (on the loop's thread),
        or each refused once the process is stopping (:meth:`refuse_new`)."""
        ident, payload = frames
        if self.refusal is not None:
            for request in load(payload):
                self._post(ident, (request[0], False, self.refusal))
            return
        loop = asyncio.get_running_loop()
        for request in load(payload):
            if request[1] == "retrieve_body":  # the hot path: no task of its own
                self._retrieve_body(ident, request[0], *request[2])
                continue
            task = loop.create_task(self.answer(ident, *request))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def finish(self) -> None:
        """Wait for the answers still being computed (after the queues were drained)."""
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the drained retrievals' callbacks
        self._flush()

    async def answer(
        self, ident: bytes, rid: int, method: str, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> None:
        try:
            handler = self.handlers.get(method)
            if handler is None:
                raise ValueError(f"unknown engine request {method!r}")
            out = (rid, True, await handler(*args, **kw))
        except Exception as exc:
            out = (rid, False, BoxedError.of(exc))
        self._post(ident, out)

    def _retrieve_body(
        self,
        ident: bytes,
        rid: int,
        user_id: str,
        query: str,
        top_pages: int | None,
        top_segments: int | None,
    ) -> None:
        """A worker's retrieval, answered as its route's JSON from the callback of the batch it
        joins, the engine writing the JSON for the whole batch (``retrieve_many(...,
        as_json=True)``): a retrieval is most of what the workers send, and a task, a pickled
        ``Retrieval`` (~170 objects) and its unpickling in the worker cost more than the
        engine's own work for it."""
        try:
            fut = self.service.enqueue_retrieval(user_id, query, top_pages, top_segments, True)
        except Exception as exc:
            self._post(ident, (rid, False, BoxedError.of(exc)))
            return
        fut.add_done_callback(lambda f: self._body_done(ident, rid, user_id, f))

    def _body_done(self, ident: bytes, rid: int, user_id: str, fut: asyncio.Future) -> None:
        try:
            known = self.service.is_known(user_id)
            out = (rid, True, (with_known(fut.result(), known), known))
        except (Exception, asyncio.CancelledError) as exc:
            out = (rid, False, BoxedError.of(exc))
        self._post(ident, out)

    def _post(self, ident: bytes, out: tuple[int, bool, Any]) -> None:
        """Queue an answer for its worker; the loop's next iteration sends them all."""
        box = self.outbox.setdefault(ident, [])
        box.append(out)
        if len(self.outbox) == 1 and len(box) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """One message per worker for the answers of this loop iteration."""
        boxes, self.outbox = self.outbox, {}
        for ident, answers in boxes.items():
            try:
                data = dump(answers)
            except Exception:  # one answer pickle cannot carry: the others still go
                data = dump([_picklable(a) for a in answers])
            try:
                self.sock.send([ident, data])
            except zmq.Again:  # the worker's queue is full (it is stuck or gone)
                log.warning("engine process: %d answers for a worker dropped", len(answers))
            except Exception as exc:  # one worker's failed send must not skip the others'
                log.warning(
                    "engine process: %d answers for a worker not sent: %r", len(answers), exc
                )

    async def retrieve(
        self, user_id: str, query: str, top_pages: int | None, top_segments: int | None
    ) -> tuple[Any, bool]:
        """The retrieval, and whether the user is known (the worker's ``known_user``)."""
        r = await self.service.retrieve(
            user_id, query, top_pages=top_pages, top_segments=top_segments
        )
        return r, self.service.is_known(user_id)

    async def respond(self, user_id: str, query: str, timestamp: Any) -> Any:
        return await self.service.respond(user_id, query, timestamp=timestamp)

    async def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An engine method by dotted name (``store.user_row``), on the service's executor."""
        target: Any = self.service.engine
        if target is None:
            self.service.check_ready()
        for part in name.split("."):
            if part.startswith("_"):
                raise ValueError(f"engine call {name!r}: private names are not served")
            target = getattr(target, part)
        return await self.service.call(target, *args, **kwargs)

    async def status(self) -> dict[str, Any]:
        """What the workers cache: lifecycle state, queue statistics, gauges, the config."""
        return await self.service.status()

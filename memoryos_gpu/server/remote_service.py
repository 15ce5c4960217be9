"""The worker side of ``serve --workers``: the service interface of the HTTP app, forwarded.

:class:`RemoteService` has the methods of :class:`~memoryos_gpu.server.service.MemoryService`
that the routes call (``create_app(service=...)``, as the Ray Serve router does): each one is
one request to the engine process over :class:`~memoryos_gpu.server.ipc.EngineClient`. What the
routes read synchronously (lifecycle state, queue statistics, the config, the gauges of
``/metrics``) comes from a status snapshot the worker refreshes in the background (every 0.5 s
while ready, every 50 ms while not); the membership checks that must see other workers' writes
are the awaited :meth:`RemoteService.known` / :meth:`RemoteService.users`, answered by the
engine process.

The engine process's pid, published by the supervisor in shared memory, is the liveness
signal: when it changes (0 while the engine restarts), every request in flight fails with
:class:`~memoryos_gpu.server.ipc.EngineGone` (503 + Retry-After: its answer will never come) and
the worker reports not-ready until the new engine process has reopened the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from memoryos_gpu.parent_death import running
from memoryos_gpu.server.batching import check_state
from memoryos_gpu.server.ipc import EngineClient, EngineGone
from memoryos_gpu.server.scope import done_writing
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval

__all__ = ["RemoteService"]

log = logging.getLogger("memoryos_gpu.server")
READY_REFRESH_S = 0.5
STARTING_REFRESH_S = 0.05
FRESH_S = 0.1  # a snapshot younger than this is fresh enough for a scrape
REFRESH_TIMEOUT_S = 5.0  # the watcher's status request, unanswered: the engine is stuck or gone
CONFIRM_S = 1.0  # how long a request waits for the engine's word that it is ready


class _Remote:
    """An engine method in the engine process, by dotted name (``store.user_row``): its
    attributes are the names below it."""

    def __init__(self, service: RemoteService, name: str) -> None:
        self._service, self.name = service, name

    def __getattr__(self, name: str) -> _Remote:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Remote(self._service, f"{self.name}.{name}" if self.name else name)

    async def acall(self, *args: Any, **kw: Any) -> Any:
        return await self._service.client.request("call", self.name, args, kw)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        """Blocking call, from a worker thread (the mem0 verbs run in one)."""
        return self._service.client.request_sync("call", self.name, args, kw)


class _RemoteEmbedder(_Remote):
    """``engine.embedder``: ``encode`` is a remote call, ``dim`` a value of the snapshot."""

    @property
    def dim(self) -> int:
        return int(self._service.snapshot().get("embedder_dim", 0))


class _LLMStats:
    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats

    def as_dict(self) -> dict[str, Any]:
        return dict(self._stats)


class _Stages:
    def __init__(self, stats: dict[str, Any]) -> None:
        self.stats = _LLMStats(stats)


class RemoteEngine(_Remote):
    """``service.engine`` in a worker: methods are remote calls; the attributes the routes
    and the metrics read (config, memory, counters, LLM statistics, pending work) come from
    the status snapshot."""

    def __init__(self, service: RemoteService) -> None:
        super().__init__(service, "")
        self.embedder = _RemoteEmbedder(service, "embedder")

    @property
    def config(self) -> Any:
        return self._service.snapshot().get("config")

    @property
    def memory(self) -> Any:
        return self._service.snapshot().get("memory")

    @property
    def counters(self) -> dict[str, Any]:
        return self._service.snapshot().get("counters") or {}

    @property
    def stages(self) -> _Stages | None:
        llm = self._service.snapshot().get("llm")
        return _Stages(llm) if llm is not None else None

    def pending_count(self, user_id: str | None = None) -> int:
        if user_id is None:
            return int(self._service.snapshot().get("pending", 0))
        return int(self._service.client.request_sync("call", "pending_count", (user_id,), {}))


class StatusPart:
    """An engine (a shard) as ``/metrics`` reads it, from the last status snapshot it sent
    (:meth:`~memoryos_gpu.server.service.MemoryService.status`): for a router that keeps its
    shards' statuses (``serve --ray``), as a worker's :class:`RemoteService` keeps its engine
    process's. Its state, queue depths, health, and the engine's counters and LLM statistics
    (:class:`RemoteEngine` over the snapshot); ``/v1/stats`` reads the first two per shard."""

    def __init__(self, status: dict[str, Any]) -> None:
        self._status = status
        self.engine = RemoteEngine(self)  # type: ignore[arg-type]  # reads snapshot() only

    def snapshot(self) -> dict[str, Any]:
        return self._status

    @property
    def state(self) -> str:
        return str(self._status.get("state", "unknown"))

    def queue_depths(self) -> dict[str, int]:
        return dict(self._status.get("depths", {}))

    def health(self) -> dict[str, Any]:
        runs = int(self._status.get("derived_runs", 0))
        return dict(
            self._status.get("health") or {"degraded": [], "llm": None, "derived_runs": runs}
        )


class RemoteService:
    """The HTTP app's service in a worker process: every engine request goes to the engine
    process. ``engine_pid``: returns the engine process's pid (0 while none runs)."""

    #: what this worker's shutdown did (the engine process logs its own drain and close)
    closed_message = "worker stopped; the engine process drains the queues and closes the store"

    def __init__(
        self,
        address: str,
        engine_pid: Callable[[], int],
        settings: ServerSettings | None = None,
        *,
        metrics: Any = None,
    ) -> None:
        self.address = address
        self.settings = settings or ServerSettings()
        self.metrics = metrics
        self._published_pid = engine_pid
        self._gone = 0  # an engine process seen dead while its pid is still published
        self.client = EngineClient(address, self.settings.retry_after_s)
        self.engine = RemoteEngine(self)
        self._status: dict[str, Any] = {"state": "starting"}
        self._status_at = 0.0
        self._local = "created"  # created -> running -> closing -> closed
        self._known: set[str] = set()
        self._user_writes: Counter[str] = Counter()
        self._watcher: asyncio.Task | None = None
        self._loop_thread: int | None = None
        self._restarting = False  # an engine process died; the next one is not ready yet
        self._confirming: asyncio.Future | None = None  # a status request ensure_ready awaits

    def _engine_pid(self) -> int:
        """The engine process's pid; 0 while none runs, also for one that died while its pid
        is still published (:meth:`_note_death`)."""
        pid = self._published_pid()
        return 0 if pid == self._gone else pid

    def _note_death(self) -> None:
        """Take a published engine pid whose process is gone for no engine. The supervisor
        unpublishes a dead engine itself, but not once it is dead too (SIGKILL): then its
        engine process and this worker stop at once, and the requests this worker sends
        after the engine has gone would wait out the graceful-shutdown timeout (500s)
        instead of failing with 503 + Retry-After as when the engine dies alone."""
        pid = self._published_pid()
        self._gone = pid if pid and not running(pid) else 0  # a pid used again runs again

    # ------------------------------------------------------------------ lifecycle
    async def start(self, *, wait: bool = True) -> None:
        if self._local != "created":
            return
        self._local = "running"
        self.client.start()
        self._loop_thread = threading.get_ident()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        while wait and self.state not in ("ready", "failed"):
            await asyncio.sleep(STARTING_REFRESH_S)

    async def close(self) -> None:
        """The worker's part of shutdown: its requests are answered (uvicorn waited for them);
        the engine process drains and closes the store after every worker has stopped."""
        if self._local in ("closing", "closed"):
            return
        self._local = "closing"
        for task in (self._watcher, self._confirming):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.client.close()
        self._local = "closed"

    async def _watch(self) -> None:
        """Follow the engine process: fail what is in flight when it goes, refresh the
        status snapshot (often while it is not ready, so readiness returns promptly).

        The refresh runs as a task of its own, never awaited here: a status request that the
        engine took with it when it died waited out its 5 s timeout, and the watcher with it,
        so for those seconds the worker answered ready for an engine that was gone (a flaky
        failure of the killed-engine test, ~1 run in 8)."""
        seen = None
        refreshing: asyncio.Task | None = None
        try:
            while True:
                self._note_death()
                pid = self._engine_pid()
                if pid != seen:
                    if seen:
                        n = self.client.fail_all(  # a status request in flight fails too
                            "the engine process stopped while this request was in flight; retry"
                        )
                        log.warning("engine process %s went away; %d request(s) failed", seen, n)
                        self._status, self._status_at = {"state": "starting"}, 0.0
                        self._restarting = True
                    seen = pid
                interval = (
                    READY_REFRESH_S if self._status.get("state") == "ready" else STARTING_REFRESH_S
                )
                idle = refreshing is None or refreshing.done()
                if pid and idle and time.monotonic() - self._status_at >= interval:
                    refreshing = asyncio.get_running_loop().create_task(
                        self._refresh_quietly(REFRESH_TIMEOUT_S)
                    )
                await asyncio.sleep(STARTING_REFRESH_S / 2)
        finally:
            if refreshing is not None:
                refreshing.cancel()

    async def _refresh_quietly(self, timeout: float) -> None:
        """:meth:`refresh`, giving up after ``timeout`` (the engine may have died holding the
        request) and keeping the old snapshot on any failure."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.refresh(), timeout)

    async def refresh(self) -> None:
        pid = self._engine_pid()
        self._store_status(await self.client.request("status"), pid)

    def _store_status(self, status: dict[str, Any], pid: int) -> None:
        """Keep ``status`` unless the engine process that was asked (``pid``) is gone: an
        answer that arrives after its engine died must not make the next one look ready."""
        if pid and self._engine_pid() == pid:
            self._status, self._status_at = status, time.monotonic()

    def snapshot(self) -> dict[str, Any]:
        """The status snapshot; refreshed first when called off the event loop (a /metrics
        scrape runs in a thread) and older than :data:`FRESH_S`."""
        off_loop = self._loop_thread is not None and threading.get_ident() != self._loop_thread
        if off_loop and self.ready and time.monotonic() - self._status_at > FRESH_S:
            pid = self._engine_pid()
            with contextlib.suppress(Exception):
                self._store_status(self.client.request_sync("status", timeout=2.0), pid)
        return self._status

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        if self._local != "running":
            return self._local
        if not self._engine_pid():
            return "starting"
        return str(self._status.get("state", "starting"))

    @property
    def error(self) -> str | None:
        return self._status.get("error")

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def check_ready(self) -> None:
        state = self.state
        if state == "ready":
            self._restarting = False
            return
        if state == "starting" and self._restarting:
            raise EngineGone(
                "the engine process is restarting (reopening the store); retry",
                self.settings.retry_after_s,
            )
        check_state(state, self.error, "the engine", self.settings.retry_after_s)

    async def ensure_ready(self) -> None:
        """:meth:`check_ready`, after asking the engine process when this worker's snapshot
        still says it is starting: the snapshot is refreshed every 50 ms until then, so the
        worker that answered ``/ready`` may have seen the engine ready first, and a request
        sent here just after must not get 503 for this worker's older view. The requests
        that arrive meanwhile share one status request."""
        if self.state == "starting" and self._engine_pid():
            if self._confirming is None or self._confirming.done():
                self._confirming = asyncio.ensure_future(self._refresh_quietly(CONFIRM_S))
            await asyncio.shield(self._confirming)
        self.check_ready()

    def queue_depths(self) -> dict[str, int]:
        return dict(self.snapshot().get("depths", {}))

    def batch_stats(self) -> dict[str, Any]:
        return dict(self.snapshot().get("batching", {}))

    @property
    def _derived_runs(self) -> int:
        return int(self._status.get("derived_runs", 0))

    def health(self) -> dict[str, Any]:
        """The engine process's :meth:`~memoryos_gpu.server.service.MemoryService.health`,
        from its status snapshot."""
        empty = {"degraded": [], "llm": None, "derived_runs": self._derived_runs}
        return dict(self.snapshot().get("health") or empty)

    @property
    def has_llm(self) -> bool:
        return bool(self._status.get("has_llm", False))

    def known_users(self) -> list[str]:
        """Users this worker has seen (a cache); :meth:`users` asks the engine process."""
        return sorted(self._known)

    def is_known(self, user_id: str) -> bool:
        return user_id in self._known

    async def known(self, user_id: str) -> bool:
        await self.ensure_ready()
        found = bool(await self.client.request("known", user_id))
        self._mark([user_id], found)
        return found

    async def users(self) -> list[str]:
        await self.ensure_ready()
        return list(await self.client.request("users"))

    def _mark(self, user_ids: Sequence[str] | set[str], known: bool) -> None:
        for u in user_ids:
            (self._known.add if known else self._known.discard)(u)

    def engine_for(self, user_id: str) -> RemoteEngine:
        return self.engine

    # ------------------------------------------------------------------ requests
    async def add_pages(self, pages: Sequence[PageInput]) -> list[AddResult]:
        await self.ensure_ready()
        users = Counter(p.user_id for p in pages)
        self._user_writes.update(users)
        try:
            results = await self.client.request("add_pages", list(pages))
        finally:
            done_writing(self._user_writes, users)
        self._mark({r.user_id for r in results}, True)
        return results

    async def retrieve(
        self,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
    ) -> Retrieval:
        await self.ensure_ready()
        r, known = await self.client.request("retrieve", user_id, query, top_pages, top_segments)
        self._mark([user_id], known)
        return r

    async def retrieve_body(
        self,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
    ) -> bytes:
        """The retrieval as its route's JSON, made in the engine process (the hot path)."""
        await self.ensure_ready()
        body, known = await self.client.request(
            "retrieve_body", user_id, query, top_pages, top_segments
        )
        self._mark([user_id], known)
        return body

    async def respond(
        self, user_id: str, query: str, *, timestamp: float | str | None = None
    ) -> Response:
        await self.ensure_ready()
        return await self.client.request("respond", user_id, query, timestamp)

    async def call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """An engine method (``service.engine.x`` / ``engine_for(u).store.y``) in the engine
        process; any other callable (a mem0 verb over this engine) in a worker thread."""
        await self.ensure_ready()
        if isinstance(fn, _Remote):
            out = await fn.acall(*args, **kw)
            if fn.name == "stats":  # /v1/stats: the queue statistics beside it are current
                await self.refresh()
            return out
        return await asyncio.to_thread(fn, *args, **kw)

    async def delete_user(self, user_id: str) -> bool:
        await self.ensure_ready()
        deleted = await self.client.request("delete_user", user_id)
        self._mark([user_id], False)
        return bool(deleted)

    async def wait_for_user(self, user_id: str, timeout: float = 10.0) -> dict[str, Any]:
        await self.ensure_ready()
        return await self.client.request("wait_for_user", user_id, timeout)

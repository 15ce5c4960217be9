"""``serve --workers N --engines K``: a worker's service over K engine processes, one per shard.

Why: with one engine process, that process does the engine's work for the whole box, and on a
many-core box it is the cap while the other cores idle (benchmarks/README.md). With
``--engines K`` the users are sharded over K engine processes by the hash of
:mod:`memoryos_gpu.distributed.layout` (one store per shard, ``STORE/shard-I``: the layout
``ingest --workers K`` writes, so a store ingested that way is served as it is). Each engine
process runs a :class:`~memoryos_gpu.distributed.sharding.ShardEngine` behind its own ZeroMQ
socket, and every HTTP worker sends each request to its user's engine: the router of
``serve --ray`` (:class:`~memoryos_gpu.distributed.ray_router.RouterService`) over the channels
of :class:`~memoryos_gpu.server.remote_service.RemoteService` instead of Ray handles.

What crosses shards works as it does on Ray: a batch of pages is split by shard and answered
in order; keyword statistics and assistant facts are exchanged by a sync loop (worker 0 runs
it; its first sync, or a worker's first deletion, first has the shards catch up on the keyword
statistics of the pages no exchange gave them, as a ``ShardedEngine`` does on open:
``RouterService._catch_up``); deleting a user or a page forgets what its pages taught the
assistants on every shard. A sync and a deletion take the *exchange lock*, here a file lock
(``flock``) in the server's private runtime directory that every worker shares
(:class:`ExchangeLock`): a deletion in one worker waits for the facts another worker's sync
has in flight, as in a single router; the kernel releases the lock of a worker that dies.

Per shard, failures stay per shard: an engine process that dies makes its users' requests fail
with 503 + Retry-After until it has reopened its store, while the other shards' users are
served (``/ready`` answers 503 while any engine is not ready). Membership (``known``,
``users``) is asked of the engines, so a worker sees the users that other workers added.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.layout import ShardMap
from memoryos_gpu.distributed.ray_router import DEFAULT_SYNC_S, RouterService
from memoryos_gpu.distributed.ray_routing import _Remote, add_by_shard
from memoryos_gpu.llm.breaker import CLOSED, HALF_OPEN, OPEN
from memoryos_gpu.server.remote_service import RemoteService, _Stages
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval

__all__ = ["ExchangeLock", "ShardedRemoteService"]

LOCK_POLL_S = 0.005


#: How bad each breaker state is, for the shards' worst (no breaker: 0).
_BREAKER_SEVERITY = {CLOSED: 1, HALF_OPEN: 2, OPEN: 3}


class ExchangeLock:
    """The exchange lock across worker processes: ``flock`` on ``path``, polled, so a waiter
    that is cancelled never takes the lock afterwards. A new one per acquisition: ``flock``
    excludes open files, so two holders in one process exclude each other too."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    async def __aenter__(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(LOCK_POLL_S)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    async def __aexit__(self, *exc: object) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the file releases the lock


class _EngineRouter(RouterService):
    """:class:`RouterService` over the engine processes' channels. Its caches (users, queue
    statistics) are not used: :class:`ShardedRemoteService` reads those from the engines."""

    def __init__(
        self,
        parts: list[RemoteService],
        settings: ServerSettings,
        lock_path: str,
        sync_interval_s: float | None,
    ) -> None:
        super().__init__(parts, EngineConfig(), settings, sync_interval_s=sync_interval_s)
        self.parts = parts
        self._lock_path = lock_path

    def _exchange_lock(self) -> ExchangeLock:
        return ExchangeLock(self._lock_path)

    async def ask(self, shard: int, method: str, *args: Any) -> Any:
        part = self.parts[shard]
        await part.ensure_ready()  # 503 + Retry-After while this shard's engine (re)starts
        return await part.client.request(method, *args)

    async def sync(self) -> dict[str, int]:
        """A sync only while every engine is up: one while an engine (re)starts would fail
        its calls to it (the facts would wait in their outboxes meanwhile, and the keyword
        deltas in the router), logging an error every interval for a restart."""
        for p in self.parts:
            p.check_ready()
        return await super().sync()

    async def refresh(self) -> None:
        """Nothing to cache: each part keeps its engine's status."""


class _ShardsEngine:
    """``service.engine`` in a worker over K engines: what the routes and the metrics read of
    it (per-user calls go through ``engine_for(user)``): ``stats`` merged over the shards, the
    gauges summed over the engines' status snapshots, the config of the first."""

    def __init__(self, service: ShardedRemoteService) -> None:
        self._service = service
        self.stats = _Remote(service.router, "stats", None)

    def _snapshots(self) -> list[dict[str, Any]]:
        return [p.snapshot() for p in self._service.parts]

    @property
    def config(self) -> Any:
        return self._service.parts[0].engine.config

    @property
    def memory(self) -> Any:
        return self._service.parts[0].engine.memory

    @property
    def embedder(self) -> Any:
        return self._service.parts[0].engine.embedder

    @property
    def counters(self) -> dict[str, Any]:
        total: Counter[str] = Counter()
        for s in self._snapshots():
            total.update(s.get("counters") or {})
        return dict(total)

    @property
    def stages(self) -> _Stages | None:
        llm = [s["llm"] for s in self._snapshots() if s.get("llm") is not None]
        if not llm:
            return None
        total: Counter[str] = Counter()
        for stats in llm:
            total.update({k: v for k, v in stats.items() if isinstance(v, int | float)})
        return _Stages(dict(total))

    def pending_count(self, user_id: str | None = None) -> int:
        if user_id is None:
            return sum(int(s.get("pending", 0)) for s in self._snapshots())
        return self._service.part(user_id).engine.pending_count(user_id)


class ShardedRemoteService:
    """The HTTP app's service in a worker over K engine processes (the module docstring).

    ``addresses[i]`` and ``engine_pids[i]``: engine ``i``'s socket and its pid getter (0 while
    it restarts); ``lock_path``: the exchange lock's file; ``sync``: whether this worker runs
    the sync loop (one worker does)."""

    closed_message = RemoteService.closed_message

    def __init__(
        self,
        addresses: Sequence[str],
        engine_pids: Sequence[Callable[[], int]],
        settings: ServerSettings | None = None,
        *,
        lock_path: str,
        sync: bool,
        sync_interval_s: float = DEFAULT_SYNC_S,
        metrics: Any = None,
    ) -> None:
        if len(addresses) < 2 or len(addresses) != len(engine_pids):
            raise ValueError("a sharded worker needs two or more engines, each with its pid")
        self.settings = settings or ServerSettings()
        self.metrics = metrics
        self.parts = [
            RemoteService(a, pid, self.settings)
            for a, pid in zip(addresses, engine_pids, strict=True)
        ]
        self.shard_map = ShardMap(len(self.parts))
        self.router = _EngineRouter(
            self.parts, self.settings, lock_path, sync_interval_s if sync else None
        )
        self.engine = _ShardsEngine(self)
        # what the routes read: writes in flight per user, over every part
        self._user_writes = collections.ChainMap(*(p._user_writes for p in self.parts))

    def part(self, user_id: str) -> RemoteService:
        return self.parts[self.shard_map.shard(user_id)]

    # ------------------------------------------------------------------ lifecycle
    async def start(self, *, wait: bool = True) -> None:
        for p in self.parts:
            await p.start(wait=False)
        await self.router.start(wait=True)  # no engine call: its refresh caches nothing
        while wait and self.state not in ("ready", "failed"):
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """The router's last sync (worker 0's), then the channels; the engine processes drain
        and close their stores after every worker has stopped."""
        await self.router.close()
        for p in self.parts:
            await p.close()

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        """``ready`` when every engine is; else the first part's state that is not."""
        states = [p.state for p in self.parts]
        return next((s for s in states if s != "ready"), "ready")

    @property
    def error(self) -> str | None:
        return next((p.error for p in self.parts if p.error), None)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def check_ready(self) -> None:
        """Whether the server takes requests at all: a request for one user needs only its
        shard (checked where it is sent), so here only a failed or stopping part refuses."""
        for p in self.parts:
            if p.state in ("failed", "closing", "closed"):
                p.check_ready()

    def queue_depths(self) -> dict[str, int]:
        return {
            f"shard-{i}:{k}": v
            for i, p in enumerate(self.parts)
            for k, v in p.queue_depths().items()
        }

    def batch_stats(self) -> dict[str, Any]:
        return {f"shard-{i}": p.batch_stats() for i, p in enumerate(self.parts)}

    @property
    def _derived_runs(self) -> int:
        return sum(p._derived_runs for p in self.parts)

    def health(self) -> dict[str, Any]:
        """The engines' :meth:`~memoryos_gpu.server.service.MemoryService.health` as one:
        every state one of them is degraded in, their derived rounds summed, and their LLM
        backends' counts summed under the worst breaker state (one open breaker is what an
        operator must see)."""
        parts = [p.health() for p in self.parts]
        degraded = list(dict.fromkeys(d for h in parts for d in h.get("degraded", [])))
        llms = [h["llm"] for h in parts if h.get("llm")]
        llm: dict[str, Any] | None = None
        if llms:
            counts: Counter[str] = Counter()
            for one in llms:
                counts.update(
                    {k: v for k, v in one.items() if isinstance(v, int) and not isinstance(v, bool)}
                )
            worst = max(llms, key=lambda one: _BREAKER_SEVERITY.get(one.get("breaker"), 0))
            llm = {**worst, **counts}
        runs = sum(int(h.get("derived_runs", 0)) for h in parts)
        return {"degraded": degraded, "llm": llm, "derived_runs": runs}

    @property
    def has_llm(self) -> bool:
        return self.parts[0].has_llm

    def known_users(self) -> list[str]:
        return sorted(u for p in self.parts for u in p.known_users())

    def is_known(self, user_id: str) -> bool:
        return self.part(user_id).is_known(user_id)

    async def known(self, user_id: str) -> bool:
        return await self.part(user_id).known(user_id)

    async def users(self) -> list[str]:
        return sorted(
            u for part in await asyncio.gather(*(p.users() for p in self.parts)) for u in part
        )

    def engine_for(self, user_id: str) -> Any:
        return self.router.engine_for(user_id)

    # ------------------------------------------------------------------ requests
    async def add_pages(self, pages: Sequence[PageInput]) -> list[AddResult]:
        """Pages split by shard (one queued write each), answered in request order."""
        self.check_ready()
        return await add_by_shard(
            self.shard_map, pages, lambda s, part: self.parts[s].add_pages(part)
        )

    async def retrieve(
        self,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
    ) -> Retrieval:
        return await self.part(user_id).retrieve(
            user_id, query, top_pages=top_pages, top_segments=top_segments
        )

    async def retrieve_body(
        self,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
    ) -> bytes:
        return await self.part(user_id).retrieve_body(
            user_id, query, top_pages=top_pages, top_segments=top_segments
        )

    async def respond(
        self, user_id: str, query: str, *, timestamp: float | str | None = None
    ) -> Response:
        return await self.part(user_id).respond(user_id, query, timestamp=timestamp)

    async def call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """An engine method routed by the router (``engine_for(u).x``, ``engine.stats``), or
        any other callable in a worker thread. After ``engine.stats`` (``/v1/stats``) every
        engine's status snapshot is refreshed, as one engine's :meth:`RemoteService.call`
        does: the batching statistics read beside it are then current, not up to 0.5 s old."""
        self.check_ready()
        out = await self.router.call(fn, *args, **kw)
        if fn is self.engine.stats:
            await asyncio.gather(*(p.refresh() for p in self.parts))
        return out

    async def delete_user(self, user_id: str) -> bool:
        """The user's shard deletes the user, every shard forgets what its pages taught the
        assistants (under the exchange lock, across workers)."""
        deleted = await self.router.delete_user(user_id)
        self.part(user_id)._mark([user_id], False)
        return deleted

    async def wait_for_user(self, user_id: str, timeout: float = 10.0) -> dict[str, Any]:
        return await self.part(user_id).wait_for_user(user_id, timeout)

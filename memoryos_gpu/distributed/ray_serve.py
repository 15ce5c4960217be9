"""The HTTP API on Ray Serve (``memoryos-gpu serve --ray``): one replica per shard, one router.

* **Shard deployments** ``shard-0`` .. ``shard-{N-1}`` (:class:`ShardReplica`, one replica
  each, a GPU each when the cluster has one per shard): each holds the single-box serving core,
  a :class:`~memoryos_gpu.server.service.MemoryService` over its
  :class:`~memoryos_gpu.distributed.sharding.ShardEngine` - the same micro-batching queues
  (concurrent requests of the shard's users become one ``retrieve_many`` / ``add_many``), the
  same derived-work thread, the same acknowledgement rule (an add answers after its commit).
* **Ingress** (:class:`Router`): the single-box FastAPI app itself
  (:func:`~memoryos_gpu.server.app.create_app`: same routes, API keys, tenancy, limits, error
  bodies, OpenAPI), built over :class:`RouterService`, which sends each request to its user's
  shard (a batch of pages is split by shard and answered in request order).
* **Sync loop** in the router (every ``sync_interval_s``): exchanges the shards' keyword
  statistics and routes assistant facts to their owner shard and its replicas (the rule in
  :mod:`memoryos_gpu.distributed.replicas`), refreshes the user list and queue statistics.
  Its first sync (or first deletion across shards) first has the shards catch up on the
  keyword statistics of the pages no exchange gave them (an ``ingest --ray`` stopped before
  its exchange), as a ``ShardedEngine`` does on open (:meth:`RouterService._catch_up`).

A replica that dies is restarted by Serve and reopens its shard from the store: acknowledged
pages are there, queued derived work resumes. Requests to its users fail (503) meanwhile.

**Shutdown** (:func:`finish_app`, before the application is deleted): the router refuses new
requests, the shards drain and finish derived work, one last exchange, then each shard saves
its keyword statistics and closes its store. A replica stopped without it (``serve delete``)
closes itself in Serve's shutdown hook, without the last exchange.

Run it: ``memoryos-gpu serve --ray --shards N --store DIR`` (local Ray, or $RAY_ADDRESS), or
``serve run deploy/ray-serve.yaml`` (see that file), whose import path is :func:`app_builder`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.exchange import catch_up_async, exchange_keywords
from memoryos_gpu.distributed.layout import ShardMap, prepare_layout, shard_store
from memoryos_gpu.distributed.ray_common import (
    BoxedError,
    ensure_ray,
    require_ray,
    shard_resources,
    unbox,
)
from memoryos_gpu.distributed.sharded_forget import check_edit, forget_everywhere_async
from memoryos_gpu.errors import UnknownItemError
from memoryos_gpu.server.scope import RetrievalBodies
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.stop_signals import StopSignals
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval

__all__ = [
    "Router",
    "RouterService",
    "ShardReplica",
    "add_by_shard",
    "app_builder",
    "build_app",
    "finish_app",
    "run",
]

log = logging.getLogger("memoryos_gpu.server")
APP_NAME = "memoryos"
DEFAULT_SYNC_S = 2.0
REPLICA_CONCURRENCY = 1024  # requests a replica takes at once: micro-batches form inside it
SHUTDOWN_S = 120.0  # how long Serve lets a shard replica close before it kills it


# ============================================================================ shard replica
class ShardReplica:
    """One shard: the single-box serving core over the shard's engine (a Serve deployment)."""

    def __init__(
        self, config: dict[str, Any], shard: int, count: int, settings: dict[str, Any]
    ) -> None:
        from memoryos_gpu.distributed.sharding import ShardEngine
        from memoryos_gpu.server.service import MemoryService

        cfg = EngineConfig.model_validate({**config, "auto_process": False})
        self.shard, self.count = shard, count
        # the replica closes the engine itself (close()): the router's last exchange of keyword
        # statistics and facts comes between the service's end and the engine's
        self.service = MemoryService(
            lambda: ShardEngine(cfg, shard=shard, count=count),
            ServerSettings(**{**settings, "close_engine": False}),
        )
        self._starting: asyncio.Lock | None = None
        self._finishing: asyncio.Future | None = None
        self._closing: asyncio.Future | None = None

    async def _ready(self) -> Any:
        if self.service.state == "created":
            self._starting = self._starting or asyncio.Lock()
            async with self._starting:
                await self.service.start(wait=True)
        self.service.check_ready()
        return self.service

    async def _boxed(self, fn: Any, *args: Any) -> Any:
        """``await fn(*args)`` once the service is up; an exception is returned as data."""
        try:
            await self._ready()
            return await fn(*args)
        except Exception as exc:  # re-raised by the router as the same type
            return BoxedError.of(exc)

    def check_health(self) -> None:
        if self.service.state == "failed":
            raise RuntimeError(f"shard {self.shard}: {self.service.error}")

    # ------------------------------------------------------------------ shutdown
    async def finish(self) -> None:
        """Stop taking requests, drain the queues and finish derived work (the service's
        close); the engine stays open for the router's last exchange
        (:meth:`RouterService.finish_shards`), then :meth:`close` closes it. Idempotent:
        a second caller waits for the first."""
        if self._finishing is None:
            self._finishing = asyncio.ensure_future(self.service.close())
        await asyncio.shield(self._finishing)

    async def close(self) -> None:
        """:meth:`finish`, then close the engine: buffered heat written, keyword statistics
        saved (without that, a reopened shard would lack the other shards' pages of the run),
        the store closed. Idempotent."""
        await self.finish()
        if self._closing is None:
            engine = self.service.engine
            done = asyncio.sleep(0) if engine is None else asyncio.to_thread(engine.close)
            self._closing = asyncio.ensure_future(done)
        await asyncio.shield(self._closing)

    async def __del__(self) -> None:
        """Serve's shutdown hook (awaited once, when the replica stops): :meth:`close`. Under
        ``serve --ray`` the router has done it already, with a last exchange before it
        (:func:`finish_app`); under ``serve run`` / ``serve delete`` this is the only close,
        and the statistics saved are those of the last periodic sync."""
        try:
            await self.close()
        except Exception:
            log.exception("shard %d did not close cleanly", self.shard)

    async def _final_call(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """An engine method by name once :meth:`finish` ran (the router's last exchange): on a
        thread of its own, the service's executors being gone."""
        try:
            return await asyncio.to_thread(self._target(name), *args, **kwargs)
        except Exception as exc:
            return BoxedError.of(exc)

    def _target(self, name: str) -> Any:
        """The engine's method ``name`` (``store.x``: the store's)."""
        target = self.service.engine
        for part in name.split("."):
            target = getattr(target, part)
        return target

    async def add_pages(self, pages: list[PageInput]) -> list[AddResult] | BoxedError:
        return await self._boxed(self.service.add_pages, pages)

    async def retrieve(
        self, user_id: str, query: str, top_pages: int | None, top_segments: int | None
    ) -> tuple[Retrieval, bool] | BoxedError:
        """The retrieval, and whether the user is known here (for ``known_user``)."""

        async def go() -> tuple[Retrieval, bool]:
            r = await self.service.retrieve(
                user_id, query, top_pages=top_pages, top_segments=top_segments
            )
            return r, self.service.is_known(user_id)

        return await self._boxed(go)

    async def respond(self, user_id: str, query: str, timestamp: Any) -> Response | BoxedError:
        async def go() -> Response:
            return await self.service.respond(user_id, query, timestamp=timestamp)

        return await self._boxed(go)

    async def call(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """An engine method by name (``store.x`` for the store), on the service's executor
        (on a thread of its own after :meth:`finish`: the router's last exchange)."""
        if self._finishing is not None:
            await asyncio.shield(self._finishing)
            return await self._final_call(name, args, kwargs)

        async def go() -> Any:
            return await self.service.call(self._target(name), *args, **kwargs)

        return await self._boxed(go)

    async def delete_user(self, user_id: str) -> Any:
        return await self._boxed(self.service.delete_user, user_id)

    async def wait_for_user(self, user_id: str, timeout: float) -> Any:
        return await self._boxed(self.service.wait_for_user, user_id, timeout)

    async def status(self) -> Any:
        """Users, queue statistics and pending work (the router's cached view)."""
        return await self._boxed(self._status)

    async def _status(self) -> dict[str, Any]:
        svc = self.service
        return {
            "shard": self.shard,
            "state": svc.state,
            "users": svc.known_users(),
            "batching": svc.batch_stats(),
            "derived_runs": svc._derived_runs,
            "pending": await svc.call(svc.engine.pending_count),
        }


# ============================================================================ router
async def add_by_shard(
    shard_map: ShardMap,
    pages: Sequence[PageInput],
    send: Callable[[int, list[PageInput]], Awaitable[list[AddResult]]],
) -> list[AddResult]:
    """``pages`` split by their users' shards, each part sent at once (``send(shard,
    part)``), the results in the pages' order."""
    groups = shard_map.group(p.user_id for p in pages)
    parts = await asyncio.gather(*(send(s, [pages[i] for i in idx]) for s, idx in groups.items()))
    out: list[AddResult | None] = [None] * len(pages)
    for idx, part in zip(groups.values(), parts, strict=True):
        for i, r in zip(idx, part, strict=True):
            out[i] = r
    return [r for r in out if r is not None]


class _Remote:
    """An engine method on a shard replica (or, ``fan_out``, on all of them)."""

    def __init__(self, router: RouterService, name: str, shard: int | None) -> None:
        self.router, self.name, self.shard = router, name, shard

    async def acall(self, *args: Any, **kw: Any) -> Any:
        if self.shard is None:
            return await self.router.fan_out(self.name, args, kw)
        return await self.router.ask(self.shard, "call", self.name, args, kw)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        raise RuntimeError(f"{self.name}: await it through RouterService.call")


class _Namespace:
    def __init__(self, router: RouterService, prefix: str, shard: int | None) -> None:
        self._router, self._prefix, self._shard = router, prefix, shard

    def __getattr__(self, name: str) -> _Remote:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Remote(self._router, f"{self._prefix}{name}", self._shard)


class _AcrossShards(_Remote):
    """A page change the router runs over every shard itself (``sharded_forget.py``)."""

    def __init__(self, router: RouterService, name: str, fn: Callable[..., Awaitable[Any]]) -> None:
        super().__init__(router, name, None)
        self._fn = fn

    async def acall(self, *args: Any, **kw: Any) -> Any:
        return await self._fn(*args, **kw)


class _ShardEngineProxy(_Namespace):
    """What the HTTP routes call as ``service.engine_for(uid)``: the user's shard engine;
    deleting or editing a page goes through the router (it reaches every shard)."""

    def __init__(self, router: RouterService, shard: int, user_id: str) -> None:
        super().__init__(router, "", shard)
        self.store = _Namespace(router, "store.", shard)
        self.delete_page = _AcrossShards(
            router, "delete_page", partial(router.delete_page, user_id)
        )
        self.update_page = _AcrossShards(
            router, "update_page", partial(router.update_page, user_id)
        )


class _RouterEngine:
    """``service.engine`` of the router: whole-engine calls (stats), cached counts (metrics)."""

    def __init__(self, router: RouterService) -> None:
        self._router = router
        self.stats = _Remote(router, "stats", None)
        self.config = router.config

    def pending_count(self, user_id: str | None = None) -> int:
        return self._router.pending

    def users(self) -> list[str]:
        return self._router.known_users()


class RouterService(RetrievalBodies):
    """The :class:`~memoryos_gpu.server.service.MemoryService` interface of the HTTP app, over
    shard replicas: each call goes to its user's shard. Users, queue statistics and pending
    counts that the app reads synchronously are cached and refreshed by the sync loop (and by
    every add, retrieval and delete, so one router sees its own writes at once)."""

    def __init__(
        self,
        handles: Sequence[Any],
        config: EngineConfig,
        settings: ServerSettings | None = None,
        *,
        sync_interval_s: float | None = DEFAULT_SYNC_S,
        metrics: Any = None,
    ) -> None:
        self.handles = list(handles)
        self.shard_map = ShardMap(len(self.handles))
        self.config = config
        self.settings = settings or ServerSettings()
        self.metrics = metrics
        self.sync_interval_s = sync_interval_s
        self.state = "created"
        self.error: str | None = None
        self.engine = _RouterEngine(self)
        self.pending = 0
        self._known: set[str] = set()
        # membership changes seen while a refresh gathers the shards' user lists: applied on
        # top of its (by then possibly stale) answer, so a user deleted meanwhile stays gone
        self._watchers: list[dict[str, bool]] = []
        self._user_writes: Counter[str] = Counter()
        self._batching: dict[str, Any] = {}
        self._derived_runs = 0
        self._task: asyncio.Task | None = None
        self._loading: asyncio.Task | None = None
        # held by a sync (facts taken from the outboxes until the owners committed them) and by
        # a deletion or edit across shards: a fact in flight never lands after its pages went
        self._exchange: asyncio.Lock | None = None
        self._caught_up = False  # see _catch_up

    def _exchange_lock(self) -> Any:
        """Held by a sync and by a change across shards (an async context manager)."""
        self._exchange = self._exchange or asyncio.Lock()  # made in the running loop
        return self._exchange

    async def ask(self, shard: int, method: str, *args: Any) -> Any:
        """``method(*args)`` of shard ``shard``'s replica; its error raised here. The one place
        a shard is reached: a Serve handle here, an engine process's ZeroMQ channel under
        ``serve --engines`` (:mod:`memoryos_gpu.server.shard_router`)."""
        return unbox(await getattr(self.handles[shard], method).remote(*args))

    async def _ask_all(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(self.ask(i, method, *args) for i in self._shards)))

    @property
    def _shards(self) -> range:
        return range(self.shard_map.count)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, *, wait: bool = True) -> None:
        if self.state != "created":
            return
        self.state = "starting"
        self._loading = asyncio.get_running_loop().create_task(self._load())
        if wait:
            await self._loading

    async def _load(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("the shards failed to load")
            return
        if self.sync_interval_s is not None:
            self._task = asyncio.get_running_loop().create_task(self._sync_loop())
        self.state = "ready"

    async def close(self) -> None:
        if self.state in ("closing", "closed"):
            return
        if self._loading is not None and not self._loading.done():
            await self._loading
        self.state = "closing"
        if self._task is not None:  # a syncing router syncs a last time
            await self._stop_sync_loop()
            with contextlib.suppress(Exception):
                await self.sync()
        self.state = "closed"

    async def finish_shards(self) -> dict[str, int]:
        """The orderly end of a serving run (:func:`finish_app`): refuse new requests (503),
        stop the sync loop, let every shard drain its queues and finish its derived work,
        exchange keyword statistics and assistant facts a last time, then have every shard save
        and close its engine. Why here and not in each replica's shutdown hook: Serve stops an
        application's deployments all at once, so a shard closing on its own saves keyword
        statistics without the other shards' latest pages, and facts found by its last derived
        work never reach their owners. A shard that fails a step is logged; the others go on."""
        if self.state in ("closing", "closed"):
            return {}
        if self._loading is not None and not self._loading.done():
            await self._loading
        self.state = "closing"
        await self._stop_sync_loop()
        out: dict[str, int] = {}
        async with self._exchange_lock():  # a sync or a change across shards finishes first
            finished = await self._each("finish")
            if all(finished):
                try:
                    out = await self._sync()
                except Exception:
                    log.exception("the shards' last exchange failed")
            else:
                log.error("not every shard finished: no last exchange (see above)")
            await self._each("close")
        self.state = "closed"
        return out

    async def _each(self, method: str) -> list[bool]:
        """``method()`` on every shard at once; whether each succeeded (failures logged)."""
        res = await asyncio.gather(
            *(self.ask(i, method) for i in self._shards), return_exceptions=True
        )
        for i, r in enumerate(res):
            if isinstance(r, BaseException):
                log.error("shard %d: %s failed: %s: %s", i, method, type(r).__name__, r)
        return [not isinstance(r, BaseException) for r in res]

    async def _stop_sync_loop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sync_interval_s or DEFAULT_SYNC_S)
            try:
                await self.sync()
                await self.refresh()
            except Exception:  # a restarting shard: try again next round
                log.warning("shard sync failed; retrying", exc_info=True)

    async def sync(self) -> dict[str, int]:
        """Keyword statistics to every shard, assistant facts to owners and replicas (under
        the exchange lock: a deletion waits for the facts in flight to land, then removes
        them)."""
        async with self._exchange_lock():
            return await self._sync()

    async def _catch_up(self) -> None:
        """Once, before this router's first exchange (a sync, or a change across shards; under
        the exchange lock): the shards catch up on the keyword statistics of the pages no
        exchange gave them, those of an ``ingest --ray`` stopped before its exchange, as a
        ``ShardedEngine`` does on open (:func:`~memoryos_gpu.distributed.exchange.catch_up_rounds`;
        harmless when another router did it: the saved marks then say every page is counted).
        Not done: tried again by the next exchange."""
        if self._caught_up:
            return
        docs = await catch_up_async(self._on_shard, self.shard_map.count)
        self._caught_up = True
        if docs:
            log.info("the shards caught up on the keyword statistics of %d pages", docs)

    async def _sync(self) -> dict[str, int]:
        await self._catch_up()
        parts = await self._ask_all("call", "take_sync", (), {})  # what each gathered since
        pending: list[Any] = []
        docs = exchange_keywords(
            [lambda p=p: p["delta"] for p in parts],
            [
                lambda d, i=i: pending.append(self.ask(i, "call", "apply_keyword_delta", (d,), {}))
                for i in self._shards
            ],
        )
        await asyncio.gather(*pending)
        facts = [f for p in parts for f in p["facts"]]
        written = 0
        if facts:
            written = await self._route_facts(facts)
        return {"keyword_docs": docs, "assistant_facts": written}

    async def _route_facts(self, facts: list[Any]) -> int:
        """The owner numbers and commits an assistant's facts (``Fact``s, with their
        provenance), then every other shard copies the numbered entries (the rule of
        :mod:`~memoryos_gpu.distributed.replicas`)."""
        by_owner: dict[int, list[Any]] = {}
        for f in facts:
            by_owner.setdefault(self.shard_map.assistant_owner(f[1]), []).append(f)
        written = 0
        for owner, owned in sorted(by_owner.items()):
            entries = await self.ask(owner, "call", "append_assistant_facts", (owned,), {})
            written += len(entries)
            await asyncio.gather(
                *(
                    self.ask(j, "call", "replicate_assistant_entries", (entries,), {})
                    for j in self._shards
                    if j != owner
                )
            )
        return written

    def _mark(self, user_ids: Iterable[str], known: bool) -> None:
        for u in user_ids:
            (self._known.add if known else self._known.discard)(u)
            for changes in self._watchers:
                changes[u] = known

    async def refresh(self) -> None:
        changes: dict[str, bool] = {}
        self._watchers.append(changes)
        try:
            statuses = await self._ask_all("status")
        finally:
            self._watchers.remove(changes)
        known: set[str] = set()
        for s in statuses:
            known.update(s["users"])
        known |= {u for u, is_known in changes.items() if is_known}
        known -= {u for u, is_known in changes.items() if not is_known}
        self._known = known | {u for u, n in self._user_writes.items() if n > 0}
        self.pending = sum(int(s["pending"]) for s in statuses)
        self._derived_runs = sum(int(s["derived_runs"]) for s in statuses)
        self._batching = {f"shard-{s['shard']}": s["batching"] for s in statuses}

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def check_ready(self) -> None:
        from memoryos_gpu.server.batching import check_state

        check_state(self.state, self.error, "the shards", self.settings.retry_after_s, plural=True)

    def queue_depths(self) -> dict[str, int]:
        return {}

    def batch_stats(self) -> dict[str, Any]:
        return dict(self._batching)

    def known_users(self) -> list[str]:
        return sorted(self._known)

    def is_known(self, user_id: str) -> bool:
        return user_id in self._known

    async def known(self, user_id: str) -> bool:
        return self.is_known(user_id)

    async def users(self) -> list[str]:
        return self.known_users()

    @property
    def has_llm(self) -> bool:
        return self.config.llm.mode == "llm"

    def engine_for(self, user_id: str) -> _ShardEngineProxy:
        return _ShardEngineProxy(self, self.shard_map.shard(user_id), user_id)

    def _home(self, user_id: str) -> int:
        return self.shard_map.shard(user_id)

    # ------------------------------------------------------------------ requests
    async def add_pages(self, pages: Sequence[PageInput]) -> list[AddResult]:
        """Pages split by shard (each part one queued write there), answered in order."""
        self.check_ready()
        users = Counter(p.user_id for p in pages)
        self._user_writes.update(users)
        try:
            out = await add_by_shard(
                self.shard_map, pages, lambda s, part: self.ask(s, "add_pages", part)
            )
        finally:
            self._user_writes.subtract(users)
            for u in users:
                if self._user_writes[u] <= 0:
                    del self._user_writes[u]
        self._mark({r.user_id for r in out}, True)
        return out

    async def retrieve(
        self,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
    ) -> Retrieval:
        self.check_ready()
        r, known = await self.ask(
            self._home(user_id), "retrieve", user_id, query, top_pages, top_segments
        )
        self._mark([user_id], known)
        return r

    async def respond(
        self, user_id: str, query: str, *, timestamp: float | str | None = None
    ) -> Response:
        self.check_ready()
        return await self.ask(self._home(user_id), "respond", user_id, query, timestamp)

    async def call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        self.check_ready()
        if isinstance(fn, _Remote):
            return await fn.acall(*args, **kw)
        return await asyncio.to_thread(fn, *args, **kw)

    async def fan_out(self, name: str, args: Sequence[Any], kw: Mapping[str, Any]) -> Any:
        """A whole-engine call on every shard; ``stats`` is merged."""
        res = await self._ask_all("call", name, tuple(args), dict(kw))
        if name != "stats":
            return res
        counters: Counter[str] = Counter()
        for s in res:
            counters.update(s.get("counters", {}))
        await self.refresh()
        return {
            "shard_count": len(res),
            "users": sum(int(s.get("users", 0)) for s in res),
            "counters": dict(counters),
            "arena_bytes": sum(int(s.get("arena_bytes", 0)) for s in res),
            "device": res[0].get("device") if res else None,
            "mode": res[0].get("mode") if res else None,
            "shards": res,
        }

    async def delete_user(self, user_id: str) -> bool:
        """The user's shard deletes the user; every shard forgets what the user's pages taught
        the assistants (``sharded_forget.py``)."""
        self.check_ready()

        async def delete() -> Any:
            return await self.ask(self._home(user_id), "delete_user", user_id)

        deleted = await self._forget(delete, user_id)
        self._mark([user_id], False)
        return bool(deleted)

    async def delete_page(self, user_id: str, page_id: int) -> bool:
        """The page goes on the user's shard, and what it taught the assistants on every
        shard (``sharded_forget.py``); False when the user has no such page."""
        self.check_ready()
        home = self.shard_map.shard(user_id)
        row = await self._on_shard(home, "get_page", (page_id,))
        if row is None or row["user_id"] != user_id:
            return False

        async def delete() -> Any:
            return await self._on_shard(home, "delete_page", (page_id,))

        return bool(await self._forget(delete, user_id, [page_id]))

    async def update_page(
        self,
        user_id: str,
        page_id: int,
        *,
        user_input: str | None = None,
        agent_response: str | None = None,
    ) -> dict[str, Any]:
        """The page's edit on the user's shard; what its old text taught goes on every shard
        as for :meth:`delete_page`, the page is re-analysed (``sharded_forget.py``)."""
        self.check_ready()
        check_edit(user_input, agent_response)
        home = self.shard_map.shard(user_id)
        row = await self._on_shard(home, "get_page", (page_id,))
        if row is None or row["user_id"] != user_id:
            raise UnknownItemError(f"user {user_id!r} has no page {page_id}")
        text = {"user_input": user_input, "agent_response": agent_response}

        async def edit() -> Any:
            return await self.ask(home, "call", "update_page", (page_id,), text)

        return await self._forget(edit, user_id, [page_id])

    async def _forget(
        self, change: Callable[[], Awaitable[Any]], user_id: str, pages: list[int] | None = None
    ) -> Any:
        """``change`` on the user's shard with what the pages taught forgotten on every shard
        (``sharded_forget.py``), under the exchange lock: no sync has facts in flight."""
        async with self._exchange_lock():
            await self._catch_up()  # what is forgotten is then what every shard counts
            return await forget_everywhere_async(
                self._on_shard, change, self.shard_map, user_id, pages
            )

    async def _on_shard(self, shard: int, name: str, args: tuple) -> Any:
        """A shard engine's method by name (``sharded_forget``'s ``call``)."""
        return await self.ask(shard, "call", name, args, {})

    async def wait_for_user(self, user_id: str, timeout: float = 10.0) -> dict[str, Any]:
        self.check_ready()
        return await self.ask(self._home(user_id), "wait_for_user", user_id, timeout)


# ============================================================================ ingress
class Router:
    """The ingress deployment: the single-box FastAPI app over a :class:`RouterService`."""

    def __init__(
        self,
        *shards: Any,
        config: dict[str, Any],
        api_keys: dict[str, str] | None,
        settings: dict[str, Any],
        sync_interval_s: float = DEFAULT_SYNC_S,
    ) -> None:
        self.shards = list(shards)
        self.config = EngineConfig.model_validate(config)
        self.api_keys = api_keys
        self.settings = ServerSettings(**settings)
        self.sync_interval_s = sync_interval_s
        self.service: RouterService | None = None

    async def finish(self) -> dict[str, int]:
        """The shards' orderly end (:meth:`RouterService.finish_shards`), asked by
        :func:`finish_app` through a handle before the application is deleted."""
        if self.service is None:
            return {}
        return await self.service.finish_shards()

    def __serve_build_asgi_app__(self) -> Any:
        from memoryos_gpu.server.app import create_app

        service = self.service = RouterService(
            self.shards, self.config, self.settings, sync_interval_s=self.sync_interval_s
        )
        return create_app(
            service=service, api_keys=self.api_keys, settings=self.settings, use_env_keys=False
        )


# ============================================================================ building
def build_app(
    config: EngineConfig,
    shards: int,
    *,
    api_keys: Mapping[str, str] | str | Path | None = None,
    settings: ServerSettings | None = None,
    shard_cpus: float | None = None,
    shard_gpus: float | None = None,
    sync_interval_s: float = DEFAULT_SYNC_S,
) -> Any:
    """The Serve application: ``shards`` shard deployments behind one router.

    ``config.store``: a directory (one SQLite store per shard, ``STORE/shard-I``) or a
    PostgreSQL URL. ``api_keys``: ``{key: tenant}`` or a ``KEY TENANT`` file, read here (plus
    $MEMORYOS_GPU_API_KEYS) and handed to the router. Call with Ray connected (resources are
    read from the cluster)."""
    serve = _serve()
    from memoryos_gpu.server.auth import load_api_keys

    prepare_layout(config.store, shards)
    settings = settings or ServerSettings()
    res = shard_resources(shards, cpus=shard_cpus, gpus=shard_gpus)
    replica = serve.deployment(
        ShardReplica,
        max_ongoing_requests=REPLICA_CONCURRENCY,
        ray_actor_options=res.options(),
        health_check_period_s=5,
        # a replica stopped on its own (serve delete) drains and finishes derived work first
        graceful_shutdown_timeout_s=SHUTDOWN_S,
    )
    parts = [
        replica.options(name=f"shard-{i}").bind(
            config.model_copy(update={"store": shard_store(config.store, i, shards)}).model_dump(),
            i,
            shards,
            settings.model_dump(),
        )
        for i in range(shards)
    ]
    ingress = serve.deployment(
        serve.ingress()(Router),
        name="router",
        max_ongoing_requests=REPLICA_CONCURRENCY,
        ray_actor_options={"num_cpus": 0},
    )
    keys = load_api_keys(api_keys, use_env=True) or None
    return ingress.bind(
        *parts,
        config=config.model_dump(),
        api_keys=dict(keys) if keys else None,
        settings=settings.model_dump(),
        sync_interval_s=sync_interval_s,
    )


def _serve() -> Any:
    require_ray("serve")
    from ray import serve

    return serve


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run memoryos_gpu.distributed.ray_serve:app_builder store=DIR shards=2`` (or the
    ``args`` of deploy/ray-serve.yaml): ``store``, ``shards``, ``embedder``, ``device``,
    ``config`` (a TOML file), ``api_keys`` (a key file), ``sync_interval_s``, ``shard_cpus``,
    ``shard_gpus``, and any :class:`ServerSettings` field."""
    args = dict(args)
    base = EngineConfig.from_toml(args.pop("config")) if args.get("config") else EngineConfig()
    update = {k: args.pop(k) for k in ("store", "embedder", "device") if args.get(k)}
    config = EngineConfig.model_validate({**base.model_dump(), **update})
    known = set(ServerSettings.model_fields)
    settings = ServerSettings(**{k: args.pop(k) for k in list(args) if k in known})
    num = {k: float(args.pop(k)) for k in ("shard_cpus", "shard_gpus") if k in args}
    return build_app(
        config,
        int(args.pop("shards", 1)),
        api_keys=args.pop("api_keys", None),
        settings=settings,
        sync_interval_s=float(args.pop("sync_interval_s", DEFAULT_SYNC_S)),
        **num,
    )


def run(
    config: EngineConfig,
    shards: int,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_keys: Mapping[str, str] | str | Path | None = None,
    settings: ServerSettings | None = None,
    address: str | None = None,
    blocking: bool = True,
    **kw: Any,
) -> None:
    """Start the application on Ray Serve (local Ray, or ``address`` / $RAY_ADDRESS) and, with
    ``blocking``, serve until SIGINT, SIGTERM or SIGHUP, then shut the application down and
    return: the shards drain their queues, finish derived work, exchange keyword statistics and
    facts a last time, save and close their stores (:func:`finish_app`), then the application
    is deleted. The signals follow :mod:`memoryos_gpu.stop_signals` (the first stops
    gracefully, a second Ctrl-C stops waiting for the shards); a stop that comes while the
    application starts shuts it down as soon as it has started."""
    stopping = threading.Event()
    # sets the event and nothing else: it runs in the main thread wherever that is, inside
    # Ray's calls too, so it must not raise there
    stop = StopSignals(lambda _signum: stopping.set())
    if blocking:
        stop.install()
    try:
        ensure_ray(address)
        if blocking:
            # Again: ray.init sets Ray's SIGTERM handlers over ours. Its C++ core chains
            # abseil's failure handler in front of Python's, and that handler arms a 3-second
            # SIGALRM abort before it calls Ray's own (sys.exit(15)): a shutdown that took
            # longer than 3 s (finish_app, the deletion, Ray's own shutdown at exit) was cut
            # short by SIGABRT (exit -6). Set through signal.signal, ours replaces both.
            stop.install()
        serve = _serve()
        serve.start(http_options={"host": host, "port": int(port)})
        app = build_app(config, shards, api_keys=api_keys, settings=settings, **kw)
        serve.run(app, name=APP_NAME, route_prefix="/")
        if not blocking:
            return
        log.warning(
            "memoryos-gpu on Ray Serve: http://%s:%d, %d shards; Ctrl-C stops", host, port, shards
        )
        stopping.wait()
        try:
            finish_app(serve)
        finally:  # a second Ctrl-C in finish_app's wait, or its failure, is logged there
            serve.delete(APP_NAME)
    finally:
        stop.restore()


def finish_app(serve: Any) -> None:
    """Before the application is deleted: the router drains the shards, exchanges keyword
    statistics and facts a last time, and has every shard save and close its engine
    (:meth:`RouterService.finish_shards`). A second Ctrl-C stops waiting (each replica then
    closes on its own as Serve stops it, without the last exchange)."""
    log.warning("stopping: the shards finish their queues and derived work, then save")
    try:
        done = serve.get_app_handle(APP_NAME).finish.remote().result()
    except KeyboardInterrupt:
        log.warning("second Ctrl-C: the shards close without a last exchange")
    except Exception:
        log.exception("the shards' orderly end failed; each closes on its own as it stops")
    else:
        log.warning("shards closed (last exchange: %s)", done)

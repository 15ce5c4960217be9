"""The router's service (:class:`RouterService`): the
:class:`~memoryos_gpu.server.service.MemoryService` interface of the HTTP app over the shard
replicas of ``serve --ray``. Each request goes to its user's shard; the sync loop exchanges
keyword statistics and routes assistant facts to their owners and replicas; a delete or an edit
reaches every shard under the exchange lock; :meth:`RouterService.finish_shards` is a serving
run's orderly end.

The ingress deployment and the application around it: :mod:`memoryos_gpu.distributed.ray_serve`;
``serve --engines`` runs it over engine processes (:mod:`memoryos_gpu.server.shard_router`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.exchange import catch_up_async, merge_deltas
from memoryos_gpu.distributed.layout import ShardMap
from memoryos_gpu.distributed.ray_common import unbox
from memoryos_gpu.distributed.ray_routing import (
    _Remote,
    _RouterEngine,
    _ShardEngineProxy,
    add_by_shard,
)
from memoryos_gpu.distributed.replicas import OutboxFact, by_owner, outbox_facts, outbox_upto
from memoryos_gpu.distributed.sharded_forget import check_edit, forget_everywhere_async
from memoryos_gpu.errors import UnknownItemError
from memoryos_gpu.server.remote_service import StatusPart
from memoryos_gpu.server.scope import RetrievalBodies, done_writing
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval

log = logging.getLogger("memoryos_gpu.server")
DEFAULT_SYNC_S = 2.0


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
        # each shard as ``/metrics`` reads it (queue depths, health, engine counters, labelled
        # ``shard``), from the statuses of the last refresh: a scrape is answered from memory,
        # not by asking every shard
        self.parts: list[Any] = []
        self._task: asyncio.Task | None = None
        self._loading: asyncio.Task | None = None
        # held by a sync (facts taken from the outboxes until the owners committed them) and by
        # a deletion or edit across shards: a fact in flight never lands after its pages went
        self._exchange: asyncio.Lock | None = None
        self._caught_up = False  # see _catch_up
        # keyword deltas taken from shards that a shard has not added yet, by that shard: a
        # sync whose call to a shard fails (an engine restarting) keeps them for the next one
        self._owed: dict[int, list[dict[str, Any]]] = {}

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
        """One exchange: each shard's keyword delta to every other shard, the assistant facts
        to their owners and the entries they number to the replicas. A keyword delta a shard
        gave up stays owed to each shard that has not taken it (its call failed: the engine
        restarting), and goes with the next sync; assistant facts stay in their senders'
        outboxes until committed and copied everywhere (:meth:`_route_facts`). So no shard loses
        another's pages or facts; the sync then raises (logged, retried by the loop)."""
        await self._catch_up()
        parts = await asyncio.gather(  # what each gathered since (a failed shard keeps its own)
            *(self.ask(i, "call", "take_sync", (), {}) for i in self._shards),
            return_exceptions=True,
        )
        taken = {i: p for i, p in enumerate(parts) if not isinstance(p, BaseException)}
        deltas = {i: p["delta"] for i, p in taken.items() if p["delta"]["n_docs"]}
        for j in self._shards:  # every shard is owed every other shard's delta
            self._owed.setdefault(j, []).extend(d for i, d in deltas.items() if i != j)
        added = await asyncio.gather(
            *(self._add_owed(j) for j in self._shards), return_exceptions=True
        )
        written, routed = await self._route_facts([f for p in taken.values() for f in p["facts"]])
        failed = next((x for x in (*parts, *added) if isinstance(x, BaseException)), routed)
        if failed is not None:
            raise failed
        docs = sum(int(d["n_docs"]) for d in deltas.values())
        return {"keyword_docs": docs, "assistant_facts": written}

    async def _add_owed(self, shard: int) -> None:
        """The keyword deltas owed to ``shard``, added in one call (kept owed if it fails)."""
        owed = self._owed.pop(shard, [])
        if not owed:
            return
        try:
            await self.ask(shard, "call", "apply_keyword_delta", (merge_deltas(owed),), {})
        except BaseException:
            self._owed[shard] = owed + self._owed.get(shard, [])
            raise

    async def _route_facts(self, sent: list[Any]) -> tuple[int, Exception | None]:
        """The owner numbers and commits an assistant's facts (``OutboxFact``s taken from the
        shards' outboxes, with their provenance), every other shard copies the numbered entries
        (the rule of :mod:`~memoryos_gpu.distributed.replicas`), and each sender whose facts
        were committed and copied everywhere drops them from its outbox. A failed commit or
        copy leaves its senders' facts in their outboxes, in the store, for the next exchange,
        whose owner skips what it committed and answers those assistants' rings whole (a
        replica skips what it holds): the router keeps nothing owed in its memory, which a
        router that stopped lost. Returns the entries written and the first failure (None:
        none)."""
        sent = outbox_facts(sent)
        written, failures, kept = 0, [], set()
        for owner, owned in sorted(by_owner(sent, self.shard_map).items()):
            try:
                written += await self._commit_and_copy(owner, owned)
            except Exception as exc:
                failures.append(exc)
                kept.update(f.sender for f in owned)  # their senders keep them
        acks = [self._ack(i, upto) for i, upto in outbox_upto(sent).items() if i not in kept]
        failures += [x for x in await asyncio.gather(*acks, return_exceptions=True) if x]
        return written, next(iter(failures), None)

    async def _commit_and_copy(self, owner: int, owned: list[OutboxFact]) -> int:
        """The owner commits ``owned`` and every other shard copies the entries; raises the
        first failure (after every copy was tried). Returns the entries written."""
        entries = await self.ask(owner, "call", "append_assistant_facts", (owned,), {})
        copies = [
            self.ask(j, "call", "replicate_assistant_entries", (entries,), {})
            for j in self._shards
            if j != owner and entries
        ]
        for x in await asyncio.gather(*copies, return_exceptions=True):
            if x is not None:
                raise x
        return len(entries)

    async def _ack(self, sender: int, upto: int) -> None:
        """Shard ``sender``'s outbox drops its facts up to ``upto``: their owners committed
        them and the replicas copied the entries (a failure leaves them there: sent again,
        skipped by their owners)."""
        await self.ask(sender, "call", "ack_assistant_facts", (upto,), {})

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
        self.parts = [StatusPart(s) for s in statuses]

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
            done_writing(self._user_writes, users)
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

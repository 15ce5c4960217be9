"""Sharding users over engines: the shard engine, and an in-process router with the engine's API.

Users are the unit of placement: the hash of :class:`~memoryos_gpu.distributed.layout.ShardMap`
names the one shard that owns a user, and that shard's engine (its arena on one GPU, or on the
CPU) is the only writer of the user's rows. :class:`ShardEngine` is that engine;
:class:`ShardedEngine` runs N of them in one process behind the engine's API (the Ray drivers
and ``serve --engines`` run them in processes of their own:
:mod:`~memoryos_gpu.distributed.ray_ingest`, :mod:`~memoryos_gpu.distributed.ray_serve`,
:mod:`~memoryos_gpu.server.shard_router`).

What crosses shards has a module of its own, each saying why it works as it does:

* :mod:`~memoryos_gpu.distributed.layout`: the user -> shard map, where each shard's store is
  (``STORE/shard-I``, or one shared PostgreSQL database seen through ``OwnedStore``), and the
  check that a store sharded N ways is reopened with N shards;
* :mod:`~memoryos_gpu.distributed.exchange`: the keyword statistics, exchanged so that every
  shard ranks keywords as if it had seen every page (by deltas, and by the *exchange marks*
  that find the pages an interrupted ``ingest --ray`` never exchanged);
* :mod:`~memoryos_gpu.distributed.replicas`: assistant knowledge, one writer per assistant
  (its owner shard) and read replicas everywhere;
* :mod:`~memoryos_gpu.distributed.sharded_forget`: deleting a user or a page, which reaches
  what its pages taught the assistants on every shard.

With those, a :class:`ShardedEngine` produces the same pages, segments and retrievals as one
:class:`~memoryos_gpu.engine.MemoryEngine` fed the same calls (tests/test_distributed.py checks
it).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import InvalidInputError, MemoryEngine, clean_queries, validate_pages
from memoryos_gpu.errors import UnknownItemError, UnknownUserError
from memoryos_gpu.shared_gate import SharedGate
from memoryos_gpu.store import open_store
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval

from . import sharded_forget
from .exchange import KeywordExchange, catch_up_keywords, exchange_keywords
from .layout import OwnedStore, ShardMap, is_shared_store, prepare_layout, shard_store
from .replicas import AssistantReplicas, route_assistant_facts

__all__ = ["ShardEngine", "ShardedEngine"]


# ============================================================================ the shard engine
class ShardEngine(KeywordExchange, AssistantReplicas, MemoryEngine):
    """A :class:`MemoryEngine` owning shard ``shard`` of ``count``.

    What it adds to the engine: a view of a shared store restricted to its users
    (:class:`~memoryos_gpu.distributed.layout.OwnedStore`); the keyword statistics of the pages
    it accepted since the last exchange, and the exchange marks
    (:class:`~memoryos_gpu.distributed.exchange.KeywordExchange`); an outbox for the assistant
    facts its promotions find, the owner's commit of them and the ring of every other assistant
    kept as a replica (:class:`~memoryos_gpu.distributed.replicas.AssistantReplicas`);
    ``accept_many`` (commit pages, no derived work) so a router can commit a batch on every
    shard before any shard derives (with the engine's ``hold_pending``, which keeps derived work
    queued, also on open, until ``release_pending``, a restarted ingest actor leaves it to the
    end of the run).

    It changes the engine only through the engine's hooks (``MemoryEngine`` Notes):
    ``_open_store`` (the shared-store view), and, in the mixins, ``_learn_keywords`` /
    ``_unlearn_keywords`` (texts for the keyword exchange) and ``_push_knowledge`` (the
    assistant-fact outbox).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        shard: int = 0,
        count: int = 1,
        **kw: Any,
    ) -> None:
        self.shard_index, self.shard_count = int(shard), int(count)
        self.shard_map = ShardMap(self.shard_count)
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard {shard} of {count}: need 0 <= shard < count")
        super().__init__(config, **kw)  # the mixins' state, then the engine's open

    # ------------------------------------------------------------------ construction hooks
    def _open_store(self, config: EngineConfig) -> Any:
        """A store shared by every shard (PostgreSQL) is seen through this shard's view, and
        this engine claims only its shard of it (the other shards' engines write beside it)."""
        if is_shared_store(config.store) and self.shard_count > 1:
            shard = (self.shard_index, self.shard_count)
            return OwnedStore(
                open_store(config.store, shard=shard, key=config.encryption_key), *shard
            )
        return super()._open_store(config)

    @property
    def shared_store(self) -> bool:
        return isinstance(self.store, OwnedStore)

    def owns(self, user_id: str) -> bool:
        return self.shard_map.shard(user_id) == self.shard_index

    def has_user(self, user_id: str) -> bool:
        return user_id in self._users

    def assistant_of(self, user_id: str) -> str:
        return self._user(user_id).assistant_id

    # ------------------------------------------------------------------ pages
    def accept_many(self, pages: Iterable[PageInput | dict[str, Any]]) -> list[AddResult]:
        """Commit pages like ``add_many`` (one transaction, acknowledged once it returns), but
        run no derived work. The embeddings are made first, outside the engine lock, as
        ``add_many`` makes them: retrievals on this shard go on meanwhile."""
        items = validate_pages(pages)
        return self._accept_durably(items, self._stm.prepare(items))

    # ------------------------------------------------------------------ exchanges
    def take_sync(self) -> dict[str, Any]:
        """What a router's sync takes from this shard in one call: the keyword delta and the
        assistant facts gathered since the last one."""
        return {"delta": self.take_keyword_delta(), "facts": self.take_assistant_facts()}

    # ------------------------------------------------------------------ forgetting
    def delete_page(self, page_id: int) -> bool:
        """The engine's delete; the page's facts still in the outbox go too (their other
        pages are re-analysed)."""
        with self._state.locked():
            self._drop_outbox_of(page_id)
            return super().delete_page(page_id)

    def update_page(
        self, page_id: int, *, user_input: str | None = None, agent_response: str | None = None
    ) -> dict[str, Any]:
        """The engine's edit; the facts of the page's old text still in the outbox go too."""
        sharded_forget.check_edit(user_input, agent_response)
        with self._state.locked():
            self._drop_outbox_of(page_id)
            return super().update_page(
                page_id, user_input=user_input, agent_response=agent_response
            )

    def forget_learned_from(
        self, user_id: str, pages: Sequence[int] | None = None
    ) -> dict[str, list]:
        """The assistant entries this shard owns learned from the user's pages (``pages``:
        those of them) go (``sharded_forget.py``, step 1)."""
        return sharded_forget.forget_learned_from(self, user_id, pages)

    def drop_assistant_entries(self, entries: Sequence[tuple[str, int]]) -> int:
        """Replicas of entries their owner removed go (``sharded_forget.py``, step 2)."""
        return sharded_forget.drop_assistant_entries(self, entries)

    def user_keyword_delta(
        self, user_id: str, pages: Sequence[int] | None = None
    ) -> dict[str, Any]:
        """Keyword frequencies of the user's pages (``sharded_forget.py``, step 3)."""
        return sharded_forget.user_keyword_delta(self, user_id, pages)

    def forget_keyword_delta(self, delta: dict[str, Any]) -> None:
        """Un-count a deleted user's keyword frequencies (``sharded_forget.py``, step 3)."""
        sharded_forget.forget_keyword_delta(self, delta)

    def reanalyse_pages(self, pages: Sequence[tuple[int, str]]) -> list[int]:
        """Pages behind a fact another shard removed (``sharded_forget.py``, step 4)."""
        return sharded_forget.reanalyse_pages(self, pages)

    def info(self) -> dict[str, Any]:
        """Shard identity and size (cheap: no store scan)."""
        with self._lock:
            return {
                "shard": self.shard_index,
                "count": self.shard_count,
                "users": len(self._users),
                "store": self.config.store,
                "device": "cuda" if self.arena.on_cuda else "cpu",
            }


def _holds(engine: MemoryEngine, user_id: str, page_id: int) -> bool:
    """Whether the shard's store holds a page ``page_id`` of ``user_id``."""
    row = engine.get_page(page_id)
    return row is not None and row["user_id"] == user_id


# ============================================================================ in-process router
class ShardedEngine:
    """N shard engines in one process, behind the engine's API.

    Every call is split by the users' shards and the results are put back in input order.
    ``add_many`` commits the batch on every shard, exchanges keyword statistics, and only then
    runs the derived work (when ``config.auto_process``), so derived results equal one
    engine's; afterwards it routes assistant facts (:mod:`~memoryos_gpu.distributed.replicas`).
    Calls that name a page
    or knowledge entry by id go through :meth:`engine_for` (ids are per shard store), except
    :meth:`delete_page` and :meth:`update_page`, which take the user and reach every shard.

    Concurrency: each shard engine is thread-safe on its own, so the router only keeps calls
    apart where they cross shards. Writes, retrievals, responses and promotions share its gate
    (a :class:`~memoryos_gpu.shared_gate.SharedGate`) and run at once, each shard's work under
    that shard's own locks; a deletion or edit, which changes every shard in steps
    (``sharded_forget``), takes the gate alone, so no call sees or adds to a half-forgotten
    user. The keyword exchange and the routing of assistant facts take a short lock of their
    own inside the gate. The deadlock rule: the gate comes first, then the exchange lock, then
    a shard engine's locks; nothing waits at the gate holding either. Before, one router lock
    kept every call apart: a retrieval waited for another caller's whole batch (its
    embedding included) or LLM response.

    ``shards``: how many; ``config.store``: a directory (one SQLite store per shard, the
    ``ingest --workers`` layout), a PostgreSQL URL (shared) or ``:memory:``; a store laid out
    for another count is refused (:func:`prepare_layout`).

    On open, before the work the store owes runs, the shards catch up on the keyword
    statistics of the pages no exchange gave them (:func:`catch_up_keywords`: an ``ingest
    --ray`` stopped before its exchange), so the engines derive, and save, what one engine
    holding every page would.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        shards: int = 2,
        *,
        embedder: Any = None,
        llm: Any = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.shard_map = ShardMap(shards)
        prepare_layout(self.config.store, shards)
        self.engines: list[ShardEngine] = []
        try:
            for i in range(shards):
                cfg = self.config.model_copy(
                    update={"store": shard_store(self.config.store, i, shards)}
                )
                self.engines.append(  # the work owed waits for the keyword catch-up
                    ShardEngine(
                        cfg, shard=i, count=shards, embedder=embedder, llm=llm, hold_pending=True
                    )
                )
            catch_up_keywords(self.engines)
        except BaseException:
            for e in self.engines:
                e.close()
            raise
        self._gate = SharedGate()  # deletions across shards alone, everything else at once
        self._sync_lock = threading.Lock()  # the keyword exchange and the facts' routing
        for e in self.engines:
            e.release_pending()
            if e.pending_count():
                e._process_owed()  # as an engine does on open: a failure leaves it pending
        self.sync_shards()

    # ------------------------------------------------------------------ routing
    @property
    def count(self) -> int:
        return self.shard_map.count

    def engine_for(self, user_id: str) -> ShardEngine:
        """The shard engine that owns ``user_id`` (page / knowledge calls by id go there)."""
        return self.engines[self.shard_map.shard(user_id)]

    def validate_page(self, p: PageInput | dict[str, Any]) -> PageInput:
        return self.engines[0].validate_page(p)

    def page_text(self, page: Any) -> str:
        return self.engines[0].page_text(page)

    # ------------------------------------------------------------------ writes
    def add(self, user_id: str, user_input: str, agent_response: str = "", **kw: Any) -> AddResult:
        return self.add_many([PageInput(user_id, user_input, agent_response, **kw)])[0]

    def add_many(self, pages: Iterable[PageInput | dict[str, Any]]) -> list[AddResult]:
        """Commit pages on their users' shards (each shard one transaction), then derive."""
        items = validate_pages(pages)
        out: list[AddResult | None] = [None] * len(items)
        with self._gate.enter():
            for shard, idx in self.shard_map.group(p.user_id for p in items).items():
                res = self.engines[shard].accept_many([items[i] for i in idx])
                for i, r in zip(idx, res, strict=True):
                    out[i] = r
            with self._sync_lock:
                self._exchange_keywords()
        if self.config.auto_process:
            self.process_pending()
        return [r for r in out if r is not None]

    def process_pending(self) -> dict[str, int]:
        """Every shard's derived work, then the assistant facts it found. The shards' rounds
        run outside this router's lock (each shard keeps its own rounds apart, and calls
        its LLM without its engine lock), so retrievals and writes go on meanwhile."""
        done: Counter[str] = Counter()
        for e in self.engines:
            done.update(e.process_pending())
        with self._gate.enter(), self._sync_lock:
            self._route_facts()
        return dict(done)

    def flush(self) -> dict[str, int]:
        return self.process_pending()

    def sync_shards(self) -> None:
        """Exchange keyword statistics and route assistant facts now."""
        with self._gate.enter():
            self._sync_all()

    def _sync_all(self) -> None:
        """:meth:`sync_shards`' work, for a caller inside the gate (or holding it alone)."""
        with self._sync_lock:
            self._exchange_keywords()
            self._route_facts()

    def _exchange_keywords(self) -> int:
        return exchange_keywords(
            [e.take_keyword_delta for e in self.engines],
            [e.apply_keyword_delta for e in self.engines],
        )

    def _route_facts(self) -> int:
        sent = [f for e in self.engines for f in e.take_assistant_facts()]
        if not sent:
            return 0
        return route_assistant_facts(
            sent,
            self.shard_map,
            lambda s, f: self.engines[s].append_assistant_facts(f),
            lambda s, entries: self.engines[s].replicate_assistant_entries(entries),
            lambda s, upto: self.engines[s].ack_assistant_facts(upto),
        )

    # ------------------------------------------------------------------ reads
    def retrieve(self, user_id: str, query: str, **kw: Any) -> Retrieval:
        return self.retrieve_many([(user_id, query)], **kw)[0]

    def retrieve_many(
        self,
        queries: Sequence[tuple[str, str]],
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
        at: float | None = None,
        update_heat: bool = True,
        as_json: bool = False,
    ) -> list[Retrieval] | list[bytes]:
        """One ``retrieve_many`` per shard involved; results in input order (``as_json``: as
        each result's JSON bytes, as one engine writes them). Refused as a whole (before any
        heat changes) when a query is invalid or names an unknown user, as in one engine."""
        if (top_pages is not None and top_pages < 1) or (
            top_segments is not None and top_segments < 1
        ):
            raise InvalidInputError("top_pages and top_segments must be >= 1")
        cleaned = clean_queries(queries)
        with self._gate.enter():
            for uid, _ in cleaned:
                if not self.engine_for(uid).has_user(uid):
                    raise UnknownUserError(f"unknown user {uid!r}")
            out: list[Any] = [None] * len(cleaned)
            for shard, idx in self.shard_map.group(u for u, _ in cleaned).items():
                res = self.engines[shard].retrieve_many(
                    [cleaned[i] for i in idx],
                    top_pages=top_pages,
                    top_segments=top_segments,
                    at=at,
                    update_heat=update_heat,
                    as_json=as_json,
                )
                for i, r in zip(idx, res, strict=True):
                    out[i] = r
            if self.config.auto_process:  # retrievals may have made segments hot: promote
                with self._sync_lock:
                    self._route_facts()
        return [r for r in out if r is not None]

    def respond(self, user_id: str, query: str, **kw: Any) -> Response:
        return self.respond_many([(user_id, query)], **kw)[0]

    def respond_many(self, queries: Sequence[tuple[str, str]], **kw: Any) -> list[Response]:
        out: list[Response | None] = [None] * len(queries)
        with self._gate.enter():
            for shard, idx in self.shard_map.group(u for u, _ in queries).items():
                res = self.engines[shard].respond_many([queries[i] for i in idx], **kw)
                for i, r in zip(idx, res, strict=True):
                    out[i] = r
            self._sync_all()
        return [r for r in out if r is not None]

    # ------------------------------------------------------------------ per-user calls
    def users(self) -> list[str]:
        return [u for e in self.engines for u in e.users()]

    def profile(self, user_id: str) -> dict[str, str]:
        return self.engine_for(user_id).profile(user_id)

    def knowledge(self, user_id: str, *, history: bool = False) -> dict[str, list[dict[str, Any]]]:
        return self.engine_for(user_id).knowledge(user_id, history=history)

    def history(self, user_id: str) -> list[dict[str, Any]]:
        return self.engine_for(user_id).history(user_id)

    def export_user(self, user_id: str) -> dict[str, Any]:
        return self.engine_for(user_id).export_user(user_id)

    def delete_user(self, user_id: str) -> bool:
        """The user's rows on its shard, and what its pages taught the assistants on every
        shard (``sharded_forget.py``)."""
        with self._gate.exclusive():
            home = self.engine_for(user_id)
            return bool(
                sharded_forget.forget_everywhere(
                    self._call, lambda: home.delete_user(user_id), self.shard_map, user_id
                )
            )

    def delete_page(self, page_id: int, *, user_id: str) -> bool:
        """Remove one of the user's pages (ids are per shard: the user names the shard) and
        what it taught: on its shard as one engine does, and the assistant facts it taught on
        every shard (``sharded_forget.py``). False when the user has no such page."""
        with self._gate.exclusive():
            home = self.engine_for(user_id)
            if not _holds(home, user_id, page_id):
                return False
            return bool(
                sharded_forget.forget_everywhere(
                    self._call,
                    lambda: home.delete_page(page_id),
                    self.shard_map,
                    user_id,
                    [page_id],
                )
            )

    def update_page(
        self,
        page_id: int,
        *,
        user_id: str,
        user_input: str | None = None,
        agent_response: str | None = None,
    ) -> dict[str, Any]:
        """Edit one of the user's pages: what its old text taught goes on every shard as for
        :meth:`delete_page`, and the page is re-analysed on its shard (the next
        ``process_pending`` derives what the new text says). :class:`UnknownItemError` (a
        KeyError; 404 over HTTP) when the user has no such page, also when a delete won the
        race for it; bad text is refused before anything is forgotten."""
        sharded_forget.check_edit(user_input, agent_response)
        with self._gate.exclusive():
            home = self.engine_for(user_id)
            if not _holds(home, user_id, page_id):
                raise UnknownItemError(f"user {user_id!r} has no page {page_id}")
            return sharded_forget.forget_everywhere(
                self._call,
                lambda: home.update_page(
                    page_id, user_input=user_input, agent_response=agent_response
                ),
                self.shard_map,
                user_id,
                [page_id],
            )

    def _call(self, shard: int, name: str, args: tuple) -> Any:
        """``call`` of ``sharded_forget``'s steps: a shard engine's method by name."""
        return getattr(self.engines[shard], name)(*args)

    def promote(self, user_id: str, segment_slot: int | None = None) -> int:
        with self._gate.enter():
            n = self.engine_for(user_id).promote(user_id, segment_slot)
            with self._sync_lock:
                self._route_facts()
            return n

    def pending_count(self, user_id: str | None = None) -> int:
        if user_id is not None:
            return self.engine_for(user_id).pending_count(user_id)
        return sum(e.pending_count() for e in self.engines)

    # ------------------------------------------------------------------ whole engine
    def stats(self) -> dict[str, Any]:
        """Sums over the shards, and each shard's own statistics under ``shards``."""
        per = [e.stats() for e in self.engines]
        counters: Counter[str] = Counter()
        for s in per:
            counters.update(s["counters"])
        return {
            "users": sum(s["users"] for s in per),
            "shards": per,
            "shard_count": self.count,
            "arena_bytes": sum(s["arena_bytes"] for s in per),
            "counters": dict(counters),
            "device": per[0]["device"],
            "mode": per[0]["mode"],
            "preset": per[0]["preset"],
        }

    def sync(self) -> None:
        for e in self.engines:
            e.sync()

    def close(self) -> None:
        """Exchange and route what is owed, then close every shard: alone at the gate, so
        calls in flight finish first."""
        with self._gate.exclusive():
            try:
                self._sync_all()
            finally:
                for e in self.engines:
                    e.close()

    def __enter__(self) -> ShardedEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

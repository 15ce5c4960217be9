"""``MemoryEngine``: construction, the public API, and the hooks its parts call back through.

The facade owns the parts (one mechanic each, see the package docstring) and the
:class:`~memoryos_gpu.engine.state.EngineState` they share; each public method is a few lines
that take the lock where needed and delegate. The steps a subclass may replace are the
methods under "hooks": the parts reach them through the engine (never part-to-part), so an
override runs wherever the step does -- from ``add_many``, a derived round, a retrieval's heat
feedback, or the rebuild on open.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import numpy as np

from memoryos_gpu import ops
from memoryos_gpu.arena import Arena, ArenaConfig
from memoryos_gpu.config import EngineConfig, MemoryConfig
from memoryos_gpu.errors import EngineClosedError
from memoryos_gpu.llm.base import LLMBackendError
from memoryos_gpu.stages import ExtractiveStages, LLMStages
from memoryos_gpu.store import SQLiteStore, StoreError, StoreFullError, derivations, open_store
from memoryos_gpu.text.keywords import KeywordExtractor
from memoryos_gpu.text.vocabulary import UserVocabulary
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval

from .derived import DerivedWork
from .heat import Heat
from .items import Items
from .lpm import LongTerm
from .mtm import Segments
from .page_text import page_text
from .rebuild import Rebuild
from .responses import Responder
from .retrieval import RetrievalPipeline
from .state import INHERITED, EngineState, Fact, UserState, WorkItem
from .stm import Prepared, ShortTerm
from .validation import clean_int, clean_item_id, clean_user_id, validate_page, validate_pages

if TYPE_CHECKING:
    import threading

    from memoryos_gpu.page_views import PageViews

T = TypeVar("T")
log = logging.getLogger("memoryos_gpu.engine")


class _Shared(Generic[T]):
    """An engine attribute that is the shared state's (tests, the shard engine and the server
    read it under the engine's name; the state is the one place it lives, so it is read-only
    here -- assigning it would leave the parts on the old object)."""

    def __init__(self, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, engine: None, owner: type) -> _Shared[T]: ...

    @overload
    def __get__(self, engine: MemoryEngine, owner: type | None = None) -> T: ...

    def __get__(self, engine: MemoryEngine | None, owner: type | None = None) -> Any:
        return self if engine is None else getattr(engine._state, self._name)

    def __set__(self, engine: MemoryEngine, value: T) -> None:
        raise AttributeError(f"{self._name} belongs to the engine state and is not reassigned")


class MemoryEngine:
    """MemoryOS for many users: STM, MTM, LPM on a shared arena, batched end to end.

    Parameters
    ----------
    config:
        Everything tunable (:class:`~memoryos_gpu.config.EngineConfig`).
    embedder, llm:
        Optional ready-made components (tests pass doubles); built from ``config`` otherwise.
    hold_pending:
        Keep derived work queued in the store, the work owed at open included, until
        :meth:`release_pending`: :meth:`process_pending` runs nothing meanwhile. For writers
        that leave derived work to another process or to later (``ingest --process defer``,
        a restarted ingest shard), which must not start on the work an earlier run left.

    Notes
    -----
    A subclass changes a step by overriding its hook; the parts call every hook through the
    engine, so the override holds wherever the step runs: ``_open_store`` (the store),
    ``_rebuild`` (loading on open), ``_accept`` (committing pages), ``_learn_keywords`` (the
    keyword statistics of accepted pages), ``process_pending`` (derived work),
    ``_process_pages`` (one round into MTM), ``_process_promotions`` (into LPM) and
    ``_push_knowledge`` (where promoted facts go).

    Every public method starts with ``self._state.check_open()`` (or ``check_process()``,
    for those a closed engine still answers): one attribute read, before any lock or work, so
    that a closed engine refuses at once and an engine a forked child inherited refuses
    (:class:`~memoryos_gpu.errors.EngineForkedError`) instead of writing through its parent's
    store or waiting forever for a lock a parent's thread held at the fork
    (:func:`_disown_inherited`). A new public method does the same
    (``tests/test_engine_fork.py`` calls every one in a child).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        embedder: Any = None,
        llm: Any = None,
        hold_pending: bool = False,
    ) -> None:
        self.config = config or EngineConfig()  # first: the construction hooks read it
        self._hold_pending = hold_pending  # before the open, which resumes owed work
        self._mode_checked = False  # _warn_of_another_mode, once
        # every part a setting can refuse is built before the store is opened: a refusal
        # after it left a new, empty store behind, bound to this run's embedding model (the
        # corrected command was then refused: "store was built with embedding model ...")
        embedder = embedder or self._make_embedder()
        arena = self._make_arena(embedder.dim)  # the device: --device cuda without a GPU
        built_llm = None if llm is not None else self._llm_of_mode()
        try:
            store = self._open_store(self.config)
        except BaseException:
            self._close_built(built_llm)
            raise
        try:
            self._assemble(store, embedder, arena, llm if llm is not None else built_llm)
        except BaseException:
            store.close()  # a failed open gives the store (and its writer claim) back
            self._close_built(built_llm)
            raise

    def _assemble(self, store: SQLiteStore, embedder: Any, arena: Arena, llm: Any) -> None:
        """Build the parts on the open ``store`` and load it (the rest of construction)."""
        m = self.config.memory
        store.check_embedding_model(embedder.model_id, embedder.dim)
        extractor, vocabulary = KeywordExtractor(), UserVocabulary()
        extractive = ExtractiveStages(
            extractor,
            vocabulary=vocabulary,
            continuity_threshold=m.continuity_threshold,
            page_keywords=m.page_keywords,
        )
        self.llm = llm
        stages: ExtractiveStages | LLMStages = extractive
        if self.config.llm.mode == "llm":
            c = self.config.llm
            stages = LLMStages(
                self.llm,
                extractive,
                fused=c.fused,
                max_tokens=c.max_tokens,
                temperature=c.temperature,
                batch_size=c.batch_size,
            )
        self._state = state = EngineState(
            self.config,
            embedder=embedder,
            store=store,
            arena=arena,
            extractor=extractor,
            vocabulary=vocabulary,
            stages=stages,
        )
        self._heat = Heat(state, self)
        self._stm = ShortTerm(state, self)
        self._mtm = Segments(state, self._heat)
        self._lpm = LongTerm(state, self._heat, self)
        self._derived = DerivedWork(state, self)
        self._retrieval = RetrievalPipeline(state, self._heat)
        self._responder = Responder(state, self)
        self._items = Items(state, self._heat)
        self._rebuilder = Rebuild(state, self)
        state.reload = self._reload
        _OPEN.add(self)  # before the rebuild: a fork meanwhile (another thread) disowns it too
        self._rebuild()

    # ================================================================== construction hooks
    def _make_embedder(self) -> Any:
        """The embedder ``config`` names (called only when none was passed)."""
        from memoryos_gpu.embed import make_embedder

        return make_embedder(self.config)

    def _make_arena(self, dim: int) -> Arena:
        """The arena of ``config`` for embeddings of ``dim`` (and the CPU kernels' threads),
        before the store is opened: it is where an unusable ``device`` (CUDA that torch does
        not see) is refused."""
        m = self.config.memory
        if self.config.cpu_threads is not None:
            ops.set_cpu_threads(self.config.cpu_threads)
        return Arena(
            ArenaConfig(
                dim=dim,
                segment_slots=m.mtm_capacity,
                keyword_width=m.keyword_width,
                knowledge_capacity=m.knowledge_capacity,
                device=self.config.resolved_device(),
                gpu_dtype=self.config.gpu_dtype,
            )
        )

    def _llm_of_mode(self) -> Any:
        """The LLM backend this engine builds (:meth:`_make_llm`) in LLM mode, else None:
        built before the store is opened, so that a backend its settings cannot build (an
        option it does not take, a model file or package that is missing) leaves no store."""
        return self._make_llm() if self.config.llm.mode == "llm" else None

    @staticmethod
    def _close_built(llm: Any) -> None:
        """Close a backend this engine built for an open that then failed (a loaded local
        model holds GPU memory; an HTTP backend, its connections); errors closing it would
        hide the open's own, so they are logged."""
        if llm is None:
            return
        try:
            llm.close()
        except Exception as exc:  # the open's error is the one to raise
            log.warning("closing the LLM backend of a failed open: %s: %s", type(exc).__name__, exc)

    def _make_llm(self) -> Any:
        """The LLM backend ``config.llm`` names (LLM mode, when none was passed); a setting
        the backend cannot be built from raises ``LLMConfigError`` naming it as the user
        sets it (flag / config key)."""
        from memoryos_gpu.config import llm_settings_problem
        from memoryos_gpu.llm.base import LLMConfigError
        from memoryos_gpu.llm.factory import make_backend

        c = self.config.llm
        problem = llm_settings_problem(c)  # the CLI checks the same rule before the open
        if problem:
            raise LLMConfigError(problem)
        # a dedicated setting wins over the same option (flag > env > file: the CLI puts a
        # flag in the option's place, and LLMConfig refuses a file giving both)
        dedicated = {"model": c.model}
        if c.backend == "openai":
            dedicated.update(base_url=c.base_url, api_key=c.api_key)
        options = {**c.options, **{k: v for k, v in dedicated.items() if v}}
        return make_backend(c.backend, **options)

    def _open_store(self, config: EngineConfig) -> SQLiteStore:
        """Hook: the store this engine reads and writes (a shard engine returns its view of a
        shared store). Called once, before anything is loaded."""
        return open_store(config.store, key=config.encryption_key, cache_mb=config.store_cache_mb)

    def _rebuild(self) -> None:
        """Hook: load the store into the arena and resume pending work (on open)."""
        self._rebuilder.rebuild()

    def _reload(self) -> None:
        """The in-memory state again from the store after an apply failed halfway (see
        ``EngineState.write_transaction``); the heat credits not yet written name slots of
        the arena it replaces, so they go (heat: lost at most, docs/storage.md)."""
        log.warning("an apply failed halfway: reloading the in-memory state from the store")
        self._heat.discard()
        self._rebuilder.reload()

    # ================================================================== hooks the parts call
    def _accept(self, items: list[PageInput], prepared: Prepared | None = None) -> list[AddResult]:
        """Hook: commit validated pages (and their STM overflow) in one transaction, taking
        the engine lock for its statements (``prepared``: their embeddings, made outside the
        lock by ``add_many``)."""
        return self._stm.accept(items, prepared)

    def _learn_keywords(self, texts: list[str]) -> None:
        """Hook: the texts of newly accepted pages, once committed, for the keyword statistics
        (a shard engine also keeps them for its exchange with the other shards)."""
        self.extractor.update(texts)

    def _unlearn_keywords(self, texts: list[str]) -> None:
        """Hook: take back :meth:`_learn_keywords` of a batch whose transaction rolled back
        (the statistics count committed pages only, once each)."""
        self.extractor.remove(texts)

    def process_pending(
        self,
        max_batch: int | None = None,
        max_rounds: int | None = None,
        until: Callable[[], bool] | None = None,
    ) -> dict[str, int]:
        """Run every pending derived item (chain, MTM, promotion) to completion (or at most
        ``max_rounds`` page rounds, or until ``until()`` is true between two rounds: a stop
        asked meanwhile), after writing the heat retrievals credited (which queues the
        promotions they earned).

        Rounds of at most ``max_batch`` (default ``config.derived_max_batch``) pages, one per
        user, so each user's pages keep their order; safe at any time and after a crash (see
        :mod:`memoryos_gpu.engine.derived`). Also a hook: the rebuild on open resumes pending
        work through it. Nothing runs while the engine holds derived work (``hold_pending``).
        """
        self._state.check_open()
        if self._hold_pending:
            return {"pages": 0, "promotions": 0}
        self._warn_of_another_mode()
        self._heat.write_behind()
        return self._derived.process_pending(max_batch, max_rounds, until)

    def _warn_of_another_mode(self) -> None:
        """Once an engine: one without an LLM about to derive the pending work of a store an
        LLM derived says so -- an operator who left out the LLM settings (or a command run
        without them) would otherwise turn that work extractive for good, silently."""
        if self._mode_checked:
            return
        self._mode_checked = True
        pending = self.store.count_pending() if self.stages.mode == "extractive" else 0
        if pending and self.store.llm_derived():
            log.warning(
                "this store's pages were derived by an LLM and this engine runs without one: "
                "its %d pending derived item(s) are derived extractively, for good (to keep "
                "the LLM, open the store with its LLM settings: --llm-mode llm ...)",
                pending,
            )

    def release_pending(self) -> None:
        """Stop holding derived work back (``hold_pending``): the next :meth:`process_pending`
        runs it."""
        self._state.check_process()
        self._hold_pending = False

    def _process_pages(self, items: list[WorkItem]) -> int:
        """Hook: apply one derived round of pages to MTM (segments, chain, heat); returns the
        items taken off the queue. Called without the engine lock: it takes the lock to read
        and to apply, and runs the stages between without it."""
        return self._mtm.process_pages(items)

    def _process_promotions(self) -> int:
        """Hook: run the queued promotions into LPM; returns how many were processed. Called
        under the derived-work lease, without the engine lock (as ``_process_pages``)."""
        return self._lpm.process_promotions()

    def _push_knowledge(self, db: Any, facts: list[Fact], emb: np.ndarray) -> None:
        """Hook: where the facts a promotion found go, inside its transaction (default: every
        fact into its owner's ring; a shard engine sends assistant facts to their owner)."""
        self._lpm.push_knowledge(db, facts, emb)

    # ================================================================== pages
    def add(
        self,
        user_id: str,
        user_input: str,
        agent_response: str = "",
        *,
        timestamp: float | str | datetime | None = None,
        assistant_id: str | None = None,
        source: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> AddResult:
        """Remember one exchange (committed to the store before this returns)."""
        return self.add_many(
            [
                PageInput(
                    user_id, user_input, agent_response, timestamp, assistant_id, source, meta or {}
                )
            ]
        )[0]

    def add_many(self, pages: Iterable[PageInput | dict[str, Any]]) -> list[AddResult]:
        """Remember many exchanges of many users, in order per user, as one transaction.

        Pages whose ``source`` was accepted before are skipped (``duplicate=True``). Derived work
        runs afterwards when ``config.auto_process`` (else call :meth:`process_pending`); the
        pages are committed by then, so a failure of that work never makes this raise
        (:meth:`_process_owed`).
        """
        self._state.check_open()
        items = validate_pages(pages)
        # a disk known full refuses before the embeddings, which the refusal would waste
        self._state.full_disk.check(trying=False)
        prepared = self._stm.prepare(items)  # embedding: outside the lock, others go on
        results = self._accept_durably(items, prepared)
        if self.config.auto_process:  # outside the lock: its stages run without it
            self._process_owed()
        return results

    def _process_owed(self) -> None:
        """The derived work committed pages owe, run now: after an accepted batch
        (``auto_process``) and when the engine opens on a store with pending work.

        Why it does not raise: the pages are committed and their work is pending in the store,
        so a failure here (an LLM server down, a full disk) loses nothing -- the work is
        retried by the next :meth:`process_pending` -- whereas raising would cost an ``add``
        its page ids (a retry would store the pages twice) and an open the whole store (no
        retrieval, which needs no LLM, until the LLM is back). The failure is logged and
        counted (``stats()["counters"]["derived_failures"]``; of them, those the store failed
        also as ``derived_store_failures``, those for a full disk as ``derived_disk_full`` and
        those the LLM could not do (down, failing every request, its breaker open:
        ``LLMBackendError``) as ``derived_llm_failures``, so that a caller such as ``ingest``
        can say why the run's work stayed pending); an engine closed meanwhile resumes the
        work when the store is opened again. KeyboardInterrupt and SystemExit still
        propagate."""
        try:
            self.process_pending()
        except EngineClosedError:
            log.debug("engine closed during the derived work of an add; it stays pending")
        except Exception as exc:
            self.count_derived_failure(exc)
            log.warning(
                "derived work failed; it stays pending and is retried by the next "
                "process_pending: %s: %s",
                type(exc).__name__,
                exc,
            )

    def count_derived_failure(self, exc: BaseException) -> None:
        """Count one failed derived round in :attr:`counters`: ``derived_failures``, and of
        them ``derived_store_failures`` (the store failed), ``derived_disk_full`` (a full
        disk) and ``derived_llm_failures`` (the LLM could not be used: ``LLMBackendError``).

        Why a method of its own: derived work fails in the engine's own :meth:`_process_owed`
        and in the rounds a caller drives (the server's derived-work thread), and both must
        show in the same counters (``stats()``, the server's ``/metrics`` and ``/v1/stats``);
        a failure counted in one place only left the server's reporting 0 while its log said
        every round failed."""
        self._state.check_process()
        with self._lock:
            c = self.counters
            c["derived_failures"] += 1
            if isinstance(exc, StoreError):
                c["derived_store_failures"] = c.get("derived_store_failures", 0) + 1
            if isinstance(exc, StoreFullError):
                c["derived_disk_full"] = c.get("derived_disk_full", 0) + 1
            if isinstance(exc, LLMBackendError):
                c["derived_llm_failures"] = c.get("derived_llm_failures", 0) + 1

    def _accept_durably(
        self, items: list[PageInput], prepared: Prepared | None = None
    ) -> list[AddResult]:
        """Write the pages under the engine lock, commit them after it (``_accept``), then
        wait for the disk: neither the commit nor the flush (each about as long as the
        statements) holds up the retrievals and derived work that wait for the lock. The
        pages are acknowledged after both."""
        results = self._accept(items, prepared)
        self.store.sync()
        return results

    def validate_page(self, p: PageInput | dict[str, Any]) -> PageInput:
        """The normalised page ``add_many`` would store, or InvalidInputError saying why not
        (lets a bulk reader reject one record without failing its batch)."""
        self._state.check_process()
        return validate_page(p)

    def page_text(self, page: Any) -> str:
        """The text a page is embedded and keyword-indexed from (``PageInput`` or store row)."""
        self._state.check_process()
        return page_text(page, self.memory.embed_dates)

    def flush(self) -> dict[str, int]:
        """Finish the derived work pending now (read-your-writes for a following retrieval);
        pages other threads add meanwhile wait for the next call (``process_pending``)."""
        return self.process_pending()

    def pending_count(self, user_id: str | None = None) -> int:
        """Derived work still owed: the whole store's, or ``user_id``'s."""
        self._state.check_open()
        return self.store.count_pending(None if user_id is None else clean_user_id(user_id))

    # ================================================================== retrieval, response
    def retrieve(
        self,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
        at: float | None = None,
        sources: bool = False,
    ) -> Retrieval:
        """STM whole, the top MTM pages, and LPM profile + knowledge for one query."""
        return self.retrieve_many(
            [(user_id, query)],
            top_pages=top_pages,
            top_segments=top_segments,
            at=at,
            sources=sources,
        )[0]

    def retrieve_many(
        self,
        queries: Sequence[tuple[str, str]],
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
        at: float | None = None,
        update_heat: bool = True,
        sources: bool = False,
        as_json: bool = False,
    ) -> list[Retrieval] | list[bytes]:
        """Many users' queries in one batched pass: one embedding batch, one call per kernel,
        then heat feedback (unless ``update_heat=False``); ``sources``: knowledge entries
        name the pages they were derived from; ``as_json``: each result as the UTF-8 bytes of
        its JSON object (every field but ``user_id``; what the server answers), written
        natively with no Python object per page."""
        self._state.check_open()
        return self._retrieval.retrieve_many(
            queries,
            top_pages=top_pages,
            top_segments=top_segments,
            at=at,
            update_heat=update_heat,
            sources=sources,
            as_json=as_json,
        )

    def respond(self, user_id: str, query: str, **kw: Any) -> Response:
        """Answer with memory (retrieve, prompt the LLM), then remember the exchange."""
        return self.respond_many([(user_id, query)], **kw)[0]

    def respond_many(
        self,
        queries: Sequence[tuple[str, str]],
        *,
        timestamp: float | str | datetime | None = None,
        assistant_id: str | None = None,
    ) -> list[Response]:
        """Answer many users at once: one retrieval pass, one LLM batch, one add_many."""
        self._state.check_open()
        return self._responder.respond_many(queries, timestamp=timestamp, assistant_id=assistant_id)

    # ================================================================== LPM
    def promote(self, user_id: str, segment_slot: int | None = None) -> int:
        """Force promotion of a user's segments now (all with unanalysed pages, or one slot):
        what the reference calls mid-term analysis. Returns the promotions processed."""
        self._state.check_open()
        if segment_slot is not None:
            segment_slot = clean_int(segment_slot, "segment_slot", 0, self.arena.segment_width - 1)
        with self._derived.lease():
            with self._state.locked():  # writes the store: the rewrite gate first (state.py)
                self._lpm.queue_promotions(user_id, segment_slot)
            return self._process_promotions()

    def profile(self, user_id: str) -> dict[str, str]:
        self._state.check_open()  # before the lock: a forked child's may never be released
        with self._lock:
            self._state.check_open()  # read from memory only: no store check on the way
            return self._lpm.profile(user_id)

    def knowledge(self, user_id: str, *, history: bool = False) -> dict[str, list[dict[str, Any]]]:
        """Live user knowledge and the user's assistant's knowledge, oldest first, each entry
        with its sources and validity; ``history``: superseded and dropped entries too."""
        self._state.check_open()
        return self._lpm.knowledge(clean_user_id(user_id), history)

    def knowledge_sources(self, entry_ids: Sequence[int]) -> dict[int, list[int]]:
        """The source page ids of knowledge entries, by entry id (one store query)."""
        self._state.check_open()
        ids = [clean_item_id(e, "entry_id") for e in entry_ids]
        return derivations.sources(self.store, derivations.KNOWLEDGE, ids)

    def get_knowledge(self, entry_id: int) -> dict[str, Any] | None:
        """One knowledge entry (live or not) with its sources, validity and strength."""
        self._state.check_open()
        entry_id = clean_item_id(entry_id, "entry_id")
        return self.store.knowledge_rows([entry_id]).get(entry_id)

    # ================================================================== item-level control
    def get_page(self, page_id: int) -> dict[str, Any] | None:
        """One page (any tier) by id, or None. Every method taking a page or entry id checks
        it first (``clean_item_id``): a NumPy integer, a float or an out-of-range value would
        otherwise reach SQL and match nothing, silently."""
        self._state.check_open()
        return self._items.get_page(clean_item_id(page_id, "page_id"))

    def list_pages(
        self, user_id: str, offset: int = 0, limit: int = 100
    ) -> tuple[list[dict[str, Any]], int]:
        """One window of a user's pages (every tier), oldest first, and the user's total."""
        self._state.check_open()
        return self._items.list_pages(user_id, offset, limit)

    def update_page(
        self, page_id: int, *, user_input: str | None = None, agent_response: str | None = None
    ) -> dict[str, Any]:
        """Edit a page's text; its embedding (and its arena row, when in MTM) follow."""
        self._state.check_open()
        return self._items.update_page(
            clean_item_id(page_id, "page_id"), user_input=user_input, agent_response=agent_response
        )

    def delete_page(self, page_id: int) -> bool:
        self._state.check_open()
        return self._items.delete_page(clean_item_id(page_id, "page_id"))

    def update_knowledge(self, entry_id: int, text: str) -> dict[str, Any]:
        self._state.check_open()
        return self._items.update_knowledge(clean_item_id(entry_id, "entry_id"), text)

    def delete_knowledge(self, entry_id: int) -> bool:
        self._state.check_open()
        return self._items.delete_knowledge(clean_item_id(entry_id, "entry_id"))

    def history(self, user_id: str) -> list[dict[str, Any]]:
        """Append-only audit of changes to the user's memory."""
        self._state.check_open()
        return self._items.history(user_id)

    def users(self) -> list[str]:
        self._state.check_open()  # before the lock: a forked child's may never be released
        with self._lock:
            self._state.check_open()  # read from memory only: no store check on the way
            return list(self._users)

    def export_user(self, user_id: str) -> dict[str, Any]:
        """Everything held about a user, derived profile and knowledge included (JSON-ready)."""
        self._state.check_open()
        return self._items.export_user(user_id)

    def delete_user(self, user_id: str) -> bool:
        """Remove every row and arena slot held about the user."""
        self._state.check_open()
        return self._items.delete_user(user_id)

    # ================================================================== whole engine
    def stats(self) -> dict[str, Any]:
        """The engine's figures. The store's row counts are read before the engine lock is
        taken: they scan the pages' index (~20 ms at 60,000 pages), which every retrieval
        waited for when a monitor scraped ``/v1/stats``."""
        self._state.check_open()
        counts = self.store.counts()
        with self._lock:
            return {
                "users": len(self._users),
                "store": counts,
                "arena_bytes": self.arena.nbytes(),
                "device": "cuda" if self.arena.on_cuda else "cpu",
                "mode": self.stages.mode,
                "preset": self.memory.preset,
                "counters": dict(self.counters),
                "views": self._views.stats(),
                "retrieval": dict(self._retrieval.timing),
                "heat_marks_unwritten": self._heat.pending_marks(),
                "llm": self.stages.stats.as_dict(),
                "embedder": getattr(getattr(self.embedder, "stats", None), "__dict__", {}),
                "native": ops.build_info(),
            }

    def write_behind(self) -> dict[str, int]:
        """Write the heat statistics retrievals changed and queue the promotions they earned
        (retrievals only buffer them; the server's background worker calls this every
        second). Returns ``{"segments": written, "promotions": queued}``."""
        self._state.check_open()
        return self._heat.write_behind()

    def sync(self) -> None:
        """Write retrieval-driven heat statistics to the store now (see :meth:`write_behind`)."""
        self._state.check_open()
        self._heat.write_behind()

    def close(self) -> None:
        """Write what is buffered and close the store, once a round in flight has finished.

        Idempotent (a ``with`` block around an explicit ``close`` is common). An ``add``
        committing meanwhile finishes first (the store closes under the store lock its
        commit holds) and is acknowledged; every call after this raises
        :class:`~memoryos_gpu.errors.EngineClosedError`.

        In a forked child of the process that opened the engine it does nothing: the store,
        its writer lock and the LLM client are the parent's (closing them cleared the parent's
        lock record), and a lock a parent's thread held would never be released here."""
        if self._state.forked:
            return
        # the rewrite gate before the engine lock (state.py): a close that comes during a
        # rewrite of the file waits for it there, not holding up the retrievals meanwhile
        with self._derived.lease(), self._state.locked():
            if self._state.closed:
                return
            try:
                self._heat.write_behind()
                self._derived.save_extractor()
            finally:  # closed even if the last writes fail: the store is released
                self._state.closed = True
                _OPEN.discard(self)
                self.store.close()
                if self.llm is not None:
                    self.llm.close()

    def __enter__(self) -> MemoryEngine:
        self._state.check_open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ================================================================== async twins
    async def aadd_many(self, pages: Iterable[PageInput | dict[str, Any]]) -> list[AddResult]:
        return await asyncio.to_thread(self.add_many, list(pages))

    async def aretrieve_many(
        self, queries: Sequence[tuple[str, str]], **kw: Any
    ) -> list[Retrieval]:
        return await asyncio.to_thread(self.retrieve_many, queries, **kw)

    async def arespond_many(self, queries: Sequence[tuple[str, str]], **kw: Any) -> list[Response]:
        return await asyncio.to_thread(self.respond_many, queries, **kw)

    async def aflush(self) -> dict[str, int]:
        return await asyncio.to_thread(self.flush)

    # ================================================================== shared state
    # the state's attributes under the names tests, the shard engine and the server read
    @property
    def memory(self) -> MemoryConfig:
        return self.config.memory

    _lock: _Shared[threading.RLock] = _Shared("lock")
    store: _Shared[SQLiteStore] = _Shared("store")
    arena: _Shared[Arena] = _Shared("arena")
    embedder: _Shared[Any] = _Shared("embedder")
    extractor: _Shared[KeywordExtractor] = _Shared("extractor")
    stages: _Shared[ExtractiveStages | LLMStages] = _Shared("stages")
    counters: _Shared[dict[str, int]] = _Shared("counters")
    _views: _Shared[PageViews] = _Shared("views")
    _users: _Shared[dict[str, UserState]] = _Shared("users")
    _assistant_owner: _Shared[dict[str, int]] = _Shared("assistant_owner")
    _page_of_slot: _Shared[np.ndarray] = _Shared("page_of_slot")
    _segment_of: _Shared[np.ndarray] = _Shared("segment_of")
    _entry_of_ring: _Shared[np.ndarray] = _Shared("entry_of_ring")

    def _user(self, user_id: str) -> UserState:
        return self._state.user(user_id)

    def _assistant_slot(self, assistant_id: str) -> int:
        return self._state.assistant_slot(assistant_id)

    def _grow_maps(self) -> None:
        self._state.grow_maps()


#: The engines open in this process, which a forked child disowns (:func:`_disown_inherited`).
_OPEN: weakref.WeakSet[MemoryEngine] = weakref.WeakSet()


def _disown_inherited() -> None:
    """In a forked child (``os.register_at_fork``): every engine the parent had open refuses
    every call from now on (:class:`~memoryos_gpu.errors.EngineForkedError`), and nothing it
    holds is closed or finalized here (kept in :data:`~memoryos_gpu.engine.state.INHERITED`).

    Why at the fork and not a pid check per call: the check stays one attribute read
    (``EngineState.check_open``, which every public call starts with), where ``os.getpid``
    would be a system call per call. Why refuse at all: gunicorn ``--preload``, Celery's
    prefork pool and multiprocessing's fork start method hand the parent's engine to each
    child, whose writes then collided with the parent's in the one store (``UNIQUE
    constraint failed``), left pages pending with no work queued, or hung on a lock a
    parent's thread held at the fork."""
    for engine in list(_OPEN):
        INHERITED.append(dict(vars(engine)))  # its LLM client and parts: never finalized here
        engine._state.disown()
    _OPEN.clear()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_disown_inherited)

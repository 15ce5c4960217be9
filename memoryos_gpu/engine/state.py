"""The state every part of the engine works on, and the hooks the parts call back through.

One :class:`EngineState` per engine holds what the tiers share: the arena (the batched
kernels' struct-of-arrays, the lexical index among them), the store it caches, the embedder,
the keyword statistics, the LLM stages, the in-memory views of pages, knowledge and profiles,
the per-user records and the maps from arena slots back to store ids.
The parts (``stm``, ``mtm``, ``heat``, ``lpm``, ``retrieval``, ...) are small classes that
hold this object, so a newcomer reads one mechanic in one file and every part sees the same
slots; none of them keeps a copy of anything here (the maps are replaced when the arena grows).

Steps a subclass of :class:`~memoryos_gpu.engine.MemoryEngine` may replace (the shard engine
does) are reached through :class:`EngineHooks`, never called part-to-part, so an override
takes effect wherever the step runs.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from memoryos_gpu import _C
from memoryos_gpu.arena import Arena
from memoryos_gpu.config import EngineConfig, MemoryConfig
from memoryos_gpu.errors import EngineClosedError, EngineForkedError, UnknownUserError
from memoryos_gpu.page_views import PageViews
from memoryos_gpu.shared_gate import SharedGate
from memoryos_gpu.stages import ExtractiveStages, LLMStages
from memoryos_gpu.store import SQLiteStore, StoreFullError
from memoryos_gpu.store.rows import select_in
from memoryos_gpu.store.sqlite import Durability
from memoryos_gpu.store.write_gate import NO_REWRITES, NoRewrites
from memoryos_gpu.text.keywords import KeywordExtractor, hash_keyword
from memoryos_gpu.text.vocabulary import UserVocabulary
from memoryos_gpu.types import AddResult, PageInput, Retrieval

from .full_disk import FullDiskGate

T = TypeVar("T")

DEFAULT_ASSISTANT = "default"

#: In a forked child: what the parent's engines held (their stores, connections, writer locks,
#: clients), kept referenced for the child's lifetime so that nothing of it is ever closed or
#: finalized there -- closing the child's copy of a store cleared the parent's writer-lock
#: record, and SQLite forbids using a connection across a fork, closing included.
INHERITED: list[Any] = []


class Fact(NamedTuple):
    """A fact a promotion found, on its way into its owner's ring. The first four fields are
    what a plain 4-tuple carries (the shard engine's outbox passes those: no provenance)."""

    kind: str  # owner kind, "user" | "assistant"
    owner_id: str
    text: str
    mode: str
    pages: tuple[int, ...] = ()  # the pages it was derived from
    source_user: str | None = None  # whose pages those are
    valid_from: float | None = None  # the newest of those pages' timestamps
    decision: tuple[str, int | None] | None = None  # the LLM's (action, entry id), if any


WorkItem = tuple[int, str, int]  # a pending row: (work id, user id, ref: page or segment id)


@dataclass
class UserState:
    """What the engine keeps in memory about one user (the store holds the rest)."""

    user_id: str
    assistant_id: str
    slot: int  # arena user slot
    owner: int  # arena knowledge-ring owner slot of the user's knowledge
    clock: float = 0.0  # logical clock: the newest page timestamp seen
    next_seq: int = 0
    chain_tail: int | None = None
    chain_meta: str | None = None
    stm: deque = field(default_factory=deque)  # page ids, oldest first
    # page ids pushed out of STM whose derived work has not placed them in MTM yet, oldest
    # first: a retrieval shows them with the STM (engine.assembly), or they would be in no
    # tier it shows until a round runs (with the LLM down, for as long as it is down)
    pending: deque = field(default_factory=deque)
    extra: Any = None  # the user's last page metadata as a read-only dict, shared by its views


class EngineHooks(Protocol):
    """The engine's overridable steps, as the parts call them (the facade implements them).

    A part never calls another part's version of these directly: it calls the engine, so a
    subclass (:class:`~memoryos_gpu.distributed.ShardEngine`, a test's spy) sees every call.
    """

    def process_pending(
        self,
        max_batch: int | None = None,
        max_rounds: int | None = None,
        until: Callable[[], bool] | None = None,
    ) -> dict[str, int]: ...

    def _process_owed(self) -> None: ...

    def _process_pages(self, items: list[WorkItem]) -> int: ...

    def _process_promotions(self) -> int: ...

    def _push_knowledge(self, db: Any, facts: list[Fact], emb: np.ndarray) -> None: ...

    def _learn_keywords(self, texts: list[str]) -> None: ...

    def _unlearn_keywords(self, texts: list[str]) -> None: ...

    def add_many(self, pages: Iterable[PageInput | dict[str, Any]]) -> list[AddResult]: ...

    def retrieve_many(self, queries: Sequence[tuple[str, str]], **kw: Any) -> list[Retrieval]: ...


#: What :meth:`EngineState.replaced` swaps out: everything loaded from the store.
_LOADED = (
    "arena",
    "views",
    "profiles",
    "users",
    "user_of_slot",
    "assistant_owner",
    "page_of_slot",
    "segment_of",
    "entry_of_ring",
)


class EngineState:
    """The shared state, plus the slot bookkeeping that keeps its maps in step with the arena.

    ``page_of_slot[pool slot]`` -> page id, ``segment_of[user slot, segment slot]`` -> segment
    id, ``entry_of_ring[owner slot, ring position]`` -> knowledge entry id (-1: empty);
    ``assistant_owner[assistant id]`` -> the owner slot of that assistant's ring.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        embedder: Any,
        store: SQLiteStore,
        arena: Arena,
        extractor: KeywordExtractor,
        vocabulary: UserVocabulary,
        stages: ExtractiveStages | LLMStages,
    ) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.embedder = embedder
        self.store = store
        # what a store section waits at, before the engine lock, while the store's erasure
        # thread rewrites its file (locked(), store/write_gate.py); kept here, so that a forked
        # child's stand-in store is never asked for it
        self.gate: SharedGate | NoRewrites = getattr(store, "rewrite_gate", NO_REWRITES)
        self.arena = arena
        self.extractor = extractor
        self.vocabulary = vocabulary  # each user's document frequencies (extractive keywords)
        self.stages = stages
        # item-level changes (a page edited or deleted, a user deleted) so far: derived work
        # reads its inputs, runs its stages without the lock, and compares texts it read again
        # only when this moved meanwhile
        self.edits = 0
        # changes to the queue of pending pages other than deletions (pages queued as they
        # leave STM, rounds applied): a drain's queue read once (derived.py) holds while this
        # and ``edits`` move only by its own rounds
        self.queue_changes = 0
        # what reloads the in-memory state from the store (the engine sets it: Rebuild.reload),
        # and whether a failed apply's reload is still owed (write_transaction)
        self.reload: Callable[[], None] | None = None
        self.reload_owed = False
        self._claims_lost = store.claims_lost  # a new loss: another writer may have written
        # a full disk that cost a reload: writes refused at once until it has room
        self.full_disk = FullDiskGate(getattr(store, "path", None))
        # set by MemoryEngine.close (under the lock): every write and retrieval refuses from
        # then on (check_open), the store's statements too (StoreClosedError)
        self.closed = False
        # the process that opened the engine, and whether this is a forked child of it (set
        # by the fork hook, ``disown``): then every call refuses (check_process, check_open)
        self.pid = os.getpid()
        self.forked = False
        self._empty()
        self.counters = {
            "pages_added": 0,
            "duplicates_skipped": 0,
            "retrievals": 0,
            "retrieval_tokens": 0,
            "responses": 0,
            "segments_created": 0,
            "segments_evicted": 0,
            "promotions": 0,
            "derived_failures": 0,  # failed derived rounds (left pending): inline or a server's
        }

    def _empty(self) -> None:
        """The users, their records, views and slot maps, empty (on a fresh arena)."""
        arena, m = self.arena, self.config.memory
        # what retrievals show of pages and knowledge entries, and every user's profile, in
        # memory: assembling a retrieval reads nothing from the store (page_views.py)
        self.views = PageViews()
        self.profiles: dict[str, dict[str, Any]] = {}
        self.users: dict[str, UserState] = {}
        self.user_of_slot: dict[int, str] = {}  # arena user slot -> user id
        self.assistant_owner: dict[str, int] = {}
        self.page_of_slot = np.full(arena.page_live.shape[0], -1, np.int64)
        self.segment_of = np.full((arena.user_capacity, arena.segment_width), -1, np.int64)
        self.entry_of_ring = np.full((arena.owner_capacity, m.knowledge_capacity), -1, np.int64)

    @contextmanager
    def replaced(self) -> Iterator[None]:
        """Everything loaded from the store dropped (a fresh arena of the same shape, no
        users, empty views and per-user keyword statistics) for the body to load it again;
        if the body fails, the previous state is put back: a half-loaded one must not serve.
        Under the engine lock."""
        old = {k: getattr(self, k) for k in _LOADED}
        counts = self.vocabulary.clear()
        self.arena = Arena(self.arena.config)
        self._empty()
        try:
            yield
        except BaseException:
            for k, v in old.items():
                setattr(self, k, v)
            self.vocabulary.restore(counts)
            raise
        self.edits += 1  # rounds read before the reload find their users changed

    def owns_lock(self) -> bool:
        """Whether this thread holds the engine lock. Asked of the lock itself
        (``RLock._is_owned``, what ``threading.Condition`` relies on, the derived lease's
        included) rather than of a flag set by :meth:`locked`: the lock is also taken directly
        (a retrieval, the shard engine, ``sharded_forget``), and a nested write under such a
        holder must not wait at the gate either."""
        return bool(self.lock._is_owned())  # type: ignore[attr-defined]

    @contextmanager
    def using_store(self) -> Iterator[None]:
        """Inside the store's rewrite gate for the body (:mod:`~memoryos_gpu.store.write_gate`):
        waits while the erasure thread rewrites the file, unless this thread holds the engine
        lock already (then it must not wait: the deadlock rule there). For a section that
        touches the store and takes the engine lock on the way (or waits for a lock taken
        under it: the heat write-behind); enter it before the engine lock."""
        with self.gate.enter(wait=not self.owns_lock()):
            yield

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The engine lock for a section that touches the store under it: the rewrite gate
        first (:meth:`using_store`), then the lock. Why: a write that took the engine lock
        and then waited for the store lock through a rewrite of the file held up every
        retrieval for the rest of it (seconds on a large store); at the gate it waits holding
        nothing. A section that reads memory only (a retrieval) takes the plain lock: it
        never waits at the gate."""
        with self.using_store(), self.lock:
            yield

    @contextmanager
    def write_transaction(
        self,
        durability: Durability = "none",
        *,
        reload_on_error: bool = True,
        undo: Callable[[], None] | None = None,
    ) -> Iterator[Any]:
        """The engine lock and a store transaction for a write that changes the in-memory
        state as it goes (accepting pages, applying derived work), committed once the engine
        lock is released.

        The body changes memory and writes the store under the lock; the COMMIT (SQLite
        appending the transaction's pages to its log, PostgreSQL a round trip) needs only the
        store's own lock, so retrievals, which read memory only, go on meanwhile, and another
        writer waits for the store as it would have waited for the engine lock (the serving
        pattern replayed in one process: the engine lock held ~1/6 less of the time). A
        retrieval may thus show a write a moment before it is committed; acknowledging it
        still waits for the commit (and the caller's ``sync``). Lock order stays gate, engine,
        then store (:meth:`locked`): nothing waits for the engine lock while holding the store,
        and a write that comes during a rewrite of the file waits at the store's gate, before
        the engine lock, its COMMIT included (inside the gate). The store never
        hands out an id twice in a process, even a rolled-back one's (``store.new_ids``).

        If the body raises, the transaction rolls back and -- ``reload_on_error``, for a body
        that does not undo its own memory changes, or if the body set ``reload_owed`` -- the
        state is reloaded from the store under the lock: the memory was changed halfway (a
        segment in the arena whose row was never committed, a page appended twice when the
        item is retried), and what the store committed is the truth; a reload that fails
        (the store still unreachable) is owed, done first by the next write. If the
        COMMIT fails, the state is reloaded: what the store committed is the truth, and
        derived work is redone from its pending rows. A caller that holds the engine lock
        already commits under it.

        ``undo``: what takes the body's changes to state the reload does not rebuild (the
        keyword statistics: a reload keeps them) back out, run under the engine lock before
        the reload whenever the body or the COMMIT fails, so that state counts committed rows
        only. After a failed COMMIT it runs once the engine lock is free again: a keyword
        statistics save that got the store first (``close``, a derived round's periodic save)
        may still persist the body's texts under a watermark without them, until the next
        save (``close``'s) rewrites the copy.

        A full disk that cost a reload makes the next writes fail at once, before they touch
        memory or the store, until the disk has room (:mod:`~memoryos_gpu.engine.full_disk`):
        each retry against it would otherwise stall every retrieval for a reload."""
        self.full_disk.check()
        with self.using_store():
            yield from self._write_transaction(durability, reload_on_error, undo)

    def in_write_transaction(
        self,
        body: Callable[[Any], T],
        durability: Durability = "none",
        *,
        reload_on_error: bool = True,
        undo: Callable[[], None] | None = None,
    ) -> T:
        """``body(db)`` in :meth:`write_transaction` (same arguments); returns what it returns.

        Not a ``with``: a ``with``'s entry and exit run outside the statement's protection, so
        a Ctrl-C landing as the exit (or the entry) began left the transaction open and the
        engine lock held until the garbage collector closed the generator (every other
        thread's call waiting meanwhile). Here both run inside the ``try``: an interrupt
        anywhere rolls back what is still open, or finds the COMMIT done."""
        tx = self.write_transaction(durability, reload_on_error=reload_on_error, undo=undo)
        try:
            db = tx.__enter__()
            out = body(db)
            tx.__exit__(None, None, None)  # the COMMIT
        except BaseException as exc:
            tx.__exit__(type(exc), exc, exc.__traceback__)  # rolls back what is still open
            raise
        return out

    def _write_transaction(
        self, durability: Durability, reload_on_error: bool, undo: Callable[[], None] | None
    ) -> Iterator[Any]:
        """:meth:`write_transaction`'s body, inside the store's rewrite gate."""
        committing = False  # the body is done: the COMMIT is owed (or was tried)
        try:
            with self.lock:
                self.check_open()
                self.reload_if_owed()
                tx = self.store.transaction(durability)
                db = tx.__enter__()
                try:
                    yield db
                except BaseException as exc:
                    reload = reload_on_error or self.reload_owed
                    try:
                        tx.__exit__(type(exc), exc, exc.__traceback__)  # rolls back
                    finally:
                        self._failed(undo, reload)
                    if reload and isinstance(exc, StoreFullError):
                        self.full_disk.failed(exc)
                    raise
                committing = True
                # what the body changed in memory is the COMMIT's now (a failed one reloads);
                # left set until here, so that a Ctrl-C raised as the body ends (where this
                # generator resumes) still reloads the memory the rollback no longer matches
                self.reload_owed = False
            tx.__exit__(None, None, None)  # the COMMIT, without the engine lock
        except BaseException as exc:
            if committing:
                self._commit_failed(tx, exc, undo)
            raise
        self.full_disk.passed()

    def _commit_failed(self, tx: Any, exc: BaseException, undo: Callable[[], None] | None) -> None:
        """After the body of :meth:`write_transaction`: its COMMIT failed, or never ran (a
        Ctrl-C landing as the engine lock was released, before the COMMIT). A transaction
        still open is rolled back (ending one that ended already does nothing): left to the
        garbage collector, it rolled back with memory still showing its writes. Then the
        memory is reloaded, as what the store committed is the truth."""
        try:
            tx.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            with self.lock:
                self._failed(undo, True)
        if isinstance(exc, StoreFullError):
            self.full_disk.failed(exc)

    def _failed(self, undo: Callable[[], None] | None, reload: bool) -> None:
        """After a write transaction rolled back (under the engine lock): its ``undo``, then
        the reload if asked -- which runs even if the undo fails (memory must follow the
        store)."""
        try:
            if undo is not None:
                undo()
        finally:
            if reload:
                self._reload()

    def check_open(self) -> None:
        """EngineClosedError once the engine is closed (call under the lock to rule out a
        ``close`` racing the call), EngineForkedError in a forked child. The facade checks it
        as each public call starts, and again where a call reaches the engine's memory without
        a store statement first (a write transaction, a retrieval, the reads of ``users`` and
        ``profile``); every other path meets the store's own check (``StoreClosedError``, an
        EngineClosedError too). One attribute read while open: a child has ``closed`` set."""
        if self.closed:
            if self.forked:
                raise EngineForkedError.of(self.pid)
            raise EngineClosedError("this MemoryEngine is closed")

    def check_process(self) -> None:
        """EngineForkedError in a forked child; nothing otherwise, closed or not. For the calls
        a closed engine still answers (validating a page) and those of its own shutdown."""
        if self.forked:
            raise EngineForkedError.of(self.pid)

    def disown(self) -> None:
        """In a forked child (the engine's fork hook): refuse every call from now on, and
        never touch the parent's store. The store is kept referenced, unclosed, for the
        child's lifetime (:data:`INHERITED`); in its place a stand-in refuses every use, so no
        path of the engine can run a statement on the connection the parent shares. Only
        attribute writes: nothing here may fail or block in a fresh child."""
        INHERITED.append(self.store)
        self.store = _InheritedStore(self.pid)  # type: ignore[assignment]
        self.forked = self.closed = True

    def reload_if_owed(self) -> None:
        """The reload a failed apply still owes (see :meth:`write_transaction`), done before
        a derived round reads its inputs, so the round does not read a half-applied state;
        also after the store's writer claim was lost (PostgreSQL restarted under it: another
        writer may have written before the claim was taken again)."""
        lost = self.store.claims_lost
        if lost != self._claims_lost:
            self._claims_lost, self.reload_owed = lost, True
        if self.reload_owed:
            self._reload()

    def _reload(self) -> None:
        if self.reload is None:
            return
        self.reload_owed = True
        self.reload()
        self.reload_owed = False

    @property
    def memory(self) -> MemoryConfig:
        return self.config.memory

    # ---------------------------------------------------------------- slot bookkeeping
    def grow_maps(self) -> None:
        """Extend the slot maps to the arena's current capacity (call after it may have grown)."""
        a, m = self.arena, self.memory
        if self.page_of_slot.size < a.page_live.shape[0]:
            extra = a.page_live.shape[0] - self.page_of_slot.size
            self.page_of_slot = np.concatenate([self.page_of_slot, np.full(extra, -1, np.int64)])
        if self.segment_of.shape != (a.user_capacity, a.segment_width):  # more users or wider
            grown = np.full((a.user_capacity, a.segment_width), -1, np.int64)
            grown[: self.segment_of.shape[0], : self.segment_of.shape[1]] = self.segment_of
            self.segment_of = grown
        if self.entry_of_ring.shape[0] < a.owner_capacity:
            extra = a.owner_capacity - self.entry_of_ring.shape[0]
            self.entry_of_ring = np.concatenate(
                [self.entry_of_ring, np.full((extra, m.knowledge_capacity), -1, np.int64)]
            )

    def map_pages(self, pool_slots: np.ndarray, page_ids: np.ndarray) -> None:
        self.grow_maps()
        self.page_of_slot[pool_slots] = page_ids

    def assistant_slot(self, assistant_id: str) -> int:
        """The owner slot of an assistant's knowledge ring (made on first use)."""
        if assistant_id not in self.assistant_owner:
            self.assistant_owner[assistant_id] = int(self.arena.add_owners(1)[0])
            self.grow_maps()
        return self.assistant_owner[assistant_id]

    def new_user_state(self, user_id: str, assistant_id: str, **kw: Any) -> UserState:
        """A user's arena slots (segments, knowledge ring) and in-memory record."""
        slot = int(self.arena.add_users(1)[0])
        owner = int(self.arena.add_owners(1)[0])
        self.assistant_slot(assistant_id)
        self.grow_maps()
        state = UserState(user_id, assistant_id, slot, owner, **kw)
        self.users[user_id] = state
        self.user_of_slot[slot] = user_id
        return state

    def drop_user_state(self, user: UserState) -> None:
        """Free a user's arena slots (segments, pages, term rows, knowledge ring) and record."""
        self.arena.remove_user(user.slot)
        self.arena.remove_owner(user.owner)
        self.users.pop(user.user_id, None)
        self.user_of_slot.pop(user.slot, None)

    def user(self, user_id: str) -> UserState:
        try:
            return self.users[user_id]
        except KeyError:
            raise UnknownUserError(f"unknown user {user_id!r}") from None

    def users_of(self, user_ids: Sequence[str]) -> list[UserState]:
        """The records of many users (UnknownUserError names the first unknown one)."""
        users = self.users
        try:
            return [users[u] for u in user_ids]
        except KeyError as exc:
            raise UnknownUserError(f"unknown user {exc.args[0]!r}") from None

    def now(self, user: UserState, at: float | None = None) -> float:
        """The time heat is computed at: ``at`` if given, else the user's logical clock (the
        newest page timestamp) or the wall clock, as ``memory.clock`` says."""
        if at is not None:
            return float(at)
        return user.clock if self.memory.clock == "logical" else time.time()

    def now_at(self, users: Sequence[UserState], clocks: np.ndarray) -> np.ndarray:
        """The times of derived work items of ``users``: on the logical clock, each item's own
        ``clocks`` (its user's clock when its page left STM; NaN where not recorded: the
        user's clock now), else :meth:`now`."""
        now = np.array([self.now(u) for u in users], np.float64)
        if self.memory.clock == "logical":
            known = ~np.isnan(clocks)
            now[known] = clocks[known]
        return now


class _InheritedStore:
    """What a forked child's engine holds instead of its parent's store: every attribute
    raises :class:`EngineForkedError` (the parent's store object itself is kept, unclosed, in
    :data:`INHERITED`)."""

    def __init__(self, opened_in: int) -> None:
        self._opened_in = opened_in

    def __getattr__(self, name: str) -> Any:
        raise EngineForkedError.of(self._opened_in)


# ---------------------------------------------------------------- derived-work helpers
def still_pending(store: SQLiteStore, work_ids: Sequence[int]) -> np.ndarray:
    """Which pending rows (by work id) the store still holds: deleting a page or a user
    deletes its rows, so a row gone means the work is no longer owed. One query per 500 ids."""
    ids = [int(w) for w in work_ids]
    sql = "SELECT work_id FROM pending WHERE work_id IN"
    live = {r[0] for r in select_in(store.query, sql, ids)}
    return np.fromiter((w in live for w in ids), bool, len(ids))


def pending_clocks(store: SQLiteStore, work_ids: Sequence[int]) -> dict[int, float]:
    """The clock each pending page row was stamped with when its page left STM (by work id;
    rows of older versions have none and are left out). One query per 500 ids."""
    sql = "SELECT work_id, clock FROM pending WHERE clock IS NOT NULL AND work_id IN"
    return dict(select_in(store.query, sql, work_ids))


def pending_left(state: EngineState, work_ids: Sequence[int], read_edits: int) -> np.ndarray:
    """Which of the pending rows (by work id) read when ``state.edits`` was ``read_edits`` are
    still in the store. A row leaves the table when the derived-work lease holder (the
    caller: a round or a promotion batch) applies it or evicts its segment, or with a
    deletion, and every deletion counts in ``edits``: with the count unchanged every row is
    still there and the store is not asked (a query a wave saved)."""
    if state.edits == read_edits:
        return np.ones(len(work_ids), bool)
    return still_pending(state.store, work_ids)


# ---------------------------------------------------------------- arena row helpers
def to_host(x: Any) -> np.ndarray:
    """A kernel result as a NumPy array (a CUDA tensor is copied to the host)."""
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def keyword_rows(token_lists: Sequence[Sequence[str]], width: int) -> np.ndarray:
    """Normalised keyword tokens (best first) -> the arena's padded rows of hashed ids: each
    row the sorted distinct ids of its first ``width`` tokens (as
    :func:`~memoryos_gpu.text.keywords.hash_keywords` gives them), for the whole batch in one
    native pass (``_C.keyword_rows``: a plain ASCII word through the native term id cache,
    any other token through ``hash_keyword``)."""
    return _C.keyword_rows(token_lists, width, hash_keyword)

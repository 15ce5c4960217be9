"""Sharding users over engines: the hash, the store layout, the shard engine, an in-process router.

**Why by user.** Everything MemoryOS keeps about a user (STM, segments, pages, heat, profile, user
knowledge) is private to that user, and a user's pages must be applied in order. So the user is
the unit of placement: :func:`~memoryos_gpu.ingest.shard_of` (blake2b-64 of the user id, mod N,
the same hash as ``ingest --shard/--workers``) names the one shard that owns a user, and that
shard's engine (its arena on one GPU, or on the CPU) is the only writer of the user's rows.

**Stores.** With SQLite every shard has its own file, in the layout ``ingest --workers`` writes
(``STORE/shard-I/memory.sqlite3`` plus ``STORE/shards.json``, so ``retrieve``, ``stats`` and
``export`` find a user's shard); with a PostgreSQL URL every shard uses the same database,
which records the shard count (meta :data:`LAYOUT_KEY`), and each engine loads only its own
users (:class:`OwnedStore`). Either way a store sharded N ways is reopened with N shards only.

**Assistant knowledge** is the one thing shared across users, hence across shards. Rule: *one
writer, read replicas everywhere*. The writer of assistant ``A`` is its owner shard,
``shard_of(A, N)``. A shard never writes assistant facts itself: facts found by its promotions
wait in its outbox; the router (:meth:`ShardedEngine.sync_shards`, the Ray ingest driver, the
Serve ingress) hands each outbox to the owner, which numbers the facts (``seq``, the ring
position) and commits them, then copies the numbered entries to every other shard, which holds
a read replica in its arena (per-shard SQLite: rows with the same ``seq`` in its own file; a
shared PostgreSQL store: re-read from the owner's rows). Retrievals and responses therefore read
assistant knowledge locally, with no cross-shard call on the request path, and every shard sees
the same entries once the router has synced. Facts still in an outbox when a shard dies are
lost: they are derived data (the pages they came from are committed and are re-promoted only if
they were never marked analysed). A fact travels with its provenance (source user, page ids),
so deleting a user, or deleting or editing one of its pages, reaches what those pages taught
the assistants on every shard (``sharded_forget.py``).

**Keyword statistics.** The keyword extractor's document frequencies (its IDF) are corpus-wide
in one engine. Shards exchange the frequencies of the pages they accepted
(:meth:`ShardEngine.take_keyword_delta` / :meth:`ShardEngine.apply_keyword_delta`) so every shard
ranks keywords as if it had seen every page. With that, a :class:`ShardedEngine` produces the
same pages, segments and retrievals as one :class:`~memoryos_gpu.engine.MemoryEngine` fed the
same calls (tests/test_distributed.py checks it). Pages no exchange has given the other shards
yet (an ``ingest --ray`` stopped before its exchange) are found by the *exchange marks* saved
with each shard's statistics: through which page of every shard they count
(:meth:`ShardEngine.exchange_marks`); the Ray ingest driver and a :class:`ShardedEngine`'s open
send the pages above them (:func:`catch_up_keywords`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import InvalidInputError, MemoryEngine, clean_queries, validate_pages
from memoryos_gpu.engine.state import Fact
from memoryos_gpu.errors import UnknownItemError, UnknownUserError
from memoryos_gpu.ingest import shard_of
from memoryos_gpu.store import SHARDS_FILE, check_store_dir, open_store
from memoryos_gpu.store.pg_urls import redact
from memoryos_gpu.store.sqlite import ArenaExtent
from memoryos_gpu.text.keywords import KeywordExtractor
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval

from . import sharded_forget

__all__ = [
    "SHARDS_FILE",
    "AssistantEntry",
    "OwnedStore",
    "ShardEngine",
    "ShardMap",
    "ShardedEngine",
    "check_layout",
    "is_shared_store",
    "prepare_layout",
    "shard_store",
    "shared_shards",
]

_HASH_NAME = "blake2b-64(user_id) mod count"
_EXTRACTOR_KEY = "keyword_extractor"
#: A shared store's layout (meta key): ``{"count": N, "hash": ...}``, as a sharded directory's
#: ``shards.json``.
LAYOUT_KEY = "shard_layout"
#: The exchange marks saved with a shard's keyword statistics (:meth:`ShardEngine.exchange_marks`).
EXCHANGE_MARKS = "ray_exchanged"


# ============================================================================ the map
@dataclass(frozen=True)
class ShardMap:
    """Which shard owns a user, and which shard writes an assistant's knowledge."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"a shard count must be >= 1, got {self.count}")

    def shard(self, user_id: str) -> int:
        return shard_of(user_id, self.count)

    def assistant_owner(self, assistant_id: str) -> int:
        return shard_of(assistant_id, self.count)

    def group(self, user_ids: Iterable[str]) -> dict[int, list[int]]:
        """Positions of ``user_ids`` by shard, each list in input order."""
        out: dict[int, list[int]] = {}
        for i, uid in enumerate(user_ids):
            out.setdefault(self.shard(uid), []).append(i)
        return out


# ============================================================================ store layout
def is_shared_store(store: str) -> bool:
    """A database URL (``postgresql://...``): one store that every shard shares."""
    return "://" in store


def shard_store(store: str, index: int, count: int) -> str:
    """The store of shard ``index`` of ``count``: the shared URL itself, ``:memory:`` for an
    in-memory store, else ``STORE/shard-I`` (the ``ingest --workers`` layout)."""
    if is_shared_store(store) or store == ":memory:":
        return store
    return str(Path(store) / f"shard-{index}")


def check_layout(store: str, count: int) -> bool:
    """Whether ``store`` can be opened with ``count`` shards; True when its layout must still
    be recorded (a new sharded directory, or a shared store with no count recorded).

    Separate from :func:`prepare_layout` so a caller with a slow start-up (``ingest --ray``
    starts Ray: ~15 s) refuses a wrong store first, and leaves no directory behind when
    it then cannot start (a directory is only read; a PostgreSQL database is opened, which
    creates its tables when new: the database itself is there already). Users are placed by
    ``hash mod count``, so a store sharded N ways must be reopened with N shards, a directory
    (``shards.json``) or a PostgreSQL store (:func:`shared_shards`) alike; an unsharded
    directory (``STORE/memory.sqlite3``) cannot be reopened sharded; a path through a regular
    file is refused as the single-store commands refuse it
    (:func:`~memoryos_gpu.store.check_store_dir`).
    """
    if store == ":memory:":
        return False
    if is_shared_store(store):
        return _shared_layout(store, count, record=False)
    base = Path(store)
    if base.suffix in (".sqlite", ".sqlite3", ".db"):
        raise ValueError(
            f"{store} is a single SQLite file; sharding needs --store DIR (a directory: one "
            "store per shard) or a PostgreSQL URL"
        )
    manifest = base / SHARDS_FILE
    if manifest.exists():
        _check_manifest(manifest, count)
        return False
    check_store_dir(base)  # a file in the path: refused as for one store
    if (base / "memory.sqlite3").exists():
        raise ValueError(f"{base} holds an unsharded store; use a new store directory")
    return True


def _check_manifest(manifest: Path, count: int) -> None:
    try:
        found = int(json.loads(manifest.read_text())["count"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{manifest} is unreadable ({exc}); move it away to start over") from None
    _check_count(str(manifest.parent), found, count)


def _check_count(where: str, found: int, count: int) -> None:
    if found != count:
        raise ValueError(
            f"{where} holds {found} shards; users are placed by hash mod count, so "
            f"open it with {found} shards (or use a new store)"
        )


def prepare_layout(store: str, count: int) -> None:
    """Check (:func:`check_layout`) and record, for a new store, the layout: a sharded SQLite
    directory's manifest, a shared store's meta key."""
    if is_shared_store(store):
        _shared_layout(store, count, record=True)
        return
    if not check_layout(store, count):
        return
    base = Path(store)
    base.mkdir(parents=True, exist_ok=True)
    (base / SHARDS_FILE).write_text(json.dumps({"count": count, "hash": _HASH_NAME}))


def shared_shards(url: str) -> int | None:
    """The shard count a shared (PostgreSQL) store was laid out with; None when it has none
    (new, or only ever opened by one engine)."""
    store = open_store(url)
    try:
        return _layout_of(store)
    finally:
        store.close()


def _shared_layout(url: str, count: int, *, record: bool) -> bool:
    """:func:`check_layout` of a shared store (``record``: and record ``count`` when it has no
    count yet); True when no count is recorded. The store is opened as its one writer for a
    moment, so no shard engine writes it meanwhile (a running one is named by the refusal)."""
    store = open_store(url)
    try:
        found = _layout_of(store)
        if found is not None:
            _check_count(redact(url), found, count)
        missing = store.get_meta(LAYOUT_KEY) is None
        if record and missing:
            store.set_meta(LAYOUT_KEY, json.dumps({"count": count, "hash": _HASH_NAME}))
        return missing
    finally:
        store.close()


def _layout_of(store: Any) -> int | None:
    """A shared store's recorded shard count; without one (written before counts were
    recorded), the count its shards' saved keyword statistics are keyed by, when they agree."""
    raw = store.get_meta(LAYOUT_KEY)
    if raw is not None:
        try:
            return int(json.loads(raw)["count"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{store.path}: its {LAYOUT_KEY} record is unreadable ({exc})"
            ) from None
    keys = store.query("SELECT key FROM meta WHERE key LIKE ?", (f"{_EXTRACTOR_KEY}@shard-%",))
    counts = {int(k.rpartition("-of-")[2]) for (k,) in keys if k.rpartition("-of-")[2].isdigit()}
    return counts.pop() if len(counts) == 1 else None


# ============================================================================ shared-store view
def _mask_chunk(chunk: dict[str, Any], keep: np.ndarray) -> dict[str, Any]:
    """Rows of a column chunk (arrays and lists of equal length) where ``keep``."""
    out: dict[str, Any] = {}
    for key, value in chunk.items():
        if isinstance(value, np.ndarray) and value.shape[:1] == keep.shape:
            out[key] = value[keep]
        elif isinstance(value, list) and len(value) == keep.size:
            out[key] = [v for v, k in zip(value, keep, strict=True) if k]
        else:
            out[key] = value
    return out


class OwnedStore:
    """One shard's view of a store shared by every shard (PostgreSQL).

    The engine loads, and runs the pending work of, only the users this shard owns; assistant
    knowledge is loaded whole (every shard keeps a read replica of it). Per-shard metadata (the
    keyword statistics) is kept under a per-shard key. Everything else (writes, page and
    knowledge lookups by id, idempotency sources) passes through unchanged.
    """

    def __init__(self, store: Any, shard: int, count: int) -> None:
        self._store = store
        self._shard, self._count = shard, count
        self._segments: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def owns(self, user_id: str) -> bool:
        return shard_of(user_id, self._count) == self._shard

    def _meta_key(self, key: str) -> str:
        return f"{key}@shard-{self._shard}-of-{self._count}" if key == _EXTRACTOR_KEY else key

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        return self._store.get_meta(self._meta_key(key), default)

    def set_meta(self, key: str, value: str) -> None:
        self._store.set_meta(self._meta_key(key), value)

    def all_users(self) -> list[tuple]:
        return [u for u in self._store.all_users() if self.owns(u[0])]

    def load_stm(self) -> dict[str, list[int]]:
        return {u: p for u, p in self._store.load_stm().items() if self.owns(u)}

    def arena_extent(self, block_size: int, knowledge_capacity: int) -> ArenaExtent:
        n = blocks = width = 0
        for uid, slot, n_pages in self._store.query("SELECT user_id, slot, n_pages FROM segments"):
            if self.owns(uid):
                n += 1
                blocks += -(-max(int(n_pages), 1) // block_size)
                width = max(width, int(slot) + 1)
        ring = 0
        for kind, owner, top in self._store.query(
            "SELECT owner_kind, owner_id, MAX(seq % ?) FROM knowledge WHERE live = 1 "
            "GROUP BY owner_kind, owner_id",
            (knowledge_capacity,),
        ):
            if kind == "assistant" or self.owns(owner):
                ring = max(ring, int(top) + 1)
        return ArenaExtent(n, blocks, width, ring)

    def iter_segments(self, dim: int, keyword_width: int) -> Iterator[dict[str, Any]]:
        self._segments = set()
        for chunk in self._store.iter_segments(dim, keyword_width):
            keep = np.array([self.owns(u) for u in chunk["user_id"]], bool)
            self._segments.update(int(s) for s in chunk["segment_id"][keep])
            yield _mask_chunk(chunk, keep)

    def iter_mtm_pages(self, dim: int) -> Iterator[dict[str, Any]]:
        owned = np.fromiter(self._segments, np.int64, len(self._segments))
        for chunk in self._store.iter_mtm_pages(dim):
            yield _mask_chunk(chunk, np.isin(chunk["segment_id"], owned))

    def iter_knowledge(self, dim: int) -> Iterator[dict[str, Any]]:
        for chunk in self._store.iter_knowledge(dim):
            keep = np.array(
                [
                    k == "assistant" or self.owns(o)
                    for k, o in zip(chunk["owner_kind"], chunk["owner_id"], strict=True)
                ],
                bool,
            )
            yield _mask_chunk(chunk, keep)

    def iter_page_views(self) -> Iterator[list[tuple[int, str, Any]]]:
        for chunk in self._store.iter_page_views():
            yield [row for row in chunk if self.owns(row[1])]

    def pages_without_terms(self) -> list[tuple]:
        return [row for row in self._store.pages_without_terms() if self.owns(row[1])]

    def pending(self, kind: str) -> list[tuple[int, str, int]]:
        return [w for w in self._store.pending(kind) if self.owns(w[1])]

    def pending_round(self, kind: str, limit: int, per_user: int = 1) -> list[tuple[int, str, int]]:
        # the oldest items of each user, over every user, then this shard's: a user's oldest
        # items are the same either way
        every = self._store.pending_round(kind, 1 << 62, per_user)
        return [w for w in every if self.owns(w[1])][:limit]

    def count_pending(self, user_id: str | None = None) -> int:
        if user_id is not None:
            return self._store.count_pending(user_id)
        return sum(
            1 for (uid,) in self._store.query("SELECT user_id FROM pending") if self.owns(uid)
        )


# ============================================================================ the shard engine
@dataclass(frozen=True)
class AssistantEntry:
    """An assistant-knowledge entry as numbered by its owner shard (``seq``: ring position);
    ``live`` False: the owner superseded it (replicas drop their copy)."""

    assistant_id: str
    seq: int
    text: str
    mode: str
    embedding: np.ndarray
    source_user: str | None = None
    live: bool = True


class ShardEngine(MemoryEngine):
    """A :class:`MemoryEngine` owning shard ``shard`` of ``count``.

    What it adds to the engine: a view of a shared store restricted to its users; an outbox for
    the assistant facts its promotions find (the owner shard writes them, see the module doc);
    the ring of every assistant kept as a replica; the keyword statistics of the pages it
    accepted since the last exchange; ``accept_many`` (commit pages, no derived work) so a
    router can commit a batch on every shard before any shard derives; and ``hold_pending``,
    which keeps derived work queued (also on open) until :meth:`release` - a restarted ingest
    actor then leaves it to the end of the run.

    It changes the engine only through the engine's hooks (``MemoryEngine`` Notes):
    ``_open_store`` (the shared-store view), ``_learn_keywords`` (texts for the keyword
    exchange), ``process_pending`` (holding derived work back) and ``_push_knowledge`` (the
    assistant-fact outbox).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        shard: int = 0,
        count: int = 1,
        hold_pending: bool = False,
        **kw: Any,
    ) -> None:
        self.shard_index, self.shard_count = int(shard), int(count)
        self.shard_map = ShardMap(self.shard_count)
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard {shard} of {count}: need 0 <= shard < count")
        self._hold_pending = hold_pending
        self._outbox: list[Fact] = []  # assistant facts for their owner shard
        self._kw_texts: list[str] = []  # accepted since the last keyword exchange
        self._kw_lock = threading.Lock()
        super().__init__(config, **kw)

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
    def process_pending(self, *args: Any, **kw: Any) -> dict[str, int]:
        if self._hold_pending:
            return {"pages": 0, "promotions": 0}
        return super().process_pending(*args, **kw)

    def release(self) -> None:
        """Stop holding derived work back (the next :meth:`process_pending` runs it)."""
        self._hold_pending = False

    def accept_many(self, pages: Iterable[PageInput | dict[str, Any]]) -> list[AddResult]:
        """Commit pages like ``add_many`` (one transaction, acknowledged once it returns), but
        run no derived work."""
        items = validate_pages(pages)
        return self._accept_durably(items)

    def _learn_keywords(self, texts: list[str]) -> None:
        """The engine's hook for the texts its keyword statistics learn on acceptance: kept
        for the next exchange with the other shards too."""
        super()._learn_keywords(texts)
        with self._kw_lock:
            self._kw_texts.extend(texts)

    def _unlearn_keywords(self, texts: list[str]) -> None:
        """A rolled-back batch's texts out of the statistics and out of the next exchange
        (those an exchange already took are the other shards' to count: they stay)."""
        super()._unlearn_keywords(texts)
        owed = Counter(texts)
        with self._kw_lock:
            kept = []
            for t in reversed(self._kw_texts):  # the batch's are the latest
                if owed[t] > 0:
                    owed[t] -= 1
                else:
                    kept.append(t)
            self._kw_texts = kept[::-1]

    # ------------------------------------------------------------------ keyword statistics
    def _scratch_extractor(self) -> KeywordExtractor:
        ex = self.extractor
        return KeywordExtractor(
            stopwords=ex.stopwords,
            proper_noun_boost=ex.proper_noun_boost,
            number_boost=ex.number_boost,
            min_len=ex.min_len,
            fold_plurals=ex.fold_plurals,
        )

    def take_keyword_delta(self) -> dict[str, Any]:
        """Document frequencies of the pages accepted since the last call (and forget them)."""
        with self._kw_lock:
            texts, self._kw_texts = self._kw_texts, []
        return _delta_of(self._scratch_extractor().update(texts))

    def keyword_delta_since(self, page_watermark: int) -> dict[str, Any]:
        """Document frequencies of this shard's pages with ``page_id > page_watermark``, read
        from the store: exact even when the process restarted in between (ingestion)."""
        with self._kw_lock:
            self._kw_texts.clear()
        scratch = self._scratch_extractor()
        rows = self.store.query(
            "SELECT user_id, user_input || ' ' || agent_response FROM pages WHERE page_id > ? "
            "ORDER BY page_id",
            (int(page_watermark),),
        )
        scratch.update(text for uid, text in rows if self.owns(uid))
        return _delta_of(scratch)

    def apply_keyword_delta(self, delta: dict[str, Any]) -> None:
        """Add other shards' document frequencies to this shard's keyword statistics."""
        with self._lock:
            self.extractor.df.update(delta["df"])
            self.extractor.n_docs += int(delta["n_docs"])

    def page_watermark(self) -> int:
        """The largest page id in the store (pages added later have larger ids)."""
        return int(self.store.query("SELECT COALESCE(MAX(page_id), 0) FROM pages")[0][0])

    # ------------------------------------------------------------------ exchange by marks
    def exchange_marks(self, tops: list[int]) -> list[int]:
        """Receiver side of an exchange by marks (:func:`catch_up_keywords`, the Ray ingest
        driver): through which page id of each shard's store (``[i]``) this shard's keyword
        statistics count that shard's pages. Statistics never saved count none (the open
        refits them from this shard's own pages): zeros. Saved with marks (by an exchange by
        marks): those marks. Saved by an engine (it writes no marks, and saves after its
        exchanges): every page there is, ``tops``, saved now with the statistics, so that a
        run stopped before its exchange leaves marks below the pages it committed and the
        next exchange by marks sends those pages too."""
        raw = self.store.get_meta(_EXTRACTOR_KEY)
        if raw is None:
            return [0] * self.shard_count
        saved = json.loads(raw).get(EXCHANGE_MARKS)
        if isinstance(saved, dict) and saved.get("count") == self.shard_count:
            return [int(m) for m in saved["through"]]
        self.save_keywords(list(tops))
        return list(tops)

    def keyword_deltas(self, since: Sequence[int]) -> dict[str, Any]:
        """Sender side: this shard's last page id (``top``) and the document frequencies of its
        pages above each mark of ``since``, up to ``top`` (the caller accepts nothing
        meanwhile)."""
        top = self.page_watermark()
        return {"top": top, "deltas": {m: self.keyword_delta_since(m) for m in since}}

    def apply_exchange(self, delta: dict[str, Any], through: list[int]) -> None:
        """Receiver side: add the other shards' frequencies and save them with the new marks in
        one write, so a statistic and the mark that says it is counted are never apart."""
        with self._lock:
            self.apply_keyword_delta(delta)
            self.save_keywords(through)

    def save_keywords(self, through: list[int]) -> None:
        """The keyword statistics as the engine saves them (the state and the page watermark
        the open refits from), plus the exchange marks ``through``."""
        with self._lock:
            state = {
                **self.extractor.to_dict(),
                "page_watermark": self.page_watermark(),
                EXCHANGE_MARKS: {"count": self.shard_count, "through": list(through)},
            }
            self.store.set_meta(_EXTRACTOR_KEY, json.dumps(state))

    # ------------------------------------------------------------------ assistant knowledge
    def _push_knowledge(self, db: Any, facts: list[Fact], emb: np.ndarray) -> None:
        """User facts go to the ring as usual; assistant facts wait in the outbox for the
        owner shard (module doc: one writer per assistant), with their provenance (source
        user, page ids, time). An LLM decision names an entry of this shard's replica, not
        the owner's: the owner's rule decides instead."""
        keep = [i for i, f in enumerate(facts) if f.kind == "user"]
        self._outbox.extend(Fact(*f[:7]) for f in facts if f.kind != "user")
        if keep:
            super()._push_knowledge(db, [facts[i] for i in keep], emb[keep])

    def take_sync(self) -> dict[str, Any]:
        """What a router's sync takes from this shard in one call: the keyword delta and the
        assistant facts gathered since the last one."""
        return {"delta": self.take_keyword_delta(), "facts": self.take_assistant_facts()}

    def take_assistant_facts(self) -> list[Fact]:
        """The assistant facts found since the last call (``Fact``: owner id = assistant)."""
        with self._lock:
            out, self._outbox = self._outbox, []
        return out

    def append_assistant_facts(self, facts: Sequence[Fact]) -> list[AssistantEntry]:
        """Owner side: commit facts of assistants this shard owns (provenance recorded as in
        one engine; the conflict rule may merge or supersede), and answer what changed in the
        rings for the replicas: the entries added, and those superseded (``live`` False)."""
        facts = [Fact(*f) for f in facts]  # over Ray: plain tuples are accepted too
        if not facts:
            return []
        with self._lock:
            emb = self.embedder.encode([f.text for f in facts])
            # the rings change as the transaction goes (reloaded from the store if it fails);
            # committed under the lock this method holds (it answers what the rings hold)
            with self._state.write_transaction("commit") as db:
                self.store.ensure_assistants(db, (f.owner_id for f in facts), time.time())
                mark = db.execute("SELECT COALESCE(MAX(entry_id), 0) FROM knowledge").fetchone()
                # the engine's own ring write, not this class's outbox: this shard is the owner
                super()._push_knowledge(db, facts, emb)
                return self._ring_changes(db, int(mark[0]), {f.owner_id for f in facts})

    def _ring_changes(self, db: Any, mark: int, assistants: set[str]) -> list[AssistantEntry]:
        """The assistants' ring entries added after entry ``mark`` and those they superseded."""
        from memoryos_gpu.store.sqlite import blob_matrix

        ids = sorted(assistants)
        rows = db.execute(
            "SELECT owner_id, seq, text, mode, embedding, source_user, live FROM knowledge "
            f"WHERE owner_kind = 'assistant' AND owner_id IN ({','.join('?' * len(ids))}) AND "
            "seq >= 0 AND (entry_id > ? OR (live = 0 AND superseded_by > ?)) ORDER BY seq",
            (*ids, mark, mark),
        ).fetchall()
        vecs = blob_matrix([r[4] for r in rows], self.embedder.dim)
        return [
            AssistantEntry(r[0], int(r[1]), r[2], r[3], v, r[5], bool(r[6]))
            for r, v in zip(rows, vecs, strict=True)
        ]

    def delete_user(self, user_id: str) -> bool:
        """The engine's delete, and the user's facts still in the outbox go too (they were
        not routed to their owner yet)."""
        with self._lock:
            self._outbox = [f for f in self._outbox if f.source_user != user_id]
            return super().delete_user(user_id)

    def delete_page(self, page_id: int) -> bool:
        """The engine's delete; the page's facts still in the outbox go too (their other
        pages are re-analysed)."""
        with self._lock:
            self._drop_outbox_of(page_id)
            return super().delete_page(page_id)

    def update_page(
        self, page_id: int, *, user_input: str | None = None, agent_response: str | None = None
    ) -> dict[str, Any]:
        """The engine's edit; the facts of the page's old text still in the outbox go too."""
        sharded_forget.check_edit(user_input, agent_response)
        with self._lock:
            self._drop_outbox_of(page_id)
            return super().update_page(
                page_id, user_input=user_input, agent_response=agent_response
            )

    def _drop_outbox_of(self, page_id: int) -> None:
        """Outbox facts derived from the page (not routed to their owner yet) go, as the
        owner's entries would; the other pages they came from are re-analysed."""
        row = self.get_page(page_id)
        if row is None:
            return
        uid = row["user_id"]
        hit = [f for f in self._outbox if f.source_user == uid and int(page_id) in f.pages]
        if not hit:
            return
        self._outbox = [f for f in self._outbox if f not in hit]
        again = {(int(p), uid) for f in hit for p in f.pages if int(p) != int(page_id)}
        sharded_forget.reanalyse_pages(self, sorted(again))

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

    def replicate_assistant_entries(self, entries: Sequence[AssistantEntry]) -> None:
        """Replica side: hold the owner's numbered entries (same ring positions)."""
        if not entries:
            return
        with self._lock:
            if self.shared_store:
                self._reload_assistants(sorted({e.assistant_id for e in entries}))
                return
            gone = [(e.assistant_id, e.seq) for e in entries if not e.live]
            # its ring rows change as it writes (reloaded from the store if it fails);
            # committed under the lock this method holds
            with self._state.write_transaction("commit") as db:
                self._write_replica(db, [e for e in entries if e.live])
            if gone:
                sharded_forget.drop_assistant_entries(self, gone, superseded=True)

    def _write_replica(self, db: Any, entries: Sequence[AssistantEntry]) -> None:
        cap = self.memory.knowledge_capacity
        t = time.time()
        self.store.ensure_assistants(db, (e.assistant_id for e in entries), time.time())
        for e in entries:
            slot = self._assistant_slot(e.assistant_id)
            db.execute(
                "UPDATE knowledge SET live = 0 WHERE owner_kind = 'assistant' AND "
                "owner_id = ? AND seq <= ?",
                (e.assistant_id, e.seq - cap),
            )
            (entry,) = self.store.new_ids(db, "knowledge", 1)
            db.execute(
                "INSERT INTO knowledge(entry_id, owner_kind, owner_id, seq, text, embedding, "
                "mode, created, source_user) VALUES (?, 'assistant', ?, ?, ?, ?, ?, ?, ?)",
                (
                    entry,
                    e.assistant_id,
                    e.seq,
                    e.text,
                    _emb_blob(e.embedding),
                    e.mode,
                    t,
                    e.source_user,
                ),
            )
            head = max(self.arena.ring_head(slot), e.seq + 1)
            db.execute(
                "UPDATE assistants SET knowledge_head = ? WHERE assistant_id = ?",
                (head, e.assistant_id),
            )
            self.arena.write_knowledge([slot], [e.seq % cap], e.embedding[None])
            self.arena.set_ring_head(slot, head)
            self._grow_maps()
            old = int(self._entry_of_ring[slot, e.seq % cap])
            if old >= 0:
                self._views.drop_knowledge([old])
            self._entry_of_ring[slot, e.seq % cap] = entry
            self._views.knowledge[entry] = e.text

    def _reload_assistants(self, assistant_ids: Sequence[str]) -> None:
        """Shared store: re-read assistants' live entries (written by their owner shard); the
        ring positions of entries no longer live there are cleared."""
        from memoryos_gpu.store.sqlite import blob_matrix

        cap = self.memory.knowledge_capacity
        for aid in assistant_ids:
            slot = self._assistant_slot(aid)
            rows = self.store.query(
                "SELECT entry_id, seq, embedding, text FROM knowledge "
                "WHERE owner_kind = 'assistant' AND owner_id = ? AND live = 1 ORDER BY seq",
                (aid,),
            )
            head = self.store.query(
                "SELECT knowledge_head FROM assistants WHERE assistant_id = ?", (aid,)
            )
            self._grow_maps()
            held = np.flatnonzero(self._entry_of_ring[slot] >= 0)
            self.arena.delete_knowledge(np.full(held.size, slot, np.int32), held)
            self._views.drop_knowledge(int(e) for e in self._entry_of_ring[slot, held])
            self._entry_of_ring[slot, held] = -1
            if not rows:
                continue
            ring = np.array([r[1] % cap for r in rows], np.int32)
            self.arena.write_knowledge(
                np.full(len(rows), slot, np.int32),
                ring,
                blob_matrix([r[2] for r in rows], self.embedder.dim),
            )
            self.arena.set_ring_head(slot, int(head[0][0]) if head else rows[-1][1] + 1)
            self._entry_of_ring[slot, ring] = [r[0] for r in rows]
            self._views.knowledge.update((r[0], r[3]) for r in rows)

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


def _delta_of(scratch: KeywordExtractor) -> dict[str, Any]:
    return {"n_docs": scratch.n_docs, "df": dict(scratch.df)}


def merge_deltas(deltas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The sum of keyword deltas."""
    df: Counter[str] = Counter()
    for d in deltas:
        df.update(d["df"])
    return {"n_docs": sum(int(d["n_docs"]) for d in deltas), "df": dict(df)}


def exchange_senders(marks: Sequence[Sequence[int]]) -> list[list[int]]:
    """For an exchange by marks (``marks[j][i]``: through which page of shard ``i`` receiver
    ``j`` counts), the marks each shard ``i`` sends its pages above (one delta per distinct
    mark, ascending)."""
    n = len(marks)
    return [sorted({marks[j][i] for j in range(n) if j != i}) for i in range(n)]


def exchange_receipts(
    marks: Sequence[Sequence[int]], sent: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """What each receiver ``j`` adds: every other shard ``i``'s delta above ``marks[j][i]``
    (``sent[i]``: :meth:`ShardEngine.keyword_deltas` of :func:`exchange_senders`' marks)."""
    n = len(marks)
    return [
        merge_deltas([sent[i]["deltas"][marks[j][i]] for i in range(n) if i != j]) for j in range(n)
    ]


def sent_documents(marks: Sequence[Sequence[int]], sent: Sequence[dict[str, Any]]) -> int:
    """The documents an exchange by marks sent: each shard's pages above its lowest mark."""
    since = exchange_senders(marks)
    return sum(int(sent[i]["deltas"][s[0]]["n_docs"]) for i, s in enumerate(since) if s)


def catch_up_keywords(engines: Sequence[ShardEngine]) -> int:
    """Exchange by marks between shard engines in one process, before they accept anything:
    each gets the keyword statistics of the other shards' pages its own do not count yet
    (those an ``ingest --ray`` committed before it was stopped), and saves them with the
    marks that say so. Returns the documents sent."""
    tops = [e.page_watermark() for e in engines]
    marks = [e.exchange_marks(tops) for e in engines]
    sent = [e.keyword_deltas(s) for e, s in zip(engines, exchange_senders(marks), strict=True)]
    through = [int(part["top"]) for part in sent]
    for j, (e, delta) in enumerate(zip(engines, exchange_receipts(marks, sent), strict=True)):
        if any(marks[j][i] != through[i] for i in range(len(engines)) if i != j):
            e.apply_exchange(delta, through)  # (nothing new for it: no write)
    return sent_documents(marks, sent)


def _emb_blob(vec: np.ndarray) -> bytes:
    from memoryos_gpu.store.sqlite import emb_blob

    return emb_blob(vec)


def exchange_keywords(
    take: Sequence[Callable[[], dict[str, Any]]], apply: Sequence[Callable[[dict], None]]
) -> int:
    """Give every shard the keyword delta of every other shard; returns documents exchanged."""
    deltas = [t() for t in take]
    total = merge_deltas(deltas)
    if not total["n_docs"]:
        return 0
    for i, fn in enumerate(apply):
        others = merge_deltas([d for j, d in enumerate(deltas) if j != i])
        if others["n_docs"]:
            fn(others)
    return int(total["n_docs"])


def route_assistant_facts(
    facts: Sequence[Fact],
    shard_map: ShardMap,
    append: Callable[[int, list[Fact]], list[AssistantEntry]],
    replicate: Callable[[int, list[AssistantEntry]], None],
) -> int:
    """Send facts to their assistant's owner shard, then its numbered entries to every other
    shard (the module doc's rule). ``append(shard, facts)`` / ``replicate(shard, entries)`` do
    the calls (in process, or on Ray actors). Returns the entries written."""
    by_owner: dict[int, list[Fact]] = {}
    for f in facts:
        by_owner.setdefault(shard_map.assistant_owner(f[1]), []).append(f)
    written = 0
    for owner, owned in sorted(by_owner.items()):
        entries = append(owner, owned)
        written += len(entries)
        for j in range(shard_map.count):
            if j != owner:
                replicate(j, entries)
    return written


# ============================================================================ in-process router
class ShardedEngine:
    """N shard engines in one process, behind the engine's API.

    Every call is split by the users' shards and the results are put back in input order.
    ``add_many`` commits the batch on every shard, exchanges keyword statistics, and only then
    runs the derived work (when ``config.auto_process``), so derived results equal one
    engine's; afterwards it routes assistant facts (see the module doc). Calls that name a page
    or knowledge entry by id go through :meth:`engine_for` (ids are per shard store), except
    :meth:`delete_page` and :meth:`update_page`, which take the user and reach every shard.

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
        self._lock = threading.RLock()
        for e in self.engines:
            e.release()
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
        with self._lock:
            for shard, idx in self.shard_map.group(p.user_id for p in items).items():
                res = self.engines[shard].accept_many([items[i] for i in idx])
                for i, r in zip(idx, res, strict=True):
                    out[i] = r
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
        with self._lock:
            self._route_facts()
        return dict(done)

    def flush(self) -> dict[str, int]:
        return self.process_pending()

    def sync_shards(self) -> None:
        """Exchange keyword statistics and route assistant facts now."""
        with self._lock:
            self._exchange_keywords()
            self._route_facts()

    def _exchange_keywords(self) -> int:
        return exchange_keywords(
            [e.take_keyword_delta for e in self.engines],
            [e.apply_keyword_delta for e in self.engines],
        )

    def _route_facts(self) -> int:
        facts = [f for e in self.engines for f in e.take_assistant_facts()]
        if not facts:
            return 0
        return route_assistant_facts(
            facts,
            self.shard_map,
            lambda s, f: self.engines[s].append_assistant_facts(f),
            lambda s, entries: self.engines[s].replicate_assistant_entries(entries),
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
        with self._lock:
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
                self._route_facts()
        return [r for r in out if r is not None]

    def respond(self, user_id: str, query: str, **kw: Any) -> Response:
        return self.respond_many([(user_id, query)], **kw)[0]

    def respond_many(self, queries: Sequence[tuple[str, str]], **kw: Any) -> list[Response]:
        out: list[Response | None] = [None] * len(queries)
        with self._lock:
            for shard, idx in self.shard_map.group(u for u, _ in queries).items():
                res = self.engines[shard].respond_many([queries[i] for i in idx], **kw)
                for i, r in zip(idx, res, strict=True):
                    out[i] = r
            self._exchange_keywords()
            self._route_facts()
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
        with self._lock:
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
        with self._lock:
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
        with self._lock:
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
        with self._lock:
            n = self.engine_for(user_id).promote(user_id, segment_slot)
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
        with self._lock:
            try:
                self.sync_shards()
            finally:
                for e in self.engines:
                    e.close()

    def __enter__(self) -> ShardedEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

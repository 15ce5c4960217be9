"""Where a sharded store's shards live, and the checks that it is reopened as it was laid out.

**Why by user** (the map). Everything MemoryOS keeps about a user (STM, segments, pages, heat,
profile, user knowledge) is private to that user, and a user's pages must be applied in order.
So the user is the unit of placement: :func:`~memoryos_gpu.ingest.shard_of` (blake2b-64 of the
user id, mod N, the same hash as ``ingest --shard/--workers``) names the one shard that owns a
user (:class:`ShardMap`), and that shard's engine is the only writer of the user's rows.

**Stores** (the layout). With SQLite every shard has its own file, in the layout ``ingest
--workers`` writes (``STORE/shard-I/memory.sqlite3`` plus ``STORE/shards.json``, so
``retrieve``, ``stats`` and ``export`` find a user's shard: :func:`shard_store`); with a
PostgreSQL URL every shard uses the same database, which records the shard count (meta
:data:`LAYOUT_KEY`), and each engine loads only its own users through :class:`OwnedStore`.
Either way a store sharded N ways is reopened with N shards only (:func:`check_layout`,
:func:`prepare_layout`): users are placed by hash mod count.

Kept apart from the shard engine (:mod:`~memoryos_gpu.distributed.sharding`) because the CLI,
``serve --engines`` and the Ray drivers check and lay out a store without opening an engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memoryos_gpu.ingest import shard_of
from memoryos_gpu.store import (
    SHARDS_FILE,
    STORE_FILE,
    STORE_FILE_SUFFIXES,
    check_store_dir,
    open_store,
)
from memoryos_gpu.store.pg_urls import redact
from memoryos_gpu.store.reads import ArenaExtent

__all__ = [
    "EXTRACTOR_KEY",
    "LAYOUT_KEY",
    "OwnedStore",
    "ShardMap",
    "check_layout",
    "is_shared_store",
    "manifest_count",
    "prepare_layout",
    "shard_of_directory",
    "shard_store",
    "shared_shards",
]

_HASH_NAME = "blake2b-64(user_id) mod count"
#: A shard's saved keyword statistics (meta key; per shard in a shared store, :class:`OwnedStore`).
EXTRACTOR_KEY = "keyword_extractor"
#: A shared store's layout (meta key): ``{"count": N, "hash": ...}``, as a sharded directory's
#: ``shards.json``.
LAYOUT_KEY = "shard_layout"


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
    if base.suffix in STORE_FILE_SUFFIXES:
        raise ValueError(
            f"{store} is a single SQLite file; sharding needs --store DIR (a directory: one "
            "store per shard) or a PostgreSQL URL"
        )
    manifest = base / SHARDS_FILE
    if manifest.exists():
        _check_manifest(manifest, count)
        return False
    check_store_dir(base)  # a file in the path: refused as for one store
    if (base / STORE_FILE).exists():
        raise ValueError(f"{base} holds an unsharded store; use a new store directory")
    return True


def _check_manifest(manifest: Path, count: int) -> None:
    _check_count(str(manifest.parent), manifest_count(manifest), count)


def manifest_count(manifest: Path) -> int:
    """The shard count a sharded directory's ``shards.json`` records (``ValueError`` when
    it is unreadable)."""
    try:
        return int(json.loads(manifest.read_text())["count"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{manifest} is unreadable ({exc}); move it away to start over") from None


def shard_of_directory(store: str) -> tuple[Path, int, int] | None:
    """``(PARENT, I, N)`` when directory ``store`` is shard ``I`` of ``N`` of a sharded
    directory (``PARENT/shard-I`` beside ``PARENT/shards.json``, the ``ingest --workers``
    layout), else None. Why: a shard's directory carries no marker of its own, so a command
    given it directly would take it for a whole store (``ingest`` put every user there, also
    the other shards' ones, whose pages then existed twice). ``ValueError`` for an unreadable
    manifest."""
    if store == ":memory:" or is_shared_store(store):
        return None
    here = Path(store).resolve()
    if here.suffix in STORE_FILE_SUFFIXES:  # a shard's database file given itself
        here = here.parent
    match = re.fullmatch(r"shard-(\d+)", here.name)
    manifest = here.parent / SHARDS_FILE
    if match is None or not manifest.is_file():
        return None
    return here.parent, int(match[1]), manifest_count(manifest)


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
    keys = store.query("SELECT key FROM meta WHERE key LIKE ?", (f"{EXTRACTOR_KEY}@shard-%",))
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
        return f"{key}@shard-{self._shard}-of-{self._count}" if key == EXTRACTOR_KEY else key

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

    def iter_pages_without_terms(self) -> Iterator[list[tuple]]:
        for chunk in self._store.iter_pages_without_terms():
            yield [row for row in chunk if self.owns(row[1])]

    def pending(self, kind: str) -> list[tuple[int, str, int]]:
        return [w for w in self._store.pending(kind) if self.owns(w[1])]

    def pending_items(self, kind: str) -> list[tuple[int, str, int]]:
        return [w for w in self._store.pending_items(kind) if self.owns(w[1])]

    def count_pending(self, user_id: str | None = None) -> int:
        if user_id is not None:
            return self._store.count_pending(user_id)
        return sum(
            1 for (uid,) in self._store.query("SELECT user_id FROM pending") if self.owns(uid)
        )

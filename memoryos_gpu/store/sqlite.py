"""SQLite store: the durable truth behind the arena.

Why SQLite: embedded, transactional, one file to back up, and fast enough for one box when
every accepted batch is one transaction (WAL mode, synchronous=NORMAL... FULL for
acknowledged pages, see :data:`SYNCHRONOUS`). The engine writes a page here before ``add``
returns; derived work (chain, MTM insertion, promotion) is recorded in ``pending`` in the same
transaction as the page, and each pending item is deleted in the same transaction as its
effects, so a crash at any point loses nothing and does nothing twice.

Embeddings are stored as little-endian float32 blobs with the model id and dimension recorded
in ``meta``; keyword ids as int32 blobs (the arena's hashed ids) beside the readable words.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
from pydantic import SecretStr

from memoryos_gpu.errors import EngineClosedError, MemoryOSError
from memoryos_gpu.store.derivations import (
    KNOWLEDGE,
    Forgotten,
    forget_pages,
    profile_sources,
    sources,
)
from memoryos_gpu.store.rounds import round_order
from memoryos_gpu.store.wal import BACKSTOP_PAGES, WalCheckpointer

log = logging.getLogger("memoryos_gpu.store")

SCHEMA_VERSION = 7
SYNCHRONOUS = "FULL"  # an acknowledged page survives power loss, not only a process crash

#: The tables whose new rows take their ids from :meth:`SQLiteStore.new_ids`, and the id column.
ID_COLUMNS = {"pages": "page_id", "segments": "segment_id", "knowledge": "entry_id"}

#: SQLite's page cache of a file store's connection, MiB (``PRAGMA cache_size``; SQLite's own
#: default is 2 MiB). Derived work rewrites rows spread over the pages table and its indexes:
#: at 10,000 users (a 410 MB file) SQLite re-read 39 pages from the OS per page of derived
#: work with 2 MiB, 14 with 64 MiB, and derived work cost 12 % less a page
#: (benchmarks/store_cache.py). Memory is taken as pages are read.
DEFAULT_CACHE_MB = 64
#: The page size of an in-memory store, bytes (a file store keeps SQLite's default, 4 KiB).
#: A derived round rewrites rows spread over every table of the users it serves; with 4 KiB
#: pages an in-memory store of 10,000 users x 20 pages (~75,000 pages) spent 14 us a page of
#: ingestion in its commits, and its memory-system time fell from 154 to 139 us a page with
#: 16 KiB (no change at 1,000 users; 32 KiB 143, 64 KiB 153). A file store measured the same
#: either way (its commits write whole pages to the log), so it keeps the default.
MEMORY_PAGE_SIZE = 16384
#: When a transaction's commit reaches the disk: see :meth:`SQLiteStore.transaction`.
Durability = Literal["commit", "deferred", "none"]


class StoreError(MemoryOSError, RuntimeError):
    """The store cannot be opened or used (newer schema, corrupt file, ...)."""


class StoreClosedError(StoreError, EngineClosedError):
    """The store was used after :meth:`SQLiteStore.close` (its engine closed): one clear error
    (an :class:`~memoryos_gpu.errors.EngineClosedError` too, so a caller of the engine catches
    one type) instead of the driver's own."""


class StoreUnavailableError(StoreError):
    """The store's server cannot be reached or dropped the connection (PostgreSQL down,
    restarted, a network cut): nothing of the failed call was committed, and the same call can
    succeed once the server answers again. A server answers it 503 with Retry-After, and keeps
    trying to load an engine whose store was unavailable at start."""


class StoreFullError(StoreError):
    """The store's disk is full: the transaction that met it was rolled back, what was
    committed before it is kept."""

    @classmethod
    def met(cls, store: str, exc: BaseException) -> StoreFullError:
        """The error for ``store`` (path or redacted URL), the backend's own words kept."""
        return cls(
            f"store {store}: the disk is full ({exc}); the transaction was rolled back (what "
            "was committed before it is kept): free space on that disk, then retry"
        )


def _on_read_only_fs(path: str) -> bool:
    """Whether ``path``'s directory is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(os.path.dirname(os.path.abspath(path))).f_flag & os.ST_RDONLY)
    except OSError:
        return False


#: Free space (bytes) below which an I/O error met while opening or copying a store is taken
#: for a full disk: SQLite reports ENOSPC on its shared-memory index (``-shm``, 32 KiB) as a
#: plain I/O error, and the index plus the first frames of a log need far less than this.
LOW_SPACE_BYTES = 1 << 20


def _primary_code(exc: BaseException) -> int | None:
    """SQLite's primary result code of a driver error (the low byte of the extended one)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _low_on_space(path: str) -> bool:
    """Whether the file system holding ``path`` has (almost) no room left for this user."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < LOW_SPACE_BYTES


def disk_full(exc: BaseException, path: str | None = None) -> bool:
    """Whether a driver error means a full disk: SQLite's SQLITE_FULL (or its words, which an
    SQL function such as ``sqlcipher_export`` passes on under SQLITE_ERROR), or (given the
    ``path`` it was met on) an I/O or can't-open error on a file system with no room left."""
    primary = _primary_code(exc)
    if primary == sqlite3.SQLITE_FULL:
        return True
    if primary in (None, sqlite3.SQLITE_ERROR) and "disk is full" in str(exc):
        return True
    io_like = primary in (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN)
    return path is not None and io_like and _low_on_space(path)


def open_error(path: str, exc: BaseException) -> StoreError | None:
    """Why opening the store ``path`` failed when the machine, not the file, is the cause
    (read-only file system, full disk, I/O error), said for an operator with SQLite's words
    kept; None when the file itself is at fault. Plain and encrypted stores share it, so the
    right key on a read-only or full disk is never reported as a wrong one. (The words of
    :func:`_environment_error`, without its rolled-back transaction: an open has none.)"""
    if _on_read_only_fs(path):
        return StoreError(
            f"cannot open store {path}: its file system is read-only, and SQLite writes beside "
            f"a store even to read it ({path}-shm, the index of its write-ahead log); copy the "
            "store to a writable place to read it"
        )
    if disk_full(exc, path):
        return StoreFullError(
            f"cannot open store {path}: the disk is full ({exc}); SQLite writes beside a store "
            f"even to read it ({path}-shm, -wal): free space on that disk, then retry"
        )
    primary = _primary_code(exc)
    if primary == sqlite3.SQLITE_IOERR:
        return StoreError(f"cannot open store {path}: disk I/O error ({exc}): check the disk")
    if primary == sqlite3.SQLITE_READONLY:
        return StoreError(
            f"cannot open store {path}: cannot write ({exc}): the file, its directory or the "
            "file system is read-only"
        )
    if primary == sqlite3.SQLITE_CANTOPEN:
        return StoreError(
            f"cannot open store {path}: {exc} (it, or a file SQLite keeps beside it: "
            f"{path}-wal, {path}-shm): check that they can be opened and written"
        )
    return None


def _environment_error(path: str, exc: BaseException) -> StoreError | None:
    """What the machine did to a transaction (disk full, I/O error, read-only file), said for
    an operator with SQLite's own words kept; None for any other error."""
    primary = _primary_code(exc)
    text = str(exc)
    if primary == sqlite3.SQLITE_FULL or (primary is None and "disk is full" in text):
        return StoreFullError.met(path, exc)
    if primary == sqlite3.SQLITE_IOERR:
        return StoreError(
            f"store {path}: disk I/O error ({text}); the transaction was rolled back (what was "
            "committed before it is kept): check the disk"
        )
    if primary == sqlite3.SQLITE_READONLY:
        return StoreError(
            f"store {path}: cannot write ({text}): the file, its directory or the filesystem "
            "is read-only"
        )
    return None


_SCHEMA_V1 = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE assistants(
  assistant_id TEXT PRIMARY KEY,
  created REAL NOT NULL,
  knowledge_head INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE users(
  user_id TEXT PRIMARY KEY,
  assistant_id TEXT NOT NULL REFERENCES assistants(assistant_id),
  created REAL NOT NULL,
  clock REAL NOT NULL DEFAULT 0,
  next_seq INTEGER NOT NULL DEFAULT 0,
  chain_tail INTEGER,
  chain_meta TEXT,
  profile TEXT NOT NULL DEFAULT '{}',
  knowledge_head INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE segments(
  segment_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
  slot INTEGER NOT NULL,
  summary TEXT NOT NULL,
  keywords TEXT NOT NULL,
  kw_ids BLOB NOT NULL,
  embedding BLOB NOT NULL,
  n_visit INTEGER NOT NULL DEFAULT 0,
  l_interaction INTEGER NOT NULL DEFAULT 0,
  last_access REAL NOT NULL,
  created REAL NOT NULL,
  n_pages INTEGER NOT NULL DEFAULT 0,
  UNIQUE(user_id, slot)
);
CREATE TABLE pages(
  page_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
  seq INTEGER NOT NULL,
  user_input TEXT NOT NULL,
  agent_response TEXT NOT NULL,
  timestamp REAL NOT NULL,
  tier TEXT NOT NULL CHECK (tier IN ('stm', 'pending', 'mtm', 'evicted')),
  segment_id INTEGER REFERENCES segments(segment_id) ON DELETE SET NULL,
  seg_pos INTEGER,
  prev_page INTEGER,
  next_page INTEGER,
  chain_id INTEGER,
  meta TEXT,
  summary TEXT,
  keywords TEXT,
  analysed INTEGER NOT NULL DEFAULT 0,
  mode TEXT,
  embedding BLOB NOT NULL,
  source TEXT UNIQUE,
  extra TEXT NOT NULL DEFAULT '{}',
  created REAL NOT NULL,
  UNIQUE(user_id, seq)
);
CREATE INDEX pages_segment ON pages(segment_id, seg_pos);
CREATE INDEX pages_tier ON pages(user_id, tier, seq);
CREATE INDEX pages_chain ON pages(chain_id);
CREATE TABLE knowledge(
  entry_id INTEGER PRIMARY KEY,
  owner_kind TEXT NOT NULL CHECK (owner_kind IN ('user', 'assistant')),
  owner_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  text TEXT NOT NULL,
  embedding BLOB NOT NULL,
  live INTEGER NOT NULL DEFAULT 1,
  mode TEXT NOT NULL,
  source_user TEXT,
  created REAL NOT NULL,
  UNIQUE(owner_kind, owner_id, seq)
);
CREATE INDEX knowledge_live ON knowledge(owner_kind, owner_id, live);
CREATE TABLE pending(
  work_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
  kind TEXT NOT NULL CHECK (kind IN ('page', 'promote')),
  ref INTEGER NOT NULL,
  created REAL NOT NULL,
  UNIQUE(kind, ref)
);
CREATE TABLE audit(
  event_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL,
  ts REAL NOT NULL,
  action TEXT NOT NULL,
  item_kind TEXT NOT NULL,
  item_id INTEGER,
  detail TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_user ON audit(user_id, event_id);
"""

# The tables every store at the current version has (checked on open).
_REQUIRED_TABLES = frozenset(
    {
        "meta",
        "assistants",
        "users",
        "segments",
        "pages",
        "knowledge",
        "pending",
        "audit",
        "provenance",
        "chains",
        "page_vectors",
        "claims",
    }
)

# Forward migrations: MIGRATIONS[v] upgrades a store at version v to v + 1. A value is either
# SQL text (statements separated by ";", no ";" inside literals) or a callable taking the open
# connection; each migration runs in one transaction together with its version bump, so a crash
# mid-migration leaves the store at the old version. A new store is created at version 1
# (``_SCHEMA_V1``) and brought forward through the same chain, so every store of a version has
# the same schema however it was made.
Migration = str | Callable[[sqlite3.Connection], None]
MIGRATIONS: dict[int, Migration] = {
    # 1 -> 2: each page keeps its BM25 term row (memoryos_gpu.lexical.terms_to_blobs), so a
    # reopen loads the lexical index with the embeddings; rows of older pages are computed
    # from their text on the first open (MemoryEngine rebuild) and written back
    1: "ALTER TABLE pages ADD COLUMN terms BLOB",
    # 2 -> 3: provenance (which pages each knowledge entry and profile value was derived
    # from) and the validity of knowledge entries (a newer contradicting fact supersedes an
    # older one; both are kept). Entries of older stores have no provenance rows: they start
    # valid from when they were made (memoryos_gpu/store/derivations.py, docs/storage.md).
    2: """
CREATE TABLE provenance(
  item_kind TEXT NOT NULL CHECK (item_kind IN ('knowledge', 'profile')),
  item_id INTEGER NOT NULL,
  item_key TEXT NOT NULL DEFAULT '',
  page_id INTEGER NOT NULL,
  user_id TEXT NOT NULL,
  PRIMARY KEY (item_kind, item_id, item_key, page_id)
) WITHOUT ROWID;
CREATE INDEX provenance_page ON provenance(page_id);
CREATE INDEX provenance_user ON provenance(user_id, item_kind);
ALTER TABLE knowledge ADD COLUMN valid_from REAL;
ALTER TABLE knowledge ADD COLUMN valid_to REAL;
ALTER TABLE knowledge ADD COLUMN superseded_by INTEGER;
ALTER TABLE knowledge ADD COLUMN fact_key TEXT;
ALTER TABLE knowledge ADD COLUMN strength INTEGER NOT NULL DEFAULT 1;
CREATE INDEX knowledge_superseded ON knowledge(superseded_by) WHERE superseded_by IS NOT NULL;
CREATE INDEX knowledge_learned ON knowledge(source_user) WHERE owner_kind = 'assistant';
UPDATE knowledge SET valid_from = created, source_user = CASE WHEN owner_kind = 'user' THEN
  owner_id END
""",
    # 3 -> 4: a provenance row is keyed by its page's user too. Under per-shard stores an
    # assistant's owner shard records the pages of users on other shards, whose ids are
    # numbered by their own files: page 7 of one shard and page 7 of another are two sources.
    3: """
CREATE TABLE provenance_v4(
  item_kind TEXT NOT NULL CHECK (item_kind IN ('knowledge', 'profile')),
  item_id INTEGER NOT NULL,
  item_key TEXT NOT NULL DEFAULT '',
  page_id INTEGER NOT NULL,
  user_id TEXT NOT NULL,
  PRIMARY KEY (item_kind, item_id, item_key, page_id, user_id)
) WITHOUT ROWID;
INSERT INTO provenance_v4 SELECT item_kind, item_id, item_key, page_id, user_id FROM provenance;
DROP TABLE provenance;
ALTER TABLE provenance_v4 RENAME TO provenance;
CREATE INDEX provenance_page ON provenance(page_id);
CREATE INDEX provenance_user ON provenance(user_id, item_kind)
""",
    # 4 -> 5: a dialogue chain's meta summary is kept once, in its own row, instead of on
    # every page of the chain: it changes each time the chain grows, and rewriting it on
    # every page cost O(chain length) a page (O(n^2) over a long conversation). A chain's id
    # stays the id of its first page; its meta is the one its latest page carried. A user's
    # current chain meta is its tail's chain's (users.chain_meta, a copy, goes). And the
    # pages a promotion analyses are found without reading the segment's analysed ones.
    4: """
CREATE TABLE chains(
  chain_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
  meta TEXT
);
CREATE INDEX chains_user ON chains(user_id);
CREATE INDEX pages_unanalysed ON pages(segment_id, seg_pos) WHERE analysed = 0;
INSERT INTO chains(chain_id, user_id, meta) SELECT chain_id, user_id, meta FROM (
  SELECT chain_id, user_id, meta, MAX(seq) FROM pages WHERE chain_id IS NOT NULL
  GROUP BY chain_id
);
ALTER TABLE pages DROP COLUMN meta;
ALTER TABLE users DROP COLUMN chain_meta
""",
    # 5 -> 6: a page's embedding and BM25 term row (~1.7 KB, written once) move to a table of
    # their own, so the page row that a page's passage through the tiers rewrites (stm ->
    # pending -> mtm: tier, segment, chain) is the narrow one: SQLite rewrites a whole row on
    # any update, and the wide row made each of those updates ~3x dearer (benchmarks/README.md).
    # The indexes by segment and by chain leave out the pages on none (STM, pending): an
    # accepted page no longer writes three index entries it has no use for (still used by
    # the lookups and the foreign key, whose terms imply IS NOT NULL)
    5: """
CREATE TABLE page_vectors(
  page_id INTEGER PRIMARY KEY REFERENCES pages(page_id) ON DELETE CASCADE,
  embedding BLOB NOT NULL,
  terms BLOB
);
INSERT INTO page_vectors(page_id, embedding, terms) SELECT page_id, embedding, terms FROM pages;
ALTER TABLE pages DROP COLUMN embedding;
ALTER TABLE pages DROP COLUMN terms;
DROP INDEX pages_segment;
CREATE INDEX pages_segment ON pages(segment_id, seg_pos) WHERE segment_id IS NOT NULL;
DROP INDEX pages_chain;
CREATE INDEX pages_chain ON pages(chain_id) WHERE chain_id IS NOT NULL;
DROP INDEX pages_unanalysed;
CREATE INDEX pages_unanalysed ON pages(segment_id, seg_pos)
  WHERE analysed = 0 AND segment_id IS NOT NULL
""",
    # 6 -> 7: promotion claims (memoryos_gpu/engine/heat.py) in the store: the wave that makes
    # a segment hot claims its pages up to its own (``upto``; NULL: every unanalysed page), in
    # the wave's transaction, and the promotion deletes them in its own. Held only in memory
    # before, a crash between the two made the resumed promotion take every unanalysed page,
    # later ones included, and merged a segment's queued promotions into one. Older stores
    # start without claims: their queued promotions take every page, as they did.
    6: """
CREATE TABLE claims(
  segment_id INTEGER NOT NULL REFERENCES segments(segment_id) ON DELETE CASCADE,
  claim_order INTEGER NOT NULL,
  upto INTEGER,
  PRIMARY KEY (segment_id, claim_order)
) WITHOUT ROWID
""",
}

#: Rows fetched per round trip by the bulk loaders (bounds their transient memory).
LOAD_CHUNK = 65536
#: ... and the bytes of embeddings per chunk of a loader that reads them: a row of 384 float32
#: is 1.5 KB, held three times while a chunk is decoded (the row's blob, the joined blob, the
#: matrix), so 65,536 of them made a 350 MB transient, the peak of a reopen at 10,000 users
LOAD_CHUNK_BYTES = 16 << 20


class ArenaExtent(NamedTuple):
    """The arena a store's rows need: ``segments``; the page ``blocks`` they take (at least
    one each); the segment slots (``segment_width``) and knowledge ring positions
    (``knowledge_width``) every user must have room for. Why the widths: widening copies
    every user's rows into a new array (the old and the new resident at once): at 100,000
    users the knowledge rings' 8 -> 16 was a 2.5 GB transient, the peak of the whole reopen."""

    segments: int
    blocks: int
    segment_width: int
    knowledge_width: int


#: A page's readable columns in ``_page_dict``'s order (its chain's meta among them): pages
#: ``p`` joined to their chains ``c``; a query adds its WHERE on ``p``.
_PAGE_SELECT = (
    "SELECT p.page_id, p.user_id, p.seq, p.user_input, p.agent_response, p.timestamp, p.tier, "
    "p.segment_id, p.prev_page, p.next_page, c.meta, p.summary, p.keywords, p.analysed, "
    "p.mode, p.source, p.extra FROM pages p LEFT JOIN chains c ON c.chain_id = p.chain_id"
)
#: Users joined to their chain tail ``p`` and its chain ``c``: a user's current chain meta is
#: ``c.meta`` (the meta of the chain its tail is on), with ``_USER_COLS`` before it.
_USER_COLS = "users.user_id, users.assistant_id, users.clock, users.next_seq, users.chain_tail"
_USER_FROM = (
    "FROM users LEFT JOIN pages p ON p.page_id = users.chain_tail "
    "LEFT JOIN chains c ON c.chain_id = p.chain_id"
)
#: What a retrieval shows of a page (:class:`PageView`'s fields after the page id).
_VIEW_SELECT = (
    "SELECT p.page_id, p.user_id, p.user_input, p.agent_response, p.timestamp, p.chain_id, "
    "c.meta, p.extra FROM pages p LEFT JOIN chains c ON c.chain_id = p.chain_id"
)


def emb_blob(v: np.ndarray) -> bytes:
    return np.ascontiguousarray(v, dtype="<f4").tobytes()


def blob_matrix(blobs: Sequence[bytes], dim: int) -> np.ndarray:
    """Many float32 blobs to one ``[n, dim]`` array in a single copy (no per-row numpy)."""
    if not len(blobs):
        return np.zeros((0, dim), np.float32)
    joined = b"".join(blobs)
    if len(joined) != len(blobs) * dim * 4:
        raise StoreError(
            f"embedding blobs hold {len(joined)} bytes, expected {len(blobs)} x {dim} float32; "
            "the store is corrupt or was written with another dimension"
        )
    # frombuffer over a fresh bytes object is read-only; one copy makes it a writable float32.
    return np.frombuffer(joined, dtype="<f4").reshape(len(blobs), dim).astype(np.float32)


def kw_matrix(blobs: Sequence[bytes], width: int) -> np.ndarray:
    """Ragged int32 keyword-id blobs to a ``[n, width]`` matrix padded with -1 (ids past
    ``width`` dropped), vectorised: one join, one scatter (~5x faster than a per-row
    ``np.frombuffer`` loop on 2M rows)."""
    n = len(blobs)
    out = np.full((n, width), -1, np.int32)
    if not n:
        return out
    counts = np.fromiter(map(len, blobs), np.int64, n)
    if (counts & 3).any():
        raise StoreError("keyword-id blobs are not whole int32 arrays; the store is corrupt")
    counts >>= 2
    ids = np.frombuffer(b"".join(blobs), "<i4")
    starts = np.cumsum(counts) - counts
    if counts.max() > width:  # rare: drop the ids past the width
        col = np.arange(ids.size) - np.repeat(starts, counts)
        keep = col < width
        row = np.repeat(np.arange(n), counts)
        out[row[keep], col[keep]] = ids[keep]
        return out
    pos = np.repeat(np.arange(n, dtype=np.int64) * width - starts, counts)
    pos += np.arange(ids.size)
    out.reshape(-1)[pos] = ids
    return out


def _run_sql(db: sqlite3.Connection, script: str) -> None:
    for stmt in script.split(";"):
        if stmt.strip():
            db.execute(stmt)


class SQLiteStore:
    """One SQLite database. Thread-safe: one connection guarded by a re-entrant lock.

    Opening refuses (with :class:`StoreError`) a file that is not SQLite, a SQLite database
    that is not a memoryos-gpu store, and a store written by a newer schema; an older store is
    migrated forward (:data:`MIGRATIONS`).

    ``writer`` (default): claim the store for this object until :meth:`close`, so no other
    writer opens it meanwhile (:mod:`memoryos_gpu.store.writer`); a second claim raises
    :class:`~memoryos_gpu.store.writer.StoreLockedError` naming the holder. ``writer=False``
    is for tools that only read: they open beside a writer (and must not write).

    ``key``: the store is encrypted under this key (SQLCipher, :mod:`memoryos_gpu.store.encryption`:
    the same class over another connect function); None opens a plain store. A key that does not
    fit the file is a :class:`StoreError` at open.
    """

    #: Whether the store is encrypted at rest (its key is never kept on the object).
    encrypted: bool = False

    def __init__(
        self,
        path: str | Path = ":memory:",
        *,
        writer: bool = True,
        key: str | SecretStr | None = None,
        cache_mb: int = DEFAULT_CACHE_MB,
    ) -> None:
        from memoryos_gpu.store.encryption import as_secret, connect
        from memoryos_gpu.store.writer import SQLiteWriterLock

        if cache_mb < 0:
            raise StoreError(f"cache_mb must be >= 0 (0: SQLite's default), got {cache_mb}")
        self.path = str(path)
        self._cache_mb = int(cache_mb)
        self._issued: dict[str, int] = {}  # table -> the next id never handed out (new_ids)
        secret = as_secret(key)
        self.encrypted = secret is not None
        self._closed = False
        self._writer: SQLiteWriterLock | None = None
        #: Seconds spent in the last bulk load, by phase (``sql``: fetching rows, ``join``:
        #: joining blobs into matrices), keyed by loader name; read by benchmarks/reopen.py.
        self.load_stats: dict[str, dict[str, float]] = {}
        if self.path != ":memory:":
            if Path(self.path).is_dir():
                raise StoreError(f"cannot open store {self.path}: it is a directory")
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            if writer:  # first: a refused open must not touch the database
                self._writer = SQLiteWriterLock(self.path)
                self._writer.acquire()
        try:
            self._db, self._dbapi = connect(
                self.path, secret, check_same_thread=False, isolation_level=None, timeout=30.0
            )
        except BaseException as exc:  # whatever it is, the claim must not outlive the open
            self._release_writer()
            if isinstance(exc, sqlite3.Error):
                said = open_error(self.path, exc)
                raise said or StoreError(f"cannot open store {self.path}: {exc}") from exc
            raise
        self._lock = threading.RLock()
        self._depth = 0
        self._checkpointer: WalCheckpointer | None = None
        self._wal_fd: int | None = None  # the log, for sync()
        try:
            self._configure()
            self._migrate()
        except BaseException as exc:  # any failure: nothing stays open or claimed
            self._db.close()
            self._release_writer()
            if isinstance(exc, self._dbapi.DatabaseError):  # "file is not a database", ...
                said = open_error(self.path, exc)
                raise said or StoreError(
                    f"{self.path} is not a usable memoryos-gpu store: {exc}"
                ) from exc
            raise
        if self._writer is not None:  # the writer's commits leave checkpoints to a thread
            try:
                db, _ = connect(
                    self.path, secret, reopen=True, check_same_thread=False, isolation_level=None
                )
                self._checkpointer = WalCheckpointer(db, self.path + "-wal")
                self._db.execute(f"PRAGMA wal_autocheckpoint = {BACKSTOP_PAGES}")
            except BaseException:
                self.close()
                raise

    def _release_writer(self) -> None:
        if self._writer is not None:
            self._writer.release()
            self._writer = None

    @property
    def is_writer(self) -> bool:
        """Whether this store object holds the store's writer claim."""
        return self._writer is not None

    def _configure(self) -> None:
        db = self._db
        db.execute("PRAGMA foreign_keys = ON")
        if self.path == ":memory:":  # before the schema: an empty database takes a page size
            db.execute(f"PRAGMA page_size = {MEMORY_PAGE_SIZE}")
        else:
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"cannot put store {self.path} in WAL mode (got {mode!r})")
            if self._cache_mb:  # an in-memory store is all cache already
                db.execute(f"PRAGMA cache_size = {-self._cache_mb * 1024}")
        db.execute(f"PRAGMA synchronous = {SYNCHRONOUS}")

    # ------------------------------------------------------------------ schema
    # Dialect hooks: what differs between SQLite and PostgreSQL (postgres.py overrides them);
    # everything else in this class is SQL both run unchanged.
    _DIALECT = "SQLite"

    def _table_names(self) -> set[str]:
        """The store's own tables (not the engine's internal ones)."""
        return {
            r[0]
            for r in self.query(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        }

    def _create_schema(self, db: Any) -> None:
        """Create the version-1 schema (in the open transaction ``db``)."""
        _run_sql(db, _SCHEMA_V1)

    def _migrations(self) -> dict[int, Migration]:
        """This dialect's forward migrations (read at open, so tests can patch them)."""
        return MIGRATIONS

    def _migrate(self) -> None:
        tables = self._table_names()
        if "meta" not in tables:
            if tables:
                raise StoreError(
                    f"{self.path} is a {self._DIALECT} database but not a memoryos-gpu store "
                    f"(it has tables {sorted(tables)[:5]} and no meta table); refusing to touch it"
                )
            with self.transaction() as db:
                self._create_schema(db)
                db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        raw = self.get_meta("schema_version", "0")
        try:
            version = int(raw)
        except (TypeError, ValueError):
            raise StoreError(
                f"store {self.path} has an unreadable schema_version {raw!r}; it is corrupt"
            ) from None
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"store {self.path} has schema version {version}, newer than this memoryos-gpu "
                f"supports ({SCHEMA_VERSION}); upgrade memoryos-gpu to open it"
            )
        while version < SCHEMA_VERSION:
            step = self._migrations().get(version)
            if step is None:
                raise StoreError(
                    f"store {self.path} has schema version {version} and no migration from it "
                    f"to {version + 1} exists; it cannot be upgraded to {SCHEMA_VERSION}"
                )
            with self.transaction() as db:
                if callable(step):
                    step(db)
                else:
                    _run_sql(db, step)
                version += 1
                self.set_meta("schema_version", str(version))
        missing = _REQUIRED_TABLES - self._table_names()
        if missing:
            raise StoreError(f"store {self.path} lacks tables {sorted(missing)}; it is corrupt")

    @property
    def schema_version(self) -> int:
        return int(self.get_meta("schema_version", "0"))

    @contextmanager
    def transaction(self, durability: Durability = "commit") -> Iterator[sqlite3.Connection]:
        """One write transaction (re-entrant: a nested call runs in a savepoint of the outer one,
        so an exception inside it undoes only its own work before propagating).

        ``durability`` (of the outermost call): ``"commit"``, the commit returns once it is on
        disk; ``"deferred"``, it returns before, and :meth:`sync` waits for the disk (the
        engine commits accepted pages under its lock and waits for the disk after releasing
        it, before acknowledging them); ``"none"``, for work that can be redone (derived work,
        whose pending rows go in the same transaction; retrieval heat): a power loss can undo
        it, consistently, a crash of the process cannot. Either way the next synced commit
        syncs the log, and with it every commit before."""
        with self._lock:
            self._check_open()
            if self._depth:
                name = f"sp{self._depth}"
                self._db.execute(f"SAVEPOINT {name}")
                self._depth += 1
                try:
                    yield self._db
                except BaseException:
                    if self._db.in_transaction:  # not when SQLite rolled it all back (FULL)
                        self._db.execute(f"ROLLBACK TO {name}")
                        self._db.execute(f"RELEASE {name}")
                    raise
                else:
                    self._db.execute(f"RELEASE {name}")
                finally:
                    self._depth -= 1
                return
            if durability != "commit":
                self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException as exc:
                # SQLite may already have rolled back (e.g. SQLITE_FULL); never mask the error.
                if self._db.in_transaction:
                    with suppress(self._dbapi.Error):
                        self._db.execute("ROLLBACK")
                said = _environment_error(str(self.path), exc)
                if said is not None:
                    raise said from exc
                raise
            finally:
                self._depth = 0
                if durability != "commit":
                    self._db.execute(f"PRAGMA synchronous = {SYNCHRONOUS}")

    def sync(self) -> None:
        """Wait until every commit so far is on disk (see :meth:`transaction`): an fdatasync of
        the write-ahead log, as SQLite's own synced commit would have made it, but without this
        store's lock, so other threads go on committing meanwhile (and concurrent callers
        share one flush). Closed meanwhile (a ``close`` racing an ``add``): nothing to wait
        for, closing checkpointed the log into the database file and synced it."""
        if self._closed:
            return
        if self._wal_fd is None:
            if self.path == ":memory:":
                return
            self._wal_fd = os.open(self.path + "-wal", os.O_RDONLY)
        try:
            os.fdatasync(self._wal_fd)  # what SQLite calls for its own log syncs
        except OSError:
            if not self._closed:  # else: its descriptor was closed under us, see above
                raise

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """A consistent read of several statements (one read transaction; joins an open one)."""
        with self._lock:
            self._check_open()
            if self._db.in_transaction:
                yield self._db
                return
            self._db.execute("BEGIN")
            try:
                yield self._db
            finally:
                if self._db.in_transaction:
                    self._db.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            self._check_open()
            return self._db.execute(sql, params).fetchall()

    def _check_open(self) -> None:
        """StoreClosedError once :meth:`close` ran (call under the store lock): the statements
        of a closed store would raise the driver's own error, which names no cause."""
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def close(self) -> None:
        """Close the connection and give the writer claim up (idempotent)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._checkpointer is not None:
                    self._checkpointer.close()
                if self._wal_fd is not None:
                    os.close(self._wal_fd)
                self._db.close()
                self._release_writer()

    def check_integrity(self) -> list[str]:
        """Problems found by SQLite's integrity and foreign-key checks (empty when sound)."""
        out = [r[0] for r in self.query("PRAGMA integrity_check") if r[0] != "ok"]
        out += [f"foreign key: {tuple(r)}" for r in self.query("PRAGMA foreign_key_check")]
        return out

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.query("SELECT value FROM meta WHERE key = ?", (key,))
        return row[0][0] if row else default

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                "excluded.value",
                (key, value),
            )

    def check_embedding_model(self, model_id: str, dim: int) -> None:
        """Record the embedding model on first use; refuse a store built with another one."""
        stored = self.get_meta("embedding_model")
        if stored is None:
            with self.transaction():  # both or neither
                self.set_meta("embedding_model", model_id)
                self.set_meta("embedding_dim", str(dim))
        elif stored != model_id or int(self.get_meta("embedding_dim", "0")) != dim:
            raise StoreError(
                f"store {self.path} was built with embedding model {stored} "
                f"(dim {self.get_meta('embedding_dim')}); this engine uses {model_id} (dim {dim}). "
                "Open it with the same model, or re-ingest into a new store."
            )

    # ------------------------------------------------------------------ users
    def ensure_assistants(self, db: Any, assistant_ids: Iterable[str], now: float) -> None:
        """Create the assistants that are new, in the caller's transaction, in sorted order: on
        a PostgreSQL store shared by shard engines, two transactions creating the same new
        assistants each wait for the other's insert of a key it inserted first, so in any other
        order they can deadlock."""
        db.executemany(
            "INSERT INTO assistants(assistant_id, created) VALUES (?, ?) ON CONFLICT DO NOTHING",
            [(a, now) for a in sorted(set(assistant_ids))],
        )

    def ensure_users(self, db: Any, users: Sequence[tuple[str, str]], now: float) -> None:
        """Create users ``(user id, assistant id)`` (and their assistants) that are new, in
        the caller's transaction."""
        self.ensure_assistants(db, (a for _, a in users), now)
        db.executemany(
            "INSERT INTO users(user_id, assistant_id, created) VALUES (?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            [(u, a, now) for u, a in users],
        )

    def user_row(self, user_id: str) -> dict[str, Any] | None:
        rows = self.query(
            f"SELECT {_USER_COLS}, c.meta, users.profile, users.knowledge_head {_USER_FROM} "
            "WHERE users.user_id = ?",
            (user_id,),
        )
        if not rows:
            return None
        r = rows[0]
        return {
            "user_id": r[0],
            "assistant_id": r[1],
            "clock": r[2],
            "next_seq": r[3],
            "chain_tail": r[4],
            "chain_meta": r[5],
            "profile": json.loads(r[6]),
            "knowledge_head": r[7],
        }

    def profiles(self, user_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Structured profiles of many users in one query (missing users are left out)."""
        ids = list(user_ids)
        out: dict[str, dict[str, Any]] = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            out.update(
                (uid, json.loads(p))
                for uid, p in self.query(
                    f"SELECT user_id, profile FROM users WHERE user_id IN ({marks})", chunk
                )
            )
        return out

    def all_users(self) -> list[tuple]:
        return self.query(
            f"SELECT {_USER_COLS}, c.meta, users.knowledge_head {_USER_FROM} ORDER BY users.rowid"
        )

    def all_assistants(self) -> list[tuple]:
        return self.query("SELECT assistant_id, knowledge_head FROM assistants ORDER BY rowid")

    # ------------------------------------------------------------------ journal
    def known_sources(self, sources: Iterable[str]) -> dict[str, tuple[int, str]]:
        """Which idempotency keys were already accepted, mapped to (page id, user id). The
        owner comes along because a source is unique across the store (``pages.source``):
        the same source again is a duplicate only for the user who stored it."""
        out: dict[str, tuple[int, str]] = {}
        keys = [s for s in sources if s]
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            marks = ",".join("?" * len(chunk))
            rows = self.query(
                f"SELECT source, page_id, user_id FROM pages WHERE source IN ({marks})", chunk
            )
            out.update((r[0], (r[1], r[2])) for r in rows)
        return out

    # ------------------------------------------------------------------ pages
    def page_rows(self, page_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Readable fields of pages by id (no embeddings)."""
        out: dict[int, dict[str, Any]] = {}
        for chunk in _id_chunks(page_ids):
            marks = ",".join("?" * len(chunk))
            for r in self.query(f"{_PAGE_SELECT} WHERE p.page_id IN ({marks})", chunk):
                out[r[0]] = _page_dict(r)
        return out

    def page_views(self, page_ids: Sequence[int]) -> dict[int, PageView]:
        """What a retrieval shows of each page, by id (the engine caches these)."""
        out: dict[int, PageView] = {}
        for chunk in _id_chunks(page_ids):
            for r in self.query(
                f"{_VIEW_SELECT} WHERE p.page_id IN ({','.join('?' * len(chunk))})", chunk
            ):
                out[r[0]] = PageView(r[2], r[3], r[4], r[5], r[6], _json_dict(r[7]))
        return out

    def live_chains(self, chain_ids: Iterable[int]) -> set[int]:
        """Those of ``chain_ids`` with a page still in MTM (the engine keeps their meta in
        memory)."""
        out: set[int] = set()
        for chunk in _id_chunks(sorted(chain_ids)):
            marks = ",".join("?" * len(chunk))
            out.update(
                r[0]
                for r in self.query(
                    "SELECT DISTINCT chain_id FROM pages WHERE tier = 'mtm' AND chain_id IN "
                    f"({marks})",
                    chunk,
                )
            )
        return out

    def user_pages(self, user_id: str, tier: str | None = None) -> list[dict[str, Any]]:
        sql = f"{_PAGE_SELECT} WHERE p.user_id = ?"
        params: list[Any] = [user_id]
        if tier is not None:
            sql += " AND p.tier = ?"
            params.append(tier)
        return [_page_dict(r) for r in self.query(sql + " ORDER BY p.seq", params)]

    def page_window(self, user_id: str, offset: int, limit: int) -> tuple[list[dict], int]:
        """One page of a user's pages, oldest first, and how many the user has: a listing
        that stays stable while pages are added (new ones come last)."""
        rows = self.query(
            f"{_PAGE_SELECT} WHERE p.user_id = ? ORDER BY p.seq LIMIT ? OFFSET ?",
            (user_id, int(limit), int(offset)),
        )
        total = self.query("SELECT COUNT(*) FROM pages WHERE user_id = ?", (user_id,))[0][0]
        return [_page_dict(r) for r in rows], int(total)

    def page_embeddings(self, page_ids: Sequence[int], dim: int) -> np.ndarray:
        """The pages' embeddings, one row per id in order; ``KeyError`` for a page with no row
        (its callers hold the pages under the engine lock: a missing one is a bug)."""
        ids = [int(p) for p in page_ids]
        blobs = self._page_embedding_blobs(ids)
        return blob_matrix([blobs[i] for i in ids], dim)

    def live_page_embeddings(
        self, page_ids: Sequence[int], dim: int
    ) -> tuple[list[int], np.ndarray]:
        """The ids of ``page_ids`` that still have a row, in order, and their embeddings: for
        callers that hold page ids from outside the engine lock (a mem0 search ranks the pages
        a retrieval returned; one deleted since is simply not a result)."""
        ids = [int(p) for p in page_ids]
        blobs = self._page_embedding_blobs(ids)
        kept = [i for i in ids if i in blobs]
        return kept, blob_matrix([blobs[i] for i in kept], dim)

    def _page_embedding_blobs(self, ids: Sequence[int]) -> dict[int, bytes]:
        blobs: dict[int, bytes] = {}
        for chunk in _id_chunks(ids):
            marks = ",".join("?" * len(chunk))
            blobs.update(
                self.query(
                    f"SELECT page_id, embedding FROM page_vectors WHERE page_id IN ({marks})", chunk
                )
            )
        return blobs

    # ------------------------------------------------------------------ pending work
    def pending(self, kind: str) -> list[tuple[int, str, int]]:
        """(work_id, user_id, ref) of pending work of a kind, oldest first."""
        return [
            tuple(r)
            for r in self.query(
                "SELECT work_id, user_id, ref FROM pending WHERE kind = ? ORDER BY work_id", (kind,)
            )
        ]

    def pending_round(self, kind: str, limit: int, per_user: int = 1) -> list[tuple[int, str, int]]:
        """(work_id, user_id, ref) of one scheduling round: the oldest ``per_user`` pending
        items of each user that has some, at most ``limit``, in *waves*: every user's oldest
        item first, then every user's second oldest, and so on (so a user's items stay in
        order, and a user with a long backlog does not push another user's one page into
        later rounds).

        Within a wave tenants take turns: the oldest user of every tenant first, then the
        second oldest of each, and so on (oldest first within a turn), so a tenant with a
        thousand users pending does not push another tenant's one page into later rounds.
        Without tenant prefixes each wave is oldest first. The order is :func:`round_order`'s,
        over the kind's items read in queue order."""
        rows = self.query(
            "SELECT work_id, user_id, ref FROM pending WHERE kind = ? ORDER BY work_id", (kind,)
        )
        if not rows:
            return []
        _, users, _ = zip(*rows, strict=True)
        return [rows[i] for i in round_order(users, per_user, limit).tolist()]

    def count_pending(self, user_id: str | None = None) -> int:
        if user_id is None:
            return self.query("SELECT COUNT(*) FROM pending")[0][0]
        return self.query("SELECT COUNT(*) FROM pending WHERE user_id = ?", (user_id,))[0][0]

    # ------------------------------------------------------------------ bulk load (reopen)
    def arena_extent(self, block_size: int, knowledge_capacity: int) -> ArenaExtent:
        """What a reopen's arena must hold (:class:`ArenaExtent`), reserved before streaming
        so that it never grows by copying."""
        n, blocks, width = self.query(
            "SELECT COUNT(*), COALESCE(SUM((CASE WHEN n_pages > 1 THEN n_pages ELSE 1 END "
            "+ ? - 1) / ?), 0), COALESCE(MAX(slot) + 1, 0) FROM segments",
            (block_size, block_size),
        )[0]
        ring = self.query(
            "SELECT COALESCE(MAX(seq % ?) + 1, 0) FROM knowledge WHERE live = 1",
            (knowledge_capacity,),
        )[0][0]
        return ArenaExtent(int(n), int(blocks), int(width), int(ring))

    def _stream(
        self,
        name: str,
        sql: str,
        numeric: Sequence[tuple[str, Any]],
        dim: int,
        *,
        keep: Sequence[str] = (),
        params: Sequence[Any] = (),
    ) -> Iterator[dict[str, Any]]:
        """Yield ``sql``'s rows in chunks of :data:`LOAD_CHUNK_BYTES` of embeddings (at most
        :data:`LOAD_CHUNK` rows) as column arrays.

        Why chunks: a reopen of 10,000 users x 200 segments reads ~6 GB of embeddings; holding
        them all beside the arena they go into doubled the peak memory. Each chunk is consumed
        (written into the arena) before the next is fetched, all in one read snapshot.

        Row layout: the ``numeric`` columns (name, dtype) first, then the float32 embedding
        blob (one join per chunk into a ``[k, dim]`` matrix), then the ``keep`` columns,
        returned as Python lists. Timings accumulate in ``load_stats[name]``.
        """
        stats = self.load_stats[name] = {"rows": 0, "sql_s": 0.0, "join_s": 0.0}
        blob_col = len(numeric)
        chunk_rows = max(1, min(LOAD_CHUNK, LOAD_CHUNK_BYTES // (4 * dim)))
        with self._snapshot() as db:
            t0 = time.perf_counter()
            cur = db.execute(sql, params)
            while True:
                rows = cur.fetchmany(chunk_rows)
                t1 = time.perf_counter()
                stats["sql_s"] += t1 - t0
                if not rows:
                    return
                k = len(rows)
                cols = list(zip(*rows, strict=True))
                chunk: dict[str, Any] = {
                    key: np.asarray(cols[c], dt) for c, (key, dt) in enumerate(numeric)
                }
                joined = b"".join(cols[blob_col])
                if len(joined) != k * dim * 4:
                    raise StoreError(
                        f"{name}: embedding blobs hold {len(joined)} bytes, expected {k} x {dim} "
                        "float32; the store is corrupt or was written with another dimension"
                    )
                # frombuffer over bytes is read-only; the copy makes a writable array
                chunk["embedding"] = np.frombuffer(joined, "<f4").reshape(k, dim).copy()
                for c, key in enumerate(keep, start=blob_col + 1):
                    chunk[key] = list(cols[c])
                stats["rows"] += k
                stats["join_s"] += time.perf_counter() - t1
                yield chunk
                t0 = time.perf_counter()  # the consumer's time between chunks is not ours

    def iter_segments(self, dim: int, keyword_width: int) -> Iterator[dict[str, Any]]:
        """Every segment, in chunks ordered by ``segment_id`` (ascending across chunks).

        Keys: ``segment_id``, ``slot``, ``n_visit``, ``l_interaction``, ``last_access``,
        ``n_pages``, ``embedding`` ``[k, dim]``, ``user_id`` (list), ``kw_matrix``
        ``[k, keyword_width]`` int32 padded with -1 (built without a per-row loop).
        """
        numeric = [
            ("segment_id", np.int64),
            ("slot", np.int32),
            ("n_visit", np.int32),
            ("l_interaction", np.int32),
            ("last_access", np.float64),
            ("n_pages", np.int32),
        ]
        for chunk in self._stream(
            "segments",
            "SELECT segment_id, slot, n_visit, l_interaction, last_access, n_pages, "
            "embedding, user_id, kw_ids FROM segments ORDER BY segment_id",
            numeric,
            dim,
            keep=("user_id", "kw_ids"),
        ):
            t0 = time.perf_counter()
            chunk["kw_matrix"] = kw_matrix(chunk.pop("kw_ids"), keyword_width)
            self.load_stats["segments"]["join_s"] += time.perf_counter() - t0
            yield chunk

    def load_stm(self) -> dict[str, list[int]]:
        """Page ids of every user's STM, oldest first, in one query (tier 'stm' only: pages
        already pushed out to 'pending' are not in STM any more)."""
        out: dict[str, list[int]] = {}
        for uid, pid in self.query(
            "SELECT user_id, page_id FROM pages WHERE tier = 'stm' ORDER BY user_id, seq"
        ):
            out.setdefault(uid, []).append(pid)
        return out

    def iter_mtm_pages(self, dim: int) -> Iterator[dict[str, Any]]:
        """Every page in MTM, in chunks of ``page_id``, ``segment_id``, ``seg_pos``,
        ``embedding`` and ``terms`` (a list of term-row blobs, None where a page has none yet).
        Read in one sequential scan in key order (no random lookups, no SQL sort of the
        blobs): callers place each page by its (segment, position), so the order of the rows
        does not matter."""
        return self._stream(
            "mtm_pages",
            "SELECT p.page_id, p.segment_id, p.seg_pos, v.embedding, v.terms FROM pages p "
            "JOIN page_vectors v ON v.page_id = p.page_id WHERE p.tier = 'mtm' "
            "ORDER BY p.page_id",
            [("page_id", np.int64), ("segment_id", np.int64), ("seg_pos", np.int64)],
            dim,
            keep=("terms",),
        )

    def iter_page_views(self) -> Iterator[list[tuple[int, str, PageView]]]:
        """What retrievals show of every page in STM or MTM (or waiting between them), in
        chunks of ``(page_id, user_id, view)``: the engine holds these in memory, so
        assembling a retrieval reads no row. A user's pages come one after the other (the
        ``(user_id, seq)`` key's order), so the in-memory records of one user's pages, which a
        retrieval reads together, are made together and lie together."""
        with self._snapshot() as db:
            cur = db.execute(f"{_VIEW_SELECT} WHERE p.tier != 'evicted' ORDER BY p.user_id, p.seq")
            while rows := cur.fetchmany(LOAD_CHUNK):
                extras: dict[str, dict[str, Any]] = {}  # one dict per distinct text, per chunk
                out = []
                for r in rows:
                    extra = extras.get(r[7])
                    if extra is None:
                        extra = extras[r[7]] = _json_dict(r[7])
                    out.append((r[0], r[1], PageView(r[2], r[3], r[4], r[5], r[6], extra)))
                yield out

    def pages_without_terms(self) -> list[tuple[int, str, str, str, float, dict[str, Any]]]:
        """Pages not yet evicted and written before term rows were stored (schema 1):
        ``(page_id, user_id, user_input, agent_response, timestamp, extra)``. Their rows are
        computed once from the text and written back (:meth:`set_page_terms`)."""
        return [
            (r[0], r[1], r[2], r[3], r[4], _json_dict(r[5]))
            for r in self.query(
                "SELECT p.page_id, p.user_id, p.user_input, p.agent_response, p.timestamp, "
                "p.extra FROM pages p JOIN page_vectors v ON v.page_id = p.page_id "
                "WHERE p.tier != 'evicted' AND v.terms IS NULL ORDER BY p.page_id"
            )
        ]

    def set_page_terms(self, rows: Sequence[tuple[int, bytes]]) -> None:
        """Store pages' term-row blobs ``(page_id, blob)`` in one transaction."""
        with self.transaction() as db:
            db.executemany(
                "UPDATE page_vectors SET terms = ? WHERE page_id = ?", [(b, p) for p, b in rows]
            )

    def page_terms(self, page_ids: Sequence[int]) -> dict[int, bytes | None]:
        """Term-row blobs of pages by id (None for a page stored without one)."""
        out: dict[int, bytes | None] = {}
        for chunk in _id_chunks(page_ids):
            marks = ",".join("?" * len(chunk))
            out.update(
                self.query(
                    f"SELECT page_id, terms FROM page_vectors WHERE page_id IN ({marks})", chunk
                )
            )
        return out

    def iter_knowledge(self, dim: int) -> Iterator[dict[str, Any]]:
        """Live knowledge entries, owner after owner (the ``(owner_kind, owner_id, seq)`` key's
        order: the texts of one owner's entries, which a retrieval reads together, are then
        made together and lie together in memory), in chunks of ``entry_id``, ``seq``,
        ``embedding``, ``owner_kind``, ``owner_id`` and ``text`` (lists)."""
        return self._stream(
            "knowledge",
            "SELECT entry_id, seq, embedding, owner_kind, owner_id, text FROM knowledge "
            "WHERE live = 1 ORDER BY owner_kind, owner_id, seq",
            [("entry_id", np.int64), ("seq", np.int64)],
            dim,
            keep=("owner_kind", "owner_id", "text"),
        )

    # ------------------------------------------------------------------ knowledge
    #: The columns of a knowledge entry's readable form (:func:`_knowledge_dict`).
    _KNOWLEDGE_COLS = (
        "entry_id, owner_kind, owner_id, seq, text, live, mode, created, strength, valid_from, "
        "valid_to, superseded_by, source_user"
    )

    def knowledge_rows(self, entry_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Readable entries by id, each with its ``sources`` (the page ids it was derived
        from), validity (``valid_from``, ``valid_to``, ``superseded_by``) and ``strength``
        (how many times it was said)."""
        out: dict[int, dict[str, Any]] = {}
        for chunk in _id_chunks(entry_ids):
            marks = ",".join("?" * len(chunk))
            for r in self.query(
                f"SELECT {self._KNOWLEDGE_COLS} FROM knowledge WHERE entry_id IN ({marks})",
                chunk,
            ):
                out[r[0]] = _knowledge_dict(r)
        return self._with_sources(out)

    def _with_sources(self, rows: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        found = sources(self, KNOWLEDGE, list(rows))
        for eid, row in rows.items():
            row["sources"] = found.get(eid, [])
        return rows

    def knowledge_texts(self, entry_ids: Sequence[int]) -> dict[int, str]:
        """Text of each knowledge entry, by id (the engine caches these)."""
        out: dict[int, str] = {}
        for chunk in _id_chunks(entry_ids):
            sql = "SELECT entry_id, text FROM knowledge WHERE entry_id IN ({})"
            out.update(self.query(sql.format(",".join("?" * len(chunk))), chunk))
        return out

    def owner_knowledge(self, kind: str, owner_id: str, live_only: bool = True) -> list[dict]:
        """An owner's entries in ring order (``live_only=False``: superseded and dropped ones
        too, the history), each as :meth:`knowledge_rows` gives it."""
        rows = self.query(
            f"SELECT {self._KNOWLEDGE_COLS} FROM knowledge WHERE owner_kind = ? AND owner_id = ?"
            + (" AND live = 1" if live_only else "")
            + " ORDER BY seq",
            (kind, owner_id),
        )
        out = self._with_sources({r[0]: _knowledge_dict(r) for r in rows})
        for row in out.values():  # the owner is the caller's question: not repeated
            del row["owner_kind"], row["owner_id"]
        return list(out.values())

    # ------------------------------------------------------------------ ids
    def new_ids(self, db: sqlite3.Connection, table: str, n: int) -> list[int]:
        """``n`` ids for new rows of ``table`` (``pages``, ``segments`` or ``knowledge``) that
        no row of it ever had, inside the open write transaction ``db``; the caller inserts
        its rows with them (one ``executemany``: faster than reading generated ids back).

        Why not SQLite's own choice: a new rowid is the highest one + 1, so when the newest
        row is deleted its id goes to the next row, and whoever still holds it (a page id from
        the HTTP API, a mem0 memory id, an audit event) names another row, maybe another
        user's. The next free id of each table is kept in ``meta`` (``next_id.<table>``) and
        raised in the transaction that uses it, and remembered by the store object beyond a
        rollback: the engine shows a write's rows before its commit (the commit runs after
        the engine lock, ``EngineState.write_transaction``), so a transaction whose commit
        fails leaves its ids unused, a gap, never a reuse."""
        if n <= 0:
            return []
        column = ID_COLUMNS[table]
        key = f"next_id.{table}"
        top = db.execute(f"SELECT COALESCE(MAX({column}), 0) FROM {table}").fetchone()[0]
        mark = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        first = max(int(top) + 1, int(mark[0]) if mark else 1, self._issued.get(table, 1))
        self._issued[table] = first + n
        db.execute(
            "INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, str(first + n)),
        )
        return list(range(first, first + n))

    # ------------------------------------------------------------------ audit
    def audit_many(
        self,
        db: sqlite3.Connection,
        rows: Sequence[tuple[str, str, str, int | None]],
        details: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """:meth:`audit` of many events ``(user, action, kind, item id)`` in one statement,
        content-free or with ``details`` (one per row)."""
        now = time.time()
        if details is None:
            db.executemany(
                "INSERT INTO audit(user_id, ts, action, item_kind, item_id, detail) "
                "VALUES (?, ?, ?, ?, ?, '{}')",
                [(u, now, a, k, i) for u, a, k, i in rows],
            )
            return
        db.executemany(
            "INSERT INTO audit(user_id, ts, action, item_kind, item_id, detail) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            [
                (u, now, a, k, i, json.dumps(d, ensure_ascii=False))
                for (u, a, k, i), d in zip(rows, details, strict=True)
            ],
        )

    def audit(
        self,
        db: sqlite3.Connection,
        user_id: str,
        action: str,
        item_kind: str,
        item_id: int | None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        db.execute(
            "INSERT INTO audit(user_id, ts, action, item_kind, item_id, detail) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                user_id,
                time.time(),
                action,
                item_kind,
                item_id,
                json.dumps(detail or {}, ensure_ascii=False),
            ),
        )

    def history(self, user_id: str) -> list[dict[str, Any]]:
        return [
            {
                "event_id": r[0],
                "ts": r[1],
                "action": r[2],
                "item_kind": r[3],
                "item_id": r[4],
                "detail": json.loads(r[5]),
            }
            for r in self.query(
                "SELECT event_id, ts, action, item_kind, item_id, detail FROM "
                "audit WHERE user_id = ? ORDER BY event_id",
                (user_id,),
            )
        ]

    def item_history(self, user_id: str, item_kind: str, item_id: int) -> list[dict[str, Any]]:
        """The audit events of one page or knowledge entry of a user, oldest first."""
        return [
            {"event_id": r[0], "ts": r[1], "action": r[2], "detail": json.loads(r[3])}
            for r in self.query(
                "SELECT event_id, ts, action, detail FROM audit WHERE user_id = ? AND "
                "item_kind = ? AND item_id = ? ORDER BY event_id",
                (user_id, item_kind, int(item_id)),
            )
        ]

    def last_updates(self, user_id: str, item_kind: str) -> dict[int, float]:
        """When each edited page or knowledge entry of a user was last edited, by id."""
        return dict(
            self.query(
                "SELECT item_id, MAX(ts) FROM audit WHERE user_id = ? AND item_kind = ? AND "
                "action = 'update' GROUP BY item_id",
                (user_id, item_kind),
            )
        )

    # ------------------------------------------------------------------ export / delete
    def export_user(self, user_id: str) -> dict[str, Any] | None:
        user = self.user_row(user_id)
        if user is None:
            return None
        segs = self.query(
            "SELECT segment_id, slot, summary, keywords, n_visit, l_interaction, "
            "last_access, created, n_pages FROM segments WHERE user_id = ? "
            "ORDER BY slot",
            (user_id,),
        )
        segment_pages: dict[int, list[int]] = {}
        chains: dict[int, dict[str, Any]] = {}
        for pid, sid, chain, meta in self.query(
            "SELECT p.page_id, p.segment_id, p.chain_id, c.meta FROM pages p LEFT JOIN chains c "
            "ON c.chain_id = p.chain_id WHERE p.user_id = ? ORDER BY p.seq",
            (user_id,),
        ):
            if sid is not None:
                segment_pages.setdefault(sid, []).append(pid)
            if chain is not None:
                chains.setdefault(chain, {"chain_id": chain, "meta": meta, "sources": []})
                chains[chain]["sources"].append(pid)
        return {
            "user": user,
            "pages": self.user_pages(user_id),
            "chains": list(chains.values()),
            "segments": [
                {
                    "segment_id": r[0],
                    "slot": r[1],
                    "summary": r[2],
                    "keywords": json.loads(r[3]),
                    "n_visit": r[4],
                    "l_interaction": r[5],
                    "last_access": r[6],
                    "created": r[7],
                    "n_pages": r[8],
                    "sources": segment_pages.get(r[0], []),
                }
                for r in segs
            ],
            "user_knowledge": self.owner_knowledge("user", user_id, live_only=False),
            "profile_sources": profile_sources(self, user_id),
            "pending": self.count_pending(user_id),
            "history": self.history(user_id),
        }

    def delete_user(self, user_id: str) -> Forgotten | None:
        """Remove every row held about the user (pages, segments, knowledge, pending, audit),
        everything derived from the user's pages elsewhere (assistant knowledge: see
        :func:`~memoryos_gpu.store.derivations.forget_pages`) and the saved keyword statistics
        (they count the user's words; the next open refits them from the pages left). One
        audit event records the deletion, without content. Returns what was forgotten beyond
        the user's own rows (None: there was no such user).

        Deleted content is overwritten in the database file (``PRAGMA secure_delete``), and the
        write-ahead log is checkpointed and truncated afterwards so older copies of the user's
        pages do not linger in it (:meth:`checkpoint`: while a reader holds the log, retried
        until it is truncated).
        """
        with self._lock:
            self.begin_erasure()
            with self.transaction() as db:
                removed = self._delete_user_rows(db, user_id)
            self.checkpoint()
            return removed

    #: How long (ms) :meth:`checkpoint` waits for readers of the log before leaving the
    #: truncation to a retry: it holds the store lock meanwhile.
    ERASURE_WAIT_MS: int = 250
    #: The first and the longest wait (s) before a retry of the truncation.
    ERASURE_RETRY_S: tuple[float, float] = (0.5, 10.0)
    #: A truncation of the log that :meth:`checkpoint` could not do yet; retried on a timer.
    _erasure_due: bool = False
    _erasure_timer: threading.Timer | None = None

    def begin_erasure(self) -> None:
        """Deletions from now on overwrite the freed space (``PRAGMA secure_delete``), so the
        deleted text does not stay in the database file (call before deleting content)."""
        with self._lock:
            self._check_open()
            self._db.execute("PRAGMA secure_delete = ON")

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the file and truncate it, after a deletion, so the
        deleted rows' old versions do not stay in the log.

        It follows a committed deletion, so it never fails for the log's sake: a caller must
        report the deletion done (and its memory side must not be skipped). The statement runs
        under the store lock, as every statement on the shared connection must (beside another
        thread's open statement it failed with "database table is locked"), and waits at most
        :attr:`ERASURE_WAIT_MS` for readers of the log, not the connection's 30 s with every
        other call of the store waiting behind it. When the log cannot be truncated now -- a
        reader still on it (the statement's ``busy`` result, not an error), a transaction open,
        an error -- the truncation is retried on a timer, backing off up to
        :attr:`ERASURE_RETRY_S`, until it is done or the store closes (then the last
        connection to the file to close checkpoints the log and removes it)."""
        if self.path == ":memory:":
            return
        with self._lock:
            self._check_open()
            if self._truncate_log():
                return
        self._retry_erasure(self.ERASURE_RETRY_S[0])

    def _truncate_log(self) -> bool:
        """One try of the truncating checkpoint (under the store lock): whether the log is
        empty now. Not inside a transaction: its commit may still log deleted rows."""
        if self._depth or self._db.in_transaction:
            return self._erasure_tried(False, "a transaction is open")
        try:
            with self._busy_timeout(self.ERASURE_WAIT_MS):
                busy = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        except self._dbapi.Error as exc:
            return self._erasure_tried(False, f"{type(exc).__name__}: {exc}")
        return self._erasure_tried(busy == 0, "a reader holds it")

    def _erasure_tried(self, done: bool, why: str) -> bool:
        """Record a try (``done`` or not, and why not): the first failure and the success
        after failures are logged, not every retry."""
        if not done and not self._erasure_due:
            log.warning(
                "%s: the write-ahead log still holds deleted rows (%s); the truncation is retried",
                self.path,
                why,
            )
        elif done and self._erasure_due:
            log.info("%s: the write-ahead log is truncated", self.path)
        self._erasure_due = not done
        return done

    @contextmanager
    def _busy_timeout(self, ms: int) -> Iterator[None]:
        """The connection waits at most ``ms`` for a lock while inside (under the store lock)."""
        before = self._db.execute("PRAGMA busy_timeout").fetchone()[0]
        self._db.execute(f"PRAGMA busy_timeout = {int(ms)}")
        try:
            yield
        finally:
            self._db.execute(f"PRAGMA busy_timeout = {int(before)}")

    def _retry_erasure(self, delay: float) -> None:
        """Try the truncation again in ``delay`` s (one timer at a time: a pending one will)."""
        with self._lock:
            if self._closed or self._erasure_timer is not None:
                return
            timer = threading.Timer(delay, self._erasure_retry_due, args=(delay,))
            timer.name, timer.daemon = "memoryos-erasure", True
            self._erasure_timer = timer
        timer.start()

    def _erasure_retry_due(self, delay: float) -> None:
        with self._lock:
            self._erasure_timer = None
            if self._closed or not self._erasure_due or self._truncate_log():
                return
        self._retry_erasure(min(2 * delay, self.ERASURE_RETRY_S[1]))

    def _delete_user_rows(self, db: Any, user_id: str) -> Forgotten | None:
        """Delete every row about the user in the open transaction ``db`` (both dialects)."""
        pages = [
            r[0]
            for r in db.execute(
                "SELECT page_id FROM pages WHERE user_id = ?", (user_id,)
            ).fetchall()
        ]
        forgotten = forget_pages(db, pages, drop_user=user_id)
        # assistant entries learned from the user without provenance rows (written with
        # MemoryConfig(provenance=False)) still name the user as their source
        learned = [
            int(r[0])
            for r in db.execute(
                "SELECT entry_id FROM knowledge WHERE owner_kind = 'assistant' AND source_user = ?",
                (user_id,),
            ).fetchall()
        ]
        db.execute(
            "DELETE FROM knowledge WHERE owner_kind = 'assistant' AND source_user = ?", (user_id,)
        )
        forgotten.entries = sorted({*forgotten.entries, *learned})
        db.execute("DELETE FROM pending WHERE user_id = ?", (user_id,))
        db.execute("DELETE FROM pages WHERE user_id = ?", (user_id,))
        db.execute("DELETE FROM chains WHERE user_id = ?", (user_id,))
        db.execute("DELETE FROM segments WHERE user_id = ?", (user_id,))
        db.execute("DELETE FROM knowledge WHERE owner_kind = 'user' AND owner_id = ?", (user_id,))
        db.execute("DELETE FROM audit WHERE user_id = ?", (user_id,))
        db.execute("DELETE FROM meta WHERE key = 'keyword_extractor'")
        cur = db.execute("DELETE FROM users WHERE user_id = ?", (user_id,))
        if cur.rowcount <= 0:
            return None
        self.audit(db, user_id, "delete", "user", None, {"pages": len(pages)})
        return forgotten

    def rows_about(self, user_id: str) -> int:
        """Rows anywhere in the store that name the user or derive from the user's pages (0
        after delete_user, whose one content-free audit event of the deletion is not counted)."""
        total = 0
        for table, col in (
            ("users", "user_id"),
            ("pages", "user_id"),
            ("segments", "user_id"),
            ("pending", "user_id"),
            ("knowledge", "owner_id"),
            ("provenance", "user_id"),
        ):
            total += self.query(f"SELECT COUNT(*) FROM {table} WHERE {col} = ?", (user_id,))[0][0]
        total += self.query(  # assistant entries learned from the user's pages
            "SELECT COUNT(*) FROM knowledge WHERE owner_kind = 'assistant' AND source_user = ?",
            (user_id,),
        )[0][0]
        total += self.query(
            "SELECT COUNT(*) FROM audit WHERE user_id = ? AND NOT (action = 'delete' AND "
            "item_kind = 'user')",
            (user_id,),
        )[0][0]
        return total

    def counts(self) -> dict[str, int]:
        out = {}
        for table in ("users", "assistants", "segments", "pending", "audit"):
            out[table] = self.query(f"SELECT COUNT(*) FROM {table}")[0][0]
        for tier, n in self.query("SELECT tier, COUNT(*) FROM pages GROUP BY tier"):
            out[f"pages_{tier}"] = n
        out["knowledge_live"] = self.query("SELECT COUNT(*) FROM knowledge WHERE live = 1")[0][0]
        return out


def _page_dict(r: tuple) -> dict[str, Any]:
    return {
        "page_id": r[0],
        "user_id": r[1],
        "seq": r[2],
        "user_input": r[3],
        "agent_response": r[4],
        "timestamp": r[5],
        "tier": r[6],
        "segment_id": r[7],
        "prev_page": r[8],
        "next_page": r[9],
        "meta": r[10],
        "summary": r[11],
        "keywords": json.loads(r[12]) if r[12] and r[12] != "[]" else [],
        "analysed": bool(r[13]),
        "mode": r[14],
        "source": r[15],
        "extra": _json_dict(r[16]),
    }


def _knowledge_dict(r: tuple) -> dict[str, Any]:
    return {
        "entry_id": r[0],
        "owner_kind": r[1],
        "owner_id": r[2],
        "seq": r[3],
        "text": r[4],
        "live": bool(r[5]),
        "mode": r[6],
        "created": r[7],
        "strength": r[8],
        "valid_from": r[9] if r[9] is not None else r[7],
        "valid_to": r[10],
        "superseded_by": r[11],
        "source_user": r[12],
    }


def _json_dict(text: str | None) -> dict[str, Any]:
    return json.loads(text) if text and text != "{}" else {}  # most pages: no decode


def select_in(db: Any, select: str, ids: Sequence[Any]) -> list[tuple]:
    """The rows of ``select`` (ending in ``IN``) over ``ids``, one statement per chunk."""
    rows: list[tuple] = []
    for i in range(0, len(ids), 500):
        chunk = list(ids[i : i + 500])
        rows += db.execute(f"{select} ({','.join('?' * len(chunk))})", chunk).fetchall()
    return rows


def _id_chunks(ids: Sequence[int], size: int = 500) -> list[list[int]]:
    """Ids as ints, in chunks small enough for one ``IN (...)`` list."""
    ints = [int(i) for i in ids]
    return [ints[i : i + size] for i in range(0, len(ints), size)]


class PageView(NamedTuple):
    """The fields of a page that a retrieval returns."""

    user_input: str
    agent_response: str
    timestamp: float
    chain_id: int | None  # the dialogue chain the page is on (MTM pages)
    meta: str | None  # that chain's meta summary
    extra: dict[str, Any]

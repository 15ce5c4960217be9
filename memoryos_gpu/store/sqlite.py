"""SQLite store: the durable truth behind the arena.

Why SQLite: embedded, transactional, one file to back up, and fast enough for one box when
every accepted batch is one transaction (WAL mode, synchronous=NORMAL... FULL for
acknowledged pages, see :data:`SYNCHRONOUS`). The engine writes a page here before ``add``
returns; derived work (chain, MTM insertion, promotion) is recorded in ``pending`` in the same
transaction as the page, and each pending item is deleted in the same transaction as its
effects, so a crash at any point loses nothing and does nothing twice.

Embeddings are stored as little-endian float32 blobs with the model id and dimension recorded
in ``meta``; keyword ids as int32 blobs (the arena's hashed ids) beside the readable words.

This module keeps what opens, configures, migrates and writes a store. The rest lives
beside it: the errors (:mod:`memoryos_gpu.store.errors`), the schema and its migrations
(:mod:`memoryos_gpu.store.sqlite_schema`), the encoding of rows and blobs
(:mod:`memoryos_gpu.store.rows`), and two mixins that :class:`SQLiteStore` inherits: the read
side (:mod:`memoryos_gpu.store.reads`) and the erasure of deleted content
(:mod:`memoryos_gpu.store.erasure`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Literal

from pydantic import SecretStr

from memoryos_gpu.shared_gate import SharedGate
from memoryos_gpu.store import sqlite_schema
from memoryos_gpu.store.derivations import Forgotten, forget_pages
from memoryos_gpu.store.erasure import SQLiteErasure
from memoryos_gpu.store.errors import (
    StoreClosedError,
    StoreError,
    damaged_error,
    damaged_store,
    environment_error,
    open_error,
)
from memoryos_gpu.store.reads import StoreReads
from memoryos_gpu.store.rows import audit_owner
from memoryos_gpu.store.sqlite_schema import SCHEMA_V1, Migration, run_sql
from memoryos_gpu.store.wal import BACKSTOP_PAGES, WalCheckpointer

log = logging.getLogger("memoryos_gpu.store")

#: The stores open in this process, for the fork hook (:func:`_disown_in_children`).
_OPEN_STORES: weakref.WeakSet[SQLiteStore] = weakref.WeakSet()


def _disown_in_children() -> None:
    """In a forked child, every store the parent had open is the parent's (:meth:`_disown`):
    a child that wrote through the inherited connection corrupted its parent's view, and one
    that closed it rewrote or checkpointed the parent's file and cleared its lock record."""
    for store in list(_OPEN_STORES):
        store._disown()


os.register_at_fork(after_in_child=_disown_in_children)

SYNCHRONOUS = "FULL"  # an acknowledged page survives power loss, not only a process crash

#: The tables whose new rows take their ids from :meth:`SQLiteStore.new_ids`, and the id column.
ID_COLUMNS = {
    "pages": "page_id",
    "segments": "segment_id",
    "knowledge": "entry_id",
    "audit": "event_id",
    "outbox": "fact_id",
}

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


class SQLiteStore(StoreReads, SQLiteErasure):
    """One SQLite database. Thread-safe: one connection guarded by a re-entrant lock.

    Opening refuses (with :class:`StoreError`) a file that is not SQLite, a SQLite database
    that is not a memoryos-gpu store, and a store written by a newer schema; an older store is
    migrated forward (:data:`~memoryos_gpu.store.sqlite_schema.MIGRATIONS`).

    ``writer`` (default): claim the store for this object until :meth:`close`, so no other
    writer opens it meanwhile (:mod:`memoryos_gpu.store.writer`); a second claim raises
    :class:`~memoryos_gpu.store.writer.StoreLockedError` naming the holder. ``writer=False``
    is for tools that only read: they open beside a writer, and SQLite refuses a write
    through them (``PRAGMA query_only``: "attempt to write a readonly database").

    What only reads (queries, the streaming loads of a reopen, history, export) is
    :class:`~memoryos_gpu.store.reads.StoreReads`, which this class inherits.

    ``key``: the store is encrypted under this key (SQLCipher, :mod:`memoryos_gpu.store.encryption`:
    the same class over another connect function); None opens a plain store. A key that does not
    fit the file is a :class:`StoreError` at open.
    """

    #: Times this store's writer claim was found lost (PostgreSQL: its session dropped by a
    #: server restart); a file lock is never lost. The engine reloads when it moves.
    claims_lost: int = 0
    #: Set in a forked child (:meth:`_disown`): the store is the parent's. A class default, so
    #: a backend that opens without this class's ``__init__`` (PostgreSQL) has it too.
    _forked: bool = False

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
            folder = Path(self.path).parent
            try:  # a user's path (under /proc, no permission): one line, not a traceback
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                why = exc.strerror or str(exc)
                raise StoreError(
                    f"cannot open store {self.path}: cannot create its folder {folder} ({why}); "
                    "pick a store path in a folder this user can create"
                ) from None
            if writer:  # first: a refused open must not touch the database
                self._writer = SQLiteWriterLock(self.path)
                self._writer.acquire()
                _create_private(self.path)
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
        self._opened_in = os.getpid()
        _OPEN_STORES.add(self)
        if self.path != ":memory:":  # a file the erasure thread rewrites (erasure.py)
            self.rewrite_gate = SharedGate()
        self._depth = 0
        self._checkpointer: WalCheckpointer | None = None
        self._wal_fd: int | None = None  # the log, for sync()
        try:
            if self._writer is not None:  # the database file exists now: its byte lock too
                self._writer.hold_database()
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
        if not writer:
            # "must not write", enforced: a write through a reader beside a running engine
            # (a program's delete_user) left that engine's memory and the store disagreeing
            self._db.execute("PRAGMA query_only = ON")
        if self._writer is not None:  # the writer's commits leave checkpoints to a thread
            try:
                db, _ = connect(
                    self.path, secret, reopen=True, check_same_thread=False, isolation_level=None
                )
                self._checkpointer = WalCheckpointer(db, self.path + "-wal")
                self._db.execute(f"PRAGMA wal_autocheckpoint = {BACKSTOP_PAGES}")
                self.resume_erasure()
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
        run_sql(db, SCHEMA_V1)

    def _migrations(self) -> dict[int, Migration]:
        """This dialect's forward migrations (read at open, so tests can patch them)."""
        return sqlite_schema.MIGRATIONS

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
        # the current version and tables: read at open (module attributes: tests patch them)
        latest = sqlite_schema.SCHEMA_VERSION
        required = sqlite_schema.required_tables(latest)
        raw = self.get_meta("schema_version", "0")
        try:
            version = int(raw)
        except (TypeError, ValueError):
            raise StoreError(
                f"store {self.path} has an unreadable schema_version {raw!r}; it is corrupt"
            ) from None
        if version > latest:
            raise StoreError(
                f"store {self.path} has schema version {version}, newer than this memoryos-gpu "
                f"supports ({latest}); upgrade memoryos-gpu to open it"
            )
        while version < latest:
            step = self._migrations().get(version)
            if step is None:
                raise StoreError(
                    f"store {self.path} has schema version {version} and no migration from it "
                    f"to {version + 1} exists; it cannot be upgraded to {latest}"
                )
            with self.transaction() as db:
                if callable(step):
                    step(db)
                else:
                    run_sql(db, step)
                version += 1
                self.set_meta("schema_version", str(version))
        missing = required - self._table_names()
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
            if self._db.in_transaction:  # left open by a call interrupted before its rollback
                log.warning("store %s: rolling back what an interrupted call left open", self.path)
                self._db.execute("ROLLBACK")
            try:  # from the first statement: a Ctrl-C after any of them still rolls back
                # set each time: a level left lowered by an interrupted call is put back
                self._db.execute(
                    f"PRAGMA synchronous = {SYNCHRONOUS if durability == 'commit' else 'NORMAL'}"
                )
                self._db.execute("BEGIN IMMEDIATE")
                self._depth = 1
                yield self._db
                self._db.execute("COMMIT")
            except BaseException as exc:
                # SQLite may already have rolled back (e.g. SQLITE_FULL); never mask the error.
                if self._db.in_transaction:
                    with suppress(self._dbapi.Error):
                        self._db.execute("ROLLBACK")
                # said for an operator once begun (BEGIN's own error stays SQLite's, as before)
                said = environment_error(str(self.path), exc) if self._depth else None
                if said is not None:
                    raise said from exc
                raise
            finally:
                self._depth = 0
                # not inside a transaction a failed ROLLBACK left (SQLite refuses the change
                # there, and its error would hide this one's): the next call ends it first
                if durability != "commit" and not self._db.in_transaction:
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
            try:  # BEGIN inside: a Ctrl-C after it still ends the read transaction
                self._db.execute("BEGIN")
                yield self._db
            finally:
                if self._db.in_transaction:
                    self._db.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            self._check_open()
            try:
                return self._db.execute(sql, params).fetchall()
            except self._dbapi.DatabaseError as exc:  # a damaged file: said, with what to do
                said = damaged_error(exc, self.path)
                if said is None:
                    raise
                raise said from exc

    def _check_open(self) -> None:
        """StoreClosedError once :meth:`close` ran (call under the store lock): the statements
        of a closed store would raise the driver's own error, which names no cause. In a
        forked child, always (:meth:`_disown`)."""
        if self._forked:
            raise StoreClosedError(
                f"store {self.path} was opened in process {self._opened_in}, and process "
                f"{os.getpid()} is a fork of it: a SQLite connection must not cross a fork "
                "(its writes would collide with the parent's); open the store again in this "
                "process"
            )
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def _disown(self) -> None:
        """In a forked child: the store is the parent's. Its statements are refused
        (:meth:`_check_open`), and its close touches nothing of the parent's (no checkpoint,
        no rewrite of the file, no record cleared: :meth:`close`). A fresh store lock, since a
        parent's thread may have held this one at the fork, and none of the parent's threads
        (the checkpointer, the erasure timer) exists here."""
        self._forked = True
        self._lock = threading.RLock()
        self._checkpointer = None
        self._erasure_timer = None

    def close(self) -> None:
        """Close the connection and give the writer claim up (idempotent).

        The background checkpointer stops first: a checkpoint of its own in progress makes
        the erasure's truncation of the log fail at once (SQLite does not wait for it), and
        the close warned "a reader holds the log" with no reader anywhere.

        In a forked child only this process's descriptors of the writer lock close (the
        claim, its record and the file stay the parent's); the connection is left to the
        garbage collector, and nothing is checkpointed or rewritten."""
        if self._forked:
            if not self._closed:
                self._closed = True
                self._release_writer()
            return
        with self._lock:
            if not self._closed:
                if self._checkpointer is not None:
                    self._checkpointer.close()
                    self._checkpointer = None
                self._erase_at_close()
                self._closed = True
                if self._wal_fd is not None:
                    os.close(self._wal_fd)
                self._db.close()
                self._release_writer()

    def refuse_if_damaged(self) -> None:
        """Raise the damaged-file :class:`StoreError` when SQLite's quick check (every page of
        the file read once, O(store size)) finds damage. For the commands that must not answer
        from a damaged file or write into it (``stats``, ``delete``): a read of the pages that
        are sound answers as if nothing were wrong, and a deletion writes into the damage."""
        found = [r[0] for r in self.query("PRAGMA quick_check") if r[0] != "ok"]
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise damaged_store(f"{self.path}: {found[0]}{more}")

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

    # ------------------------------------------------------------------ pages
    def set_page_terms(self, rows: Sequence[tuple[int, bytes]]) -> None:
        """Store pages' term-row blobs ``(page_id, blob)`` in one transaction."""
        with self.transaction() as db:
            db.executemany(
                "UPDATE page_vectors SET terms = ? WHERE page_id = ?", [(b, p) for p, b in rows]
            )

    # ------------------------------------------------------------------ ids
    def new_ids(self, db: sqlite3.Connection, table: str, n: int) -> list[int]:
        """``n`` ids for new rows of ``table`` (``pages``, ``segments``, ``knowledge`` or
        ``audit``) that no row of it ever had, inside the open write transaction ``db``; the
        caller inserts its rows with them (one ``executemany``: faster than reading generated
        ids back).

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
        content-free or with ``details`` (one per row). Their ids come from :meth:`new_ids`,
        as a page's do: SQLite gave a new event the highest id + 1, so deleting a user whose
        events were the newest handed their ids to the next events (another user's), and a
        client reading the log from its last event id skipped those."""
        if not rows:
            return
        now = time.time()
        ids = self.new_ids(db, "audit", len(rows))
        sql = (
            "INSERT INTO audit(event_id, user_id, ts, action, item_kind, item_id, detail) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)"
        )
        if details is None:
            rows_in = zip(ids, rows, strict=True)
            db.executemany(sql, [(e, u, now, a, k, i, "{}") for e, (u, a, k, i) in rows_in])
            return
        db.executemany(
            sql,
            [
                (e, u, now, a, k, i, json.dumps(d, ensure_ascii=False))
                for e, (u, a, k, i), d in zip(ids, rows, details, strict=True)
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
        self.audit_many(db, [(user_id, action, item_kind, item_id)], [detail or {}])

    # ------------------------------------------------------------------ delete
    def delete_user(self, user_id: str) -> Forgotten | None:
        """Remove every row held about the user (pages, segments, knowledge, pending, audit, a
        shard's outbox), everything derived from the user's pages elsewhere (assistant
        knowledge: see :func:`~memoryos_gpu.store.derivations.forget_pages`) and the saved
        keyword statistics (they count the user's words; the next open refits them from the
        pages left). One audit event records the deletion, without content. Returns what was
        forgotten beyond the user's own rows (None: there was no such user).

        The deleted content then leaves the database file and its log (:meth:`checkpoint`,
        :mod:`memoryos_gpu.store.erasure`).
        """
        with self._lock:
            self.begin_erasure()
            with self.transaction() as db:
                removed = self._delete_user_rows(db, user_id)
            self.checkpoint()
            return removed

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
        learned = db.execute(
            "SELECT entry_id, owner_id FROM knowledge WHERE owner_kind = 'assistant' AND "
            "source_user = ?",
            (user_id,),
        ).fetchall()
        db.execute(
            "DELETE FROM knowledge WHERE owner_kind = 'assistant' AND source_user = ?", (user_id,)
        )
        forgotten.owners += [(int(e), audit_owner("assistant", str(a))) for e, a in learned]
        forgotten.entries = sorted({*forgotten.entries, *(int(e) for e, _ in learned)})
        db.execute("DELETE FROM pending WHERE user_id = ?", (user_id,))
        # a shard's assistant facts from the user's pages not yet sent to their owner
        db.execute("DELETE FROM outbox WHERE source_user = ?", (user_id,))
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
        # the assistants' entries learned from the user: their deletion in the assistant's
        # history (the user's own events went with the user)
        others = {(e, o) for e, o in forgotten.owners if o != user_id}
        self.audit_many(db, [(o, "delete", "knowledge", e) for e, o in sorted(others)])
        return forgotten


def _create_private(path: str) -> None:
    """Create a new store's database file readable by its owner only (0600), before SQLite
    creates it 0644 (less the umask): the file holds every user's text, and SQLite gives its
    ``-wal`` and ``-shm`` files the database file's permissions. A folder the store creates is
    0700; an existing file or folder keeps its permissions (the operator's choice)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))

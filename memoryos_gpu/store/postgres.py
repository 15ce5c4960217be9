"""PostgreSQL store: the same durable truth as :mod:`memoryos_gpu.store.sqlite`, on a server that
engine processes on several machines can share.

Why a subclass of :class:`SQLiteStore`: the engine and the store speak one SQL for everything
both databases run unchanged (nearly all of it), so that SQL is written once, in sqlite.py
and reads.py. What differs is kept here, and in two modules beside this one:

* connections: a :class:`psycopg_pool.ConnectionPool`; reads outside a write transaction take
  any pooled connection, a write transaction holds one connection from ``BEGIN`` to ``COMMIT``
  (re-entrant: nested calls are savepoints, as in SQLite), and bulk loads read one
  ``REPEATABLE READ`` snapshot through server-side cursors (rows stream in chunks, not all at
  once);
* :class:`~memoryos_gpu.store.pg_connection.PgConnection`
  (:mod:`memoryos_gpu.store.pg_connection`), a thin adapter that gives a psycopg connection
  sqlite3's ``execute``/``executemany`` surface: ``?`` placeholders become ``%s`` (outside string
  literals), a literal ``%`` is doubled, and ``rowid`` becomes the key of the statement's table
  (``pages`` -> ``page_id``, ...). ``users`` and ``assistants``, whose SQLite rowid is their
  insertion order, have a real ``rowid`` identity column here;
* the DDL (:mod:`memoryos_gpu.store.postgres_schema`: BIGINT identity keys, DOUBLE PRECISION
  times, BYTEA blobs, ``COLLATE "C"`` ids so ordering is bytewise as in SQLite) and this
  dialect's migrations there (the mechanism and the version check are sqlite.py's), the list
  of tables, the integrity check and delete_user's housekeeping.

Requires ``pip install 'memoryos-gpu[postgres]'`` (psycopg 3 and psycopg-pool) and a UTF-8
database. Errors name the server by its URL with any password masked, and every driver error
that leaves the store as a failure of the server or of the connection is a :class:`StoreError`
(:meth:`PostgresStore._failure`): :class:`StoreUnavailableError` for a server that cannot be
reached or dropped the connection, a "statement timed out" StoreError for ``statement_timeout``,
:class:`StoreFullError` for a full disk. Connections carry TCP keepalives and
``tcp_user_timeout`` (:data:`KEEPALIVES`) so that a dead server or a cut network is noticed,
and a call gives up on a server that sends nothing for longer than its ``statement_timeout``
allows (:class:`WatchedConnection`: a stopped or stuck backend, a hung host, which TCP cannot tell
from a slow statement), so that no call waits without limit. A store opened with
``writer=False`` refuses writes, as SQLite's readers do: its pooled connections run read-only
transactions (:func:`~memoryos_gpu.store.pg_connection.configure_connection`), and a write
through it is a StoreError saying the store was opened read-only.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

from memoryos_gpu.store import postgres_schema, sqlite_schema
from memoryos_gpu.store.errors import (
    NoStoreError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
    WriterClaimLostError,
)
from memoryos_gpu.store.pg_connection import (
    KEEPALIVES,
    NO_ANSWER,
    NO_ANSWER_MARGIN,
    ConnectFailures,
    PgConnection,
    StatementLimit,
    WatchedConnection,
    check_connection,
    configure_connection,
    milliseconds,
    noting_failures,
)
from memoryos_gpu.store.pg_urls import check_url, credentials_end, redact
from memoryos_gpu.store.sqlite import ID_COLUMNS, Durability, SQLiteStore
from memoryos_gpu.store.sqlite_schema import Migration, run_sql

try:
    import psycopg
    from psycopg.pq import TransactionStatus
    from psycopg_pool import ConnectionPool, PoolTimeout
except ImportError:  # pragma: no cover - exercised only without the extra installed
    psycopg = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# Held (session-level) while a store is created or migrated, so two engines opening a new
# database at once do not both create the schema. Any constant unique to memoryos-gpu.
_MIGRATE_LOCK = 0x6D656D6F_7367


class PostgresStore(SQLiteStore):
    """One PostgreSQL database (or schema: the URL's ``options=-csearch_path=...``) as a store.

    Thread-safe: write transactions are serialised within the process by a re-entrant lock, as
    with SQLite; reads from other threads do not wait for them (they see committed data).
    Several processes may open the same database: the schema is created or migrated under an
    advisory lock, and each accepted batch is one transaction.

    ``writer=False`` (tools that only read, beside a running engine): no writer claim, no store
    created in an empty database, and no write accepted: every pooled connection's session is
    read-only (``SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY``), so the server refuses
    a write (``delete_user``, ``set_meta``, a ``query`` that writes) and the caller gets a
    :class:`StoreError` saying the store was opened read-only, where SQLite's ``PRAGMA
    query_only`` says "attempt to write a readonly database". Like a SQLite reader, one that
    opens an older store migrates it first (the tools that only read must open a store an older
    memoryos-gpu wrote): only those transactions are ``BEGIN READ WRITE``.
    """

    _DIALECT = "PostgreSQL"

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 8,
        connect_timeout: float = 10.0,
        writer: bool = True,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.url = url
        self.path = redact(url)  # what every message (ours and sqlite.py's) names
        self._closed = True
        self._writer: WriterClaim | None = None
        self.load_stats: dict[str, dict[str, float]] = {}
        if psycopg is None:
            raise StoreError(
                f"cannot open store {self.path}: the PostgreSQL store needs psycopg 3 and "
                "psycopg-pool (pip install 'memoryos-gpu[postgres]')"
            )
        self._lock = threading.RLock()
        self._depth = 0
        self._tx: PgConnection | None = None
        self._tx_owner: int | None = None
        self._reader = not writer
        #: True while a reader migrates an older store at open (its only writes)
        self._migrating = False
        given = check_url(url)
        end = credentials_end(url) or 0
        auth = url[url.find("://") + 3 : end] if end > 0 else ""
        #: the password as libpq reads it and as the URL writes it, for :meth:`_clean`
        self._secrets = {given.get("password") or "", auth.partition(":")[2]} - {""}
        timeout = max(1, round(connect_timeout))
        #: what every connection is opened with beside the URL (the URL's own keepalive
        #: settings win; connect_timeout is this store's)
        self.connect_kwargs: dict[str, Any] = {
            **{k: v for k, v in KEEPALIVES.items() if k not in given},
            "connect_timeout": timeout,
        }
        try:  # one direct connection first: the pool retries silently, this says what failed
            with WatchedConnection.connect(url, **self.connect_kwargs) as probe:
                probe._limit = StatementLimit(
                    timeout + NO_ANSWER_MARGIN,
                    f"the connect timeout of {timeout} s + {NO_ANSWER_MARGIN:g} s",
                )
                encoding = probe.info.parameter_status("server_encoding")  # sent at connect
                if encoding is None:
                    encoding = probe.execute("SHOW server_encoding").fetchone()[0]
                statement_timeout = probe.execute("SHOW statement_timeout").fetchone()[0]
                schema, path = probe.execute(
                    "SELECT current_schema(), current_setting('search_path')"
                ).fetchone()
        except psycopg.Error as exc:
            raise self._connect_error(exc) from None
        if schema is None:  # else creating the tables fails with raw SQL in the message
            raise StoreError(
                f"store {self.path}: no schema of its search_path ({path}) exists: create it "
                "first (CREATE SCHEMA name), or name an existing one"
            )
        # first: a SQL_ASCII server answers SHOW with bytes, which nothing below parses
        if isinstance(encoding, bytes) or encoding.upper() not in ("UTF8", "UTF-8"):
            shown = encoding.decode("ascii", "replace") if isinstance(encoding, bytes) else encoding
            raise StoreError(
                f"store {self.path} uses server encoding {shown}; memoryos-gpu needs a UTF8 "
                "database (CREATE DATABASE ... ENCODING 'UTF8')"
            )
        #: how long a call waits on a silent server (:class:`WatchedConnection`), from the
        #: statement_timeout the connections get (the URL's, the role's or the server's)
        self._statement_timeout_ms = milliseconds(statement_timeout)
        self._limit = limit = StatementLimit.of(self._statement_timeout_ms)
        #: why the pool last failed to open a connection (named when a caller times out)
        self._connect_failures = ConnectFailures()
        self._down = False  # the last call found no connection while the server was down
        self._wait = 30.0  # how long the last call waited for a connection (its error says)
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max(2, pool_size),  # opening holds one for the lock, one to work
            kwargs={"autocommit": True, **self.connect_kwargs},
            connection_class=noting_failures(self._connect_failures),
            # each connection gets the store's limit; a reader's, a read-only session
            configure=functools.partial(configure_connection, limit=limit, read_only=not writer),
            name="memoryos-gpu",
            timeout=30.0,
            open=False,
            # a connection is looked at before it is handed out: one the server dropped (a
            # restart, an idle timeout, pg_terminate_backend) is replaced instead of failing
            # the call that took it
            check=check_connection,
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout)
        except PoolTimeout:
            self._pool.close()
            raise StoreUnavailableError(
                f"cannot connect to store {self.path}: no connection within {connect_timeout} s"
                f"{self._refused(connect_timeout)}"
            ) from None
        self._closed = False
        try:
            self._migrate()
            if writer:
                self._writer = WriterClaim(self, shard, timeout)
        except StoreError:
            self.close()
            raise
        except (psycopg.Error, PoolTimeout) as exc:
            self.close()
            said = self._failure(exc)
            if said is not None:
                raise said from None
            raise StoreError(
                f"{self.path} is not a usable memoryos-gpu store: {self._clean(exc)}"
            ) from None

    def _refused(self, seconds: float) -> str:
        """``": opening one failed: <the server's words>"``: why no pooled connection came
        within ``seconds`` when the pool met an error opening one meanwhile (the server refused
        it: too many connections, ...); else ``""``."""
        cause = self._connect_failures.within(seconds)
        if cause is None:
            return ""
        text = f": opening one failed: {self._clean(cause)}"
        if "too many connections" in cause:
            text += (
                " (the role's or the server's connection limit is reached: run fewer shards or "
                "processes on this store, or raise the limit)"
            )
        return text

    def _clean(self, exc: BaseException | str) -> str:
        """An error's text without the URL's password, should a driver ever echo it."""
        text = " ".join(str(exc).split())  # libpq's messages span lines: one line per error
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _connect_error(self, exc: BaseException) -> StoreError:
        """The error for a connection that could not be made: :class:`StoreUnavailableError`
        (the server down or unreachable, starting, out of connection slots: it can pass),
        unless the server refused us for good (authentication, no such database or role)."""
        text = self._clean(exc)
        final = ("password authentication failed", "does not exist", "no pg_hba.conf entry")
        cls = StoreError if any(w in text for w in final) else StoreUnavailableError
        return cls(f"cannot connect to store {self.path}: {text}")

    def _failure(self, exc: BaseException) -> StoreError | None:
        """The :class:`StoreError` a driver or pool error leaving the store becomes, or None
        for one that is left as it is (a constraint violation, a bug in a statement). The one
        place where server and connection failures are named:

        * the pool had no connection in time: :class:`StoreUnavailableError`;
        * a full disk: :class:`StoreFullError`;
        * a statement cancelled (``statement_timeout``, or ``pg_cancel_backend``): a
          StoreError that says so;
        * any other :class:`psycopg.OperationalError` (connection lost or refused, server
          shutting down or restarting, out of connections or memory):
          :class:`StoreUnavailableError` (nothing of the failed call was committed, unless the
          connection was lost during the COMMIT itself: see docs/storage.md), a transaction
          the server rolled back (class 40: a deadlock, a serialization failure) too, in its
          own words, and a server that stopped answering (:class:`WatchedConnection`) too; a program
          limit (class 54) a plain StoreError.
        """
        if psycopg is None:
            return None
        if isinstance(exc, PoolTimeout):
            seconds = self._wait
            return StoreUnavailableError(
                f"no connection to store {self.path} within {seconds:g} s"
                + (
                    self._refused(seconds)
                    or " (server down or unreachable, or every pooled connection busy)"
                )
            )
        if not isinstance(exc, psycopg.Error):
            return None
        text = self._clean(exc)
        if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction) and self._reader:
            return StoreError(
                f"store {self.path} was opened read-only (writer=False) and refuses writes "
                f"({text}): write through the engine that holds the store, or open it as its "
                "writer"
            )
        if isinstance(exc, psycopg.errors.DiskFull):
            return StoreFullError.met(self.path, text)
        if isinstance(exc, psycopg.errors.QueryCanceled):
            if "statement timeout" in text:
                return StoreError(
                    f"store {self.path}: a statement timed out ({text}); the limit is the "
                    "statement_timeout of the store's connections (set by the URL's "
                    "options=-cstatement_timeout=..., or by the role or the server): raise it"
                )
            return StoreError(f"store {self.path}: a statement was cancelled ({text})")
        if isinstance(exc, psycopg.OperationalError):
            state = exc.sqlstate or ""
            if state.startswith("54"):  # program limit: no retry helps
                return StoreError(f"store {self.path}: {text}")
            if state.startswith("40"):  # deadlock, serialization failure: the server is up
                return StoreUnavailableError(
                    f"store {self.path}: the server rolled the transaction back ({text}); "
                    "nothing of it was committed: retry"
                )
            if text.startswith(NO_ANSWER):  # WatchedConnection gave a silent server up
                return StoreUnavailableError(f"store {self.path} is unavailable: {text}; retry")
            return StoreUnavailableError(
                f"store {self.path} is unavailable: {text} (the server cannot be reached or "
                "dropped the connection; retry once it answers)"
            )
        return None

    @contextmanager
    def _failures(self) -> Iterator[None]:
        """Raise driver and pool errors as :meth:`_failure` names them."""
        try:
            yield
        except (psycopg.Error, PoolTimeout) as exc:
            said = self._failure(exc)
            if said is None:
                raise
            raise said from exc

    # ------------------------------------------------------------------ dialect hooks
    def _table_names(self) -> set[str]:
        return {
            r[0]
            for r in self.query(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
            )
        }

    def _create_schema(self, db: Any) -> None:
        run_sql(db, postgres_schema.SCHEMA_V1)

    def _migrations(self) -> dict[int, Migration]:
        return postgres_schema.MIGRATIONS

    def _migrate(self) -> None:
        if self._reader and not self._table_names():
            # a tool that only reads must not create a store (SQLite's "no store" likewise)
            raise NoStoreError(
                f"no memoryos-gpu store in {self.path} (create one with: memoryos-gpu ingest "
                f"FILE --store URL)"
            )
        limit = self._limit
        seconds = limit.seconds
        if not self._statement_timeout_ms:  # a migration may rewrite every row: wait as long
            limit.seconds = None  # as the server lets it run (only this thread has the store)
        try:
            with self._pool.connection() as lock:
                lock.execute("SELECT pg_advisory_lock(%s)", (_MIGRATE_LOCK,))
                # a reader's sessions are read-only: its migration, as a SQLite reader's (run
                # before its query_only), writes in READ WRITE transactions (transaction())
                self._migrating = self._reader
                try:
                    super()._migrate()
                finally:
                    self._migrating = False
                    with suppress(psycopg.Error):
                        lock.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATE_LOCK,))
        finally:
            limit.seconds = seconds

    # ------------------------------------------------------------------ connections
    def _own_tx(self) -> PgConnection | None:
        """The write transaction this thread has open, if any (its reads must go through it,
        to see its own uncommitted writes, as on SQLite's single connection)."""
        tx = self._tx
        return tx if tx is not None and self._tx_owner == threading.get_ident() else None

    #: How long a call waits for a pooled connection while the server is known down (the
    #: call before found none in time, and opening one failed meanwhile), instead of the pool's
    #: 30 s: a write waits under the engine lock, so a queue of writes and deletions during an
    #: outage was refused one per 30 s (a deletion answered after 1-2 minutes). The first call
    #: the pool serves again ends it.
    DOWN_WAIT_S: float = 1.0

    def _getconn(self) -> Any:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")
        self._wait = wait = self.DOWN_WAIT_S if self._down else self._pool.timeout
        try:
            conn = self._pool.getconn(timeout=wait)
        except PoolTimeout:  # named by the caller's _failures()
            # down, not busy: the pool met connection failures while this call waited (and
            # down it stays until a call is served)
            self._down = self._down or self._connect_failures.within(wait) is not None
            raise
        self._down = False
        return conn

    @contextmanager
    def transaction(  # type: ignore[override]
        self, durability: Durability = "commit"
    ) -> Iterator[PgConnection]:
        """One write transaction on one connection (re-entrant: a nested call runs in a
        savepoint, so an exception inside it undoes only its own work before propagating).
        ``durability`` as for SQLite: ``"none"`` commits without waiting for the server's log
        flush (``synchronous_commit = off``, this transaction only); ``"deferred"`` is a
        synced commit here (the flush is the server's: nothing to wait for afterwards)."""
        with self._lock:
            if self._depth:
                tx = self._tx
                assert tx is not None
                name = f"sp{self._depth}"
                tx.conn.execute(f"SAVEPOINT {name}")
                self._depth += 1
                try:
                    yield tx
                except BaseException:
                    if not tx.conn.closed:  # a dropped connection: the outer call says so
                        tx.conn.execute(f"ROLLBACK TO SAVEPOINT {name}")
                        tx.conn.execute(f"RELEASE SAVEPOINT {name}")
                    raise
                else:
                    tx.conn.execute(f"RELEASE SAVEPOINT {name}")
                finally:
                    self._depth -= 1
                return
            with self._failures():
                conn = None
                try:  # the connection taken inside: a Ctrl-C after it still gives it back
                    conn = self._getconn()
                    conn.execute("BEGIN READ WRITE" if self._migrating else "BEGIN")
                    if durability == "none":
                        conn.execute("SET LOCAL synchronous_commit TO OFF")
                    tx = PgConnection(conn)
                    self._tx, self._tx_owner, self._depth = tx, threading.get_ident(), 1
                    try:
                        if self._writer is not None:
                            self._writer.check(conn)
                        yield tx
                        conn.execute("COMMIT")
                    except BaseException:
                        # never mask the error; a broken connection is dropped by the pool
                        if conn.info.transaction_status != TransactionStatus.IDLE:
                            with suppress(psycopg.Error):
                                conn.execute("ROLLBACK")
                        raise
                    finally:
                        self._tx = self._tx_owner = None
                        self._depth = 0
                finally:
                    if conn is not None:  # one left in a transaction is rolled back by the pool
                        self._pool.putconn(conn)

    @contextmanager
    def _snapshot(self) -> Iterator[PgConnection]:  # type: ignore[override]
        """A consistent read of several statements: one REPEATABLE READ, READ ONLY transaction
        whose SELECTs stream through server-side cursors (joins this thread's open write
        transaction instead, as SQLite does)."""
        tx = self._own_tx()
        if tx is not None:
            view = PgConnection(tx.conn, server_side=True)
            try:
                yield view
            finally:
                view.close_cursors()
            return
        with self._failures():
            conn = view = None
            try:  # the connection taken inside: a Ctrl-C after it still gives it back
                conn = self._getconn()
                view = PgConnection(conn, server_side=True)
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                yield view
            finally:
                if view is not None:
                    view.close_cursors()
                if conn is not None:
                    if conn.info.transaction_status != TransactionStatus.IDLE:
                        with suppress(psycopg.Error):
                            conn.execute("ROLLBACK")  # read only: nothing to commit
                    self._pool.putconn(conn)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        tx = self._own_tx()
        if tx is not None:
            return tx.execute(sql, params).fetchall()
        with self._failures():
            conn = None
            try:
                conn = self._getconn()
                return PgConnection(conn).execute(sql, params).fetchall()
            finally:
                if conn is not None:
                    self._pool.putconn(conn)

    def close(self) -> None:
        """Close every pooled connection and give the writer claim up (idempotent)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._pool.close()
                self._release_writer()

    @property
    def claims_lost(self) -> int:  # type: ignore[override]
        """Times the writer claim was found lost (:meth:`WriterClaim.check`)."""
        return self._writer.lost if self._writer is not None else 0

    def _release_writer(self) -> None:
        if self._writer is not None:
            self._writer.release()
            self._writer = None

    # ------------------------------------------------------------------ dialect specifics
    def new_ids(self, db: Any, table: str, n: int) -> list[int]:
        """``n`` ids from the table's identity sequence (see SQLiteStore's): a sequence never
        gives a number twice, whichever of the engines sharing the database asks."""
        if n <= 0:
            return []
        column = ID_COLUMNS[table]
        rows = db.execute(
            "SELECT nextval(pg_get_serial_sequence(?, ?)) FROM generate_series(1, ?)",
            (table, column, n),
        ).fetchall()
        return [int(r[0]) for r in rows]

    def refuse_if_damaged(self) -> None:
        """Nothing to do: PostgreSQL finds a damaged page itself when it reads it (and its
        page checksums, when the cluster has them on), and the server's files are its own."""

    def check_integrity(self) -> list[str]:
        """A light check: PostgreSQL enforces the constraints itself, so what is left to find is
        a missing table, a constraint left NOT VALID, or an invalid index (a failed
        ``CREATE INDEX CONCURRENTLY``)."""
        missing = sqlite_schema.required_tables(self.schema_version) - self._table_names()
        out = [f"missing table {t}" for t in sorted(missing)]
        out += [
            f"constraint {r[0]} on {r[1]} is not validated"
            for r in self.query(
                "SELECT c.conname, t.relname FROM pg_constraint c "
                "JOIN pg_class t ON t.oid = c.conrelid "
                "JOIN pg_namespace n ON n.oid = t.relnamespace "
                "WHERE n.nspname = current_schema() AND NOT c.convalidated"
            )
        ]
        out += [
            f"index {r[0]} is invalid"
            for r in self.query(
                "SELECT i.relname FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
                "JOIN pg_namespace n ON n.oid = i.relnamespace "
                "WHERE n.nspname = current_schema() AND NOT (x.indisvalid AND x.indisready)"
            )
        ]
        return out

    def size_bytes(self) -> int:
        """Bytes on disk of the store's tables with their indexes and TOAST (``stats``)."""
        return int(
            self.query(
                "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = current_schema() AND c.relkind = 'r'"
            )[0][0]
        )

    def delete_user(self, user_id: str) -> Any:
        """Remove every row held about the user, in one transaction (what SQLite's does).

        Unlike SQLite's ``secure_delete``, PostgreSQL keeps the old row versions on disk until
        VACUUM reuses their space (autovacuum, or ``VACUUM pages`` by an operator), and in its
        write-ahead log and backups until those are recycled: erasure from the files is the
        operator's retention policy, not something one engine can force on a shared server.
        """
        with self.transaction() as db:
            return self._delete_user_rows(db, user_id)

    def begin_erasure(self) -> None:
        """Nothing to switch on: see :meth:`delete_user` for what erasure means here."""

    def checkpoint(self) -> None:
        """Nothing to do: PostgreSQL's WAL and dead row versions are the server's (above)."""

    def sync(self) -> None:
        """Nothing to wait for: a ``"deferred"`` transaction was a synced commit here."""


# ====================================================================== one writer per shard
#: The first key of every writer lock (pg_locks.classid), with the schema hashed in: one
#: database may hold several stores, one per schema.
_WRITER_NAMESPACE = "memoryos-gpu writer"
_WHOLE = 0  # second key of the whole-store lock; a shard's is (count << 16) | index
MAX_SHARDS = 32767  # so a shard's key fits a positive int4


class WriterClaim:
    """This engine's claim on a shared PostgreSQL store: session-level advisory locks on a
    connection of their own (never pooled, so nothing else resets them), released when it
    closes, including when the process dies and the server drops its connection.

    Claims (two int4 keys: the schema's namespace, then what is claimed):

    * the whole store (a plain engine, ``shard=None``): the whole-store key, exclusive;
    * shard ``i`` of ``n``: the whole-store key *shared* (shard engines write side by side, a
      whole-store writer is kept out) and the shard's own key exclusive; a shard of another
      layout (another ``n``, whose users overlap this one's) is refused too.

    The holder is named from ``pg_stat_activity``: the claim's connection carries
    ``application_name`` "<program> <subcommand> pid <pid> on <host>" (e.g. "memoryos-gpu
    serve pid 4242 on box-1") and its ``backend_start`` is when the claim was made.
    """

    def __init__(self, store: PostgresStore, shard: tuple[int, int] | None, timeout: int) -> None:
        from memoryos_gpu.store.writer import command_line

        self.store = store.path
        self.shard = _check_shard(shard)
        name = f"{_short(command_line())} pid {os.getpid()} on {socket.gethostname()}"
        self._name = name.encode()[:63].decode("utf-8", "ignore")  # the server keeps 63 bytes
        self._owner = store
        self._timeout = timeout
        self.lost = 0  # times the claim was found gone (PostgresStore.claims_lost)
        self._take()

    def _take(self) -> None:
        """Connect the claim's own session and take the claim on it."""
        store = self._owner
        try:
            self._conn = WatchedConnection.connect(
                store.url,
                autocommit=True,
                **{**store.connect_kwargs, "connect_timeout": self._timeout},
                application_name=self._name,
            )
        except psycopg.Error as exc:
            raise store._connect_error(exc) from None
        self._conn._limit = store._limit
        try:
            self._claim()
        except BaseException:
            self._conn.close()
            raise
        self._pid = self._conn.info.backend_pid

    def check(self, conn: psycopg.Connection) -> None:
        """Raise :class:`WriterClaimLostError` when the claim's session no longer holds its
        lock, asked in ``conn``'s open write transaction (one statement): the server dropped
        it (a restart), so another writer could take the store. The claim is taken again
        first (or the error names the writer that holds it now); either way the write fails
        and ``lost`` counts it, so the engine reloads what another writer may have written."""
        key = _WHOLE if self.shard is None else (self.shard[1] << 16) | self.shard[0]
        held = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND pid = %s AND classid = %s::bigint::oid AND objid = %s::bigint::oid "
            "AND objsubid = 2)",
            (self._pid, self.namespace, key),
        ).fetchone()[0]
        if held:
            return
        from memoryos_gpu.store.writer import StoreLockedError

        self.lost += 1
        log.warning(
            "the writer claim on %s was lost (its session is gone): taking it again", self.store
        )
        self.release()
        try:
            self._take()
        except StoreLockedError as exc:
            raise WriterClaimLostError(
                f"the writer claim on {self.store} was lost (the database dropped its "
                f"session) and another writer holds the store now; writes are refused until "
                f"it is done: {exc}"
            ) from None
        except StoreUnavailableError as exc:
            raise WriterClaimLostError(
                f"the writer claim on {self.store} was lost: {exc}"
            ) from None
        raise WriterClaimLostError(
            f"the writer claim on {self.store} was lost (the database dropped its session) "
            "and is taken again; this write was not committed: retry it"
        )

    def _claim(self) -> None:
        schema = self._conn.execute("SELECT current_schema()").fetchone()[0]
        self.namespace = zlib.crc32(f"{_WRITER_NAMESPACE} {schema}".encode()) & 0x7FFFFFFF
        if self.shard is None:
            if not self._try("pg_try_advisory_lock", _WHOLE):
                self._refuse(self._holders(lambda k: True), "store")
            return
        index, count = self.shard
        if not self._try("pg_try_advisory_lock_shared", _WHOLE):
            self._refuse(self._holders(lambda k: k == _WHOLE, exclusive=True), "store")
        key = (count << 16) | index
        if not self._try("pg_try_advisory_lock", key):
            self._refuse(self._holders(lambda k: k == key), f"shard {index}/{count} of store")
        other = self._holders(lambda k: k != _WHOLE and k >> 16 != count)
        if other:  # claimed after our lock, so of two racing layouts neither gets through
            self._refuse(other, f"shard {index}/{count} of store")

    def _try(self, fn: str, key: int) -> bool:
        return bool(self._conn.execute(f"SELECT {fn}(%s, %s)", (self.namespace, key)).fetchone()[0])

    def _holders(
        self, wanted: Callable[[int], bool], *, exclusive: bool = False
    ) -> list[tuple[int, int, str, Any]]:
        """(backend pid, key, application_name, backend_start) of the other sessions holding
        a writer lock of this store whose key satisfies ``wanted`` (``exclusive``: only
        exclusive holders, the ones a shared claim waits for)."""
        mode = " AND l.mode = 'ExclusiveLock'" if exclusive else ""
        rows = self._conn.execute(
            "SELECT l.pid, l.objid::bigint, COALESCE(a.application_name, ''), a.backend_start "
            "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 "
            "AND l.classid = %s::bigint::oid AND l.pid <> pg_backend_pid() "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            + mode,
            (self.namespace,),
        ).fetchall()
        return [r for r in rows if wanted(int(r[1]))]

    def _refuse(self, holders: list[tuple[int, int, str, Any]], scope: str) -> None:
        from memoryos_gpu.store.writer import StoreLockedError, refusal

        if not holders:  # released between our try and the look-up: say so, do not guess
            raise StoreLockedError(
                f"{scope} {self.store} was held by another writer a moment ago; try again"
            )
        sessions: dict[int, tuple[list[int], str, Any]] = {}
        for pid, key, app, started in holders:
            sessions.setdefault(pid, ([], app, started))[0].append(key)
        names = []
        for pid, (keys, app, started) in list(sessions.items())[:4]:
            shards = [f"shard {k & 0xFFFF}/{k >> 16}" for k in keys if k != _WHOLE]
            what = ", ".join(shards) or "the whole store"
            since = f", since {started:%Y-%m-%d %H:%M:%S %Z}" if started is not None else ""
            who = f"this process ({app})" if app == self._name else app or "an unnamed session"
            names.append(f"{who} ({what}; server pid {pid}{since})")
        raise StoreLockedError(refusal(self.store, "; ".join(names), scope))

    def release(self) -> None:
        """Give the claim up (idempotent): closing the session drops its advisory locks."""
        with suppress(Exception):
            self._conn.close()


def _check_shard(shard: tuple[int, int] | None) -> tuple[int, int] | None:
    if shard is None or int(shard[1]) == 1:
        return None  # one shard of one is the whole store
    index, count = int(shard[0]), int(shard[1])
    if not 0 <= index < count <= MAX_SHARDS:
        raise StoreError(f"shard {index}/{count}: need 0 <= index < count <= {MAX_SHARDS}")
    return index, count


def _short(command: str) -> str:
    """The program and its command word ("memoryos-gpu serve", "memoryos_gpu ingest"; not an
    option's value: ``--store URL serve``), from a :func:`command_line` record: what fits in
    application_name's 63 bytes beside pid and host."""
    from memoryos_gpu.store.writer import command_word

    words = command.split()
    word = command_word(command)
    return " ".join(words[:1] + ([word] if word else []))[:32]

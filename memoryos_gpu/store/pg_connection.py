"""The PostgreSQL store's connections: psycopg made to speak the store's SQLite SQL, and never to
wait without limit on a server that has stopped answering.

* :class:`PgConnection` and :class:`PgCursor` give a psycopg connection sqlite3's
  ``execute``/``executemany`` surface (:func:`translate`: ``?`` placeholders, literal ``%``,
  ``rowid``), with server-side cursors for bulk scans;
* :class:`WatchedConnection` gives up on a server that sends nothing for longer than the
  connections' ``statement_timeout`` allows (:class:`StatementLimit`, :data:`NO_ANSWER_MARGIN`), and
  :data:`KEEPALIVES` bound how long a dead server or a cut network goes unnoticed;
* the pool's hooks: :func:`check_connection`, :func:`configure_connection` (a store's
  :class:`StatementLimit`, and a reader's read-only session), and :func:`noting_failures` (why
  the pool last failed to open a connection).

Why a module of its own: none of it needs the store class
(:class:`~memoryos_gpu.store.postgres.PostgresStore`), which opens its pool with these, names
their failures and runs the transactions.
"""

from __future__ import annotations

import functools
import itertools
import re
import select
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from time import monotonic
from typing import Any

try:
    import psycopg
    from psycopg.pq import TransactionStatus
    from psycopg_pool import ConnectionPool

    _PsycopgConnection = psycopg.Connection
except ImportError:  # pragma: no cover - exercised only without the extra installed
    psycopg = None  # type: ignore[assignment]
    _PsycopgConnection = object  # type: ignore[assignment, misc]

#: The key column that stands for SQLite's ``rowid`` in tables whose INTEGER PRIMARY KEY is
#: their rowid. ``users`` and ``assistants`` have a real ``rowid`` column instead.
ROWID_KEY = {
    "pages": "page_id",
    "segments": "segment_id",
    "knowledge": "entry_id",
    "pending": "work_id",
    "audit": "event_id",
}

#: libpq connection parameters that bound how long a dead server or a cut network goes
#: unnoticed, given to every connection whose URL does not set them itself (the URL wins):
#: an idle connection, or one waiting for an answer, is probed after 10 s of silence, then
#: every 5 s, and dropped after 3 probes unanswered (~25 s); data sent and not acknowledged
#: for 30 s (``tcp_user_timeout``, milliseconds; Linux) drops it too. A server that still
#: answers TCP but whose backend is stuck is not noticed by these: :data:`NO_ANSWER_MARGIN` is.
KEEPALIVES: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}

#: How long (seconds) a call waits beyond the connections' ``statement_timeout`` for a server
#: that sends nothing before it gives up (:class:`WatchedConnection`): the server itself cancels a
#: statement at its ``statement_timeout``, so one that is silent for longer has a backend that
#: is stopped or stuck, or a host that hangs, which keepalives do not notice (the kernel still
#: acknowledges TCP) and a cancel request does not reach.
NO_ANSWER_MARGIN = 5.0

#: How long (seconds) a call waits for a silent server when the connections have no
#: ``statement_timeout`` (0: no limit on the server). Schema migrations at open, which may
#: rewrite every row, wait without limit then.
NO_ANSWER_LIMIT = 300.0

#: Rows per round trip when iterating a server-side cursor.
ITER_ROWS = 10_000

_ROWID = re.compile(r"\browid\b", re.IGNORECASE)
_FROM = re.compile(r"\bFROM\s+([A-Za-z_][A-Za-z0-9_]*)", re.IGNORECASE)
_READS = re.compile(r"\s*(SELECT|WITH)\b", re.IGNORECASE)
_cursor_names = itertools.count()


@functools.lru_cache(maxsize=2048)
def translate(sql: str) -> str:
    """SQLite-style SQL to psycopg's: ``?`` -> ``%s`` and ``%`` -> ``%%`` (psycopg reads ``%``
    everywhere, literals included), and ``rowid`` -> the key of the table the statement reads
    (:data:`ROWID_KEY`), all outside quoted literals and identifiers. Cached: the engine sends a
    few dozen distinct statements."""
    out: list[str] = []
    code: list[str] = []  # the current run of text outside quotes

    def flush() -> None:
        if code:
            text = "".join(code)
            out.append(_ROWID.sub(_rowid_key(sql), text) if "rowid" in text else text)
            code.clear()

    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in ("'", '"'):
            flush()
            j = sql.find(c, i + 1)
            while j != -1 and j + 1 < n and sql[j + 1] == c:  # doubled quote inside
                j = sql.find(c, j + 2)
            j = n - 1 if j == -1 else j
            out.append(sql[i : j + 1].replace("%", "%%"))
            i = j + 1
            continue
        code.append("%s" if c == "?" else "%%" if c == "%" else c)
        i += 1
    flush()
    return "".join(out)


def _rowid_key(sql: str) -> str:
    m = _FROM.search(sql)
    return ROWID_KEY.get(m.group(1).lower(), "rowid") if m else "rowid"


class PgCursor:
    """A psycopg cursor with sqlite3's leniency: fetching from a statement without a result
    gives ``None``/``[]`` instead of raising, so the engine's code runs unchanged."""

    __slots__ = ("_cur",)

    def __init__(self, cur: Any) -> None:
        self._cur = cur

    @property
    def rowcount(self) -> int:
        return self._cur.rowcount

    @property
    def description(self) -> Any:
        return self._cur.description

    def fetchone(self) -> tuple | None:
        if self._cur.description is None:
            return None
        with self._fetching():
            return self._cur.fetchone()

    def fetchmany(self, size: int) -> list[tuple]:
        if self._cur.description is None:
            return []
        with self._fetching():
            return self._cur.fetchmany(size)

    def fetchall(self) -> list[tuple]:
        if self._cur.description is None:
            return []
        with self._fetching():
            return self._cur.fetchall()

    def __iter__(self) -> Iterator[tuple]:
        return self._rows() if self._cur.description is not None else iter(())

    def _rows(self) -> Iterator[tuple]:
        with self._fetching():
            yield from self._cur

    @contextmanager
    def _fetching(self) -> Iterator[None]:
        """Raise the error a failed fetch stands for (:func:`_fetch_error`)."""
        try:
            yield
        except psycopg.InternalError as exc:
            raise _fetch_error(self._cur, exc) from exc


def set_limit(conn: Any, *, limit: StatementLimit) -> None:
    """A new connection gets its store's :class:`StatementLimit`."""
    conn._limit = limit


#: What makes a session's transactions read-only by default (``default_transaction_read_only``):
#: a write then fails with ``ReadOnlySqlTransaction`` (SQLSTATE 25006), "cannot execute DELETE
#: in a read-only transaction"; reads, and advisory locks, are not affected. Only an explicit
#: ``BEGIN READ WRITE`` (or ``SET``) undoes it, which a reader's code sends only to migrate an
#: older store at open.
READ_ONLY_SESSION = "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"


def configure_connection(conn: Any, *, limit: StatementLimit, read_only: bool = False) -> None:
    """The pool's ``configure``, run once on each new connection before the pool lends it: the
    store's :class:`StatementLimit` (:func:`set_limit`), and for a store opened as a reader
    (``read_only``) a read-only session (:data:`READ_ONLY_SESSION`, one round trip), so that no
    pooled connection of a reader can write, as SQLite's ``PRAGMA query_only`` does for its
    readers. Why a statement here and not the URL's ``options=-cdefault_transaction_read_only=on``:
    a connection's ``options`` replace the URL's own (its ``search_path``) and ``$PGOPTIONS``.
    The pool's connections are autocommit, so the session stays idle, as the pool requires.
    psycopg_pool resets a returned connection only by rolling back an open transaction (no
    ``RESET ALL``: this store passes no ``reset``), so the setting lasts as long as the
    connection."""
    set_limit(conn, limit=limit)
    if read_only:
        conn.execute(READ_ONLY_SESSION)


def check_connection(conn: Any) -> None:
    """The pool's check before it hands a connection out (raise: replace it). A connection
    the server closed (a restart, ``pg_terminate_backend``, an idle timeout) has the server's
    goodbye waiting on its socket: only then, or when that cannot be told, does the full check
    run (psycopg_pool's ``check_connection``, one round trip), so a healthy connection costs
    none (a full check on every call doubled a small query's time)."""
    if conn.closed:
        raise psycopg.OperationalError("the connection is closed")
    try:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLPRI)
        idle = not poller.poll(0)
    except (AttributeError, OSError, ValueError):  # no poll() here
        idle = False
    if not idle:
        ConnectionPool.check_connection(conn)


def _fetch_error(cur: Any, exc: BaseException) -> BaseException:
    """The error a failed fetch stands for. psycopg (3.3) raises InternalError "received 2
    results from command 'FETCH FORWARD ...'" when a server-side cursor's FETCH fails after part
    of its rows were sent (a statement timeout mid-chunk): the server's own error is then the
    connection's last message, and the transaction is aborted."""
    conn = cur.connection
    msg = conn.pgconn.error_message.decode("utf-8", "replace").strip()
    if conn.closed:
        return psycopg.OperationalError(msg or str(exc))
    if conn.info.transaction_status != TransactionStatus.INERROR or not msg:
        return exc
    msg = msg.removeprefix("ERROR:").strip()
    if msg.startswith("canceling statement"):
        return psycopg.errors.QueryCanceled(msg)
    return psycopg.DatabaseError(msg)


class StatementLimit:
    """How long a call may wait on a silent server (``seconds``; None: without limit) and why
    (``why``, for the message), shared by a store's connections:
    :meth:`~memoryos_gpu.store.postgres.PostgresStore._migrate` lifts it for the migration when
    no ``statement_timeout`` is set."""

    __slots__ = ("seconds", "why")

    def __init__(self, seconds: float | None, why: str) -> None:
        self.seconds = seconds
        self.why = why

    @classmethod
    def of(cls, statement_timeout_ms: int) -> StatementLimit:
        """The limit for connections with this ``statement_timeout`` (0: none)."""
        if statement_timeout_ms > 0:
            return cls(
                statement_timeout_ms / 1000 + NO_ANSWER_MARGIN,
                f"the statement_timeout of {statement_timeout_ms} ms + {NO_ANSWER_MARGIN:g} s",
            )
        return cls(NO_ANSWER_LIMIT, "no statement_timeout is set")


_MS = {"": 1, "ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


def milliseconds(shown: str) -> int:
    """A time setting as SHOW writes it ("0", "500ms", "30s", "2min", "1h", "1d") in
    milliseconds; 0 for one it does not write so."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", shown)
    return int(m[1]) * _MS[m[2]] if m and m[2] in _MS else 0


NO_ANSWER = "no answer from the server"  # how WatchedConnection's error begins, for _failure
_TICK = 0.05  # a resume this long after the one before may be psycopg's 0.1 s tick


class _NoAnswer(Exception):
    """Raised into psycopg's wait by :func:`_answered` (not a psycopg error: only
    :meth:`WatchedConnection.wait` sees it)."""


def _answered(gen: Any, limit: float, pgconn: Any) -> Any:
    """psycopg's generator ``gen`` (one round trip: it yields what it waits for on the socket,
    1 read, 2 write, 3 both, and is sent what became ready), given up with :class:`_NoAnswer`
    once the server has sent nothing and taken nothing for ``limit`` seconds; any traffic starts
    the count again, so a long exchange that makes progress is never cut.

    In silence psycopg's wait resumes the generator every 0.1 s with "nothing ready" (0), or
    (the C wait of early psycopg 3.2 releases) with the state it waits for, as if it were
    ready: a resume that comes a tick or more after the one before is checked against the
    socket itself (one poll, only for a round trip already slow). One clock reading a resume."""
    last = prev = monotonic()  # the last sign of life; the last resume
    try:
        state = next(gen)
        while True:
            ready = yield state
            now = monotonic()
            if ready and (now - prev < _TICK or _ready_now(pgconn.socket, state)):
                last = now
            elif now - last >= limit:
                raise _NoAnswer
            prev = now
            state = gen.send(ready)
    except StopIteration as stop:
        return stop.value


def _ready_now(fd: int, state: int) -> bool:
    """Whether the socket is ready for ``state`` (1 read, 2 write, 3 either) at once."""
    try:
        poller = select.poll()
    except AttributeError:  # no poll() (Windows)
        r, w, _ = select.select([fd] if state & 1 else [], [fd] if state & 2 else [], [], 0)
        return bool(r or w)
    poller.register(fd, (select.POLLIN if state & 1 else 0) | (select.POLLOUT if state & 2 else 0))
    return bool(poller.poll(0))


class WatchedConnection(_PsycopgConnection):  # type: ignore[misc, valid-type]
    """A psycopg connection whose every round trip (a statement, a FETCH, COMMIT, ROLLBACK, the
    pool's check and reset: everything psycopg waits for through :meth:`wait`) gives up on a
    server that sends nothing for ``_limit.seconds`` (:func:`_answered`): the connection is
    closed (the server rolls its transaction back when it notices) and the call fails with an
    OperationalError, a :class:`StoreUnavailableError` for the store; the pool discards the
    closed connection instead of lending it again. Connecting is bounded by the
    ``connect_timeout`` instead (psycopg's connect does not come here).

    Why not a timer that cancels the query: a stopped or stuck backend does not act on a cancel
    request (nor on its own ``statement_timeout``), and a timer per call costs more than this
    (measured in docs/storage.md)."""

    _limit = StatementLimit(
        NO_ANSWER_LIMIT, "no statement_timeout is set"
    )  # each store sets its own

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        limit = self._limit
        seconds = limit.seconds
        if seconds is None:
            return super().wait(gen, *args, **kwargs)
        try:
            return super().wait(_answered(gen, seconds, self.pgconn), *args, **kwargs)
        except _NoAnswer:
            self.pgconn.finish()  # mid-exchange: the connection cannot be used again
            raise psycopg.OperationalError(
                f"{NO_ANSWER} for {seconds:g} s ({limit.why}): its backend is stopped or "
                "stuck, or its host hangs; the connection was closed"
            ) from None


class ConnectFailures:
    """The last error met opening a pooled connection, and when (``monotonic()``).

    Why: psycopg_pool opens connections in its background workers and only logs why one failed;
    a caller waiting for a connection then gets a bare ``PoolTimeout``, which cannot tell a
    server that refuses connections (``too many connections for role``, a database not
    accepting them) from a busy pool. The store's timeout message names this error instead."""

    def __init__(self) -> None:
        self.text: str | None = None
        self.at = 0.0

    def note(self, exc: BaseException) -> None:
        self.text, self.at = " ".join(str(exc).split()), monotonic()

    def within(self, seconds: float) -> str | None:
        """The last error, if it was met in the last ``seconds`` (during a caller's wait)."""
        return self.text if self.text and monotonic() - self.at <= seconds else None


def noting_failures(failures: ConnectFailures) -> type:
    """A :class:`WatchedConnection` class whose ``connect`` notes its errors in ``failures`` (one
    class per store: the pool makes its connections from a class, not from a function)."""

    class _PooledConnection(WatchedConnection):
        @classmethod
        def connect(cls, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().connect(*args, **kwargs)
            except psycopg.Error as exc:
                failures.note(exc)
                raise

    return _PooledConnection


class PgConnection:
    """sqlite3.Connection's ``execute``/``executemany`` over one psycopg connection.

    ``server_side``: SELECTs run as server-side cursors, fetched in round trips of
    ``fetchmany(n)`` or :data:`ITER_ROWS` rows, so a bulk scan never holds the whole result in
    the client; they only exist inside a transaction, and :meth:`close_cursors` closes them
    before it ends. Results come in binary format (bytea without hex decoding).
    """

    def __init__(self, conn: Any, *, server_side: bool = False) -> None:
        self.conn = conn
        self._server_side = server_side
        self._open: list[Any] = []

    def execute(self, sql: str, params: Sequence[Any] = ()) -> PgCursor:
        query = translate(sql)
        if self._server_side and _READS.match(sql):
            cur = self.conn.cursor(name=f"memoryos_gpu_{next(_cursor_names)}", binary=True)
            cur.itersize = ITER_ROWS
            self._open.append(cur)
        else:
            cur = self.conn.cursor(binary=True)
        cur.execute(query, tuple(params))
        return PgCursor(cur)

    def executemany(self, sql: str, seq: Any) -> PgCursor:
        cur = self.conn.cursor()
        cur.executemany(translate(sql), [tuple(p) for p in seq])
        return PgCursor(cur)

    def close_cursors(self) -> None:
        for cur in self._open:
            with suppress(Exception):
                cur.close()
        self._open.clear()

"""The PostgreSQL store when its server fails: a dropped connection is a StoreUnavailableError
(and costs the next call nothing), the HTTP server answers it 503 with Retry-After, a statement
timeout is a StoreError that says so, a backend that stops answering (SIGSTOP: what a stuck
backend or a hung host looks like) fails the call within its statement_timeout and a margin instead
of hanging it, connections carry TCP keepalives, a reader does not create a store, and no message
prints a password, however it is written in the URL. Once a call found the server down the next
fail fast; a database that is not UTF-8, or a search_path of no existing schema, is refused
saying so; a writer claim the server dropped is found by the next write, and taken again.

The server tests use ``$MEMORYOS_GPU_TEST_PG_URL`` (tests/store_backends.py) and skip without
it; the URL tests need no server.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

from store_backends import Backend, make_backend  # noqa: E402

from memoryos_gpu import EngineConfig, MemoryEngine  # noqa: E402
from memoryos_gpu.store import StoreUnavailableError, pg_connection  # noqa: E402
from memoryos_gpu.store.errors import StoreError, WriterClaimLostError  # noqa: E402
from memoryos_gpu.store.pg_connection import KEEPALIVES, PgCursor  # noqa: E402
from memoryos_gpu.store.pg_urls import check_url, redact  # noqa: E402
from memoryos_gpu.store.postgres import PostgresStore  # noqa: E402

SPECIAL = ["Se#cret99", "Se/cret99", "Se?cret99", "Se[cret99", "Se@cret99", "S@e/cret99"]


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Backend]:
    b = make_backend("postgres", tmp_path)
    try:
        yield b
    finally:
        b.cleanup()


def admin(b: Backend, sql: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(b.pg_url, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def named(url: str, app: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={app}"


# ====================================================================== URLs and passwords
@pytest.mark.parametrize("password", SPECIAL)
def test_redact_masks_passwords_with_unencoded_special_characters(password: str) -> None:
    url = f"postgresql://app:{password}@127.0.0.1:18850/sec"
    shown = redact(url)
    assert "cret99" not in shown and "Se" not in shown.split("//", 1)[1], shown
    assert shown.startswith("postgresql://") and shown.endswith("/sec")


def test_redact_keeps_what_is_not_secret() -> None:
    url = "postgresql://app:pw@db.example:5432/mem?options=-csearch_path%3Dx&password=p2"
    assert (
        redact(url)
        == "postgresql://app:***@db.example:5432/mem?options=-csearch_path%3Dx&password=***"
    )
    assert redact("postgresql://app@h/db?application_name=a@b") == (
        "postgresql://app@h/db?application_name=a@b"
    )
    assert redact("postgresql://h/db") == "postgresql://h/db"


@pytest.mark.parametrize("password", ["Se/cret99", "S@e@cret99", "a@b/cret99"])
def test_a_url_libpq_would_misread_is_refused_without_the_password(password: str) -> None:
    url = f"postgresql://app:{password}@127.0.0.1:1/sec"
    with pytest.raises(StoreError, match="percent-encode") as info:
        PostgresStore(url, connect_timeout=1)
    assert "cret99" not in str(info.value)
    with pytest.raises(StoreError, match="percent-encode"):
        check_url(url)


@pytest.mark.parametrize("password", ["Se#cret99", "Se?cret99", "Se[cret99"])
def test_an_unreachable_server_names_the_url_without_the_password(password: str) -> None:
    """libpq reads these as written; the old redaction (urlsplit) printed them or raised
    ValueError ('Se[cret99': Invalid IPv6 URL)."""
    with pytest.raises(StoreUnavailableError, match="cannot connect") as info:
        PostgresStore(f"postgresql://app:{password}@127.0.0.1:1/sec", connect_timeout=1)
    assert "cret99" not in str(info.value)


@pytest.mark.parametrize("password", ["Se#cret99", "Se/cret99", "Se[cret99"])
def test_cli_stats_says_error_without_the_password(password: str) -> None:
    from click.testing import CliRunner

    from memoryos_gpu import cli as cli_mod

    url = f"postgresql://app:{password}@127.0.0.1:1/sec"
    res = CliRunner().invoke(cli_mod.cli, ["stats", "--store", url])
    assert res.exit_code == 1, res.output
    assert "error:" in res.output and "cret99" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


# ====================================================================== dropped connections
def test_a_connection_dropped_in_a_query_is_unavailable_and_the_next_call_works(
    pg: Backend,
) -> None:
    st = pg.open(pg.spec("drop_q"))
    try:
        with pytest.raises(StoreUnavailableError, match="unavailable") as info:
            st.query("SELECT pg_terminate_backend(pg_backend_pid())")
        assert st.path in str(info.value)
        assert st.query("SELECT 1") == [(1,)]
    finally:
        st.close()


def test_a_connection_dropped_in_a_transaction_commits_nothing(pg: Backend) -> None:
    st = pg.open(pg.spec("drop_tx"))
    try:
        with pytest.raises(StoreUnavailableError), st.transaction() as db:
            db.execute("INSERT INTO meta VALUES ('lost', '1')")
            with st.transaction() as inner:  # a savepoint: its rollback must not mask it
                inner.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        assert st.get_meta("lost") is None
        with st.transaction() as db:
            db.execute("INSERT INTO meta VALUES ('kept', '1')")
        assert st.get_meta("kept") == "1"
    finally:
        st.close()


def test_pooled_connections_the_server_dropped_cost_no_failed_call(pg: Backend) -> None:
    app = f"pgfail_{uuid.uuid4().hex[:10]}"
    st = pg.open(named(pg.spec("stale"), app))
    try:
        assert st.query("SELECT 1") == [(1,)]
        pids = [
            r[0]
            for r in admin(
                pg, "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,)
            )
        ]
        assert pids
        admin(pg, "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid", (pids,))
        deadline = time.monotonic() + 10
        while admin(pg, "SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)):
            assert time.monotonic() < deadline, "the terminated backends did not exit"
            time.sleep(0.05)
        for _ in range(3):  # each stale connection is checked and replaced, none fails a call
            assert st.query("SELECT 1") == [(1,)]
        with st.transaction() as db:
            db.execute("INSERT INTO meta VALUES ('after', '1')")
    finally:
        st.close()


@contextmanager
def refusing(pg: Backend) -> Iterator[tuple[PostgresStore, Callable[[], None]]]:
    """What a restart looks like from the store: a store on a database of its own (a pool
    timeout of 2 s), then every connection dropped and none accepted (a database that does
    not allow connections stands in for a server starting up); yields the store and what
    lets connections in again."""
    name = f"pgfail_{uuid.uuid4().hex[:10]}"
    admin(pg, f'CREATE DATABASE "{name}"')
    base = pg.pg_url.rsplit("/", 1)[0] + f"/{name}"

    def allow() -> None:
        admin(pg, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')

    try:
        st = PostgresStore(named(base, name), connect_timeout=2)
        try:
            st._pool.timeout = 2.0
            admin(pg, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
            admin(
                pg,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )
            yield st, allow
        finally:
            st.close()
    finally:
        allow()
        admin(pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def assert_served_again(st: PostgresStore, within_s: float = 30.0) -> None:
    """Once the server lets connections in again, a call is served within ``within_s`` and
    the store leaves its down state. Not the first call: while down a call waits only
    DOWN_WAIT_S, and the pool's reconnection may still be in its backoff (seconds on a
    loaded machine), so the calls before it are refused fast, as designed."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            assert st.query("SELECT 1") == [(1,)]
            break
        except StoreUnavailableError:
            assert time.monotonic() < deadline, f"not served {within_s} s after the restart"
    assert not st._down


def test_a_server_that_refuses_connections_is_unavailable_until_it_is_back(
    pg: Backend,
) -> None:
    with refusing(pg) as (st, allow):
        st.DOWN_WAIT_S = 0.01
        with pytest.raises(StoreUnavailableError):
            st.query("SELECT 1")
        with pytest.raises(StoreUnavailableError), st.transaction():
            pass
        allow()
        assert_served_again(st)


def test_while_the_server_is_down_calls_fail_fast_after_the_first(pg: Backend) -> None:
    """Each call waited the pool's whole timeout (30 s) for a connection, under the engine
    lock for a write: a queue of writes and deletions during an outage was refused one per
    30 s. Once a call found the server down, the next wait DOWN_WAIT_S; the first call served
    again ends it."""
    with refusing(pg) as (st, allow):
        st.DOWN_WAIT_S = 0.2
        waited: list[float] = []
        while len(waited) < 3:  # (a call may meet the terminated connection first)
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailableError) as info:
                st.query("SELECT 1")
            if "within" in str(info.value) or waited:
                waited.append(time.monotonic() - t0)
        assert waited[0] >= 1.9 and max(waited[1:]) < 1.0, waited
        allow()
        assert_served_again(st)


# ====================================================================== the HTTP server
def test_the_error_mapping_answers_store_unavailable_503_with_retry_after() -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    import json

    from memoryos_gpu.server.edge import ErrorMapper
    from memoryos_gpu.server.metrics import ServerMetrics

    r = ErrorMapper(ServerMetrics())(StoreUnavailableError("store x is unavailable"), None)
    assert r is not None and r.status_code == 503
    assert int(r.headers["Retry-After"]) > 0
    assert json.loads(r.body)["error"] == "unavailable"


def test_the_server_answers_503_json_when_its_store_drops_the_connection(pg: Backend) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    from served import HA, hashing, serve

    from memoryos_gpu.engine import MemoryEngine

    class DropsOnBoom(MemoryEngine):
        def add_many(self, pages):  # type: ignore[no-untyped-def, override]
            pages = list(pages)
            if any(getattr(p, "user_input", "") == "boom" for p in pages):
                self.store.query("SELECT pg_terminate_backend(pg_backend_pid())")
            return super().add_many(pages)

    engine = DropsOnBoom(hashing(pg.spec("served")))
    try:
        with serve(engine) as c:
            body = {"user_input": "boom", "agent_response": "y"}
            r = c.post("/v1/users/u/pages", json=body, headers=HA)
            assert r.status_code == 503, r.text
            assert r.json()["error"] == "unavailable" and int(r.headers["Retry-After"]) > 0
            body = {"user_input": "fine", "agent_response": "y"}
            r = c.post("/v1/users/u/pages", json=body, headers=HA)
            assert r.status_code < 300, r.text
    finally:
        engine.close()


# ====================================================================== statement timeouts
def test_a_statement_timeout_while_streaming_is_a_store_error_that_says_so(pg: Backend) -> None:
    spec = pg.spec("stream_timeout")
    pg.open(spec).close()
    slow = spec.replace("options=", "options=-cstatement_timeout%3D150%20", 1)
    st = PostgresStore(slow, writer=False)
    try:
        dim = 256  # rows of 1 KiB, so the server sends some before the timeout
        sql = (
            "SELECT g, decode(repeat('00', 4 * ?), 'hex'), pg_sleep(0.002) "
            "FROM generate_series(1, 5000) g"
        )
        with pytest.raises(StoreError, match="timed out") as info:
            for _ in st._stream("slow", sql, [("g", int)], dim, params=(dim,)):
                pass
        assert "statement_timeout" in str(info.value)
        assert st.query("SELECT 1") == [(1,)]  # the snapshot was rolled back, the pool is fine
    finally:
        st.close()


def test_a_fetch_psycopg_misreports_is_raised_as_the_servers_own_error(pg: Backend) -> None:
    """psycopg 3.3 raises InternalError "received 2 results from command 'FETCH FORWARD ...'"
    when a FETCH fails after part of its rows arrived: the error becomes the server's."""
    with psycopg.connect(pg.pg_url, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute("SET LOCAL statement_timeout = 50")
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(1)")

        class Misreporting:
            description = ("x",)
            connection = conn

            def fetchmany(self, size: int) -> Any:
                raise psycopg.InternalError("received 2 results from command 'FETCH FORWARD 9'")

        with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
            PgCursor(Misreporting()).fetchmany(10)
        conn.execute("ROLLBACK")


def test_an_engine_load_past_the_statement_timeout_says_timed_out(pg: Backend) -> None:
    from memoryos_gpu.config import EngineConfig, LLMConfig, preset
    from memoryos_gpu.engine import MemoryEngine

    spec = pg.spec("load_timeout")

    def config(store: str) -> EngineConfig:
        return EngineConfig(
            store=store,
            embedder="hashing",
            device="cpu",
            memory=preset("paper", stm_capacity=3, mtm_capacity=20, tau=2.0),
            llm=LLMConfig(mode="extractive"),
        )

    e = MemoryEngine(config(spec))
    for u in range(3):
        e.add_many(
            [
                {"user_id": f"u{u}", "user_input": f"cats {i}", "agent_response": "y"}
                for i in range(20)
            ]
        )
    e.close()
    slow = spec.replace("options=", "options=-cstatement_timeout%3D1%20", 1)
    with pytest.raises(StoreError, match="timed out"):
        MemoryEngine(config(slow)).close()


# ============================================================ a backend that stops answering
def timed_out(url: str, ms: int) -> str:
    """``url`` (a store spec: it has ``options=``) whose connections have this statement_timeout."""
    return url.replace("options=", f"options=-cstatement_timeout%3D{ms}%20", 1)


class Stopper:
    """SIGSTOPs PostgreSQL backends of a server on this machine (a backend that no longer answers
    while the kernel still acknowledges TCP: a stuck backend, a hung host) and SIGCONTs every one
    of them in :meth:`resume` (call it in a ``finally``). Skips the test where the backends cannot
    be signalled (a server elsewhere, or owned by another user)."""

    def __init__(self) -> None:
        self.stopped: list[int] = []

    def stop(self, pid: int) -> None:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("postgres"):
                    pytest.skip(f"process {pid} here is not the server's backend")
        except OSError:
            pytest.skip("the PostgreSQL server does not run on this machine")
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError as exc:  # PermissionError: the server runs as another user
            pytest.skip(f"cannot stop the server's backend {pid}: {exc}")
        self.stopped.append(pid)

    def resume(self) -> None:
        for pid in self.stopped:
            with suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()


def ends_within(seconds: float, call: Callable[[], Any]) -> tuple[Any, float]:
    """(what ``call`` returned or raised, seconds it took), failing the test, instead of hanging
    it, when ``call`` is still waiting after ``seconds`` (it runs in a daemon thread)."""
    out: list[Any] = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            out.append(call())
        except BaseException as exc:  # handed to the test
            out.append(exc)
        out.append(time.monotonic() - t0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the call was still waiting after {seconds} s")
    if isinstance(out[0], pytest.skip.Exception):  # Stopper.stop in the call: skip the test
        raise out[0]
    return out[0], out[1]


def pool_backends(pg: Backend, app: str) -> list[int]:
    rows = admin(pg, "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,))
    return [r[0] for r in rows]


def wait_gone(pg: Backend, pid: int, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while admin(pg, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)):
        assert time.monotonic() < deadline, f"backend {pid} is still there"
        time.sleep(0.05)


def test_a_stopped_backend_fails_the_call_within_the_statement_timeout_and_a_margin(
    pg: Backend,
) -> None:
    """A backend that stops answering with its TCP connection up (kill -STOP) hung the caller
    forever: the statement_timeout is enforced by the stopped backend itself, keepalives are
    answered by the kernel. Now the call is a StoreUnavailableError once the server has been
    silent for statement_timeout + NO_ANSWER_MARGIN (5 s), the connection is closed and never
    lent again, and the next call works."""
    spec = pg.spec("stopped")
    pg.open(spec).close()
    app = f"pgstop_{uuid.uuid4().hex[:10]}"
    st = PostgresStore(named(timed_out(spec, 500), app), writer=False)
    stopper = Stopper()
    lent: list[tuple[Any, int]] = []
    getconn = st._getconn

    def recording() -> Any:
        conn = getconn()
        lent.append((conn, conn.info.backend_pid))
        return conn

    st._getconn = recording  # type: ignore[method-assign]
    try:
        assert st.query("SELECT 1") == [(1,)]
        for pid in pool_backends(pg, app):  # every pooled connection: the call gets one
            stopper.stop(pid)
        lent.clear()
        said, took = ends_within(30, lambda: st.query("SELECT 1"))
        assert isinstance(said, StoreUnavailableError), said
        assert "no answer from the server for 5.5 s" in str(said), said
        assert "statement_timeout of 500 ms" in str(said) and st.path in str(said), said
        assert 5.3 <= took <= 5.5 + 3, took  # silent 0.5 s + 5 s; the slack is the machine's
        ((dead, dead_pid),) = lent
        assert dead.closed
        stopper.resume()
        wait_gone(pg, dead_pid)  # the server saw the client go: nothing left holding locks
        for _ in range(4):  # never lent again; a new connection or a resumed one serves
            said, _took = ends_within(30, lambda: st.query("SELECT pg_backend_pid()"))
            assert isinstance(said, list) and said[0][0] != dead_pid, said
        assert all(conn is not dead for conn, _pid in lent[1:])
        assert st._limit.seconds == pytest.approx(5.5)
    finally:
        stopper.resume()
        st.close()


@pytest.mark.parametrize("where", ["statement", "commit", "fetch"])
def test_a_backend_that_stops_in_a_transaction_or_a_fetch_fails_the_call(
    pg: Backend, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The limit covers every round trip: a statement inside a write transaction (nothing of
    it is committed), the COMMIT itself, and a FETCH from a streaming snapshot."""
    monkeypatch.setattr(pg_connection, "NO_ANSWER_MARGIN", 1.0, raising=False)  # 0.5 s + 1 s
    spec = pg.spec(f"stopped_{where}")
    st = PostgresStore(timed_out(spec, 500))
    stopper = Stopper()

    def call() -> None:
        if where == "fetch":
            with st._snapshot() as view:
                cur = view.execute("SELECT g FROM generate_series(1, 100) g")
                assert len(cur.fetchmany(10)) == 10
                stopper.stop(view.conn.info.backend_pid)
                cur.fetchmany(10)
            return
        with st.transaction() as db:
            db.execute("INSERT INTO meta VALUES ('lost', '1')")
            stopper.stop(db.conn.info.backend_pid)
            if where == "statement":
                db.execute("INSERT INTO meta VALUES ('lost2', '1')")

    try:
        said, took = ends_within(20, call)
        assert isinstance(said, StoreUnavailableError), said
        assert "no answer from the server for 1.5 s" in str(said), said
        assert took < 1.5 + 3, took
        stopper.resume()
        # the pool replaces the closed connection; writes and reads work again
        said, _took = ends_within(20, lambda: st.set_meta("kept", "1"))
        assert not isinstance(said, BaseException), said
        assert st.get_meta("kept") == "1"
        if where == "statement":  # (a cut COMMIT may or may not have been committed)
            assert st.get_meta("lost") is None and st.get_meta("lost2") is None
    finally:
        stopper.resume()
        st.close()


def test_a_statement_within_the_statement_timeout_is_not_cut(
    pg: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit is on silence, not on the length of a call: a statement that runs almost its
    whole statement_timeout, and a stream of FETCHes longer in all than the limit, complete; a
    statement past the statement_timeout is still the server's "timed out"."""
    monkeypatch.setattr(pg_connection, "NO_ANSWER_MARGIN", 0.3, raising=False)  # 1.5 s + 0.3 s
    spec = pg.spec("not_cut")
    pg.open(spec).close()
    st = PostgresStore(timed_out(spec, 1500), writer=False)
    try:
        assert st.query("SELECT 1 FROM pg_sleep(1.4)") == [(1,)]
        t0 = time.monotonic()
        with st._snapshot() as view:
            cur = view.execute("SELECT g, pg_sleep(0.1) FROM generate_series(1, 30) g")
            got = [len(cur.fetchmany(6)) for _ in range(5)]  # 0.6 s a FETCH, 3 s in all
        assert got == [6] * 5 and time.monotonic() - t0 > 1.8
        with pytest.raises(StoreError, match="timed out"):
            st.query("SELECT pg_sleep(3)")
        assert st.query("SELECT 1") == [(1,)]
    finally:
        st.close()


def test_the_limit_is_derived_from_the_statement_timeout() -> None:
    assert pg_connection.StatementLimit.of(500).seconds == pytest.approx(
        0.5 + pg_connection.NO_ANSWER_MARGIN
    )
    assert (
        pg_connection.StatementLimit.of(0).seconds == pg_connection.NO_ANSWER_LIMIT
    )  # none set: 300 s
    shown = ["0", "150ms", "30s", "2min", "1h", "1d"]  # as SHOW statement_timeout writes it
    ms = [0, 150, 30_000, 120_000, 3_600_000, 86_400_000]
    assert [pg_connection.milliseconds(x) for x in shown] == ms


def test_a_stopped_server_fails_opening_within_the_connect_timeout(pg: Backend) -> None:
    """Connecting is bounded by connect_timeout: a server whose postmaster does not answer (its
    kernel accepts the TCP connection) fails the open, it does not hang it."""
    spec = pg.spec("stopped_open")
    stopper = Stopper()
    with psycopg.connect(pg.pg_url, autocommit=True) as conn:
        pid = conn.info.backend_pid
        try:
            with open(f"/proc/{pid}/status") as f:
                postmaster = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
        except OSError:
            pytest.skip("the PostgreSQL server does not run on this machine")
    try:
        stopper.stop(postmaster)
        said, took = ends_within(20, lambda: PostgresStore(spec, connect_timeout=1))
        assert isinstance(said, StoreUnavailableError), said
        assert took < 1 + 3, took
    finally:
        stopper.resume()
    PostgresStore(spec).close()  # and it opens once the server answers


# ====================================================================== keepalives, readers
def test_connections_carry_keepalives_unless_the_url_sets_them(pg: Backend) -> None:
    spec = pg.spec("keepalive")
    st = pg.open(spec)
    try:
        with st._pool.connection() as conn:
            got = conn.info.get_parameters()
        for key, value in KEEPALIVES.items():
            assert got.get(key) == str(value), (key, got)
        assert st._writer is not None
        assert st._writer._conn.info.get_parameters().get("tcp_user_timeout") == "30000"
    finally:
        st.close()
    st = PostgresStore(f"{spec}&keepalives_idle=7&tcp_user_timeout=9000", writer=False)
    try:
        with st._pool.connection() as conn:
            got = conn.info.get_parameters()
        assert got["keepalives_idle"] == "7" and got["tcp_user_timeout"] == "9000"
        assert got["keepalives_count"] == str(KEEPALIVES["keepalives_count"])
    finally:
        st.close()


def test_a_reader_does_not_create_a_store(pg: Backend) -> None:
    spec = pg.spec("reader")
    with pytest.raises(StoreError, match="no memoryos-gpu store"):
        PostgresStore(spec, writer=False)
    assert pg.tables(spec) == []
    PostgresStore(spec).close()  # a writer creates it; then a reader opens it
    PostgresStore(spec, writer=False).close()


@pytest.mark.parametrize(
    "command",
    [["retrieve", "--user", "maya", "when?"], ["delete", "--user", "maya", "--yes"], ["stats"]],
)
def test_a_cli_command_that_does_not_ingest_refuses_a_url_without_a_store(
    pg: Backend, command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A URL left without its schema option (``?options=-csearch_path...``) pointed
    ``retrieve`` and ``delete`` at an empty database: they created the store's tables there
    (recording their embedder, which a later ingest with another one was refused for) and
    answered "unknown user"; ``stats`` refused it already."""
    from memoryos_gpu.cli.app import main

    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    spec = pg.spec("cli_no_store")
    assert main([command[0], "--store", spec, *command[1:]]) == 1
    assert "no memoryos-gpu store in" in capsys.readouterr().err
    assert pg.tables(spec) == []


def test_driver_errors_are_named_by_their_class() -> None:
    """A deadlock is retryable but not "the server cannot be reached"; a full disk and a
    statement timeout keep their own words; a constraint violation is left as it is."""
    from memoryos_gpu.store.errors import StoreFullError

    store = PostgresStore.__new__(PostgresStore)  # only what _failure reads
    store.path, store._secrets = "postgresql://u:***@h/db", []
    said = store._failure(psycopg.errors.DeadlockDetected("deadlock detected"))
    assert isinstance(said, StoreUnavailableError) and "rolled the transaction back" in str(said)
    said = store._failure(psycopg.errors.AdminShutdown("terminating connection"))
    assert isinstance(said, StoreUnavailableError) and "is unavailable" in str(said)
    assert isinstance(store._failure(psycopg.errors.DiskFull("disk full")), StoreFullError)
    said = store._failure(
        psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
    )
    assert type(said) is StoreError and "timed out" in str(said)
    assert store._failure(psycopg.errors.UniqueViolation("duplicate key")) is None


@pytest.mark.parametrize("encoding", ["SQL_ASCII", "LATIN1"])
def test_a_database_not_in_utf8_is_refused_saying_so(pg: Backend, encoding: str) -> None:
    """SQL_ASCII answered SHOW with bytes, and the open failed with a TypeError traceback."""
    from memoryos_gpu.store import open_store

    name = f"enc_{encoding.lower()}_{uuid.uuid4().hex[:8]}"
    admin(
        pg,
        f"CREATE DATABASE {name} ENCODING '{encoding}' TEMPLATE template0 "
        "LC_COLLATE 'C' LC_CTYPE 'C'",
    )
    try:
        url = pg.pg_url.rsplit("/", 1)[0] + f"/{name}"
        with pytest.raises(StoreError, match=f"server encoding {encoding}; .* needs a UTF8"):
            open_store(url)
    finally:
        admin(pg, f"DROP DATABASE {name}")


def test_a_search_path_of_no_existing_schema_is_refused_saying_so(pg: Backend) -> None:
    """It failed creating the tables, with a piece of the CREATE TABLE statement as message."""
    from memoryos_gpu.store import open_store

    url = f"{pg.pg_url}?options=-csearch_path%3Dno_such_schema_zq"
    with pytest.raises(StoreError, match=r"no schema of its search_path \(no_such_schema_zq\)"):
        open_store(url)


# ====================================================================== the writer claim
# The server drops the claim's session (a restart does; here pg_terminate_backend): the claim
# was only taken at open, so another writer got in and the engine, its memory stale, failed
# every write for that user with a UniqueViolation (500) and answered 404 for a user whose
# pages were in the store. Now a write finds the loss out (one statement in its transaction),
# is not committed, takes the claim again -- or names the writer that holds it now -- and the
# engine reloads its memory from the store before the next write.
def claiming_engine(spec: str) -> MemoryEngine:
    return MemoryEngine(EngineConfig(store=spec, embedder="hashing", device="cpu"))


def drop_claim(b: Backend, e: MemoryEngine) -> None:
    """What a server restart does to the claim's session: the server ends it."""
    pid = e.store._writer._pid
    with psycopg.connect(b.pg_url, autocommit=True) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
        deadline = time.monotonic() + 30  # the backend ends (and drops its locks) after
        gone = "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s)"
        while not conn.execute(gone, (pid,)).fetchone()[0]:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_a_lost_claim_is_taken_again_by_the_next_write(pg: Backend) -> None:
    spec = pg.spec("claim-again")
    e = claiming_engine(spec)
    try:
        e.add("u1", "I like tea", "ok")
        drop_claim(pg, e)
        with pytest.raises(WriterClaimLostError, match="taken again"):
            e.add("u1", "I like coffee", "ok")
        e.add("u1", "I like cocoa", "ok")
        texts = [p["user_input"] for p in e.list_pages("u1")[0]]
        assert texts == ["I like tea", "I like cocoa"]
    finally:
        e.close()


def test_a_writer_that_got_in_meanwhile_is_named_then_its_pages_are_loaded(pg: Backend) -> None:
    spec = pg.spec("claim-taken")
    e = claiming_engine(spec)
    try:
        e.add("u1", "first page", "ok")
        drop_claim(pg, e)
        other = claiming_engine(spec)  # what `memoryos-gpu ingest` beside the server did
        try:
            other.add("u1", "written by the other writer", "ok")
            with pytest.raises(WriterClaimLostError, match="another writer holds"):
                e.add("u1", "refused while the other writes", "ok")
        finally:
            other.close()
        with pytest.raises(WriterClaimLostError, match="taken again"):
            e.add("u1", "the claim comes back", "ok")
        e.add("u1", "after the reload", "ok")  # was: UniqueViolation (seq 1 taken)
        texts = [p["user_input"] for p in e.list_pages("u1")[0]]
        assert texts == ["first page", "written by the other writer", "after the reload"]
    finally:
        e.close()

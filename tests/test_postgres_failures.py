"""The PostgreSQL store when its server fails: a dropped connection is a StoreUnavailableError
(and costs the next call nothing), the HTTP server answers it 503 with Retry-After, a statement
timeout is a StoreError that says so, connections carry TCP keepalives, a reader does not create
a store, and no message prints a password, however it is written in the URL.

The server tests use ``$MEMORYOS_GPU_TEST_PG_URL`` (tests/store_backends.py) and skip without
it; the URL tests need no server.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

from store_backends import Backend, make_backend  # noqa: E402

from memoryos_gpu.store import StoreUnavailableError  # noqa: E402
from memoryos_gpu.store.pg_urls import check_url, redact  # noqa: E402
from memoryos_gpu.store.postgres import KEEPALIVES, PgCursor, PostgresStore  # noqa: E402
from memoryos_gpu.store.sqlite import StoreError  # noqa: E402

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


def test_a_server_that_refuses_connections_is_unavailable_until_it_is_back(
    pg: Backend,
) -> None:
    """What a restart looks like from the store: every connection dropped, none accepted for a
    while (a database that does not allow connections stands in for a server starting up)."""
    name = f"pgfail_{uuid.uuid4().hex[:10]}"
    admin(pg, f'CREATE DATABASE "{name}"')
    base = pg.pg_url.rsplit("/", 1)[0] + f"/{name}"
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
            with pytest.raises(StoreUnavailableError):
                st.query("SELECT 1")
            with pytest.raises(StoreUnavailableError), st.transaction():
                pass
            admin(pg, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
            st._pool.timeout = 30.0
            assert st.query("SELECT 1") == [(1,)]
        finally:
            st.close()
    finally:
        admin(pg, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        admin(pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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


def test_driver_errors_are_named_by_their_class() -> None:
    """A deadlock is retryable but not "the server cannot be reached"; a full disk and a
    statement timeout keep their own words; a constraint violation is left as it is."""
    from memoryos_gpu.store.sqlite import StoreFullError

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

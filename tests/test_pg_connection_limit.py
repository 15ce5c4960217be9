"""A PostgreSQL store whose pool cannot open a connection because the server refuses it (the
role's connection limit reached) says so: the refusal, not "server down or every pooled
connection busy", is what a caller that timed out waiting for a connection is told.

Why it matters: psycopg_pool opens connections in the background and only logs why one failed,
so without this the cause (``too many connections for role ...``) was seen only in worker logs
(``ingest --ray --shards 4`` with a role limited to 10 connections).

Uses ``$MEMORYOS_GPU_TEST_PG_URL`` (tests/store_backends.py); skips without it, or when its
user may not create roles.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import suppress
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

psycopg = pytest.importorskip("psycopg")

from store_backends import pg_url_or_skip, with_search_path  # noqa: E402

from memoryos_gpu.store import StoreUnavailableError  # noqa: E402
from memoryos_gpu.store.postgres import PostgresStore  # noqa: E402


def _admin(url: str, sql: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def _as_role(url: str, role: str, password: str) -> str:
    """``url`` logging in as ``role`` instead of its own user."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{role}:{quote(password)}@{host}"))


@pytest.fixture
def limited_role() -> Iterator[tuple[str, str, str]]:
    """(admin URL, the role's URL on a schema of its own, the role's name); dropped after."""
    url = pg_url_or_skip()
    can = _admin(url, "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = user")
    if not can or not can[0][0]:
        pytest.skip("the test server's user may not create roles")
    role = f"lim_{uuid.uuid4().hex[:10]}"
    password = uuid.uuid4().hex
    db = _admin(url, "SELECT current_database()")[0][0]
    _admin(url, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    try:
        _admin(url, f'GRANT CONNECT ON DATABASE "{db}" TO {role}')
        _admin(url, f"CREATE SCHEMA {role} AUTHORIZATION {role}")
        yield url, with_search_path(_as_role(url, role, password), role), role
    finally:
        with suppress(psycopg.Error):
            _admin(url, f"ALTER ROLE {role} CONNECTION LIMIT -1")
        _admin(
            url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
            (role,),
        )
        _admin(url, f"DROP SCHEMA IF EXISTS {role} CASCADE")
        _admin(url, f'REVOKE ALL ON DATABASE "{db}" FROM {role}')
        _admin(url, f"DROP ROLE IF EXISTS {role}")


def test_pool_timeout_names_the_connection_limit_the_server_enforced(
    limited_role: tuple[str, str, str],
) -> None:
    admin_url, url, role = limited_role
    st = PostgresStore(url, connect_timeout=2)
    held = []
    try:
        in_use = _admin(
            admin_url, "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (role,)
        )[0][0]
        # the role may keep what it has, and open nothing more
        _admin(admin_url, f"ALTER ROLE {role} CONNECTION LIMIT {int(in_use)}")
        st._pool.timeout = 2.0  # a short wait (the store's is 30 s)
        while st._pool.get_stats().get("pool_available", 0) > 0:
            held.append(st._pool.getconn())  # every pooled connection busy
        with pytest.raises(StoreUnavailableError) as caught:
            st.query("SELECT 1")
        text = str(caught.value)
        assert "too many connections for role" in text, text
        assert "connection limit" in text, text
    finally:
        for conn in held:
            st._pool.putconn(conn)
        st.close()


def test_pool_timeout_without_a_refusal_keeps_the_general_causes(
    limited_role: tuple[str, str, str],
) -> None:
    """A pool that is merely busy (no connection refused meanwhile) still says so."""
    _, url, _ = limited_role
    st = PostgresStore(url, connect_timeout=2, pool_size=2)
    held = []
    try:
        st._pool.timeout = 1.0
        for _ in range(2):  # the pool's whole size
            held.append(st._pool.getconn())
        with pytest.raises(StoreUnavailableError) as caught:
            st.query("SELECT 1")
        text = str(caught.value)
        assert "every pooled connection busy" in text and "opening one failed" not in text, text
    finally:
        for conn in held:
            st._pool.putconn(conn)
        st.close()

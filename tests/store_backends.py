"""The store backends the store tests run against: SQLite files, and a real PostgreSQL server.

PostgreSQL comes from ``$MEMORYOS_GPU_TEST_PG_URL`` (``eval "$(bash scripts/pg_test_server.sh
start)"`` starts a throwaway one). Without it, or with the server unreachable, the PostgreSQL
cases skip, saying why; with ``MEMORYOS_GPU_REQUIRE_PG=1`` (CI) they fail instead, so a broken
server setup cannot pass as a green run. Every store a test asks for is a fresh schema of that
database (the URL's ``search_path``), dropped when the backend is torn down.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from memoryos_gpu.store import open_store
from memoryos_gpu.store.sqlite import SQLiteStore

PG_ENV = "MEMORYOS_GPU_TEST_PG_URL"
REQUIRE_ENV = "MEMORYOS_GPU_REQUIRE_PG"
START_HINT = 'eval "$(bash scripts/pg_test_server.sh start)"'


def pg_url_or_skip() -> str:
    """The test server's URL; skips (fails under MEMORYOS_GPU_REQUIRE_PG=1) when there is none."""
    url = os.environ.get(PG_ENV, "")
    why = None
    try:
        import psycopg
    except ImportError:
        psycopg = None
        why = "psycopg is not installed (pip install -e '.[postgres]')"
    if why is None and not url:
        why = f"${PG_ENV} is not set; start a server with: {START_HINT}"
    if why is None:
        try:
            psycopg.connect(url, connect_timeout=5).close()
        except psycopg.Error as exc:
            from memoryos_gpu.store.pg_urls import redact

            why = f"PostgreSQL at {redact(url)} is unreachable ({' '.join(str(exc).split())})"
    if why is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{why} and {REQUIRE_ENV}=1", pytrace=False)
        pytest.skip(f"PostgreSQL store tests skipped: {why}")
    return url


def with_search_path(url: str, schema: str) -> str:
    """``url`` whose connections work in ``schema`` (libpq's ``options=-csearch_path=...``)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "options"]
    query.append(("options", f"-csearch_path={schema}"))
    return urlunsplit(parts._replace(query=urlencode(query)))


class RawSQLite:
    """sqlite3 connection that commits each write at once (as the PostgreSQL one does)."""

    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, isolation_level=None)

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self._db.execute(sql, params)

    def close(self) -> None:
        self._db.close()


class RawPostgres:
    """A plain autocommit psycopg connection speaking the store's ``?`` SQL."""

    def __init__(self, url: str) -> None:
        import psycopg

        from memoryos_gpu.store.pg_connection import PgConnection

        self._conn = psycopg.connect(url, autocommit=True)
        self._db = PgConnection(self._conn)

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self._db.execute(sql, params)

    def close(self) -> None:
        self._conn.close()


class Backend:
    """Makes store specs (paths or URLs) of one backend and talks to them directly."""

    def __init__(self, kind: str, tmp: Path, pg_url: str | None = None) -> None:
        self.kind = kind
        self.tmp = tmp
        self.pg_url = pg_url
        self._schemas: list[str] = []
        if kind == "postgres":
            import psycopg

            import memoryos_gpu.store.postgres_schema as module

            self.IntegrityError: type[Exception] = psycopg.IntegrityError
            self.module: Any = module
        else:
            import memoryos_gpu.store.sqlite_schema as module

            self.IntegrityError = sqlite3.IntegrityError
            self.module = module

    def __repr__(self) -> str:
        return f"Backend({self.kind})"

    def spec(self, name: str) -> str:
        """A new, empty store's spec: a file in the temp dir, or a fresh PostgreSQL schema."""
        if self.kind == "sqlite":
            return str(self.tmp / f"{name}-{uuid.uuid4().hex[:8]}.sqlite3")
        assert self.pg_url is not None
        schema = f"t_{name[:20].lower().replace('-', '_')}_{uuid.uuid4().hex[:10]}"
        self._admin(f'CREATE SCHEMA "{schema}"')
        self._schemas.append(schema)
        return with_search_path(self.pg_url, schema)

    def open(self, spec: str) -> SQLiteStore:
        return open_store(spec)

    def connect(self, spec: str) -> RawSQLite | RawPostgres:
        """A raw connection to the store, outside any engine (autocommit)."""
        return RawSQLite(spec) if self.kind == "sqlite" else RawPostgres(spec)

    def tables(self, spec: str) -> list[str]:
        db = self.connect(spec)
        try:
            if self.kind == "sqlite":
                sql = "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            else:
                sql = (
                    "SELECT table_name FROM information_schema.tables "
                    "WHERE table_schema = current_schema() ORDER BY table_name"
                )
            return [r[0] for r in db.execute(sql).fetchall()]
        finally:
            db.close()

    def columns(self, spec: str, table: str) -> list[str]:
        db = self.connect(spec)
        try:
            if self.kind == "sqlite":
                return [r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()]
            return [
                r[0]
                for r in db.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_schema = "
                    "current_schema() AND table_name = ? ORDER BY ordinal_position",
                    (table,),
                ).fetchall()
            ]
        finally:
            db.close()

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            conn.execute(sql)

    def cleanup(self) -> None:
        for schema in self._schemas:
            self._admin(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        self._schemas.clear()


def make_backend(kind: str, tmp: Path) -> Backend:
    if kind == "postgres":
        return Backend(kind, tmp, pg_url_or_skip())
    return Backend(kind, tmp)

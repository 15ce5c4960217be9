"""The store's multi-row ``executemany`` (memoryos_gpu/store/batched_sql.py): the same changes
as sqlite3's row-by-row one, for every shape it rewrites, at every chunk size; the shapes it
must not rewrite run row by row; and the engine's own rewritten statements find their rows
by index, never by a scan per chunk."""

from __future__ import annotations

import re
import sqlite3
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.store.batched_sql import (
    MAX_UPDATE_FROM_BYTES,
    batched_connection,
    plan,
    sql_for,
)

SCHEMA = """
CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT UNIQUE, n INTEGER NOT NULL DEFAULT 0,
               note TEXT, data BLOB, kind TEXT);
CREATE TABLE k(key TEXT PRIMARY KEY, v REAL);
"""

STATEMENTS = [
    "INSERT INTO t(id, name, n, note, data, kind) VALUES (?, ?, ?, ?, ?, 'x')",
    "INSERT INTO t(id, name, n) VALUES (?, ?, ?) "
    "ON CONFLICT(id) DO UPDATE SET n = t.n + excluded.n, name = excluded.name",
    "INSERT OR IGNORE INTO k(key, v) VALUES (?, ?)",
    "UPDATE t SET n = n + ?, note = ? WHERE id = ?",
    "UPDATE t SET kind = 'seen', n = n + 1 WHERE id = ?",
    "UPDATE k SET v = ? WHERE key = ?",
    "DELETE FROM t WHERE id = ?",
    "DELETE FROM k WHERE key = ?",
]


def _pair(dbapi: Any = sqlite3) -> tuple[Any, Any]:
    """A plain connection and a batched one of ``dbapi``, each on the same seeded database."""
    out = []
    for factory in (dbapi.Connection, batched_connection(dbapi)):
        db = dbapi.connect(":memory:", isolation_level=None, factory=factory)
        db.executescript(SCHEMA)
        db.executemany(
            "INSERT INTO t(id, name, n) VALUES (?, ?, ?)", [(i, f"n{i}", i) for i in range(40)]
        )
        db.executemany("INSERT INTO k(key, v) VALUES (?, ?)", [(f"k{i}", i) for i in range(40)])
        out.append(db)
    return out[0], out[1]


def _rows(db: Any) -> tuple[list, list]:
    return (
        db.execute("SELECT * FROM t ORDER BY id").fetchall(),
        db.execute("SELECT * FROM k ORDER BY key").fetchall(),
    )


def _params(sql: str, i: int, key: int, text: str) -> tuple:
    """Row ``i`` of ``sql``'s parameters, keyed ``key`` (ids 0-39 exist at first)."""
    return {
        STATEMENTS[0]: (1000 + i, f"new{i}", i, text, text.encode(), None)[:5],
        STATEMENTS[1]: (key, f"up{i}", i),
        STATEMENTS[2]: (f"k{key}", float(i)),
        STATEMENTS[3]: (i, text, key),
        STATEMENTS[4]: (key,),
        STATEMENTS[5]: (float(i) / 3, f"k{key}"),
        STATEMENTS[6]: (key,),
        STATEMENTS[7]: (f"k{key}",),
    }[sql]


@settings(max_examples=60, deadline=None)
@given(
    sql=st.sampled_from(STATEMENTS),
    keys=st.lists(st.integers(0, 300), min_size=0, max_size=300),
    wide=st.booleans(),
)
def test_same_changes_as_row_by_row(sql: str, keys: list[int], wide: bool) -> None:
    """Any number of rows (chunk edges included), keys repeated or not, narrow or wide."""
    text = "w" * (MAX_UPDATE_FROM_BYTES + 1 if wide else 8)
    rows = [_params(sql, i, k, text) for i, k in enumerate(keys)]
    plain, batched = _pair()
    for db in (plain, batched):
        db.execute("BEGIN")
        db.executemany(sql, rows)
        db.execute("COMMIT")
    assert _rows(batched) == _rows(plain)


@pytest.mark.parametrize("sql", STATEMENTS)
def test_the_encryption_driver_batches_the_same(sql: str) -> None:
    """The encrypted store's connection (sqlcipher3) takes the same rewrites."""
    dbapi = pytest.importorskip("sqlcipher3")
    for keys in (list(range(200)), [k % 60 for k in range(0, 600, 3)]):  # distinct, repeated
        rows = [_params(sql, i, k, "w" * 8) for i, k in enumerate(keys)]
        plain, batched = _pair(dbapi)
        for db in (plain, batched):
            db.executemany(sql, rows)
        assert _rows(batched) == _rows(plain)


def test_a_failing_row_fails_the_statement_as_sqlite3_does() -> None:
    plain, batched = _pair()
    rows = [(500, "a", 1, None, None), (501, "n3", 1, None, None)]  # n3 exists: UNIQUE
    for db in (plain, batched):
        db.execute("BEGIN")
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
            db.executemany(STATEMENTS[0], rows)
        db.execute("ROLLBACK")
    assert _rows(batched) == _rows(plain)


@pytest.mark.parametrize(
    ("sql", "rows"),
    [
        ("DELETE FROM t WHERE id = ?", [(1,), (2, 3)]),  # a row of the wrong width
        ("UPDATE t SET n = ? WHERE id = ?", [(1, [2]), (3, 4)]),  # an unhashable key
        ("INSERT INTO k(key, v) VALUES (?, ?)", [("a", 1.0), 7]),  # a row that is no sequence
    ],
)
def test_bad_rows_get_sqlite3s_error(sql: str, rows: list) -> None:
    plain, batched = _pair()
    errors = []
    for db in (plain, batched):
        with pytest.raises(sqlite3.ProgrammingError) as info:
            db.executemany(sql, rows)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO t(id, n) SELECT ?, ? FROM k",  # no VALUES group
        "INSERT INTO t(id, n) VALUES (?, abs(?))",  # a call inside the group
        "INSERT INTO t(id, n) VALUES (?, ?) ON CONFLICT(id) DO UPDATE SET n = ?",
        "UPDATE t SET n = ? WHERE id = ? AND kind = 'x'",
        "UPDATE t SET n = (SELECT v FROM k WHERE key = ?) WHERE id = ?",
        "DELETE FROM t WHERE id > ?",
        "SELECT * FROM t WHERE id = ?",
        "INSERT INTO t(id, n) VALUES (?1, ?2)",  # numbered and named parameters
        "UPDATE t SET n = ?1 WHERE id = ?",
        "INSERT INTO t(id, n) VALUES (:id, :n)",
        "UPDATE t SET n = :n WHERE id = ?",
    ],
)
def test_other_shapes_run_row_by_row(sql: str) -> None:
    assert plan(sql) is None


def test_a_question_mark_in_a_literal_is_not_a_parameter() -> None:
    sql = sql_for("INSERT INTO t(id, note) VALUES (?, 'why?')", 2)
    assert sql is not None and sql.endswith("(?, 'why?'),(?, 'why?')")
    update = sql_for("UPDATE t SET note = 'what?', n = ? WHERE id = ?", 2)
    assert update is not None and "note = 'what?', n = _rows.column1" in update


def test_literals_keep_their_whitespace() -> None:
    plain, batched = _pair()
    sql = "INSERT INTO t(id, note)\n  VALUES (?, 'two  spaces\n and a line')"
    for db in (plain, batched):
        db.executemany(sql, [(900,), (901,)])
    assert _rows(batched) == _rows(plain)
    assert batched.execute("SELECT note FROM t WHERE id = 901").fetchone() == (
        "two  spaces\n and a line",
    )


def _scans(db: sqlite3.Connection, sql: str) -> set[str]:
    """The tables ``sql``'s plan reads by a full scan, VALUES rows aside, and for an INSERT
    its table's children too: a multi-row INSERT into a parent table plans a scan of each
    child for deferred foreign-key violations, which runs only while some are outstanding
    (``FkIfZero``; never in the engine's immediate mode)."""
    steps = [r[3] for r in db.execute(f"EXPLAIN QUERY PLAN {sql}", [None] * sql.count("?"))]
    scans = {s for s in steps if s.startswith("SCAN") and "_rows" not in s and "CONSTANT" not in s}
    m = re.match(r"INSERT\b.*?\bINTO\s+(\w+)", sql, re.IGNORECASE)
    if m:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        children = {
            t for t in tables for fk in db.execute(f"PRAGMA foreign_key_list({t})") if fk[2] == m[1]
        }
        scans -= {f"SCAN {t}" for t in children}
    return scans


def test_the_engines_statements_scan_nothing_more(make_engine: Any) -> None:
    """Every statement a batch of pages rewrites (bulk ingestion's): its plan scans no table
    that the one-row statement does not (a scan per chunk would make a batch quadratic)."""
    engine = make_engine(mode="extractive")
    cls = type(engine.store._db)
    base = cls.executemany
    seen: set[str] = set()

    def spy(self: sqlite3.Connection, sql: str, seq: Any) -> Any:
        seen.add(sql)
        return base(self, sql, seq)

    cls.executemany = spy  # type: ignore[method-assign]
    try:
        engine.add_many(
            [
                {"user_id": f"u{u}", "user_input": f"I like topic {j} of {u}", "timestamp": 1e9 + j}
                for j in range(12)
                for u in range(6)
            ]
        )
    finally:
        cls.executemany = base  # type: ignore[method-assign]
    rewritten = {s: text for s in seen if (text := sql_for(s, 3)) is not None}
    assert {s.split()[0] for s in rewritten} >= {"INSERT", "UPDATE", "DELETE"}
    db = engine.store._db
    for sql, text in rewritten.items():
        assert _scans(db, text) <= _scans(db, sql), sql

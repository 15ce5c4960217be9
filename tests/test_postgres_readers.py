"""A PostgreSQL store opened with ``writer=False`` refuses writes, as SQLite's does (``PRAGMA
query_only``): every pooled connection of a reader runs read-only transactions, so a program's
``delete_user`` through a reader beside a running engine no longer succeeds and leaves that
engine's memory and the store disagreeing. The refusal is a one-line :class:`StoreError` that
says the store was opened read-only. Reads through a reader keep working (queries, the
streaming loads of a reopen, history, export, the CLI's read-only commands), and a reader
that opens an older store migrates it first, as a SQLite reader does.

Uses ``$MEMORYOS_GPU_TEST_PG_URL`` (tests/store_backends.py) and skips without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

psycopg = pytest.importorskip("psycopg")

from store_backends import Backend, make_backend  # noqa: E402

from memoryos_gpu import EngineConfig, MemoryEngine  # noqa: E402
from memoryos_gpu.store import open_store, sqlite_schema  # noqa: E402
from memoryos_gpu.store.errors import StoreError  # noqa: E402
from memoryos_gpu.store.postgres import PostgresStore  # noqa: E402

READ_ONLY = "opened read-only"


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Backend]:
    b = make_backend("postgres", tmp_path)
    try:
        yield b
    finally:
        b.cleanup()


def _engine(url: str) -> MemoryEngine:
    return MemoryEngine(EngineConfig(store=url, embedder="hashing"))


def _filled(pg: Backend, name: str) -> str:
    url = pg.spec(name)
    with _engine(url) as e:
        e.add("u", "hello there", "hi")
        e.add("u", "I like hiking", "nice")
    return url


def test_a_postgres_reader_beside_an_engine_cannot_write(pg: Backend) -> None:
    """The PostgreSQL twin of test_writer_lock's SQLite test: the reader's delete_user
    succeeded, and the running engine's next add for the user failed (FOREIGN KEY)."""
    url = pg.spec("beside")
    with _engine(url) as e:
        e.add("u", "hello there")
        reader = open_store(url, writer=False)
        try:
            with pytest.raises(StoreError, match=READ_ONLY) as info:
                reader.delete_user("u")
            assert "writer=False" in str(info.value), info.value
            assert "\n" not in str(info.value)  # one line, for the CLI
            assert reader.query("SELECT COUNT(*) FROM pages WHERE user_id = 'u'") == [(1,)]
        finally:
            reader.close()
        e.add("u", "and again")  # the engine's memory and its store still agree
        assert [p.user_input for p in e.retrieve("u", "hello").stm] == ["hello there", "and again"]


def test_every_write_path_of_a_reader_is_refused(pg: Backend) -> None:
    url = _filled(pg, "writes")
    before = pg.connect(url)
    try:
        counts = before.execute("SELECT COUNT(*) FROM pages").fetchone()
    finally:
        before.close()
    reader = open_store(url, writer=False)
    try:
        assert isinstance(reader, PostgresStore) and not reader.is_writer
        with pytest.raises(StoreError, match=READ_ONLY):
            reader.set_meta("written_by", "a reader")
        with pytest.raises(StoreError, match=READ_ONLY):
            reader.query("DELETE FROM pages")  # outside a transaction: autocommit
        with pytest.raises(StoreError, match=READ_ONLY), reader.transaction() as db:
            db.execute("UPDATE users SET profile = '{}'")
        with (
            pytest.raises(StoreError, match=READ_ONLY),
            reader.transaction(durability="none") as db,
        ):
            reader.new_ids(db, "pages", 2)  # nextval() writes its sequence
        with pytest.raises(StoreError, match=READ_ONLY):
            reader.query("CREATE TABLE made_by_a_reader (x INT)")
        # every connection of the pool, not only the one that happened to be handed out
        held = [reader._pool.getconn() for _ in range(3)]
        try:
            shown = [c.execute("SHOW transaction_read_only").fetchone()[0] for c in held]
        finally:
            for c in held:
                reader._pool.putconn(c)
        assert shown == ["on", "on", "on"]
        assert reader.get_meta("written_by") is None
    finally:
        reader.close()
    after = pg.connect(url)
    try:
        assert after.execute("SELECT COUNT(*) FROM pages").fetchone() == counts
    finally:
        after.close()
    assert "made_by_a_reader" not in pg.tables(url)
    writer = open_store(url)  # a writer of the same store still writes
    try:
        writer.set_meta("written_by", "the writer")
        assert writer.get_meta("written_by") == "the writer"
    finally:
        writer.close()


def test_reads_through_a_reader_keep_working(pg: Backend) -> None:
    url = _filled(pg, "reads")
    reader = open_store(url, writer=False)
    try:
        assert reader.counts()["users"] == 1
        assert reader.query("SELECT COUNT(*) FROM pages") == [(2,)]
        assert reader.user_row("u") is not None
        assert [p["user_input"] for p in reader.user_pages("u")] == [
            "hello there",
            "I like hiking",
        ]
        exported = reader.export_user("u")
        assert exported is not None and len(exported["pages"]) == 2
        assert isinstance(reader.history("u"), list)
        assert reader.load_stm() == {"u": [r["page_id"] for r in reader.user_pages("u")]}
        with reader.transaction() as db:  # a transaction that only reads works
            assert db.execute("SELECT COUNT(*) FROM users").fetchone() == (1,)
        assert reader.check_integrity() == []
        assert reader.size_bytes() > 0
    finally:
        reader.close()


def test_the_cli_read_only_commands_work_on_a_postgres_store(pg: Backend) -> None:
    from click.testing import CliRunner

    from memoryos_gpu import cli as cli_mod

    url = _filled(pg, "cli")
    run = CliRunner().invoke
    res = run(cli_mod.cli, ["stats", "--store", url, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["counts"]["users"] == 1
    res = run(cli_mod.cli, ["export", "--user", "u", "--store", url])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.output)["pages"]) == 2
    res = run(cli_mod.cli, ["profile", "--user", "u", "--store", url, "--json"])
    assert res.exit_code == 0, res.output


def test_a_reader_migrates_an_older_store_then_refuses_writes(
    pg: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a SQLite reader does (its migration runs before ``PRAGMA query_only``): the tools
    that only read must open a store an older memoryos-gpu wrote."""
    url = _filled(pg, "older")
    base = sqlite_schema.SCHEMA_VERSION
    step = "ALTER TABLE pages ADD COLUMN lang TEXT"
    monkeypatch.setattr(sqlite_schema, "SCHEMA_VERSION", base + 1)
    monkeypatch.setattr(pg.module, "MIGRATIONS", {**pg.module.MIGRATIONS, base: step})
    reader = open_store(url, writer=False)
    try:
        assert reader.schema_version == base + 1
        assert reader.query("SELECT COUNT(*) FROM pages WHERE lang IS NULL") == [(2,)]
        with pytest.raises(StoreError, match=READ_ONLY):
            reader.query("UPDATE pages SET lang = 'en'")
    finally:
        reader.close()
    assert "lang" in pg.columns(url, "pages")

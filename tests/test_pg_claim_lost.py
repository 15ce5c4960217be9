"""A PostgreSQL store whose server drops the writer claim's session (a restart does; here
``pg_terminate_backend``): the claim was only taken at open, so another writer got in and the
engine, its memory stale, failed every write for that user with a UniqueViolation (500) and
answered 404 for a user whose pages were in the store. Now a write finds the loss out (one
statement in its transaction), is not committed, takes the claim again -- or names the writer
that holds it now -- and the engine reloads its memory from the store before the next write.
Skipped without ``$MEMORYOS_GPU_TEST_PG_URL`` (tests/store_backends.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

psycopg = pytest.importorskip("psycopg")

from store_backends import Backend, make_backend  # noqa: E402

from memoryos_gpu import EngineConfig, MemoryEngine  # noqa: E402
from memoryos_gpu.store.errors import WriterClaimLostError  # noqa: E402


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Backend]:
    b = make_backend("postgres", tmp_path)
    try:
        yield b
    finally:
        b.cleanup()


def engine(spec: str) -> MemoryEngine:
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
    e = engine(spec)
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
    e = engine(spec)
    try:
        e.add("u1", "first page", "ok")
        drop_claim(pg, e)
        other = engine(spec)  # what `memoryos-gpu ingest` beside the server did
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

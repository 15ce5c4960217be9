"""A rewrite of the file that an erasure owes outlives the process that owed it: a full disk
failing it, or a process dying before it, leaves a mark in the store, and the next writer to
open the store rewrites the file (deleted text used to wait there for a later deletion)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store.erasure import REWRITE_OWED
from memoryos_gpu.store.sqlite import SQLiteStore

SECRET = "zanzibarquokka"


def _engine(path: Path) -> MemoryEngine:
    cfg = EngineConfig(
        store=str(path), memory=preset("paper", stm_capacity=2), embedder="hashing", device="cpu"
    )
    return MemoryEngine(cfg)


def _owed(path: Path) -> bool:
    with sqlite3.connect(path) as db:
        return bool(db.execute("SELECT 1 FROM meta WHERE key = ?", (REWRITE_OWED,)).fetchall())


def _in_file(path: Path) -> bool:
    """Whether the secret's bytes are anywhere in the database file or its log."""
    files = [path, Path(f"{path}-wal")]
    return any(f.exists() and SECRET.encode() in f.read_bytes() for f in files)


def _no_room(store: Any) -> Any:
    """The store's connection with every ``VACUUM`` failing as on a full disk."""
    real = store._db

    class NoRoom:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def execute(self, sql: str, *args: Any) -> Any:
            if sql == "VACUUM":
                raise sqlite3.OperationalError("database or disk is full")
            return real.execute(sql, *args)

    store._db = NoRoom()
    return real


def _with_secret(path: Path) -> MemoryEngine:
    eng = _engine(path)
    for i in range(6):
        eng.add("alice", f"my locker code is {SECRET} number {i}", "noted", timestamp=float(i))
        eng.add("bob", f"bob likes sailing {i}", "nice", timestamp=float(i))
    eng.process_pending()
    return eng


def test_a_rewrite_a_full_disk_failed_is_done_by_the_next_writer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s.sqlite3"
    eng = _with_secret(path)
    _no_room(eng.store)  # the disk stays full through the close: its rewrite fails too
    try:
        with caplog.at_level("WARNING", logger="memoryos_gpu.store"):
            eng.delete_user("alice")
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "could not be rewritten" in said, said
    finally:
        eng.close()
    assert _owed(path)

    eng = _engine(path)  # the next writer: rewrites the file (at close at the latest)
    try:
        assert eng.retrieve_many([("bob", "sailing")], update_heat=False)[0].pages
    finally:
        eng.close()
    assert not _owed(path)
    assert not _in_file(path)


def test_a_writer_killed_between_a_deletion_and_its_rewrite_leaves_it_owed(
    tmp_path: Path,
) -> None:
    """The mark is written before the deletion commits: a process that dies after the commit
    (simulated: the store closed with nothing left due) still leaves the rewrite owed, and a
    reader's open leaves it owed (it must not write)."""
    path = tmp_path / "s.sqlite3"
    st = SQLiteStore(str(path))
    try:
        st.begin_erasure()
        assert st.get_meta(REWRITE_OWED) == "1"
    finally:
        st.close()  # no checkpoint(): the deletion's process died before its rewrite
    assert _owed(path)
    SQLiteStore(str(path), writer=False).close()
    assert _owed(path)
    st = SQLiteStore(str(path))
    st.close()
    assert not _owed(path)


def test_a_rewrite_done_clears_the_mark_and_the_next_deletion_sets_it_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.sqlite3"
    eng = _with_secret(path)
    try:
        eng.delete_user("alice")  # rewritten at once: the mark set, then cleared
        assert not _owed(path)
        assert not _in_file(path)
        page = eng.store.user_pages("bob")[0]["page_id"]
        real = _no_room(eng.store)
        try:
            eng.delete_page(page)
            assert _owed(path)
        finally:
            eng.store._db = real
    finally:
        eng.close()  # the rewrite due is done at close: the mark goes
    assert not _owed(path)

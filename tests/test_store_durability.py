"""When a SQLite store's commits reach the disk, and who folds the log back into the file.

Acknowledged pages are on disk before ``add_many`` returns, but the engine waits for the disk
after releasing its lock (``"deferred"`` + ``sync``); derived work and retrieval heat, which
can be redone or may be lost, commit without a flush (``"none"``); the write-ahead log is
checkpointed by a thread of the store's own, not inside the commits made under the engine
lock (:mod:`memoryos_gpu.store.wal`)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.embed import HashingEmbedder
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store import wal
from memoryos_gpu.store.sqlite import SQLiteStore
from memoryos_gpu.types import PageInput

FULL, NORMAL = 2, 1


def _synchronous(store: SQLiteStore) -> int:
    return int(store.query("PRAGMA synchronous")[0][0])


@pytest.mark.parametrize(
    ("durability", "inside"), [("commit", FULL), ("deferred", NORMAL), ("none", NORMAL)]
)
def test_each_durability_commits_as_said_and_the_next_transaction_is_synced(
    tmp_path: Path, durability: Any, inside: int
) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    try:
        with store.transaction(durability):
            assert _synchronous(store) == inside
            store.set_meta("k", durability)
        assert _synchronous(store) == FULL  # back to synced commits, for the next caller
        with pytest.raises(RuntimeError), store.transaction(durability):
            store.set_meta("k", "rolled back")
            raise RuntimeError("boom")
        assert _synchronous(store) == FULL and store.get_meta("k") == durability
        store.sync()  # the log is there to flush once anything was written
    finally:
        store.close()


def _engine(path: Path) -> MemoryEngine:
    memory = preset("paper", stm_capacity=2)
    return MemoryEngine(
        EngineConfig(store=str(path), memory=memory, auto_process=False),
        embedder=HashingEmbedder(),
    )


def test_pages_wait_for_the_disk_outside_the_engine_lock_and_derived_work_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add_many commits its pages ``"deferred"`` and flushes them before it returns, at a
    moment another thread can take the engine lock; derived work commits without a flush."""
    e = _engine(tmp_path / "store")
    kinds: list[str] = []
    flushes: list[bool] = []
    transaction, sync = e.store.transaction, e.store.sync

    def spy_transaction(durability: str = "commit") -> Any:
        kinds.append(durability)
        return transaction(durability)

    def spy_sync() -> None:
        free: list[bool] = []

        def take() -> None:  # another thread: can it take the engine lock now?
            if e._lock.acquire(timeout=5):
                e._lock.release()
                free.append(True)

        t = threading.Thread(target=take)
        t.start()
        t.join()
        flushes.append(bool(free))
        sync()

    monkeypatch.setattr(e.store, "transaction", spy_transaction)
    monkeypatch.setattr(e.store, "sync", spy_sync)
    try:
        pages = [PageInput("alice", f"I ran {k} km today", "nice", 1.7e9 + k) for k in range(6)]
        e.add_many(pages)
        assert kinds == ["deferred"] and flushes == [True]
        kinds.clear()
        assert e.process_pending()["pages"] == 4  # the STM overflow: chain, segments
        assert kinds and set(kinds) == {"none"} and flushes == [True]
    finally:
        monkeypatch.undo()
        e.close()


def test_the_log_is_checkpointed_by_the_store_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the commits' own autocheckpoint at the backstop, the log still stays small: the
    store's thread folds it back into the file once it passes CHECKPOINT_BYTES."""
    monkeypatch.setattr(wal, "CHECKPOINT_BYTES", 64 * 1024)
    monkeypatch.setattr(wal, "INTERVAL_S", 0.01)
    store = SQLiteStore(tmp_path / "s.db")
    try:
        assert store.query("PRAGMA wal_autocheckpoint") == [(wal.BACKSTOP_PAGES,)]
        log = str(tmp_path / "s.db-wal")
        biggest = 0
        for i in range(400):  # ~12 MB through the log, in commits of ~30 KB
            with store.transaction("none"):
                store.set_meta(f"k{i}", "x" * 30_000)
            biggest = max(biggest, os.path.getsize(log))
            if i % 20 == 0:
                time.sleep(0.03)  # the thread's turn
        assert store._checkpointer is not None and store._checkpointer.checkpoints > 0
        assert biggest < 6 * 1024 * 1024  # the backstop alone would let it reach ~64 MB
        assert store.get_meta("k399") == "x" * 30_000
    finally:
        store.close()
    assert not Path(log).exists()  # the last connection closed: log folded in and removed

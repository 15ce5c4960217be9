"""A write whose COMMIT meets a full disk costs a reload of the engine's memory (retrievals wait
for it); the writes after it are refused at once, without touching memory or the store, until
the disk has room again or a while has passed (:mod:`memoryos_gpu.engine.full_disk`).

A sweep of a server on a full tmpfs found every retried write reloading the whole memory:
retrieval p99 went from 8 ms to 0.89 s. A COMMIT that fails is simulated here: the store's
transaction rolls back and raises the StoreFullError a full disk gives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine, full_disk
from memoryos_gpu.store import StoreFullError

FULL = "store s: the disk is full (database or disk is full); the transaction was rolled back"


class _Disk:
    """The store's commits fail while ``full``; counts the transactions begun and the
    engine's reloads; ``free`` is what the probe reads of the store's file system."""

    def __init__(self, engine: MemoryEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full, self.begun, self.reloads, self.free = False, 0, 0, 10 << 20
        real_tx, real_reload = engine.store.transaction, engine._state.reload

        @contextlib.contextmanager
        def transaction(*a: Any, **k: Any) -> Iterator[Any]:
            self.begun += 1
            with real_tx(*a, **k) as db:
                yield db
                if self.full:  # the COMMIT: rolled back, as SQLite does on SQLITE_FULL
                    raise StoreFullError(FULL)

        def reload() -> None:
            self.reloads += 1
            real_reload()

        monkeypatch.setattr(engine.store, "transaction", transaction)
        monkeypatch.setattr(engine._state, "reload", reload)
        usage = type("Usage", (), {})

        def disk_usage(path: str) -> Any:
            u = usage()
            u.free = self.free
            return u

        monkeypatch.setattr(full_disk.shutil, "disk_usage", disk_usage)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[MemoryEngine]:
    cfg = EngineConfig(store=str(tmp_path / "store"), embedder="hashing", auto_process=False)
    with MemoryEngine(cfg) as e:
        e.add("u", "first page", "ok")
        yield e


def _add(e: MemoryEngine, text: str) -> None:
    e.add("u", text, "ok")


def test_writes_after_a_full_disk_commit_are_refused_without_a_reload(engine, monkeypatch):
    disk = _Disk(engine, monkeypatch)
    disk.full = True
    with pytest.raises(StoreFullError, match="disk is full"):
        _add(engine, "second page")
    assert disk.reloads == 1 and disk.begun == 1  # the failed COMMIT's reload
    embedded = engine.embedder.encode
    monkeypatch.setattr(engine.embedder, "encode", lambda *a, **k: pytest.fail("embedded"))
    for _ in range(5):  # retried: refused before the embeddings, memory or the store
        with pytest.raises(StoreFullError, match="not tried again"):
            _add(engine, "second page")
    monkeypatch.setattr(engine.embedder, "encode", embedded)
    assert disk.reloads == 1 and disk.begun == 1
    assert [p.user_input for p in engine.retrieve("u", "page").stm] == ["first page"]

    disk.full, disk.free = False, disk.free + full_disk.ROOM_BYTES  # space freed
    _add(engine, "second page")
    _add(engine, "third page")  # the gate is open again
    assert disk.begun == 3 and disk.reloads == 1
    assert [p.user_input for p in engine.retrieve("u", "page").stm] == [
        "first page",
        "second page",
        "third page",
    ]


def test_a_full_disk_is_tried_again_after_a_while_without_new_room(engine, monkeypatch):
    disk = _Disk(engine, monkeypatch)
    disk.full = True
    with pytest.raises(StoreFullError):
        _add(engine, "second page")
    clock = [full_disk.time.monotonic()]
    monkeypatch.setattr(full_disk.time, "monotonic", lambda: clock[0])
    with pytest.raises(StoreFullError, match="not tried again"):
        _add(engine, "second page")
    clock[0] += full_disk.RETRY_S  # no new room seen (a quota, a remote store): a try
    with pytest.raises(StoreFullError, match="disk is full") as info:
        _add(engine, "second page")
    assert "not tried again" not in str(info.value)
    assert disk.begun == 2 and disk.reloads == 2


def test_a_batch_refused_by_its_statements_arms_nothing(tmp_path: Path) -> None:
    """A full disk met by an accept's statements is undone in memory (no reload): the next
    write tries the store at once, so a write goes in as soon as there is room."""
    cfg = EngineConfig(store=str(tmp_path / "store"), embedder="hashing", auto_process=False)
    with MemoryEngine(cfg) as e:
        e.add("u", "first page", "ok")
        used = e.store.query("PRAGMA page_count")[0][0]
        e.store._db.execute(f"PRAGMA max_page_count = {used}")
        with pytest.raises(StoreFullError):
            e.add_many([{"user_id": "u", "user_input": "x " * 5000} for _ in range(20)])
        e.store._db.execute("PRAGMA max_page_count = 1000000000")
        e.add("u", "second page", "ok")
        assert [p.user_input for p in e.retrieve("u", "page").stm][-1] == "second page"

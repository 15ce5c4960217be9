"""A full disk under a SQLite store: the write that meets it fails whole with a
:class:`StoreFullError` that says so, the engine goes on serving what it had, and once there is
room the same write, the derived work or the ingest re-run goes in, nothing twice.

The disk is filled with SQLite's own page limit (``PRAGMA max_page_count``), which fails a
transaction exactly as a full disk does (``SQLITE_FULL``, "database or disk is full")."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store import StoreFullError
from memoryos_gpu.store.sqlite import SQLiteStore


def _pages(first: int, last: int) -> list[dict[str, Any]]:
    return [
        {"user_id": f"u{i % 3}", "user_input": f"page {i} " + "words " * 300, "source": f"s{i}"}
        for i in range(first, last)
    ]


def _fill(store: SQLiteStore, room_pages: int = 0) -> None:
    """No room beyond ``room_pages`` more database pages."""
    used = store.query("PRAGMA page_count")[0][0]
    store._db.execute(f"PRAGMA max_page_count = {used + room_pages}")


def _make_room(store: SQLiteStore) -> None:
    store._db.execute("PRAGMA max_page_count = 1000000000")


def _count(engine: MemoryEngine) -> int:
    return engine.store.query("SELECT COUNT(*) FROM pages")[0][0]


def test_a_write_on_a_full_disk_fails_whole_and_goes_in_once_there_is_room(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    with MemoryEngine(EngineConfig(store=str(store), embedder="hashing", auto_process=False)) as e:
        e.add_many(_pages(0, 20))
        e.process_pending()
        stm = [p.page_id for p in e.retrieve("u1", "page").stm]
        _fill(e.store)
        with pytest.raises(StoreFullError, match="disk is full") as info:
            e.add_many(_pages(20, 70))
        assert str(store) in str(info.value) and "rolled back" in str(info.value)
        assert _count(e) == 20  # nothing of the batch
        assert [p.page_id for p in e.retrieve("u1", "page").stm] == stm  # still serving
        _make_room(e.store)
        results = e.add_many(_pages(20, 70))
        assert not any(r.duplicate for r in results) and _count(e) == 70
        # derived work that meets a full disk stays pending, and is done once there is room
        _fill(e.store)
        pending = e.pending_count()
        assert pending > 0
        with pytest.raises(StoreFullError):
            e.process_pending()
        assert e.pending_count() == pending
        _make_room(e.store)
        e.process_pending()
        assert e.pending_count() == 0
    sources = SQLiteStore(store / "memory.sqlite3", writer=False).query(
        "SELECT COUNT(DISTINCT source), COUNT(*) FROM pages"
    )
    assert sources == [(70, 70)]


def test_a_write_on_a_full_disk_answers_507_without_the_servers_paths(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from served import hashing, serve

    engine = MemoryEngine(hashing(tmp_path / "store"))
    page = {"user_input": "I keep bees " + "and honey " * 200}
    with serve(engine, keys=None) as c:
        assert c.post("/v1/users/ann/pages", json=page).status_code == 201
        _fill(engine.store)
        r = c.post("/v1/users/ann/pages", json=page)
        assert r.status_code == 507, r.text
        assert r.json()["error"] == "insufficient_storage"
        assert str(tmp_path) not in r.text
        _make_room(engine.store)
        assert c.post("/v1/users/ann/pages", json=page).status_code == 201
        assert len(c.get("/v1/users/ann/pages").json()["pages"]) == 2
    engine.close()


def test_ingest_on_a_full_disk_says_so_and_a_rerun_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI prints the store's own message (no traceback), exits 1 with the batches before
    the full one committed, and the same command run again adds the rest."""
    from memoryos_gpu import cli

    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({**p, "agent_response": "ok"}) for p in _pages(0, 60)))
    store = tmp_path / "store"
    argv = ["ingest", str(chats), "--store", str(store), "--batch-size", "10", "--json"]
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    opened = SQLiteStore.__init__

    def small_disk(self: SQLiteStore, *args: Any, **kw: Any) -> None:
        opened(self, *args, **kw)
        if kw.get("writer", True):
            _fill(self, room_pages=40)  # about half the chats

    monkeypatch.setattr(SQLiteStore, "__init__", small_disk)
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert "error: store" in err and "disk is full" in err and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "run the same command again" in errors[0], err
    report = json.loads(out.strip().splitlines()[-1])  # --json ends stdout with the report
    assert "disk is full" in report["store_full"] and report["exit_code"] == 1
    reader = SQLiteStore(store / "memory.sqlite3", writer=False)
    kept = reader.query("SELECT COUNT(*) FROM pages")[0][0]
    reader.close()
    assert 0 < kept < 60 and kept % 10 == 0  # whole batches only
    assert report["accepted"] == kept

    monkeypatch.setattr(SQLiteStore, "__init__", opened)
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["accepted"], report["skipped"]) == (60 - kept, kept)


@pytest.mark.parametrize(
    ("code", "text", "said"),
    [
        (13, "database or disk is full", "the disk is full"),  # SQLITE_FULL
        (10 | (4 << 8), "disk I/O error", "disk I/O error"),  # SQLITE_IOERR_WRITE
        (8, "attempt to write a readonly database", "read-only"),  # SQLITE_READONLY
        (None, "database or disk is full", "the disk is full"),  # no code (SQLCipher's)
        (19, "UNIQUE constraint failed: pages.source", None),  # the engine's to handle
    ],
)
def test_what_the_machine_did_to_a_transaction_is_said_for_the_operator(
    tmp_path: Path, code: int | None, text: str, said: str | None
) -> None:
    """The store's error for each way the machine can fail a commit names the store and keeps
    SQLite's words; an error of the SQL itself passes through unchanged."""
    import sqlite3

    store = SQLiteStore(tmp_path / "s.db")
    failure = sqlite3.OperationalError(text)
    if code is not None:
        failure.sqlite_errorcode = code

    def fails() -> None:
        with store.transaction():
            raise failure

    try:
        with pytest.raises(Exception) as info:
            fails()
    finally:
        store.close()
    if said is None:
        assert info.value is failure
    else:
        assert said in str(info.value) and str(tmp_path) in str(info.value)
        assert text in str(info.value) and info.value.__cause__ is failure
        assert isinstance(info.value, StoreFullError) is (said == "the disk is full")


class _Clock(threading.Event):
    """An event whose waits return at once, recording how long they were asked to last, and
    calling ``hook(n)`` at the n-th; always set (due) when ``due``."""

    def __init__(self, hook: Any = None, due: bool = False) -> None:
        super().__init__()
        self.waits: list[float | None] = []
        self.hook = hook
        if due:
            self.set()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        if self.hook is not None:
            self.hook(len(self.waits))
        return self.is_set()


def test_a_servers_derived_work_on_a_full_disk_is_retried_ever_less_often(tmp_path: Path) -> None:
    """A round that meets a full disk is tried again after 1, 2, 4, ... s up to a minute, not
    every second (each failed round reloads the engine's memory under the lock retrievals wait
    for); once there is room the work is done, and the next failure starts at 1 s again."""
    pytest.importorskip("fastapi")
    from memoryos_gpu.server.service import DERIVED_RETRY_MAX_S, MemoryService
    from memoryos_gpu.server.settings import ServerSettings

    config = EngineConfig(store=str(tmp_path / "s"), embedder="hashing", auto_process=False)
    with MemoryEngine(config) as engine:
        service = MemoryService(engine, ServerSettings(derived_max_wait_ms=0))
        service.engine = engine
        service._derived_wake = _Clock(due=True)  # work is always due: no real waiting

        def backoff(stop_at: int, room_at: int = 0) -> list[float | None]:
            """The loop's waits after failures until the ``stop_at``-th; at the ``room_at``-th
            the disk gets room, and once the work is done new pages meet a full disk again."""

            def after_failure(n: int) -> None:
                if n == room_at:
                    _make_room(engine.store)
                if n == stop_at:
                    service._derived_stop.set()

            def before_round(_: int) -> None:
                if room_at and engine.pending_count() == 0 and len(stop.waits) == room_at:
                    engine.add_many(_pages(100, 130))
                    _fill(engine.store)

            service._derived_stop = stop = _Clock(after_failure)
            service._derived_wake = _Clock(before_round, due=True)
            service._derived_loop()
            return stop.waits

        engine.add_many(_pages(0, 30))
        _fill(engine.store)
        assert backoff(stop_at=9) == [1, 2, 4, 8, 16, 32, *[DERIVED_RETRY_MAX_S] * 3]
        assert engine.pending_count() > 0
        # room after the third failure: the round succeeds, and the next failure waits 1 s
        assert backoff(stop_at=5, room_at=3) == [1, 2, 4, 1, 2]

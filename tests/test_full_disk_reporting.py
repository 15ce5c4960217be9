"""A full disk met where its failure is not raised: the derived work an ``ingest`` owes (its
engine logs it and leaves it pending, ``MemoryEngine._process_owed``), the background WAL
checkpoint, and the server's engine close at shutdown. Each is said in one line: ``ingest``
exits 1 naming the full disk, the checkpoint and the shutdown log no traceback, and the server
still closes its store."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.ingest import ingest
from memoryos_gpu.store import StoreFullError
from memoryos_gpu.store import wal as wal_mod


def _chats(tmp_path: Path, n: int = 30) -> Path:
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "\n".join(
            json.dumps(
                {"user_id": f"u{i % 3}", "user_input": f"page {i} words", "agent_response": "ok"}
            )
            for i in range(n)
        )
    )
    return chats


def _full_disk_derived(monkeypatch: pytest.MonkeyPatch, store: Path) -> None:
    """Derived work meets a full disk (as the store raises it); pages still commit."""

    def full(self: MemoryEngine, *a: Any, **kw: Any) -> dict[str, int]:
        raise StoreFullError.met(str(store), sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setattr(MemoryEngine, "process_pending", full)


def test_ingest_whose_derived_work_meets_a_full_disk_exits_1_and_says_it_stays_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from memoryos_gpu import cli

    chats, store = _chats(tmp_path), tmp_path / "store"
    argv = ["ingest", str(chats), "--store", str(store), "--batch-size", "10", "--json"]
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    original = MemoryEngine.process_pending
    _full_disk_derived(monkeypatch, store)
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    assert report["accepted"] == 30 and report["pending"] > 0
    assert report["derived_failure"] == "disk_full" and report["exit_code"] == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    assert "disk is full" in lines[0] and "stays pending" in lines[0]
    assert "space is freed" in lines[0] and "Traceback" not in err
    assert "derived work failed: the disk is full" in err  # the summary's status

    # with room again the same command does the work and ends clean
    monkeypatch.setattr(MemoryEngine, "process_pending", original)
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["pending"] == 0 and report["derived_failure"] is None
    assert (report["skipped"], report["exit_code"]) == (30, 0)


def test_ingest_library_report_counts_only_this_runs_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chats, store = _chats(tmp_path), tmp_path / "store"
    cfg = EngineConfig(store=str(store), embedder="hashing")
    # a deferred run expects no derived work: pending, but no failure
    r = ingest([str(chats)], cfg, process="defer", reject_log=open("/dev/null", "w"))  # noqa: SIM115
    assert r.pending > 0 and r.derived_failure is None and r.exit_code == 0
    # its work meets a full disk when the next run opens the store: this run's failure
    _full_disk_derived(monkeypatch, store)
    r = ingest([str(chats)], cfg)
    assert (r.skipped, r.derived_failure, r.exit_code) == (30, "disk_full", 1)
    assert r.to_dict()["exit_code"] == 1
    monkeypatch.undo()
    # a caller's engine that failed before this run: not this run's failure
    engine = MemoryEngine(cfg)
    engine.counters["derived_disk_full"] = 5  # an earlier failure of the caller's
    try:
        engine.store.count_pending = lambda: 3  # type: ignore[method-assign]
        r = ingest([str(chats)], engine)
        assert r.derived_failure is None and r.exit_code == 0
    finally:
        del engine.store.count_pending
        engine.close()


def _checkpointer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: Exception) -> Any:
    monkeypatch.setattr(wal_mod, "CHECKPOINT_BYTES", 0)
    wal = tmp_path / "memory.sqlite3-wal"
    wal.write_bytes(b"x")

    class Db:
        def execute(self, sql: str) -> Any:
            raise exc

        def close(self) -> None:
            pass

    return wal_mod.WalCheckpointer(Db(), str(wal), interval_s=0.01)


@pytest.mark.parametrize(
    ("exc", "traceback"),
    [
        (sqlite3.OperationalError("database or disk is full"), False),
        (StoreFullError("store x: the disk is full"), False),
        (RuntimeError("a bug"), True),  # unexpected: the traceback is kept
    ],
)
def test_a_failed_background_checkpoint_is_one_line_for_a_full_disk(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    exc: Exception,
    traceback: bool,
) -> None:
    caplog.set_level(logging.WARNING, logger="memoryos_gpu.store")
    cp = _checkpointer(tmp_path, monkeypatch, exc)
    try:
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        cp.close()
    rec = [r for r in caplog.records if "background checkpoint" in r.getMessage()]
    assert rec, caplog.text
    assert (rec[0].exc_info is not None) is traceback
    if not traceback:
        assert "disk is full" in rec[0].getMessage()


def test_server_shutdown_on_a_full_disk_logs_one_line_and_closes_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("fastapi")
    from memoryos_gpu.server.service import MemoryService
    from memoryos_gpu.server.settings import ServerSettings

    store = tmp_path / "store"
    made: list[MemoryEngine] = []

    def make() -> MemoryEngine:
        e = MemoryEngine(EngineConfig(store=str(store), embedder="hashing", auto_process=False))
        made.append(e)
        return e

    async def scenario() -> None:
        svc = MemoryService(make, ServerSettings(derived_max_wait_ms=0))
        await svc.start()
        engine = made[0]

        def full() -> None:
            raise StoreFullError.met(
                str(store), sqlite3.OperationalError("database or disk is full")
            )

        engine._derived.save_extractor = full  # type: ignore[method-assign]
        await asyncio.wait_for(svc.close(), 60)  # no StoreFullError out of the lifespan
        assert "last writes failed: the disk is full" in svc.closed_message

    caplog.set_level(logging.WARNING, logger="memoryos_gpu.server")
    asyncio.run(scenario())
    assert made[0]._state.closed  # the store was closed all the same
    rec = [r for r in caplog.records if "last writes" in r.getMessage()]
    assert len(rec) == 1 and rec[0].exc_info is None
    assert "disk is full" in rec[0].getMessage()

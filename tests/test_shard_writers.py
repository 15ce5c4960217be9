"""Shard stores held by another writer, refused before Ray starts (``shard_writers``).

``ingest --ray`` run again right after its driver was killed: the killed run's shard actors
(Ray workers) still hold their stores while they finish the chunk in flight, and the re-run was
refused once, with the advice meant for a running server. It now waits for such a holder, and
names one that does not let go as a Ray worker. Another holder is refused at once, as before.
``serve --ray`` on a held store was refused only after Ray had started (15-25 s), by a shard
replica, in Ray's log; it is now refused before. No Ray here: the holder is a process whose
program name is a Ray worker's, or the CLI's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed import shard_writers
from memoryos_gpu.store.writer import StoreLockedError

HOLD = """
import sys, time
from memoryos_gpu.store.writer import SQLiteWriterLock
lock = SQLiteWriterLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(tmp_path: Path, program: str, db: Path, seconds: float) -> subprocess.Popen:
    """A process named ``program`` holding ``db``'s writer claim for ``seconds``."""
    script = tmp_path / program
    script.write_text(HOLD, encoding="utf-8")
    p = subprocess.Popen(
        [sys.executable, str(script), str(db), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _shard_db(tmp_path: Path) -> tuple[Path, Path]:
    store = tmp_path / "store"
    db = store / "shard-1" / "memory.sqlite3"
    db.parent.mkdir(parents=True)
    db.touch()
    return store, db


def test_a_stopped_runs_shard_actor_is_waited_for(tmp_path: Path) -> None:
    store, db = _shard_db(tmp_path)
    p = _holder(tmp_path, "default_worker.py", db, 3.0)  # held 3 s: room for a stall
    try:
        t0 = time.monotonic()
        shard_writers.check_shard_writers(str(store), 2)  # was: StoreLockedError at once
        assert time.monotonic() - t0 >= 0.5
    finally:
        p.kill()
        p.wait()


def test_a_ray_worker_that_keeps_the_store_is_named_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, db = _shard_db(tmp_path)
    monkeypatch.setattr(shard_writers, "ACTOR_WAIT_S", 0.5)
    p = _holder(tmp_path, "default_worker.py", db, 60)
    try:
        with pytest.raises(StoreLockedError, match="by a Ray worker, pid") as caught:
            shard_writers.check_shard_writers(str(store), 2)
        assert "earlier `ingest --ray`" in str(caught.value) and "ray stop" in str(caught.value)
        assert "POST /v1/pages" not in str(caught.value)  # not a server's advice
    finally:
        p.kill()
        p.wait()


def test_another_holder_is_refused_at_once(tmp_path: Path) -> None:
    store, db = _shard_db(tmp_path)
    p = _holder(tmp_path, "memoryos-gpu", db, 60)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreLockedError, match="POST /v1/pages"):
            shard_writers.check_shard_writers(str(store), 2)
        assert time.monotonic() - t0 < shard_writers.ACTOR_WAIT_S / 2
    finally:
        p.kill()
        p.wait()


def test_serve_ray_refuses_a_held_shard_before_ray_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray")
    from memoryos_gpu.distributed import ray_serve

    store, db = _shard_db(tmp_path)
    (store / "shards.json").write_text('{"count": 2}', encoding="utf-8")

    def no_ray(*_a: object, **_k: object) -> None:
        raise AssertionError("Ray was started for a store that is held")

    monkeypatch.setattr(ray_serve, "ensure_ray", no_ray)
    p = _holder(tmp_path, "memoryos-gpu", db, 60)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreLockedError, match="POST /v1/pages"):
            ray_serve.run(EngineConfig(store=str(store), embedder="hashing"), 2, blocking=False)
        assert time.monotonic() - t0 < shard_writers.ACTOR_WAIT_S / 2
    finally:
        p.kill()
        p.wait()

"""``ingest --ray`` run again right after its driver was killed: the killed run's shard actors
(Ray workers) still hold their stores while they finish the chunk in flight, and the re-run was
refused once, with the advice meant for a running server. It now waits for such a holder, and
names one that does not let go as a Ray worker. Another holder is refused at once, as before.
No Ray here: the holder is a process whose program name is a Ray worker's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from memoryos_gpu.distributed import ray_ingest
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
    p = _holder(tmp_path, "default_worker.py", db, 1.0)
    try:
        t0 = time.monotonic()
        ray_ingest._check_writers(str(store), 2)  # was: StoreLockedError at once
        assert time.monotonic() - t0 >= 0.5
    finally:
        p.kill()
        p.wait()


def test_a_ray_worker_that_keeps_the_store_is_named_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, db = _shard_db(tmp_path)
    monkeypatch.setattr(ray_ingest, "ACTOR_WAIT_S", 0.5)
    p = _holder(tmp_path, "default_worker.py", db, 60)
    try:
        with pytest.raises(StoreLockedError, match="by a Ray worker, pid") as caught:
            ray_ingest._check_writers(str(store), 2)
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
            ray_ingest._check_writers(str(store), 2)
        assert time.monotonic() - t0 < ray_ingest.ACTOR_WAIT_S / 2
    finally:
        p.kill()
        p.wait()

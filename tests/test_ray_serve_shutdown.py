"""``serve --ray`` shuts its shards down cleanly: each shard saves its keyword statistics and
closes its store, after a last exchange with the other shards.

Why: the shard replicas never closed their engines, so the statistics were never saved; on a
per-shard SQLite store a reopened shard then refitted only its own pages of the session, and
lost the other shards' for good (1202 and 1204 documents instead of 1206 on both).

``serve --ray`` stopped by SIGTERM exits 0 after that shutdown, as plain ``serve`` does. Why:
``ray.init`` puts abseil's failure handler in front of Ray's SIGTERM handler, and it arms a
3-second abort: a shutdown that took longer died of SIGABRT (exit -6).

Local Ray (``ray.init(num_cpus=2)``), 2 shards, a few pages; skipped without Ray Serve.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_distributed import _free_port, _start_serve

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.layout import ShardMap
from memoryos_gpu.distributed.sharding import ShardedEngine

pytest.importorskip("ray.serve", reason="Ray Serve is not installed")

PAGES = [
    {
        "user_id": f"u{i}",
        "user_input": f"I collect rare stamps from country {i}",
        "agent_response": "Stamps!",
    }
    for i in range(6)
]


def _config(store: Path) -> EngineConfig:
    return EngineConfig(store=str(store), embedder="hashing", device="cpu")


def _wait_ready(c: Any, proc: subprocess.Popen | None = None, timeout: float = 180.0) -> None:
    """Until the app answers ``/ready`` with 200 (the router answers 503 until every shard has
    loaded; nothing answers while Serve starts), or the serving process ``proc`` has ended."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        with contextlib.suppress(httpx.TransportError):
            if c.get("/ready").status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"not ready within {timeout:.0f} s, or the server ended")


def _write_pages(port: int) -> None:
    """Wait for the app, then add :data:`PAGES` (both shards get some)."""
    import httpx

    assert {ShardMap(2).shard(p["user_id"]) for p in PAGES} == {0, 1}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        _wait_ready(c)
        r = c.post("/v1/pages", json={"pages": PAGES})
        assert r.status_code == 201, r.text


def _saved_statistics(store: Path) -> list[dict[str, Any]]:
    """Each shard's saved keyword statistics (``{}`` where none were saved)."""
    out = []
    for i in range(2):
        db = sqlite3.connect(store / f"shard-{i}" / "memory.sqlite3")
        try:
            row = db.execute("SELECT value FROM meta WHERE key = 'keyword_extractor'").fetchone()
        finally:
            db.close()
        out.append(json.loads(row[0]) if row else {})
    return out


def _reopened_documents(store: Path) -> list[int]:
    engine = ShardedEngine(_config(store), shards=2)
    try:
        return [e.extractor.n_docs for e in engine.engines]
    finally:
        engine.close()


def test_cli_serve_ray_exits_0_on_sigterm(tmp_path: Path) -> None:
    """``memoryos-gpu serve --ray`` (its own local Ray) stopped by SIGTERM once it answers:
    the shards close in order and the process exits 0, as plain ``serve`` does (was: -6,
    SIGABRT, 3 s after the signal, from the abort abseil's SIGTERM handler arms)."""
    import httpx

    port = _free_port()
    env = {**os.environ, "MEMORYOS_GPU_EMBEDDER": "hashing", "RAY_ADDRESS": "local"}
    args = ["serve", "--ray", "--shards", "2", "--store", str(tmp_path / "s"), "--port", str(port)]
    log = (tmp_path / "stderr.txt").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "memoryos_gpu", *args, "--device", "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=env,
        start_new_session=True,  # its Ray processes too: killed together if it hangs
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            _wait_ready(c, proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        # what is left of its session (all of it if it hangs; Ray's processes if it died)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.seek(0)
        err = log.read()
        log.close()
    assert code == 0, err[-4000:]
    assert "shards closed" in err, err[-4000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_ray_stopped_saves_every_shards_statistics_after_a_last_exchange(
    ray_local: Any, tmp_path: Path, sig: signal.Signals
) -> None:
    """``run`` stopped by Ctrl-C or SIGTERM returns after its shutdown: every shard's
    statistics count every page, the other shard's included. No periodic sync runs (a 1-hour
    interval): the last exchange is the shutdown's."""
    from ray import serve

    from memoryos_gpu.distributed import ray_serve

    store = tmp_path / "store"
    port = _start_serve(serve)
    failed: list[BaseException] = []

    def write_then_signal() -> None:  # beside run(): write, then the signal
        try:
            _write_pages(port)
        except BaseException as exc:  # reported by the test, after run() has stopped
            failed.append(exc)
        os.kill(os.getpid(), sig)

    writer = threading.Thread(target=write_then_signal, daemon=True)
    writer.start()
    try:
        ray_serve.run(_config(store), 2, port=port, sync_interval_s=3600.0)
    finally:
        serve.shutdown()
    writer.join(10)
    assert not failed, failed
    saved = _saved_statistics(store)
    assert [s.get("n_docs") for s in saved] == [len(PAGES)] * 2, saved
    assert _reopened_documents(store) == [len(PAGES)] * 2


def test_deleted_serve_app_closes_its_shards(ray_local: Any, tmp_path: Path) -> None:
    """``serve run`` / ``serve delete`` (no router-led end): each replica's shutdown hook still
    saves its statistics and closes its store. Its own pages at least: the router's own last
    sync, as it stops beside the shards, may or may not reach them in time."""
    from ray import serve

    from memoryos_gpu.distributed.ray_serve import APP_NAME, build_app

    store = tmp_path / "store"
    port = _start_serve(serve)
    try:
        app = build_app(_config(store), 2, sync_interval_s=3600.0)
        serve.run(app, name=APP_NAME, route_prefix="/")
        _write_pages(port)
        serve.delete(APP_NAME)
    finally:
        serve.shutdown()
    own = [sum(ShardMap(2).shard(p["user_id"]) == i for p in PAGES) for i in range(2)]
    saved = _saved_statistics(store)
    assert all(
        mine <= (s.get("n_docs") or 0) <= len(PAGES) for mine, s in zip(own, saved, strict=True)
    ), saved
    assert [s.get("page_watermark") for s in saved] == own, saved

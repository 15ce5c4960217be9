"""``serve --ray`` shuts its shards down cleanly: each shard saves its keyword statistics and
closes its store, after a last exchange with the other shards.

Why: the shard replicas never closed their engines, so the statistics were never saved; on a
per-shard SQLite store a reopened shard then refitted only its own pages of the session, and
lost the other shards' for good (1202 and 1204 documents instead of 1206 on both).

Local Ray (``ray.init(num_cpus=2)``), 2 shards, a few pages; skipped without Ray Serve.
"""

from __future__ import annotations

import json
import sqlite3
import types
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from test_distributed import _start_serve

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


def _write_pages(port: int) -> None:
    """Wait for the app, then add :data:`PAGES` (both shards get some)."""
    import time

    import httpx

    assert {ShardMap(2).shard(p["user_id"]) for p in PAGES} == {0, 1}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        for _ in range(240):  # the router answers 503 until every shard has loaded
            if c.get("/ready").status_code == 200:
                break
            time.sleep(0.5)
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


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_serve_ray_stopped_saves_every_shards_statistics_after_a_last_exchange(
    ray_local: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: type[BaseException]
) -> None:
    """``run`` stopped by Ctrl-C (KeyboardInterrupt) or SIGTERM (Ray's driver handler raises
    SystemExit): every shard's statistics count every page, the other shard's included. No
    periodic sync runs (a 1-hour interval): the last exchange is the shutdown's."""
    from ray import serve

    from memoryos_gpu.distributed import ray_serve

    store = tmp_path / "store"
    port = _start_serve(serve)

    def serve_a_while(_seconds: float) -> None:  # run()'s wait: write, then the signal
        _write_pages(port)
        raise stop(15) if stop is SystemExit else stop()

    monkeypatch.setattr(ray_serve, "time", types.SimpleNamespace(sleep=serve_a_while))
    try:
        with pytest.raises(SystemExit) if stop is SystemExit else nullcontext():
            ray_serve.run(_config(store), 2, port=port, sync_interval_s=3600.0)
    finally:
        serve.shutdown()
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

"""``memoryos-gpu stats`` counts the store's write-ahead log in its size: committed pages stay
in ``memory.sqlite3-wal`` until a checkpoint, so the database file alone under-reports a store
that a server (or an ingest that just ended) writes."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runs import run_cli

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine


def test_stats_bytes_count_the_write_ahead_log(tmp_path: Path) -> None:
    store = tmp_path / "st"
    config = EngineConfig(store=str(store), embedder="hashing", device="cpu", auto_process=False)
    with MemoryEngine(config) as engine:  # open: its commits are still in the log
        engine.add_many(
            [{"user_id": f"u{i % 4}", "user_input": f"page {i} " + "w " * 200} for i in range(60)]
        )
        db = store / "memory.sqlite3"
        wal = store / "memory.sqlite3-wal"
        assert wal.stat().st_size > 0
        res = run_cli("stats", "--store", store, "--json")
        assert res.exit_code == 0, res.output
        data = json.loads(res.output)
        assert data["log_bytes"] == wal.stat().st_size
        assert data["bytes"] == db.stat().st_size + wal.stat().st_size
        res = run_cli("stats", "--store", store)
        assert res.exit_code == 0, res.output
        store_line = next(line for line in res.output.splitlines() if line.startswith("store"))
        assert " log)" in store_line and " + " in store_line, store_line
    res = run_cli("stats", "--store", store, "--json")  # closed: checkpointed, no log left
    data = json.loads(res.output)
    assert data["log_bytes"] == 0 and data["bytes"] == (store / "memory.sqlite3").stat().st_size
    assert " log" not in run_cli("stats", "--store", store).output

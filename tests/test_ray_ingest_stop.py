"""A stop (Ctrl-C, SIGTERM) that reaches ``ingest --ray`` while its shard actors run the
derived work: each actor finishes the round in flight and leaves the rest pending for the next
run, as docs/cli.md says of a stopped run (one ``process_pending`` call for all of it ran to
the end whatever the signal). No Ray: the actor's class is used directly."""

from __future__ import annotations

from pathlib import Path

import pytest

from memoryos_gpu import EngineConfig, PageInput
from memoryos_gpu.distributed.ray_ingest import ShardIngestActor


def _actor(tmp_path: Path) -> ShardIngestActor:
    cfg = EngineConfig(store=str(tmp_path / "shard-0"), embedder="hashing", derived_max_batch=8)
    actor = ShardIngestActor(cfg.model_dump(), 0, 1)
    pages = [PageInput(f"u{i % 10}", f"page {i} about topic {i % 7}", "ok") for i in range(200)]
    actor.engine.add_many(pages)  # held back: the actor's engine derives nothing until process
    return actor


def test_a_stop_during_the_derived_work_leaves_the_rest_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    actor = _actor(tmp_path)
    engine = actor.engine
    before = engine.pending_count()
    real = engine._process_pages
    rounds: list[int] = []

    def one_round_then_stop(items: list) -> int:
        rounds.append(len(items))
        actor.stop()  # the driver's stop arrives while the first round runs
        return real(items)

    monkeypatch.setattr(engine, "_process_pages", one_round_then_stop)
    done = actor.process()
    assert len(rounds) == 1 and done["pages"] == rounds[0]
    assert 0 < engine.pending_count() < before  # the rest waits for the next run


def test_without_a_stop_the_derived_work_runs_to_the_end(tmp_path: Path) -> None:
    actor = _actor(tmp_path)
    done = actor.process()
    assert done["pages"] > 0 and actor.engine.pending_count() == 0

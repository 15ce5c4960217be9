"""``ingest --ray`` whose derived work meets a full disk (or another store failure): the shard
actor leaves the work pending and counts the failure instead of raising it through Ray (the
driver lost its report: no pending count, no 'work stays pending' line), and the run's report
names it (``derived_failure``) and exits 1, as a single process's ingestion does. The actor
class is a plain class (Ray wraps it), so this needs no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.ray_ingest import ShardIngestActor, derived_failure_of
from memoryos_gpu.ingest import IngestReport
from memoryos_gpu.store import StoreError, StoreFullError


@pytest.mark.parametrize(
    ("error", "kind"),
    [(StoreFullError("disk full"), "disk_full"), (StoreError("database is locked"), "store_error")],
)
def test_a_shards_store_failure_is_counted_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: StoreError, kind: str
) -> None:
    cfg = EngineConfig(store=str(tmp_path / "shard-0"), embedder="hashing", device="cpu")
    actor = ShardIngestActor(cfg.model_dump(), 0, 1)
    try:
        assert actor.process() == {"pages": 0, "promotions": 0}  # nothing pending: no failure

        def fail(*args: object, **kw: object) -> dict[str, int]:
            raise error

        monkeypatch.setattr(actor.engine, "process_pending", fail)
        counts = actor.process()
    finally:
        actor.close()
    assert derived_failure_of(counts) == kind
    report = IngestReport(derived_failure=derived_failure_of(counts))
    assert report.exit_code == 1
    assert derived_failure_of({"pages": 3, "promotions": 1}) is None

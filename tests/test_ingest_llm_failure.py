"""``ingest`` whose derived work fails because the LLM cannot be used (a server down, failing
every request, its circuit breaker open: ``LLMBackendError``). The pages are committed and the
work stays pending, as for a store failure; the run used to say "status done" and exit 0, so a
script checking ``$?`` took the LLM analysis for done. Now it names the cause
(``derived_failure`` ``"llm_unavailable"``), prints one ``error:`` line and exits 1, in one
process and with ``--ray`` (whose shard actor counts the failure instead of raising it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.ray_ingest import ShardIngestActor, derived_failure_of
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.ingest import IngestReport
from memoryos_gpu.llm.base import LLMBackendError

DOWN = "cannot connect to the LLM server at http://127.0.0.1:9/v1: unreachable"


def _llm_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """Derived work fails as an LLM-mode engine's does with its server down."""

    def down(self: MemoryEngine, *a: Any, **kw: Any) -> dict[str, int]:
        raise LLMBackendError(DOWN)

    monkeypatch.setattr(MemoryEngine, "process_pending", down)


def test_ingest_whose_llm_is_down_exits_1_with_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from memoryos_gpu import cli

    chats, store = tmp_path / "chats.jsonl", tmp_path / "store"
    chats.write_text(
        "\n".join(
            json.dumps({"user_id": f"u{i % 3}", "user_input": f"page {i}", "agent_response": "ok"})
            for i in range(30)
        )
    )
    argv = ["ingest", str(chats), "--store", str(store), "--batch-size", "10", "--json"]
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    original = MemoryEngine.process_pending
    _llm_down(monkeypatch)
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    assert report["accepted"] == 30 and report["pending"] > 0
    assert (report["derived_failure"], report["exit_code"]) == ("llm_unavailable", 1)
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert "the LLM could not be used" in line and "stays pending" in line
    assert "resumes once the LLM answers" in line and "Traceback" not in err
    assert "derived work failed: the LLM could not be used" in " ".join(err.split())  # table

    # the LLM back: the same command does the work and ends clean
    monkeypatch.setattr(MemoryEngine, "process_pending", original)
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["pending"], report["derived_failure"], report["exit_code"]) == (0, None, 0)


def test_a_ray_shards_llm_failure_is_counted_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor is a plain class (Ray wraps it): no Ray needed."""
    cfg = EngineConfig(store=str(tmp_path / "shard-0"), embedder="hashing", device="cpu")
    actor = ShardIngestActor(cfg.model_dump(), 0, 1)
    try:
        _llm_down(monkeypatch)
        counts = actor.process()  # raised through Ray before: the driver lost its report
    finally:
        actor.close()
    assert counts == {"derived_llm_failures": 1}
    assert derived_failure_of(counts) == "llm_unavailable"
    assert IngestReport(derived_failure=derived_failure_of(counts)).exit_code == 1

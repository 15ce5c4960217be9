"""``ingest --ray`` whose store's disk fills (or whose store goes away) while pages are accepted:
the run ends with its report (``store_full`` / ``store_unavailable``, exit 1, no derived work),
as a single process's ingestion does, instead of the shard actor's error escaping with no
report; and ``ingest --workers`` keeps a shard's ``store_full`` in its merged report. The Ray
calls are faked (the driver's control flow is what is tested), so this needs no Ray."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.cli.ingest import _merge, _store_full_line
from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed import ray_ingest
from memoryos_gpu.ingest import IngestReport, resolve_formats
from memoryos_gpu.stop_signals import StopSignals
from memoryos_gpu.store.errors import StoreFullError, StoreUnavailableError


class _RayError(Exception):
    """Ray's wrapper of a remote error (``cause``: what the actor raised)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__("remote traceback ...")
        self.cause = cause


class _Call:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Actor:
    """A shard actor as the driver calls it; ``summary`` fails when ``down``."""

    def __init__(self, down: bool) -> None:
        self.derived = False
        self.page_watermark = _Call(lambda: 0)
        self.exchange_marks = _Call(lambda tops: [0] * len(tops))
        self.summary = _Call(self._summary if not down else self._down)
        self.process = _Call(self._process)

    def _summary(self) -> dict[str, Any]:
        return {**ray_ingest._NO_SUMMARY, "store_counts": {"pages": 4}, "batches": 1}

    def _down(self) -> dict[str, Any]:
        raise _RayError(StoreUnavailableError("server closed the connection"))

    def _process(self) -> dict[str, int]:
        self.derived = True
        return {"pages": 0, "promotions": 0}


def _fake_ray() -> Any:
    def get(x: Any) -> Any:
        return x

    return types.SimpleNamespace(
        get=get, kill=lambda a: None, exceptions=types.SimpleNamespace(RayError=_RayError)
    )


def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException, down: bool
) -> tuple[dict[str, Any], IngestReport, _Actor]:
    src = tmp_path / "chats.jsonl"
    src.write_text(
        "".join(
            json.dumps({"user_id": f"u{i}", "user_input": "hello there", "agent_response": "hi"})
            + "\n"
            for i in range(6)
        )
    )
    actor = _Actor(down)
    res = types.SimpleNamespace(gpus=0.0, cpus=0.5)
    monkeypatch.setattr(ray_ingest, "shard_resources", lambda *a, **kw: res)
    monkeypatch.setattr(ray_ingest, "_start_actors", lambda *a, **kw: [actor])

    def fails(*args: Any) -> Any:
        raise _RayError(error)

    monkeypatch.setattr(ray_ingest, "_run_window", fails)
    ray = _fake_ray()
    run = ray_ingest._Run(ray, "t", 1, 10, None, ray_ingest._Stop())
    report = IngestReport(store=str(tmp_path / "st"))
    cfg = EngineConfig(store=str(tmp_path / "st"), embedder="hashing", device="cpu")
    files = dict(resolve_formats([str(src)], "auto"))
    out = ray_ingest._ingest(run, cfg, files, report, None, None, 100, None)
    return out, report, actor


def test_a_full_disk_ends_the_ray_run_with_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = StoreFullError("store st/shard-0: the disk is full")
    out, report, actor = _run(tmp_path, monkeypatch, full, down=False)
    assert out["store_full"] == str(full) and report.exit_code == 1
    assert out["exit_code"] == 1 and not actor.derived  # no derived work after it
    assert out["store_counts"] == {"pages": 4}
    assert _store_full_line(out) is not None


def test_a_store_gone_ends_the_run_with_its_report_though_no_summary_can_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = StoreUnavailableError("server closed the connection")
    out, _, actor = _run(tmp_path, monkeypatch, gone, down=True)
    assert out["store_unavailable"] == str(gone) and out["exit_code"] == 1
    assert out["store_counts"] == {} and not actor.derived


def test_any_other_shard_error_is_still_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(_RayError):
        _run(tmp_path, monkeypatch, ValueError("a bug"), down=False)


def test_ingest_workers_keeps_a_shards_store_full_in_its_merged_report(tmp_path: Path) -> None:
    full = "store st/shard-1: the disk is full"
    reports = [
        {"shard": "0/2", "accepted": 5, "exit_code": 0},
        {"shard": "1/2", "accepted": 2, "exit_code": 1, "store_full": full},
    ]
    procs: list[Any] = [types.SimpleNamespace(returncode=r["exit_code"]) for r in reports]
    outputs = [json.dumps(r).encode() + b"\n" for r in reports]
    merged = _merge(procs, outputs, StopSignals(), [], tmp_path, 2, None, 0.0)
    assert merged["store_full"] == full and merged["exit_code"] == 1
    line = _store_full_line(merged)
    assert line is not None and "7 page(s) accepted" in line

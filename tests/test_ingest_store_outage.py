"""An ``ingest`` whose store goes away mid-run (PostgreSQL down: ``StoreUnavailableError`` from
``add_many``) ends with its report: what was committed before the outage, the cause, a
non-zero exit; and the driver's pool does not flood stderr with its reconnection lines.

The outage is a patched ``MemoryEngine.add_many`` that raises after N batches, as the
PostgreSQL store raises once its server is gone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from memoryos_gpu.cli import cli
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.ingest import ingest
from memoryos_gpu.store.errors import StoreUnavailableError

CAUSE = "no connection to store postgresql://x@db/m within 1 s (server down or unreachable)"


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    monkeypatch.delenv("MEMORYOS_GPU_KEY", raising=False)


def _chats(tmp_path: Path, n: int = 10) -> Path:
    chats = tmp_path / "in.jsonl"
    rows = [{"user_id": f"u{i}", "user_input": f"hi {i}", "agent_response": "ok"} for i in range(n)]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return chats


def _outage_after(monkeypatch: pytest.MonkeyPatch, batches: int) -> None:
    real, calls = MemoryEngine.add_many, []

    def add_many(self: MemoryEngine, pages: list, *a: object, **k: object) -> list:
        calls.append(len(pages))
        if len(calls) > batches:
            raise StoreUnavailableError(CAUSE)
        return real(self, pages, *a, **k)

    monkeypatch.setattr(MemoryEngine, "add_many", add_many)


def test_the_api_returns_the_report_with_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _outage_after(monkeypatch, batches=2)
    from memoryos_gpu.config import EngineConfig

    cfg = EngineConfig(store=str(tmp_path / "store"), embedder="hashing")
    report = ingest(_chats(tmp_path), cfg, batch_size=3, progress=False)
    assert report.accepted == 6  # two batches committed, the third failed
    assert report.store_unavailable == CAUSE
    assert report.exit_code == 1
    assert report.to_dict()["store_unavailable"] == CAUSE


def test_ingest_json_prints_the_report_and_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _outage_after(monkeypatch, batches=1)
    store = tmp_path / "store"
    args = ["ingest", str(_chats(tmp_path)), "--store", str(store), "--no-progress"]
    res = CliRunner().invoke(cli, [*args, "--json", "--batch-size", "4"])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    report = json.loads(lines[-1])  # the last stdout line is the JSON report
    assert report["accepted"] == 4
    assert report["store_unavailable"] == CAUSE
    assert report["exit_code"] == 1
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1
    assert CAUSE in errors[0] and "4 page(s) accepted before it are committed" in errors[0]
    assert "run the same command again" in errors[0]
    # resumed once the store answers: the committed pages are skipped, the rest accepted
    monkeypatch.undo()
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    again = CliRunner().invoke(cli, [*args, "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout.splitlines()[-1])["skipped"] == 4


def test_the_pool_log_is_quiet_and_its_cause_kept(caplog: pytest.LogCaptureFixture) -> None:
    from memoryos_gpu.cli.ingest import _PoolLog

    caplog.set_level(logging.DEBUG)
    pool = logging.getLogger("psycopg.pool")
    with _PoolLog() as log:
        for _ in range(17):
            pool.warning(
                "error connecting in 'memoryos-gpu': connection failed: connection to server "
                'at "127.0.0.1", port 5432 failed: Connection refused\n\tIs the server running?'
            )
        pool.info("discarding closed connection: <psycopg_pool._PooledConnection [BAD]>")
        logging.getLogger("psycopg").warning("error ignored terminating <psycopg.Pipeline [BAD]>")
        pool.error("a pool error worth seeing")
    assert [r.getMessage() for r in caplog.records] == ["a pool error worth seeing"]
    said = log.with_cause(CAUSE)
    assert said.startswith(CAUSE) and said.endswith("Connection refused Is the server running?")
    pool.warning("error connecting in 'x': connection failed: after the run")
    assert "after the run" in caplog.records[-1].getMessage()  # the filter went with the block

"""``ingest --timezone``: a timestamp written without a zone (BAI-LAB MemoryOS wrote its local
time as ``%Y-%m-%d %H:%M:%S``) is read in the zone given, so pages migrated from it line up with
the pages the compat facade adds (which reads such stamps as local time); a timestamp with an
offset, or in epoch seconds, names its instant already and is unchanged."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from memoryos_gpu.cli import cli
from memoryos_gpu.config import EngineConfig, LLMConfig
from memoryos_gpu.formats import parse_timestamp
from memoryos_gpu.formats.timestamps import naive_zone
from memoryos_gpu.ingest import ingest

NAIVE = "2025-01-01 04:00:00"
AS_UTC = datetime(2025, 1, 1, 4, tzinfo=UTC).timestamp()
AS_TOKYO = AS_UTC - 9 * 3600  # 04:00 in Tokyo (UTC+9, no daylight saving) is 19:00 UTC before
OFFSET = "2025-01-01T04:00:00+02:00"
EPOCH = 1_735_704_000


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    """One page per way of writing a time: naive ISO, LoCoMo's, with an offset, epoch seconds."""
    rows = [
        ("naive", NAIVE),
        ("locomo", "4:00 am on 1 January, 2025"),
        ("offset", OFFSET),
        ("epoch", EPOCH),
    ]
    path = tmp_path / "old.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"user_id": "u", "user_input": name, "agent_response": "ok", "timestamp": ts}
            )
            + "\n"
            for name, ts in rows
        ),
        encoding="utf-8",
    )
    return path


@pytest.fixture
def hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's engine on the hashing test embedder (no model to load)."""
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)


@pytest.fixture
def tz_tokyo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's local time is Tokyo's for the test (restored after)."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _run(*args: str) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _stored(store: Path) -> dict[str, float]:
    """user_input -> the page's stored epoch seconds."""
    with sqlite3.connect(store / "memory.sqlite3") as db:
        return dict(db.execute("SELECT user_input, timestamp FROM pages"))


def test_default_reads_naive_timestamps_as_utc(hashing: None, chats: Path, tmp_path: Path) -> None:
    res = _run("ingest", chats, "--store", tmp_path / "st", "--no-progress")
    assert res.exit_code == 0, res.output
    stored = _stored(tmp_path / "st")
    assert stored["naive"] == stored["locomo"] == AS_UTC
    assert stored["offset"] == AS_UTC - 2 * 3600
    assert stored["epoch"] == EPOCH


def test_an_iana_zone_moves_naive_timestamps_only(
    hashing: None, chats: Path, tmp_path: Path
) -> None:
    res = _run("ingest", chats, "--store", tmp_path / "st", "--timezone", "Asia/Tokyo")
    assert res.exit_code == 0, res.output
    stored = _stored(tmp_path / "st")
    assert stored["naive"] == stored["locomo"] == AS_TOKYO
    assert stored["offset"] == AS_UTC - 2 * 3600  # its own offset, whatever --timezone says
    assert stored["epoch"] == EPOCH


def test_local_is_the_machines_zone(
    tz_tokyo: None, hashing: None, chats: Path, tmp_path: Path
) -> None:
    """``--timezone local`` is what the migration guide says: the facade's reading."""
    res = _run("ingest", chats, "--store", tmp_path / "st", "--timezone", "local")
    assert res.exit_code == 0, res.output
    assert _stored(tmp_path / "st")["naive"] == AS_TOKYO


def test_local_follows_daylight_saving(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        local = naive_zone("local")
        winter = parse_timestamp("2025-01-15 12:00:00", local)
        summer = parse_timestamp("2025-07-15 12:00:00", local)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert winter == datetime(2025, 1, 15, 11, tzinfo=UTC).timestamp()  # CET, UTC+1
    assert summer == datetime(2025, 7, 15, 10, tzinfo=UTC).timestamp()  # CEST, UTC+2
    berlin = naive_zone("Europe/Berlin")
    assert parse_timestamp("2025-07-15 12:00:00", berlin) == summer


@pytest.mark.parametrize("zone", ["Nope/Zone", "Asia", "", "../etc/passwd"])
def test_an_unknown_zone_is_a_usage_error(
    hashing: None, chats: Path, tmp_path: Path, zone: str
) -> None:
    res = _run("ingest", chats, "--store", tmp_path / "st", "--timezone", zone)
    assert res.exit_code == 2
    assert "unknown time zone" in res.output and "--timezone" in res.output
    assert not (tmp_path / "st").exists()  # refused before anything was opened or read
    with pytest.raises(ValueError, match="unknown time zone"):
        ingest([chats], EngineConfig(embedder="hashing"), timezone=zone, progress=False)


def test_workers_pass_the_zone_to_their_shard_processes(
    hashing: None, chats: Path, tmp_path: Path
) -> None:
    store = tmp_path / "st"
    res = _run("ingest", chats, "--store", store, "--workers", "2", "--timezone", "Asia/Tokyo")
    assert res.exit_code == 0, res.output
    stored: dict[str, float] = {}
    for shard in sorted(store.glob("shard-*")):
        if (shard / "memory.sqlite3").exists():
            stored |= _stored(shard)
    assert stored["naive"] == stored["locomo"] == AS_TOKYO


def test_a_zone_that_moves_a_time_past_9999_rejects_the_record(tmp_path: Path) -> None:
    """9999-12-31 23:00 in New York is in the year 10000 in UTC: a reject, not a crash."""
    path = tmp_path / "late.jsonl"
    page = {"user_id": "u", "user_input": "x", "agent_response": "y"}
    path.write_text(
        json.dumps({**page, "timestamp": "9999-12-31 23:00:00"}) + "\n" + json.dumps(page) + "\n",
        encoding="utf-8",
    )
    cfg = EngineConfig(embedder="hashing", llm=LLMConfig(mode="extractive"))
    report = ingest([path], cfg, timezone="America/New_York", progress=False)
    assert (report.accepted, report.rejected) == (1, 1)
    assert report.reject_reasons == {"timestamp: outside the years 1-9999": 1}

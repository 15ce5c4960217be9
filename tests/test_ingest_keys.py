"""Page keys and generated users: a re-run after the input was edited, moved, renamed,
compressed or piped adds nothing twice, and conversations naming no user never share one."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.formats import Record, read_records
from memoryos_gpu.ingest import IngestReport, ingest


def _cfg(store: Path | str, kit: SimpleNamespace) -> EngineConfig:
    return EngineConfig(embedder="hashing", store=str(store), device=kit.device)


def _pages(store: Path, kit: SimpleNamespace) -> list[tuple[str, str]]:
    """``(user_id, user_input)`` of every stored page, in page order."""
    with MemoryEngine(_cfg(store, kit)) as eng:
        return list(eng.store.query("SELECT user_id, user_input FROM pages ORDER BY page_id"))


def _run(paths: object, store: Path, kit: SimpleNamespace, **kw: object) -> IngestReport:
    return ingest(paths, _cfg(store, kit), progress=False, **kw)  # type: ignore[arg-type]


def _garden(path: Path, rows: int = 10) -> Path:
    """A JSONL log of one user, one page per line."""
    lines = [
        json.dumps(
            {
                "user_id": "ann",
                "user_input": f"message {i} about my garden",
                "agent_response": "nice",
                "timestamp": 1_700_000_000 + 3600 * i,
            }
        )
        for i in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _chat(text: str) -> str:
    """One OpenAI-format conversation that names no user (no user_id, no id)."""
    msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}]
    return json.dumps({"messages": msgs}) + "\n"


# ------------------------------------------------------------------ position-free keys
def _remove_a_line(path: Path) -> Path:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:3] + lines[4:]))
    return path


def _prepend_a_line(path: Path) -> Path:
    extra = {"user_id": "bob", "user_input": "first!", "agent_response": "hi", "timestamp": 1}
    path.write_text(json.dumps(extra) + "\n" + path.read_text())
    return path


def _compress_and_rename(path: Path) -> Path:
    moved = path.parent / "elsewhere" / "archive.jsonl.gz"
    moved.parent.mkdir()
    moved.write_bytes(gzip.compress(path.read_bytes()))
    return moved


@pytest.mark.parametrize("edit", [_remove_a_line, _prepend_a_line, _compress_and_rename])
def test_a_rerun_after_the_input_changed_adds_no_page_twice(tmp_path, kit, edit):
    path = _garden(tmp_path / "chats.jsonl")
    first = _run(path, tmp_path / "s", kit)
    assert first.accepted == 10
    again = _run(edit(path), tmp_path / "s", kit)
    pages = _pages(tmp_path / "s", kit)
    assert len(pages) == len(set(pages)), "a page was stored twice"
    new = 1 if edit is _prepend_a_line else 0
    assert (again.accepted, again.skipped) == (new, 10 - (edit is _remove_a_line))


def test_identical_pages_in_an_input_stay_distinct_and_rerun_cleanly(tmp_path, kit):
    page = {"user_id": "ann", "user_input": "ok", "agent_response": "sure"}
    other = {"user_id": "ann", "user_input": "why?", "agent_response": "because"}
    path = tmp_path / "repeats.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in (page, other, page, page)))
    assert _run(path, tmp_path / "s", kit).accepted == 4
    path.write_text(json.dumps(other) + "\n" + path.read_text())  # one more "why?" in front
    again = _run(path, tmp_path / "s", kit)
    assert (again.accepted, again.skipped) == (1, 4)
    assert sorted(_pages(tmp_path / "s", kit)) == [("ann", "ok")] * 3 + [("ann", "why?")] * 2


def test_a_page_the_engine_refuses_is_reported_at_its_line(tmp_path, kit):
    path = _garden(tmp_path / "chats.jsonl", 3)
    bad = {"user_id": "u" * 300, "user_input": "x", "agent_response": "y"}  # id too long
    path.write_text(path.read_text() + json.dumps(bad) + "\n")
    rejects = tmp_path / "rejects.jsonl"
    report = _run(path, tmp_path / "s", kit, rejects_path=rejects, reject_log=io.StringIO())
    (row,) = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert (report.rejected, row["line"], row["stage"]) == (1, 4, "validate")
    assert row["source"].startswith("pg-")


# ------------------------------------------------------------------ stores of earlier versions
def _fill_as_earlier_versions_did(path: Path, store: Path, kit: SimpleNamespace) -> int:
    """Store ``path``'s pages as versions before position-free keys did: source
    ``name:line:sub:hash``, and a conversation naming no user as user ``name:line``."""
    recs = [r for r in read_records(path) if isinstance(r, Record)]
    with MemoryEngine(_cfg(store, kit)) as eng:
        for r in recs:
            user = f"{path.name}:{r.line}" if r.generated_user else r.user_id
            eng.add_many([{**r.to_page(), "user_id": user, "source": r.legacy_source}])
    return len(recs)


def test_a_store_of_an_earlier_version_is_not_filled_twice(tmp_path, kit):
    path = _garden(tmp_path / "chats.jsonl", 6)
    convs = tmp_path / "convs.jsonl"
    convs.write_text(_chat("I am Carol from Lima.") + _chat("I am Dave from Perth."))
    stored = sum(_fill_as_earlier_versions_did(p, tmp_path / "s", kit) for p in (path, convs))
    report = _run([path, convs], tmp_path / "s", kit, reject_log=io.StringIO())
    assert (report.accepted, report.skipped, report.rejected) == (0, stored, 0)
    assert len(_pages(tmp_path / "s", kit)) == stored


# ------------------------------------------------------------------ generated users
def test_same_named_files_in_two_folders_keep_their_users_apart(tmp_path, kit):
    for folder, text in (("a", "My name is Alice."), ("b", "My name is Bob.")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "chats.jsonl").write_text(_chat(text))
    log = io.StringIO()
    paths = [tmp_path / "a" / "chats.jsonl", tmp_path / "b" / "chats.jsonl"]
    report = _run(paths, tmp_path / "s", kit, reject_log=log)
    users = {user for user, _ in _pages(tmp_path / "s", kit)}
    assert len(users) == 2 and all(u.startswith("conv-") for u in users)
    assert report.generated_users == 2
    (line,) = log.getvalue().splitlines()  # one summary line, not one per record
    assert line.startswith("2 conversations named no user")


@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="needs /dev/fd")
def test_piped_conversations_get_their_own_users_and_match_the_file(tmp_path, kit):
    store = tmp_path / "s"
    for text in ("I am Carol from Lima.", "I am Erin from Quito."):
        path, fd, feeder = kit.pipe(gzip.compress(_chat(text).encode()))
        assert _run(path, store, kit, reject_log=io.StringIO()).accepted == 1
        feeder.join(5)
        os.close(fd)  # the next pipe gets the same number, as `<(zcat ...)` does
    users = [user for user, _ in _pages(store, kit)]
    assert len(set(users)) == 2
    carol = tmp_path / "day1.jsonl"
    carol.write_text(_chat("I am Carol from Lima."))
    again = _run(carol, store, kit, reject_log=io.StringIO())
    assert (again.accepted, again.skipped) == (0, 1)
    assert [user for user, _ in _pages(store, kit)] == users


def test_a_conversation_keeps_its_user_when_moved_renamed_or_compressed(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(_chat("I am Dave from Perth."))
    moved = tmp_path / "x" / "other.json.gz"
    moved.parent.mkdir()
    moved.write_bytes(gzip.compress(b"\n\n" + path.read_bytes()))
    shutil.copy(path, tmp_path / "x" / "chats.jsonl")
    got = [
        [(r.user_id, r.source) for r in read_records(p)]
        for p in (path, moved, tmp_path / "x" / "chats.jsonl")
    ]
    assert got[0] == got[1] == got[2] and got[0][0][0].startswith("conv-")


def test_page_counter_numbers_every_repeat_across_its_growth():
    import hashlib
    import random

    from memoryos_gpu.formats import PageCounter

    rng = random.Random(7)
    digests = [hashlib.sha256(str(rng.randrange(3000)).encode()).digest() for _ in range(20000)]
    digests.append(bytes(32))  # an all-zero prefix: the table's empty mark, still counted
    digests.append(bytes(32))
    counter, seen = PageCounter(), {}
    for d in digests:
        seen[d] = seen.get(d, 0) + 1
        assert counter.occurrence(d) == seen[d]


def test_a_ray_shard_skips_pages_an_earlier_version_stored(tmp_path, kit):
    """``ingest --ray``'s shard actor (called in process, no Ray) recognises the old keys too."""
    from memoryos_gpu.distributed.layout import prepare_layout, shard_store
    from memoryos_gpu.distributed.ray_ingest import ShardIngestActor, _records

    path = _garden(tmp_path / "chats.jsonl", 5)
    store = tmp_path / "s"
    prepare_layout(str(store), 1)
    shard = Path(shard_store(str(store), 0, 1))
    stored = _fill_as_earlier_versions_did(path, shard, kit)
    chunk = [r for r in _records({str(path): "jsonl"}, 1, 1) if isinstance(r, dict)]
    actor = ShardIngestActor(_cfg(shard, kit).model_dump(), 0, 1)
    try:
        outcomes = actor.ingest(chunk, actor.engine.page_watermark())
    finally:
        actor.close()
    assert [o["status"] for o in outcomes] == ["skipped"] * stored
    assert len(_pages(shard, kit)) == stored


def test_ray_rows_read_times_without_a_zone_in_the_zone_given(tmp_path):
    from datetime import UTC, datetime
    from zoneinfo import ZoneInfo

    from memoryos_gpu.distributed.ray_ingest import _records

    path = tmp_path / "old.jsonl"
    row = {"user_id": "u", "user_input": "hi", "agent_response": "ok"}
    path.write_text(json.dumps({**row, "timestamp": "2025-01-01 04:00:00"}) + "\n")

    def stamp(zone: object) -> float:
        (r,) = [r for r in _records({str(path): "jsonl"}, 1, 1, zone) if isinstance(r, dict)]
        return json.loads(r["page"])["timestamp"]

    assert stamp(UTC) == datetime(2025, 1, 1, 4, tzinfo=UTC).timestamp()
    assert stamp(ZoneInfo("Asia/Tokyo")) == stamp(UTC) - 9 * 3600

"""Exports as an ingest format, the ``users`` command, and ``jsonl`` records' own ``source``.

A migration: ingest chat logs into store A, list A's users (``users --json``), export each one,
ingest the exports into store B; B holds the same users with the same pages (order,
timestamps, metadata, assistants, keys), and the original logs ingested into B afterwards add
nothing. Every CLI run uses the hashing test embedder.
"""

from __future__ import annotations

import gzip
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.formats import (
    EXPORT_FORMAT,
    FormatError,
    Record,
    Reject,
    detect_format,
    read_records,
)


def cli(
    *args: object, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    skip = ("MEMORYOS_GPU_STORE", "MEMORYOS_GPU_KEY")
    env = {**{k: v for k, v in os.environ.items() if k not in skip}, **(env or {})}
    env["MEMORYOS_GPU_EMBEDDER"] = "hashing"
    return subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def last_json(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------ inputs
def _pages_log(path: Path, untimed: bool = True) -> Path:
    """A JSONL log: two users, assistants named and not, metadata, timestamps as ISO strings
    (with and without a zone), epoch numbers and (``untimed``) none, on an exchange that
    happened twice (its pages are stamped with the time they are ingested)."""
    rows: list[dict[str, Any]] = []
    for i in range(6):
        rows.append(
            {
                "user_id": "maya",
                "assistant_id": "bot-a",
                "user_input": f"day {i}: I repotted the fern and watered the basil",
                "agent_response": f"noted, day {i}",
                "timestamp": f"2024-06-{i + 1:02d}T08:15:00Z" if i % 2 else f"2024-06-{i + 1:02d}",
                "meta": {"channel": "sms", "n": i, "tags": ["garden", str(i)]},
            }
        )
        rows.append(
            {
                "user_id": "tomas",
                "user_input": f"run {i}: 5 km along the river",
                "agent_response": "" if i == 3 else "nice pace",
                "timestamp": 1_717_000_000 + 86_400 * i,
            }
        )
    for _ in range(2 if untimed else 0):  # the same exchange twice: keys -1 and -2
        rows.append({"user_id": "tomas", "user_input": "ok", "agent_response": "sure"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _locomo_log(path: Path) -> Path:
    """A LoCoMo-like file: one conversation naming no user (a generated ``conv-...`` id)."""
    conv = {
        "speaker_a": "Ann",
        "speaker_b": "Ben",
        "session_1_date_time": "1:56 pm on 8 May, 2023",
        "session_1": [
            {"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a cat named Miso."},
            {"speaker": "Ben", "dia_id": "D1:2", "text": "Lovely! What colour?"},
            {"speaker": "Ann", "dia_id": "D1:3", "text": "Ginger.", "blip_caption": "a cat"},
        ],
        "session_2_date_time": "9:01 am on 20 May, 2023",
        "session_2": [
            {"speaker": "Ben", "dia_id": "D2:1", "text": "How is Miso?"},
            {"speaker": "Ann", "dia_id": "D2:2", "text": "Asleep on my keyboard."},
        ],
    }
    path.write_text(json.dumps([{"conversation": conv, "qa": []}]), encoding="utf-8")
    return path


def _db(store: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{store / 'memory.sqlite3'}?mode=ro", uri=True)


def _content(store: Path) -> dict[str, Any]:
    """What a migration must keep: each user's assistant and pages in order (texts,
    timestamp, metadata, key)."""
    db = _db(store)
    try:
        users = dict(db.execute("SELECT user_id, assistant_id FROM users").fetchall())
        pages: dict[str, list[tuple]] = {}
        for row in db.execute(
            "SELECT user_id, user_input, agent_response, timestamp, extra, source FROM pages "
            "ORDER BY user_id, seq"
        ):
            extra = json.loads(row[4]) if row[4] else {}
            pages.setdefault(row[0], []).append((row[1], row[2], row[3], extra, row[5]))
    finally:
        db.close()
    return {"users": users, "pages": pages}


def _users(store: Path | str) -> dict[str, Any]:
    p = cli("users", "--store", store, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _export_all(store: Path, out: Path) -> list[Path]:
    """Every user of ``store`` exported (ids from ``users --json``), one file each."""
    out.mkdir()
    files = []
    for n, row in enumerate(_users(store)["users"]):
        path = out / f"export-{n}.json"
        p = cli("export", "--store", store, "--user", row["user_id"], "--out", path)
        assert p.returncode == 0, p.stderr
        files.append(path)
    return files


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Store A from the logs, the exports of all its users, store B from the exports."""
    tmp = tmp_path_factory.mktemp("migration")
    logs = [_pages_log(tmp / "chats.jsonl"), _locomo_log(tmp / "locomo.json")]
    a, b = tmp / "A", tmp / "B"
    p = cli("ingest", *logs, "--store", a, "--json")
    assert p.returncode == 0, p.stderr
    exports = _export_all(a, tmp / "exports")
    p = cli("ingest", *exports, "--store", b, "--json")
    assert p.returncode == 0, p.stderr
    return SimpleNamespace(
        tmp=tmp, logs=logs, a=a, b=b, exports=exports, into_b=last_json(p.stdout)
    )


# ------------------------------------------------------------------------------ round trip
def test_exports_are_detected_and_every_page_is_taken(migrated):
    assert len(migrated.exports) == 3  # maya, tomas and the generated conv-... user
    for path in migrated.exports:
        data = json.loads(path.read_text())
        assert data["format"] == EXPORT_FORMAT and data["version"] == 1
        assert detect_format(path) == "export"
    report = migrated.into_b
    assert set(report["formats"].values()) == {"export"}
    assert report["rejected"] == 0 and report["skipped"] == 0
    assert report["accepted"] == 6 + 8 + 4  # maya, tomas (the twice-said "ok" too), LoCoMo


def test_the_new_store_holds_the_same_users_and_pages(migrated):
    before, after = _content(migrated.a), _content(migrated.b)
    assert after["users"] == before["users"]
    assert before["users"]["maya"] == "bot-a"
    assert list(after["pages"]) == list(before["pages"])
    for user, pages in before["pages"].items():
        assert after["pages"][user] == pages, user  # order, texts, timestamps, extra, keys
    maya = after["pages"]["maya"]
    assert maya[1][3] == {"channel": "sms", "n": 1, "tags": ["garden", "1"]}
    ok = [p for p in after["pages"]["tomas"] if p[0] == "ok"]
    assert len(ok) == 2 and ok[0][4].endswith("-1") and ok[1][4].endswith("-2")
    # users --json of both stores agree (ids, assistants, page counts, newest page times)
    rows = _users(migrated.b)["users"]
    assert rows == _users(migrated.a)["users"]
    assert {r["user_id"]: r["pages"] for r in rows}["tomas"] == 8


def test_the_history_starts_with_the_import(migrated):
    """Derived data and the audit history are not copied: the new store's history is the
    import's (one event a page), not the old store's events."""
    db = _db(migrated.b)
    try:
        audit = db.execute("SELECT COUNT(*) FROM audit").fetchone()[0]
    finally:
        db.close()
    assert audit == sum(len(p) for p in _content(migrated.b)["pages"].values())


def test_the_original_logs_add_nothing_to_the_migrated_store(migrated):
    p = cli("ingest", *migrated.logs, "--store", migrated.b, "--json")
    assert p.returncode == 0, p.stderr
    report = last_json(p.stdout)
    assert report["accepted"] == 0
    assert report["skipped"] == migrated.into_b["accepted"]
    # and the exports read again add nothing either
    p = cli("ingest", *migrated.exports, "--store", migrated.b, "--json")
    assert p.returncode == 0 and last_json(p.stdout)["accepted"] == 0


def test_users_prints_generated_ids(migrated):
    p = cli("users", "--store", migrated.a)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["user", "assistant", "pages", "newest", "page"]
    ids = [ln.split()[0] for ln in lines[1:]]
    assert ids[:2] == ["maya", "tomas"] and ids[2].startswith("conv-")
    assert "3 users" in p.stderr
    rows = _users(migrated.a)
    assert rows["count"] == 3
    conv = rows["users"][2]
    assert conv["pages"] == 4 and conv["assistant_id"] == f"{conv['user_id']}:Ben"
    assert conv["last_time"] == "2023-05-20T09:01:00Z"
    assert conv["last_timestamp"] == 1684573260.0


def test_an_export_without_the_marker_is_recognised_by_its_shape(migrated, tmp_path):
    data = json.loads(migrated.exports[0].read_text())
    del data["format"], data["version"]  # the server's export, or an earlier version's
    bare = tmp_path / "bare.json.gz"
    bare.write_bytes(gzip.compress(json.dumps(data, indent=2).encode()))
    assert detect_format(bare) == "export"
    records = list(read_records(bare))
    assert all(isinstance(r, Record) for r in records)
    assert [r.source for r in records] == [p["source"] for p in data["pages"]]


# ------------------------------------------------------------------------------ malformed exports
def _export(pages: Any, **extra: Any) -> dict[str, Any]:
    return {
        "format": EXPORT_FORMAT,
        "version": 1,
        "user": {"user_id": "ann", "assistant_id": "bot"},
        "pages": pages,
        **extra,
    }


def _page(i: int, **fields: Any) -> dict[str, Any]:
    page = {
        "page_id": i,
        "user_id": "ann",
        "user_input": f"hello {i}",
        "agent_response": "hi",
        "timestamp": 1_700_000_000.0 + i,
        "source": f"pg-{i:024x}-1",
        "extra": {},
    }
    page.update(fields)
    return {k: v for k, v in page.items() if v is not ...}


def test_a_bad_page_is_rejected_alone_naming_file_and_position(tmp_path):
    path = tmp_path / "ann.json"
    pages = [
        _page(1),
        _page(2, user_input=...),  # a page without its text
        _page(3, agent_response=7),
        "not a page",
        _page(5, user_id="bob"),
        _page(6, source=""),
        _page(7, timestamp="next tuesday"),
        _page(8, extra=[1]),
        _page(9),
    ]
    path.write_text(json.dumps(_export(pages), indent=2))
    out = list(read_records(path))
    assert [r.user_input for r in out if isinstance(r, Record)] == ["hello 1", "hello 9"]
    rejects = [r for r in out if isinstance(r, Reject)]
    assert all(r.path == str(path) and r.line == 1 for r in rejects)
    reasons = [r.reason for r in rejects]
    assert reasons[0] == "pages[1] (page_id 2): missing field 'user_input'"
    assert reasons[1] == "pages[2] (page_id 3): agent_response must be a string, got int"
    assert reasons[2] == "pages[3]: not an object"
    assert reasons[3] == "pages[4] (page_id 5): user_id 'bob' is not the export's user 'ann'"
    assert reasons[4].startswith("pages[5] (page_id 6): source is empty")
    assert reasons[5].startswith("pages[6] (page_id 7): timestamp: ")
    assert reasons[6] == "pages[7] (page_id 8): extra must be an object, got list"
    assert '"page_id": 2' in rejects[0].raw  # the page itself, not the whole export


def test_a_broken_export_is_rejected_whole(tmp_path):
    path = tmp_path / "several.json"
    items = [
        _export([_page(1)]),
        {k: v for k, v in _export([]).items() if k != "pages"},  # missing pages
        _export([]),
        _export("many"),
        _export([_page(2)], version=2),
        {"format": EXPORT_FORMAT, "pages": [_page(3)]},  # no user
    ]
    path.write_text(json.dumps(items))
    out = list(read_records(path))
    assert [(r.line, r.user_input) for r in out if isinstance(r, Record)] == [(1, "hello 1")]
    rejects = {r.line: r.reason for r in out if isinstance(r, Reject)}
    assert rejects == {
        2: "export of user 'ann': field 'pages' is missing",
        3: "export of user 'ann' holds no page (pages is empty)",
        4: "export of user 'ann': field 'pages' is not a list (str)",
        5: "export version 2 is newer than this memoryos-gpu reads (up to 1): "
        "upgrade memoryos-gpu to import it",
        6: "export: missing or non-object field 'user'",
    }


def test_ingest_of_a_malformed_export_exits_3_with_rejects(tmp_path):
    path = tmp_path / "ann.json"
    path.write_text(json.dumps(_export([_page(1), _page(2, user_input=...)]), indent=2))
    store = tmp_path / "s"
    p = cli("ingest", path, "--store", store, "--json")
    assert p.returncode == 3, p.stderr
    report = last_json(p.stdout)
    assert report["accepted"] == 1 and report["rejected"] == 1
    assert f"{path}:1: rejected: pages[1] (page_id 2): missing field 'user_input'" in p.stderr
    row = json.loads((store / "rejects.jsonl").read_text().splitlines()[0])
    assert row["file"] == str(path) and row["line"] == 1


def test_an_undetectable_file_names_the_export_format(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"user": "ann", "stuff": []}, indent=2))
    with pytest.raises(FormatError, match="export"):
        detect_format(path)


def test_a_page_stored_without_a_key_gets_a_stable_one(tmp_path, kit):
    """Pages added through the API without ``source``: their export gives each the key a
    jsonl record of the same content would get, so the export read twice adds nothing."""
    a, b = tmp_path / "A", tmp_path / "B"
    cfg = EngineConfig(embedder="hashing", store=str(a), device=kit.device)
    with MemoryEngine(cfg) as eng:
        for i in range(3):
            eng.add("zoe", f"note {i}", "ok", timestamp=1_700_000_000 + i)
        eng.add("zoe", "note 0", "ok", timestamp=1_700_000_000)  # the same page again
    out = tmp_path / "zoe.json"
    assert cli("export", "--store", a, "--user", "zoe", "--out", out).returncode == 0
    assert all(p["source"] is None for p in json.loads(out.read_text())["pages"])
    records = [r for r in read_records(out) if isinstance(r, Record)]
    assert len({r.source for r in records}) == 4
    assert records[0].source.endswith("-1") and records[3].source.endswith("-2")
    same = tmp_path / "same.jsonl"
    same.write_text(
        "".join(
            json.dumps(
                {
                    "user_id": "zoe",
                    "assistant_id": r.assistant_id,
                    "user_input": r.user_input,
                    "agent_response": r.agent_response,
                    "timestamp": r.timestamp,
                }
            )
            + "\n"
            for r in records
        )
    )
    assert [r.source for r in read_records(same)] == [r.source for r in records]
    for accepted in (4, 0):
        p = cli("ingest", out, "--store", b, "--json")
        assert p.returncode == 0 and last_json(p.stdout)["accepted"] == accepted, p.stderr


# ------------------------------------------------------------------------------ jsonl source
def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _row(i: int, **fields: Any) -> dict[str, Any]:
    return {"user_id": "ann", "user_input": f"msg {i}", "agent_response": "ok", **fields}


def test_jsonl_keeps_an_explicit_source(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [_row(0, source="msg-0"), _row(1), _row(2, source=None)])
    plain = _jsonl(tmp_path / "q.jsonl", [_row(0), _row(1), _row(2)])
    keyed, derived = list(read_records(path)), list(read_records(plain))
    assert keyed[0].source == "msg-0"
    assert keyed[0].legacy_source == derived[0].source  # what versions ignoring source gave it
    assert [r.source for r in keyed[1:]] == [r.source for r in derived[1:]]


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("", "source is empty: give a non-empty key or leave it out"),
        ("   ", "source is blank (only whitespace): give a visible key"),
        (7, "source must be a string, got int"),
        (["a"], "source must be a string, got list"),
        ("x" * 257, "source is 257 characters; the limit is 256"),
        ("a\nb", "source must be printable characters: it contains U+000A, a control character"),
    ],
)
def test_jsonl_refuses_a_bad_source(tmp_path, source, reason):
    path = _jsonl(tmp_path / "p.jsonl", [_row(0, source=source), _row(1)])
    out = list(read_records(path))
    assert isinstance(out[0], Reject) and out[0].reason == reason and out[0].line == 1
    assert isinstance(out[1], Record)


def test_jsonl_source_dedups_and_a_store_filled_before_adds_nothing(tmp_path):
    store = tmp_path / "s"
    # filled when source was ignored: the pages are held under their derived keys
    before = _jsonl(tmp_path / "before.jsonl", [_row(i) for i in range(3)])
    p = cli("ingest", before, "--store", store, "--json")
    assert p.returncode == 0 and last_json(p.stdout)["accepted"] == 3
    keyed = _jsonl(tmp_path / "keyed.jsonl", [_row(i, source=f"msg-{i}") for i in range(3)])
    p = cli("ingest", keyed, "--store", store, "--json")
    assert p.returncode == 0 and last_json(p.stdout)["accepted"] == 0, p.stderr
    # a new page under an explicit key, then the same key again: taken once
    new = _jsonl(tmp_path / "new.jsonl", [_row(9, source="msg-9"), _row(10, source="msg-9")])
    p = cli("ingest", new, "--store", store, "--json")
    report = last_json(p.stdout)
    assert p.returncode == 0 and report["accepted"] == 1 and report["skipped"] == 1
    db = _db(store)
    try:
        assert db.execute("SELECT user_input FROM pages WHERE source = 'msg-9'").fetchall() == [
            ("msg 9",)
        ]
    finally:
        db.close()


# ------------------------------------------------------------------------------ users
def test_users_of_a_sharded_directory_and_beside_a_writer(tmp_path, kit):
    src = _pages_log(tmp_path / "chats.jsonl")
    store = tmp_path / "sharded"
    p = cli("ingest", src, "--store", store, "--workers", "2")
    assert p.returncode == 0, p.stderr
    rows = _users(store)["users"]
    assert sorted(r["user_id"] for r in rows) == ["maya", "tomas"]
    assert {r["shard"] for r in rows} <= {0, 1}
    assert {r["user_id"]: r["pages"] for r in rows} == {"maya": 6, "tomas": 8}
    # beside an engine that holds the store (as a running server does)
    single = tmp_path / "single"
    assert cli("ingest", src, "--store", single).returncode == 0
    cfg = EngineConfig(embedder="hashing", store=str(single), device=kit.device)
    with MemoryEngine(cfg) as eng:
        eng.add("new-user", "hello", "hi", timestamp=1_800_000_000)
        listed = _users(single)["users"]
    assert [r["user_id"] for r in listed] == ["maya", "tomas", "new-user"]
    assert listed[2]["last_time"] == "2027-01-15T08:00:00Z"


def test_users_of_a_missing_store_or_without_its_key(tmp_path):
    p = cli("users", "--store", tmp_path / "nope")
    assert p.returncode == 1 and "no store at" in p.stderr
    assert not (tmp_path / "nope").exists()
    pytest.importorskip("sqlcipher3", reason="encrypted stores need sqlcipher3")
    store, key = tmp_path / "enc", {"MEMORYOS_GPU_KEY": "a test key"}
    src = _pages_log(tmp_path / "chats.jsonl")
    assert cli("ingest", src, "--store", store, env=key).returncode == 0
    p = cli("users", "--store", store, "--json", env=key)
    assert p.returncode == 0, p.stderr
    assert [r["user_id"] for r in json.loads(p.stdout)["users"]] == ["maya", "tomas"]
    p = cli("users", "--store", store)
    assert p.returncode == 1 and "encrypted" in p.stderr


def test_users_and_a_migration_on_postgresql(tmp_path):
    from store_backends import make_backend

    pg = make_backend("postgres", tmp_path)  # skips without a server
    try:
        src = _pages_log(tmp_path / "chats.jsonl", untimed=False)  # the same times each run
        conv = _locomo_log(tmp_path / "locomo.json")
        a = pg.spec("users-a")
        p = cli("ingest", src, conv, "--store", a, "--json")
        assert p.returncode == 0, p.stderr
        rows = _users(a)["users"]
        assert [r["user_id"] for r in rows][:2] == ["maya", "tomas"]
        assert [r["pages"] for r in rows] == [6, 6, 4]
        sqlite_store = tmp_path / "lite"
        assert cli("ingest", src, conv, "--store", sqlite_store).returncode == 0
        assert rows == _users(sqlite_store)["users"]
        exports = _export_all(a, tmp_path / "exports")  # PostgreSQL -> SQLite
        b = tmp_path / "B"
        p = cli("ingest", *exports, "--store", b, "--json")
        assert p.returncode == 0 and last_json(p.stdout)["accepted"] == 16, p.stderr
        assert _content(b) == _content(sqlite_store)
    finally:
        pg.cleanup()

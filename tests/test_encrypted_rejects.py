"""An encrypted store's folder holds nothing of its users in plain text: the default rejects
file of ``ingest`` into it says where each rejected record is and why - the reason's kind,
without the values a reason quotes (a timestamp, a user or assistant id) - and ``rekey
--encrypt`` rewrites the rejects files a plain store's ingest left (the records in full) the
same way, or removes one it cannot read row by row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

pytest.importorskip("sqlcipher3")

from memoryos_gpu.cli import cli
from memoryos_gpu.rejects import RejectRow, reason_kind
from memoryos_gpu.store import encryption as enc

MARK = "PLUMBAGOMARK"
KEY = "rejects test key"


def _page(user: str, **extra: Any) -> str:
    return json.dumps(
        {"user_id": user, "user_input": f"{MARK} said", "agent_response": "ok"} | extra
    )


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    """Records refused by the reader and by the engine, each quoting the marker somewhere."""
    lines = [
        _page("ulla"),
        _page("ulla", timestamp=f"{MARK}-ts"),  # unparseable timestamp 'PLUMBAGOMARK-ts'
        _page("ulla", timestamp=99999999999999),
        _page("ulla", assistant_id=f"{MARK}/a"),  # user 'ulla' belongs to assistant ..., not
        json.dumps([f"{MARK}-array"]),
        json.dumps({"conversations": [{"from": MARK, "value": "hi"}], "id": "ulla"}),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    monkeypatch.delenv(enc.ENV_KEY, raising=False)
    monkeypatch.delenv(enc.ENV_NEW_KEY, raising=False)


def _run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _clean(rejects: Path) -> list[dict[str, Any]]:
    """The rows of an encrypted store's rejects file, checked to hold nothing of a record."""
    text = rejects.read_text(encoding="utf-8")
    assert MARK not in text and "ulla" not in text, text
    rows = [json.loads(line) for line in text.splitlines()]
    for row in rows:
        assert set(row) == {"file", "line", "reason", "stage", "source"}
        assert row["source"] is None or row["source"].startswith("pg-")
    return rows


def test_an_encrypted_stores_rejects_file_quotes_nothing_of_the_records(
    tmp_path: Path, chats: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(enc.ENV_KEY, KEY)
    store = tmp_path / "store"
    res = _run("ingest", chats, "--store", store, "--no-progress")
    assert res.exit_code == 3, res.output
    rows = _clean(store / "rejects.jsonl")
    assert len(rows) == 5
    reasons = {r["line"]: r["reason"] for r in rows}
    assert reasons[2] == "timestamp: unparseable"  # where and why stay
    assert reasons[4].startswith("user belongs to assistant")
    assert all(r["file"] == str(chats) for r in rows)


def test_a_reasons_kind_keeps_field_names_only() -> None:
    """Quoted words stay only when they name a record field: a quoted user id or role looks
    like a field name too, and neither the report nor the rejects file may quote a record."""
    assert reason_kind("missing field 'user_id'") == "missing field 'user_id'"
    role = "conversations[3] has unknown role 'ulla'"
    assert reason_kind(role) == "conversations[i] has unknown role"
    row = RejectRow("in.jsonl", 2, role, raw="{}", stage="validate", source="pg-1", user_id="u")
    assert json.loads(row.as_json(raw=True))["reason"] == role  # --rejects FILE: in full
    assert json.loads(row.as_json(raw=False)) == {
        "file": "in.jsonl",
        "line": 2,
        "reason": "conversations[i] has unknown role",
        "stage": "validate",
        "source": "pg-1",
    }


def test_rekey_encrypt_rewrites_the_plain_stores_rejects_files(
    tmp_path: Path, chats: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    res = _run("ingest", chats, "--store", store, "--no-progress")
    assert res.exit_code == 3, res.output
    rejects = store / "rejects.jsonl"
    assert MARK in rejects.read_text(encoding="utf-8")  # a plain store's: the records in full
    rejects.chmod(0o600)
    shard = store / "shard-0"  # a --workers shard's file, and one that is not rows throughout
    shard.mkdir()
    (shard / "rejects.jsonl").write_text(f'{{"file": "x"}}\n{MARK} ulla\n', encoding="utf-8")

    monkeypatch.setenv(enc.ENV_KEY, KEY)
    res = CliRunner().invoke(cli, ["rekey", "--encrypt", "--store", str(store)])
    assert res.exit_code == 0, res.output + res.stderr
    assert "encrypted 1 of 1" in res.stdout
    assert f"rewrote {rejects}" in res.stderr
    assert f"removed {shard / 'rejects.jsonl'}" in res.stderr
    assert not (shard / "rejects.jsonl").exists()
    rows = _clean(rejects)
    assert [r["line"] for r in rows] == [2, 3, 5, 6, 4]  # every row, where and why kept
    assert rows[0]["reason"] == "timestamp: unparseable"
    assert rejects.stat().st_mode & 0o777 == 0o600
    assert not list(store.glob(".rejects.jsonl.*"))  # no copy left behind
    # the file is as an encrypted store's ingest writes it: the same again is unchanged
    before = rejects.read_text(encoding="utf-8")
    rekeyed = _run("rekey", "--encrypt", "--store", store)
    assert rekeyed.exit_code == 1  # already encrypted: refused, the file untouched
    assert rejects.read_text(encoding="utf-8") == before

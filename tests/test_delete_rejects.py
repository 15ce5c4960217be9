"""Deleting a user also deletes the user's rows of the rejects files ``ingest`` left in the
store's folder: those rows hold the refused records in plain text (the user's words), and a
deletion must leave nothing of the user behind (docs/storage.md, "Deletion leaves nothing")."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from memoryos_gpu.cli import cli
from memoryos_gpu.config import EngineConfig, LLMConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.ingest import ingest
from memoryos_gpu.rejects import count_rejects, forget_rejects

SECRET = "my secret is 4242"


def _page(user: str, text: str, **extra: Any) -> str:
    return json.dumps({"user_id": user, "user_input": text, "agent_response": "ok", **extra})


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    """u1: a record the reader refuses, one the engine refuses (over its text limit: its raw
    is cut short and no longer parses), and a good one; u2 and u3 a refused record each; u2 a
    good one."""
    path = tmp_path / "in.jsonl"
    lines = [
        _page("u1", SECRET, timestamp="2024-02-30"),
        _page("u1", SECRET + " " + "x" * 1_000_000),
        _page("u1", "hello"),
        _page("u2", "u2 words", timestamp=1_717_000_000_000),
        _page("u2", "hi"),
        _page("u3", "u3 only refused", timestamp=True),
    ]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)


def _run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _users_of(path: Path) -> list[str]:
    """The user each rejects row is about, read from its record."""
    out = []
    for row in _rows(path):
        if row.get("user_id"):
            out.append(row["user_id"])
        else:
            out.append(json.loads(row["raw"])["user_id"])
    return out


def _ingested(chats: Path, store: Path) -> Path:
    res = _run("ingest", chats, "--store", store, "--no-progress")
    assert res.exit_code == 3, res.output  # some records rejected
    rejects = store / "rejects.jsonl"
    assert sorted(_users_of(rejects)) == ["u1", "u1", "u2", "u3"]
    return rejects


def test_cli_delete_removes_the_users_rejected_records(
    hashing: None, chats: Path, tmp_path: Path
) -> None:
    store = tmp_path / "st"
    rejects = _ingested(chats, store)
    res = _run("delete", "--store", store, "--user", "u1", "--yes")
    assert res.exit_code == 0, res.output
    assert "2 rejected records removed" in res.output
    assert sorted(_users_of(rejects)) == ["u2", "u3"]  # the other users' rows stay
    for f in store.iterdir():  # nothing in the store's folder holds the user's words now
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f
    assert not list(store.glob(".rejects*"))  # no temporary copy left


def test_cli_delete_of_a_user_known_only_by_rejected_records(
    hashing: None, chats: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """u3's every record was refused: the store never knew u3, the rejects file still does."""
    from memoryos_gpu.cli import admin

    store = tmp_path / "st"
    rejects = _ingested(chats, store)
    monkeypatch.setattr(admin, "_stdin_is_terminal", lambda: True)  # a person to ask
    asked = CliRunner().invoke(cli, ["delete", "--store", str(store), "--user", "u3"], input="n\n")
    assert "0 rows, 1 rejected record)" in asked.output and asked.exit_code == 1
    assert "u3" in _users_of(rejects)  # not confirmed: kept
    res = _run("delete", "--store", store, "--user", "u3", "--yes")
    assert res.exit_code == 0, res.output
    assert "u3" not in _users_of(rejects)
    assert _run("delete", "--store", store, "--user", "u3", "--yes").exit_code == 1  # unknown now


def test_engine_delete_user_scrubs_the_rejects_file(
    make_engine: Any, kit: Any, chats: Path, tmp_path: Path
) -> None:
    """The library and server path: ``engine.delete_user`` on a store in a folder."""
    store = tmp_path / "st"
    engine = make_engine(mode="extractive", store=str(store), embedder=kit.TableEmbedder())
    rejects = store / "rejects.jsonl"
    ingest([chats], engine, rejects_path=rejects, progress=False)
    assert engine.delete_user("u1")
    assert sorted(_users_of(rejects)) == ["u2", "u3"]
    assert SECRET not in rejects.read_text(encoding="utf-8")


def test_sharded_folders_and_cut_short_records(tmp_path: Path) -> None:
    """``--workers`` leaves a merged file and one per shard; a record cut short (its raw no
    longer parses) is still found by the user it names; an unreadable row is kept."""
    cut = json.dumps({"raw": '{"user_id": "u1", "user_input": "' + "y" * 50, "user_id": None})
    rows = [
        json.dumps({"raw": _page("u1", SECRET), "user_id": None}),
        cut,
        json.dumps({"raw": _page("u10", "a lookalike id"), "user_id": None}),
        json.dumps({"raw": "", "user_id": "u2"}),
        "not json",
    ]
    files = [tmp_path / "rejects.jsonl", tmp_path / "shard-1" / "rejects.jsonl"]
    for f in files:
        f.parent.mkdir(exist_ok=True)
        f.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
        f.chmod(0o600)
    untouched = tmp_path / "shard-0" / "rejects.jsonl"
    untouched.parent.mkdir()
    untouched.write_text(rows[2] + "\n", encoding="utf-8")
    before = os.stat(untouched)

    assert count_rejects(tmp_path, "u1") == 4
    assert forget_rejects(tmp_path, "u1") == 4
    for f in files:
        assert f.read_text(encoding="utf-8").splitlines() == rows[2:]
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600  # who may read it is unchanged
    assert os.stat(untouched).st_ino == before.st_ino  # nothing to remove: not rewritten
    assert forget_rejects(tmp_path, "u1") == 0
    assert forget_rejects(":memory:", "u1") == 0
    assert forget_rejects("postgresql://h/db", "u1") == 0


def test_a_rejects_file_that_cannot_be_rewritten(
    hashing: None,
    chats: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The CLI says so (exit 1) after deleting the store's rows; the engine logs it."""
    store = tmp_path / "st"
    _ingested(chats, store)

    def full(path: Path, user_id: str) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("memoryos_gpu.rejects._scrub_rejects", full)
    res = _run("delete", "--store", store, "--user", "u1", "--yes")
    assert res.exit_code == 1
    assert "deleted user u1: 3 rows removed" in res.output
    assert "a rejects file still holds 'u1'" in res.output
    assert "No space left" in res.output

    # the engine on the CLI's store (built with the hashing embedder, so not the kit's)
    cfg = EngineConfig(store=str(store), embedder="hashing", llm=LLMConfig(mode="extractive"))
    with MemoryEngine(cfg) as engine:
        assert engine.delete_user("u2")  # the deletion itself succeeded
    assert "a rejects file keeps their rows" in caplog.text

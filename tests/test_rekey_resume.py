"""``rekey --encrypt`` killed after the store file is encrypted but before the plain store's
rejects files are rewritten: a re-run finishes that step (exit 0) instead of refusing with
"already encrypted; nothing to do" and leaving the records in plain text beside the store.
A re-run with truly nothing left keeps the refusal (exit 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

pytest.importorskip("sqlcipher3")

import memoryos_gpu.rejects as rejects_mod
from memoryos_gpu.cli import cli
from memoryos_gpu.store import encryption as enc

MARK = "RESUMEMARK"
KEY = "resume test key"


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    monkeypatch.delenv(enc.ENV_KEY, raising=False)
    monkeypatch.delenv(enc.ENV_NEW_KEY, raising=False)


def _run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


class _Killed(BaseException):
    """The process dying at the start of the rejects step (not an error the CLI handles)."""


def test_rerun_of_an_encrypt_killed_before_the_rejects_step_finishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chats = tmp_path / "in.jsonl"
    good = {"user_id": "ulla", "user_input": "hi", "agent_response": "ok"}
    bad = {"user_id": "ulla", "user_input": f"{MARK} said", "agent_response": "ok"}
    lines = [good, bad | {"timestamp": f"{MARK}-ts"}, bad | {"assistant_id": f"{MARK}/a"}]
    chats.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    store = tmp_path / "store"
    res = _run("ingest", chats, "--store", store, "--no-progress")
    assert res.exit_code == 3, res.output
    rejects = store / "rejects.jsonl"
    assert MARK in rejects.read_text(encoding="utf-8")  # a plain store's: records in full
    shard = store / "shard-0"  # a file that is not rejects rows throughout: to be removed
    shard.mkdir()
    (shard / "rejects.jsonl").write_text(f"{MARK} ulla\n", encoding="utf-8")

    monkeypatch.setenv(enc.ENV_KEY, KEY)
    real = rejects_mod.encrypt_rejects

    def killed(*_a: object, **_k: object) -> None:
        raise _Killed

    monkeypatch.setattr(rejects_mod, "encrypt_rejects", killed)
    with pytest.raises(_Killed):
        CliRunner().invoke(
            cli, ["rekey", "--encrypt", "--store", str(store)], catch_exceptions=False
        )
    monkeypatch.setattr(rejects_mod, "encrypt_rejects", real)
    assert enc.file_state(str(store / "memory.sqlite3")) == "encrypted"  # renamed over already
    assert MARK in rejects.read_text(encoding="utf-8")  # the interrupted step's file

    res = _run("rekey", "--encrypt", "--store", store)
    assert res.exit_code == 0, res.output + res.stderr
    assert "already encrypted (under this key)" in res.stdout
    assert "finished what an interrupted --encrypt left: 2 rejects file(s)" in res.stdout
    assert f"rewrote {rejects}" in res.stderr
    assert f"removed {shard / 'rejects.jsonl'}" in res.stderr
    text = rejects.read_text(encoding="utf-8")
    assert MARK not in text and "ulla" not in text, text
    assert [json.loads(line)["line"] for line in text.splitlines()] == [2, 3]
    assert not (shard / "rejects.jsonl").exists()
    assert not list(store.glob(".rejects.jsonl.*"))

    # nothing left: the documented refusal, exit 1, the file untouched
    before = rejects.read_text(encoding="utf-8"), rejects.stat().st_ino
    res = _run("rekey", "--encrypt", "--store", store)
    assert res.exit_code == 1, res.output
    assert "already encrypted (under this key); nothing to do" in res.stderr
    assert "finished" not in res.output
    assert (rejects.read_text(encoding="utf-8"), rejects.stat().st_ino) == before


def test_encrypt_of_a_store_encrypted_from_the_start_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encrypted store's own ingest writes content-free rejects: nothing to finish."""
    chats = tmp_path / "in.jsonl"
    bad = {"user_id": "ulla", "user_input": "x", "agent_response": "ok", "timestamp": "zz"}
    chats.write_text(json.dumps(bad) + "\n", encoding="utf-8")
    store = tmp_path / "store"
    monkeypatch.setenv(enc.ENV_KEY, KEY)
    assert _run("ingest", chats, "--store", store, "--no-progress").exit_code == 3
    rejects = store / "rejects.jsonl"
    before = rejects.read_text(encoding="utf-8"), rejects.stat().st_ino
    res = _run("rekey", "--encrypt", "--store", store)
    assert res.exit_code == 1, res.output
    assert "nothing to do" in res.stderr
    assert (rejects.read_text(encoding="utf-8"), rejects.stat().st_ino) == before

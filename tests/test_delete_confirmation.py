"""``delete`` asks for confirmation only on a terminal: with stdin a pipe or a file it refuses
to prompt (exit 2, "give --yes") instead of reading the answer from a script's input, which
took the next line for the answer and ended the script's loop (CLI report defect #9)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from memoryos_gpu.cli import admin, cli

USERS = ["u1", "u2"]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two users, u1 and u2, one page each; u1 also one rejected record (a bad date)."""
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    chats = tmp_path / "in.jsonl"
    rows = [{"user_id": u, "user_input": f"{u} said hi", "agent_response": "ok"} for u in USERS]
    rows.append({**rows[0], "timestamp": "2024-02-30"})
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "store"
    assert _run("ingest", chats, "--store", path).exit_code == 3  # the rejected record
    return path


def _run(*args: object, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


def _users(store: Path) -> list[str]:
    res = _run("users", "--store", store, "--json")
    return [u["user_id"] for u in json.loads(res.stdout)["users"]]


def test_no_terminal_no_prompt(store: Path) -> None:
    res = _run("delete", "--store", store, "--user", "u1", input="u2\n")
    assert res.exit_code == 2, res.output  # was: 1, "Error: invalid input" for "u2"
    assert "stdin is not a terminal" in res.stderr and "--yes" in res.stderr
    assert "[y/N]" not in res.output
    assert _users(store) == USERS
    assert _run("delete", "--store", store, "--user", "u1", "--yes").exit_code == 0
    assert _users(store) == ["u2"]


def test_a_loop_over_ids_reads_every_id(store: Path, tmp_path: Path) -> None:
    """The report's loop: each delete refuses without touching stdin, so the loop sees both
    ids (it used to end after one pass, its second id eaten by the prompt)."""
    ids = tmp_path / "ids.txt"
    ids.write_text("u1\nu2\n")
    script = (
        f'while IFS= read -r u; do echo "id $u"; "{sys.executable}" -m memoryos_gpu delete '
        f'--store "{store}" --user "$u"; echo "rc $?"; done < "{ids}"'
    )
    env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_STORE"}
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert p.stdout.splitlines() == ["id u1", "rc 2", "id u2", "rc 2"], p.stdout + p.stderr
    assert _users(store) == USERS


def test_a_terminal_is_asked(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin, "_stdin_is_terminal", lambda: True)
    res = _run("delete", "--store", store, "--user", "u1", input="n\n")
    assert res.exit_code == 1, res.output  # declined: kept
    assert "delete user 'u1' (" in res.output and " rows, 1 rejected record)?" in res.output
    assert _users(store) == USERS
    res = _run("delete", "--store", store, "--user", "u1", input="y\n")
    assert res.exit_code == 0, res.output
    assert "1 rejected record removed" in res.stdout  # was: 1 rejected records
    assert _users(store) == ["u2"]

"""Human output shows stored text as it is stored (no ``:smile:`` turned into an emoji) and
counts in the right number ("1 user", not "1 users"). CLI report defects #8 and #12."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from memoryos_gpu.cli import cli

TEXT = "see :smile: and :fire: at [bold]x[/bold] 127.0.0.1"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One user, ``mk``, with one page whose text holds emoji codes and markup."""
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    chats = tmp_path / "mk.jsonl"
    record = {"user_id": "mk", "user_input": TEXT, "agent_response": "y", "timestamp": 1.7e9}
    chats.write_text(json.dumps(record) + "\n", encoding="utf-8")
    path = tmp_path / "store"
    res = _run("ingest", chats, "--store", path)
    assert res.exit_code == 0, res.output
    return path


def _run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_retrieve_text_shows_emoji_codes_as_stored(store: Path) -> None:
    res = _run("retrieve", "--store", store, "--user", "mk", "smile")
    assert res.exit_code == 0, res.output
    assert f"User: {TEXT}" in res.stdout  # was: "User: see 😄 and 🔥 ..."
    assert "\N{SMILING FACE WITH OPEN MOUTH AND SMILING EYES}" not in res.stdout


def test_users_and_export_count_one_in_the_singular(store: Path, tmp_path: Path) -> None:
    res = _run("users", "--store", store)
    assert res.exit_code == 0 and res.stderr.strip() == "1 user", res.stderr  # was: 1 users
    out = tmp_path / "one.json"
    res = _run("export", "--store", store, "--user", "mk", "--out", out)
    assert res.exit_code == 0, res.output
    assert f"exported mk: 1 page -> {out}" in res.stderr  # was: 1 pages


@pytest.mark.parametrize(
    ("n", "noun", "text"),
    [
        (0, "page", "0 pages"),
        (1, "user", "1 user"),
        (2, "user", "2 users"),
        (1234, "row", "1,234 rows"),
    ],
)
def test_plural(n: int, noun: str, text: str) -> None:
    from memoryos_gpu.cli.output import plural

    assert plural(n, noun) == text

"""A store key of only whitespace is refused as an empty one is (CLI report defect #11): it
is what a variable holding a stray blank or newline gives, and accepted it encrypted a store,
one way, under a key nobody meant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memoryos_gpu.cli import cli
from memoryos_gpu.config import config_key
from memoryos_gpu.store import StoreError
from memoryos_gpu.store.encryption import as_secret, env_key

PLAIN_HEADER = b"SQLite format 3\x00"


@pytest.mark.parametrize("blank", [" ", "  ", "\t", "\n", " \r\n "])
def test_a_blank_key_is_refused_everywhere(blank: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StoreError, match=r"^the encryption key is blank \(only whitespace\)$"):
        as_secret(blank)
    monkeypatch.setenv("MEMORYOS_GPU_KEY", blank)
    with pytest.raises(StoreError, match=r"^\$MEMORYOS_GPU_KEY: the encryption key is blank"):
        env_key()
    monkeypatch.delenv("MEMORYOS_GPU_KEY")
    with pytest.raises(ValueError, match=r"^encryption_key: the encryption key is blank"):
        config_key(blank)


def test_a_key_with_blanks_around_it_is_taken_as_it_is() -> None:
    assert as_secret(" k e y \n").get_secret_value() == " k e y \n"  # not stripped


def test_rekey_encrypt_under_a_blank_key_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    monkeypatch.delenv("MEMORYOS_GPU_KEY", raising=False)
    chats = tmp_path / "in.jsonl"
    chats.write_text(json.dumps({"user_id": "u", "user_input": "hi", "agent_response": "ok"}))
    store = tmp_path / "store"
    assert CliRunner().invoke(cli, ["ingest", str(chats), "--store", str(store)]).exit_code == 0
    monkeypatch.setenv("MEMORYOS_GPU_KEY", "  ")
    res = CliRunner().invoke(cli, ["rekey", "--encrypt", "--store", str(store)])
    assert res.exit_code != 0, res.output  # was: 0, "encrypted 1 of 1 store file(s)"
    assert "$MEMORYOS_GPU_KEY: the encryption key is blank" in res.stderr
    assert (store / "memory.sqlite3").read_bytes().startswith(PLAIN_HEADER)  # still plain

"""What ``rekey`` and an encrypted store's open say when the keys are not what a person
expects: a sharded store that a rekey left half done names the way out, a bad or empty
``$MEMORYOS_GPU_NEW_KEY`` is named, and a rekey with nothing to change says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

pytest.importorskip("sqlcipher3")

from memoryos_gpu.cli import cli
from memoryos_gpu.sizes import size_text
from memoryos_gpu.store import encryption as enc

OLD, NEW = "old key of the test", "new key of the test"


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    monkeypatch.setenv(enc.ENV_KEY, OLD)
    monkeypatch.delenv(enc.ENV_NEW_KEY, raising=False)


def _run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _store(tmp_path: Path, workers: int = 1) -> Path:
    chats = tmp_path / "in.jsonl"
    rows = [{"user_id": f"u{i}", "user_input": f"hi {i}", "agent_response": "ok"} for i in range(8)]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    store = tmp_path / "store"
    args = ["ingest", chats, "--store", store, "--no-progress"]
    res = _run(*args, *(["--workers", workers] if workers > 1 else []))
    assert res.exit_code == 0, res.output
    return store


def test_a_half_rekeyed_sharded_store_names_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path, workers=2)
    # a rekey stopped after its first shard: shard-0 under the new key, shard-1 under the old
    enc.rekey(store / "shard-0" / "memory.sqlite3", enc.SecretStr(OLD), enc.SecretStr(NEW))
    for key, shard in ((OLD, "shard-0"), (NEW, "shard-1")):
        monkeypatch.setenv(enc.ENV_KEY, key)
        res = _run("stats", "--store", store)
        assert res.exit_code == 1
        assert f"cannot decrypt store {store / shard / 'memory.sqlite3'}" in res.output
        assert "stopped between shards? run it again with both keys" in res.output
    monkeypatch.setenv(enc.ENV_KEY, OLD)
    monkeypatch.setenv(enc.ENV_NEW_KEY, NEW)
    assert _run("rekey", "--store", store).exit_code == 0  # the way out it names works
    monkeypatch.setenv(enc.ENV_KEY, NEW)
    assert _run("stats", "--store", store).exit_code == 0


def test_a_wrong_key_on_one_store_gets_no_rekey_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path)
    monkeypatch.setenv(enc.ENV_KEY, "another key")
    res = _run("stats", "--store", store)
    assert res.exit_code == 1 and "wrong encryption key" in res.output
    assert "rekey" not in res.output


@pytest.mark.parametrize(
    ("value", "said"),
    [("", "the encryption key is empty; unset"), ("caf\udce9", "is not valid UTF-8")],
)
def test_a_bad_new_key_is_named_and_never_prompted_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, said: str
) -> None:
    store = _store(tmp_path)
    monkeypatch.setenv(enc.ENV_NEW_KEY, value)
    res = CliRunner().invoke(cli, ["rekey", "--store", str(store)], input="")
    assert res.exit_code == 1, res.output
    assert f"${enc.ENV_NEW_KEY}: " in res.output and said in res.output
    assert "new key:" not in res.output  # refused, not asked for


def test_rekey_with_nothing_to_change_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path)
    monkeypatch.setenv(enc.ENV_NEW_KEY, OLD)
    res = _run("rekey", "--store", store)
    assert res.exit_code == 1 and "is the current key: nothing to change" in res.output
    monkeypatch.setenv(enc.ENV_NEW_KEY, NEW)
    assert "re-keyed 1 of 1" in _run("rekey", "--store", store).output
    res = _run("rekey", "--store", store)  # run again: the key is the new one already
    assert res.exit_code == 0 and "has the new key already: nothing re-keyed" in res.output


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 bytes"), (1023, "1023 bytes"), (48 * 1024, "48 KiB"), (3.25 * 2**20, "3.2 MiB")],
)
def test_sizes_are_said_in_a_unit_that_keeps_them_readable(n: float, text: str) -> None:
    assert size_text(n) == text

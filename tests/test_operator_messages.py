"""An operator sweep's findings about what the CLI says (each test failed before its fix):

5. ``delete`` warned "the erasure is retried" (a reader on the log; on a sharded store right
   after ingest: "the file was rewritten moments ago") and exited at once: nothing retried it.
   A one-shot delete now completes the erasure at close and warns only about what is still
   owed then, saying what completes it.
6. Sharded ``stats`` summed the copies every shard holds (``assistants 2`` for one assistant,
   replicated assistant knowledge once per shard) and had no ``embeddings`` line nor a
   top-level ``embedding_model``.
7. The PostgreSQL holder's ``application_name`` was named after the ``--store`` URL for
   ``memoryos-gpu --store URL serve``.
8. Key wording: an empty config-file ``encryption_key`` (named as the file's setting, exit 2),
   "got int", the no-key hint naming the config file, and ``rekey`` refusing to prompt when
   stdin is not a terminal (getpass fell back to an echoing prompt).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from memoryos_gpu.cli import cli
from memoryos_gpu.config import config_key
from memoryos_gpu.distributed.layout import ShardMap
from memoryos_gpu.store.encryption import connect
from memoryos_gpu.store.errors import StoreError
from memoryos_gpu.store.postgres import _short
from memoryos_gpu.store.writer import command_line, holder_kind

USERS = ("alice", "bob", "carol", "dave")


def _cli(*args: object, stdin: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEMORYOS_GPU_EMBEDDER": "hashing"}
    for name in ("MEMORYOS_GPU_STORE", "MEMORYOS_GPU_KEY", "MEMORYOS_GPU_NEW_KEY"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        stdin=stdin,
        timeout=180,
    )


def _store(tmp_path: Path, *extra: str) -> Path:
    src = tmp_path / "in.jsonl"
    rows = [
        {"user_id": u, "user_input": f"{u} says zq{u}mark {i}", "agent_response": "ok"}
        for u in USERS
        for i in range(3)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    store = tmp_path / "store"
    p = _cli("ingest", src, "--store", store, "--no-progress", *extra)
    assert p.returncode == 0, p.stderr
    return store


def _held(store: Path, user: str) -> dict[str, int]:
    """How often the user's text is in each store file and log."""
    mark = f"zq{user}mark".encode()
    return {
        str(f): f.read_bytes().count(mark)
        for f in sorted(store.rglob("memory.sqlite3*"))
        if not f.name.endswith(".lock")
    }


# ---------------------------------------------------------------- 5. erasure after `delete`
def test_sharded_delete_right_after_ingest_erases_at_close_without_a_warning(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path, "--workers", "2")
    p = _cli("delete", "--store", store, "--user", "alice", "--yes")
    assert p.returncode == 0, p.stderr
    assert "deleted user alice" in p.stdout
    assert "retried" not in p.stderr and "may still be" not in p.stderr, p.stderr
    assert sum(_held(store, "alice").values()) == 0


def test_delete_beside_a_reader_says_what_completes_the_erasure(tmp_path: Path) -> None:
    store = _store(tmp_path)
    reader = sqlite3.connect(store / "memory.sqlite3", isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM pages").fetchone()  # holds the log
        p = _cli("delete", "--store", store, "--user", "bob", "--yes")
        assert p.returncode == 0, p.stderr
        assert "a reader holds the log" in p.stderr, p.stderr
        assert "is retried" not in p.stderr  # nothing would retry it: the CLI exits
        assert "memoryos-gpu stats" in p.stderr and "once the reader has finished" in p.stderr
        assert sum(_held(store, "bob").values()) > 0  # owed, as it says
        reader.execute("COMMIT")  # the reader has finished (its connection stays open)
        assert _cli("stats", "--store", store).returncode == 0  # what the message says to do
        assert sum(_held(store, "bob").values()) == 0
    finally:
        reader.close()


def test_an_engine_keeps_spacing_rewrites_and_retrying(tmp_path: Path) -> None:
    """Not a one-shot store: a deletion soon after a rewrite is left to the timer, as before."""
    from memoryos_gpu.store.sqlite import SQLiteStore

    st = SQLiteStore(str(tmp_path / "s.db"))
    try:
        assert st.erase_at_close is False
        st._rewrite_at = time.monotonic() + 60
        st.checkpoint()
        assert st._erasure_timer is not None and st._rewrite_due
    finally:
        st.close()
    assert not st._rewrite_due  # close did the rewrite


# ---------------------------------------------------------------- 6. sharded stats
def test_sharded_stats_counts_replicated_rows_once_and_names_the_embeddings(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path, "--workers", "2")
    shards = sorted(store.glob("shard-*/memory.sqlite3"))
    assert len(shards) == 2
    owner = ShardMap(2).assistant_owner("default")
    for i, f in enumerate(shards):  # an assistant fact, numbered by its owner, copied to both
        db = sqlite3.connect(f)
        rows = [("default", 0, "fact one")] + ([("default", 1, "fact two")] if i == owner else [])
        db.executemany(
            "INSERT INTO knowledge(owner_kind, owner_id, seq, text, embedding, mode, created) "
            "VALUES ('assistant', ?, ?, ?, x'00', 'llm', 0)",
            rows,
        )
        db.commit()
        db.close()
    p = _cli("stats", "--store", store, "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["counts"]["assistants"] == 1  # was 2: "default" on each shard
    assert data["counts"]["knowledge_live"] == 2  # the owner's entries, not 3 (copies summed)
    assert data["users"] == len(USERS) and data["pages"] == 3 * len(USERS)
    model = data["shards"][0]["embedding_model"]
    assert model and data["embedding_model"] == model
    assert all("assistant_knowledge" not in s and "assistants" not in s for s in data["shards"])
    text = _cli("stats", "--store", store).stdout
    lines = dict(line.split(None, 1) for line in text.splitlines())
    assert lines["embeddings"].strip() == model
    assert lines["assistants"].strip() == "1"
    # shards that disagree are named as such, not reduced to one model
    db = sqlite3.connect(shards[1])
    db.execute("UPDATE meta SET value = 'other-model' WHERE key = 'embedding_model'")
    db.commit()
    db.close()
    data = json.loads(_cli("stats", "--store", store, "--json").stdout)
    assert data["embedding_model"] is None
    text = _cli("stats", "--store", store).stdout
    assert "the shards disagree" in text and "other-model" in text and model in text


# ---------------------------------------------------------------- 7. PostgreSQL holder name
@pytest.mark.parametrize(
    "argv",
    [
        ["memoryos-gpu", "--store", "postgresql://u:pw@h/db", "serve"],
        ["memoryos-gpu", "serve", "--store", "postgresql://u:pw@h/db"],
        ["memoryos-gpu", "--store=postgresql://u:pw@h/db", "serve", "--port", "80"],
        ["memoryos-gpu", "--config", "x.toml", "--store", "postgresql://u@h/db", "serve"],
    ],
)
def test_holder_name_is_the_command_word_wherever_the_options_are(argv: list[str]) -> None:
    line = command_line(argv)
    assert "pw" not in line
    assert _short(line) == "memoryos-gpu serve", line
    assert holder_kind(line) == "server"


def test_holder_name_of_other_programs() -> None:
    assert (
        _short(command_line(["/x/memoryos_gpu", "ingest", "chat.jsonl"])) == "memoryos_gpu ingest"
    )
    assert _short(command_line(["python"])) == "python"
    assert _short(command_line(["memoryos-gpu", "--store", "s", "alice@x"])) == "memoryos-gpu"


# ---------------------------------------------------------------- 8. key wording
def test_config_file_key_errors_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMORYOS_GPU_KEY", raising=False)
    with pytest.raises(ValueError, match=r"^encryption_key: the encryption key is empty; remove"):
        config_key("")
    with pytest.raises(ValueError, match=r"^encryption_key: .*NUL"):
        config_key("a\x00b")
    with pytest.raises(ValueError, match=r"^encryption_key must be a string, got int$"):
        config_key(12345)
    assert config_key("k").get_secret_value() == "k"


@pytest.mark.parametrize(
    ("value", "said"), [('""', "encryption key is empty"), ("12345", "got int")]
)
def test_cli_config_key_errors_name_file_and_key(tmp_path: Path, value: str, said: str) -> None:
    store = _store(tmp_path)
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f"encryption_key = {value}\n", encoding="utf-8")
    p = _cli("stats", "--config", cfg, "--store", store)
    assert p.returncode == 2, p.stderr
    assert "bad.toml" in p.stderr and "encryption_key" in p.stderr and said in p.stderr


def test_the_no_key_message_names_the_config_file_setting(tmp_path: Path) -> None:
    f = tmp_path / "enc.db"
    f.write_bytes(os.urandom(4096))  # not a plain SQLite header: taken for encrypted
    with pytest.raises(StoreError) as err:
        connect(str(f), None)
    assert "config file's encryption_key" in str(err.value) and "MEMORYOS_GPU_KEY" in str(err.value)


def test_rekey_without_keys_and_no_terminal_refuses_rather_than_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path)
    p = _cli("rekey", "--store", store, stdin=subprocess.DEVNULL)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "GetPassWarning" not in p.stderr and "may be echoed" not in p.stderr
    assert "stdin is not a terminal" in p.stderr and "$MEMORYOS_GPU_KEY" in p.stderr, p.stderr
    monkeypatch.delenv("MEMORYOS_GPU_KEY", raising=False)
    monkeypatch.delenv("MEMORYOS_GPU_NEW_KEY", raising=False)
    monkeypatch.setenv("MEMORYOS_GPU_KEY", "old")  # the new key missing: its variable named
    res = CliRunner().invoke(cli, ["rekey", "--store", str(store)], input="")
    assert res.exit_code == 1 and "no new key given" in res.output, res.output
    assert "$MEMORYOS_GPU_NEW_KEY" in res.output


def test_a_rewrite_that_fails_at_close_is_not_blamed_on_a_reader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk fails the file's rewrite (it needs about the store's size free): the
    warning says so and what completes it, not "once the reader has finished" and a command
    that rewrites nothing (the sweep's full-disk delete, with no reader anywhere)."""
    from test_erasure_owed import _no_room

    from memoryos_gpu.store.sqlite import SQLiteStore

    st = SQLiteStore(str(tmp_path / "s.sqlite3"))
    st.erase_at_close = True
    st.checkpoint()  # a deletion committed: its erasure is left to the close
    _no_room(st)
    with caplog.at_level("WARNING", logger="memoryos_gpu.store"):
        st.close()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "could not be rewritten" in said and "disk is full" in said, said
    assert "until the store is next opened for writing" in said
    assert "reader" not in said

"""``memoryos-gpu ingest`` must not destroy or misplace what it is given.

* ``--rejects FILE`` is truncated before anything is read: naming the store's database (or its
  log, lock, a shard's files) wiped the store, and naming an input file erased the input
  before it was read (the run then reported success with 0 accepted). Both are refused now,
  before anything is opened, with a usage error naming ``--rejects``; so is a directory.
* A shard's directory of a sharded store (``PARENT/shard-I`` beside ``PARENT/shards.json``)
  took a plain ingest of every user, the other shards' ones too (their pages then existed
  twice, and ``delete`` left the stray copies behind): only its own ``--shard I/N`` is taken.
* (``ingest --workers N`` forwards the stop signal the user sent: tests/test_stop_signals.py.)
* The summary table lists the 5 most frequent reject kinds and says how many more there are.

In-process through click's runner (fast); the hashing test embedder throughout.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from memoryos_gpu import cli as cli_mod
from memoryos_gpu.config import EngineConfig
from memoryos_gpu.ingest import ingest, shard_of

GOOD = {"user_id": "u", "user_input": "keep me", "agent_response": "ok"}


@pytest.fixture(autouse=True)
def _hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("MEMORYOS_GPU_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.setenv("COLUMNS", "250")  # the summary table on one line per row


def _run(*args: Any) -> Result:
    return CliRunner().invoke(cli_mod.cli, [str(a) for a in args])


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
        encoding="utf-8",
    )
    return path


def _pages(db: Path) -> list[str]:
    """The user ids of the pages stored in SQLite database ``db``."""
    with sqlite3.connect(db) as con:
        return [u for (u,) in con.execute("SELECT user_id FROM pages")]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store holding one page."""
    st = tmp_path / "st"
    res = _run("ingest", _jsonl(tmp_path / "a.jsonl", [GOOD]), "--store", st)
    assert res.exit_code == 0, res.output
    assert _pages(st / "memory.sqlite3") == ["u"]
    return st


def _bad_input(tmp_path: Path) -> Path:
    return _jsonl(tmp_path / "b.jsonl", [{**GOOD, "user_input": "more"}, "not json"])


# ============================================================ --rejects: the store's files
@pytest.mark.parametrize("side", ["", "-wal", "-journal", ".lock"])
def test_rejects_naming_a_file_of_the_store_is_refused_and_the_store_kept(store, tmp_path, side):
    """The database, its logs, its writer lock."""
    before = (store / "memory.sqlite3").read_bytes()
    target = store / f"memory.sqlite3{side}"
    res = _run("ingest", _bad_input(tmp_path), "--store", store, "--rejects", target)
    assert res.exit_code == 2, res.output
    assert "--rejects" in res.stderr and "store's database" in res.stderr, res.stderr
    assert "Traceback" not in res.output
    assert (store / "memory.sqlite3").read_bytes() == before
    assert _pages(store / "memory.sqlite3") == ["u"]


def test_rejects_naming_the_database_by_another_spelling_is_refused(store, tmp_path, monkeypatch):
    """``./``, ``..`` and a symlink name the same file: compared resolved."""
    link = tmp_path / "innocent.jsonl"
    link.symlink_to(store / "memory.sqlite3")
    monkeypatch.chdir(tmp_path)
    for spelling in (f"./{store.name}/../{store.name}/memory.sqlite3", str(link)):
        res = _run("ingest", _bad_input(tmp_path), "--store", store, "--rejects", spelling)
        assert res.exit_code == 2 and "--rejects" in res.stderr, (spelling, res.output)
    assert _pages(store / "memory.sqlite3") == ["u"]


def test_rejects_naming_a_shards_database_is_refused(tmp_path):
    """With --workers N the store's files are its shards' (not written yet, here)."""
    src = _jsonl(tmp_path / "in.jsonl", [GOOD, {**GOOD, "user_id": "v"}])
    target = tmp_path / "sh" / "shard-1" / "memory.sqlite3"
    res = _run("ingest", src, "--store", tmp_path / "sh", "--workers", "2", "--rejects", target)
    assert res.exit_code == 2 and "--rejects" in res.stderr, res.output
    assert "shard's database" in res.stderr, res.stderr
    assert not (tmp_path / "sh").exists()  # refused before anything was made


# ============================================================ --rejects: the input files
def test_rejects_naming_an_input_file_is_refused_and_the_input_kept(tmp_path):
    src = _bad_input(tmp_path)
    before = src.read_bytes()
    hard = tmp_path / "hard.jsonl"
    os.link(src, hard)
    soft = tmp_path / "soft.jsonl"
    soft.symlink_to(src)
    for rejects in (src, hard, soft):
        res = _run("ingest", src, "--store", tmp_path / "st", "--rejects", rejects)
        assert res.exit_code == 2, (rejects, res.output)
        assert "--rejects" in res.stderr and "input file" in res.stderr, res.stderr
        assert src.read_bytes() == before
    assert not (tmp_path / "st").exists()  # nothing opened


def test_rejects_naming_the_second_input_file_is_refused(tmp_path):
    first = _jsonl(tmp_path / "one.jsonl", [GOOD])
    second = _bad_input(tmp_path)
    before = second.read_bytes()
    res = _run("ingest", first, second, "--store", tmp_path / "st", "--rejects", second)
    assert res.exit_code == 2 and "input file" in res.stderr, res.output
    assert second.read_bytes() == before


def test_the_library_refuses_an_input_file_as_its_rejects_file(tmp_path):
    src = _bad_input(tmp_path)
    before = src.read_bytes()
    cfg = EngineConfig(store=str(tmp_path / "st"), embedder="hashing")
    with pytest.raises(ValueError, match="input file"):
        ingest(src, cfg, rejects_path=src, progress=False)
    assert src.read_bytes() == before


def test_rejects_naming_a_directory_is_a_usage_error_naming_the_option(tmp_path):
    folder = tmp_path / "dup"
    folder.mkdir()
    res = _run("ingest", _bad_input(tmp_path), "--store", tmp_path / "st", "--rejects", folder)
    assert res.exit_code == 2, res.output
    assert "--rejects" in res.stderr and "is a directory" in res.stderr, res.stderr
    assert "Errno" not in res.output


def test_a_rejects_file_elsewhere_still_gets_the_rejects(store, tmp_path):
    out = tmp_path / "out" / "rejects.jsonl"
    res = _run("ingest", _bad_input(tmp_path), "--store", store, "--rejects", out)
    assert res.exit_code == 3, res.output
    assert len(out.read_text().splitlines()) == 1
    assert sorted(_pages(store / "memory.sqlite3")) == ["u", "u"]


# ============================================================ a shard's directory
USERS = [f"user{i}" for i in range(12)]


@pytest.fixture
def sharded(tmp_path: Path) -> tuple[Path, Path]:
    """A sharded directory (2 shards, as ``ingest --workers 2`` lays it out) and an input of
    users of both shards."""
    from memoryos_gpu.distributed.layout import prepare_layout

    parent = tmp_path / "sh"
    prepare_layout(str(parent), 2)
    assert {shard_of(u, 2) for u in USERS} == {0, 1}
    src = _jsonl(tmp_path / "in.jsonl", [{**GOOD, "user_id": u} for u in USERS])
    return parent, src


def test_a_plain_ingest_into_a_shard_directory_is_refused(sharded):
    parent, src = sharded
    res = _run("ingest", src, "--store", parent / "shard-0")
    assert res.exit_code == 2, res.output
    assert "--workers 2" in res.stderr and "--shard 0/2" in res.stderr, res.stderr
    assert not (parent / "shard-0" / "memory.sqlite3").exists()


def test_another_shards_number_into_a_shard_directory_is_refused(sharded):
    parent, src = sharded
    res = _run("ingest", src, "--store", parent / "shard-0", "--shard", "1/2")
    assert res.exit_code == 2 and "--shard 0/2" in res.stderr, res.output
    assert not (parent / "shard-0" / "memory.sqlite3").exists()


def test_its_own_shard_into_a_shard_directory_keeps_its_users_only(sharded):
    parent, src = sharded
    res = _run("ingest", src, "--store", parent / "shard-0", "--shard", "0/2")
    assert res.exit_code == 0, res.output
    stored = _pages(parent / "shard-0" / "memory.sqlite3")
    assert sorted(stored) == sorted(u for u in USERS if shard_of(u, 2) == 0)


def test_a_plain_ingest_into_the_parent_names_what_works(sharded):
    """The refusal once offered "open one shard's directory", which then took every user."""
    parent, src = sharded
    res = _run("ingest", src, "--store", parent)
    assert res.exit_code == 1, res.output
    assert "--workers 2" in res.stderr and "--shard I/2" in res.stderr, res.stderr
    assert "open one shard's directory" not in res.stderr
    assert not (parent / "memory.sqlite3").exists()


# ============================================================ the summary's reject kinds
def test_the_summary_says_how_many_reject_kinds_it_leaves_out(tmp_path):
    rows: list[Any] = [
        GOOD,
        "not json",
        "[1, 2]",
        {"user_input": "x", "agent_response": "y"},
        {"user_id": 5, "user_input": "x", "agent_response": "y"},
        {**GOOD, "timestamp": "yesterday-ish"},
        {**GOOD, "timestamp": True},
        {**GOOD, "user_id": "   "},
        {**GOOD, "user_input": 7},
        {**GOOD, "user_input": 8},
    ]
    res = _run("ingest", _jsonl(tmp_path / "k.jsonl", rows), "--store", tmp_path / "st", "--json")
    assert res.exit_code == 3, res.output
    reasons = json.loads(res.stdout.splitlines()[-1])["reject_reasons"]
    assert len(reasons) > 5, reasons
    rest = sorted(reasons.values(), reverse=True)[5:]
    line = f"and {len(rest)} more kind{'s' if len(rest) > 1 else ''} ({sum(rest)} reject"
    assert line in res.stderr and "--json reject_reasons" in res.stderr, res.stderr


def test_workers_into_postgresql_names_what_shards_it(tmp_path):
    """``--shards N`` without ``--ray`` says "or --workers N"; into a PostgreSQL store that is
    refused, and the refusal named no way that works there."""
    src = _jsonl(tmp_path / "a.jsonl", [GOOD])
    res = _run("ingest", src, "--store", "postgresql://u@127.0.0.1:1/db", "--workers", "2")
    assert res.exit_code == 2, res.output
    assert "--ray --shards N" in res.output and "--shard I/N" in res.output

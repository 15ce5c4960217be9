"""A store's files and an export are readable by their owner only (security sweep, defect 8).

With the usual umask (022) SQLite created the database 0644 and its ``-wal``/``-shm`` alike, in
a folder made 0755: any local user could read every tenant's text. A new store's folder is now
0700 and its files 0600 (SQLite gives the log files the database file's mode); what exists
already keeps the mode its operator gave it. ``export --out`` writes a new file 0600 (an export
of an encrypted store is plaintext).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from memoryos_gpu.cli import cli
from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _write_some(path: Path) -> MemoryEngine:
    engine = MemoryEngine(EngineConfig(store=str(path), embedder="hashing"))
    engine.add_many([{"user_id": "alice", "user_input": "my secret is blue"}])
    return engine


def test_a_new_store_is_its_owners_only(tmp_path: Path) -> None:
    path = tmp_path / "new" / "store" / "memory.sqlite3"
    engine = _write_some(path)
    try:
        assert _mode(path.parent) == 0o700
        assert _mode(path) == 0o600
        for suffix in ("-wal", "-shm"):  # open while the engine writes
            log = Path(f"{path}{suffix}")
            assert log.exists() and _mode(log) == 0o600, suffix
    finally:
        engine.close()


def test_an_existing_folder_and_file_keep_their_modes(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o750)
    folder.chmod(0o750)
    path = folder / "memory.sqlite3"
    _write_some(path).close()
    assert _mode(folder) == 0o750  # the operator's folder: not changed
    path.chmod(0o640)  # the operator opened the file to a group
    _write_some(path).close()
    assert _mode(path) == 0o640


def test_export_writes_a_new_file_its_owners_only(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _write_some(store / "memory.sqlite3").close()
    out = tmp_path / "alice.json"
    res = CliRunner().invoke(
        cli,
        ["export", "--store", str(store), "--user", "alice", "--out", str(out)],
        env={"MEMORYOS_GPU_EMBEDDER": "hashing"},
    )
    assert res.exit_code == 0, res.output
    assert "my secret is blue" in out.read_text() and _mode(out) == 0o600

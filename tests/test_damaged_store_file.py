"""A store file damaged where a command's own reads do not look: ``stats`` answered from the
sound pages with exit 0, and ``delete`` wrote into the damaged file. Both check the whole file
first now (SQLite's quick check, about the cost of the rewrite a deletion ends in)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from cli_runs import run_cli, sample_store

from memoryos_gpu.store.errors import StoreError
from memoryos_gpu.store.sqlite import SQLiteStore


def _reads_fine_but_damaged(path: Path) -> bool:
    """Whether the store opens, reads its meta and counts its rows (what ``stats`` reads),
    while its quick check finds damage."""
    try:
        st = SQLiteStore(str(path), writer=False)
    except StoreError:
        return False
    try:
        st.get_meta("embedding_model")
        st.counts()
        found = [r[0] for r in st._db.execute("PRAGMA quick_check").fetchall()]
    except (StoreError, sqlite3.DatabaseError):
        return False
    finally:
        st.close()
    return found != ["ok"]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sample store with 200 bytes overwritten at the end of the first page whose damage
    leaves the store opening and counting as if sound (bytes a bad disk could change)."""
    store = sample_store(tmp_path_factory.mktemp("damaged"))
    file = store / "memory.sqlite3"
    sound = file.read_bytes()
    for page in range(2, len(sound) // 4096):
        data = bytearray(sound)
        data[page * 4096 - 300 : page * 4096 - 100] = b"\x07" * 200
        file.write_bytes(bytes(data))
        if _reads_fine_but_damaged(file):
            return store
    raise AssertionError("no page's damage went unnoticed by the counts: nothing to test")


def test_stats_refuses_a_damaged_file_its_counts_would_not_notice(damaged: Path) -> None:
    res = run_cli("stats", "--store", damaged)
    assert res.exit_code == 1, res.output
    assert "the store's file is damaged" in res.output and "backup" in res.output, res.output


def test_delete_refuses_a_damaged_file_before_writing_into_it(damaged: Path) -> None:
    file = damaged / "memory.sqlite3"
    before = file.read_bytes()
    res = run_cli("delete", "--store", damaged, "--user", "maya_chen", "--yes")
    assert res.exit_code == 1, res.output
    assert "the store's file is damaged" in res.output, res.output
    assert file.read_bytes() == before
    wal = Path(f"{file}-wal")
    assert not wal.exists() or wal.stat().st_size == 0


def test_a_sound_store_passes_the_check(tmp_path: Path) -> None:
    store = sample_store(tmp_path)
    res = run_cli("stats", "--store", store)
    assert res.exit_code == 0, res.output
    res = run_cli("delete", "--store", store, "--user", "maya_chen", "--yes")
    assert res.exit_code == 0 and "deleted user maya_chen" in res.output, res.output

"""An error of the store file or of the disk under a file a command writes is one ``error:``
line (exit 1), not a traceback: a store file damaged in the middle failed its first read with
47 lines ending in "database disk image is malformed", and ``export --out`` / ``ingest
--rejects`` on a full or read-only disk with an ``OSError`` traceback (crash sweep, defects 2
and 3)."""

from __future__ import annotations

import errno
import sqlite3
from typing import Any

import click
import pytest
from click.testing import CliRunner

from memoryos_gpu.cli.options import handle_errors


def _invoke(exc: BaseException) -> Any:
    @click.command()
    @handle_errors
    def command() -> None:
        raise exc

    return CliRunner().invoke(command, [])


def _run(exc: BaseException) -> tuple[int, str]:
    res = _invoke(exc)
    return res.exit_code, res.output


def test_a_damaged_store_file_is_one_line_that_says_what_to_do() -> None:
    exc = sqlite3.DatabaseError("database disk image is malformed")
    exc.sqlite_errorname = "SQLITE_CORRUPT"
    code, out = _run(exc)
    assert code == 1 and out.count("\n") == 1, out
    assert "the store's file is damaged" in out and "backup" in out and "Traceback" not in out


def test_another_sqlite_error_is_one_line_with_its_name() -> None:
    try:
        sqlite3.connect(":memory:").execute("SELECT * FROM nowhere")
    except sqlite3.Error as exc:
        code, out = _run(exc)
    assert code == 1 and out == "error: store error: no such table: nowhere (SQLITE_ERROR)\n"


@pytest.mark.parametrize("code_", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_is_one_line(code_: int) -> None:
    code, out = _run(OSError(code_, "no room or read-only", "/mnt/x/out.json"))
    assert code == 1 and out.count("\n") == 1 and "/mnt/x/out.json" in out, out


def test_a_plain_bug_still_raises() -> None:
    res = _invoke(ZeroDivisionError("a bug shows its traceback"))
    assert isinstance(res.exception, ZeroDivisionError) and "error:" not in res.output


def test_the_store_says_a_damaged_file_itself(tmp_path) -> None:
    """The store's reads turn SQLite's "malformed" into a StoreError that names the file and
    what to do, for every caller (the CLI, a server, a program), not only the CLI."""
    from memoryos_gpu.store import StoreError
    from memoryos_gpu.store.sqlite import SQLiteStore

    st = SQLiteStore(str(tmp_path / "s.sqlite3"))
    real = st._db

    class Damaged:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def execute(self, sql: str, *args: Any) -> Any:
            exc = sqlite3.DatabaseError("database disk image is malformed")
            exc.sqlite_errorname = "SQLITE_CORRUPT"
            raise exc

    st._db = Damaged()
    try:
        with pytest.raises(StoreError, match="the store's file is damaged") as info:
            st.query("SELECT COUNT(*) FROM pages")
        assert str(tmp_path / "s.sqlite3") in str(info.value) and "backup" in str(info.value)
    finally:
        st._db = real
        st.close()

"""The store's errors, and what a failed open or transaction says about the machine.

Why a module of its own: every backend (SQLite, SQLCipher, PostgreSQL), the writer claim and
the server's answers raise or catch these, and the diagnosis of an open or a transaction that
the machine failed (read-only file system, full disk, I/O error) is shared by the plain and the
encrypted SQLite store; none of it needs the store class itself.
"""

from __future__ import annotations

import os
import sqlite3

from memoryos_gpu.errors import EngineClosedError, MemoryOSError


class StoreError(MemoryOSError, RuntimeError):
    """The store cannot be opened or used (newer schema, corrupt file, ...)."""


class NoStoreError(StoreError):
    """A tool that only reads found no store where it was pointed (a database without the
    store's tables): it must not create one."""


class StoreClosedError(StoreError, EngineClosedError):
    """The store was used after :meth:`~memoryos_gpu.store.sqlite.SQLiteStore.close` (its
    engine closed): one clear error (an :class:`~memoryos_gpu.errors.EngineClosedError` too, so
    a caller of the engine catches one type) instead of the driver's own."""


class StoreUnavailableError(StoreError):
    """The store's server cannot be reached or dropped the connection (PostgreSQL down,
    restarted, a network cut): nothing of the failed call was committed, and the same call can
    succeed once the server answers again. A server answers it 503 with Retry-After, and keeps
    trying to load an engine whose store was unavailable at start."""


class WriterClaimLostError(StoreUnavailableError):
    """This engine's writer claim on a PostgreSQL store went with the claim's connection (the
    database server restarted, or dropped the session), found by a write, which was not
    committed. The claim is taken again at once (or, while another writer holds it, at the
    next write: refused meanwhile, naming the holder), and the engine reloads its memory from
    the store before its next write: another writer may have written in between."""


class StoreFullError(StoreError):
    """The store's disk is full: the transaction that met it was rolled back, what was
    committed before it is kept."""

    @classmethod
    def met(cls, store: str, exc: BaseException) -> StoreFullError:
        """The error for ``store`` (path or redacted URL), the backend's own words kept."""
        return cls(
            f"store {store}: the disk is full ({exc}); the transaction was rolled back (what "
            "was committed before it is kept): free space on that disk, then retry"
        )


def _on_read_only_fs(path: str) -> bool:
    """Whether ``path``'s directory is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(os.path.dirname(os.path.abspath(path))).f_flag & os.ST_RDONLY)
    except OSError:
        return False


#: Free space (bytes) below which an I/O error met while opening or copying a store is taken
#: for a full disk: SQLite reports ENOSPC on its shared-memory index (``-shm``, 32 KiB) as a
#: plain I/O error, and the index plus the first frames of a log need far less than this.
LOW_SPACE_BYTES = 1 << 20


def _primary_code(exc: BaseException) -> int | None:
    """SQLite's primary result code of a driver error (the low byte of the extended one)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _low_on_space(path: str) -> bool:
    """Whether the file system holding ``path`` has (almost) no room left for this user."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < LOW_SPACE_BYTES


def disk_full(exc: BaseException, path: str | None = None) -> bool:
    """Whether a driver error means a full disk: SQLite's SQLITE_FULL (or its words, which an
    SQL function such as ``sqlcipher_export`` passes on under SQLITE_ERROR), or (given the
    ``path`` it was met on) an I/O or can't-open error on a file system with no room left."""
    primary = _primary_code(exc)
    if primary == sqlite3.SQLITE_FULL:
        return True
    if primary in (None, sqlite3.SQLITE_ERROR) and "disk is full" in str(exc):
        return True
    io_like = primary in (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN)
    return path is not None and io_like and _low_on_space(path)


def open_error(path: str, exc: BaseException) -> StoreError | None:
    """Why opening the store ``path`` failed when the machine, not the file, is the cause
    (read-only file system, full disk, I/O error), said for an operator with SQLite's words
    kept; None when the file itself is at fault. Plain and encrypted stores share it, so the
    right key on a read-only or full disk is never reported as a wrong one. (The words of
    :func:`environment_error`, without its rolled-back transaction: an open has none.)"""
    if _on_read_only_fs(path):
        return StoreError(
            f"cannot open store {path}: its file system is read-only, and SQLite writes beside "
            f"a store even to read it ({path}-shm, the index of its write-ahead log); copy the "
            "store to a writable place to read it"
        )
    if disk_full(exc, path):
        return StoreFullError(
            f"cannot open store {path}: the disk is full ({exc}); SQLite writes beside a store "
            f"even to read it ({path}-shm, -wal): free space on that disk, then retry"
        )
    primary = _primary_code(exc)
    if primary == sqlite3.SQLITE_IOERR:
        return StoreError(f"cannot open store {path}: disk I/O error ({exc}): check the disk")
    if primary == sqlite3.SQLITE_READONLY:
        return StoreError(
            f"cannot open store {path}: cannot write ({exc}): the file, its directory or the "
            "file system is read-only"
        )
    if primary == sqlite3.SQLITE_CANTOPEN:
        return StoreError(
            f"cannot open store {path}: {exc} (it, or a file SQLite keeps beside it: "
            f"{path}-wal, {path}-shm): check that they can be opened and written"
        )
    return None


def damaged_error(exc: BaseException, path: str | None = None) -> StoreError | None:
    """A store file damaged in the middle (a bad disk, a copy cut short, bytes overwritten),
    said with what to do, from SQLite's error (SQLite's or SQLCipher's: both carry
    ``sqlite_errorname``); None for any other error. Why: the first read of a damaged page
    raised the driver's "database disk image is malformed", a 47-line traceback in the CLI."""
    name = getattr(exc, "sqlite_errorname", None) or ""
    if not (name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in str(exc)):
        return None
    return damaged_store(f"{path}: {exc}" if path else str(exc))


def damaged_store(what: str) -> StoreError:
    """The error that says a store file is damaged (``what``: the file and what was found),
    with what to do."""
    return StoreError(
        f"the store's file is damaged ({what}): restore it from a backup (`sqlite3 FILE "
        "'PRAGMA integrity_check'` lists what is damaged)"
    )


def environment_error(path: str, exc: BaseException) -> StoreError | None:
    """What the machine did to a transaction (disk full, I/O error, read-only file), said for
    an operator with SQLite's own words kept; None for any other error."""
    primary = _primary_code(exc)
    text = str(exc)
    if primary == sqlite3.SQLITE_FULL or (primary is None and "disk is full" in text):
        return StoreFullError.met(path, exc)
    if primary == sqlite3.SQLITE_IOERR:
        return StoreError(
            f"store {path}: disk I/O error ({text}); the transaction was rolled back (what was "
            "committed before it is kept): check the disk"
        )
    if primary == sqlite3.SQLITE_READONLY:
        return StoreError(
            f"store {path}: cannot write ({text}): the file, its directory or the filesystem "
            "is read-only"
        )
    return None

"""One writer per store: who holds a store, and the lock that keeps a second writer out.

Why: an engine keeps its users' state in memory (STM, sequence numbers, segments, the arena)
and writes the store as if it were the only writer. A second writer on the same store (say
``memoryos-gpu ingest`` beside a running ``memoryos-gpu serve``) is invisible to the first, whose
next write for a shared user then collides (``UNIQUE constraint failed: pages.user_id,
pages.seq``). So opening a store for writing claims it, and a second claim is refused at open
with :class:`StoreLockedError`, whose message names the holder (pid, host, command, since when).

* SQLite: an OS lock (``flock``) on a sidecar file next to the database
  (``memory.sqlite3.lock``), which also holds the holder's record as JSON. The kernel drops the
  lock when its process exits however it exits (kill -9 included), so a stale lock cannot
  happen; a record left in the file by a dead holder is never shown, because the record is only
  read when the lock is held. ``flock`` is per open file, so a second engine in the *same*
  process is refused too. The sidecar holds a pid, so an operator may take it for stale and
  delete it, which let a second writer in (it then failed on ``UNIQUE constraint failed:
  pages.user_id, pages.seq``): the writer also holds an open-file-description lock
  (``F_OFD_SETLK``) on one byte of the database file itself, far above the bytes SQLite locks,
  which a deleted sidecar does not release (:meth:`SQLiteWriterLock.hold_database`).
  Why not the ``filelock`` package: its lock files carry no holder
  record (a waiter opens them truncating), and where ``flock`` is missing it falls back to a
  soft lock that a killed process leaves behind; the kernel lock plus a record is 60 lines.
* PostgreSQL: session-level advisory locks, held by a connection of their own
  (:mod:`memoryos_gpu.store.postgres`), per shard of the shared database.

Read-only tools (``memoryos-gpu stats``, ``profile``, ``export``) open a store without claiming
it and work beside a running writer.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import struct
import sys
import time
import warnings
import weakref
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from memoryos_gpu.log_setup import redact
from memoryos_gpu.sizes import size_text
from memoryos_gpu.store.errors import StoreError, StoreFullError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; the lock is not enforced there
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "Holder",
    "SQLiteWriterLock",
    "StoreLockedError",
    "holder_kind",
    "lock_path",
    "this_process",
]

log = logging.getLogger("memoryos_gpu.store")

#: Longest command line kept in a holder record (the rest is cut, marked with "...").
MAX_COMMAND_CHARS = 300
#: Options whose values a holder record keeps: settings that tell an operator which process
#: it is (where it serves, on what store), none of them a user's data. Every other value and
#: positional argument (a user id, a query, a chat log's path, a key) is shown as "...".
SHOWN_VALUES = frozenset(
    {
        "--store",
        "--config",
        "--host",
        "--port",
        "--workers",
        "--engines",
        "--shards",
        "--shard",
        "--device",
        "--preset",
        "--llm-mode",
        "--llm-backend",
        "--embedder",
    }
)
_COMMAND_WORD = re.compile(r"[a-z][a-z0-9_-]*")
_NOTE = re.compile(r"\[[a-z ]+ of pid \d+\]")  # what a server adds: [engine process of pid N]


class StoreLockedError(StoreError):
    """Another writer holds the store (or this shard of it): opening it to write is refused.

    ``holder``: the holder's record when it could be read (None otherwise)."""

    def __init__(self, message: str, holder: Holder | None = None) -> None:
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class Holder:
    """Who holds a store: enough for an operator to find the process."""

    pid: int
    host: str
    command: str
    since: float  # epoch seconds

    def describe(self) -> str:
        who = "this process" if self.is_this_process() else f"pid {self.pid} on {self.host}"
        return f"{who} ({self.command}), since {self.since_text()}"

    def since_text(self) -> str:
        return datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

    def is_this_process(self) -> bool:
        """Whether this record is the running process's own (an engine of it holds the
        store)."""
        return self.pid == os.getpid() and self.host == socket.gethostname()

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return cls(int(d["pid"]), str(d["host"]), str(d["command"]), float(d["since"]))
        except (ValueError, KeyError, TypeError):
            return None


def command_line(argv: list[str] | None = None) -> str:
    """This process's command line, safe to show: the program, its command word, the option
    names, the values of :data:`SHOWN_VALUES` (a URL's password masked) and notes in brackets
    (``[engine process of pid N]``); any other value or argument becomes ``...``. The record
    sits in plain beside an encrypted store, and a PostgreSQL claim's session name is visible
    to the database's other users, so a user id or a query text must not reach it. Cut to
    :data:`MAX_COMMAND_CHARS` in the middle (the program and its first arguments, and the
    end, where a server's engine process names its supervisor)."""
    args = list(sys.argv if argv is None else argv) or ["python"]
    out: list[str] = [program_name(args[0])]
    shown_next = command_seen = False
    for a in args[1:]:
        flag, eq, value = a.partition("=")
        if shown_next:  # a shown option's value (`--store URL serve`): not the command word
            out.append(_no_password(a))
            shown_next = False
            continue
        if _NOTE.fullmatch(a):
            out.append(_no_password(a))
        elif a.startswith("-"):
            shown = flag in SHOWN_VALUES
            out.append(a if not eq else f"{flag}={_no_password(value) if shown else '...'}")
            shown_next = shown and not eq
            continue
        elif not command_seen and _COMMAND_WORD.fullmatch(a):  # serve, ingest, ...
            out.append(a)
        else:
            out.append("...")
        shown_next, command_seen = False, True
    text = " ".join(out)
    if len(text) <= MAX_COMMAND_CHARS:
        return text
    head = (MAX_COMMAND_CHARS - 5) * 2 // 3
    return f"{text[:head]} ... {text[len(text) - (MAX_COMMAND_CHARS - 5 - head) :]}"


def _no_password(text: str) -> str:
    """``text`` with any secret masked: the log's rule (:func:`memoryos_gpu.log_setup.redact`),
    one rule for every text a secret may reach."""
    return redact(text)


def program_name(argv0: str) -> str:
    """``argv[0]`` as a person would type it: ``memoryos-gpu``, or the package of a
    ``python -m package`` run (whose ``argv[0]`` is ``.../package/__main__.py``)."""
    p = Path(argv0)
    return p.parent.name if p.name == "__main__.py" and p.parent.name else p.name or argv0


def this_process() -> Holder:
    """The record a writer leaves for whoever is refused."""
    return Holder(os.getpid(), socket.gethostname(), command_line(), time.time())


def lock_path(db_path: str | os.PathLike[str]) -> Path:
    """The sidecar lock file of a SQLite store: ``<database>.lock`` beside it, named after the
    database's real path (a symlink to the store locks the same file)."""
    return Path(os.path.realpath(db_path) + ".lock")


def refusal(store: str, who: str, scope: str = "store", command: str | None = None) -> str:
    """The message of a refused open: who holds it (``who``), and what to do instead, which
    depends on the holder's ``command`` (its record's): an MCP server has no ``POST
    /v1/pages`` to send pages through, and a batch command (``ingest``, ``rekey``) is no
    server at all. A holder whose command is unknown (none given, a program of its own) may
    be a server embedding the HTTP API, so it gets the server's advice."""
    return (
        f"{scope} {store} is open for writing by {who}; one engine process writes a store at "
        f"a time. {_advice(command)}; read-only commands (stats, profile, export) still work "
        "beside it"
    )


def _advice(command: str | None) -> str:
    """What to do about a holder running ``command``."""
    kind = holder_kind(command or "")
    if kind == "mcp":
        return (
            "Connect to that MCP server instead (its add_memory tool writes this store), or stop it"
        )
    if kind == "batch":
        return "Stop that process, or wait until it has finished"
    return "Stop that process, or send the pages through its server (POST /v1/pages)"


def holder_kind(command: str) -> str:
    """``mcp`` (an MCP server), ``ray`` (a Ray worker: a shard actor of ``ingest --ray`` or a
    replica of ``serve --ray``), ``batch`` (a ``memoryos-gpu`` command that serves nothing) or
    ``server`` (``serve``, or a program this cannot tell), from a holder record's command:
    the one reading of it, for the refusal's advice and for ``ingest --ray``'s wait."""
    words = command.split()
    if not words:
        return "server"
    if words[0].startswith(("default_worker.py", "ray::")):
        return "ray"
    if words[0] in ("mcp_server.py", "memoryos_gpu.server.mcp_server"):
        return "mcp"
    if words[0] != "memoryos-gpu":
        return "server"
    word = command_word(command)
    if word == "mcp":
        return "mcp"
    return "batch" if word not in (None, "serve") else "server"


def command_word(command: str) -> str | None:
    """The command word (``serve``, ``ingest``) of a :func:`command_line` record: its first
    argument that is neither an option nor a shown option's value (``--store URL serve``),
    None when that is not a command word (``...``)."""
    skip = False
    for w in command.split()[1:]:
        if skip or w.startswith("-"):
            skip = not skip and w in SHOWN_VALUES
            continue
        return w if _COMMAND_WORD.fullmatch(w) else None
    return None


class SQLiteWriterLock:
    """The ``flock`` on a SQLite store's sidecar file, held from :meth:`acquire` until
    :meth:`release`, the lock object's garbage collection, or the process's end.

    Why on collection too: an engine dropped without ``close()`` (a notebook cell re-run,
    ``engine = MemoryEngine(cfg)`` again; a test that forgets to close) kept its claim for the
    rest of the process, and every later engine on the store was refused."""

    def __init__(self, db_path: str | os.PathLike[str]) -> None:
        self.store = str(db_path)
        self.path = lock_path(db_path)
        self._fd: int | None = None
        # the database file's descriptor while it holds its byte lock (hold_database); a list,
        # which the finalizer shares
        self._db_fds: list[int] = []
        self._finalizer: weakref.finalize | None = None
        self._pid = 0  # the claiming process: only it clears the record (a forked child not)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Claim the store, or raise :class:`StoreLockedError` naming the holder. Once
        claimed, what a killed ``rekey`` left beside the store is removed (:func:`_after_claim`).
        """
        if fcntl is None or self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise self._lock_file_error("open", exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StoreError(
                    f"cannot lock store {self.store} ({self.path}): {exc.strerror}"
                ) from None
            if holder is not None and holder.is_this_process():
                raise StoreLockedError(_own_refusal(self.store, holder), holder) from None
            who = holder.describe() if holder else "another process (it left no record yet)"
            command = holder.command if holder else None
            raise StoreLockedError(refusal(self.store, who, command=command), holder) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, this_process().to_json().encode(), 0)
        except BaseException as exc:  # a claim without its record is no claim: give it back
            os.close(fd)
            if isinstance(exc, OSError):
                raise self._lock_file_error("write", exc) from None
            raise
        self._fd, self._pid = fd, os.getpid()
        # closes the file (so drops the flock) if this lock is collected unreleased; not at
        # exit, where the kernel drops it anyway and an engine's own close may still run
        self._finalizer = weakref.finalize(
            self, _drop_claim, fd, self.store, self._db_fds, self._pid
        )
        self._finalizer.atexit = False
        _after_claim(self.store)

    def hold_database(self) -> None:
        """Also lock one byte of the database file (which exists once SQLite opened it), or
        raise :class:`StoreLockedError`: another writer holds it, whose sidecar was deleted.

        An open-file-description lock (Linux's ``F_OFD_SETLK``) on byte 2**62, which SQLite
        never locks (its bytes are at 1 GiB): it conflicts with another open of the file, in
        any process, and, unlike a POSIX lock, no other close of the file releases it. This
        descriptor must outlive SQLite's own (closing a descriptor of the file would release
        the POSIX locks SQLite holds in this process): :meth:`release` closes it after the
        store's connection. Where the lock is not supported (another system, a file system
        without it) the sidecar alone guards the store."""
        if self._fd is None or self._db_fds or not hasattr(fcntl, "F_OFD_SETLK"):
            return
        try:
            fd = os.open(os.path.realpath(self.store), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return  # not a file this process may open: SQLite's own open then says so
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _DB_LOCK)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise StoreLockedError(
                    refusal(self.store, "another process, whose lock file was deleted")
                ) from None
            log.debug("no byte lock on %s (%s): the lock file alone guards it", self.store, exc)
            return
        self._db_fds.append(fd)

    def _lock_file_error(self, doing: str, exc: OSError) -> StoreError:
        """A failed open of, or write to, the lock file, said for an operator: a full disk (the
        holder record is written into the lock file) is a :class:`StoreFullError`, like a full
        disk met by a transaction, not an ``OSError`` traceback."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFullError(
                f"cannot claim store {self.store}: the disk is full ({exc.strerror} on its "
                f"writer lock {self.path}); nothing was written: free space on that disk, then "
                "retry"
            )
        return StoreError(
            f"cannot {doing} the writer lock {self.path} of store {self.store}: {exc.strerror}"
        )

    def release(self) -> None:
        """Give the store up (idempotent); the record is cleared first. Called after the
        store's connection closed (see :meth:`hold_database`).

        In a forked child (a bare store opened before ``os.fork``, closed in the child) only
        the child's copies of the descriptors close: the lock and the database's byte lock
        are the parent's open file descriptions, held as long as the parent keeps its own
        descriptors, and the record is the parent's too; clearing it made a second writer's
        refusal name no holder while the parent still held the store."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()  # the fds are closed here, once
            self._finalizer = None
        try:
            if os.getpid() == self._pid:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the file drops the flock
            while self._db_fds:
                os.close(self._db_fds.pop())  # and the database's byte lock


#: The database byte :meth:`SQLiteWriterLock.hold_database` locks: a ``struct flock`` (Linux:
#: type, whence, start, length, pid 0 as OFD locks need, padding) for a write lock on 2**62.
_DB_LOCK = struct.pack("hhqqi4x", getattr(fcntl, "F_WRLCK", 1), os.SEEK_SET, 1 << 62, 1, 0)


def _drop_claim(fd: int, store: str, others: list[int], pid: int) -> None:
    """Give up the claim of a lock collected without :meth:`SQLiteWriterLock.release`: the
    record cleared, the files closed (which drops the locks). A ``ResourceWarning`` says so,
    as for a file left open (Python shows it under ``-X dev`` or ``-W default``). In a forked
    child (``pid`` is the claimer's) the descriptors close and nothing else: the claim is the
    parent's (:meth:`SQLiteWriterLock.release`)."""
    mine = os.getpid() == pid
    try:
        if mine:
            os.ftruncate(fd, 0)
    except OSError:
        pass  # the record is only read while the lock is held: a stale one is never shown
    finally:
        os.close(fd)
        while others:
            os.close(others.pop())
    if not mine:
        return
    warnings.warn(
        f"store {store} was still open for writing when its engine was garbage-collected; "
        "its writer lock is given back now: close an engine (engine.close(), or "
        "`with MemoryEngine(...) as engine:`) when done with it",
        ResourceWarning,
        stacklevel=1,
    )


def _own_refusal(store: str, holder: Holder) -> str:
    """The refusal when the holder is this very process: most likely an engine opened earlier
    and never closed (still referenced, e.g. by a notebook variable or a test fixture)."""
    return (
        f"store {store} is open for writing by this process ({holder.command}), since "
        f"{holder.since_text()}: an engine this process opened on it earlier was not closed "
        "and is still referenced. Close it first (engine.close(), or open it as `with "
        "MemoryEngine(...) as engine:`), or keep using that engine; one engine writes a store "
        "at a time"
    )


def _after_claim(store: str) -> None:
    """Remove the copy of the store that a ``rekey`` killed before its rename left (about the
    store's size; before, only a rerun of rekey removed it). Safe only here, under the claim:
    a running rekey holds it (``encryption.remove_rekey_leftovers``)."""
    from memoryos_gpu.store.encryption import remove_rekey_leftovers

    removed = remove_rekey_leftovers(store)
    if removed:
        what = ", ".join(f"{p.name} ({size_text(size)})" for p, size in removed)
        log.warning("removed what an interrupted rekey left beside store %s: %s", store, what)


def _read_holder(fd: int) -> Holder | None:
    """The record in a lock file another process holds. It writes the record right after it
    wins the lock, so an empty file is retried briefly before giving up."""
    for _ in range(20):
        data = os.pread(fd, 4096, 0)
        if data:
            return Holder.from_json(data.decode("utf-8", "replace"))
        time.sleep(0.005)
    return None

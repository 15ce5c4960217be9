"""Child processes that stop when the process that started them dies, even by SIGKILL.

Why: the children of ``ingest --workers`` (shard processes) and of ``serve --workers`` (the
engine process, the HTTP workers) hold stores' writer claims and listening sockets. A parent
killed outright (``kill -9``, the OOM killer) runs no cleanup, so without this its children
are reparented to PID 1 and go on: writing, answering on the old port and keeping the store
claimed, so a restarted command is refused (``StoreLockedError``) until someone kills them by
hand. Linux's ``prctl(PR_SET_PDEATHSIG)`` has the kernel signal the child instead; the child
handles that signal as its graceful stop.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

__all__ = ["die_with_parent", "running"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int, signum: int = signal.SIGTERM) -> bool:
    """Have the kernel send this process ``signum`` when its parent ``parent_pid`` dies.

    Call it first thing in the child. Returns whether it is armed (False off Linux, or when
    ``prctl`` is unavailable: then nothing changes). Two things the caller must know:

    * the signal fires when the parent *thread* that started this process exits, and again
      each time this process is handed to another of the parent's threads as they exit in
      turn: a multi-threaded parent killed by SIGKILL may send it several times. Its handler
      must therefore be idempotent (a repeated SIGTERM is no "abort now": the rule of
      :mod:`memoryos_gpu.stop_signals`, which ingestion's handlers follow);
    * a parent that died before the ``prctl`` took effect sends nothing. That is seen here by
      the parent pid no longer being ``parent_pid`` (this process was reparented), and this
      process then exits at once with 128 + ``signum``, before it has opened anything.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError, ValueError):
        return False
    if os.getppid() != parent_pid:
        os._exit(128 + int(signum))
    return True


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs: it exists and is no zombie. Why the zombie check:
    a process whose parent died is reaped by PID 1, and in a container PID 1 may never reap,
    so a dead child of a killed supervisor can stay a zombie that ``kill(pid, 0)`` still
    finds."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (not Linux), or it ended just now: kill() found it
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] not in (["Z"], ["X"])

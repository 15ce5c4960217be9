"""The runtime directory of a ``serve --workers`` / ``--engines`` run: the engine processes'
sockets, the shared rate-limit buckets and the metrics files, in the temporary folder, mode
0700, removed by the supervisor's stop; and the removal of those a supervisor that died
without its stop left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["RUNTIME_PREFIX", "SUPERVISOR_PID", "make_runtime_dir", "remove_stale_runtime_dirs"]

#: The runtime directory of a ``serve --workers`` / ``--engines`` run (sockets, metrics, limits)
#: in the temporary folder, and the file in it naming the supervisor's pid.
RUNTIME_PREFIX = "memoryos-serve-"
SUPERVISOR_PID = "supervisor.pid"


def remove_stale_runtime_dirs() -> list[Path]:
    """Remove the runtime directories of supervisors that died without their stop (SIGKILL, a
    power cut): this user's, whose :data:`SUPERVISOR_PID` names a process that is gone.
    Returns those removed. Why: nothing else ever removes them, and a host that restarts its
    server by SIGKILL gathered one a restart (37 on a test host). A directory without the
    file (made by an older version) or of a live process is left alone."""
    removed = []
    for d in Path(tempfile.gettempdir()).glob(f"{RUNTIME_PREFIX}*"):
        try:
            if d.stat().st_uid != os.getuid():
                continue
            pid = int((d / SUPERVISOR_PID).read_text())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def make_runtime_dir() -> Path:
    """A new runtime directory naming this process as its supervisor, after removing the
    stale ones (:func:`remove_stale_runtime_dirs`)."""
    remove_stale_runtime_dirs()
    d = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX))  # mode 0700
    (d / SUPERVISOR_PID).write_text(str(os.getpid()))
    return d

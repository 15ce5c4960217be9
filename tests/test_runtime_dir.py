"""A ``serve --workers`` supervisor killed without its stop (SIGKILL) left its runtime directory
(sockets, metrics, limits) in the temporary folder for good: the next supervisor removes those
whose supervisor is gone, and no other."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from memoryos_gpu.server.runtime_dir import (
    RUNTIME_PREFIX,
    SUPERVISOR_PID,
    make_runtime_dir,
    remove_stale_runtime_dirs,
)


def _dir(tmp: Path, name: str, pid: int | None) -> Path:
    d = tmp / f"{RUNTIME_PREFIX}{name}"
    (d / "metrics").mkdir(parents=True)
    if pid is not None:
        (d / SUPERVISOR_PID).write_text(str(pid))
    return d


def test_only_the_directories_of_dead_supervisors_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        gone = _dir(tmp_path, "dead", dead.pid)
        kept = [_dir(tmp_path, "alive", alive.pid), _dir(tmp_path, "old", None)]
        kept.append(_dir(tmp_path, "garbled", None))
        (kept[-1] / SUPERVISOR_PID).write_text("not a pid")
        other = tmp_path / "unrelated-dir"
        other.mkdir()
        new = make_runtime_dir()
        assert not gone.exists() and all(d.exists() for d in kept) and other.exists()
        assert new.parent == tmp_path
        assert (new / SUPERVISOR_PID).read_text() == str(os.getpid())
        assert new.stat().st_mode & 0o777 == 0o700
        assert remove_stale_runtime_dirs() == []  # this process's own is alive
    finally:
        alive.kill()
        alive.wait()

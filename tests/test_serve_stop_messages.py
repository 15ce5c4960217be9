"""``serve``'s messages about its processes: a refused ``--workers 0`` names what the user
gave (not a flag the store's layout implied), and an engine process's restart line reads
"engine process 0 (pid N) ..." (not "the engine process 0 29705 exited (-9)")."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")

from memoryos_gpu.distributed.layout import prepare_layout
from memoryos_gpu.server import workers
from tests.served import ROOT


def test_serve_stop_workers_0_on_a_sharded_store_names_the_store_not_a_flag(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    prepare_layout(str(store), 2)
    out = subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", "serve", "--store", str(store), "--workers", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--engines 2 needs" not in out.stderr  # the user gave no --engines
    assert "holds 2 shards" in out.stderr and "--workers 0" in out.stderr, out.stderr


class _Dead:
    """A process that has exited, as the supervisor's watch finds it."""

    def __init__(self, pid: int, exitcode: int) -> None:
        self.pid, self.exitcode = pid, exitcode

    def join(self, timeout: float | None = None) -> None:
        pass


class _Value:
    value = 0


@pytest.mark.parametrize("engines", [1, 2])
def test_serve_stop_an_engine_restart_line_names_index_and_pid_apart(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, engines: int
) -> None:
    sup: Any = object.__new__(workers.Supervisor)
    dead = _Dead(29705, -signal.SIGKILL)
    sup.engines = [None] * engines
    sup.engines[-1] = dead
    sup.engine_pids = [_Value() for _ in range(engines)]
    sup.started = {29705: 0.0}  # long ago: no restart pause
    sup.restarts = {"engine": 0, "worker": 0}
    monkeypatch.setattr(sup, "_start_engine", lambda i: None, raising=False)
    with caplog.at_level(logging.ERROR, logger="memoryos_gpu.server"):
        sup._restart(dead)
    (line,) = [r.getMessage() for r in caplog.records]
    name = "engine process" if engines == 1 else f"engine process {engines - 1}"
    assert line.startswith(f"{name} (pid 29705) "), line
    assert "SIGKILL" in line and "starting it again" in line, line

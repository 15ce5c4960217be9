"""The exit status of a stopped server: 0 after a graceful stop by SIGTERM or Ctrl-C, the same
whether one process serves (``serve --workers 0``), workers and an engine process do
(``serve --workers 1``), or the MCP server does over HTTP; non-zero when the shutdown failed.

SIGTERM is how systemd, Docker and Kubernetes stop a service, and they report a stop that
exits 143 as a failure. uvicorn shuts down gracefully on SIGTERM and then raises the signal
again, which killed the single-process server and the MCP server (status 143) after the very
shutdown that ``serve --workers`` exits 0 from. Real processes throughout (an exit status is
the point), each on a fresh store with the hashing embedder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

from tests.served import ROOT, free_port

#: What every server here logs once its shutdown drained the queues and closed the engine.
CLOSED = "engine closed"

#: Loaded by every process of the server (``sitecustomize``, the spawned engine process's
#: too) when ``$FAIL_CLOSE`` is set: once ``memoryos_gpu.server.service`` is imported (not
#: before: importing it in every process, multiprocessing's helpers included, costs seconds),
#: the service's close does its work, then fails, as a store that cannot be closed would.
SITECUSTOMIZE = """
import os
import sys

TARGET = "memoryos_gpu.server.service"


def _patch(module):
    _close = module.MemoryService.close

    async def close(self, *args, **kwargs):
        await _close(self, *args, **kwargs)
        raise RuntimeError("the store could not be closed (injected)")

    module.MemoryService.close = close


class _FailClose:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is not cls and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("FAIL_CLOSE"):
    sys.meta_path.insert(0, _FailClose)
"""


def _env(tmp_path: Path, fail_close: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_API_KEYS"}
    env.update(MEMORYOS_GPU_EMBEDDER="hashing", OMP_WAIT_POLICY="PASSIVE")
    if fail_close:
        hooks = tmp_path / "hooks"
        hooks.mkdir()
        (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hooks), env.get("PYTHONPATH")]))
        env["FAIL_CLOSE"] = "1"
    return env


@contextmanager
def started(
    tmp_path: Path, args: list[str], ready: str, fail_close: bool = False
) -> Iterator[subprocess.Popen[str]]:
    """``memoryos-gpu ARGS`` in a subprocess, yielded once ``GET ready`` answers 200 (``ready``
    is a URL path on the port given as ``--port``); killed if the test left it running."""
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "memoryos_gpu", *args, "--port", str(port)],
            cwd=ROOT,
            env=_env(tmp_path, fail_close),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}{ready}", log)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen[str], url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            # any answer but 503 "starting" is a server that has started (MCP answers 4xx
            # to a bare GET)
            if httpx.get(url, timeout=2).status_code != 503:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # polling, not a fixed wait
    raise AssertionError(f"not ready: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[str], sig: int, tmp_path: Path) -> tuple[int, str]:
    """Send ``sig``; the exit status and the log once the process ended."""
    proc.send_signal(sig)
    code = proc.wait(60)
    return code, (tmp_path / "server.log").read_text()


def _serve(tmp_path: Path, workers: int) -> list[str]:
    return ["serve", "--store", str(tmp_path / "store"), "--workers", str(workers)]


SIGNALS = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])


@SIGNALS
@pytest.mark.parametrize("workers", [0, 1], ids=["one-process", "workers"])
def test_a_stopped_server_exits_0_after_its_shutdown(
    tmp_path: Path, workers: int, sig: int
) -> None:
    with started(tmp_path, _serve(tmp_path, workers), "/ready") as proc:
        code, log = _stop(proc, sig, tmp_path)
    assert code == 0, log[-3000:]
    assert CLOSED in log, log[-3000:]  # the same orderly shutdown: drained, engine closed


@SIGNALS
def test_a_stopped_mcp_http_server_exits_0_after_its_shutdown(tmp_path: Path, sig: int) -> None:
    args = ["mcp", "--store", str(tmp_path / "store"), "--transport", "streamable-http"]
    with started(tmp_path, [*args, "--log-level", "info"], "/mcp") as proc:
        code, log = _stop(proc, sig, tmp_path)
    assert code == 0, log[-3000:]
    assert "Application shutdown complete" in log, log[-3000:]


@pytest.mark.parametrize(
    ("workers", "sig"),
    [(0, signal.SIGTERM), (0, signal.SIGINT), (1, signal.SIGTERM)],
    ids=["one-process-TERM", "one-process-INT", "workers-TERM"],
)
def test_a_failed_shutdown_exits_non_zero_and_says_so(
    tmp_path: Path, workers: int, sig: int
) -> None:
    with started(tmp_path, _serve(tmp_path, workers), "/ready", fail_close=True) as proc:
        code, log = _stop(proc, sig, tmp_path)
    assert code == 1, log[-3000:]
    assert "error: " in log and "shutdown failed" in log, log[-3000:]


def test_a_failed_mcp_http_shutdown_exits_non_zero(tmp_path: Path) -> None:
    args = ["mcp", "--store", str(tmp_path / "store"), "--transport", "streamable-http"]
    with started(tmp_path, args, "/mcp", fail_close=True) as proc:
        code, log = _stop(proc, signal.SIGTERM, tmp_path)
    assert code == 1, log[-3000:]
    assert "shutdown failed" in log, log[-3000:]

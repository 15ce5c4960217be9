"""How ``serve`` stops, in every mode (``--workers 0``, ``--workers N``): what a stop signal
does to the port, to the requests in flight, and to the exit status.

* Once a graceful stop begins, new connections are refused at once (under ``--workers`` the
  supervisor's copy of the listening socket kept the port open: a new connection was queued
  by the kernel, held for the whole drain and then reset), while a request in flight is
  answered.
* SIGTERM to the whole process group (systemd's ``KillMode=control-group``, ``timeout``,
  ``kill -TERM -PGID``) stops in the same order as SIGTERM to the supervisor: the engine
  process answers the workers' requests in flight (it used to stop at once and answer them
  503 "the engine process is stopping").
* SIGHUP (a closed terminal) is a graceful stop, exit 0, as for ``serve --ray`` and ``mcp``
  (it killed ``serve`` outright: exit 129, no drain, the runtime directory left behind).
* A second Ctrl-C during the drain aborts the requests in flight and exits 1 with one line
  saying so, in both modes, with no traceback (``--workers`` exited 0 claiming a clean stop).

Real processes and sockets throughout; the server runs in its own session so that a test can
signal its process group, as a terminal or systemd does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("zmq")

from tests.served import ROOT, free_port, wait_ready

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")


class Served:
    """``memoryos-gpu serve`` in a subprocess, in a session (process group) of its own."""

    def __init__(self, tmp_path: Path, workers: int) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "server.log"
        self.tmp = tmp_path / "tmp"  # where the runtime directory goes (TMPDIR)
        self.tmp.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_API_KEYS"}
        env.update(MEMORYOS_GPU_EMBEDDER="hashing", OMP_WAIT_POLICY="PASSIVE", TMPDIR=str(self.tmp))
        args = ["serve", "--store", str(tmp_path / "store"), "--workers", str(workers)]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "memoryos_gpu", *args, "--port", str(self.port)],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text()

    def wait_ready(self) -> None:
        wait_ready(self.proc, self.base, lambda: self.text()[-3000:], 120, 0.1)

    def signal(self, sig: int, group: bool = False) -> None:
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def wait_log(self, *needles: str, timeout: float = 60) -> str:
        """Poll the log until one of ``needles`` is in it; that needle."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text()
            for n in needles:
                if n in text:
                    return n
            time.sleep(0.05)
        raise AssertionError(f"none of {needles} in the log:\n{self.text()[-3000:]}")

    def wait(self, timeout: float = 90) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Whatever is left of the server's process group (the test failed midway)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


@pytest.fixture
def served(tmp_path: Path):
    made: list[Served] = []

    def make(workers: int) -> Served:
        s = Served(tmp_path, workers)
        made.append(s)
        s.wait_ready()
        return s

    yield make
    for s in made:
        s.kill()


class Held:
    """A write held in flight: its headers sent with ``Expect: 100-continue``, the body kept
    back. The server's ``100 Continue`` says the app is reading the body: the request is in
    flight (a connection whose request had not begun would just be closed by a shutdown)."""

    def __init__(self, port: int, user: str = "held") -> None:
        self.body = json.dumps({"user_input": f"held page of {user}"}).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall(
            f"POST /v1/users/{user}/pages HTTP/1.1\r\nHost: x\r\n"
            "Content-Type: application/json\r\nExpect: 100-continue\r\n"
            f"Content-Length: {len(self.body)}\r\n\r\n".encode()
        )
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = self.sock.recv(1024)
            assert chunk, f"closed before 100 Continue: {got!r}"
            got += chunk
        assert got.startswith(b"HTTP/1.1 100"), got

    def finish(self) -> tuple[int, bytes]:
        """Send the body; the answer's status and body (status 0: no answer)."""
        try:
            self.sock.sendall(self.body)
            got = b""
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                got += chunk
                head, _, rest = got.partition(b"\r\n\r\n")
                length = [
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ]
                if length and len(rest) >= length[0]:
                    break
        except OSError as exc:
            return 0, repr(exc).encode()
        finally:
            self.sock.close()
        if not got:
            return 0, b"(connection closed)"
        return int(got.split(b" ", 2)[1]), got.partition(b"\r\n\r\n")[2]


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout: no process accepts it
        return False


# ============================================================================ defect 1
@pytest.mark.parametrize("workers", [0, 1], ids=["one-process", "workers"])
def test_serve_stop_refuses_new_connections_at_once_and_answers_those_in_flight(
    served, workers: int
) -> None:
    s = served(workers)
    held = Held(s.port)
    s.signal(signal.SIGTERM)
    deadline = time.monotonic() + 20  # generous: it is at once when the box is not loaded
    while not _refused(s.port):
        assert time.monotonic() < deadline, (
            f"a new connection is still accepted during the stop:\n{s.text()[-3000:]}"
        )
        assert s.proc.poll() is None, s.text()[-3000:]
        time.sleep(0.1)
    status, body = held.finish()
    assert status == 201, (status, body, s.text()[-3000:])
    assert s.wait() == 0, s.text()[-3000:]


# ============================================================================ defect 5
def test_serve_stop_sigterm_to_the_group_answers_the_requests_in_flight(served) -> None:
    s = served(1)
    held = Held(s.port)
    s.signal(signal.SIGTERM, group=True)
    # the engine process has taken its SIGTERM: it stopped (before), or waits for the
    # workers (now)
    s.wait_log("engine process: draining", "engine process: SIGTERM")
    status, body = held.finish()
    assert status == 201, (status, body, s.text()[-3000:])
    assert s.wait() == 0, s.text()[-3000:]
    text = s.text()
    assert text.index("worker stopped") < text.index("engine process: draining"), text[-3000:]


# ============================================================================ defect 6
@pytest.mark.parametrize(
    ("workers", "group"),
    [(0, False), (1, False), (1, True)],
    ids=["one-process", "workers", "workers-group"],
)
def test_serve_stop_sighup_is_a_graceful_stop(served, workers: int, group: bool) -> None:
    s = served(workers)
    held = Held(s.port)
    s.signal(signal.SIGHUP, group=group)
    s.wait_log("Shutting down")
    status, body = held.finish()
    assert status == 201, (status, body, s.text()[-3000:])
    assert s.wait() == 0, s.text()[-3000:]
    assert "engine closed" in s.text(), s.text()[-3000:]  # drained and closed
    assert not list(s.tmp.glob("memoryos-serve-*"))  # the runtime directory is removed


# ============================================================================ defect 7
@pytest.mark.parametrize("workers", [0, 1], ids=["one-process", "workers"])
def test_serve_stop_a_second_ctrl_c_aborts_and_says_so_in_every_mode(served, workers: int) -> None:
    s = served(workers)
    held = Held(s.port)
    s.signal(signal.SIGINT, group=True)  # Ctrl-C: the terminal signals the whole group
    s.wait_log("Waiting for connections to close")
    s.signal(signal.SIGINT, group=True)
    code = s.wait()
    held.finish()  # aborted: whatever it got (uvicorn's 500, or a closed connection)
    text = s.text()
    assert code == 1, text[-3000:]
    assert "second Ctrl-C" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]  # one line, not an ERROR traceback
    assert "queues drained, store closed" not in text, text[-3000:]  # it did not drain

"""The one stop-signal rule of ingestion (memoryos_gpu/stop_signals.py), as each command
applies it: the first SIGINT, SIGTERM or SIGHUP stops gracefully, a second SIGINT aborts,
a repeated SIGTERM or SIGHUP changes nothing.

The signals are real ones, sent to this process with ``os.kill`` while the handler is
installed (a context manager). Was: ``ingest --ray``'s driver and the ``ingest --workers``
supervisor aborted on any second signal, so a repeated SIGTERM (the kernel's parent-death
signal comes once per thread of the dead parent; ``systemctl stop`` and a process group's
SIGTERM can come twice) killed the work the first had asked to finish.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from memoryos_gpu.stop_signals import STOP_SIGNALS, StopSignals

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")


def _send(sig: int) -> None:
    """Deliver ``sig`` to this process and give its handler the chance to run (Python runs
    handlers in the main thread between bytecodes; the sleep is interrupted by it)."""
    os.kill(os.getpid(), sig)
    time.sleep(0.01)


def _handlers() -> dict[int, Any]:
    return {s: signal.getsignal(s) for s in STOP_SIGNALS}


class _Calls:
    def __init__(self) -> None:
        self.stops: list[int] = []
        self.aborts = 0

    def stop(self, signum: int) -> None:
        self.stops.append(signum)

    def abort(self) -> None:
        self.aborts += 1


def test_the_stop_signals_are_ctrl_c_sigterm_and_sighup():
    assert set(STOP_SIGNALS) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@pytest.mark.parametrize("first", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_repeated_sigterm_or_sighup_is_ignored_and_a_second_ctrl_c_aborts(first):
    first_sig = int(getattr(signal, first))
    calls = _Calls()
    before = _handlers()
    with StopSignals(calls.stop, calls.abort) as stop:
        assert all(signal.getsignal(s) == stop.handle for s in STOP_SIGNALS)
        assert not stop.stopped and stop.signum is None
        _send(first_sig)
        assert stop.stopped and stop.signum == first_sig and calls.stops == [first_sig]
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGTERM, signal.SIGTERM):
            _send(sig)  # e.g. the parent-death SIGTERM, once per thread of the dead parent
        assert stop.signum == first_sig and calls.stops == [first_sig] and calls.aborts == 0
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)
        assert calls.aborts == 1 and stop.signum == first_sig
    assert _handlers() == before  # given back


def test_the_notice_names_the_signal_and_the_abort():
    """After SIGHUP or SIGTERM (no terminal, perhaps) the abort is named as the signal, not as
    a Ctrl-C "again"; after a Ctrl-C, as a Ctrl-C again."""
    with StopSignals() as stop:
        _send(signal.SIGHUP)
        assert stop.notice("finishing the batch in flight, then stopping") == (
            "SIGHUP: finishing the batch in flight, then stopping (SIGINT to abort)"
        )
        assert stop.notice("asking", "kill them").endswith("(SIGINT to kill them)")
    with StopSignals() as stop:
        _send(signal.SIGINT)
        assert stop.notice("stopping") == "SIGINT: stopping (Ctrl-C again to abort)"


def test_installed_again_it_gives_back_what_another_handler_held():
    """Around ``ray.init`` (which sets its own SIGTERM handler) the driver takes the signals
    twice; restoring gives back the handler found the last time another one held them."""
    before = _handlers()

    def theirs(signum: int, frame: Any) -> None:  # e.g. Ray's
        raise AssertionError("not ours")

    stop = StopSignals()
    try:
        assert stop.install()
        assert stop.install()  # again, nothing in between: the originals are kept
        signal.signal(signal.SIGTERM, theirs)
        assert stop.install()
        _send(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is theirs
    signal.signal(signal.SIGTERM, before[signal.SIGTERM])
    assert _handlers() == before


def test_off_the_main_thread_it_takes_nothing():
    import threading

    out: list[bool] = []
    before = _handlers()
    t = threading.Thread(target=lambda: out.append(StopSignals().install()))
    t.start()
    t.join()
    assert out == [False] and _handlers() == before


# ============================================================ the --workers supervisor
class _FakeProc:
    """A shard process of ``ingest --workers`` as the supervisor sees it."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.killed = False

    def poll(self) -> int | None:
        return -9 if self.killed else None

    def send_signal(self, sig: int) -> None:
        self.sent.append(sig)

    def kill(self) -> None:
        self.killed = True


@pytest.mark.parametrize("first", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_the_workers_supervisor_forwards_the_first_signal_and_kills_only_on_a_ctrl_c(first):
    """The first signal is forwarded to every shard process as it came (one each, also to a
    process started afterwards: their reports then name the signal the user sent, not
    SIGINT), a repeated SIGTERM or SIGHUP neither forwards nor kills, and a second Ctrl-C
    kills them (was: any second signal killed them)."""
    from memoryos_gpu.cli.ingest import _forward_stop, _supervisor_stop

    first_sig = int(getattr(signal, first))
    procs: list[Any] = [_FakeProc(), _FakeProc()]
    with _supervisor_stop(procs) as stop:
        _send(first_sig)
        assert stop.signum == first_sig
        assert [p.sent for p in procs] == [[first_sig]] * 2
        late = _FakeProc()  # started while the stop was asked
        procs.append(late)
        _forward_stop(stop, late)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGTERM):
            _send(sig)
        assert [p.sent for p in procs] == [[first_sig]] * 3
        assert not any(p.killed for p in procs)
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)
        assert all(p.killed for p in procs)


def test_the_workers_supervisor_forwards_nothing_before_a_stop():
    from memoryos_gpu.cli.ingest import _forward_stop, _supervisor_stop

    p = _FakeProc()
    with _supervisor_stop([p]) as stop:
        _forward_stop(stop, p)
    assert p.sent == [] and not p.killed

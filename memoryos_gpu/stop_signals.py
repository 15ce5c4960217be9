"""What SIGINT, SIGTERM and SIGHUP do to an ingestion run: the one rule, in one handler.

Every ingestion command (a plain ``memoryos-gpu ingest``, the ``ingest --workers``
supervisor, the ``ingest --ray`` driver) takes these signals with :class:`StopSignals`:

* the **first** SIGINT, SIGTERM or SIGHUP is a graceful stop: the work in flight (a batch, a
  shard process's batch, a shard actor's chunk) finishes and is committed, the report is
  written, and the run exits 128 + that signal (130, 143, 129);
* a **second SIGINT** (Ctrl-C again) aborts at once (``KeyboardInterrupt``);
* a repeated SIGTERM or SIGHUP changes nothing: the stop goes on gracefully.

Why Ctrl-C alone escalates: SIGINT comes from a person at a terminal, and a second Ctrl-C is
that person saying "now". SIGTERM and SIGHUP come from machinery that may send them more than
once without meaning more. The kernel's parent-death signal (``PR_SET_PDEATHSIG``,
:mod:`memoryos_gpu.parent_death`) reaches a shard process of ``ingest --workers`` whose parent
was killed once per thread of that parent, and taking the repeat for an abort interrupted
the very write the first signal had promised to finish (the store rolled it back and the shard
logged "an apply failed halfway"). ``systemctl stop``, ``timeout``, a process group's
SIGTERM or a closed terminal's SIGHUP can likewise arrive twice; whoever wants a stop that
does not wait escalates with SIGKILL (``timeout -k``, systemd's ``TimeoutStopSec``), which no
handler sees. The three commands once had three handlers and two rules (the ``--ray`` driver
and the ``--workers`` supervisor aborted on any second signal); they now share this one.

The HTTP servers (``memoryos-gpu serve``, its worker processes, ``memoryos-gpu mcp`` over HTTP)
stop by uvicorn's rule instead, and :func:`sigterm_as_ctrl_c` makes SIGTERM end them as Ctrl-C
does: after the graceful shutdown, with exit status 0; :func:`sighup_as_sigterm` makes SIGHUP
a SIGTERM while ``serve`` serves.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignals", "sigterm_as_ctrl_c"]

#: What stops a run after its work in flight: Ctrl-C, and what ``timeout``, ``systemctl
#: stop``, CI cancellation and a closed terminal send.
STOP_SIGNALS: tuple[int, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class StopSignals:
    """The handler of :data:`STOP_SIGNALS` for one run, by the rule of this module.

    ``on_stop(signum)`` runs once, in the main thread, on the first stop signal (say so; ask
    the work to stop: set an event, forward a signal, tell actors); ``on_abort()`` runs on the
    second SIGINT just before ``KeyboardInterrupt`` is raised (e.g. kill child processes).
    :attr:`signum` is the signal that stopped the run (None while none came).

    Use it as a context manager, or :meth:`install` / :meth:`restore`. Handlers can be set
    from the main thread only (signals are run there alone): elsewhere :meth:`install` does
    nothing and returns False. :meth:`install` may be called again, to take the signals back
    from a library that set its own (``ray.init`` sets a SIGTERM handler); :meth:`restore`
    puts back, for each signal, the handler that held it when it was last taken (Ray's, once
    Ray has set one: what the process would have without this run).
    """

    def __init__(
        self,
        on_stop: Callable[[int], None] | None = None,
        on_abort: Callable[[], None] | None = None,
    ) -> None:
        self.signum: int | None = None
        self._on_stop = on_stop
        self._on_abort = on_abort
        self._old: dict[int, Any] = {}

    @property
    def stopped(self) -> bool:
        """Whether a stop signal came."""
        return self.signum is not None

    def notice(self, doing: str, abort: str = "abort") -> str:
        """The line telling the user what the stop does, e.g. ``SIGINT: finishing the batch in
        flight, then stopping (Ctrl-C again to abort)``. After a SIGTERM or SIGHUP (systemd,
        ``timeout``, a closed terminal) there may be no terminal to press Ctrl-C in, and a
        repeated one changes nothing: the line names the signal that aborts (SIGINT)."""
        name = signal.Signals(self.signum).name if self.signum is not None else "stop"
        again = "Ctrl-C again" if self.signum in (None, signal.SIGINT) else "SIGINT"
        return f"{name}: {doing} ({again} to {abort})"

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        """The signal handler: the rule of this module."""
        if self.signum is not None:
            if signum == signal.SIGINT:
                if self._on_abort is not None:
                    self._on_abort()
                raise KeyboardInterrupt
            return  # a repeated SIGTERM / SIGHUP (e.g. parent death, once per thread)
        self.signum = signum
        if self._on_stop is not None:
            self._on_stop(signum)

    def install(self) -> bool:
        """Take the stop signals (again); whether they are now this handler's."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            old = signal.signal(sig, self.handle)
            if old != self.handle:  # taken from another handler (not just taken again)
                self._old[sig] = old
        return True

    def restore(self) -> None:
        """Give back the handlers :meth:`install` took the signals from."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """While in this block, SIGTERM raises ``KeyboardInterrupt`` as SIGINT does (main thread
    only; elsewhere nothing changes).

    Why: uvicorn (0.29 and later) takes SIGINT and SIGTERM while it serves, shuts down
    gracefully on either, then gives each back to the handler it found and raises it again.
    SIGINT's default handler raises ``KeyboardInterrupt``, which ``uvicorn.run`` (and the
    callers of ``Server.run`` here) take for the end of a served run: exit status 0. SIGTERM's
    default action killed the process instead, after the very same orderly shutdown: status
    143, which systemd, Docker and Kubernetes report as a failed stop. Under this handler a
    SIGTERM ends the process as Ctrl-C does, by the server's shutdown and not before it; one
    that comes before uvicorn has taken the signals interrupts the startup, as Ctrl-C would.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def sighup_as_sigterm() -> Iterator[None]:
    """While in this block, SIGHUP (a closed terminal, some process managers) does what
    SIGTERM does: a graceful stop (main thread only). uvicorn takes SIGINT and SIGTERM
    alone, and SIGHUP's default action killed the server outright (exit 129: no drain, the
    requests in flight cut), where ``ingest``, ``mcp`` and ``serve --ray`` stop gracefully
    (:data:`STOP_SIGNALS`). A repeated SIGHUP is a repeated
    SIGTERM: it changes nothing."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
        yield
        return
    old = signal.signal(signal.SIGHUP, lambda signum, frame: signal.raise_signal(signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, old)

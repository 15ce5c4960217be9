"""Reachability of one HTTP LLM endpoint: a circuit breaker and a one-prober connect gate.

Why: an endpoint that silently drops packets (a firewalled or vanished host: the TCP SYN is
never answered) makes every connect wait out its timeout. Without these, every request of a
batch paid ``timeout x tries`` on its own, and every later round of derived work paid it again.

* :class:`CircuitBreaker` counts consecutive connect failures (timed out, refused, TLS or DNS
  failure: never an HTTP answer, whatever its status, nor a read timeout of a slow but reachable
  server). ``closed`` → ``open`` once ``threshold`` of them happened in a row (a half-open probe
  failing reopens at once) → ``half_open`` after ``cooldown_s`` → ``closed`` on a connection.
  While open, requests fail at once instead of connecting.
  :meth:`CircuitBreaker.trip` opens it at once for a server that answers but failed *every*
  request of a batch after their retries (5xx, 429, timeouts: the backend decides): the next
  batches would fail alike, each paying ``tries x backoff`` against a server that cannot
  serve. It is not a connect failure and does not count towards ``threshold``; after the
  cool-down the next batch goes as usual, and its first connection closes the breaker again.
* :class:`ConnectGate` lets only one request at a time connect while the endpoint is unproven
  (before the first connection, after a connect failure, in half-open): the others of the
  batch wait for that probe's outcome instead of each waiting out its own connect timeout, so
  a batch of N requests to an unreachable endpoint costs one request's tries, not N times that.
  A connection proves the endpoint as soon as httpx's ``trace`` extension reports the request
  being sent (before the answer), so a reachable server costs the batch one connect, not one
  generation; a transport without tracing proves it with its answer.

The breaker is thread-safe (its state may be read from any thread); the gate runs on the
backend's event-loop thread only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = [
    "CLOSED",
    "DEFAULT_COOLDOWN_S",
    "HALF_OPEN",
    "OPEN",
    "Attempt",
    "CircuitBreaker",
    "ConnectGate",
    "EndpointUnreachable",
    "Outage",
]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
#: seconds an open breaker fails requests at once before one probe may connect again
DEFAULT_COOLDOWN_S = 30.0
#: httpx ``trace`` events that mean the request is being sent: the endpoint answered the connect
_SENDING = ("http11.", "http2.")
#: httpx ``trace`` events that start the connect stage (TCP, unix socket, TLS)
_CONNECTING = ("connection.connect_", "connection.start_tls")


class EndpointUnreachable(Exception):
    """Internal: the breaker is open (or this attempt's connect failure just opened it)."""


@dataclass(frozen=True)
class Outage:
    """What an open (or failing) breaker knows, for the error message."""

    what: str  # "connect timed out", "connection refused", "connect failed"; for a failing
    # server what failed ("all 4 requests of a batch, 3 tries each")
    tries: int  # consecutive connect failures
    detail: str  # the last failure, e.g. "ConnectError: [Errno 111] Connection refused"
    ago_s: float  # since the breaker opened (0 when it is not open)
    retry_in_s: float  # until half-open (0 when it is not open)
    failing: bool = False  # opened by trip(): the server answered but failed everything


class CircuitBreaker:
    """closed → open on ``threshold`` consecutive connect failures → half_open after
    ``cooldown_s`` → closed on a connection (or open again on a failed probe).

    ``clock`` is injectable (``time.monotonic`` by default) so the cool-down can be tested
    without sleeping."""

    def __init__(
        self,
        threshold: int,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold!r}")
        if not cooldown_s >= 0:  # also NaN
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s!r}")
        self.threshold = int(threshold)
        self.cooldown_s = float(cooldown_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._what = ""
        self._detail = ""
        self._failing = False  # the last opening was trip()'s, not connect failures'

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"`` (open, with the cool-down over)."""
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self._opened_at is None:
            return CLOSED
        return OPEN if self.clock() - self._opened_at < self.cooldown_s else HALF_OPEN

    @property
    def failures(self) -> int:
        """Consecutive connect failures so far."""
        with self._lock:
            return self._failures

    def record_success(self) -> None:
        """A connection was made: the endpoint is reachable, whatever it answers."""
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._failing = False

    def trip(self, what: str, detail: str) -> None:
        """Open now: the server answered but failed every request of a batch after their
        retries (``what`` says how many, ``detail`` the last error). The tries are spent
        already, so no threshold applies; the consecutive connect failures are untouched."""
        with self._lock:
            self._what, self._detail = what, detail
            self._failing = True
            self._opened_at = self.clock()

    def record_failure(self, what: str, detail: str) -> bool:
        """A connect failed; True when it (re)opened the breaker: it reached the threshold, or
        it was the half-open probe's. (With ``cooldown_s == 0`` the breaker is half-open at
        once, but the caller still gives up: every batch then probes once.)"""
        with self._lock:
            self._failures += 1
            self._what, self._detail = what, detail
            self._failing = False
            tripped = self._state() == HALF_OPEN or self._failures >= self.threshold
            if tripped:
                self._opened_at = self.clock()
            return tripped

    def outage(self) -> Outage:
        """The failures so far, and how long an open breaker has been and will stay open."""
        with self._lock:
            now = self.clock()
            ago = 0.0 if self._opened_at is None else now - self._opened_at
            left = max(0.0, self.cooldown_s - ago) if self._state() == OPEN else 0.0
            return Outage(
                self._what,
                self._failures,
                self._detail,
                ago_s=ago,
                retry_in_s=left,
                failing=self._failing,
            )


class Attempt:
    """One request attempt as the gate sees it; :meth:`trace` is its httpx ``trace`` hook."""

    def __init__(self, gate: ConnectGate, probe: bool) -> None:
        self.gate = gate
        self.probe = probe  # this attempt holds the gate's one prober place
        self.connecting = False  # the connect stage started (a deadline now means no connect)
        self.settled = False  # connected or failed has been recorded
        self.tripped = False  # its connect failure opened the breaker: give up the batch

    async def trace(self, event: str, info: Any) -> None:
        """httpx's ``trace`` extension: the request being sent proves the endpoint at once,
        so the requests waiting behind a probe go without waiting for its answer."""
        if event.startswith(_SENDING):
            self.gate.connected(self)
        elif event.startswith(_CONNECTING) and event.endswith(".started"):
            self.connecting = True


class ConnectGate:
    """One prober at a time while the endpoint is unproven; everyone while it is proven.

    ``backoff(n)`` is the pause before the probe that follows the ``n``-th (0-based)
    consecutive connect failure: the retries of the requests of a batch share it.
    ``connect_limit_s``: how long a connect may take (for messages)."""

    def __init__(
        self,
        breaker: CircuitBreaker,
        backoff: Callable[[int], float],
        connect_limit_s: float | None = None,
    ) -> None:
        self.breaker = breaker
        self._backoff = backoff
        self.connect_limit_s = connect_limit_s
        self._proven = False  # a connection was made since the last connect failure
        self._prober: Attempt | None = None
        self._turn: asyncio.Event | None = None  # set when the probe settles
        self._next_probe_at = 0.0  # time.monotonic(): backoff after a connect failure

    async def enter(self) -> Attempt:
        """An attempt allowed to connect: at once while the endpoint is proven, else after
        the probe in flight settled. Raises :class:`EndpointUnreachable` while open."""
        while True:
            self._refuse_if_open()
            if self._proven:
                return Attempt(self, probe=False)
            if self._prober is None:
                return await self._probe()
            if self._turn is None:
                self._turn = asyncio.Event()
            await self._turn.wait()

    async def _probe(self) -> Attempt:
        attempt = Attempt(self, probe=True)
        self._prober = attempt
        try:
            await asyncio.sleep(max(0.0, self._next_probe_at - time.monotonic()))
            self._refuse_if_open()  # a request in flight may have opened it meanwhile
        except BaseException:
            self._release(attempt)
            raise
        return attempt

    def _refuse_if_open(self) -> None:
        if self.breaker.state == OPEN:
            raise EndpointUnreachable

    def settle(self, attempt: Attempt, error: BaseException | None) -> str | None:
        """Record how ``attempt`` ended (``error``: what it raised, None for an answer); the
        kind of connect failure it was ("connect timed out", ...), or None."""
        kind = connect_failure(error, attempt)
        if kind is not None:
            self.failed(attempt, kind, describe(error, self.connect_limit_s))
        elif error is None or isinstance(error, httpx.TransportError | TimeoutError):
            self.connected(attempt)  # an answer, or trouble after connecting: reachable
        else:  # cancelled, or a bug before sending: no verdict
            self._release(attempt)
        return kind

    def connected(self, attempt: Attempt) -> None:
        """``attempt`` reached the endpoint: close the breaker, let everyone connect."""
        if attempt.settled:
            return
        attempt.settled = True
        self._proven = True
        self.breaker.record_success()
        self._release(attempt)

    def failed(self, attempt: Attempt, kind: str, detail: str) -> None:
        """``attempt`` could not connect: one prober at a time again, after a backoff."""
        if attempt.settled:
            return
        attempt.settled = True
        self._proven = False
        attempt.tripped = self.breaker.record_failure(kind, detail)
        pause = self._backoff(max(0, self.breaker.failures - 1))
        self._next_probe_at = time.monotonic() + pause
        self._release(attempt)

    def _release(self, attempt: Attempt) -> None:
        if self._prober is not attempt:
            return
        self._prober = None
        if self._turn is not None:
            self._turn.set()
            self._turn = None


def connect_failure(error: BaseException | None, attempt: Attempt) -> str | None:
    """The kind of connect failure ``error`` is, or None when it is not one (an answer, a
    read timeout of a reachable server, ...). The backend's overall deadline (a plain
    ``TimeoutError``) counts when it struck during the connect stage."""
    if isinstance(error, httpx.ConnectTimeout):
        return "connect timed out"
    if isinstance(error, httpx.ConnectError):
        return "connection refused" if "refused" in str(error).lower() else "connect failed"
    if isinstance(error, TimeoutError) and attempt.connecting and not attempt.settled:
        return "connect timed out"
    return None


def describe(error: BaseException | None, connect_limit_s: float | None = None) -> str:
    """``"ConnectError: [Errno 111] Connection refused"``: the exception, never a header; a
    timeout says how long the connect was given (its own text is at best "timed out")."""
    if error is None:
        return ""
    name = type(error).__name__
    if isinstance(error, httpx.ConnectTimeout | TimeoutError) and connect_limit_s is not None:
        return f"{name}: no connection within {connect_limit_s:g} s"
    text = str(error).strip()
    return f"{name}: {text}" if text else name

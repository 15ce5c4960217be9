"""Erasure on a SQLite store: deleted text leaves the database file and its log.

Why more than ``PRAGMA secure_delete``: it zeroes the cells a statement frees, but SQLite's
b-tree rebalancing moves cells between pages and leaves the old bytes in the unallocated gap
of the page they left. A deleted user's earlier row versions (pages are rewritten as they move
between tiers) were found that way in the file after ``delete_user``: in a live ``pages``
leaf, beside other users' rows, where no later statement ever overwrites them. Only a rewrite
of the file (``VACUUM``) drops them. So every erasure ends in one (:meth:`checkpoint`), then
the write-ahead log, which holds the rewritten and the old pages, is folded in and truncated.

A rewrite costs time in proportion to the file (~8 ms a MB on a 2-core machine) and holds the
store lock throughout. So a deletion does not rewrite the file itself: it leaves the rewrite to
the store's erasure thread (a timer), which holds the store lock only, never the engine's, and
the deletion returns at once. Retrievals read memory only, so they go on meanwhile; what waits
is whatever needs the store (a write, a derived round, a ``sources`` lookup). The erasure
thread holds the store's rewrite gate (:mod:`~memoryos_gpu.store.write_gate`) exclusively
around its try (the gate first, then the store lock), and the engine passes that gate before
it takes its own lock for any section that touches the store: a write arriving during a
rewrite waits at the gate, holding nothing, and the retrievals and whatever else holds the
engine lock go on. Before the gate, such a write took the engine lock and then waited for the
store lock: every retrieval waited behind it for the rest of the rewrite (p99 ~1.1-1.3 s).
Only a file of at most :attr:`ERASURE_INLINE_BYTES` (a rewrite of ~10 ms) is rewritten by the
deletion itself (inside the gate, under the engine lock), so it returns with its text out of
the file. Before, every deletion rewrote the file under the engine lock: one page's delete
froze every request for 1.3 s on a 119 MB store, 2.2 s on a 186 MB one.

Rewrites are spaced so that they take at most :attr:`ERASURE_REWRITE_SHARE` of the time: a
deletion that comes sooner after the last rewrite is erased by the next one, on the timer,
with the log's truncation (both retried until done, or done at :meth:`close`). A wait for the
spacing is the schedule, not a problem: logged at DEBUG; a warning says only that the erasure
cannot be done now (a reader holds the log, a rewrite failed). A one-shot process (the CLI's
``delete``) sets :attr:`erase_at_close`: it exits at once, so its erasure is done whole at
close, without the spacing, and only what still cannot be done then (a reader holds the log)
is warned about, with what the operator can do.

A rewrite owed outlives the process that owed it: the deletion records it in the store
(:data:`REWRITE_OWED`, before the deletion commits) and the rewrite clears it. A writer that
opens a store with the mark set -- the rewrite was failed by a full disk, or the process was
killed between the two -- rewrites the file itself (:meth:`resume_erasure`), so the deleted
text does not wait in the file for some later deletion.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from memoryos_gpu.shared_gate import SharedGate
from memoryos_gpu.store.write_gate import NO_REWRITES, NoRewrites

log = logging.getLogger("memoryos_gpu.store")

#: What completes an erasure a store's close could not finish: the log (the rewritten file)
#: is folded into the file and removed when a connection closes with no reader in a
#: transaction (any ``memoryos-gpu`` command's, or the reader's own read-write one).
ERASURE_ADVICE = (
    "to complete the erasure once the reader has finished, run `memoryos-gpu stats` on the "
    "store (its close folds the log into the file and removes it)"
)
#: What completes a truncation of the log that failed for another cause (an I/O error).
_NEXT_CLOSE = "the next command on the store folds the log into the file as it closes"
#: What a rewrite of the file that failed (a full disk: a rewrite needs about the store's size
#: free) leaves, and what completes it: the next writer to open the store (the mark
#: :data:`REWRITE_OWED` says one is owed; a reader's close only folds the log).
REWRITE_ADVICE = (
    "deleted text may stay in the file's free space until the store is next opened for "
    "writing (any memoryos-gpu command but stats, users, export and profile), which "
    "rewrites the file; a rewrite needs free disk space about the size of the store"
)
#: The ``meta`` key that says a rewrite of the file is owed: set before a deletion commits,
#: removed once the file is rewritten.
REWRITE_OWED = "erasure.rewrite_owed"


class SQLiteErasure:
    """The erasure side of :class:`~memoryos_gpu.store.sqlite.SQLiteStore` (a mixin: it uses the
    store's connection ``_db``, its ``_lock``, ``path``, ``_depth`` and ``_check_open``)."""

    _db: Any
    _dbapi: Any
    _lock: threading.RLock
    _closed: bool
    _depth: int
    path: str
    _check_open: Callable[[], None]
    query: Callable[..., list[tuple]]
    transaction: Callable[..., Any]

    #: How long (ms) a truncation of the log waits for its readers before leaving it to a
    #: retry: it holds the store lock meanwhile.
    ERASURE_WAIT_MS: int = 250
    #: The first and the longest wait (s) before a retry.
    ERASURE_RETRY_S: tuple[float, float] = (0.5, 10.0)
    #: The most of the time rewrites of the file may take: the next one waits until the last
    #: one's duration is this share of the time since it began.
    ERASURE_REWRITE_SHARE: float = 0.1
    #: The largest file (bytes) a deletion rewrites itself, under the caller's locks (the
    #: engine's, for an engine's deletion): ~10 ms at 8-12 ms a MB, about one retrieval batch,
    #: and the deletion returns with its text out of the file. A larger file is rewritten by
    #: the erasure thread, under the store lock and the rewrite gate (module docstring).
    ERASURE_INLINE_BYTES: int = 1 << 20
    #: An erasure not done yet (a rewrite or a truncation); retried on a timer.
    _erasure_due: bool = False
    #: A warning said the erasure is not done (an obstacle, not the spacing): its completion
    #: is said at INFO; an erasure that only waited for its turn completes at DEBUG.
    _erasure_warned: bool = False
    #: A deletion committed since the last rewrite of the file.
    _rewrite_due: bool = False
    #: When (``time.monotonic``) the next rewrite may begin.
    _rewrite_at: float = 0.0
    _erasure_timer: threading.Timer | None = None
    #: When (``time.monotonic``) the pending timer fires.
    _erasure_timer_at: float = 0.0
    #: Set by a process that closes the store soon after its deletion and then exits (the
    #: CLI's ``delete``): :meth:`checkpoint` leaves the erasure to :meth:`close`, which does it
    #: whole (the rewrite without the spacing, which is for a long-running engine), rather than
    #: to a timer the process would not live to run.
    erase_at_close: bool = False
    #: Inside :meth:`_erase_at_close`: a failure is final, its warning says what to do.
    _closing: bool = False
    #: Whether the store holds :data:`REWRITE_OWED` (as this object last wrote or read it).
    _owed_marked: bool = False
    #: What a write waits at, outside the engine lock, while the erasure thread rewrites the
    #: file (:mod:`~memoryos_gpu.store.write_gate`): a file store's own gate, set as it
    #: opens; a store that never rewrites a file (``:memory:``, PostgreSQL) never waits.
    rewrite_gate: SharedGate | NoRewrites = NO_REWRITES

    def begin_erasure(self) -> None:
        """Deletions from now on zero the space they free (``PRAGMA secure_delete``), so the
        deleted text does not stay in the database file (call before deleting content,
        outside a transaction). The store records that a rewrite is owed (:data:`REWRITE_OWED`)
        before the deletion commits, so a process that dies or fails before the rewrite
        leaves it to the next writer (:meth:`resume_erasure`)."""
        with self._lock:
            self._check_open()
            self._db.execute("PRAGMA secure_delete = ON")
            if self.path != ":memory:" and not self._owed_marked:
                self._mark_owed(True)

    def resume_erasure(self) -> None:
        """On opening for writing: a rewrite an earlier process owed (:data:`REWRITE_OWED`) is
        owed by this one, done as :meth:`checkpoint` does it (on a timer, or at close for a
        store that closes at once)."""
        with self._lock:
            if not self.query(f"SELECT 1 FROM meta WHERE key = '{REWRITE_OWED}'"):
                return
            self._owed_marked = True
            log.info("%s: rewriting the file for an earlier deletion's erasure", self.path)
            self._rewrite_due = self._erasure_due = True
            self._rewrite_at = 0.0
        self._retry_erasure(self.ERASURE_RETRY_S[0])

    def _mark_owed(self, owed: bool) -> None:
        """Set or clear :data:`REWRITE_OWED` in a transaction of its own."""
        with self.transaction() as db:
            if owed:
                db.execute(
                    f"INSERT INTO meta(key, value) VALUES ('{REWRITE_OWED}', '1') "
                    "ON CONFLICT(key) DO NOTHING"
                )
            else:
                db.execute(f"DELETE FROM meta WHERE key = '{REWRITE_OWED}'")
        self._owed_marked = owed

    def checkpoint(self) -> None:
        """After a committed deletion: the file is to be rewritten (``VACUUM``: the module
        docstring says why) and the write-ahead log folded into it and truncated, so neither
        holds a deleted row's old versions.

        Returns at once: the erasure thread does it, holding the store lock only, as soon as
        the spacing allows (:attr:`ERASURE_REWRITE_SHARE`). The caller may hold the engine
        lock, which every retrieval needs: a rewrite here would hold them all up for as long
        as it takes (seconds on a store of a few hundred MB). Only a file of at most
        :attr:`ERASURE_INLINE_BYTES`, whose rewrite is not due to wait, is rewritten here.

        It follows a committed deletion, so it never fails for the erasure's sake: a caller
        must report the deletion done (and its memory side must not be skipped). The log's
        truncation waits at most :attr:`ERASURE_WAIT_MS` for readers of the log. What cannot
        be done -- a reader still on the log, a transaction open, an error -- is retried on
        the timer, backing off up to :attr:`ERASURE_RETRY_S`, until it is done or the store
        closes (:meth:`_erase_at_close`)."""
        if self.path == ":memory:":
            return
        with self._lock:
            self._check_open()
            self._rewrite_due = True
            if self.erase_at_close:  # done at close, whole (not warned about before then)
                self._erasure_due = True
                return
            tried: float | None = None
            if self._rewrite_inline():
                if self._erase():
                    return
                tried = 0.0
            else:
                self._erasure_tried(False, "left to the erasure thread", scheduled=True)
            wait = self._next_try_in(tried)
        self._retry_erasure(wait)

    def _rewrite_inline(self) -> bool:
        """Whether the rewrite owed is done by the deletion itself: it may begin now and the
        file is small enough (:attr:`ERASURE_INLINE_BYTES`). Under the store lock."""
        if time.monotonic() < self._rewrite_at:
            return False
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        size = self._db.execute("PRAGMA page_size").fetchone()[0]
        return int(pages) * int(size) <= self.ERASURE_INLINE_BYTES

    def _next_try_in(self, last: float | None) -> float:
        """Seconds until the erasure thread's next try: once the rewrite owed may begin (the
        spacing), and backing off from ``last``, the previous wait (None: nothing was tried
        yet, so no backoff). Only a rewrite owed waits for the spacing: a truncation that
        failed after a rewrite (the log busy) used to wait for it too, ten times the rewrite,
        with the rewritten file still in the log."""
        first, longest = self.ERASURE_RETRY_S
        spacing = self._rewrite_at - time.monotonic() if self._rewrite_due else 0.0
        backoff = 0.0 if last is None else min(max(2 * last, first), longest)
        return max(spacing, backoff, 0.0)

    def _erase(self) -> bool:
        """One try of the erasure (under the store lock): whether it is done. Not inside a
        transaction: its commit may still log deleted rows."""
        if self._depth or self._db.in_transaction:
            return self._erasure_tried(False, "a transaction is open", REWRITE_ADVICE)
        if self._rewrite_due:
            if time.monotonic() < self._rewrite_at:
                return self._erasure_tried(False, "the next rewrite is not due", scheduled=True)
            if not self._rewrite():
                return False
        try:
            truncated = self._truncate_log()
        except self._dbapi.Error as exc:
            return self._erasure_tried(False, f"{type(exc).__name__}: {exc}")
        return self._erasure_tried(truncated, "a reader holds the log", ERASURE_ADVICE)

    def _truncate_log(self) -> bool:
        """``wal_checkpoint(TRUNCATE)``, tried again while :attr:`ERASURE_WAIT_MS` lasts:
        whether the log was truncated. SQLite waits (the busy timeout) for readers of the
        log, but not for another connection's checkpoint in progress, and the store's own
        background checkpointer (:mod:`~memoryos_gpu.store.wal`) starts one on the log a
        rewrite leaves, as large as the file: the truncation right after a rewrite found it
        busy, said "a reader holds the log", and left the log that size."""
        deadline = time.monotonic() + self.ERASURE_WAIT_MS / 1000
        while True:
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            with self._busy_timeout(left_ms):
                busy = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            if busy == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def _rewrite(self) -> bool:
        """``VACUUM``: whether it ran; the next one may begin once this one's duration is
        :attr:`ERASURE_REWRITE_SHARE` of the time since it began."""
        t0 = time.monotonic()
        try:
            self._db.execute("VACUUM")
        except self._dbapi.Error as exc:
            why = f"the file could not be rewritten: {type(exc).__name__}: {exc}"
            return self._erasure_tried(False, why, REWRITE_ADVICE)
        took = time.monotonic() - t0
        self._rewrite_due = False
        self._rewrite_at = t0 + took / self.ERASURE_REWRITE_SHARE
        log.debug("%s: the file was rewritten in %.3f s", self.path, took)
        if self._owed_marked:
            try:
                self._mark_owed(False)
            except self._dbapi.Error as exc:  # kept: the next writer rewrites once more
                log.warning("%s: could not record the rewrite done: %s", self.path, exc)
        return True

    def _erasure_tried(
        self, done: bool, why: str = "", advice: str = _NEXT_CLOSE, *, scheduled: bool = False
    ) -> bool:
        """Record a try (``done`` or not, and why not): the first obstacle and the success
        after it are logged, not every retry; ``scheduled``: not done only because the
        rewrite waits for its turn (the spacing, the erasure thread), which is no problem
        (DEBUG: a WARNING every few seconds under steady deletions said otherwise). At close,
        the warning says what completes the erasure for its cause (``advice``): "once the
        reader has finished" was said of a rewrite that a full disk failed, with no reader,
        and of the command it named, which rewrites nothing."""
        if not done and self._closing:
            log.warning(
                "%s: deleted rows may still be in the file or its log (%s) as the store closes; %s",
                self.path,
                why,
                advice,
            )
        elif not done and scheduled:
            log.debug("%s: the erasure waits (%s)", self.path, why)
        elif not done and not self._erasure_warned:
            log.warning(
                "%s: deleted rows may still be in the file or its log (%s); the erasure is retried",
                self.path,
                why,
            )
            self._erasure_warned = True
        elif done and self._erasure_due:
            said = log.info if self._erasure_warned else log.debug
            said("%s: the erasure is done", self.path)
        if done:
            self._erasure_warned = False
        self._erasure_due = not done
        return done

    def _erase_at_close(self) -> None:
        """At close (under the store lock), an erasure still owed: done now, whole, while the
        connection is open: the rewrite (not waiting for the spacing) and the log's
        truncation. What cannot be done (a reader holds the log) is warned about with
        :data:`ERASURE_ADVICE`: no timer retries it after close."""
        if not (self._rewrite_due or self._erasure_due):
            return
        self._rewrite_at = 0.0
        self._closing = True
        try:
            self._erase()
        finally:
            self._closing = False

    @contextmanager
    def _busy_timeout(self, ms: int) -> Iterator[None]:
        """The connection waits at most ``ms`` for a lock while inside (under the store lock)."""
        before = self._db.execute("PRAGMA busy_timeout").fetchone()[0]
        self._db.execute(f"PRAGMA busy_timeout = {int(ms)}")
        try:
            yield
        finally:
            self._db.execute(f"PRAGMA busy_timeout = {int(before)}")

    def _retry_erasure(self, delay: float) -> None:
        """Try the erasure in ``delay`` s on the erasure thread: one timer at a time, moved
        earlier when this try is due sooner (a deletion's rewrite behind a reader's backoff
        would otherwise wait up to :attr:`ERASURE_RETRY_S`)."""
        with self._lock:
            if self._closed:
                return
            at = time.monotonic() + delay
            pending = self._erasure_timer
            if pending is not None:
                if at >= self._erasure_timer_at:
                    return
                pending.cancel()
            timer = threading.Timer(delay, self._erasure_retry_due, args=(delay,))
            timer.name, timer.daemon = "memoryos-erasure", True
            self._erasure_timer, self._erasure_timer_at = timer, at
            timer.start()

    def _erasure_retry_due(self, delay: float) -> None:
        """The erasure thread's try (the store lock only: never the engine's), with the
        rewrite gate to itself: the gate first, then the store lock, so that a write arriving
        meanwhile waits at the gate, before the engine lock (module docstring); never the
        other way round (a user inside the gate may be waiting for the store lock)."""
        if self._erasure_timer is not threading.current_thread():
            return  # replaced (as checked below): no need to hold the writers at the gate
        with self.rewrite_gate.exclusive(), self._lock:
            if self._erasure_timer is not threading.current_thread():
                return  # replaced by an earlier one, which has run or will
            self._erasure_timer = None
            if self._closed or not self._erasure_due or self._erase():
                return
            wait = self._next_try_in(delay)
        self._retry_erasure(wait)

"""The rewrite gate: a write that comes during a rewrite of the file waits outside the engine lock.

Why: a deletion's rewrite of a SQLite file (``VACUUM``, :mod:`~memoryos_gpu.store.erasure`)
holds the store lock for seconds on a large store (~8 ms a MB). The erasure thread that runs
it never takes the engine lock, and retrievals read memory only, so they go on. But an
engine write (an ``add``, a derived round's read or apply, an edit, a deletion, a heat
write-behind) takes the engine lock first and only then waits for the store lock: every
retrieval queued behind it for the rest of the rewrite (p99 ~1.1-1.3 s). So the engine
passes this gate *before* it takes its lock, for every section that touches the store under
it, and the rewrite holds the gate exclusively: a write arriving during a rewrite waits here,
holding nothing, and the retrievals go on.

The gate is a shared/exclusive lock with a waiting rewrite first in line. Users (the engine's
store sections) overlap freely; :meth:`RewriteGate.rewrite` marks a rewrite waiting (new
users wait from then on, so a steady stream of writes cannot starve it), waits until the
users inside have left, runs, then lets everyone in again.

The deadlock rule. A thread never waits at the gate while it holds the engine lock. Else: A,
inside the gate, waits for the engine lock that B holds; B waits at the gate because a
rewrite is waiting; the rewrite waits for A to leave. So

* the engine enters the gate *before* its lock (``EngineState.locked``), and
* a thread that holds the engine lock already (a nested write: ``write_transaction`` inside
  a deletion, the shard engine's methods that take the engine lock themselves, ``close``)
  enters with ``wait=False``: counted in, never waiting, even while a rewrite waits or runs
  (its store statements then wait for the store lock, as before the gate);
* a thread already inside enters again without waiting (a per-thread depth), for the same
  reason: it may hold the engine lock between its two entries;
* a waiting or running rewrite holds no other lock: the erasure thread takes the gate first,
  then the store lock (never the other way round), and never the engine lock.

A thread inside the gate may wait for the engine lock: whoever holds that lock never waits
at the gate, so it goes on and releases it. The inline rewrite of a small file
(``checkpoint``, by the deleting thread, which is inside the gate) and the rewrite at
``close`` (under the engine lock, inside the gate) take no exclusive turn: they hold the store
lock throughout, which is what the other users' statements need anyway.

PostgreSQL and ``:memory:`` stores never rewrite a file: their gate is :data:`NO_REWRITES`,
which never waits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RewriteGate:
    """Many users of the store at once, or one rewrite of its file (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._users = 0  # entries inside (a thread's nested entries each count)
        self._rewrites = 0  # rewrites waiting or running: new users wait while > 0
        self._running = False
        self._local = threading.local()  # .depth: this thread's entries inside

    @contextmanager
    def enter(self, *, wait: bool = True) -> Iterator[None]:
        """Inside the gate for the body: waits while a rewrite runs or waits to run, unless
        ``wait`` is False (the caller holds the engine lock: see the deadlock rule) or this
        thread is inside already."""
        depth = getattr(self._local, "depth", 0)
        with self._cond:
            if wait and not depth:
                while self._rewrites:
                    self._cond.wait()
            self._users += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            with self._cond:
                self._users -= 1
                if not self._users:
                    self._cond.notify_all()

    @contextmanager
    def rewrite(self) -> Iterator[None]:
        """The gate alone for the body (the erasure thread's rewrite): new users wait from
        now on; the body runs once the users inside have left. Call it holding no lock a
        user may wait for (the store's, the engine's), and never from inside the gate."""
        with self._cond:
            self._rewrites += 1
            try:
                while self._users or self._running:
                    self._cond.wait()
            except BaseException:
                self._rewrites -= 1
                self._cond.notify_all()
                raise
            self._running = True
        try:
            yield
        finally:
            with self._cond:
                self._running = False
                self._rewrites -= 1
                self._cond.notify_all()

    @property
    def rewriting(self) -> bool:
        """Whether a rewrite runs or waits to run (new users wait)."""
        return self._rewrites > 0


class NoRewrites:
    """The gate of a store that never rewrites its file: nothing ever waits."""

    rewriting = False

    @contextmanager
    def enter(self, *, wait: bool = True) -> Iterator[None]:
        yield

    @contextmanager
    def rewrite(self) -> Iterator[None]:
        yield


#: The gate of PostgreSQL and ``:memory:`` stores (and of a store without one).
NO_REWRITES = NoRewrites()

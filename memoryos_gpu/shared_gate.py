"""A shared/exclusive gate: many holders at once, or one exclusive turn that goes first.

Why a gate of our own rather than a lock: two places need "many at once, or one alone",
with a waiting exclusive turn first in line, so that a steady stream of shared holders cannot
starve it, and with a thread's nested shared entries never waiting (it may hold something the
exclusive turn's wait depends on):

* the store's rewrite gate (:mod:`~memoryos_gpu.store.write_gate`): the engine's store
  sections share it, the erasure thread's rewrite of the file takes it alone;
* the router of :class:`~memoryos_gpu.distributed.sharding.ShardedEngine`: writes and
  retrievals on single shards share it, a deletion across shards takes it alone.

Each user states its own deadlock rule beside its use.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SharedGate:
    """Many holders at once (:meth:`enter`), or one :meth:`exclusive` turn."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._users = 0  # entries inside (a thread's nested entries each count)
        self._exclusive = 0  # exclusive turns waiting or running: new users wait while > 0
        self._running = False
        self._local = threading.local()  # .depth: this thread's entries inside

    @contextmanager
    def enter(self, *, wait: bool = True) -> Iterator[None]:
        """Inside the gate for the body: waits while an exclusive turn runs or waits to run,
        unless ``wait`` is False (the caller holds something the turn's wait depends on) or
        this thread is inside already."""
        depth = getattr(self._local, "depth", 0)
        with self._cond:
            if wait and not depth:
                while self._exclusive:
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
    def exclusive(self) -> Iterator[None]:
        """The gate alone for the body: new users wait from now on; the body runs once the
        users inside have left. Call it holding no lock a user may wait for, and never from
        inside the gate (it would wait for itself)."""
        with self._cond:
            self._exclusive += 1
            try:
                while self._users or self._running:
                    self._cond.wait()
            except BaseException:
                self._exclusive -= 1
                self._cond.notify_all()
                raise
            self._running = True
        try:
            yield
        finally:
            with self._cond:
                self._running = False
                self._exclusive -= 1
                self._cond.notify_all()

    @property
    def exclusive_waiting(self) -> bool:
        """Whether an exclusive turn runs or waits to run (new users wait)."""
        return self._exclusive > 0

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

The gate is a :class:`~memoryos_gpu.shared_gate.SharedGate`, a shared/exclusive lock with a
waiting exclusive turn first in line. Users (the engine's store sections) overlap freely; the
rewrite takes the exclusive turn: new users wait from then on (so a steady stream of writes
cannot starve it), it waits until the users inside have left, runs, then lets everyone in.

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

from collections.abc import Iterator
from contextlib import contextmanager


class NoRewrites:
    """The gate of a store that never rewrites its file: nothing ever waits."""

    exclusive_waiting = False

    @contextmanager
    def enter(self, *, wait: bool = True) -> Iterator[None]:
        yield

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        yield


#: The gate of PostgreSQL and ``:memory:`` stores (and of a store without one).
NO_REWRITES = NoRewrites()

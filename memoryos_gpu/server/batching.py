"""Micro-batching of requests into engine calls.

A :class:`MicroBatcher` owns a FIFO of submitted items and one collector task on the event
loop. The collector waits until the oldest item has waited ``max_wait`` (or ``max_batch`` items
are queued), then hands up to ``max_batch`` items to a synchronous batch function on a dedicated
executor (never on the event loop). Items arriving while a batch runs form the next batch, so
batches grow with load and a lone request pays at most ``max_wait``.

The queue is bounded by *admitted* weight (queued plus being processed): past ``limit`` a
submit raises :class:`Overloaded` at once instead of queueing without bound.

:class:`FairBatcher` is the write queue's: one FIFO per tenant, served round robin in chunks,
so one tenant's large requests do not hold up another tenant's small ones.

Both hold only their queueing policy; the lifecycle (collector task, drain, admission checks,
the executor call of ``fn`` and its counters) is their common base's, :class:`_Batcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("memoryos_gpu.server")


class Overloaded(Exception):
    """A bounded queue is full; retry after ``retry_after`` seconds. ``status``: 503 when the
    server as a whole is full, 429 when it is the caller's own share of a queue."""

    def __init__(self, queue: str, retry_after: int = 1, *, status: int = 503) -> None:
        super().__init__(f"the {queue} queue is full; retry later")
        self.queue = queue
        self.retry_after = retry_after
        self.status = status


class Unavailable(Exception):
    """The service is starting or shutting down; retry after ``retry_after`` seconds.

    ``public``: the message for a tenant of a server with API keys, when the message names
    internal details (a failed load's error names the store's file or database host and the
    exception): the operator reads those in the log and the admin's ``/v1/stats``."""

    def __init__(self, message: str, retry_after: int = 1, *, public: str | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.public = public if public is not None else message


def check_state(
    state: str, error: str | None, what: str, retry_after: int, *, plural: bool = False
) -> None:
    """Raise :class:`Unavailable` unless a service in lifecycle ``state`` (created -> starting
    -> ready -> closing -> closed | failed) can take requests; ``what`` names what loads
    ("the engine", "the shards"). Shared by the single-box and the Ray router services."""
    if state == "ready":
        return
    if state in ("created", "starting"):
        loading = f"{what} {'are' if plural else 'is'} still loading"
        why = f" ({error})" if error else ""  # e.g. waiting for its store
        raise Unavailable(f"{loading}{why}", retry_after, public=loading)
    if state == "failed":
        raise Unavailable(f"{what} failed to load: {error}", 30, public=failed_publicly(what))
    raise Unavailable("the server is shutting down", retry_after)


def failed_publicly(what: str = "the engine") -> str:
    """A failed load as a tenant of a server with API keys reads it: no path, host or error."""
    return (
        f"{what} failed to load (the server's log says why); not retried: fix it and restart "
        "the server"
    )


@dataclass
class _Entry:
    item: Any
    weight: int
    future: asyncio.Future
    t: float
    context: Any = field(default=None)
    key: str | None = None  # whose share of the queue it takes (MicroBatcher's key_limit)


BatchFn = Callable[[list[Any]], Sequence[Any]]


class _Batcher:
    """The lifecycle both batchers share: a collector task on the event loop (``start``), a
    ``drain`` that refuses new items and finishes the admitted ones, the admission checks
    (shutting down: :class:`Unavailable`; over ``limit`` admitted weight: :class:`Overloaded`)
    and one call of ``fn`` on ``executor`` (a failure or a miscounted result becomes each
    item's error; the counters and ``on_batch`` see every call). A subclass holds its queueing
    policy: ``enqueue`` and the collector ``_run``."""

    def __init__(
        self,
        name: str,
        fn: BatchFn,
        *,
        executor: Executor,
        max_batch: int,
        max_wait_s: float,
        limit: int,
        retry_after: int = 1,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        self.name = name
        self._fn = fn
        self._executor = executor
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.limit = limit
        self.retry_after = retry_after
        self._on_batch = on_batch
        self.admitted = 0  # weight queued + in running batches
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self.batches = 0
        self.items = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"batch-{self.name}")

    async def drain(self) -> None:
        """Refuse new items, finish every admitted one, stop the collector."""
        self._closing = True
        if self._wake is not None:
            self._wake_all()
        if self._task is not None:
            await self._task

    def _wake_all(self) -> None:
        """Wake the collector from whatever it waits on (``drain``: it has to see closing)."""
        self._wake.set()  # type: ignore[union-attr]

    async def _run(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ admission
    def _check_open(self) -> None:
        if self._closing or self._task is None:
            raise Unavailable("the server is shutting down", self.retry_after)

    def _check_limit(self, weight: int) -> None:
        """Past ``limit``: :class:`Overloaded` (503), unless the queue is empty (an item larger
        than the limit alone is still served)."""
        if self.admitted + weight > self.limit and self.admitted > 0:
            raise Overloaded(self.name, self.retry_after)

    # ------------------------------------------------------------------ one call of fn
    async def _call(self, items: list[Any], weight: int) -> Sequence[Any]:
        """``fn(items)`` on the executor: one result or ``Exception`` per item."""
        t0 = time.perf_counter()
        try:
            results: Sequence[Any] = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._fn, items
            )
            if len(results) != len(items):  # a bug in fn: fail loudly, per item
                raise RuntimeError(f"{self.name}: {len(results)} results for {len(items)}")
        except Exception as exc:  # the batch function itself failed
            log.exception("%s batch of %d failed", self.name, len(items))
            results = [exc] * len(items)
        self.batches += 1
        self.items += weight
        if self._on_batch is not None:
            self._on_batch(weight, time.perf_counter() - t0)
        return results


class MicroBatcher(_Batcher):
    """Gather items into batches for ``fn`` (``fn(items) -> results``, one result or
    ``Exception`` per item, run on ``executor``).

    Items whose submitter went away before their batch ran are dropped (reads; the write
    queue is a :class:`FairBatcher`, which runs every admitted item).

    ``key_limit``: the most weight one key (a tenant) may have admitted at once, past which
    its items are :class:`Overloaded` with 429 (its own share) while other keys' are still
    admitted. Why: one tenant's large retrieval requests, within their rate limits, filled the
    whole queue and other tenants' retrievals got 503 (a security sweep: 20 % of them).
    """

    def __init__(self, name: str, fn: BatchFn, *, key_limit: int | None = None, **kw: Any) -> None:
        """``kw``: :class:`_Batcher`'s (``executor``, ``max_batch``, ``max_wait_s``, ``limit``,
        ``retry_after``, ``on_batch``)."""
        super().__init__(name, fn, **kw)
        self.key_limit = key_limit
        self._by_key: dict[str, int] = {}  # key -> weight admitted (queued or running)
        self._queue: deque[_Entry] = deque()
        self._queued_weight = 0
        self._full: asyncio.Event | None = None  # set once max_batch weight is queued

    def start(self) -> None:
        self._full = asyncio.Event()
        super().start()

    def _wake_all(self) -> None:
        super()._wake_all()
        self._full.set()  # type: ignore[union-attr]

    # ------------------------------------------------------------------ submit
    def enqueue(self, item: Any, weight: int = 1, key: str | None = None) -> asyncio.Future:
        """Admit an item under ``key`` (or raise :class:`Overloaded` / :class:`Unavailable` at
        once); the returned future resolves when its batch ran."""
        self._check_open()
        if self.key_limit is None:
            key = None
        mine = self._by_key.get(key, 0) if key is not None else 0
        if mine and mine + weight > self.key_limit:  # type: ignore[operator]
            raise Overloaded(f"{self.name} (this tenant's share)", self.retry_after, status=429)
        self._check_limit(weight)
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(_Entry(item, weight, fut, time.monotonic(), key=key))
        self._queued_weight += weight
        self.admitted += weight
        if key is not None:
            self._by_key[key] = mine + weight
        self._wake.set()  # type: ignore[union-attr]
        if self._queued_weight >= self.max_batch:
            self._full.set()  # type: ignore[union-attr]
        return fut

    async def submit(self, item: Any, weight: int = 1, key: str | None = None) -> Any:
        return await self.enqueue(item, weight, key)

    def _release(self, e: _Entry) -> None:
        """An entry leaves the queue's admitted weight (answered, or its submitter gone)."""
        self.admitted -= e.weight
        if e.key is not None:
            left = self._by_key[e.key] - e.weight
            if left:
                self._by_key[e.key] = left
            else:
                del self._by_key[e.key]

    # ------------------------------------------------------------------ collector
    async def _run(self) -> None:
        assert self._wake is not None and self._full is not None
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            remaining = self._queue[0].t + self.max_wait_s - time.monotonic()
            if remaining > 0 and self._queued_weight < self.max_batch and not self._closing:
                self._full.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), remaining)
            batch = self._take()
            if not batch:
                continue
            results = await self._call([e.item for e in batch], sum(e.weight for e in batch))
            for e, r in zip(batch, results, strict=True):
                self._release(e)
                if e.future.done():
                    continue
                if isinstance(r, BaseException):
                    e.future.set_exception(r)
                else:
                    e.future.set_result(r)

    def _take(self) -> list[_Entry]:
        """The oldest entries within ``max_batch`` weight (at least one), less those whose
        submitter went away."""
        batch: list[_Entry] = []
        weight = 0
        while self._queue and (not batch or weight + self._queue[0].weight <= self.max_batch):
            e = self._queue.popleft()
            self._queued_weight -= e.weight
            if e.future.cancelled():
                self._release(e)
                continue
            batch.append(e)
            weight += e.weight
        return batch


# ====================================================================== fair (per tenant) queue
class ChunkFailed(Exception):
    """A chunk of a split request failed: the chunks before it were committed (``done``: their
    results, in order), the ones after it were not run. ``cause`` is the chunk's error."""

    def __init__(self, done: list[Any], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.done = done
        self.cause = cause


@dataclass
class _Group:
    """One request, split into chunks: the caller waits on ``future`` for all of them."""

    future: asyncio.Future
    left: int
    results: list[Any]
    failed: BaseException | None = None


@dataclass
class _Chunk:
    key: str
    group: _Group
    index: int
    item: Any
    weight: int
    size: int
    t: float


class FairBatcher(_Batcher):
    """Batches of ``fn`` served round robin over keys (tenants), on several lanes.

    Each key has its own FIFO of chunks (a large request is split by the caller into chunks:
    the unit of interleaving). A batch takes chunks key by key in turn, at most ``max_batch``
    weight (pages) and ``max_size`` size (characters), and always at least one chunk; so one
    key's backlog waits behind at most one of its chunks per turn of the others. Batches run on
    ``executor`` ``lanes`` at a time, and a key is in one running batch at most: its chunks run
    in order, one after the other (a user's pages keep their order), while another key's batch
    runs beside it. Admission is bounded per key (``key_limit`` weight, ``key_size_limit``
    size) and overall (``limit`` weight): past them :class:`Overloaded` at once.

    Every admitted chunk runs, even if its caller went away (writes: acknowledged or not, an
    admitted page is committed), except the chunks after a failed chunk of the same request.
    """

    def __init__(
        self,
        name: str,
        fn: BatchFn,
        *,
        lanes: int,
        max_size: int,
        key_limit: int,
        key_size_limit: int,
        **kw: Any,
    ) -> None:
        """``kw``: :class:`_Batcher`'s (``executor``, ``max_batch``, ``max_wait_s``, ``limit``,
        ``retry_after``, ``on_batch``)."""
        super().__init__(name, fn, **kw)
        self.lanes = lanes
        self.max_size = max_size
        self.key_limit = key_limit
        self.key_size_limit = key_size_limit
        self._queues: dict[str, deque[_Chunk]] = {}  # insertion order = round-robin order
        self._busy: set[str] = set()
        self._admitted: dict[str, list[int]] = {}  # key -> [weight, size] queued or running
        self._running = 0
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ submit
    def enqueue(self, key: str, chunks: Sequence[tuple[Any, int, int]]) -> asyncio.Future:
        """Admit one request's chunks ``(item, weight, size)`` under ``key`` (or raise
        :class:`Overloaded` / :class:`Unavailable` at once). The future resolves to the list
        of the chunks' results, or raises :class:`ChunkFailed` (or a lone chunk's error)."""
        self._check_open()
        weight = sum(c[1] for c in chunks)
        size = sum(c[2] for c in chunks)
        mine = self._admitted.setdefault(key, [0, 0])
        if mine[0] and (mine[0] + weight > self.key_limit or mine[1] + size > self.key_size_limit):
            raise Overloaded(f"{self.name} (this tenant's share)", self.retry_after, status=429)
        self._check_limit(weight)
        loop = asyncio.get_running_loop()
        group = _Group(loop.create_future(), len(chunks), [None] * len(chunks))
        now = time.monotonic()
        q = self._queues.setdefault(key, deque())
        for i, (item, w, sz) in enumerate(chunks):
            q.append(_Chunk(key, group, i, item, w, sz, now))
        mine[0] += weight
        mine[1] += size
        self.admitted += weight
        self._wake.set()  # type: ignore[union-attr]
        return group.future

    # ------------------------------------------------------------------ collector
    def _ready(self) -> list[str]:
        return [k for k, q in self._queues.items() if q and k not in self._busy]

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            ready = self._ready()
            if not ready or self._running >= self.lanes:
                if self._closing and not any(self._queues.values()) and not self._running:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            oldest = min(self._queues[k][0].t for k in ready)
            queued = sum(c.weight for k in ready for c in self._queues[k])
            remaining = oldest + self.max_wait_s - time.monotonic()
            if remaining > 0 and queued < self.max_batch and not self._closing:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), remaining)
                continue
            batch = self._take()
            if batch:
                self._running += 1
                task = asyncio.get_running_loop().create_task(self._execute(batch))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Chunk]:
        """One batch: chunks of the ready keys in turn (round robin, oldest key first after the
        last batch's), within ``max_batch`` and ``max_size``; at least one chunk. At most one
        chunk of a request: its next chunk runs only once this one succeeded."""
        batch: list[_Chunk] = []
        groups: set[int] = set()
        weight = size = 0
        progress = True
        while progress:
            progress = False
            for key in self._ready():
                q = self._queues[key]
                while q and q[0].group.failed is not None:  # after a failed chunk: not run
                    self._settle(q.popleft(), None)
                if not q or id(q[0].group) in groups:
                    continue
                c = q[0]
                if batch and (weight + c.weight > self.max_batch or size + c.size > self.max_size):
                    continue
                groups.add(id(c.group))
                batch.append(q.popleft())
                weight, size = weight + c.weight, size + c.size
                progress = True
        for key in {c.key for c in batch}:
            self._busy.add(key)
            self._queues[key] = self._queues.pop(key)  # served: to the back of the turn
        return batch

    async def _execute(self, batch: list[_Chunk]) -> None:
        results = await self._call([c.item for c in batch], sum(c.weight for c in batch))
        for c, r in zip(batch, results, strict=True):
            self._settle(c, r)
        for key in {c.key for c in batch}:
            self._busy.discard(key)
        self._running -= 1
        self._wake.set()  # type: ignore[union-attr]

    def _settle(self, c: _Chunk, result: Any) -> None:
        """Account one chunk as done (``result``: its result or error; None: skipped after a
        failed chunk) and resolve its request once every chunk is."""
        mine = self._admitted[c.key]
        mine[0] -= c.weight
        mine[1] -= c.size
        self.admitted -= c.weight
        if not mine[0] and not self._queues.get(c.key) and c.key not in self._busy:
            self._admitted.pop(c.key, None)
        g = c.group
        if isinstance(result, BaseException) and g.failed is None:
            g.failed = result
            g.results = g.results[: c.index]
        elif g.failed is None:
            g.results[c.index] = result
        g.left -= 1
        if g.left or g.future.done():
            return
        if g.failed is None:
            g.future.set_result(g.results)
        elif g.results:  # some chunks were committed before the failure
            g.future.set_exception(ChunkFailed(g.results, g.failed))
        else:
            g.future.set_exception(g.failed)

    def depth(self) -> dict[str, int]:
        """Weight admitted per key (queued or running)."""
        return {k: v[0] for k, v in self._admitted.items() if v[0]}

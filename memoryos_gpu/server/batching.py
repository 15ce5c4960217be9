"""Micro-batching of requests into engine calls.

A :class:`MicroBatcher` owns a FIFO of submitted items and one collector task on the event
loop. The collector waits until the oldest item has waited ``max_wait`` (or ``max_batch`` items
are queued), then hands up to ``max_batch`` items to a synchronous batch function on a dedicated
executor (never on the event loop). Items arriving while a batch runs form the next batch, so
batches grow with load and a lone request pays at most ``max_wait``.

The queue is bounded by *admitted* weight (queued plus being processed): past ``limit`` a
submit raises :class:`Overloaded` at once instead of queueing without bound.
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
    """A bounded queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, queue: str, retry_after: int = 1) -> None:
        super().__init__(f"the {queue} queue is full; retry later")
        self.queue = queue
        self.retry_after = retry_after


class Unavailable(Exception):
    """The service is starting or shutting down; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def check_state(
    state: str, error: str | None, what: str, retry_after: int, *, plural: bool = False
) -> None:
    """Raise :class:`Unavailable` unless a service in lifecycle ``state`` (created -> starting
    -> ready -> closing -> closed | failed) can take requests; ``what`` names what loads
    ("the engine", "the shards"). Shared by the single-box and the Ray router services."""
    if state == "ready":
        return
    if state in ("created", "starting"):
        raise Unavailable(f"{what} {'are' if plural else 'is'} still loading", retry_after)
    if state == "failed":
        raise Unavailable(f"{what} failed to load: {error}", 30)
    raise Unavailable("the server is shutting down", retry_after)


@dataclass
class _Entry:
    item: Any
    weight: int
    future: asyncio.Future
    t: float
    context: Any = field(default=None)


BatchFn = Callable[[list[Any]], Sequence[Any]]


class MicroBatcher:
    """Gather items into batches for ``fn`` (``fn(items) -> results``, one result or
    ``Exception`` per item, run on ``executor``).

    ``process_cancelled``: run items whose submitter went away anyway (writes: an accepted
    page is committed even if the client disconnected), or drop them (reads).
    """

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
        process_cancelled: bool = False,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        self.name = name
        self._fn = fn
        self._executor = executor
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.limit = limit
        self.retry_after = retry_after
        self.process_cancelled = process_cancelled
        self._on_batch = on_batch
        self._queue: deque[_Entry] = deque()
        self._queued_weight = 0
        self.admitted = 0  # queued + in the running batch
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._full: asyncio.Event | None = None
        self._closing = False
        self.batches = 0
        self.items = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"batch-{self.name}")

    async def drain(self) -> None:
        """Refuse new items, finish every admitted one, stop the collector."""
        self._closing = True
        if self._wake is not None:
            self._wake.set()
            self._full.set()  # type: ignore[union-attr]
        if self._task is not None:
            await self._task

    # ------------------------------------------------------------------ submit
    def enqueue(self, item: Any, weight: int = 1) -> asyncio.Future:
        """Admit an item (or raise :class:`Overloaded` / :class:`Unavailable` at once); the
        returned future resolves when its batch ran."""
        if self._closing or self._task is None:
            raise Unavailable("the server is shutting down", self.retry_after)
        if self.admitted + weight > self.limit and self.admitted > 0:
            raise Overloaded(self.name, self.retry_after)
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(_Entry(item, weight, fut, time.monotonic()))
        self._queued_weight += weight
        self.admitted += weight
        self._wake.set()  # type: ignore[union-attr]
        if self._queued_weight >= self.max_batch:
            self._full.set()  # type: ignore[union-attr]
        return fut

    async def submit(self, item: Any, weight: int = 1) -> Any:
        fut = self.enqueue(item, weight)
        if self.process_cancelled:
            # the batch runs even if this request is cancelled; the caller sees the result
            return await asyncio.shield(fut)
        return await fut

    # ------------------------------------------------------------------ collector
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
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
            batch: list[_Entry] = []
            weight = 0
            while self._queue and (not batch or weight + self._queue[0].weight <= self.max_batch):
                e = self._queue.popleft()
                self._queued_weight -= e.weight
                if e.future.cancelled() and not self.process_cancelled:
                    self.admitted -= e.weight
                    continue
                batch.append(e)
                weight += e.weight
            if not batch:
                continue
            t0 = time.perf_counter()
            try:
                results: Sequence[Any] = await loop.run_in_executor(
                    self._executor, self._fn, [e.item for e in batch]
                )
                if len(results) != len(batch):  # a bug in fn: fail loudly, per item
                    raise RuntimeError(f"{self.name}: {len(results)} results for {len(batch)}")
            except Exception as exc:  # the batch function itself failed
                log.exception("%s batch of %d failed", self.name, len(batch))
                results = [exc] * len(batch)
            dt = time.perf_counter() - t0
            self.batches += 1
            self.items += weight
            if self._on_batch is not None:
                self._on_batch(weight, dt)
            for e, r in zip(batch, results, strict=True):
                self.admitted -= e.weight
                if e.future.done():
                    continue
                if isinstance(r, BaseException):
                    e.future.set_exception(r)
                else:
                    e.future.set_result(r)

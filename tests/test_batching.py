"""The lifecycle both batchers share (:class:`~memoryos_gpu.server.batching._Batcher`): drain
finishes what was admitted and refuses the rest, admission is bounded, a failing or miscounting
batch function fails each item (not the collector), and every call is counted. The queueing
policies themselves are tested in test_fair_queues.py (fair) and test_server.py (micro)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from memoryos_gpu.server.batching import FairBatcher, MicroBatcher, Overloaded, Unavailable

Make = Callable[..., Any]


def _micro(fn: Any, ex: Any, **kw: Any) -> tuple[MicroBatcher, Callable[[str], Any]]:
    opts: dict[str, Any] = dict(executor=ex, max_batch=4, max_wait_s=0.0, limit=6)
    b = MicroBatcher("read", fn, **{**opts, **kw})
    return b, lambda item: b.enqueue(item, 1)


def _fair(fn: Any, ex: Any, **kw: Any) -> tuple[FairBatcher, Callable[[str], Any]]:
    opts: dict[str, Any] = dict(
        executor=ex, lanes=2, max_batch=4, max_size=100, max_wait_s=0.0, limit=6
    )
    opts.update(key_limit=100, key_size_limit=1000)
    b = FairBatcher("write", fn, **{**opts, **kw})

    async def first(fut: asyncio.Future) -> Any:  # one chunk per request: one result
        return (await fut)[0]

    # keyed by the item's first letter: "a1", "a2" are one tenant's, in order
    return b, lambda item: asyncio.ensure_future(first(b.enqueue(item[:1], [(item, 1, 1)])))


BATCHERS = pytest.mark.parametrize("make", [_micro, _fair], ids=["micro", "fair"])


@BATCHERS
def test_drain_finishes_admitted_items_then_refuses(make: Make) -> None:
    gate = threading.Event()
    seen: list[tuple[int, float]] = []

    def fn(items: list[str]) -> list[str]:
        gate.wait(10)
        return [i.upper() for i in items]

    async def main() -> None:
        with ThreadPoolExecutor(2) as ex:
            b, submit = make(fn, ex, on_batch=lambda n, s: seen.append((n, s)))
            with pytest.raises(Unavailable):  # not started: no collector to serve it
                submit("early")
            b.start()
            futs = [submit(x) for x in ("a1", "b1", "a2")]
            await asyncio.sleep(0.05)
            drained = asyncio.ensure_future(b.drain())
            await asyncio.sleep(0.05)
            with pytest.raises(Unavailable, match="shutting down"):
                submit("late")
            assert not drained.done()  # still waiting for the held batch
            gate.set()
            await drained
            assert [f.result() for f in futs] == ["A1", "B1", "A2"]
            assert b.admitted == 0 and b.items == 3 == sum(n for n, _ in seen)
            assert b.batches == len(seen) >= 1

    asyncio.run(main())


@BATCHERS
def test_admission_is_bounded_by_the_limit(make: Make) -> None:
    gate = threading.Event()

    def fn(items: list[str]) -> list[str]:
        gate.wait(10)
        return items

    async def main() -> None:
        with ThreadPoolExecutor(2) as ex:
            b, submit = make(fn, ex, limit=2)
            b.start()
            futs = [submit("a1"), submit("b1")]
            await asyncio.sleep(0)
            with pytest.raises(Overloaded) as info:
                submit("c1")
            assert info.value.status == 503 and info.value.queue == b.name
            gate.set()
            assert await asyncio.gather(*futs) == ["a1", "b1"]
            await b.drain()

    asyncio.run(main())


@BATCHERS
@pytest.mark.parametrize("failure", ["raises", "miscounts"])
def test_a_failing_batch_fails_its_items_and_the_queue_goes_on(make: Make, failure: str) -> None:
    calls = []

    def fn(items: list[str]) -> list[str]:
        calls.append(items)
        if len(calls) == 1:
            if failure == "raises":
                raise OSError("disk full")
            return items + items  # twice the results
        return items

    async def main() -> None:
        with ThreadPoolExecutor(1) as ex:
            b, submit = make(fn, ex)
            b.start()
            first = submit("a1")
            with pytest.raises((OSError, RuntimeError), match=r"disk full|results for"):
                await first
            assert await submit("a2") == "a2"  # the collector survived
            await b.drain()
            assert b.batches == 2 and b.admitted == 0

    asyncio.run(main())

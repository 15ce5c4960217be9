"""Fair queues: one tenant's large writes do not stall another tenant's small ones.

The write queue keeps one FIFO per tenant, served round robin in chunks on several lanes;
rate limits count body bytes and written pages as well as requests; derived-work rounds take
tenants in turn. The end-to-end test runs a real server process and measures a light tenant's
one-page write latency, idle and while a heavy tenant's largest allowed request is in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from store_backends import Backend

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.server.batching import ChunkFailed, FairBatcher, Overloaded
from memoryos_gpu.server.service import split_pages, tenant_of
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import PageInput

ROOT = Path(__file__).resolve().parents[1]


# ====================================================================== the fair batcher (unit)
def _batcher(fn: Any, executor: Any, **kw: Any) -> FairBatcher:
    opts: dict[str, Any] = dict(
        executor=executor,
        lanes=1,
        max_batch=100,
        max_size=10,
        max_wait_s=0.0,
        limit=1000,
        key_limit=100,
        key_size_limit=1000,
    )
    opts.update(kw)
    return FairBatcher("write", fn, **opts)


def test_tenants_take_turns_chunk_by_chunk() -> None:
    """A's five chunks queued before B's one: B is served after A's first chunk, not its last."""
    from concurrent.futures import ThreadPoolExecutor

    calls: list[list[str]] = []

    def fn(items: list[str]) -> list[str]:
        calls.append(list(items))
        time.sleep(0.01)
        return [f"done {i}" for i in items]

    async def main() -> None:
        with ThreadPoolExecutor(1) as ex:
            b = _batcher(fn, ex)
            b.start()
            fa = b.enqueue("A", [(f"a{i}", 1, 10) for i in range(5)])  # each chunk fills a call
            fb = b.enqueue("B", [("b0", 1, 1)])
            assert await fa == [f"done a{i}" for i in range(5)]  # in order, all of them
            assert await fb == ["done b0"]
            await b.drain()

    asyncio.run(main())
    flat = [i for c in calls for i in c]
    assert flat.index("b0") <= 2, calls  # at most one of A's chunks (plus the one in flight)
    assert [i for i in flat if i.startswith("a")] == [f"a{i}" for i in range(5)]


def test_a_failed_chunk_stops_its_request_and_says_what_was_committed() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def fn(items: list[str]) -> list[Any]:
        return [ValueError("disk full") if i == "a1" else f"ok {i}" for i in items]

    async def main() -> None:
        with ThreadPoolExecutor(1) as ex:
            b = _batcher(fn, ex)
            b.start()
            fut = b.enqueue("A", [("a0", 1, 10), ("a1", 1, 10), ("a2", 1, 10)])
            with pytest.raises(ChunkFailed) as info:
                await fut
            assert info.value.done == ["ok a0"] and "disk full" in str(info.value.cause)
            lone = b.enqueue("A", [("a1", 1, 1)])
            with pytest.raises(ValueError, match="disk full"):  # nothing committed: as is
                await lone
            assert b.admitted == 0 and b.depth() == {}
            await b.drain()

    asyncio.run(main())


def test_a_tenants_share_of_the_queue_is_bounded() -> None:
    from concurrent.futures import ThreadPoolExecutor

    async def main() -> None:
        with ThreadPoolExecutor(1) as ex:
            b = _batcher(lambda items: items, ex, key_limit=3, max_wait_s=10.0)
            b.start()
            b.enqueue("A", [("a", 3, 1)])
            with pytest.raises(Overloaded) as info:
                b.enqueue("A", [("a", 1, 1)])
            assert info.value.status == 429 and "this tenant's share" in str(info.value)
            b.enqueue("B", [("b", 3, 1)])  # another tenant still gets in
            await b.drain()

    asyncio.run(main())


def test_split_pages_by_count_and_characters() -> None:
    pages = [PageInput("t/u", "x" * n, "") for n in (10, 10, 50, 5, 5, 5)]
    assert [len(c) for c in split_pages(pages, 2, 30)] == [2, 1, 2, 1]
    assert [len(c) for c in split_pages(pages, 100, 1)] == [1] * 6  # a chunk holds one page
    assert tenant_of("acme/alice") == "acme" and tenant_of("alice") == ""


def test_settings_keep_the_largest_allowed_request_servable() -> None:
    with pytest.raises(ValueError, match="rate_limit_bytes_burst"):
        ServerSettings(rate_limit_bytes_burst=1024 * 1024)  # < max_body_bytes
    with pytest.raises(ValueError, match="rate_limit_pages_burst"):
        ServerSettings(rate_limit_pages_burst=10)  # < max_batch_items
    ServerSettings(rate_limit_pages_burst=10, rate_limit_pages_per_s=0)  # disabled: fine


# ====================================================================== derived work
def test_derived_rounds_take_tenants_in_turn(backend: Backend) -> None:
    """Tenant a has five users with older pending pages than tenant b's one user: b's page is
    in the first round anyway, second after a's oldest."""
    cfg = EngineConfig(embedder="hashing", store=backend.spec("turns"), auto_process=False)
    e = MemoryEngine(cfg)
    try:
        cap = e.config.memory.stm_capacity
        e.add_many(
            [
                {"user_id": f"a/u{i}", "user_input": f"a {j}"}
                for j in range(cap + 2)
                for i in range(5)
            ]
        )
        e.add_many([{"user_id": "b/u", "user_input": f"b {j}"} for j in range(cap + 2)])
        first = [w[1] for w in e.store.pending_round("page", 3)]
        assert first == ["a/u0", "b/u", "a/u1"]
        e.process_pending()
        assert e.pending_count() == 0
    finally:
        e.close()


# ====================================================================== end to end
HEAVY_KEY, LIGHT_KEY = "heavy-key-0123456789", "light-key-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Conn:
    """One keep-alive HTTP/1.1 connection (a minimal client: httpx's CPU per request would
    load the small box it measures)."""

    def __init__(self, port: int, key: str) -> None:
        self.port, self.key = port, key
        self._rw: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self._rw is None:
            self._rw = await asyncio.open_connection("127.0.0.1", self.port)
        r, w = self._rw
        w.write(
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        await w.drain()
        head = await r.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        return int(head.split()[1]), await r.readexactly(length)

    def close(self) -> None:
        if self._rw is not None:
            self._rw[1].close()
            self._rw = None


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


@pytest.mark.slow
def test_light_tenant_writes_stay_fast_beside_a_heavy_tenant(tmp_path: Path) -> None:
    """The heavy tenant sends its largest allowed request (pages of 100,000 characters up to
    the body limit, 3 MiB here to keep the test short) and keeps one more waiting (its queue
    share allows one; the rest are 429 and retried); meanwhile the light tenant's one-page
    writes must stay under 100 ms at the 95th percentile (see the bound below). Derived work
    is off: its rounds run under the engine lock (issue 15, item 1), and
    benchmarks/tenant_fairness.py measures them too.
    Only light writes sent and answered while a heavy request was in flight count (two windows
    of 40, the better one judged), and every heavy page must be committed in the end."""
    port = _free_port()
    limit = 3 * 1024 * 1024
    settings = dict(
        max_body_bytes=limit,
        tenant_write_queue_chars=limit,
        derived_enabled=False,
    )
    code = (
        "import json, sys; from memoryos_gpu.server.app import run; run(**json.loads(sys.argv[1]))"
    )
    spec = {
        "store": str(tmp_path / "store"),
        "host": "127.0.0.1",
        "port": port,
        "api_keys": {HEAVY_KEY: "heavy", LIGHT_KEY: "light"},
        "embedder": "hashing",
        "log_level": "warning",
        **settings,
    }
    env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_API_KEYS"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT, env=env, stderr=subprocess.PIPE
    )
    text = " ".join(f"word{i % 997}" for i in range(12_500))[:100_000]
    n_pages = (limit - 1000) // (len(text) + 40)
    heavy = json.dumps(
        {"pages": [{"user_id": f"h{i}", "user_input": text} for i in range(n_pages)]}
    ).encode()
    assert len(heavy) <= limit

    conn = _Conn(port, LIGHT_KEY)

    async def light(n: int, tag: str) -> list[float]:
        out = []
        for i in range(n):
            body = json.dumps({"user_input": f"{tag} page {i}"}).encode()
            t0 = time.perf_counter()
            status, _ = await conn.post(f"/v1/users/l{i % 4}/pages", body)
            out.append(time.perf_counter() - t0)
            assert status == 201
            await asyncio.sleep(0.03)
        return out

    async def main() -> tuple[list[float], list[float], list[int]]:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "server not ready"
            try:
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
                ready = b" 200 " in await r.readline()
                w.close()
                if ready:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.1)
        idle = await light(30, "idle")
        inflight, statuses = [0], []

        async def heavy_client() -> None:
            inflight[0] += 1
            heavy_conn = _Conn(port, HEAVY_KEY)
            try:
                while True:
                    status, _ = await heavy_conn.post("/v1/pages", heavy)
                    statuses.append(status)
                    if status == 201:
                        return
                    assert status == 429, status  # its share is full: wait its turn
                    await asyncio.sleep(0.2)
            finally:
                inflight[0] -= 1
                heavy_conn.close()

        tasks = [asyncio.create_task(heavy_client()) for _ in range(2)]
        await asyncio.sleep(1.0)  # the first body is read and being committed
        windows: list[list[float]] = []
        for _ in range(2):  # two windows: a burst of other work on the box spoils at most one
            window: list[float] = []
            while len(window) < 40:
                assert inflight[0] > 0, "the heavy requests finished before the measurement"
                sample = await light(1, "loaded")
                if inflight[0] > 0:
                    window += sample
            windows.append(window)
        for t in tasks:
            t.cancel()
        conn.close()
        return idle, min(windows, key=lambda w: _pct(w, 95)), statuses

    try:
        idle, loaded, statuses = asyncio.run(main())
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.stderr.close()  # type: ignore[union-attr]
    assert 429 in statuses, statuses  # the heavy tenant was at its maximum
    # Under 100 ms. The 2-core box is often busy with other work that slows every request
    # alike; then the bound is 3x the idle p95 measured in the same run (idle here ~15 ms).
    bound = max(0.100, 3 * _pct(idle, 95))
    report = (
        f"light writes under load p50 {_pct(loaded, 50) * 1000:.0f} / p95 "
        f"{_pct(loaded, 95) * 1000:.0f} ms; idle p50 {_pct(idle, 50) * 1000:.0f} / p95 "
        f"{_pct(idle, 95) * 1000:.0f} ms"
    )
    assert _pct(loaded, 50) < 0.100 and _pct(loaded, 95) < bound, report
    engine = MemoryEngine(EngineConfig(embedder="hashing", store=str(tmp_path / "store")))
    try:  # the heavy tenant's pages were being committed all along, none lost at shutdown
        assert sum(u.startswith("heavy/") for u in engine.users()) == n_pages
    finally:
        engine.close()

"""What the server reports about work that fails: derived rounds, the LLM backend, a full disk,
and the kernels it times (docs/server.md, "Metrics", ``/v1/stats``, ``/ready``).

Each test builds the serving core (:class:`MemoryService`) or the app in process, on the
hashing embedder; an LLM that is down is a scripted backend that raises for every batch, as an
HTTP backend does once its server cannot be used, or the real HTTP backend on a closed port."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm.base import ChatRequest, ChatResult, LLMBackendError
from memoryos_gpu.llm.scripted import ScriptedBackend
from memoryos_gpu.server.metrics import ServerMetrics
from memoryos_gpu.server.service import MemoryService
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import PageInput


class DownLLM(ScriptedBackend):
    """Fails every batch as a whole (``LLMBackendError``) while ``down``."""

    def __init__(self) -> None:
        super().__init__(lambda req: "fine")
        self.down = True

    def _generate_batch(self, requests: list[ChatRequest]) -> list[ChatResult]:
        if self.down:
            raise LLMBackendError("the LLM server is down")
        return super()._generate_batch(requests)


def _engine(llm: Any, store: str = ":memory:") -> MemoryEngine:
    """An LLM-mode engine whose STM holds one page: the second page of a user owes derived
    work (MTM placement) that calls the LLM."""
    cfg = EngineConfig(
        store=store,
        memory=preset("paper", stm_capacity=1),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
        auto_process=False,
    )
    return MemoryEngine(cfg, llm=llm)


def _sample(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _pages(users: int, per_user: int) -> list[PageInput]:
    return [
        PageInput(f"u{u}", f"page {i} of user {u} about gardening", "noted", float(i + 1))
        for u in range(users)
        for i in range(per_user)
    ]


def _serve(engine: Any, metrics: ServerMetrics, body: Callable[[MemoryService], Any]) -> None:
    """Run ``await body(svc)`` on a started service over ``engine`` whose metrics are bound,
    then close the service, the metrics and the engine."""

    async def scenario() -> None:
        svc = MemoryService(engine, ServerSettings(derived_max_wait_ms=0), metrics=metrics)
        metrics.bind(svc)
        await svc.start()
        try:
            await body(svc)
        finally:
            await svc.close()

    try:
        asyncio.run(scenario())
    finally:
        metrics.close()
        engine.close()


def test_a_servers_failed_derived_rounds_are_counted_and_exported_with_the_llm_backend() -> None:
    """The server's derived-work thread counts its runs and failures where the engine counts
    its own (``derived_failures``, ``derived_llm_failures``), ``/metrics`` shows them with the
    LLM backend's counts and ``memoryos_degraded{state="llm_unavailable"}``, and all of it
    clears once the LLM answers again."""
    llm = DownLLM()
    engine = _engine(llm)
    metrics = ServerMetrics()

    async def scenario(svc: MemoryService) -> None:
        await svc.add_pages(_pages(3, 3))
        await _until(lambda: engine.counters["derived_failures"] >= 1)
        assert engine.counters["derived_llm_failures"] >= 1
        assert svc._derived_runs >= 1  # the failed round was run
        health = svc.health()
        assert health["degraded"] == ["llm_unavailable"]
        llm_stats = health["llm"]
        assert llm_stats["backend"] == "scripted" and llm_stats["breaker"] is None
        assert llm_stats["calls"] >= 1 and llm_stats["errors"] == llm_stats["calls"]
        failures = _sample(metrics, "memoryos_engine_events_total", event="derived_failures")
        assert failures is not None and failures >= 1
        assert _sample(metrics, "memoryos_degraded", state="llm_unavailable", shard="") == 1
        assert _sample(metrics, "memoryos_degraded", state="store_full", shard="") == 0
        errors = _sample(metrics, "memoryos_llm_backend_events_total", event="errors", shard="")
        assert errors is not None and errors >= 1
        llm.down = False  # the next try (after 1 s) goes through
        await _until(lambda: engine.pending_count() == 0 and not svc.health()["degraded"])
        assert _sample(metrics, "memoryos_degraded", state="llm_unavailable", shard="") == 0

    _serve(engine, metrics, scenario)


def test_an_open_llm_breaker_is_a_gauge_and_says_degraded() -> None:
    """The HTTP backend against a closed port: its breaker opens, ``health()`` and
    ``memoryos_llm_breaker_state`` say so, and the refused batches count as requests and
    errors of the backend."""
    from memoryos_gpu.llm.openai_compat import OpenAICompatBackend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = OpenAICompatBackend(
        f"http://127.0.0.1:{port}/v1", "x", max_retries=0, backoff_base_s=0.01
    )
    engine = _engine(llm)
    metrics = ServerMetrics()

    async def scenario(svc: MemoryService) -> None:
        await svc.add_pages(_pages(2, 3))
        await _until(lambda: (svc.health()["llm"] or {}).get("breaker") == "open")
        health = svc.health()
        assert "llm_unavailable" in health["degraded"]
        assert health["llm"]["retry_in_s"] > 0
        assert health["llm"]["errors"] >= 1 and health["llm"]["calls"] >= 1
        assert _sample(metrics, "memoryos_llm_breaker_state", state="open", shard="") == 1
        assert _sample(metrics, "memoryos_llm_breaker_state", state="closed", shard="") == 0
        assert not svc.derived_can_progress()

    _serve(engine, metrics, scenario)


def test_a_respond_batch_the_llm_fails_retrieves_and_credits_heat_once_per_request() -> None:
    """A response batch that fails as a whole (the LLM down) answers every request with its
    error, without retrying each alone: one retrieval and one heat credit per request."""
    llm = DownLLM()
    llm.down = False
    engine = _engine(llm)
    engine.add_many(_pages(6, 4))
    engine.process_pending()
    llm.down = True
    heat = engine._heat
    credited: list[int] = []
    credit = heat.credit

    def counting(slots: Any, *a: Any, **kw: Any) -> Any:
        credited.append(len(slots))
        return credit(slots, *a, **kw)

    heat.credit = counting  # type: ignore[method-assign]
    settings = ServerSettings(derived_enabled=False, respond_max_wait_ms=200)

    async def scenario() -> list[Any]:
        svc = MemoryService(engine, settings)
        await svc.start()
        try:
            return await asyncio.gather(
                *(svc.respond(f"u{u}", "what do I grow?") for u in range(6)),
                return_exceptions=True,
            )
        finally:
            await svc.close()

    before = engine.counters["retrievals"]
    try:
        answers = asyncio.run(scenario())
        assert all(isinstance(a, LLMBackendError) for a in answers), answers
        assert engine.counters["retrievals"] - before == 6
        assert sum(credited) == 6
    finally:
        engine.close()


def test_the_fused_retrieval_kernel_is_timed_once_a_batch() -> None:
    """``memoryos_kernel_seconds{kernel="retrieve"}`` observes the fused retrieval pass once
    a batch; the series the docs list are the ones that appear."""
    metrics = ServerMetrics()
    engine = MemoryEngine(EngineConfig(store=":memory:", embedder="hashing", device="cpu"))
    try:
        engine.add_many(_pages(3, 2))
        queries = [(f"u{u}", "gardening") for u in range(3)]
        engine.retrieve_many(queries)
        engine.retrieve_many(queries)
        assert _sample(metrics, "memoryos_kernel_seconds_count", kernel="retrieve") == 2
        topk = _sample(metrics, "memoryos_kernel_seconds_count", kernel="knowledge_topk")
        assert topk is not None and topk >= 4  # the users' and the assistants', per batch
        for never in ("select_pages", "score_segments", "apply_hits"):
            assert _sample(metrics, "memoryos_kernel_seconds_count", kernel=never) is None
    finally:
        metrics.close()
        engine.close()


class _Part:
    def __init__(self, depths: dict[str, int]) -> None:
        self.depths = depths

    def queue_depths(self) -> dict[str, int]:
        return self.depths


class _Router:
    """What the metrics read of ``serve --engines K``'s shard router: its parts."""

    engine = None

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = parts


def test_queue_depths_carry_a_shard_label_not_a_prefixed_queue() -> None:
    from prometheus_client import generate_latest

    sharded = ServerMetrics(_Router([_Part({"retrieve": 3}), _Part({"retrieve": 5})]))
    single = ServerMetrics(_Part({"retrieve": 2, "write": 1}))
    try:
        assert _sample(sharded, "memoryos_queue_depth", queue="retrieve", shard="1") == 5
        assert _sample(sharded, "memoryos_queue_depth", queue="retrieve", shard="0") == 3
        assert _sample(single, "memoryos_queue_depth", queue="retrieve", shard="") == 2
        text = generate_latest(single.registry).decode()
        assert "shard-" not in text
        assert "(retrieve, write, respond, derived)" in text  # memoryos_batch_size's HELP
    finally:
        sharded.close()
        single.close()


def test_a_full_disk_keeps_ready_200_and_says_store_full(tmp_path: Path) -> None:
    """Writes answered 507 (the disk full): ``/ready`` stays 200 (retrievals work) with
    ``degraded: ["store_full"]``, as ``/v1/stats`` and ``memoryos_degraded`` say, until a
    write commits again."""
    pytest.importorskip("fastapi")
    from served import hashing, serve

    engine = MemoryEngine(hashing(tmp_path / "store"))
    page = {"user_input": "I keep bees " + "and honey " * 200}
    try:
        with serve(engine, keys=None) as c:
            assert c.post("/v1/users/ann/pages", json=page).status_code == 201
            assert c.get("/ready").json()["degraded"] == []
            used = engine.store.query("PRAGMA page_count")[0][0]
            engine.store._db.execute(f"PRAGMA max_page_count = {used}")
            assert c.post("/v1/users/ann/pages", json=page).status_code == 507
            ready = c.get("/ready")
            assert ready.status_code == 200 and ready.json()["degraded"] == ["store_full"]
            assert c.get("/v1/stats").json()["server"]["degraded"] == ["store_full"]
            metrics = c.get("/metrics").text
            assert 'memoryos_degraded{shard="",state="store_full"} 1.0' in metrics
            assert c.post("/v1/users/ann/retrieve", json={"query": "bees"}).status_code == 200
            engine.store._db.execute("PRAGMA max_page_count = 1000000000")
            assert c.post("/v1/users/ann/pages", json=page).status_code == 201
            assert c.get("/ready").json()["degraded"] == []
            stats = c.get("/v1/stats").json()["server"]
            assert stats["degraded"] == [] and stats["llm_backend"] is None
    finally:
        engine.close()


def test_the_ray_router_exports_each_shards_engine_series() -> None:
    """``serve --ray``'s ``/metrics`` had the router's own series only: no engine counters, no
    queue depths, no degraded state of any shard. The router keeps each shard's last status
    (``MemoryService.status``, as an engine process sends its workers) and exports it
    labelled ``shard``, as ``serve --engines K`` does."""
    from memoryos_gpu.config import EngineConfig as Config
    from memoryos_gpu.distributed.ray_router import RouterService
    from memoryos_gpu.server.service import MemoryService
    from memoryos_gpu.server.settings import ServerSettings

    engines = [
        MemoryEngine(EngineConfig(store=":memory:", embedder="hashing", device="cpu"))
        for _ in range(2)
    ]
    engines[0].add_many(_pages(2, 3))
    engines[1].add_many(_pages(1, 2))
    settings = ServerSettings(derived_max_wait_ms=0, close_engine=True)
    services = [MemoryService(e, settings) for e in engines]

    class Router(RouterService):
        async def _ask_all(self, method: str, *args: Any) -> list[Any]:
            assert method == "status"
            return [
                {**await svc.status(), "shard": i, "users": svc.known_users()}
                for i, svc in enumerate(services)
            ]

    async def scraped() -> dict[str, Any]:
        for svc in services:
            await svc.start()
        router = Router([None, None], Config(), sync_interval_s=None)
        metrics = ServerMetrics(router)
        try:
            await router.refresh()
            return {
                "added": [
                    _sample(metrics, "memoryos_engine_events_total", event="pages_added", shard=s)
                    for s in ("0", "1")
                ],
                "unlabelled": _sample(metrics, "memoryos_engine_events_total", event="pages_added"),
                "store_full": [
                    _sample(metrics, "memoryos_degraded", state="store_full", shard=s)
                    for s in ("0", "1")
                ],
                "depth": [
                    _sample(metrics, "memoryos_queue_depth", queue="retrieve", shard=s)
                    for s in ("0", "1")
                ],
            }
        finally:
            metrics.close()
            for svc in services:
                await svc.close()

    got = asyncio.run(scraped())
    assert got["added"] == [6, 2] and got["unlabelled"] is None, got
    assert got["store_full"] == [0, 0] and got["depth"] == [0, 0], got

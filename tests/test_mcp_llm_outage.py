"""MCP ``add_memory`` while the LLM is unreachable: it answers at once, ``processed: false``.

``add_memory`` waits (``--add-wait-s``, 10 s by default) for the derived work of the pages it
pushed out of STM. With the LLM's circuit breaker open that work cannot progress (every LLM
call fails at once until the cool-down ends), and each add used to hold the agent for the
whole wait. Now the wait ends as soon as the breaker is open; the page is committed, and
retrieved with the short-term memory meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

pytest.importorskip("mcp")
pytest.importorskip("mcp.server.mcpserver")

from mcp import Client

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm import OpenAICompatBackend
from memoryos_gpu.llm.breaker import OPEN
from memoryos_gpu.server.mcp_server import build_mcp
from memoryos_gpu.server.service import MemoryService

ADD_WAIT_S = 10.0


def _refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def _engine(kit: Any) -> MemoryEngine:
    """An LLM-mode engine whose LLM server refuses every connection (the first refusal opens
    its breaker: ``max_retries=0``), its derived work left to the service's thread."""
    llm = OpenAICompatBackend(
        "http://10.255.255.1:8000", "m", transport=httpx.MockTransport(_refused), max_retries=0
    )
    cfg = EngineConfig(
        memory=preset("paper"),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device=kit.device,
        store=":memory:",
        auto_process=False,
    )
    return MemoryEngine(cfg, embedder=kit.TableEmbedder(), llm=llm)


async def _add(c: Client, i: int) -> tuple[dict[str, Any], float]:
    """One add_memory call: its result and how long it took."""
    t0 = time.monotonic()
    res = await c.call_tool("add_memory", {"user_input": f"page {i}", "agent_response": "ok"})
    assert not res.is_error, res
    return res.structured_content, time.monotonic() - t0


def test_add_memory_does_not_wait_for_work_an_open_breaker_stops(kit: Any) -> None:
    engine = _engine(kit)
    service = MemoryService(engine)

    async def go() -> None:
        await service.start()
        try:
            mcp = build_mcp(service, default_user="alice", add_wait_s=ADD_WAIT_S)
            async with Client(mcp) as c:
                for i in range(7):  # the STM fills: nothing pushed out, nothing to wait for
                    out, _ = await _add(c, i)
                    assert out["processed"] is True
                for i in range(7, 9):  # each pushes a page out: work the LLM cannot do
                    out, took = await _add(c, i)
                    assert out["processed"] is False
                    assert took < 2.0, f"add_memory waited {took:.1f} s for blocked work"
                assert engine.stages.backend.breaker.state == OPEN
                assert not service.derived_can_progress()
                found = await c.call_tool("retrieve_memory", {"query": "page"})
                assert found.structured_content["short_term_count"] == 9  # 2 pending + 7
        finally:
            await service.close()

    try:
        asyncio.run(go())
    finally:
        engine.close()


def test_wait_for_user_waits_while_derived_work_can_progress(kit: Any) -> None:
    """The early stop is only for a blocked LLM: with a working one the wait ends ``done``."""

    async def go() -> None:
        engine = MemoryEngine(
            EngineConfig(embedder="hashing", device=kit.device, auto_process=False),
            embedder=kit.TableEmbedder(),
        )
        service = MemoryService(engine)
        await service.start()
        try:
            assert service.derived_can_progress()  # extractive: no LLM, no breaker
            await service.add_pages(
                [engine.validate_page({"user_id": "bob", "user_input": f"p{i}"}) for i in range(9)]
            )
            out = await service.wait_for_user("bob", ADD_WAIT_S, while_progressing=True)
            assert (out["done"], out["pending"]) == (True, 0)
        finally:
            await service.close()
            engine.close()

    asyncio.run(go())

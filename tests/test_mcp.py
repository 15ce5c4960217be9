"""The MCP server through the official SDK's client: stdio (spawned) and streamable HTTP."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")
pytest.importorskip("mcp.server.mcpserver")

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine

ROOT = Path(__file__).resolve().parents[1]
SERVER = [sys.executable, "-m", "memoryos_gpu.server.mcp_server"]

# the tool names and arguments of BAI-LAB/MemoryOS's MCP server (plus our optional user_id)
REFERENCE_TOOLS = {
    "add_memory": ["user_input", "agent_response", "timestamp", "meta_data"],
    "retrieve_memory": ["query", "relationship_with_user", "style_hint", "max_results"],
    "get_user_profile": ["include_knowledge", "include_assistant_knowledge"],
}


async def call(session: ClientSession, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    res = await session.call_tool(tool, args)
    assert not res.is_error, res
    return res.structured_content  # type: ignore[return-value]


def test_stdio_tools_roundtrip_and_persistence(tmp_path: Path) -> None:
    store = tmp_path / "store"
    params = StdioServerParameters(
        command=SERVER[0],
        args=[*SERVER[1:], "--store", str(store), "--embedder", "hashing", "--user-id", "alice"],
        cwd=str(ROOT),
        env={k: v for k, v in os.environ.items() if k.startswith(("PATH", "PYTHON", "HOME"))},
    )

    async def main() -> None:
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            tools = {t.name: t for t in (await s.list_tools()).tools}
            for name, args in REFERENCE_TOOLS.items():
                props = tools[name].input_schema["properties"]
                assert list(props)[: len(args)] == args
                assert "user_id" in props and tools[name].description
            assert tools["add_memory"].input_schema["required"] == ["user_input", "agent_response"]
            for i in range(10):
                out = await call(
                    s,
                    "add_memory",
                    {
                        "user_input": f"I practised the cello for {i + 1} hours",
                        "agent_response": "Great dedication!",
                        "timestamp": f"2024-05-{i + 1:02d} 10:00:00",
                        "meta_data": {"turn": i},
                    },
                )
                assert out["status"] == "success" and out["user_id"] == "alice"
                assert out["details"]["has_meta_data"] is True
            out = await call(s, "retrieve_memory", {"query": "cello practice", "max_results": 2})
            assert out["status"] == "success" and out["short_term_count"] == 7
            assert (
                out["short_term_memory"][-1]["user_input"] == "I practised the cello for 10 hours"
            )
            assert out["short_term_memory"][-1]["timestamp"].startswith("2024-05-10")
            assert len(out["retrieved_pages"]) <= 2
            assert set(out) >= {
                "user_profile",
                "retrieved_pages",
                "retrieved_user_knowledge",
                "retrieved_assistant_knowledge",
                "total_pages_found",
            }
            prof = await call(s, "get_user_profile", {"include_assistant_knowledge": True})
            assert prof["status"] == "success" and prof["user_id"] == "alice"
            assert "user_knowledge" in prof and "assistant_knowledge" in prof
            # another user through the optional argument: isolated
            other = await call(s, "retrieve_memory", {"query": "cello", "user_id": "bob"})
            assert other["short_term_memory"] == [] and other["retrieved_pages"] == []
            prof = await call(s, "get_user_profile", {"user_id": "bob"})
            assert prof["user_profile"] == "No detailed user profile"
            # bad input: a tool error naming the argument, not a crash
            for tool, args in (
                ("add_memory", {"user_input": "", "agent_response": "x"}),
                ("retrieve_memory", {"query": ""}),
            ):
                bad = await s.call_tool(tool, args)
                assert bad.is_error and bad.structured_content is None
                assert ("user_input" if tool == "add_memory" else "query") in bad.content[0].text

    asyncio.run(main())
    engine = MemoryEngine(EngineConfig(embedder="hashing", store=str(store)))
    try:  # the session's end shut the server down cleanly: everything is in the store
        assert engine.users() == ["alice"]
        pages = engine.export_user("alice")["pages"]
        assert len(pages) == 10 and pages[0]["extra"] == {"turn": 0}
    finally:
        engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_initialize(url: str, **headers: str) -> Any:
    """One initialize request without the SDK (``headers`` added): what the transport answers
    on the wire."""
    import httpx

    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        },
    }
    headers = {"Accept": "application/json, text/event-stream", **headers}
    return httpx.post(url, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("flags", [[], ["--stateless", "--json-response"]])
def test_streamable_http_transport(tmp_path: Path, flags: list[str]) -> None:
    from mcp.client.streamable_http import streamable_http_client

    port = _free_port()
    proc = subprocess.Popen(
        [
            *SERVER,
            "--store",
            str(tmp_path / "store"),
            "--embedder",
            "hashing",
            "--transport",
            "streamable-http",
            "--port",
            str(port),
            *flags,
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "MCP HTTP server did not start"
                time.sleep(0.1)

        async def main() -> None:
            url = f"http://127.0.0.1:{port}/mcp"
            async with streamable_http_client(url) as (r, w), ClientSession(r, w) as s:
                await s.initialize()
                names = {t.name for t in (await s.list_tools()).tools}
                assert names >= set(REFERENCE_TOOLS)
                out = await call(
                    s,
                    "add_memory",
                    {"user_input": "I live in Porto", "agent_response": "Lovely city"},
                )
                assert out["status"] == "success"
                out = await call(s, "retrieve_memory", {"query": "where do I live"})
                assert out["short_term_memory"][0]["user_input"] == "I live in Porto"

        asyncio.run(main())
        raw = raw_initialize(f"http://127.0.0.1:{port}/mcp")
        assert raw.status_code == 200, raw.text
        kind = raw.headers["content-type"]
        # --json-response: plain JSON, not an SSE stream; --stateless: no session to resume
        assert kind.startswith("application/json" if flags else "text/event-stream"), kind
        assert ("mcp-session-id" in raw.headers) is not bool(flags)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    engine = MemoryEngine(EngineConfig(embedder="hashing", store=str(tmp_path / "store")))
    try:  # SIGTERM drained and committed
        assert len(engine.export_user("default_user")["pages"]) == 1
    finally:
        engine.close()


def test_the_stdio_server_loads_its_model_without_a_progress_bar(tmp_path: Path) -> None:
    """stderr is the MCP client's log of the server: the bundled MiniLM (the default
    embedder) loads without transformers' "Loading weights" bar there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.pop("MEMORYOS_GPU_EMBEDDER", None)
    res = subprocess.run(
        [*SERVER, "--store", str(tmp_path / "store")],
        input="",
        capture_output=True,
        text=True,
        timeout=180,
        cwd=str(ROOT),
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert "Loading weights" not in res.stderr and "it/s" not in res.stderr, res.stderr

"""The MCP server refuses what the HTTP API refuses: metadata the write routes refuse (an
integer past 64 bits, NaN, too many bytes) and arguments a tool does not declare; a client
that hangs up before its body arrived is one INFO line, not an ERROR traceback; and engine
options given before ``memoryos-gpu mcp``, which it would ignore, are refused."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("mcp")
pytest.importorskip("mcp.server.mcpserver")
uvicorn = pytest.importorskip("uvicorn")

from mcp import Client  # noqa: E402
from served import running  # noqa: E402

from memoryos_gpu.config import EngineConfig  # noqa: E402
from memoryos_gpu.server.mcp_server import build_mcp, http_app  # noqa: E402
from memoryos_gpu.server.service import MemoryService  # noqa: E402

TOOLS = ("add_memory", "retrieve_memory", "get_user_profile")


def _service() -> MemoryService:
    return MemoryService(EngineConfig(embedder="hashing", store=":memory:", auto_process=False))


def _run(body: Callable[[Client], Awaitable[None]], **build: Any) -> None:
    async def main() -> None:
        service = _service()
        await service.start()
        try:
            async with Client(build_mcp(service, default_user="alice", **build)) as client:
                await body(client)
        finally:
            await service.close()

    asyncio.run(main())


async def _error(c: Client, tool: str, args: dict[str, Any]) -> str:
    res = await c.call_tool(tool, args)
    assert res.is_error, res
    return res.content[0].text  # type: ignore[union-attr]


def test_add_memory_refuses_meta_the_http_api_refuses() -> None:
    async def body(c: Client) -> None:
        page = {"user_input": "q", "agent_response": "r"}
        text = await _error(c, "add_memory", {**page, "meta_data": {"n": 2**70}})
        message = json.loads(text)["message"]
        assert "int_out_of_range" in message and "['n']" in message, message
        text = await _error(c, "add_memory", {**page, "meta_data": {"big": "x" * 200}})
        assert "the limit is 100" in json.loads(text)["message"]
        # nothing was stored by the refused calls; the largest 64-bit integer is kept
        ok = await c.call_tool("add_memory", {**page, "meta_data": {"n": 2**63 - 1}})
        assert not ok.is_error, ok
        res = await c.call_tool("retrieve_memory", {"query": "q"})
        assert len(res.structured_content["short_term_memory"]) == 1  # type: ignore[index]

    _run(body, max_text_chars=100)


def test_one_meta_rule_for_http_and_mcp() -> None:
    """What the SDK reads from JSON but the HTTP API refuses in a body (the in-process client
    above turns NaN into null, a raw JSON-RPC body does not)."""
    from memoryos_gpu.server.memory_routes import check_meta
    from memoryos_gpu.server.scope import ApiError

    for bad, why in (({"x": float("nan")}, "json_invalid"), ({"n": -(2**63) - 1}, "range")):
        with pytest.raises(ApiError, match=why) as exc:
            check_meta(bad, 1000)
        assert (exc.value.status_code, exc.value.code) == (422, "invalid_input")
    with pytest.raises(ApiError) as exc:
        check_meta({"k": "v" * 100}, 100)
    assert (exc.value.status_code, exc.value.code) == (413, "too_large")
    check_meta({"n": -(2**63), "s": "é" * 10}, 1000)  # fits: no error


def test_every_tool_refuses_an_argument_it_does_not_declare() -> None:
    async def body(c: Client) -> None:
        listed = {t.name: t for t in (await c.list_tools()).tools}
        args = {
            "add_memory": {"user_input": "q", "agent_response": "r"},
            "retrieve_memory": {"query": "q"},
            "get_user_profile": {},
        }
        for tool in TOOLS:
            assert listed[tool].input_schema["additionalProperties"] is False
            text = await _error(c, tool, {**args[tool], "userid": "bob"})  # a misspelt user_id
            assert "userid" in text and "Extra inputs are not permitted" in text, text
        res = await c.call_tool("retrieve_memory", {"query": "q"})
        assert res.structured_content["short_term_memory"] == []  # type: ignore[index]

    _run(body)


@contextmanager
def _mcp_http() -> Iterator[int]:
    """A streamable HTTP MCP server (stateless, JSON answers) in a thread; yields its port."""
    service = _service()
    app = http_app(service, build_mcp(service), stateless=True, json_response=True)
    with running(app) as (port, _):
        yield port


def test_a_client_gone_before_its_body_is_one_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="memoryos_gpu.server.mcp")
    head = (
        "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Accept: application/json, text/event-stream\r\nContent-Length: 1000\r\n\r\n"
    )
    with _mcp_http() as port:
        for _ in range(3):  # each sends a tenth of its body, then hangs up
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(head.encode() + b'{"jsonrpc"')

        def lines() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "disconnect" in r.getMessage().lower()]

        deadline = time.monotonic() + 30  # until the server has seen the three go
        while len(lines()) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert [(r.levelno, r.exc_info) for r in lines()] == [(logging.INFO, None)] * 3


def test_engine_options_before_mcp_are_refused_not_ignored(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from memoryos_gpu.cli import main as cli_main

    assert cli_main(["--llm-mode", "llm", "--store", "s", "mcp", "--help"]) == 2
    err = capsys.readouterr().err
    assert "--store, --llm-mode" in err and "do not apply to the MCP server" in err
    # an engine option's variable is no flag given to this command: still served
    monkeypatch.setenv("MEMORYOS_GPU_LLM_API_KEY", "key-from-the-environment")
    with pytest.raises(SystemExit) as exc:
        cli_main(["mcp", "--help"])
    assert exc.value.code == 0 and "usage: memoryos-gpu mcp" in capsys.readouterr().out

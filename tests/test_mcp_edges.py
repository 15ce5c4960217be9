"""The MCP server's edges, found by a sweep with the official SDK's client: a locked store, loose
argument types, unbounded strings, blank input, malformed configs, an uncreatable store folder
and a busy port each get one clear answer (hashing embedder, in process where possible)."""

from __future__ import annotations

import asyncio
import json
import logging
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

from mcp import Client

from memoryos_gpu.reference import engine_config, settings
from memoryos_gpu.server.mcp_server import build_mcp, main
from memoryos_gpu.server.service import MemoryService
from memoryos_gpu.store import StoreError, open_store
from memoryos_gpu.store.writer import refusal

ROOT = Path(__file__).resolve().parents[1]

# a process whose holder record says it is `memoryos-gpu mcp`, holding a store's writer claim
HOLD_AS_MCP = """
import sys
store, db = sys.argv[1:]
sys.argv = ["memoryos-gpu", "mcp", "--store", store]
from memoryos_gpu.store.writer import SQLiteWriterLock
lock = SQLiteWriterLock(db)
lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture(autouse=True)
def _hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")


def _service() -> MemoryService:
    s = settings({"data_storage_path": ":memory:"})
    return MemoryService(engine_config(s, embedder="hashing", device="cpu", auto_process=False))


def _run(body: Any) -> None:
    service = _service()

    async def go() -> None:
        await service.start()
        try:
            async with Client(build_mcp(service, default_user="alice")) as client:
                await body(client)
        finally:
            await service.close()

    asyncio.run(go())


async def _error(c: Client, tool: str, args: dict[str, Any]) -> str:
    res = await c.call_tool(tool, args)
    assert res.is_error, (tool, args)
    return res.content[0].text  # type: ignore[union-attr]


def _exit_message(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = str(info.value.code)
    assert message.startswith("memoryos-gpu MCP server: ") and "\n" not in message, message
    return message


# ============================================================================ 1. locked store
def test_refusal_advice_fits_the_holder() -> None:
    mcp = refusal("s", "pid 1", command="memoryos-gpu mcp --store s")
    assert "MCP server" in mcp and "POST /v1/pages" not in mcp
    assert "POST /v1/pages" in refusal("s", "pid 1", command="memoryos-gpu serve --port 8")
    batch = refusal("s", "pid 1", command="memoryos-gpu ingest --store s ...")
    assert "wait until it has finished" in batch and "POST /v1/pages" not in batch
    assert "POST /v1/pages" in refusal("s", "pid 1")  # unknown holder: may be a server


def test_a_store_held_by_an_mcp_server_stops_the_second_in_one_final_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "store"
    db = store / "memory.sqlite3"
    store.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AS_MCP, str(store), str(db)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.WARNING, logger="memoryos_gpu"):
            message = _exit_message(["--store", str(store), "--embedder", "hashing"])
        assert f"pid {holder.pid}" in message and "memoryos-gpu mcp" in message
        assert "next try" not in message and "waiting for the store" not in message
        assert "POST /v1/pages" not in message and "Connect to that MCP server" in message
        assert "stops without waiting" in message
        records = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [r.levelname for r in records] == ["ERROR"], [r.getMessage() for r in records]
        assert "next try" not in records[0].getMessage()
    finally:
        holder.kill()
        holder.wait()


# ============================================================================ 2. strict types
def test_arguments_of_the_wrong_json_type_are_refused_naming_them() -> None:
    async def body(c: Client) -> None:
        for tool, args, name in [
            ("get_user_profile", {"include_knowledge": "no"}, "include_knowledge"),
            ("get_user_profile", {"include_assistant_knowledge": "yes"}, "include_assistant"),
            ("get_user_profile", {"include_assistant_knowledge": 1}, "include_assistant"),
            ("retrieve_memory", {"query": "x", "max_results": "2"}, "max_results"),
            ("retrieve_memory", {"query": "x", "max_results": True}, "max_results"),
        ]:
            assert name in await _error(c, tool, args), args
        # the right types still work
        ok = await c.call_tool("get_user_profile", {"include_assistant_knowledge": True})
        assert not ok.is_error and "assistant_knowledge" in ok.structured_content  # type: ignore[operator]
        ok = await c.call_tool("retrieve_memory", {"query": "x", "max_results": 2})
        assert not ok.is_error

    _run(body)


# ============================================================================ 3. string limits
def _strings(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The string arms of a property's schema (``anyOf`` for an optional one)."""
    arms = schema.get("anyOf", [schema])
    return [a for a in arms if a.get("type") == "string"]


def test_every_string_argument_has_a_max_length_and_errors_cut_what_they_quote() -> None:
    async def body(c: Client) -> None:
        tools = (await c.list_tools()).tools
        for tool in tools:
            for name, prop in tool.input_schema["properties"].items():
                for arm in _strings(prop):
                    assert arm.get("maxLength"), f"{tool.name}.{name} has no maxLength"
        long_hint = {"query": "x", "style_hint": "s" * 100_001}
        assert "style_hint" in await _error(c, "retrieve_memory", long_hint)
        long_rel = {"query": "x", "relationship_with_user": "r" * 201}
        assert "relationship_with_user" in await _error(c, "retrieve_memory", long_rel)
        huge = {"user_input": "x", "agent_response": "y", "timestamp": "t" * 100_000}
        assert "timestamp" in await _error(c, "add_memory", huge)
        bad = {"user_input": "x", "agent_response": "y", "timestamp": "t" * 100}
        text = json.loads(await _error(c, "add_memory", bad))["message"]
        assert "t" * 81 not in text and "t" * 80 + "…" in text, text

    _run(body)


# ============================================================================ 8. blank input
def test_a_blank_user_input_is_refused_like_an_empty_one() -> None:
    async def body(c: Client) -> None:
        assert "user_input" in await _error(
            c, "add_memory", {"user_input": " \n\t ", "agent_response": ""}
        )
        res = await c.call_tool("retrieve_memory", {"query": "x"})
        assert res.structured_content["short_term_memory"] == []  # type: ignore[index]
        schema = (await c.list_tools()).tools[0].input_schema["properties"]["user_input"]
        assert schema["minLength"] == 1 and schema["pattern"] == r"\S"

    _run(body)


# ============================================================================ 4, 5. config
def test_a_malformed_toml_config_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("x = [\n")
    message = _exit_message(["--config", str(bad)])
    assert f"cannot read config file {bad}" in message


def test_a_bad_default_user_names_its_source(tmp_path: Path) -> None:
    cfg = tmp_path / "badF.json"
    cfg.write_text(json.dumps({"user_id": "team/alice", "data_storage_path": ":memory:"}))
    message = _exit_message(["--config", str(cfg)])
    assert f"{cfg}: user_id: must not contain '/'" in message
    message = _exit_message(["--store", ":memory:", "--user-id", "a/b"])
    assert "user_id must not contain '/' (from --user-id)" in message


# ============================================================================ 6. store folder
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux)")
def test_a_store_folder_that_cannot_be_created_is_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(StoreError, match="cannot create its folder /proc/nope"):
        open_store("/proc/nope/store/memory.sqlite3")
    with caplog.at_level(logging.WARNING, logger="memoryos_gpu"):
        message = _exit_message(["--store", "/proc/nope/store", "--embedder", "hashing"])
    assert "cannot create its folder /proc/nope" in message
    assert all(r.exc_info is None for r in caplog.records)  # no traceback logged


# ============================================================================ 7. HTTP port
def test_a_busy_port_is_one_line_before_any_url_is_announced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["--store", str(tmp_path / "s"), "--transport", "streamable-http"]
        message = _exit_message([*argv, "--port", str(port), "--embedder", "hashing"])
    assert f"127.0.0.1:{port}" in message and "address already in use" in message
    assert "MCP server on" not in capsys.readouterr().err


def test_the_url_is_announced_once_the_server_listens(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MEMORYOS_GPU_EMBEDDER": "hashing"}
    args = ["--store", str(tmp_path / "s"), "--transport", "http", "--port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "memoryos_gpu.server.mcp_server", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        line = ""
        while "MCP server on" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server exited"
        assert line.strip() == f"memoryos-gpu MCP server on http://127.0.0.1:{port}/mcp"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # listening now
    finally:
        proc.terminate()
        proc.wait(30)

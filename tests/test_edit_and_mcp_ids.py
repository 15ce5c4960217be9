"""User ids through the MCP server follow the HTTP API's rule (one function, both ways in),
and a page edit accepts exactly the texts a page add accepts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.engine import InvalidInputError

# (tool, arguments, what its error says it was doing)
TOOLS = [
    ("add_memory", {"user_input": "hi", "agent_response": "hello"}, "Error adding memory"),
    ("retrieve_memory", {"query": "hi"}, "Error retrieving memory"),
    ("get_user_profile", {}, "Error getting user profile"),
]


def _http_refusal(user_id: str) -> str:
    """What the HTTP API answers for ``user_id`` (its 422's detail)."""
    from memoryos_gpu.server.auth import Principal
    from memoryos_gpu.server.scope import ApiError, Scope
    from memoryos_gpu.server.settings import ServerSettings

    with pytest.raises(ApiError) as refused:
        Scope(Principal(None, "open"), ServerSettings()).user(user_id)
    assert refused.value.status_code == 422 and refused.value.code == "invalid_user_id"
    return str(refused.value.detail)


def _service() -> Any:
    from memoryos_gpu.reference import engine_config, settings
    from memoryos_gpu.server.service import MemoryService

    s = settings({"data_storage_path": ":memory:"})
    return MemoryService(engine_config(s, embedder="hashing", device="cpu", auto_process=False))


def _with_client(body: Any, default_user: str = "alice") -> Any:
    """Run ``body(client, service)`` against an in-process MCP server on a fresh store."""
    pytest.importorskip("mcp.server.mcpserver")
    from mcp import Client

    from memoryos_gpu.server.mcp_server import build_mcp

    service = _service()

    async def run() -> Any:
        await service.start()
        try:
            async with Client(build_mcp(service, default_user=default_user)) as client:
                return await body(client, service)
        finally:
            await service.close()

    return asyncio.run(run())


def _error_message(res: Any) -> str:
    assert res.is_error and res.structured_content is None
    return json.loads(res.content[0].text)["message"]


# ---------------------------------------------------------------- 1. MCP user ids
@pytest.mark.parametrize("bad", ["team/alice", "/", "alice/", "a\x01b", "   "])
def test_every_mcp_tool_refuses_a_user_id_the_http_api_refuses(bad: str) -> None:
    """Was: 'team/alice' was stored through MCP, then unaddressable over HTTP (a '/' splits
    /v1/users/{user_id}/...) and ambiguous against tenant prefixes ('team/alice')."""
    http = _http_refusal(bad)

    async def body(c: Any, service: Any) -> None:
        for tool, args, doing in TOOLS:
            res = await c.call_tool(tool, {**args, "user_id": bad})
            assert _error_message(res) == f"{doing}: {http}", tool
        assert service.engine.users() == []  # nothing stored by the refused calls

    _with_client(body)


def test_ids_the_http_api_accepts_still_work_through_mcp() -> None:
    good = "bob.smith@example.com:chat-1 ünï"

    async def body(c: Any, service: Any) -> None:
        for tool, args, _ in TOOLS:
            res = await c.call_tool(tool, {**args, "user_id": good})
            assert not res.is_error and res.structured_content["user_id"] == good, tool
        assert service.engine.users() == [good]

    _with_client(body)


def test_a_default_user_with_a_slash_is_refused_by_tools_and_at_startup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    http = _http_refusal("team/alice")

    async def body(c: Any, service: Any) -> None:
        for tool, args, doing in TOOLS:
            assert _error_message(await c.call_tool(tool, args)) == f"{doing}: {http}", tool
        assert service.engine.users() == []

    _with_client(body, default_user="team/alice")

    from memoryos_gpu.server import mcp_server

    def serve(*_: Any) -> None:
        pytest.fail("the server started with a user id the HTTP API refuses")

    monkeypatch.setattr(mcp_server, "_serve_stdio", serve)
    with pytest.raises(SystemExit, match=f"memoryos-gpu MCP server: {http}"):
        mcp_server.main(["--store", str(tmp_path / "s"), "--user-id", "team/alice"])


# ---------------------------------------------------------------- 2. page edits
BLANKS = [("", ""), (" \n\t", "  "), ("", "an answer"), ("a question", " "), ("x\x00", "\x01")]


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except InvalidInputError as exc:
        return "refused", str(exc)


@pytest.mark.parametrize(("user_input", "agent_response"), BLANKS)
def test_a_page_edit_accepts_exactly_what_a_page_add_accepts(
    make_engine: Any, user_input: str, agent_response: str
) -> None:
    """The engine stores blank pages on add (never drop: tests/test_engine.py); an edit to the
    same texts is refused or accepted alike, and stores what the add would have stored."""
    e = make_engine(mode="extractive")
    page = e.add("u", "I live in Oslo.", "ok").page_id
    added = _outcome(lambda: e.add("u", user_input, agent_response).page_id)
    edited = _outcome(
        lambda: e.update_page(page, user_input=user_input, agent_response=agent_response)
    )
    assert added[0] == edited[0]
    if added[0] == "ok":
        fields = ("user_input", "agent_response")
        assert [e.get_page(page)[k] for k in fields] == [e.get_page(added[1])[k] for k in fields]
    else:
        assert added[1] == edited[1] and e.get_page(page)["user_input"] == "I live in Oslo."


def test_a_page_edit_of_one_side_leaves_the_other(make_engine: Any) -> None:
    e = make_engine(mode="extractive")
    page = e.add("u", "I live in Oslo.", "ok").page_id
    row = e.update_page(page, user_input="  ")
    assert (row["user_input"], row["agent_response"]) == ("  ", "ok")
    row = e.update_page(page, agent_response="")
    assert (row["user_input"], row["agent_response"]) == ("  ", "")

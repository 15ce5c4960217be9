"""The MCP server as a drop-in for BAI-LAB/MemoryOS's (``memoryos-mcp/server_new.py``) and as
MCP clients of 2026 expect it: driven through the official SDK's client, on the hashing
embedder (no model hub, no network)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")
pytest.importorskip("mcp.server.mcpserver")

from mcp import Client, ClientSession, types
from mcp.client.stdio import StdioServerParameters, stdio_client

from memoryos_gpu import compat
from memoryos_gpu.cli.options import DEFAULT_STORE
from memoryos_gpu.config import EngineConfig
from memoryos_gpu.embed import HashingEmbedder
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.reference import engine_config, settings
from memoryos_gpu.server.mcp_server import _config, _parser, build_mcp, main
from memoryos_gpu.server.service import MemoryService

ROOT = Path(__file__).resolve().parents[1]

# memoryos-mcp/test_simple.py's conversations (the reference's own MCP test client)
CONVERSATIONS = [
    ("Hello, I'm Tom from San Francisco", "Hello Tom! Nice to meet you."),
    ("I work as a software engineer", "That's awesome! What technologies do you work with?"),
    ("I mainly use Python and JavaScript", "Great choice!"),
    ("I'm interested in machine learning", "Machine learning is an exciting field!"),
    ("I want to learn about neural networks", "Neural networks are the foundation of DL."),
    ("Yes, please explain backpropagation", "Backpropagation computes gradients."),
    ("I have a project idea about chatbots", "What kind of chatbot are you thinking about?"),
    ("A customer service chatbot", "You'll need intent recognition."),
    ("What frameworks should I use?", "Rasa, Dialogflow, or PyTorch."),
    ("I prefer open source solutions", "Rasa is an excellent open-source framework."),
    ("How do I handle multiple languages?", "Use translation APIs or one model per language."),
    ("I also like hiking in my free time", "San Francisco has great trails nearby."),
    ("Do you know any good hiking spots?", "Muir Woods or Mount Tamalpais."),
    ("I'm planning a weekend trip", "Staying local or going further?"),
    ("Maybe somewhere within 2 hours drive", "Napa Valley, Santa Cruz or Lake Tahoe."),
]


def reference_config(tmp_path: Path, **changes: Any) -> Path:
    """memoryos-mcp/config.json as the reference ships it (its data path made absolute)."""
    cfg = {
        "user_id": "test_user_001",
        "openai_api_key": "",
        "openai_base_url": "",
        "data_storage_path": str(tmp_path / "memoryos_data"),
        "assistant_id": "memoryos_assistant",
        "short_term_capacity": 2,
        "mid_term_capacity": 2000,
        "embedding_model_name": "BAAI/bge-m3",
        "long_term_knowledge_capacity": 100,
        "retrieval_queue_capacity": 7,
        "mid_term_heat_threshold": 7.0,
        "mid_term_similarity_threshold": 0.6,
        "llm_model": "gpt-4o-mini",
        **changes,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def reference_response(result: types.CallToolResult) -> dict[str, Any]:
    """What test_simple.py reads: the first content block, a JSON text."""
    content = result.content[0]
    assert isinstance(content, types.TextContent)
    return json.loads(content.text)


def test_reference_client_over_stdio_with_a_reference_config_json(tmp_path: Path) -> None:
    config = reference_config(tmp_path)
    params = StdioServerParameters(
        command=sys.executable,
        # --embedder hashing: the only flag the reference has not (no bge-m3 download in CI)
        args=[
            "-m",
            "memoryos_gpu.server.mcp_server",
            "--config",
            str(config),
            "--embedder",
            "hashing",
        ],
        cwd=str(ROOT),
        env={
            **{k: v for k, v in os.environ.items() if k.startswith(("PATH", "PYTHON", "HOME"))},
            "TZ": "America/New_York",
        },
    )

    async def insert() -> None:
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert set(tools) == {"add_memory", "retrieve_memory", "get_user_profile"}
            for i, (user_input, agent_response) in enumerate(CONVERSATIONS):
                args: dict[str, Any] = {"user_input": user_input, "agent_response": agent_response}
                if i == 0:
                    args["timestamp"] = "2025-01-02 04:00:00"  # naive: local time
                if i == 1:
                    args["timestamp"] = "2025-01-02T04:00:00+09:00"
                response = reference_response(await s.call_tool("add_memory", args))
                assert response["status"] == "success", response
                assert set(response) >= {"message", "timestamp", "details"}
                assert response["details"]["has_meta_data"] is False
                assert response["timestamp"] == args.get("timestamp", response["timestamp"])
                if i == 1:  # both in STM now: printed as given
                    stm = reference_response(
                        await s.call_tool("retrieve_memory", {"query": "Tom"})
                    )["short_term_memory"]
                    assert [p["timestamp"] for p in stm] == [
                        "2025-01-02 04:00:00",
                        "2025-01-02T04:00:00+09:00",
                    ]

    async def retrieve() -> tuple[dict[str, Any], dict[str, Any]]:
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            args = {
                "query": "Tell me about Tom from San Francisco",
                "relationship_with_user": "friend",
                "style_hint": "helpful",
                "max_results": 10,
            }
            found = reference_response(await s.call_tool("retrieve_memory", args))
            prof = reference_response(
                await s.call_tool(
                    "get_user_profile",
                    {"include_knowledge": True, "include_assistant_knowledge": True},
                )
            )
            return found, prof

    asyncio.run(insert())
    found, prof = asyncio.run(retrieve())
    assert found["status"] == "success"
    for key in (
        "query",
        "timestamp",
        "user_profile",
        "short_term_memory",
        "short_term_count",
        "retrieved_pages",
        "retrieved_user_knowledge",
        "retrieved_assistant_knowledge",
        "total_pages_found",
        "total_user_knowledge_found",
        "total_assistant_knowledge_found",
    ):
        assert key in found, key
    # short_term_capacity 2 from config.json; the first conversation reached mid-term memory
    assert found["short_term_count"] == 2
    assert [p["user_input"] for p in found["short_term_memory"]] == [
        c[0] for c in CONVERSATIONS[-2:]
    ]
    pages = {p["user_input"]: p for p in found["retrieved_pages"]}
    assert "Hello, I'm Tom from San Francisco" in pages
    assert found["total_pages_found"] <= 7  # retrieval_queue_capacity
    for page in found["retrieved_pages"]:
        assert set(page) >= {"user_input", "agent_response", "timestamp", "meta_info"}
    # timestamps print as given, in the server's zone (TZ=America/New_York)
    assert pages["Hello, I'm Tom from San Francisco"]["timestamp"] == "2025-01-02 04:00:00"
    assert prof["status"] == "success" and prof["user_id"] == "test_user_001"
    assert prof["assistant_id"] == "memoryos_assistant"
    assert prof["user_profile"] == "No detailed user profile"  # LLM-free: empty API key
    assert prof["user_knowledge"] == [] or set(prof["user_knowledge"][0]) >= {
        "knowledge",
        "timestamp",
    }

    # the store is data_storage_path's memory.sqlite3, the facade's file for that folder
    data = tmp_path / "memoryos_data"
    assert (data / "memory.sqlite3").is_file()
    engine = MemoryEngine(EngineConfig(embedder="hashing", store=str(data), device="cpu"))
    try:
        stored = {p["user_input"]: p for p in engine.export_user("test_user_001")["pages"]}
    finally:
        engine.close()
    # the naive time was New York's: 04:00 EST = 09:00 UTC; the aware one kept its zone
    assert stored["Hello, I'm Tom from San Francisco"]["timestamp"] == 1735808400.0
    assert stored["Hello, I'm Tom from San Francisco"]["extra"] == {}
    assert stored["I work as a software engineer"]["timestamp"] == 1735758000.0
    assert stored["I work as a software engineer"]["extra"] == {
        "_timestamp": "2025-01-02T04:00:00+09:00"
    }
    memo = compat.Memoryos(
        "test_user_001",
        data_storage_path=str(data),
        assistant_id="memoryos_assistant",
        short_term_capacity=2,
        mid_term_heat_threshold=7.0,
        _embedder=HashingEmbedder(),
    )
    try:
        ctx = memo.retrieve_context("Tell me about Tom from San Francisco")
        assert "Hello, I'm Tom from San Francisco" in {
            p["user_input"] for p in ctx["retrieved_pages"]
        }
    finally:
        memo.close()


# ---------------------------------------------------------------------------- in process
def _service(tmp_path: Path | None = None, **reference: Any) -> MemoryService:
    s = settings({"data_storage_path": ":memory:", **reference})
    config = engine_config(s, embedder="hashing", device="cpu", auto_process=False)
    return MemoryService(config)


async def _with_client(service: MemoryService, body: Any, **build: Any) -> Any:
    await service.start()
    try:
        async with Client(build_mcp(service, default_user="alice", **build)) as client:
            return await body(client)
    finally:
        await service.close()


def test_schemas_describe_every_argument_and_result(tmp_path: Path) -> None:
    async def body(c: Client) -> None:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        for tool in tools.values():
            props = tool.input_schema["properties"]
            assert all(p.get("description") for p in props.values()), tool.name
            out = tool.output_schema
            assert out is not None and out["type"] == "object" and "status" in out["required"]
            assert tool.annotations is not None and tool.annotations.title
            assert tool.annotations.destructive_hint is False
            assert tool.annotations.open_world_hint is False
        assert tools["add_memory"].annotations.read_only_hint is False
        assert tools["retrieve_memory"].annotations.read_only_hint is True
        assert tools["get_user_profile"].annotations.idempotent_hint is True
        add = tools["add_memory"].input_schema
        assert add["required"] == ["user_input", "agent_response"]
        assert add["properties"]["user_input"]["minLength"] == 1
        assert tools["retrieve_memory"].input_schema["properties"]["max_results"]["minimum"] == 0
        out = tools["retrieve_memory"].output_schema
        page = out["$defs"]["PageItem"]["properties"]
        assert {"user_input", "agent_response", "timestamp", "meta_info", "score"} <= set(page)
        assert set(out["$defs"]["KnowledgeItem"]["required"]) == {"knowledge", "timestamp"}
        assert out["properties"]["retrieved_pages"]["items"] == {"$ref": "#/$defs/PageItem"}

    asyncio.run(_with_client(_service(), body))


def test_failures_are_tool_errors_with_the_reference_error_object() -> None:
    async def body(c: Client) -> None:
        async def error(tool: str, args: dict[str, Any]) -> str:
            res = await c.call_tool(tool, args)
            assert res.is_error and res.structured_content is None
            return res.content[0].text  # type: ignore[union-attr]

        text = await error(
            "add_memory", {"user_input": "hi", "agent_response": "", "timestamp": "soon"}
        )
        assert (
            json.loads(text)
            == {
                "status": "error",
                "message": json.loads(text)["message"],
            }
            and "Error adding memory: unparseable timestamp 'soon'" in text
        )
        text = await error(
            "add_memory", {"user_input": "hi", "agent_response": "", "meta_data": {"_timestamp": 1}}
        )
        assert "reserved" in json.loads(text)["message"]
        text = await error("retrieve_memory", {"query": "x", "user_id": "   "})
        assert json.loads(text)["message"] == "Error retrieving memory: user_id must not be blank"
        # arguments the schema refuses: the SDK's tool error, naming the argument
        assert "max_results" in await error("retrieve_memory", {"query": "x", "max_results": -1})
        assert "agent_response" in await error("add_memory", {"user_input": "x"})
        # nothing was stored by the refused calls
        res = await c.call_tool("retrieve_memory", {"query": "hi"})
        assert not res.is_error and res.structured_content["short_term_memory"] == []

    asyncio.run(_with_client(_service(), body))


def test_add_memory_reads_its_writes_and_max_results_cuts_the_retrieval_queue() -> None:
    service = _service(short_term_capacity=2, retrieval_queue_capacity=3)

    async def body(c: Client) -> None:
        for i in range(8):
            res = await c.call_tool(
                "add_memory",
                {
                    "user_input": f"My cat Miso likes tuna number {i}",
                    "agent_response": "Cats love tuna.",
                    "timestamp": f"2025-03-0{i + 1} 10:00:00",
                },
            )
            out = res.structured_content
            assert not res.is_error and out["processed"] is True
            # what the add evicted from STM is in MTM when the call returns
            tiers = [p["tier"] for p in service.engine.store.user_pages("alice")]
            assert tiers == ["mtm"] * max(0, i - 1) + ["stm"] * min(i + 1, 2), tiers
        full = (await c.call_tool("retrieve_memory", {"query": "cat Miso tuna"})).structured_content
        assert len(full["retrieved_pages"]) == full["total_pages_found"] == 3
        one = await c.call_tool("retrieve_memory", {"query": "cat Miso tuna", "max_results": 1})
        one = one.structured_content
        assert len(one["retrieved_pages"]) == 1 and one["total_pages_found"] == 3
        assert one["retrieved_pages"][0]["timestamp"].startswith("2025-03-0")
        none = await c.call_tool("retrieve_memory", {"query": "cat Miso tuna", "max_results": 0})
        assert none.structured_content["retrieved_pages"] == []

    asyncio.run(_with_client(service, body))


def test_add_wait_zero_answers_at_commit() -> None:
    service = _service(short_term_capacity=1)

    async def body(c: Client) -> None:
        outs = []
        for text in ("first", "second"):
            res = await c.call_tool("add_memory", {"user_input": text, "agent_response": "ok"})
            outs.append(res.structured_content["processed"])
        # the second add evicted the first; its derived work had not run at the answer
        assert outs == [True, False]
        assert service.engine.store.user_pages("alice")[0]["tier"] == "pending"
        await service.wait_for_user("alice")
        assert service.engine.store.user_pages("alice")[0]["tier"] == "mtm"

    asyncio.run(_with_client(service, body, add_wait_s=0))


def test_profile_leaves_out_what_was_not_asked_for() -> None:
    async def body(c: Client) -> None:
        res = await c.call_tool("get_user_profile", {"include_knowledge": False})
        out = res.structured_content
        assert "user_knowledge" not in out and "assistant_knowledge" not in out
        assert json.loads(res.content[0].text) == out  # type: ignore[union-attr]

    asyncio.run(_with_client(_service(), body))


def test_facade_and_mcp_share_one_engine_in_one_process(tmp_path: Path) -> None:
    memo = compat.Memoryos(
        "alice", data_storage_path=str(tmp_path), short_term_capacity=3, _embedder=HashingEmbedder()
    )
    memo.add_memory("I live in Porto", "Lovely city", "2025-01-01 09:00:00")
    service = MemoryService(memo.engine)

    async def body(c: Client) -> None:
        out = (
            await c.call_tool("retrieve_memory", {"query": "where do I live"})
        ).structured_content
        assert out["short_term_memory"][0]["user_input"] == "I live in Porto"
        assert out["short_term_memory"][0]["timestamp"] == "2025-01-01 09:00:00"
        await c.call_tool("add_memory", {"user_input": "I work at a bakery", "agent_response": "!"})

    try:
        asyncio.run(_with_client(service, body))
        assert memo.get_memory_stats()["short_term_count"] == 2
    finally:
        memo.close()


# ---------------------------------------------------------------------------- configuration
def test_reference_config_json_maps_to_the_engine(tmp_path: Path) -> None:
    args = _parser().parse_args(
        ["--config", str(reference_config(tmp_path)), "--embedder", "hashing"]
    )
    config, ref = _config(args)
    assert ref is not None and ref.user_id == "test_user_001"
    m = config.memory
    assert (m.preset, m.stm_capacity, m.mtm_capacity, m.knowledge_capacity) == (
        "reference",
        2,
        2000,
        100,
    )
    assert (m.top_pages, m.tau, m.theta) == (7, 7.0, 0.6)
    assert config.llm.mode == "extractive"  # "openai_api_key": "" -> LLM-free
    assert config.store == str(tmp_path / "memoryos_data") and not config.auto_process
    # flags win over the file
    args = _parser().parse_args(
        [
            "--config",
            str(reference_config(tmp_path, openai_base_url="http://127.0.0.1:9/v1")),
            "--store",
            str(tmp_path / "other"),
            "--embedder",
            "hashing",
        ]
    )
    config, _ = _config(args)
    assert config.store == str(tmp_path / "other")
    assert (config.llm.mode, config.llm.base_url, config.llm.model, config.llm.api_key) == (
        "llm",
        "http://127.0.0.1:9/v1",
        "gpt-4o-mini",
        None,
    )
    # a TOML engine config still works, and --store defaults as every command's does
    toml = tmp_path / "engine.toml"
    toml.write_text('embedder = "hashing"\n[memory]\npreset = "reference"\ntop_pages = 3\n')
    config, ref = _config(_parser().parse_args(["--config", str(toml)]))
    assert ref is None and config.memory.top_pages == 3 and config.store == DEFAULT_STORE


def test_store_precedence_is_every_commands(tmp_path, monkeypatch):
    """--store > $MEMORYOS_GPU_STORE > the config file's store > ./memoryos-store, as for
    ``memoryos-gpu ingest``: a server started after an ingest on defaults finds its pages
    (it used ./memoryos_store, and a TOML file's store was overridden by that default)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    toml = tmp_path / "engine.toml"
    toml.write_text('store = "from-file"\n')

    def store(*argv: str) -> str:
        return _config(_parser().parse_args(list(argv)))[0].store

    assert store() == DEFAULT_STORE == "./memoryos-store"
    assert store("--config", str(toml)) == "from-file"
    monkeypatch.setenv("MEMORYOS_GPU_STORE", "from-env")
    assert store("--config", str(toml)) == "from-env"
    assert store("--config", str(toml), "--store", "from-flag") == "from-flag"
    monkeypatch.delenv("MEMORYOS_GPU_STORE")
    (tmp_path / "memoryos_store").mkdir()  # the old default, kept while no new one exists
    assert store() == "./memoryos_store"
    (tmp_path / "memoryos-store").mkdir()
    assert store() == DEFAULT_STORE


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (
            {"short_term_capacty": 3},
            "unknown key 'short_term_capacty' (did you mean 'short_term_capacity'?",
        ),
        ({"short_term_capacity": "10"}, "short_term_capacity: Input should be a valid integer"),
        ({"short_term_capacity": True}, "short_term_capacity"),
        ({"short_term_capacity": 0}, "greater than or equal to 1"),
        ({"mid_term_heat_threshold": "hot"}, "mid_term_heat_threshold"),
        ({"llm_backend": "gpt"}, "llm_backend 'gpt' is not one of"),
        ({"embedding_model_kwargs": {"trust_remote_code": True}}, "trust_remote_code"),
        ({"embedding_model_name": "no-such-org/no-such-model"}, "huggingface-cli download"),
        ({"memory": {"top_segmnts": 3}}, "memory settings: unknown key 'top_segmnts' (did you"),
        ([1, 2], "expected a JSON object"),
        ("{not json", "is not valid JSON"),
    ],
)
def test_bad_config_json_is_refused_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, needle: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(path)])
    message = str(exc.value.code)
    assert needle in message
    assert message.startswith("memoryos-gpu MCP server: ")


def test_missing_config_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="config file not found"):
        main(["--config", str(tmp_path / "nope.json")])


def test_cli_mcp_passes_its_flags_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from memoryos_gpu.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["mcp", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: memoryos-gpu mcp")
    assert "--stateless" in help_text and "--json-response" in help_text
    bad = reference_config(tmp_path, short_term_capacity=-1)
    with pytest.raises(SystemExit, match="short_term_capacity"):
        cli_main(["mcp", "--config", str(bad)])

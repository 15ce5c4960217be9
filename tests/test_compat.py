"""The reference-API facade (memoryos_gpu.compat.Memoryos) on the hashing embedder and a
scripted LLM."""

from __future__ import annotations

import pytest

from memoryos_gpu import compat
from memoryos_gpu.compat import Memoryos
from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.llm.scripted import ScriptedBackend


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    compat.close_all()


def llm_config(**memory):
    return EngineConfig(
        memory=preset("paper", **{"stm_capacity": 2, "tau": 1.5, **memory}),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
    )


def scripted(response="Your cat is Miso."):
    return ScriptedBackend(
        {
            "page": {"continuous": False, "meta": "chat about pets", "summary": "pets"},
            "promotion": {
                "profile_updates": {"extraversion": "talkative"},
                "user_facts": ["User has a cat named Miso."],
                "assistant_facts": ["Assistant suggested cat toys."],
            },
            "response": response,
        }
    )


def test_reference_workflow_with_an_llm(tmp_path):
    llm = scripted()
    memo = Memoryos(
        "alice", data_storage_path=str(tmp_path), _engine_config=llm_config(), llm_backend=llm
    )
    assert memo.get_user_profile_summary() == "None"
    assert memo.get_memory_stats()["short_term_count"] == 0
    # the very first message of a new user can be answered
    assert memo.get_response("Hello there!") == "Your cat is Miso."
    memo.add_memory("I adopted a cat named Miso.", "Congratulations!", "2025-01-01 10:00:00")
    memo.add_memory("Miso likes tuna.", "Cats often do.", timestamp="2025-01-01 10:05:00")
    memo.add_memory("", "", meta_data={"channel": "web"})  # nothing is dropped
    stats = memo.get_memory_stats()
    assert stats["user_id"] == "alice"
    assert stats["short_term_count"] == 2 and stats["mid_term_pages_count"] == 2
    assert stats["mid_term_sessions_count"] >= 1
    # tau 1.5: promoted on arrival in MTM, through the scripted promotion JSON
    # (both pages share the scripted summary, so one segment is promoted twice)
    promotions = memo.engine.stats()["counters"]["promotions"]
    assert promotions == 2
    # the same fact from both promotions is one entry, strengthened (no copy)
    assert stats["has_user_profile"] and stats["assistant_knowledge_count"] == 1
    assert "talkative" in memo.get_user_profile_summary()
    summary = memo.get_assistant_knowledge_summary()
    assert [e["knowledge"] for e in summary] == ["Assistant suggested cat toys."]
    assert memo.engine.knowledge("alice")["assistant"][0]["strength"] == promotions
    assert all(len(e["timestamp"]) == len("2025-01-01 10:00:00") for e in summary)
    ctx = memo.retrieve_context("What is my cat called?")
    assert set(ctx) >= {
        "retrieved_pages",
        "retrieved_user_knowledge",
        "retrieved_assistant_knowledge",
        "retrieved_at",
    }
    assert {p["user_input"] for p in ctx["retrieved_pages"]} <= {
        "Hello there!",
        "I adopted a cat named Miso.",
    }
    assert ctx["retrieved_pages"] and all("meta_info" in p for p in ctx["retrieved_pages"])
    assert {k["knowledge"] for k in ctx["retrieved_user_knowledge"]} == {
        "User has a cat named Miso."
    }
    answer = memo.get_response(
        "What is my cat called?",
        relationship_with_user="old friend",
        style_hint="be brief",
        user_conversation_meta_data={"mood": "happy"},
    )
    assert answer == "Your cat is Miso."
    prompt = [r for r in llm.requests if r.stage == "response"][-1].messages[-1]["content"]
    for needle in ("old friend", "be brief", "happy", "User has a cat named Miso."):
        assert needle in prompt
    # the exchange was remembered
    pages = memo.engine.store.user_pages("alice")
    assert pages[-1]["user_input"] == "What is my cat called?"
    assert pages[-1]["agent_response"] == "Your cat is Miso."
    assert memo.engine.stats()["llm"]["per_stage"]["response"]["calls"] == 2
    assert "alice" in repr(memo)


def test_llm_free_mode_explains_how_to_get_responses(tmp_path):
    memo = Memoryos(
        "bob",
        data_storage_path=str(tmp_path),
        _engine_config=EngineConfig(
            memory=preset("paper", stm_capacity=1, tau=1.5), embedder="hashing", device="cpu"
        ),
    )
    memo.add_memory("I live in Oslo and I love skiing.", "Nice!", timestamp=1.0)
    memo.add_memory("Tell me a joke", "Knock knock.", timestamp=2.0)
    assert memo.get_memory_stats()["mode"] == "extractive"
    ctx = memo.retrieve_context("Where do I live?")
    assert [k["knowledge"] for k in ctx["retrieved_user_knowledge"]] == [
        "I live in Oslo and I love skiing."
    ]
    with pytest.raises(MemoryOSError, match="openai_api_key"):
        memo.get_response("Where do I live?")
    assert memo.engine.stats()["llm"]["llm_calls"] == 0


def test_default_construction_picks_the_mode_from_the_credentials(tmp_path, monkeypatch):
    import memoryos_gpu.engine as engine_mod

    monkeypatch.setattr(engine_mod.MemoryEngine, "_make_embedder", lambda self: _hashing())
    free = Memoryos("u", data_storage_path=str(tmp_path / "a"), device="cpu")
    assert free.engine.stages.mode == "extractive"
    # the reference's defaults, and the folder's store is the MCP server's file
    m = free.engine.memory
    assert (m.preset, m.stm_capacity, m.mtm_capacity, m.top_pages) == ("reference", 10, 2000, 7)
    assert (m.knowledge_capacity, m.tau, m.theta, m.knowledge_top_k) == (100, 5.0, 0.6, 20)
    assert free.engine.config.store == str(tmp_path / "a")
    assert free.engine.store.path == str(tmp_path / "a" / "memory.sqlite3")
    paid = Memoryos(
        "u",
        "sk-test",
        str(tmp_path / "b"),
        "http://127.0.0.1:9/v1",
        short_term_capacity=10,
        mid_term_capacity=2000,
        llm_model="my-model",
        device="cpu",
    )
    assert paid.engine.stages.mode == "llm"
    c = paid.engine.config.llm
    assert (c.backend, c.model, c.base_url, c.api_key) == (
        "openai",
        "my-model",
        "http://127.0.0.1:9/v1",
        "sk-test",
    )
    assert paid.engine.memory.stm_capacity == 10
    openai = Memoryos("v", "sk-x", str(tmp_path / "c"), device="cpu").engine.config.llm
    assert (openai.base_url, openai.model) == ("https://api.openai.com/v1", "gpt-4o-mini")
    paper = Memoryos("u", data_storage_path=str(tmp_path / "d"), preset="paper", device="cpu")
    assert paper.engine.memory.eviction == "heat" and paper.engine.memory.stm_capacity == 10
    with pytest.raises(TypeError, match="bogus"):
        Memoryos("u", data_storage_path=str(tmp_path / "e"), bogus=1)


def _hashing():
    from memoryos_gpu.embed import HashingEmbedder

    return HashingEmbedder()


def test_users_on_one_path_share_one_engine_and_stay_isolated(tmp_path):
    cfg = llm_config(stm_capacity=1)
    llm = scripted()
    a = Memoryos("alice", data_storage_path=str(tmp_path), _engine_config=cfg, llm_backend=llm)
    b = Memoryos("bob", data_storage_path=str(tmp_path), _engine_config=cfg)
    assert a.engine is b.engine
    for memo in (a, b):
        memo.add_memory("I have a cat named Miso.", "Nice.", timestamp=1.0)
        memo.add_memory("Second message.", "Ok.", timestamp=2.0)
    ctx_a = a.retrieve_context("cat")
    page_ids_b = {p["page_id"] for p in b.engine.store.user_pages("bob")}
    assert ctx_a["retrieved_pages"]
    assert not {p["page_id"] for p in ctx_a["retrieved_pages"]} & page_ids_b
    with pytest.raises(ValueError, match="other memory settings"):
        Memoryos("carol", data_storage_path=str(tmp_path), _engine_config=llm_config())
    a.close()
    assert compat._ENGINES  # bob still holds the engine
    b.close()
    assert not compat._ENGINES


def test_force_mid_term_analysis_promotes_below_tau(tmp_path):
    memo = Memoryos(
        "alice",
        data_storage_path=str(tmp_path),
        _engine_config=llm_config(stm_capacity=1, tau=100.0),
        llm_backend=scripted(),
    )
    assert memo.force_mid_term_analysis() is False  # unknown user: nothing to analyse
    memo.add_memory("I adopted a cat named Miso.", "Congratulations!", timestamp=1.0)
    memo.add_memory("Second message.", "Ok.", timestamp=2.0)
    assert memo.get_user_profile_summary() == "None"
    assert memo.force_mid_term_analysis() is True
    assert "talkative" in memo.get_user_profile_summary()
    assert memo.get_memory_stats()["user_knowledge_count"] == 1
    assert all(p["analysed"] for p in memo.engine.store.user_pages("alice", "mtm"))
    assert memo.force_mid_term_analysis() is False  # nothing unanalysed is left
    assert memo.engine.pending_count("alice") == 0


def test_llm_failure_returns_the_reference_error_text_and_keeps_memory_consistent(tmp_path):
    memo = Memoryos(
        "alice",
        data_storage_path=str(tmp_path),
        _engine_config=llm_config(),
        llm_backend=scripted(response=RuntimeError("server down")),
    )
    memo.add_memory("hello", "hi", timestamp=1.0)
    assert memo.get_response("are you there?") == "Error: Could not get response from LLM."
    # the failed exchange is not remembered
    assert [p["user_input"] for p in memo.engine.store.user_pages("alice")] == ["hello"]


def _hashing_memo(tmp_path, user="alice", **kw):
    return Memoryos(user, data_storage_path=str(tmp_path), device="cpu", _embedder=_hashing(), **kw)


def test_timestamps_print_as_given_and_naive_ones_are_local(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        memo = _hashing_memo(tmp_path, short_term_capacity=1)
        memo.add_memory("I adopted a cat named Miso.", "Nice", "2025-01-02 04:00:00")
        memo.add_memory("Miso likes tuna.", "Cats do.", "2025-01-02T04:00:00+09:00")
        memo.add_memory("I live in Oslo.", "Cold!")  # default: now
        pages = {p["user_input"]: p for p in memo.engine.export_user("alice")["pages"]}
        # naive = New York time (09:00 UTC); nothing extra kept for the reference's format
        assert pages["I adopted a cat named Miso."]["timestamp"] == 1735808400.0
        assert pages["I adopted a cat named Miso."]["extra"] == {}
        assert pages["Miso likes tuna."]["timestamp"] == 1735758000.0
        assert abs(pages["I live in Oslo."]["timestamp"] - time.time()) < 60
        ctx = memo.retrieve_context("cat Miso tuna")
        shown = {p["user_input"]: p["timestamp"] for p in ctx["retrieved_pages"]}
        assert shown == {
            "I adopted a cat named Miso.": "2025-01-02 04:00:00",
            "Miso likes tuna.": "2025-01-02T04:00:00+09:00",
        }
        # "now" is local, like the reference's get_timestamp() (UTC would be 5 h off)
        at = time.mktime(time.strptime(ctx["retrieved_at"], "%Y-%m-%d %H:%M:%S"))
        assert abs(at - time.time()) < 60
        with pytest.raises(MemoryOSError, match="timestamp"):
            memo.add_memory("x", "y", "next tuesday")
        with pytest.raises(ValueError, match="reserved"):
            memo.add_memory("x", "y", meta_data={"_timestamp": "whenever"})
    finally:
        monkeypatch.undo()
        time.tzset()


def llm_config_of(values):
    from memoryos_gpu.reference import llm_config, settings

    return llm_config(settings(values))


def test_llm_backend_option_selects_any_backend(tmp_path):
    local = _hashing_memo(
        tmp_path / "a",
        openai_base_url="http://127.0.0.1:9/v1",
        llm_model="qwen2.5",
        llm_options={"max_retries": 0},
    ).engine.config.llm
    # a local OpenAI-compatible server: no key needed, the base URL honoured
    assert (local.mode, local.backend, local.base_url, local.api_key, local.model) == (
        "llm",
        "openai",
        "http://127.0.0.1:9/v1",
        None,
        "qwen2.5",
    )
    assert local.options == {"max_retries": 0}
    # (the mapping only: building a vLLM engine needs vllm and a GPU)
    c = llm_config_of({"llm_backend": "vllm", "llm_model": "/models/qwen"})
    assert (c.mode, c.backend, c.model, c.base_url) == ("llm", "vllm", "/models/qwen", None)
    assert llm_config_of({"llm_backend": "transformers"}).model is None  # its bundled default
    off = _hashing_memo(tmp_path / "c", openai_api_key="sk-x", llm_backend="none")
    assert off.engine.stages.mode == "extractive"
    obj = scripted()
    ready = _hashing_memo(tmp_path / "d", llm_backend=obj)
    assert ready.engine.llm is obj and ready.engine.stages.mode == "llm"
    with pytest.raises(ValueError, match="llm_backend 'gpt' is not one of"):
        _hashing_memo(tmp_path / "e", llm_backend="gpt")


def test_an_unreachable_llm_never_makes_add_memory_raise(tmp_path):
    memo = _hashing_memo(
        tmp_path,
        openai_base_url="http://127.0.0.1:9/v1",
        short_term_capacity=1,
        llm_options={"max_retries": 0, "timeout_s": 2.0},
    )
    first = memo.add_memory("I adopted a cat named Miso.", "Congratulations!")
    second = memo.add_memory("Miso likes tuna.", "Cats do.")  # evicts: derived work needs the LLM
    assert second > first
    stored = memo.engine.store.user_pages("alice")
    assert [p["user_input"] for p in stored] == ["I adopted a cat named Miso.", "Miso likes tuna."]
    assert memo.engine.pending_count("alice") > 0  # kept for a retry, not lost
    assert memo.get_response("What is my cat called?") == "Error: Could not get response from LLM."


def test_embedding_settings_are_honoured_or_refused(tmp_path):
    from memoryos_gpu.reference import ConfigError

    memo = _hashing_memo(tmp_path / "a", embedding_model_kwargs={"batch_size": 8, "use_fp16": True})
    assert memo.engine.config.embedding_batch_size == 8
    assert memo.engine.config.gpu_dtype == "float16"
    with pytest.raises(ConfigError, match="trust_remote_code"):
        _hashing_memo(tmp_path / "b", embedding_model_kwargs={"trust_remote_code": True})
    with pytest.raises(ConfigError, match="huggingface-cli download no-such-org/model"):
        Memoryos(
            "u", data_storage_path=str(tmp_path / "c"), embedding_model_name="no-such-org/model"
        )
    folder = tmp_path / "model"
    folder.mkdir()
    from memoryos_gpu.reference import resolve_embedding_model

    assert resolve_embedding_model(str(folder)) == str(folder)


def test_the_old_store_file_is_not_silently_ignored(tmp_path):
    (tmp_path / compat.LEGACY_STORE_FILE).write_bytes(b"")
    with pytest.raises(MemoryOSError, match="rename it to"):
        _hashing_memo(tmp_path)


def test_get_response_is_bounded_by_max_tokens_as_the_respond_route_is(tmp_path):
    # 4 tokens hold at most 32 x 4 = 128 characters (engine.responses.answer_limit)
    config = llm_config().model_copy(
        update={"llm": LLMConfig(mode="llm", backend="scripted", max_tokens=4)}
    )
    llm = ScriptedBackend({"response": ["Miso.", "meow " * 40]})
    memo = Memoryos(
        "alice", data_storage_path=str(tmp_path), _engine_config=config, llm_backend=llm
    )
    assert memo.get_response("What is my cat called?") == "Miso."
    # an answer the server ignoring max_tokens made: a failure, not remembered
    assert memo.get_response("And again?") == "Error: Could not get response from LLM."
    assert [p["user_input"] for p in memo.engine.store.user_pages("alice")] == [
        "What is my cat called?"
    ]
    # the bound reaches the backend with every response request
    assert [r.max_tokens for r in llm.requests if r.stage == "response"] == [4, 4]

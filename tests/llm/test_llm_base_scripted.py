from __future__ import annotations

import asyncio
import threading

import pytest

from memoryos_gpu.llm import (
    BACKEND_KINDS,
    BackendStats,
    ChatRequest,
    ChatResult,
    LLMBackend,
    LLMBackendError,
    ScriptedBackend,
    make_backend,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string"},
        "keywords": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["summary", "keywords"],
}


def req(
    text: str = "hello there", stage: str = "", schema: dict | None = None, **kw
) -> ChatRequest:
    return ChatRequest(
        messages=({"role": "user", "content": text},), json_schema=schema, stage=stage, **kw
    )


def test_chat_request_validation_and_hash():
    r = ChatRequest(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert isinstance(r.messages, tuple) and len(r.messages) == 2
    assert hash(r) == hash(ChatRequest(messages=r.messages)) and r == ChatRequest(
        messages=r.messages
    )
    assert len({req(schema=SCHEMA), req(schema=SCHEMA)}) == 1
    with pytest.raises(ValueError):
        ChatRequest(messages=())
    with pytest.raises(ValueError):
        ChatRequest(messages=({"role": "robot", "content": "x"},))
    with pytest.raises(ValueError):
        ChatRequest(messages=({"content": "x"},))
    with pytest.raises(TypeError):
        ChatRequest(messages=({"role": "user", "content": 3},))
    with pytest.raises(ValueError):
        req(max_tokens=0)
    with pytest.raises(ValueError):
        req(temperature=-1)
    with pytest.raises(TypeError):
        ChatRequest(messages="hello")


def test_stats_thread_safe_and_dict():
    s = BackendStats()

    def work():
        for _ in range(1000):
            s.add(retries=1, repaired_json=1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = s.as_dict()
    assert d["retries"] == 4000 and d["repaired_json"] == 4000
    assert set(d) >= {
        "calls",
        "batches",
        "prompt_tokens",
        "completion_tokens",
        "retries",
        "repaired_json",
        "invalid_json",
    }
    with pytest.raises(KeyError):
        s.add(bogus=1)
    s.reset()
    assert s.as_dict()["retries"] == 0


def test_scripted_stage_queues_and_json():
    b = ScriptedBackend(
        {
            "chain": ["yes", "no"],
            "summary": {"summary": "talked about tea", "keywords": ["tea"]},
            "*": "fallback answer",
        }
    )
    out = b.generate(
        [
            req(stage="chain"),
            req(stage="chain"),
            req(stage="chain"),
            req("a b c", stage="summary", schema=SCHEMA),
        ]
    )
    assert [r.text for r in out[:3]] == ["yes", "no", "no"]  # queue, then the last entry repeats
    assert out[3].parsed == {"summary": "talked about tea", "keywords": ["tea"]}
    assert out[3].prompt_tokens == 3 and out[3].completion_tokens == len(out[3].text.split())
    assert out[0].parsed is None  # no schema: nothing parsed
    out2 = b.generate([req(stage="other")])
    assert out2[0].text == "fallback answer"
    assert b.batch_sizes() == [4, 1]
    assert b.batch_sizes("chain") == [3]
    assert len(b.requests) == 5
    st = b.stats.as_dict()
    assert st["calls"] == 5 and st["batches"] == 2 and st["by_stage"]["chain"] == 3
    assert st["prompt_tokens"] == sum(r.prompt_tokens for r in out + out2)


def test_scripted_errors_never_raise():
    b = ScriptedBackend({"chain": ["ok", RuntimeError("boom")], "summary": "not json at all"})
    out = b.generate(
        [
            req(stage="chain"),
            req(stage="chain"),
            req(stage="missing"),
            req(stage="summary", schema=SCHEMA),
        ]
    )
    assert out[0].ok and out[0].text == "ok"
    assert out[1].error == "RuntimeError: boom" and out[1].text == ""
    assert "no script for stage 'missing'" in out[2].error
    assert out[3].ok and out[3].parsed is None
    assert b.stats.as_dict()["invalid_json"] == 1 and b.stats.as_dict()["errors"] == 2


def test_scripted_callable_and_async():
    seen = []

    def responder(r: ChatRequest):
        seen.append(r.stage)
        return (
            {"summary": r.messages[-1]["content"].upper(), "keywords": "one"}
            if r.json_schema
            else "plain"
        )

    b = ScriptedBackend(responder)
    out = asyncio.run(b.agenerate([req("abc", schema=SCHEMA, stage="s"), req(stage="t")]))
    assert out[0].parsed == {"summary": "ABC", "keywords": ["one"]}  # coerced string -> list
    assert b.stats.as_dict()["repaired_json"] == 1
    assert out[1].text == "plain" and seen == ["s", "t"]
    assert b.generate([]) == [] and b.batch_sizes() == [2]
    with pytest.raises(TypeError):
        b.generate(["not a request"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        ScriptedBackend(42)  # type: ignore[arg-type]


def test_result_count_mismatch_is_backend_error():
    class Broken(LLMBackend):
        name = "broken"

        def _generate_batch(self, requests):
            return [ChatResult("x", None, 1, 1)]

    with pytest.raises(LLMBackendError, match="1 results for 2 requests"):
        Broken().generate([req(), req()])


def test_factory():
    assert BACKEND_KINDS == ("vllm", "openai", "transformers", "scripted")
    b = make_backend("scripted", responder={"*": "x"})
    assert isinstance(b, ScriptedBackend) and b.generate([req()])[0].text == "x"
    o = make_backend("openai", base_url="http://127.0.0.1:9", model="m")
    assert o.name == "openai" and o.url == "http://127.0.0.1:9/v1/chat/completions"
    o.close()
    with pytest.raises(ValueError) as ei:
        make_backend("gpt5")
    for kind in BACKEND_KINDS:
        assert kind in str(ei.value)

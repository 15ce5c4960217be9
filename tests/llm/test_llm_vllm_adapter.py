"""The vLLM adapter against fakes shaped like vLLM's objects (vLLM itself needs CUDA)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from memoryos_gpu.llm import ChatRequest, LLMBackendError, make_backend
from memoryos_gpu.llm.base import BackendStats
from memoryos_gpu.llm.vllm_backend import (
    JSON_RETRY_TEMPERATURE,
    VLLMBackend,
    build_sampling_kwargs,
    detect_structured_api,
    map_outputs,
    serve_sampling_defaults,
)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass
class FakeStructuredOutputsParams:  # vllm.sampling_params.StructuredOutputsParams
    json: Any = None


@dataclass
class FakeGuidedDecodingParams:  # older vllm.sampling_params.GuidedDecodingParams
    json: Any = None


class FakeSamplingParamsNew:
    """msgspec.Struct-like: vLLM's SamplingParams lists its fields in __struct_fields__; the
    defaults are vLLM's own."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": 16,
        "seed": None,
        "structured_outputs": None,
    }
    __struct_fields__ = tuple(DEFAULTS)

    def __init__(self, **kw: Any) -> None:
        unknown = set(kw) - set(self.__struct_fields__)
        assert not unknown, unknown
        self.kw = kw
        for name, default in self.DEFAULTS.items():
            setattr(self, name, kw.get(name, default))


class FakeSamplingParamsOld:
    __struct_fields__ = ("temperature", "max_tokens", "guided_decoding")

    def __init__(self, **kw: Any) -> None:
        self.kw = kw


@dataclass
class FakeCompletion:
    text: str
    token_ids: list[int]
    finish_reason: str = "stop"


@dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion] = field(default_factory=list)


def chat(text: str, schema: dict | None = None, **kw: Any) -> ChatRequest:
    return ChatRequest(
        messages=({"role": "system", "content": "sys"}, {"role": "user", "content": text}),
        json_schema=schema,
        **kw,
    )


def test_build_sampling_kwargs():
    api = ("structured_outputs", FakeStructuredOutputsParams)
    kw = build_sampling_kwargs(chat("x", SCHEMA, max_tokens=77, temperature=0.3), api)
    assert kw["max_tokens"] == 77 and kw["temperature"] == pytest.approx(0.3)
    assert isinstance(kw["structured_outputs"], FakeStructuredOutputsParams)
    assert kw["structured_outputs"].json == SCHEMA
    plain = build_sampling_kwargs(chat("x"), api)
    assert plain == {"max_tokens": 256, "temperature": 0.0}
    old = build_sampling_kwargs(chat("x", SCHEMA), ("guided_decoding", FakeGuidedDecodingParams))
    assert old["guided_decoding"].json == SCHEMA and "structured_outputs" not in old
    assert "structured_outputs" not in build_sampling_kwargs(chat("x", SCHEMA), None)
    assert build_sampling_kwargs(chat("x"), api, temperature=0.7)["temperature"] == 0.7
    # the kwargs are accepted by a SamplingParams with exactly these fields
    FakeSamplingParamsNew(**kw)


def test_detect_structured_api():
    new_mod = types.SimpleNamespace(
        StructuredOutputsParams=FakeStructuredOutputsParams,
        GuidedDecodingParams=FakeGuidedDecodingParams,
    )
    assert detect_structured_api(new_mod, FakeSamplingParamsNew) == (
        "structured_outputs",
        FakeStructuredOutputsParams,
    )
    old_mod = types.SimpleNamespace(GuidedDecodingParams=FakeGuidedDecodingParams)
    assert detect_structured_api(old_mod, FakeSamplingParamsOld) == (
        "guided_decoding",
        FakeGuidedDecodingParams,
    )
    # a module that still exports the old class but whose SamplingParams dropped the field
    assert detect_structured_api(old_mod, FakeSamplingParamsNew) is None
    assert detect_structured_api(types.SimpleNamespace(), FakeSamplingParamsNew) is None


def test_map_outputs():
    reqs = [chat("a"), chat("b", SCHEMA), chat("c", SCHEMA), chat("d")]
    outs = [
        FakeRequestOutput([1, 2, 3], [FakeCompletion("hello", [7, 8])]),
        FakeRequestOutput(
            [1, 2], [FakeCompletion('```json\n{"name": "Al", "age": "30",}\n```', [1, 2, 3, 4])]
        ),
        FakeRequestOutput([1], [FakeCompletion("no json", [5])]),
        FakeRequestOutput([1, 2, 3, 4], []),
    ]
    stats = BackendStats()
    res = map_outputs(outs, reqs, stats)
    assert [(r.prompt_tokens, r.completion_tokens) for r in res[:3]] == [(3, 2), (2, 4), (1, 1)]
    assert res[0].text == "hello" and res[0].parsed is None
    assert res[1].parsed == {"name": "Al", "age": 30}
    assert res[2].parsed is None and res[2].error is None
    assert res[3].error and res[3].prompt_tokens == 4
    assert stats.repaired_json == 1 and stats.invalid_json == 1
    assert [r.text for r in map_outputs(outs[:1])] == ["hello"]  # requests are optional
    with pytest.raises(ValueError):
        map_outputs(outs, reqs[:2])


def test_missing_vllm_raises_with_explanation(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(LLMBackendError) as ei:
        make_backend("vllm", model="HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(ei.value)
    assert "pip install vllm" in msg and "CUDA" in msg
    assert "vllm serve" in msg and "'openai'" in msg and "'transformers'" in msg


class FakeTokenizer:
    """One token per whitespace-separated word; records the chat-template kwargs it got."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []
        self.template_kwargs: list[dict] = []

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kw):
        assert tokenize is False and add_generation_prompt is True
        self.template_kwargs.append(kw)
        if any(m["role"] == "assistant" and m is messages[0] for m in messages):
            raise RuntimeError("Conversation roles must alternate user/assistant/user/...")
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
        return [self.vocab[w] for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words[i] for i in ids)


class FakeLLM:
    """vllm.LLM's surface the backend uses: chat, get_tokenizer, get_default_sampling_params
    (the model's generation_config), llm_engine.model_config.max_model_len."""

    instances: ClassVar[list[FakeLLM]] = []
    generation_config: ClassVar[dict[str, Any]] = {}

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[list, list, bool]] = []
        self.chat_kwargs: list[dict] = []
        self.script: list[list[str]] = []
        self.tokenizer = FakeTokenizer()
        model_config = types.SimpleNamespace(max_model_len=kwargs.get("max_model_len", 4096))
        self.llm_engine = types.SimpleNamespace(model_config=model_config)
        FakeLLM.instances.append(self)

    def get_tokenizer(self) -> FakeTokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> FakeSamplingParamsNew:
        return FakeSamplingParamsNew(**self.generation_config)

    def chat(self, messages, sampling_params=None, use_tqdm=True, **kw):
        self.calls.append((messages, sampling_params, use_tqdm))
        self.chat_kwargs.append(kw)
        texts = self.script.pop(0)
        return [
            FakeRequestOutput(list(range(len(m))), [FakeCompletion(t, [0] * len(t.split()))])
            for m, t in zip(messages, texts, strict=True)
        ]


@pytest.fixture
def fake_vllm(monkeypatch):
    sp = types.ModuleType("vllm.sampling_params")
    sp.StructuredOutputsParams = FakeStructuredOutputsParams
    sp.SamplingParams = FakeSamplingParamsNew
    mod = types.ModuleType("vllm")
    mod.LLM = FakeLLM
    mod.SamplingParams = FakeSamplingParamsNew
    mod.sampling_params = sp
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    FakeLLM.instances.clear()
    monkeypatch.setattr(FakeLLM, "generation_config", {})
    return mod


def test_backend_one_chat_call_per_batch_and_json_retry(fake_vllm):
    b = VLLMBackend("some/model", max_model_len=4096, enforce_eager=True)
    llm = FakeLLM.instances[0]
    assert llm.kwargs["model"] == "some/model" and llm.kwargs["max_model_len"] == 4096
    assert llm.kwargs["enable_prefix_caching"] is True and llm.kwargs["enforce_eager"] is True
    llm.script = [["hi", "not json", '{"name": "B", "age": 2}'], ['{"name": "A", "age": 1}']]
    reqs = [chat("a"), chat("b", SCHEMA, stage="profile"), chat("c", SCHEMA)]
    res = b.generate(reqs)
    assert len(llm.calls) == 2  # the batch, then one retry batch for the unparsable output
    msgs, params, tqdm = llm.calls[0]
    assert tqdm is False and len(msgs) == 3 and msgs[0][1] == {"role": "user", "content": "a"}
    assert (
        "structured_outputs" not in params[0].kw
        and params[1].kw["structured_outputs"].json == SCHEMA
    )
    retry_msgs, retry_params, _ = llm.calls[1]
    assert len(retry_msgs) == 1 and retry_params[0].kw["temperature"] == JSON_RETRY_TEMPERATURE
    assert res[0].text == "hi" and res[1].parsed == {"name": "A", "age": 1}
    assert res[2].parsed == {"name": "B", "age": 2}
    assert res[1].completion_tokens == 2 + 4  # first try + retry
    st = b.stats.as_dict()
    assert (
        st["calls"] == 3 and st["batches"] == 1 and st["retries"] == 1 and st["invalid_json"] == 1
    )
    b.close()
    assert b.llm is None


def test_backend_isolates_failing_request(fake_vllm):
    b = VLLMBackend("m", json_retry=False)
    llm = FakeLLM.instances[0]

    calls: list[int] = []

    def chat_fn(messages, sampling_params=None, use_tqdm=True):
        calls.append(len(messages))
        if any(m[-1]["content"] == "poison" for m in messages):
            raise ValueError("engine rejected a prompt")
        return [FakeRequestOutput([1], [FakeCompletion("ok", [1])]) for _ in messages]

    llm.chat = chat_fn
    res = b.generate([chat("fine"), chat("poison"), chat("fine too")])
    assert [r.text for r in res] == ["ok", "", "ok"]
    assert "engine rejected a prompt" in res[1].error
    # halving, not one call per request: 8 requests, one bad -> 7 calls (was 1 + 8)
    calls.clear()
    res = b.generate([chat("poison" if i == 5 else f"q{i}") for i in range(8)])
    assert [r.error is None for r in res] == [i != 5 for i in range(8)]
    assert calls == [8, 4, 4, 2, 1, 1, 2]


def test_sampling_defaults_match_vllm_serve(fake_vllm, monkeypatch):
    """generation_config's values fill what the request leaves unset, as `vllm serve` does;
    the request's temperature and max_tokens win (a generation_config max_tokens caps)."""
    gen = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    monkeypatch.setattr(FakeLLM, "generation_config", {**gen, "max_tokens": 100})
    b = VLLMBackend("m", json_retry=False)
    llm = FakeLLM.instances[0]
    assert b.sampling_defaults == {
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 100,
    }
    llm.script = [["a", "b"]]
    b.generate([chat("x", max_tokens=64, temperature=0.2), chat("y", max_tokens=500)])
    first, second = (p.kw for p in llm.calls[0][1])
    assert first == {
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 64,
        "temperature": 0.2,
    }
    assert second["max_tokens"] == 100 and second["temperature"] == 0.0
    # a model without generation_config values, or a vLLM without the method: plain params
    monkeypatch.setattr(FakeLLM, "generation_config", {})
    assert VLLMBackend("m").sampling_defaults == {}
    assert serve_sampling_defaults(object(), FakeSamplingParamsNew) == {}


def test_chat_template_kwargs_reach_chat_and_measurement(fake_vllm):
    b = VLLMBackend("m", chat_template_kwargs={"enable_thinking": False})
    llm = FakeLLM.instances[0]
    llm.script = [["ok"]]
    b.generate([chat("x")])
    assert llm.chat_kwargs == [{"chat_template_kwargs": {"enable_thinking": False}}]
    assert llm.tokenizer.template_kwargs == [{"enable_thinking": False}]
    b2 = VLLMBackend("m")
    FakeLLM.instances[1].script = [["ok"]]
    b2.generate([chat("x")])
    assert FakeLLM.instances[1].chat_kwargs == [{}]  # nothing passed when none were given


def test_long_prompts_measured_before_the_batch(fake_vllm):
    """One over max_model_len - max_tokens loses the start of its last user message; one that
    cannot fit fails alone; the batch is still one LLM.chat call."""
    b = VLLMBackend("m", max_model_len=60, json_retry=False)
    llm = FakeLLM.instances[0]
    llm.script = [["short answer", "long answer"]]
    context = " ".join(f"page{i}" for i in range(200))
    long_req = chat(f"{context} QUESTION: where does Maya move?", max_tokens=20)
    huge_system = ChatRequest(
        messages=(
            {"role": "system", "content": " ".join(["rule"] * 100)},
            {"role": "user", "content": "hi"},
        ),
        max_tokens=20,
    )
    res = b.generate([chat("short", max_tokens=20), long_req, huge_system])
    assert len(llm.calls) == 1 and len(llm.calls[0][0]) == 2
    sent = llm.calls[0][0][1]
    assert sent[0] == {"role": "system", "content": "sys"}  # the system prompt is kept
    assert sent[1]["content"].endswith("QUESTION: where does Maya move?")
    assert "page0 " not in sent[1]["content"]  # the start of the context went first
    assert len(b._encode(sent)) + 20 <= 60
    assert [r.text for r in res[:2]] == ["short answer", "long answer"]
    assert res[2].error and "max_model_len=60" in res[2].error and res[2].text == ""
    assert b.max_model_len == 60


def test_unrenderable_prompt_fails_alone(fake_vllm):
    b = VLLMBackend("m", json_retry=False)
    llm = FakeLLM.instances[0]
    llm.script = [["fine"]]
    bad = ChatRequest(messages=({"role": "assistant", "content": "hi"},))
    res = b.generate([bad, chat("ok")])
    assert res[0].error and "roles must alternate" in res[0].error and res[1].text == "fine"
    assert len(llm.calls) == 1 and len(llm.calls[0][0]) == 1

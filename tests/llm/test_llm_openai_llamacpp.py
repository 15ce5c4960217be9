"""OpenAICompatBackend against a REAL llama-cpp-python server serving the bundled SmolLM2.

Skipped only when llama_cpp is not importable and CI is not set (see conftest.py)."""

from __future__ import annotations

import jsonschema

from memoryos_gpu.llm import ChatRequest, make_backend

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}

PEOPLE = [("Alice", 30), ("Bob", 41), ("Chen", 25), ("Dana", 52)]


def test_batch_of_structured_requests(llama_server):
    b = make_backend(
        "openai", base_url=llama_server, model="smollm2", max_concurrency=4, timeout_s=120
    )
    reqs = [
        ChatRequest(
            messages=(
                {"role": "system", "content": "You reply with JSON only."},
                {
                    "role": "user",
                    "content": f"Give a JSON object with the name and age of {n}, aged {a}.",
                },
            ),
            json_schema=PERSON,
            max_tokens=48,
            stage="profile",
        )
        for n, a in PEOPLE
    ]
    try:
        results = b.generate(reqs)
    finally:
        b.close()
    assert len(results) == 4
    for r in results:
        assert r.error is None, r.error
        assert isinstance(r.parsed, dict), r.text
        jsonschema.validate(r.parsed, PERSON)
        assert r.prompt_tokens > 0 and r.completion_tokens > 0
    # llama-cpp-python rejects json_schema response_format, so "auto" must have stepped down
    assert b.style in ("json_schema", "json_object")
    st = b.stats.as_dict()
    assert st["calls"] == 4 and st["by_stage"] == {"profile": 4} and st["completion_tokens"] > 0


def test_plain_chat(llama_server):
    with make_backend("openai", base_url=llama_server, model="smollm2", timeout_s=120) as b:
        (r,) = b.generate(
            [
                ChatRequest(
                    messages=({"role": "user", "content": "What is the capital of France?"},),
                    max_tokens=16,
                )
            ]
        )
    assert r.error is None and r.text.strip()
    assert r.parsed is None and 0 < r.completion_tokens <= 16

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
    # llama-cpp-python may reject the json_schema response_format: "auto" steps the stage down
    assert b.style_for("profile") in ("json_schema", "json_object")
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


def test_engine_schemas_strict_and_open_map(llama_server):
    """A closed schema (sent strict) and the open profile map (sent without strict) both come
    back parsed, whatever the server's answer to json_schema makes each stage step down to."""
    from memoryos_gpu.prompts import SCHEMAS

    asks = {
        "continuity": 'Reply {"continuous": true}.',
        "profile_update": 'Reply {"updates": {"hobbies": "hiking"}}.',
    }
    reqs = [
        ChatRequest(
            messages=(
                {"role": "system", "content": "You reply with JSON only."},
                {"role": "user", "content": text},
            ),
            json_schema=SCHEMAS[stage],
            max_tokens=32,
            stage=stage,
        )
        for stage, text in asks.items()
    ]
    with make_backend("openai", base_url=llama_server, model="smollm2", timeout_s=120) as b:
        results = b.generate(reqs)
        styles = {stage: b.style_for(stage) for stage in asks}
    for stage, r in zip(asks, results, strict=True):
        assert r.error is None, r.error
        assert isinstance(r.parsed, dict), r.text
        jsonschema.validate(r.parsed, SCHEMAS[stage])
    assert set(styles.values()) <= {"json_schema", "json_object"}

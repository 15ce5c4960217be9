"""OpenAICompatBackend against a scripted server that answers as OpenAI's API does: the 400
bodies for ``max_tokens`` and ``temperature`` on reasoning models and for schemas outside the
strict subset are OpenAI's own (message, type, param, code)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_openai_server import FakeServer, ok_body

from memoryos_gpu.llm import ChatRequest, OpenAICompatBackend
from memoryos_gpu.llm.openai_body import ServerError, parse_error, strict_schema_ok
from memoryos_gpu.llm.openai_compat import learned_quirks
from memoryos_gpu.prompts import SCHEMAS

ANSWERS: dict[str, dict] = {
    "continuity": {"continuous": True},
    "chain_meta": {"meta": 'Maya planned her "big move" to Seattle.'},
    "topic_summary": {"summary": "Moving to Seattle.", "keywords": ["move", "Seattle"]},
    "profile_update": {"updates": {"hobbies": "hiking"}},
    "user_knowledge": {"facts": ["Maya moves to Seattle in May."]},
    "assistant_knowledge": {"facts": []},
    "fused_page": {"continuous": False, "meta": "m", "summary": "s", "keywords": ["k"]},
    "fused_promotion": {
        "profile_updates": {"hobbies": "hiking"},
        "user_facts": ["f"],
        "assistant_facts": [],
    },
}
OPEN_MAP_STAGES = {"profile_update", "fused_promotion"}  # additionalProperties: {"type": ...}


def openai_error(message: str, param: str, code: str | None) -> dict:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


MAX_TOKENS_400 = openai_error(
    "Unsupported parameter: 'max_tokens' is not supported with this model. "
    "Use 'max_completion_tokens' instead.",
    "max_tokens",
    "unsupported_parameter",
)


def temperature_400(value: float) -> dict:
    return openai_error(
        f"Unsupported value: 'temperature' does not support {value} with this model. "
        "Only the default (1) value is supported.",
        "temperature",
        "unsupported_value",
    )


def strict_violation(schema: Any, path: tuple = (), forbid: tuple[str, ...] = ()) -> str | None:
    """OpenAI's strict-mode check, written from its error messages (independently of the
    backend's ``strict_schema_ok``); ``forbid``: keywords this server does not permit."""
    if not isinstance(schema, dict):
        return None
    for kw in forbid:
        if kw in schema:
            return f"In context={path!r}, '{kw}' is not permitted."
    if schema.get("type") == "object":
        if schema.get("additionalProperties") is not False:
            return (
                f"In context={path!r}, 'additionalProperties' is required to be supplied "
                "and to be false."
            )
        props = schema.get("properties", {})
        missing = [k for k in props if k not in schema.get("required", [])]
        if missing:
            return (
                f"In context={path!r}, 'required' is required to be supplied and to be an "
                f"array including every key in properties. Missing '{missing[0]}'."
            )
        for k, sub in props.items():
            err = strict_violation(sub, (*path, "properties", k), forbid)
            if err:
                return err
    if "items" in schema:
        return strict_violation(schema["items"], (*path, "items"), forbid)
    return None


class OpenAILike:
    """The script: a reasoning model (max_completion_tokens, default temperature only) and/or
    OpenAI's strict-schema validation; counts the 400s it gave, by ``param``."""

    def __init__(self, reasoning: bool = True, forbid: tuple[str, ...] = ()) -> None:
        self.reasoning = reasoning
        self.forbid = forbid
        self.rejections: list[str] = []

    def __call__(self, n: int, body: dict) -> tuple[int, dict, Any, float]:
        if self.reasoning and "max_tokens" in body:
            return self._reject(MAX_TOKENS_400)
        if self.reasoning and body.get("temperature", 1) != 1:
            return self._reject(temperature_400(body["temperature"]))
        rf = body.get("response_format") or {}
        if rf.get("type") == "json_schema" and rf["json_schema"].get("strict"):
            name = rf["json_schema"]["name"]
            err = strict_violation(rf["json_schema"]["schema"], forbid=self.forbid)
            if err:
                msg = f"Invalid schema for response_format '{name}': {err}"
                return self._reject(openai_error(msg, "response_format", "invalid_json_schema"))
        stage = body["messages"][0]["content"]
        return 200, {}, ok_body(json.dumps(ANSWERS[stage])), 0.0

    def _reject(self, payload: dict) -> tuple[int, dict, Any, float]:
        self.rejections.append(payload["error"]["param"])
        return 400, {}, payload, 0.0


def stage_requests(copies: int = 2) -> list[ChatRequest]:
    return [
        ChatRequest(
            messages=({"role": "user", "content": stage},),
            json_schema=SCHEMAS[stage],
            max_tokens=64,
            stage=stage,
        )
        for stage in SCHEMAS
        for _ in range(copies)
    ]


def backend(server: FakeServer, model: str = "gpt-5-mini", **kw: Any) -> OpenAICompatBackend:
    return OpenAICompatBackend(
        server.url, model, timeout_s=5, backoff_base_s=0.01, backoff_max_s=0.05, **kw
    )


def test_reasoning_model_learns_max_completion_tokens_and_default_temperature(server):
    script = OpenAILike()
    server.script = script
    with backend(server, max_concurrency=4) as b:
        reqs = stage_requests()
        res = b.generate(reqs)
    assert [r.error for r in res] == [None] * len(reqs)
    assert [r.parsed for r in res] == [ANSWERS[q.stage] for q in reqs]
    assert set(script.rejections) == {"max_tokens", "temperature"}  # never a schema
    assert learned_quirks(server.url, "gpt-5-mini") == {"max_completion_tokens", "no_temperature"}
    ok = [bd for bd in server.bodies if "max_completion_tokens" in bd and "temperature" not in bd]
    assert len(ok) == len(reqs) and all(bd["max_completion_tokens"] == 64 for bd in ok)
    # remembered per model: a new backend for it sends the right body first time ...
    n = len(server.bodies)
    with backend(server) as b2:
        assert b2.generate(stage_requests(1))[0].error is None
    assert len(server.bodies) == n + len(SCHEMAS) and "max_tokens" not in server.bodies[n]
    # ... and another model on the same server starts from max_tokens again
    script.reasoning = False
    with backend(server, model="gpt-4.1") as b3:
        b3.generate(stage_requests(1))
    assert server.bodies[-1]["max_tokens"] == 64 and server.bodies[-1]["temperature"] == 0.0


def test_strict_only_for_schemas_in_openais_subset(server):
    script = OpenAILike(reasoning=False)
    server.script = script
    with backend(server) as b:
        res = b.generate(stage_requests())
        assert b.styles == {}  # no stage stepped down
    assert all(r.error is None for r in res) and script.rejections == []
    strict = {bd["messages"][0]["content"]: bd["response_format"] for bd in server.bodies}
    for stage, rf in strict.items():
        assert rf["type"] == "json_schema" and rf["json_schema"]["schema"] == SCHEMAS[stage]
        assert rf["json_schema"]["strict"] is (stage not in OPEN_MAP_STAGES), stage
    # the checker and the server agree on every engine schema
    for stage, schema in SCHEMAS.items():
        assert strict_schema_ok(schema) is (strict_violation(schema) is None), stage


def test_strict_rejection_steps_down_only_its_stage(server):
    """A server with stricter rules (OpenAI before it took maxItems) rejects some schemas:
    those stages go on without strict, the others keep it, all keep json_schema."""
    script = OpenAILike(reasoning=False, forbid=("maxItems",))
    server.script = script
    with backend(server) as b:
        res = b.generate(stage_requests())
        assert all(r.error is None for r in res) and b.styles == {}
        n = len(server.bodies)
        b.generate(stage_requests(1))
    assert script.rejections and set(script.rejections) == {"response_format"}
    assert len(server.bodies) == n + len(SCHEMAS)  # remembered: no rejection the second time
    for bd in server.bodies[n:]:
        stage = bd["messages"][0]["content"]
        has_max_items = "maxItems" in json.dumps(SCHEMAS[stage])
        strict = bd["response_format"]["json_schema"]["strict"]
        assert strict is (not has_max_items and stage not in OPEN_MAP_STAGES), stage


def test_json_schema_step_down_is_per_stage(server):
    def script(n: int, body: dict) -> tuple[int, dict, Any, float]:
        rf = body.get("response_format") or {}
        if rf.get("type") == "json_schema":
            err = openai_error("response_format json_schema is not supported", "", None)
            return 400, {}, err, 0.0
        return 200, {}, ok_body(json.dumps(ANSWERS[body["messages"][0]["content"]])), 0.0

    server.script = script
    with backend(server) as b:
        (a,) = b.generate([q for q in stage_requests(1) if q.stage == "continuity"])
        assert a.parsed == {"continuous": True}
        assert b.styles == {"continuity": "json_object"}
        assert b.style_for("chain_meta") == "json_schema"  # untouched by the other stage
        b.generate([q for q in stage_requests(1) if q.stage == "chain_meta"])
        assert b.styles == {"continuity": "json_object", "chain_meta": "json_object"}


def test_api_key_from_environment(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    with backend(server) as b:
        b.generate([ChatRequest(messages=({"role": "user", "content": "x"},))])
    with backend(server, api_key="sk-given") as b:
        b.generate([ChatRequest(messages=({"role": "user", "content": "x"},))])
    monkeypatch.delenv("OPENAI_API_KEY")
    with backend(server) as b:
        b.generate([ChatRequest(messages=({"role": "user", "content": "x"},))])
    assert server.auth == ["Bearer sk-env", "Bearer sk-given", None]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (json.dumps(MAX_TOKENS_400).encode(), ("max_tokens", "unsupported_parameter")),
        (b'{"error": "plain"}', (None, None)),
        (b'{"detail": [{"loc": ["body"]}]}', (None, None)),
        (b"<html>bad gateway</html>", (None, None)),
    ],
)
def test_parse_error_shapes(body, expected):
    err = parse_error(body)
    assert isinstance(err, ServerError) and err.message
    assert (err.param, err.code) == expected

"""OpenAICompatBackend against a scripted in-process HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from fake_openai_server import FakeServer, ok_body

from memoryos_gpu.llm import ChatRequest, LLMBackendError, OpenAICompatBackend
from memoryos_gpu.llm.openai_body import build_response_format
from memoryos_gpu.llm.openai_compat import normalize_base_url

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "keywords": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["topic", "keywords"],
}


def backend(server: FakeServer, **kw: Any) -> OpenAICompatBackend:
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    kw.setdefault("timeout_s", 5)
    return OpenAICompatBackend(server.url, "test-model", **kw)


def req(text: str = "hi", schema: dict | None = None, **kw: Any) -> ChatRequest:
    return ChatRequest(messages=({"role": "user", "content": text},), json_schema=schema, **kw)


def test_success_body_usage_and_parse(server):
    server.script = lambda n, body: (
        200,
        {},
        ok_body('{"topic": "tea", "keywords": ["green"]}', 20, 9),
        0,
    )
    with backend(server, api_key="sk-test", extra_body={"top_p": 0.9}) as b:
        res = b.generate(
            [req("x", SCHEMA, max_tokens=33, temperature=0.2, stage="summary"), req("y")]
        )
    assert res[0].parsed == {"topic": "tea", "keywords": ["green"]} and res[0].error is None
    assert res[1].parsed is None  # no schema: not parsed
    assert (res[0].prompt_tokens, res[0].completion_tokens) == (20, 9)
    assert server.paths == ["/v1/chat/completions"] * 2 and server.auth[0] == "Bearer sk-test"
    first = next(bd for bd in server.bodies if bd["messages"][0]["content"] == "x")
    assert (
        first["model"] == "test-model" and first["max_tokens"] == 33 and first["temperature"] == 0.2
    )
    assert first["top_p"] == 0.9
    assert first["response_format"]["type"] == "json_schema"
    assert first["response_format"]["json_schema"]["schema"] == SCHEMA
    assert first["response_format"]["json_schema"]["name"] == "summary"
    assert b.stats.as_dict()["prompt_tokens"] == 40


def test_429_then_200_respects_retry_after(server):
    server.script = lambda n, body: (
        (429, {"Retry-After": "0.3"}, {"error": {"message": "slow down"}}, 0)
        if n == 0
        else (200, {}, ok_body("fine"), 0)
    )
    b = backend(server)
    t0 = time.monotonic()
    res = b.generate([req()])
    elapsed = time.monotonic() - t0
    b.close()
    assert res[0].text == "fine" and res[0].error is None
    assert len(server.bodies) == 2 and b.stats.retries == 1
    assert elapsed >= 0.3  # waited Retry-After, not the 0.01 s backoff


def test_500s_retry_with_backoff_then_error(server):
    """A 500 is retried with backoff; the batch's only request failing so is an outage
    (``LLMBackendError``: tests/llm/test_llm_server_outage.py has the rule)."""
    server.script = lambda n, body: (500, {}, {"error": {"message": "engine crashed"}}, 0)
    b = backend(server, max_retries=2, backoff_base_s=0.2, backoff_max_s=10)
    t0 = time.monotonic()
    with pytest.raises(LLMBackendError) as info:
        b.generate([req()])
    elapsed = time.monotonic() - t0
    b.close()
    assert len(server.bodies) == 3  # 1 + 2 retries
    error = str(info.value)
    assert "HTTP 500" in error and "engine crashed" in error
    assert "gave up after 2 retries" in error
    # equal-jitter exponential backoff: >= 0.1 s then >= 0.2 s
    assert 0.3 <= elapsed < 5
    assert b.stats.as_dict()["retries"] == 2


def test_400_is_not_retried_and_does_not_sink_batch(server):
    def script(n, body):
        if body["messages"][0]["content"] == "bad":
            return 400, {}, {"error": {"message": "max_tokens is too large"}}, 0
        return 200, {}, ok_body("good"), 0

    server.script = script
    with backend(server) as b:
        res = b.generate([req("ok1"), req("bad"), req("ok2")])
    assert [r.text for r in res] == ["good", "", "good"]
    assert res[1].error == "HTTP 400: max_tokens is too large"
    assert len(server.bodies) == 3 and b.stats.retries == 0


def test_timeout_retried_then_error(server):
    server.script = lambda n, body: (200, {}, ok_body("late"), 1.5)
    b = backend(server, timeout_s=0.3, max_retries=1)
    with pytest.raises(LLMBackendError, match="timeout"):
        b.generate([req()])
    b.close()
    assert len(server.bodies) == 2


def test_concurrency_bound(server):
    server.script = lambda n, body: (200, {}, ok_body(f"r{n}"), 0.15)
    b = backend(server, max_concurrency=4)
    t0 = time.monotonic()
    res = b.generate([req(f"q{i}") for i in range(16)])
    elapsed = time.monotonic() - t0
    b.close()
    assert all(r.error is None for r in res)
    assert server.max_in_flight > 1 and server.max_in_flight <= 4
    assert elapsed < 16 * 0.15  # really concurrent
    # order is preserved even though answers arrive out of order
    for i, r in enumerate(res):
        n = int(r.text[1:])
        assert server.bodies[n]["messages"][0]["content"] == f"q{i}"


@pytest.mark.parametrize("reject_status", [400, 500])
def test_auto_falls_back_to_json_object_and_remembers(server, reject_status):
    def script(n, body):
        rf = body.get("response_format")
        if rf and rf["type"] == "json_schema":
            msg = (
                "1 validation error: ('body', 'response_format', 'type') "
                "Input should be 'text' or 'json_object'"
            )
            return reject_status, {}, {"error": {"message": msg}}, 0
        assert rf is None or rf == {"type": "json_object", "schema": SCHEMA}
        return 200, {}, ok_body('{"topic": "t", "keywords": ["k"]}'), 0

    server.script = script
    b = backend(server)
    assert b.style_for("") == "json_schema"
    res = b.generate([req("a", SCHEMA), req("b", SCHEMA)])
    assert all(r.parsed == {"topic": "t", "keywords": ["k"]} for r in res)
    assert b.style_for("") == "json_object" and b.styles == {"": "json_object"}
    n_before = len(server.bodies)
    b.generate([req("c", SCHEMA)])
    assert len(server.bodies) == n_before + 1  # remembered: straight to json_object
    assert server.bodies[-1]["response_format"]["type"] == "json_object"
    b.close()


def test_fixed_style_does_not_fall_back(server):
    server.script = lambda n, body: (
        400,
        {},
        {"error": {"message": "response_format not supported"}},
        0,
    )
    with backend(server, response_format_style="json_schema") as b:
        res = b.generate([req("a", SCHEMA)])
    assert "response_format not supported" in res[0].error and b.style_for("") == "json_schema"
    assert len(server.bodies) == 1
    with backend(server, response_format_style="none") as b:
        b.generate([req("a", SCHEMA)])
    assert "response_format" not in server.bodies[-1]


@pytest.mark.parametrize(
    ("status", "hint"), [(401, "api_key"), (403, "api_key"), (404, "base_url")]
)
def test_auth_and_not_found_at_first_contact_raise(server, status, hint):
    server.script = lambda n, body: (status, {}, {"error": {"message": "nope"}}, 0)
    b = backend(server)
    with pytest.raises(LLMBackendError, match=hint):
        b.generate([req(), req(), req()])
    b.close()


def test_404_after_first_contact_is_per_request(server):
    server.script = lambda n, body: (
        (200, {}, ok_body("hi"), 0) if n == 0 else (404, {}, {"error": {"message": "gone"}}, 0)
    )
    with backend(server) as b:
        assert b.generate([req()])[0].text == "hi"
        res = b.generate([req()])
    assert res[0].error == "HTTP 404: gone"


def test_unreachable_server_raises():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = OpenAICompatBackend(f"http://127.0.0.1:{port}", "m", max_retries=1, backoff_base_s=0.01)
    with pytest.raises(LLMBackendError, match="cannot connect"):
        b.generate([req()])
    b.close()
    with pytest.raises(LLMBackendError, match="closed"):
        b.generate([req()])


def test_works_inside_running_loop_and_natively_async(server):
    server.script = lambda n, body: (200, {}, ok_body("x"), 0.05)
    b = backend(server, max_concurrency=8)

    async def main():
        sync_res = b.generate([req()])  # blocking call from inside a running loop
        async_res = await asyncio.gather(b.agenerate([req(), req()]), b.agenerate([req()]))
        return sync_res, async_res

    sync_res, (r1, r2) = asyncio.run(main())
    assert sync_res[0].text == "x" and [r.text for r in r1 + r2] == ["x", "x", "x"]
    assert b.stats.as_dict()["batches"] == 3 and b.stats.as_dict()["calls"] == 4
    t0 = time.monotonic()
    b.close()
    b.close()  # idempotent
    assert time.monotonic() - t0 < 2


def test_helpers():
    assert normalize_base_url("http://h:8000") == "http://h:8000/v1"
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert normalize_base_url("https://api.x.com/v1/chat/completions") == "https://api.x.com/v1"
    with pytest.raises(ValueError):
        normalize_base_url("h:8000")
    r = req("x", {**SCHEMA, "title": "Topic summary!"})
    assert build_response_format(r, "json_schema")["json_schema"]["name"] == "Topic_summary"
    assert build_response_format(r, "json_object")["type"] == "json_object"
    assert (
        build_response_format(r, "none") is None
        and build_response_format(req(), "json_schema") is None
    )
    with pytest.raises(ValueError):
        OpenAICompatBackend("http://h", "m", response_format_style="xml")

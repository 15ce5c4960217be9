"""``/respond`` when the LLM fails: an error status (502 for a failed call, 503 + Retry-After
for an LLM that cannot be used) and nothing remembered, never a 200 that only a body field
calls a failure; and an answer past what ``max_tokens`` allows is not stored as a page."""

from __future__ import annotations

from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from served import HA, free_port, hashing, serve  # noqa: E402

from memoryos_gpu.config import LLMConfig  # noqa: E402
from memoryos_gpu.engine import MemoryEngine  # noqa: E402
from memoryos_gpu.engine.validation import MAX_TEXT_CHARS  # noqa: E402


def _pages(c: httpx.Client, user: str) -> list[str]:
    return [
        p["agent_response"] for p in c.get(f"/v1/users/{user}/export", headers=HA).json()["pages"]
    ]


def _add(c: httpx.Client, user: str) -> None:
    r = c.post(f"/v1/users/{user}/pages", json={"user_input": "I like tea"}, headers=HA)
    assert r.status_code == 201, r.text


def test_a_failed_llm_call_is_a_502_and_nothing_is_remembered(make_engine: Any, kit: Any) -> None:
    engine = make_engine(script=kit.Script(response=RuntimeError("HTTP 500: boom")))
    with serve(engine) as c:
        _add(c, "alice")
        r = c.post("/v1/users/alice/respond", json={"query": "what do I like?"}, headers=HA)
        assert r.status_code == 502, r.text
        body = r.json()
        assert body["error"] == "llm_error" and "no usable answer" in body["detail"]
        assert "boom" not in body["detail"]  # a tenant's: not the LLM server's own text
        assert set(body) == {"error", "detail"}  # the error shape of every route
        assert _pages(c, "alice") == [""]  # only the page added before
    with serve(engine, keys=None) as c:  # an open server's caller is its operator
        _add(c, "bob")
        r = c.post("/v1/users/bob/respond", json={"query": "what do I like?"})
        assert r.status_code == 502 and "HTTP 500: boom" in r.json()["detail"], r.text


def test_an_answer_past_max_tokens_is_a_502_not_a_page(make_engine: Any, kit: Any) -> None:
    # the server's own write limit is 100,000 characters; the mock's answer was 500,000
    engine = make_engine(script=kit.Script(response="x" * 500_000))
    with serve(engine) as c:
        _add(c, "alice")
        r = c.post("/v1/users/alice/respond", json={"query": "again"}, headers=HA)
        assert r.status_code == 502 and r.json()["error"] == "llm_error", r.text[:300]
        assert _pages(c, "alice") == [""]
    with serve(engine, keys=None) as c:  # an open server's caller is its operator
        assert c.post("/v1/users/bob/pages", json={"user_input": "hi"}).status_code == 201
        r = c.post("/v1/users/bob/respond", json={"query": "again"})
        assert r.status_code == 502 and "max_tokens=256" in r.json()["detail"], r.text[:300]


def test_an_unreachable_llm_is_a_503_with_retry_after() -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: connection refused
    llm = LLMConfig(
        mode="llm", backend="openai", base_url=dead, model="m", options={"max_retries": 0}
    )
    engine = MemoryEngine(hashing(llm=llm))
    with serve(engine, derived_enabled=False) as c:
        _add(c, "alice")
        r = c.post("/v1/users/alice/respond", json={"query": "what do I like?"}, headers=HA)
        assert r.status_code == 503, r.text
        detail = r.json()["detail"]  # a tenant's: why not, without the LLM's address
        assert r.json()["error"] == "unavailable" and "cannot be used now" in detail, detail
        assert dead not in detail and "127.0.0.1" not in detail, detail
        assert int(r.headers["Retry-After"]) > 0
        assert _pages(c, "alice") == [""]
    with serve(engine, keys=None, derived_enabled=False) as c:  # open: its operator's
        assert c.post("/v1/users/bob/pages", json={"user_input": "hi"}).status_code == 201
        r = c.post("/v1/users/bob/respond", json={"query": "what do I like?"})
        assert r.status_code == 503 and "cannot connect" in r.json()["detail"], r.text
    engine.close()


def test_a_good_answer_is_still_a_200_with_its_page(make_engine: Any, kit: Any) -> None:
    engine = make_engine(script=kit.Script(response="You like tea."))
    with serve(engine) as c:
        _add(c, "alice")
        r = c.post("/v1/users/alice/respond", json={"query": "what do I like?"}, headers=HA)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == "You like tea." and r.json()["error"] is None
        assert _pages(c, "alice") == ["", "You like tea."]


def test_the_engine_keeps_answers_up_to_what_max_tokens_allows(make_engine: Any, kit: Any) -> None:
    from memoryos_gpu.engine.responses import MAX_CHARS_PER_TOKEN, answer_limit

    limit = answer_limit(256)  # LLMConfig's default max_tokens
    assert limit == MAX_CHARS_PER_TOKEN * 256 < MAX_TEXT_CHARS
    e = make_engine(script=kit.Script(response="y" * limit))
    assert e.respond("u", "hi").page_id is not None
    e = make_engine(script=kit.Script(response="y" * (limit + 1)))
    r = e.respond("u", "hi")
    assert r.page_id is None and len(r.text) == limit + 1  # returned whole, not remembered
    assert "max_tokens=256" in r.error and "not remembered" in r.error
    assert answer_limit(10**9) == MAX_TEXT_CHARS  # never more than a page may hold

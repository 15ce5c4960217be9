"""A reachable LLM server that cannot serve: every request answered 5xx, 429 or timed out.

Taking such failures as the model's answers stored every page and promotion for good as the
extractive fallback (``llm-fallback``), silently. The rule now: a batch whose *every* request
failed server-side after its retries raises ``LLMBackendError`` and opens the circuit breaker
(the engine's round stays pending and is retried once the server serves again); a server-side
failure among answers, a 4xx other than 429 and a malformed answer stay that request's error
(the item falls back, counted in ``stats.fallbacks`` and logged).

And a server's shutdown is bounded: a hung LLM server must not keep the process alive past
``EngineConfig.shutdown_drain_s``; the work left stays pending in the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import FakeServer, Reply, ok_body

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm import ChatRequest, LLMBackendError, OpenAICompatBackend
from memoryos_gpu.server.service import MemoryService
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import PageInput

FAILED = "answers but cannot serve"
PAGE = {"continuous": False, "meta": "m", "summary": "s", "keywords": []}
PROMOTION = {"profile_updates": {}, "user_facts": [], "assistant_facts": []}


class Clock:
    """The breaker's clock, moved by hand: the cool-down without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backend(server: FakeServer, **kw: Any) -> OpenAICompatBackend:
    kw.setdefault("max_retries", 1)
    kw.setdefault("timeout_s", 5)
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("backoff_max_s", 0.02)
    return OpenAICompatBackend(server.url, "m", **kw)


def req(text: str) -> ChatRequest:
    return ChatRequest(messages=({"role": "user", "content": text},))


def batch(n: int) -> list[ChatRequest]:
    return [req(f"q{i}") for i in range(n)]


def failing(status: int, headers: dict | None = None) -> Any:
    return lambda n, body: (status, headers or {}, {"error": {"message": f"status {status}"}}, 0)


def stage_answer(n: int, body: dict) -> Reply:
    """A valid answer of the engine's fused stages (the schema's name is the stage)."""
    stage = body.get("response_format", {}).get("json_schema", {}).get("name")
    return 200, {}, ok_body(json.dumps(PAGE if stage == "page" else PROMOTION)), 0


# ------------------------------------------------------------------ the backend's rule


@pytest.mark.parametrize(
    "script",
    [
        failing(500),
        failing(502),
        failing(503),
        failing(429, {"Retry-After": "0"}),
        lambda n, body: (200, {}, ok_body("late"), 1.0),  # past timeout_s: a hung model
        # a 200 that is not JSON: a proxy's error page or a web UI at base_url, not the model
        lambda n, body: (200, {}, "<html>gateway</html>", 0),
    ],
    ids=["500", "502", "503", "429", "timeout", "non-json"],
)
def test_a_batch_the_server_fails_entirely_raises_and_opens_the_breaker(
    server: FakeServer, script: Any
) -> None:
    server.script = script
    with backend(server, timeout_s=0.3) as b:
        with pytest.raises(LLMBackendError, match=FAILED) as info:
            b.generate(batch(3))
        assert len(server.bodies) == 3 * 2  # every request had its retry
        assert b.breaker.state == "open" and b.breaker.failures == 0  # not a connect failure
        assert "all 3 requests of a batch failed, 2 tries each" in str(info.value)
        with pytest.raises(LLMBackendError, match=f"{FAILED}.*; not trying again for"):
            b.generate(batch(5))
        assert len(server.bodies) == 6  # refused without touching the server


def test_after_the_cool_down_a_server_that_serves_again_closes_the_breaker(
    server: FakeServer,
) -> None:
    clock = Clock()
    server.script = failing(503)
    with backend(server) as b:
        b.breaker.clock = clock
        with pytest.raises(LLMBackendError, match=FAILED):
            b.generate(batch(2))
        server.script = lambda n, body: (200, {}, ok_body("fine"), 0)
        clock.now += 31
        assert [r.text for r in b.generate(batch(2))] == ["fine", "fine"]
        assert b.breaker.state == "closed"


def test_server_failures_among_answers_stay_each_requests_own(server: FakeServer) -> None:
    def script(n: int, body: dict) -> Reply:
        if body["messages"][0]["content"] == "q1":
            return 500, {}, {"error": {"message": "boom"}}, 0
        return 200, {}, ok_body("fine"), 0

    server.script = script
    with backend(server) as b:
        res = b.generate(batch(3))
        assert [r.text for r in res] == ["fine", "", "fine"]
        assert "HTTP 500: boom" in (res[1].error or "")
        assert b.breaker.state == "closed"


@pytest.mark.parametrize(
    "script",
    [
        failing(400),
        failing(422),
        lambda n, body: (200, {}, {"choices": [{"message": {"content": 42}}]}, 0),
        lambda n, body: failing(400 if body["messages"][0]["content"] == "q0" else 500)(n, body),
    ],
    ids=["400", "422", "bad-shape", "400-and-500s"],
)
def test_client_errors_and_malformed_answers_are_each_requests_own(
    server: FakeServer, script: Any
) -> None:
    """Not the server's failure (or not all of them): the batch is answered."""
    server.script = script
    with backend(server) as b:
        res = b.generate(batch(3))
        assert all(r.error for r in res)
        assert b.breaker.state == "closed"


def _late(n: int, body: dict) -> Reply:
    return 200, {}, ok_body("late"), 0


def hang(
    server: FakeServer, seconds: float, answer: Callable[[int, dict], Reply] = _late
) -> tuple[threading.Event, threading.Event]:
    """Script ``server`` to hold every request until released (at most ``seconds``), then
    give ``answer``; returns (a request arrived, release)."""
    got, release = threading.Event(), threading.Event()

    def held(n: int, body: dict) -> Reply:
        got.set()
        release.wait(seconds)
        return answer(n, body)

    server.script = held
    return got, release


def test_close_cancels_a_batch_in_flight(server: FakeServer) -> None:
    """A hung server: close() fails the batch now instead of after timeout_s x tries."""
    got, release = hang(server, 60)
    b = backend(server, timeout_s=60, max_retries=4)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            b.generate(batch(2))
        except BaseException as e:  # recorded for the assertion
            raised.append(e)

    caller = threading.Thread(target=call, daemon=True)
    try:
        caller.start()
        assert got.wait(10)
        b.close()
        caller.join(10)
        assert not caller.is_alive()
        assert isinstance(raised[0], LLMBackendError)
        assert "closed while this batch was in flight" in str(raised[0])
        with pytest.raises(LLMBackendError, match="closed"):
            b.generate(batch(1))
    finally:
        release.set()


# ------------------------------------------------------------------ the engine: pending


def engine(llm: OpenAICompatBackend, store: str = ":memory:", **config: Any) -> MemoryEngine:
    """An LLM-mode engine on the hashing embedder with an STM of one page: a user's second
    page pushes the first out (one pending page)."""
    cfg = EngineConfig(
        store=store,
        memory=preset("paper", stm_capacity=1),
        llm=LLMConfig(mode="llm", backend="openai", base_url=llm.base_url, model="m"),
        embedder="hashing",
        device="cpu",
        **config,
    )
    return MemoryEngine(cfg, llm=llm)


def two_pages(users: list[str]) -> list[PageInput]:
    return [
        PageInput(u, f"{u} {name}", "ok", float(t))
        for u in users
        for t, name in enumerate(("one", "two"))
    ]


def modes(eng: MemoryEngine) -> dict[Any, int]:
    return dict(eng.store.query("SELECT mode, COUNT(*) FROM pages GROUP BY mode"))


def test_an_engine_keeps_the_work_pending_while_the_server_fails_every_request(
    server: FakeServer,
) -> None:
    server.script = failing(503)
    clock = Clock()
    llm = backend(server)
    llm.breaker.clock = clock
    users = ["u0", "u1", "u2"]
    eng = engine(llm)
    try:
        for p in two_pages(users):  # each add runs the derived work owed (auto_process)
            eng.add_many([p])
        assert eng.pending_count() == 3
        assert "llm-fallback" not in modes(eng)
        stats = eng.stats()
        assert stats["llm"]["fallbacks"] == 0
        assert stats["counters"]["derived_failures"] >= 1  # logged and counted, not raised
        assert len(server.bodies) == 2  # one request's tries; then the breaker refused at once

        server.script = stage_answer  # the server serves again, after the cool-down
        clock.now += 31
        assert eng.process_pending()["pages"] == 3
        assert eng.pending_count() == 0
        assert modes(eng) == {"llm": 3, None: 3}  # the three second pages are still in STM
        assert eng.stats()["llm"]["fallbacks"] == 0
    finally:
        eng.close()


def test_an_isolated_failure_falls_back_counted_and_logged(
    server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    def script(n: int, body: dict) -> Reply:
        if "u1 one" in body["messages"][-1]["content"]:
            return 500, {}, {"error": {"message": "boom"}}, 0
        return stage_answer(n, body)

    server.script = script
    eng = engine(backend(server), auto_process=False)
    try:
        eng.add_many(two_pages(["u0", "u1", "u2"]))
        with caplog.at_level(logging.WARNING, logger="memoryos_gpu.stages"):
            eng.process_pending()
        assert eng.pending_count() == 0
        assert modes(eng) == {"llm": 2, "llm-fallback": 1, None: 3}
        llm = eng.stats()["llm"]
        assert llm["fallbacks"] == 1 and llm["per_stage"]["page"]["fallbacks"] == 1
        (record,) = [r for r in caplog.records if "extractive fallback" in r.getMessage()]
        assert "HTTP 500: boom" in record.getMessage()
    finally:
        eng.close()


# ------------------------------------------------------------------ the server's shutdown


async def closed_leaving_three(svc: MemoryService) -> float:
    """Close ``svc`` while a derived round waits for the hung server; the seconds it took
    (the three items of ``two_pages`` of three users are left pending)."""
    t0 = time.monotonic()
    await asyncio.wait_for(svc.close(), 120)
    assert "3 derived item(s) left pending" in svc.closed_message
    return time.monotonic() - t0


def test_shutdown_with_a_hung_llm_ends_by_the_deadline_and_leaves_the_work_pending(
    server: FakeServer, tmp_path: Path
) -> None:
    """Defaults that make one wave cost 5 x 60 s: shutdown still ends by the deadline (plus
    the round's unwinding), and the round's pages stay pending in the store."""
    got, release = hang(server, 120, stage_answer)
    store = tmp_path / "memory.sqlite3"
    drain_s = 1.0

    def make() -> MemoryEngine:
        return engine(
            backend(server, timeout_s=60, max_retries=4),
            store=str(store),
            shutdown_drain_s=drain_s,
            auto_process=False,  # as the server builds it: derived work in its own thread
        )

    async def scenario() -> float:
        svc = MemoryService(make, ServerSettings(derived_max_wait_ms=0))
        await svc.start()
        await svc.add_pages(two_pages(["u0", "u1", "u2"]))
        assert await asyncio.to_thread(got.wait, 30)  # a round waits for the hung server
        return await closed_leaving_three(svc)

    try:
        elapsed = asyncio.run(scenario())
    finally:
        release.set()
    assert elapsed < drain_s + 20  # generous (the round's unwinding: 5 s at most); was 5 x 60 s
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM pending").fetchone()[0] == 3
        assert db.execute("SELECT COUNT(*) FROM pages WHERE mode IS NOT NULL").fetchone()[0] == 0


def test_a_server_resumes_the_work_left_pending_after_it_is_ready_and_its_shutdown_is_bounded(
    server: FakeServer, tmp_path: Path
) -> None:
    """A store with derived work a previous run left pending, served from its config (as
    ``memoryos-gpu serve`` does) while the LLM server hangs: the server is ready without
    waiting for that work (the open ran it, for up to 5 x 60 s a call), the derived-work
    thread resumes it, and a shutdown meanwhile ends by ``shutdown_drain_s``, the work still
    pending."""
    store = str(tmp_path / "memory.sqlite3")
    server.script = stage_answer
    with engine(backend(server), store=store, auto_process=False) as eng:
        eng.add_many(two_pages(["u0", "u1", "u2"]))
        assert eng.pending_count() == 3
    got, release = hang(server, 120, stage_answer)
    llm = LLMConfig(
        mode="llm", backend="openai", base_url=server.url, model="m",
        options={"timeout_s": 60, "max_retries": 4},
    )  # fmt: skip
    cfg = EngineConfig(
        store=store, memory=preset("paper", stm_capacity=1), llm=llm, embedder="hashing",
        device="cpu", shutdown_drain_s=1.0,
    )  # fmt: skip

    async def scenario() -> float:
        svc = MemoryService(cfg, ServerSettings(derived_max_wait_ms=0))
        await asyncio.wait_for(svc.start(), 60)  # the open does not wait for the LLM
        assert svc.state == "ready"
        assert await asyncio.to_thread(got.wait, 30)  # the thread resumed the work
        return await closed_leaving_three(svc)

    try:
        elapsed = asyncio.run(scenario())
    finally:
        release.set()
    assert elapsed < 1.0 + 20
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM pending").fetchone()[0] == 3


def test_shutdown_with_a_response_waiting_for_a_hung_llm_ends_by_the_deadline(
    server: FakeServer,
) -> None:
    got, release = hang(server, 120)

    def make() -> MemoryEngine:
        llm = backend(server, timeout_s=60, max_retries=4)
        return engine(llm, shutdown_drain_s=0.5, auto_process=False)

    async def scenario() -> tuple[float, BaseException | None]:
        svc = MemoryService(make, ServerSettings())
        await svc.start()
        await svc.add_pages([PageInput("u0", "u0 one", "ok", 1.0)])  # no derived work owed
        answer = asyncio.ensure_future(svc.respond("u0", "what did I say?"))
        assert await asyncio.to_thread(got.wait, 30)
        t0 = time.monotonic()
        await asyncio.wait_for(svc.close(), 120)
        elapsed = time.monotonic() - t0
        return elapsed, (await asyncio.gather(answer, return_exceptions=True))[0]

    try:
        elapsed, answered = asyncio.run(scenario())
    finally:
        release.set()
    assert elapsed < 0.5 + 20  # generous (unwinding: 5 s at most); it could wait 5 x 60 s
    assert isinstance(answered, LLMBackendError)


# ------------------------------------------------------------------ ingest: a run that says so


def test_ingest_whose_llm_cannot_serve_exits_1_and_says_the_work_stays_pending(
    server: FakeServer, tmp_path: Path
) -> None:
    """The derived work of an ``ingest`` the LLM failed stays pending (no fallback): the run
    says so (``derived_failure``, one ``error:`` line, exit 1) instead of "done", exit 0; a
    run once the LLM serves again finishes the work and exits 0."""
    from memoryos_gpu.cli.ingest import _derived_failed_line
    from memoryos_gpu.ingest import ingest

    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "\n".join(
            json.dumps({"user_id": p.user_id, "user_input": p.user_input, "agent_response": "ok"})
            for p in two_pages(["u0", "u1", "u2"])
        )
    )
    server.script = failing(503)
    clock = Clock()
    llm = backend(server)
    llm.breaker.clock = clock
    eng = engine(llm, store=str(tmp_path / "store"))
    try:
        r = ingest([str(chats)], eng, progress=False)
        assert (r.accepted, r.pending, r.derived_failure) == (6, 3, "llm_unavailable")
        assert r.exit_code == 1 and r.to_dict()["exit_code"] == 1
        assert "llm-fallback" not in modes(eng)
        line = _derived_failed_line(r.to_dict()) or ""
        assert line.startswith("error: store ") and "the LLM could not be used" in line
        assert "the derived work of 3 item(s) stays pending" in line
        assert "resumes once the LLM answers" in line and "with the LLM settings" in line

        server.script = stage_answer  # the LLM serves again, after the cool-down
        clock.now += 31
        r = ingest([str(chats)], eng, progress=False)
        assert (r.skipped, r.pending, r.derived_failure, r.exit_code) == (6, 0, None, 0)
    finally:
        eng.close()


# ------------------------------------------------------------------ respond: Retry-After


def test_an_open_breakers_error_says_its_remaining_cool_down(server: FakeServer) -> None:
    """The refusal carries the wait its message states ("not trying again for N s"), and it
    survives the trip to the HTTP worker of ``serve --workers`` (BoxedError)."""
    from memoryos_gpu.distributed.ray_common import BoxedError
    from memoryos_gpu.server.memory_routes import LLM_RETRY_AFTER, _llm_outage

    server.script = failing(503)
    clock = Clock()
    with backend(server, breaker_cooldown_s=5) as b:
        b.breaker.clock = clock
        with pytest.raises(LLMBackendError, match="not trying again for 5 s") as tripped:
            b.generate(batch(2))
        assert tripped.value.retry_after == 5
        clock.now += 1.5
        with pytest.raises(LLMBackendError, match=r"not trying again for 3\.5 s") as refused:
            b.generate(batch(2))
    assert refused.value.retry_after == 3.5
    assert _llm_outage(refused.value).retry_after == 4  # whole seconds, rounded up
    assert BoxedError.of(refused.value).exception().retry_after == 3.5  # type: ignore[attr-defined]
    assert _llm_outage(LLMBackendError("no vllm")).retry_after == LLM_RETRY_AFTER
    assert _llm_outage(LLMBackendError.refusing("x", 0.2)).retry_after == 1


def test_respond_503_retry_after_follows_the_breakers_cool_down(server: FakeServer) -> None:
    """``breaker_cooldown_s = 5``: the 503 said ``Retry-After: 30`` while its body said "not
    trying again for 5 s"."""
    from served import HA, serve

    server.script = stage_answer
    eng = engine(backend(server, breaker_cooldown_s=5), auto_process=False)
    try:
        with serve(eng, derived_enabled=False) as c:
            r = c.post("/v1/users/u0/pages", json={"user_input": "I like tea"}, headers=HA)
            assert r.status_code == 201, r.text
            server.script = failing(503)
            r = c.post("/v1/users/u0/respond", json={"query": "what do I like?"}, headers=HA)
            assert r.status_code == 503, r.text
            detail = r.json()["detail"]  # a tenant's: the wait, not the LLM's address
            assert "retry in 5 s" in detail and "127.0.0.1" not in detail, detail
            assert r.headers["Retry-After"] == "5"
    finally:
        eng.close()

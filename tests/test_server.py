"""The HTTP server, through a real uvicorn server on 127.0.0.1 and an httpx client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from served import (  # noqa: E402
    ADMIN_KEYS,
    HA,
    HADMIN,
    HB,
    KEY_A,
    KEY_ADMIN,
    KEY_B,
    KEYS,
    ROOT,
    free_port,
    hashing,
    serve,
    wait_ready,
)

from memoryos_gpu.engine import MemoryEngine  # noqa: E402
from memoryos_gpu.server.auth import (  # noqa: E402
    ENV_VAR,
    KeyFileError,
    KeyRing,
    RateLimiter,
    load_api_keys,
    parse_key_env,
    parse_key_file,
)


def add(c: httpx.Client, user: str, text: str, headers: dict = HA, **kw: Any) -> httpx.Response:
    return c.post(
        f"/v1/users/{user}/pages",
        json={"user_input": text, "agent_response": f"re: {text}", **kw},
        headers=headers,
    )


# ====================================================================== keys and limits (unit)
def test_key_file_and_env_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# comment\n\n{KEY_A} acme\n  {KEY_B}   beta  \n")
    assert parse_key_file(f) == KEYS
    assert parse_key_env(f"{KEY_A}:acme, {KEY_B}:beta") == KEYS
    monkeypatch.setenv(ENV_VAR, "key-from-env-000:gamma")
    merged = load_api_keys(f)
    assert merged == {**KEYS, "key-from-env-000": "gamma"}
    monkeypatch.delenv(ENV_VAR)
    assert load_api_keys(None) is None
    bad = tmp_path / "bad"
    bad.write_text("onlyonefield\n")
    with pytest.raises(KeyFileError, match="bad:1"):
        parse_key_file(bad)
    bad.write_text("short acme\n")
    with pytest.raises(KeyFileError, match=">= 8"):
        parse_key_file(bad)
    bad.write_text(f"{KEY_A} bad/tenant\n")
    with pytest.raises(KeyFileError, match="tenant"):
        parse_key_file(bad)
    ring = KeyRing(KEYS)
    assert ring.lookup(KEY_A).tenant == "acme"
    assert ring.lookup("nope-nope-nope") is None
    assert KEY_A not in repr(ring.lookup(KEY_A))  # only a fingerprint is kept


def test_token_bucket() -> None:
    # a rate of 1/s: a pause of the test process (a full collection, preemption) between the
    # takes must not refill the bucket before the third (at 10/s, 0.1 s did)
    rl = RateLimiter(rate=1, burst=2)
    assert rl.take("k") == 0 and rl.take("k") == 0
    wait = rl.take("k")
    assert 0 < wait <= 1.0
    assert rl.take("other") == 0  # per key
    assert RateLimiter.retry_after(wait) == 1
    assert RateLimiter(0, 1).take("k") == 0  # disabled


# ====================================================================== probes, auth
def test_probes_auth_and_openapi() -> None:
    with serve(hashing(), keys=ADMIN_KEYS) as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/ready").json()["ready"] is True
        spec = c.get("/openapi.json").json()
        v1 = [(p, meth) for p, ops in spec["paths"].items() for meth in ops if p.startswith("/v1")]
        assert len(v1) >= 18
        for path, ops in spec["paths"].items():
            for meth, op in ops.items():
                assert op.get("summary") and op.get("description"), (path, meth)
        probes = {p: set(spec["paths"][p]["get"]["responses"]) for p in ("/health", "/ready")}
        assert probes == {"/health": {"200"}, "/ready": {"200", "503"}}  # no key: no 401
        assert {"401", "429"} <= set(spec["paths"]["/v1/users"]["get"]["responses"])
        # /health: 200 with any key or none; /metrics shows every tenant's load: the admin's
        assert c.get("/health", headers={"Authorization": "Bearer wrong"}).status_code == 200
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=HA).status_code == 403
        for path, meth in v1:
            url = path.replace("{user_id}", "alice").replace("{page_id}", "1")
            url = url.replace("{entry_id}", "1")
            r = c.request(meth.upper(), url, json={})
            assert r.status_code == 401, (meth, path, r.status_code)
            assert r.json()["error"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"
        r = c.get("/v1/users", headers={"Authorization": "Bearer wrong-key-123456"})
        assert r.status_code == 401 and r.json()["detail"] == "unknown API key"
        r = c.get("/v1/users", headers={"Authorization": KEY_A})  # no Bearer scheme
        assert r.status_code == 401
        assert c.get("/v1/users", headers=HA).json() == {"users": []}
        metrics = c.get("/metrics", headers=HADMIN).text
        for name in (
            "memoryos_http_request_duration_seconds",
            "memoryos_queue_depth",
            "memoryos_pending_derived",
            "memoryos_rejected_total",
            "memoryos_llm_calls_total",
            "memoryos_llm_tokens_total",
        ):
            assert name in metrics, name
        assert 'reason="unauthorized"' in metrics


def test_fastapi_opentelemetry_checks_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """FastAPI's own OpenTelemetry instrumentation looks up the global providers on every
    request (~9 % of a worker's CPU): off by default, it is not consulted at all; with
    ``http_telemetry`` it is, so a configured OpenTelemetry SDK sees the requests."""
    from memoryos_gpu.server.app import _FASTAPI_TELEMETRY

    if not _FASTAPI_TELEMETRY:
        pytest.skip("this FastAPI has no OpenTelemetry instrumentation of its own")
    from opentelemetry import trace

    lookups = [0]
    real = trace.get_tracer_provider

    def counted() -> Any:
        lookups[0] += 1
        return real()

    monkeypatch.setattr(trace, "get_tracer_provider", counted)
    for enabled in (False, True):
        lookups[0] = 0
        with serve(hashing(), http_telemetry=enabled) as c:
            before = lookups[0]
            for i in range(5):
                assert add(c, "alice", f"page {i}").status_code == 201
            assert c.post("/v1/users/alice/retrieve", json={"query": "page"}, headers=HA).is_success
            seen = lookups[0] - before
        assert (seen >= 6) if enabled else (seen == 0), (enabled, seen)


def test_ready_while_loading_then_serving() -> None:
    gate = threading.Event()

    def slow_engine() -> MemoryEngine:
        gate.wait(10)
        return MemoryEngine(hashing())

    with serve(slow_engine, wait_ready=False) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        r = add(c, "alice", "too early")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == "unavailable"
        gate.set()
        deadline = time.monotonic() + 10
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert add(c, "alice", "now").status_code == 201


def test_a_serving_process_freezes_what_it_loaded(tmp_path: Path) -> None:
    """With ``gc_freeze`` (what ``serve`` sets) the users' state the engine loaded is out of
    the collector's scans once the server is ready, and still served; without it (the default,
    for processes that build many services) nothing is frozen."""
    import gc

    store = tmp_path / "store"
    with MemoryEngine(hashing(store)) as eng:
        eng.add_many([{"user_id": f"u{i}", "user_input": f"I like tea {i}"} for i in range(5)])
    scanned = {id(o) for o in gc.get_objects()}
    try:
        for freeze in (False, True):
            gc.unfreeze()
            with serve(hashing(store), keys=None, gc_freeze=freeze) as c:
                engine = c.app.state.service.engine  # type: ignore[attr-defined]
                states = list(engine._state.users.values())
                assert len(states) == 5
                scanned = {id(o) for o in gc.get_objects()}
                assert all((id(s) in scanned) is not freeze for s in states), freeze
                assert (gc.get_freeze_count() > 0) is freeze
                got = c.post("/v1/users/u3/retrieve", json={"query": "tea"}).json()
                assert [p["user_input"] for p in got["stm"]] == ["I like tea 3"]
    finally:
        gc.unfreeze()


# ====================================================================== the endpoints
def test_endpoints_roundtrip() -> None:
    with serve(hashing()) as c:
        ids = []
        for i in range(10):
            r = add(c, "alice", f"I went hiking in the Alps on day {i}", timestamp=1000.0 + i)
            assert r.status_code == 201, r.text
            assert r.json()["user_id"] == "alice" and not r.json()["duplicate"]
            ids.append(r.json()["page_id"])
        assert ids == sorted(ids)
        # idempotent source
        r1 = add(c, "alice", "sourced", source="log:1")
        r2 = add(c, "alice", "sourced again", source="log:1")
        assert r2.json() == {**r1.json(), "duplicate": True}
        # read-your-writes barrier: the 4 pages pushed out of STM reach MTM
        w = c.post("/v1/users/alice/wait", params={"timeout": 10}, headers=HA).json()
        assert w["done"] and w["pending"] == 0 and w["queued_writes"] == 0
        r = c.post("/v1/users/alice/retrieve", json={"query": "hiking Alps"}, headers=HA)
        assert r.status_code == 200
        ret = r.json()
        assert ret["user_id"] == "alice" and ret["known_user"]
        assert len(ret["stm"]) == 7 and len(ret["pages"]) >= 1
        assert all(p["tier"] == "mtm" for p in ret["pages"])
        r = c.post("/v1/users/alice/retrieve", json={"query": "hiking", "top_pages": 1}, headers=HA)
        assert len(r.json()["pages"]) == 1
        r = c.post("/v1/users/nobody/retrieve", json={"query": "x"}, headers=HA).json()
        assert r["known_user"] is False and r["stm"] == [] and r["pages"] == []
        assert c.get("/v1/users", headers=HA).json() == {"users": ["alice"]}
        prof = c.get("/v1/users/alice/profile", headers=HA).json()
        assert prof["user_id"] == "alice" and isinstance(prof["profile"], dict)
        kn = c.get("/v1/users/alice/knowledge", headers=HA).json()
        assert set(kn) == {"user_id", "user", "assistant"}
        hist = c.get("/v1/users/alice/history", headers=HA).json()
        assert sum(h["action"] == "add" for h in hist) == 11
        exp = c.get("/v1/users/alice/export", headers=HA).json()
        assert exp["user"]["user_id"] == "alice" and len(exp["pages"]) == 11
        assert all(p["user_id"] == "alice" for p in exp["pages"])
        assert all(p["source"] in (None, "log:1") for p in exp["pages"])
        assert c.get("/v1/users/ghost/profile", headers=HA).status_code == 404
        assert c.get("/v1/users/ghost/export", headers=HA).json()["error"] == "unknown_user"
        assert c.get("/v1/stats", headers=HA).json() == {"tenant": "acme", "users": 1}
        # respond without an LLM: 501
        r = c.post("/v1/users/alice/respond", json={"query": "hi"}, headers=HA)
        assert r.status_code == 501 and r.json()["error"] == "llm_unavailable"
        # delete the user
        assert c.delete("/v1/users/alice", headers=HA).json() == {"deleted": True}
        assert c.delete("/v1/users/alice", headers=HA).status_code == 404
        assert c.get("/v1/users", headers=HA).json() == {"users": []}
        r = c.post("/v1/users/alice/retrieve", json={"query": "hiking"}, headers=HA).json()
        assert r["known_user"] is False


def test_batch_add_and_batch_retrieve_keep_order() -> None:
    with serve(hashing()) as c:
        pages = [
            {"user_id": f"u{i % 3}", "user_input": f"message {i // 3} about topic {i % 3}"}
            for i in range(30)
        ]
        r = c.post("/v1/pages", json={"pages": pages}, headers=HA)
        assert r.status_code == 201
        res = r.json()["results"]
        assert [x["user_id"] for x in res] == [p["user_id"] for p in pages]
        for u in ("u0", "u1", "u2"):
            c.post(f"/v1/users/{u}/wait", headers=HA)
            exp = c.get(f"/v1/users/{u}/export", headers=HA).json()
            texts = [p["user_input"] for p in sorted(exp["pages"], key=lambda p: p["seq"])]
            assert texts == [f"message {k} about topic {u[1]}" for k in range(10)]
        q = {"queries": [{"user_id": f"u{i}", "query": "topic"} for i in (2, 0, 1, 9)]}
        r = c.post("/v1/retrieve", json=q, headers=HA).json()["results"]
        assert [x["user_id"] for x in r] == ["u2", "u0", "u1", "u9"]
        assert [x["known_user"] for x in r] == [True, True, True, False]


def test_page_and_knowledge_items() -> None:
    with serve(hashing()) as c:
        pid = add(c, "alice", "my cat is called Tom").json()["page_id"]
        other = add(c, "bob", "bob's page").json()["page_id"]
        r = c.get(f"/v1/users/alice/pages/{pid}", headers=HA)
        assert r.status_code == 200 and r.json()["user_input"] == "my cat is called Tom"
        assert r.json()["user_id"] == "alice"
        assert c.get(f"/v1/users/alice/pages/{other}", headers=HA).status_code == 404
        assert c.get("/v1/users/alice/pages/999999", headers=HA).status_code == 404
        r = c.patch(
            f"/v1/users/alice/pages/{pid}", json={"agent_response": "Tom is a name"}, headers=HA
        )
        assert r.status_code == 200 and r.json()["agent_response"] == "Tom is a name"
        assert c.patch(f"/v1/users/alice/pages/{pid}", json={}, headers=HA).status_code == 422
        assert c.delete(f"/v1/users/alice/pages/{pid}", headers=HA).json() == {"deleted": True}
        assert c.get(f"/v1/users/alice/pages/{pid}", headers=HA).status_code == 404
        assert (
            c.patch("/v1/users/alice/knowledge/424242", json={"text": "x"}, headers=HA).status_code
            == 404
        )
        assert c.delete("/v1/users/alice/knowledge/424242", headers=HA).status_code == 404


def test_ids_beyond_64_bits_are_invalid_input() -> None:
    """An id no store key can hold is not a driver overflow but a 422, as 0 or -1 is."""
    with serve(hashing()) as c:
        add(c, "alice", "my cat is called Tom")
        for big in (2**63, 2**64 + 5, -(2**63) - 1):
            page, entry = f"/v1/users/alice/pages/{big}", f"/v1/users/alice/knowledge/{big}"
            assert c.get(page, headers=HA).status_code == 422
            r = c.patch(page, json={"user_input": "x"}, headers=HA)
            assert r.status_code == 422 and r.json()["error"] == "invalid_input"
            assert c.delete(page, headers=HA).status_code == 422
            assert c.patch(entry, json={"text": "x"}, headers=HA).status_code == 422
            assert c.delete(entry, headers=HA).status_code == 422
            assert c.get(entry, headers=HA).status_code == 422


def test_knowledge_entry_edit_and_delete() -> None:
    # enough pages on one topic for a segment to reach the promotion heat (extractive facts)
    with serve(hashing()) as c:
        for i in range(14):
            add(c, "alice", f"I love hiking in the Alps {i}", timestamp=100.0 + i)
        c.post("/v1/users/alice/wait", headers=HA)
        entries = c.get("/v1/users/alice/knowledge", headers=HA).json()["user"]
        if not entries:
            pytest.skip("the engine promoted nothing on this input")
        eid = entries[0]["entry_id"]
        assert c.get("/v1/users/alice/knowledge", headers=HB).status_code == 404
        r = c.patch(f"/v1/users/alice/knowledge/{eid}", json={"text": "likes hikes"}, headers=HB)
        assert r.status_code == 404 and r.json()["error"] == "not_found"  # not even confirmed
        r = c.patch(f"/v1/users/alice/knowledge/{eid}", json={"text": "likes hikes"}, headers=HA)
        assert r.status_code == 200 and r.json()["text"] == "likes hikes"
        assert c.delete(f"/v1/users/alice/knowledge/{eid}", headers=HB).status_code == 404
        assert c.delete(f"/v1/users/alice/knowledge/{eid}", headers=HA).json()["deleted"]


# ====================================================================== tenancy
def test_tenant_isolation() -> None:
    with serve(hashing()) as c:
        pa = add(c, "sam", "acme secret: the launch code is 1234", source="s1").json()
        pb = add(c, "sam", "beta note: I like tea", headers=HB, source="s1").json()
        assert not pb["duplicate"] and pb["page_id"] != pa["page_id"]  # sources per tenant
        ra = c.post("/v1/users/sam/retrieve", json={"query": "launch code"}, headers=HA).json()
        rb = c.post("/v1/users/sam/retrieve", json={"query": "launch code"}, headers=HB).json()
        assert [p["user_input"] for p in ra["stm"]] == ["acme secret: the launch code is 1234"]
        assert [p["user_input"] for p in rb["stm"]] == ["beta note: I like tea"]
        assert "1234" not in str(rb)
        # another tenant's page by id: not found, as an id that does not exist (a 403 confirmed
        # that the id exists: probing counted the other tenants' pages), never its content
        r = c.get(f"/v1/users/sam/pages/{pa['page_id']}", headers=HB)
        assert r.status_code == 404 and "1234" not in r.text
        assert r.json() == c.get("/v1/users/sam/pages/987654", headers=HB).json() | {
            "detail": f"no page {pa['page_id']}"
        }
        assert c.delete(f"/v1/users/sam/pages/{pa['page_id']}", headers=HB).status_code == 404
        r = c.patch(f"/v1/users/sam/pages/{pa['page_id']}", json={"user_input": "x"}, headers=HB)
        assert r.status_code == 404
        # exports, lists and deletes are per tenant
        eb = c.get("/v1/users/sam/export", headers=HB).json()
        assert [p["user_input"] for p in eb["pages"]] == ["beta note: I like tea"]
        assert c.get("/v1/users", headers=HB).json() == {"users": ["sam"]}
        assert c.delete("/v1/users/sam", headers=HB).json() == {"deleted": True}
        assert c.get(f"/v1/users/sam/pages/{pa['page_id']}", headers=HA).status_code == 200
        assert c.get("/v1/stats", headers=HB).json()["users"] == 0
        # a user id that looks like a namespaced id stays inside the caller's tenant: beta's
        # "acme/sam" is stored as "beta/acme/sam", a user beta does not have
        r = c.post("/v1/users/acme%2Fsam/retrieve", json={"query": "code"}, headers=HB)
        assert r.status_code == 200 and "1234" not in r.text
        assert r.json()["user_id"] == "acme/sam" and not r.json()["known_user"]
        q = {"queries": [{"user_id": "acme/sam", "query": "code"}]}
        r = c.post("/v1/retrieve", json=q, headers=HB)
        assert r.status_code == 200 and "1234" not in r.text
        assert not r.json()["results"][0]["known_user"]
        assert c.get("/v1/users/acme%2Fsam/pages", headers=HB).status_code == 404
        r = c.post("/v1/users/acme%2Fsam/pages", json={"user_input": "x"}, headers=HB)
        assert r.status_code == 422 and r.json()["error"] == "invalid_user_id"


def test_open_mode_without_keys() -> None:
    engine = MemoryEngine(hashing())
    with serve(engine, keys=None) as c:
        assert add(c, "alice", "hello", headers={}).status_code == 201
        assert c.get("/v1/users").json() == {"users": ["alice"]}
        assert c.get("/v1/stats").json()["tenant"] is None
    assert engine.users() == ["alice"]  # stored as given, not namespaced
    engine.close()


def test_rate_limit_per_key() -> None:
    with serve(hashing(), rate_limit_per_s=0.1, rate_limit_burst=3) as c:
        codes = [c.get("/v1/users", headers=HA).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        r = c.get("/v1/users", headers=HA)
        assert r.json()["error"] == "rate_limited" and int(r.headers["retry-after"]) >= 1
        assert c.get("/v1/users", headers=HB).status_code == 200  # other key unaffected
        assert c.get("/health").status_code == 200


def test_rate_limits_count_pages_and_bytes() -> None:
    """A key's page and byte buckets: a request count alone would let one key send the largest
    requests back to back."""
    pages = {"pages": [{"user_id": f"u{i}", "user_input": f"page {i}"} for i in range(5)]}
    with serve(
        hashing(), max_batch_items=5, rate_limit_pages_per_s=0.1, rate_limit_pages_burst=8
    ) as c:
        assert c.post("/v1/pages", json=pages, headers=HA).status_code == 201  # 5 of 8
        r = c.post("/v1/pages", json=pages, headers=HA)  # 10 > 8
        assert r.status_code == 429 and r.json()["error"] == "rate_limited"
        assert "pages: 0.1 per second" in r.json()["detail"] and "retry-after" in r.headers
        assert add(c, "u0", "one more fits").status_code == 201  # 6 of 8
        assert c.post("/v1/pages", json=pages, headers=HB).status_code == 201  # other key
    body = {"user_input": "x" * 3000}
    with serve(
        hashing(),
        max_body_bytes=4096,
        tenant_write_queue_chars=4096,
        rate_limit_bytes_per_s=1.0,
        rate_limit_bytes_burst=8192,
    ) as c:
        codes = [c.post("/v1/users/u/pages", json=body, headers=HA).status_code for _ in range(3)]
        assert codes == [201, 201, 429]
        r = c.post("/v1/users/u/pages", json=body, headers=HA)
        assert "bytes: 1 per second" in r.json()["detail"]
        assert c.post("/v1/users/u/pages", json=body, headers=HB).status_code == 201

        def chunks() -> Iterator[bytes]:  # no Content-Length: charged once read
            yield b'{"user_input": "'
            yield b"y" * 3000
            yield b'"}'

        headers = {**HB, "Content-Type": "application/json"}
        codes = [
            c.post("/v1/users/u/pages", content=chunks(), headers=headers).status_code
            for _ in range(2)
        ]
        assert codes == [201, 429]


# ====================================================================== validation
def test_validation_and_size_limits() -> None:
    with serve(hashing(), max_text_chars=1000, max_batch_items=5, max_body_bytes=64 * 1024) as c:
        bad = [
            {"agent_response": "no user_input"},
            {"user_input": 5},
            {"user_input": "x", "unknown_field": 1},
            {"user_input": "x", "source": "   "},
            {"user_input": "x", "assistant_id": "a\x00b"},
        ]
        for body in bad:
            r = c.post("/v1/users/alice/pages", json=body, headers=HA)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["error"] == "validation_error"
        json_type = {**HA, "content-type": "application/json"}  # none: 415 (test_server_edges)
        r = c.post("/v1/users/alice/pages", content=b"{not json", headers=json_type)
        assert r.status_code == 422
        r = add(c, "alice", "x", timestamp="not a date")
        assert r.status_code == 422 and "timestamp" in r.json()["detail"]
        r = add(c, "%20", "blank user")
        assert r.status_code == 422 and r.json()["error"] == "invalid_user_id"
        r = add(c, "u" * 300, "long user id")
        assert r.status_code == 422
        r = c.post("/v1/users/alice/retrieve", json={"query": "q", "top_pages": 0}, headers=HA)
        assert r.status_code == 422
        # 413: texts, batches, bodies
        r = add(c, "alice", "y" * 1001)
        assert r.status_code == 413 and "user_input is 1001 characters" in r.json()["detail"]
        r = c.post("/v1/users/alice/retrieve", json={"query": "q" * 1001}, headers=HA)
        assert r.status_code == 413
        pages = [{"user_id": "a", "user_input": "x"}] * 6
        r = c.post("/v1/pages", json={"pages": pages}, headers=HA)
        assert r.status_code == 413 and "limit is 5" in r.json()["detail"]
        r = c.post("/v1/users/alice/pages", content=b"z" * (65 * 1024), headers=HA)
        assert r.status_code == 413 and r.json()["error"] == "too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
            for _ in range(20):
                yield b" " * 4096

        r = c.post(
            "/v1/users/alice/pages",
            content=chunks(),
            headers={**HA, "Content-Type": "application/json"},
        )
        assert r.status_code == 413
        # a good page after all that still works; nothing bad was stored
        assert add(c, "alice", "fine").status_code == 201
        assert len(c.get("/v1/users/alice/export", headers=HA).json()["pages"]) == 1


def _hot_route_script(c: httpx.Client) -> list[tuple[int, Any, str | None]]:
    """Requests to the two direct routes, good and bad: (status, JSON body, metrics label)."""
    long = "q" * 1001
    requests: list[tuple[str, dict[str, Any]]] = [
        ("/v1/users/alice/pages", {"json": {"user_input": "I sail on Sundays", "timestamp": 5}}),
        ("/v1/users/alice/pages", {"json": {"user_input": "x", "source": "s1", "timestamp": 6}}),
        ("/v1/users/alice/pages", {"json": {"user_input": "x", "source": "s1", "timestamp": 7}}),
        ("/v1/users/bob/pages", {"json": {"user_input": "bob page", "meta": {"k": [1, 2]}}}),
        ("/v1/users/alice/pages", {"json": {"agent_response": "no user_input"}}),
        ("/v1/users/alice/pages", {"json": {"user_input": 5}}),
        ("/v1/users/alice/pages", {"json": {"user_input": "x", "unknown_field": 1}}),
        ("/v1/users/alice/pages", {"json": {"user_input": "x", "assistant_id": "a\x00b"}}),
        ("/v1/users/alice/pages", {"json": {"user_input": "x", "timestamp": "not a date"}}),
        ("/v1/users/alice/pages", {"json": [1, 2]}),
        ("/v1/users/alice/pages", {"json": {"user_input": long}}),
        ("/v1/users/alice/pages", {"content": b"{not json"}),
        (
            "/v1/users/alice/pages",
            {"content": b"{not json", "headers": {"content-type": "application/json"}},
        ),
        ("/v1/users/alice/pages", {"content": b""}),
        ("/v1/users/alice/pages", {"content": b"z" * 70_000}),
        ("/v1/users/%20/pages", {"json": {"user_input": "blank user"}}),
        ("/v1/users/" + "u" * 300 + "/pages", {"json": {"user_input": "long user id"}}),
        ("/v1/users/alice/retrieve", {"json": {"query": "sailing"}}),
        ("/v1/users/alice/retrieve", {"json": {"query": "sailing", "top_pages": 2}}),
        ("/v1/users/nobody/retrieve", {"json": {"query": "sailing"}}),
        ("/v1/users/alice/retrieve", {"json": {"query": "q", "top_pages": 0}}),
        ("/v1/users/alice/retrieve", {"json": {"query": long}}),
        ("/v1/users/alice/retrieve", {"json": {}}),
    ]
    out = []
    for path, kw in requests:
        headers = {**HA, **kw.pop("headers", {})}
        r = c.post(path, headers=headers, **kw)
        body = (
            r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        )
        out.append((r.status_code, body, r.headers.get("retry-after")))
    wrong_key = c.post("/v1/users/alice/retrieve", json={"query": "q"}, headers=HB)
    out.append((wrong_key.status_code, wrong_key.json()["known_user"], None))
    no_key = c.post("/v1/users/alice/pages", json={"user_input": "x"})
    out.append((no_key.status_code, no_key.json(), None))
    return out


def test_direct_routes_answer_like_fastapi() -> None:
    """The edge's direct serving of the hot routes and FastAPI's routing give the same answers
    (status, body) to the same requests, good and bad, and the same metrics labels."""
    answers, labels = {}, {}
    for direct in (True, False):
        with serve(
            hashing(),
            direct_routes=direct,
            max_text_chars=1000,
            max_body_bytes=64 * 1024,
            metrics_public=True,  # a scraper without a key, as on a private network
        ) as c:
            answers[direct] = _hot_route_script(c)
            text = c.get("/metrics").text
            labels[direct] = sorted(  # the harness's /ready polls (503 while the engine
                # loads, as often as the load takes) are not the script's
                label
                for line in text.splitlines()
                if line.startswith("memoryos_http_request_duration_seconds_count")
                and 'route="/ready"' not in (label := line.split("{", 1)[1].rsplit("}", 1)[0])
            )
    assert answers[True] == answers[False]
    statuses = [a[0] for a in answers[True]]
    assert statuses[:4] == [201, 201, 201, 201] and 422 in statuses and 413 in statuses
    assert answers[True][2][1]["duplicate"] is True
    assert labels[True] == labels[False], set(labels[True]) ^ set(labels[False])
    assert any("/v1/users/{user_id}/retrieve" in label for label in labels[True])


def test_a_request_is_in_the_metrics_before_its_answer_goes_out() -> None:
    """The HTTP metrics record a request as its answer's last body message is sent, not after:
    a client that reads an answer and then scrapes /metrics finds the request there. (Observed
    after the send, a scrape could overtake the observation: the label lists compared in
    test_direct_routes_answer_like_fastapi then differed at random.)"""

    def refusals() -> float:  # requests answered 401 so far
        return sum(
            sample.value
            for family in metrics.http.collect()
            for sample in family.samples
            if sample.name.endswith("_count") and sample.labels["status"] == "401"
        )

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg: dict) -> None:
        if msg["type"] == "http.response.body" and not msg.get("more_body", False):
            at_last_body.append(refusals())

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/users/u/retrieve",
        "raw_path": b"/v1/users/u/retrieve",
        "query_string": b"",
        "headers": [(b"content-length", b"0")],  # no API key: refused by the edge (401)
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
        "scheme": "http",
        "http_version": "1.1",
        "root_path": "",
    }
    at_last_body: list[float] = []
    with serve(hashing()) as c:
        metrics = c.app.state.metrics
        before = refusals()
        asyncio.run(c.app(scope, receive, send))
        assert at_last_body == [before + 1]
        assert refusals() == before + 1  # once, not again when the request ends


# ====================================================================== batching, ordering
class SlowEngine(MemoryEngine):
    """An engine whose batch calls take a while (to fill queues deterministically)."""

    delay = 0.15

    def add_many(self, pages):  # type: ignore[override]
        time.sleep(self.delay)
        return super().add_many(pages)

    def retrieve_many(self, queries, **kw):  # type: ignore[override]
        time.sleep(self.delay)
        return super().retrieve_many(queries, **kw)


class DiskFullOnBoom(MemoryEngine):
    """An engine whose commit fails (as a full disk would) for a batch holding "boom"."""

    def add_many(self, pages):  # type: ignore[override]
        pages = list(pages)
        if any(getattr(p, "user_input", "") == "boom" for p in pages):
            raise OSError(28, "No space left on device")
        return super().add_many(pages)


def test_a_split_request_that_fails_part_way_says_what_was_committed() -> None:
    engine = DiskFullOnBoom(hashing())
    texts = ["first", "second", "boom", "fourth"]
    body = {"pages": [{"user_id": "u", "user_input": t} for t in texts]}
    try:
        with serve(engine, write_chunk_pages=1) as c:
            r = c.post("/v1/pages", json=body, headers=HA)
            assert r.status_code == 500 and r.json()["error"] == "partially_committed"
            detail = r.json()["detail"]
            assert "No space left on device" in detail
            assert "the first 2 of the request's 4 pages were committed" in detail
            late = {"user_id": "u", "user_input": "fifth", "timestamp": "not a date"}
            bad = {"pages": [body["pages"][0], late]}
            r = c.post("/v1/pages", json=bad, headers=HA)  # bad input: refused before any chunk
            assert r.status_code == 422 and "not a date" in r.text, r.text
        pages = [p["user_input"] for p in engine.export_user("acme/u")["pages"]]
        assert pages == ["first", "second"]  # nothing after the failed chunk ran
    finally:
        engine.close()


async def _many(base: str, calls: list[tuple[str, str, dict]], headers: dict) -> list[Any]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=60) as ac:
        return await asyncio.gather(
            *(ac.request(m, u, json=j) for m, u, j in calls), return_exceptions=True
        )


def test_concurrent_retrievals_share_engine_calls() -> None:
    engine = SlowEngine(hashing())
    with serve(engine, keys=ADMIN_KEYS, max_batch=64, max_wait_ms=5) as c:
        users = [f"user{i}" for i in range(40)]
        c.post(
            "/v1/pages",
            json={"pages": [{"user_id": u, "user_input": u} for u in users]},
            headers=HA,
        )
        calls = [("POST", f"/v1/users/{u}/retrieve", {"query": "hello"}) for u in users]
        res = asyncio.run(_many(str(c.base_url), calls, HA))
        assert all(r.status_code == 200 for r in res)
        assert [r.json()["user_id"] for r in res] == users
        b = c.get("/v1/stats", headers=HADMIN).json()["server"]["batching"]["retrieve"]
        assert b["items"] == 40 and b["batches"] <= 10, b  # 40 requests, few engine calls
        text = c.get("/metrics", headers=HADMIN).text
        assert 'memoryos_batch_size_count{queue="retrieve"}' in text
        assert "memoryos_kernel_seconds_count" in text
    engine.close()


def test_per_user_order_under_concurrency() -> None:
    with serve(hashing(), keys=ADMIN_KEYS, write_max_wait_ms=3) as c:

        async def user_stream(ac: httpx.AsyncClient, u: str) -> None:
            for k in range(15):
                r = await ac.post(f"/v1/users/{u}/pages", json={"user_input": f"{u} step {k}"})
                assert r.status_code == 201

        async def main() -> None:
            async with httpx.AsyncClient(base_url=str(c.base_url), headers=HA) as ac:
                await asyncio.gather(*(user_stream(ac, f"w{i}") for i in range(12)))

        asyncio.run(main())
        b = c.get("/v1/stats", headers=HADMIN).json()["server"]["batching"]["write"]
        assert b["items"] == 180 and b["batches"] < 180  # writes were batched
        for i in range(12):
            c.post(f"/v1/users/w{i}/wait", headers=HA)
            pages = c.get(f"/v1/users/w{i}/export", headers=HA).json()["pages"]
            texts = [p["user_input"] for p in sorted(pages, key=lambda p: p["seq"])]
            assert texts == [f"w{i} step {k}" for k in range(15)]


def test_overload_answers_503_with_retry_after() -> None:
    engine = SlowEngine(hashing())
    with serve(
        engine, write_queue_limit=2, read_queue_limit=2, retry_after_s=2, metrics_public=True
    ) as c:
        calls = [("POST", f"/v1/users/o{i}/pages", {"user_input": f"p{i}"}) for i in range(20)]
        res = asyncio.run(_many(str(c.base_url), calls, HA))
        codes = [r.status_code for r in res]
        assert set(codes) <= {201, 503} and codes.count(503) > 0 and codes.count(201) > 0
        for r in res:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "2" and r.json()["error"] == "overloaded"
        ok = [r.json()["page_id"] for r in res if r.status_code == 201]
        exp_ids = {
            p["page_id"]
            for i in range(20)
            if (r := c.get(f"/v1/users/o{i}/export", headers=HA)).status_code == 200
            for p in r.json()["pages"]
        }
        assert exp_ids == set(ok)  # what was acknowledged is exactly what is stored
        calls = [("POST", "/v1/users/o0/retrieve", {"query": "p"})] * 12
        codes = [r.status_code for r in asyncio.run(_many(str(c.base_url), calls, HA))]
        assert 503 in codes and 200 in codes
        assert 'memoryos_rejected_total{reason="overloaded"}' in c.get("/metrics").text
    engine.close()


# ====================================================================== respond with an LLM
def test_respond_with_scripted_llm() -> None:
    scripted = pytest.importorskip("memoryos_gpu.llm.scripted")
    from memoryos_gpu.config import LLMConfig

    llm = scripted.ScriptedBackend(lambda req: "You told me about Lisbon.")
    engine = MemoryEngine(hashing(llm=LLMConfig(mode="llm", backend="scripted")), llm=llm)
    with serve(engine, metrics_public=True) as c:
        add(c, "alice", "I moved to Lisbon last year")
        r = c.post("/v1/users/alice/respond", json={"query": "Where do I live?"}, headers=HA)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["text"] == "You told me about Lisbon." and body["user_id"] == "alice"
        assert body["retrieval"]["stm"][0]["user_input"] == "I moved to Lisbon last year"
        assert body["page_id"] is not None and body["prompt_tokens"] > 0
        r = c.post("/v1/users/nobody/respond", json={"query": "hi"}, headers=HA)
        assert r.status_code == 404 and r.json()["error"] == "unknown_user"
        assert "memoryos_llm_calls_total" in c.get("/metrics").text
        pages = c.get("/v1/users/alice/export", headers=HA).json()["pages"]
        assert [p["user_input"] for p in pages] == [
            "I moved to Lisbon last year",
            "Where do I live?",
        ]


# ====================================================================== shutdown
def _spawn(store: Path, keyfile: Path, port: int, *extra: str) -> subprocess.Popen:
    code = (
        "import sys; from memoryos_gpu.server.app import run; "
        f"run(store={str(store)!r}, host='127.0.0.1', port={port}, api_keys={str(keyfile)!r}, "
        f"embedder='hashing', log_level='warning'{''.join(extra)})"
    )
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )


def test_sigterm_with_inflight_writes_commits_everything(tmp_path: Path) -> None:
    store, keyfile, port = tmp_path / "store", tmp_path / "keys", free_port()
    keyfile.write_text(f"{KEY_A} acme\n")
    proc = _spawn(store, keyfile, port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base, proc.stderr.read)  # type: ignore[union-attr]

        async def load() -> list[Any]:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(
                base_url=base, headers=HA, limits=limits, timeout=120
            ) as ac:

                async def one(i: int) -> Any:
                    return await ac.post(
                        f"/v1/users/s{i % 5}/pages", json={"user_input": f"inflight {i}"}
                    )

                tasks = [asyncio.create_task(one(i)) for i in range(400)]
                for done, fut in enumerate(asyncio.as_completed(tasks), 1):
                    with suppress(httpx.HTTPError):
                        await fut
                    if done == 60:
                        proc.send_signal(signal.SIGTERM)  # shut down mid-load
                return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(load())
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    acked = {
        r.json()["page_id"]
        for r in results
        if not isinstance(r, Exception) and r.status_code == 201
    }
    refused = [r for r in results if not isinstance(r, Exception) and r.status_code != 201]
    assert all(r.status_code == 503 for r in refused)
    assert len(acked) >= 50  # SIGTERM came after 60 answers
    import sqlite3

    db = sqlite3.connect(store / "memory.sqlite3")
    try:  # read before an engine opens it (opening would resume leftover work)
        assert db.execute("SELECT COUNT(*) FROM pending").fetchone()[0] == 0
    finally:
        db.close()
    engine = MemoryEngine(hashing(store))
    try:
        stored = {p["page_id"] for u in engine.users() for p in engine.export_user(u)["pages"]}
        assert acked <= stored  # nothing acknowledged is lost
        assert all(u.startswith("acme/") for u in engine.users())
    finally:
        engine.close()


# ====================================================================== the CLI contract
@pytest.mark.slow
def test_cli_serve_contract_with_real_embedder(tmp_path: Path) -> None:
    """`memoryos-gpu serve --store DIR --host H --port P --api-keys FILE`: /health answers 200
    without a key, /v1 answers 401 without one; the default (real MiniLM) embedder serves."""
    pytest.importorskip("transformers")
    pytest.importorskip("click")
    keyfile, port = tmp_path / "keys", free_port()
    keyfile.write_text(f"{KEY_A} acme\n{KEY_ADMIN} *\n")
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memoryos_gpu",
            "serve",
            "--store",
            str(tmp_path / "store"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-keys",
            str(keyfile),
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base, proc.stderr.read, timeout=120)  # type: ignore[union-attr]
        assert httpx.get(f"{base}/health").status_code == 200
        r = httpx.post(f"{base}/v1/users/pat/retrieve", json={"query": "x"})
        assert r.status_code == 401 and r.json()["error"] == "unauthorized"
        with httpx.Client(base_url=base, headers=HA, timeout=60) as c:
            texts = [
                "My daughter Emma starts school in September",
                "I bought a red bicycle for commuting",
                "We adopted a golden retriever puppy named Max",
                "I am learning to play the violin",
                "Our trip to Kyoto was in April",
                "I work as a nurse on night shifts",
                "I am allergic to peanuts",
                "My favourite food is Thai green curry",
                "Emma's teacher is called Mrs Patel",
                "I sold my old car last week",
            ]
            for i, t in enumerate(texts):
                assert add(c, "pat", t, timestamp=1000.0 + i).status_code == 201
            assert c.post("/v1/users/pat/wait").json()["done"]
            ret = c.post("/v1/users/pat/retrieve", json={"query": "What is the dog's name?"})
            got = [p["user_input"] for p in ret.json()["pages"]]
            assert "We adopted a golden retriever puppy named Max" in got
            assert c.get("/v1/stats", headers=HADMIN).json()["engine"]["embedder"]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "OPEN mode" not in proc.stderr.read()  # type: ignore[union-attr]


class RoundSpyEngine(MemoryEngine):
    """Records the max_batch of every process_pending call and the size of every round."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.calls: list[int | None] = []
        self.rounds: list[int] = []

    def process_pending(
        self, max_batch: int | None = None, max_rounds: int | None = None
    ) -> dict[str, int]:
        self.calls.append(max_batch)
        return super().process_pending(max_batch, max_rounds)

    def _process_pages(self, items: list[tuple[int, str, int]]) -> int:
        self.rounds.append(len(items))
        return super()._process_pages(items)


def test_derived_scheduler_caps_rounds_and_a_full_round_does_not_wait() -> None:
    """With a 60 s max wait, a full round (derived_max_batch pages) runs at once and rounds
    never exceed the cap; a lone page waits until a reader asks (/wait cuts the wait short)."""
    engine = RoundSpyEngine(hashing(memory={"stm_capacity": 1}))
    with serve(engine, derived_max_wait_ms=60_000, derived_max_batch=3) as c:
        pages = [
            {"user_id": f"r{i}", "user_input": f"r{i} page {k}"} for k in range(2) for i in range(3)
        ]
        assert c.post("/v1/pages", json={"pages": pages}, headers=HA).status_code == 201
        deadline = time.monotonic() + 20
        while engine.pending_count() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.pending_count() == 0  # 3 overflow pages = a full round: no 60 s wait
        assert engine.calls and set(engine.calls) == {3}
        assert engine.rounds and max(engine.rounds) <= 3
        t0 = time.monotonic()
        assert add(c, "r0", "r0 page 2").status_code == 201  # one page: gathers company...
        time.sleep(0.3)
        assert engine.pending_count() == 1
        done = c.post("/v1/users/r0/wait", params={"timeout": 10}, headers=HA).json()
        assert done["done"] and time.monotonic() - t0 < 10  # ...until a reader waits
    engine.close()

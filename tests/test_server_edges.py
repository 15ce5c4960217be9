"""HTTP and MCP server edges a tester found: one rule on every route for bodies the server
cannot keep (lone surrogates, integers past 64 bits, bodies not sent as JSON), tenancy of a
knowledge entry's GET, the MCP server's embedder variable and failed start, and the metrics of
refusals."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from served import HA, HADMIN, HB, hashing, serve  # noqa: E402

from memoryos_gpu.json_codec import dumps  # noqa: E402
from memoryos_gpu.server.batching import Unavailable  # noqa: E402
from memoryos_gpu.server.scope import error_response  # noqa: E402
from memoryos_gpu.server.service import MemoryService  # noqa: E402

JSON = {**HA, "content-type": "application/json"}
SURROGATE = "\\ud800"  # the JSON escape of a lone surrogate, as bytes on the wire
BIG = 10**30


@pytest.fixture(params=[True, False], ids=["direct", "fastapi"])
def direct_routes(request: pytest.FixtureRequest) -> bool:
    """The hot routes are served by the edge itself or by FastAPI: both must agree."""
    return request.param


def _surrogate_requests() -> list[tuple[str, str, str]]:
    """(method, path, body) with a lone surrogate escape in a string, for every body route."""
    s = SURROGATE
    meta, metadata = (f'"{key}": {{"k": "{s}"}}' for key in ("meta", "metadata"))
    return [
        ("POST", "/v1/mem0/memories", f'{{"messages": "lone {s} x", "user_id": "u"}}'),
        ("POST", "/v1/mem0/memories", f'{{"messages": "m", "user_id": "u", {metadata}}}'),
        ("POST", "/v1/mem0/search", f'{{"query": "q {s}", "user_id": "u"}}'),
        ("POST", "/v1/pages", f'{{"pages": [{{"user_id": "u", "user_input": "m", {meta}}}]}}'),
        ("POST", "/v1/pages", f'{{"pages": [{{"user_id": "u", "user_input": "{s}"}}]}}'),
        ("POST", "/v1/users/u/pages", f'{{"user_input": "a {s}"}}'),
        ("POST", "/v1/users/u/pages", f'{{"user_input": "m", {meta}}}'),
        ("POST", "/v1/users/u/retrieve", f'{{"query": "q {s}"}}'),
        ("PATCH", "/v1/users/keep/pages/1", f'{{"user_input": "{s}"}}'),
        ("PATCH", "/v1/users/keep/knowledge/1", f'{{"text": "{s}"}}'),
    ]


def _refused(r: Any, kind: str, loc: list[Any] | None = None) -> None:
    assert r.status_code == 422, (r.status_code, r.text)
    body = r.json()
    assert body["error"] == "validation_error", body
    (err,) = body["detail"]
    assert err["type"] == kind, body
    if loc is not None:
        assert err["loc"] == loc, body


# ====================================================================== D1: lone surrogates
def test_a_lone_surrogate_is_one_422_on_every_route_before_any_write(direct_routes: bool) -> None:
    with serve(hashing(), direct_routes=direct_routes) as c:
        kept = c.post("/v1/users/keep/pages", json={"user_input": "kept"}, headers=HA)
        assert kept.status_code == 201 and kept.json()["page_id"] == 1
        for method, path, body in _surrogate_requests():
            r = c.request(method, path, content=body.encode(), headers=JSON)
            _refused(r, "json_invalid")
            assert "surrogate" in r.json()["detail"][0]["msg"], (path, r.text)
        assert c.get("/v1/users", headers=HA).json() == {"users": ["keep"]}  # nothing written
        page = c.get("/v1/users/keep/pages/1", headers=HA).json()
        assert page["user_input"] == "kept"  # not rewritten to U+FFFD


def test_a_string_no_utf8_encodes_still_answers() -> None:
    """What a store may hold from before the refusal (a lone surrogate) is written as its
    JSON escape: an answer, an error's detail included, never fails to encode."""
    assert dumps({"k": "a\ud800b"}) == b'{"k":"a\\ud800b"}'
    assert dumps({"n": BIG, "k": "\udfff"}) == b'{"n":%d,"k":"\\udfff"}' % BIG
    assert error_response(404, "not_found", "no user 'a\ud800'").body == (
        b'{"error":"not_found","detail":"no user \'a\\ud800\'"}'
    )


# ====================================================================== D4: wide integers
@pytest.mark.parametrize(
    "big", [BIG, 10**400, 2**63, -(2**63) - 1], ids=["1e30", "1e400", "2^63", "-2^63-1"]
)
def test_integers_past_64_bits_are_refused_on_every_route(big: int, direct_routes: bool) -> None:
    meta = f'{{"n": {big}}}'
    cases = [
        ("/v1/users/u/pages", f'{{"user_input": "b", "meta": {meta}}}', ["body", "meta", "n"]),
        (
            "/v1/pages",
            f'{{"pages": [{{"user_id": "u", "user_input": "b", "meta": {meta}}}]}}',
            ["body", "pages", 0, "meta", "n"],
        ),
        (
            "/v1/mem0/memories",
            f'{{"messages": "m", "user_id": "u", "metadata": {meta}}}',
            ["body", "metadata", "n"],
        ),
        ("/v1/users/u/retrieve", f'{{"query": "q", "top_pages": {big}}}', ["body", "top_pages"]),
    ]
    with serve(hashing(), direct_routes=direct_routes) as c:
        for path, body, loc in cases:
            r = c.post(path, content=body.encode(), headers=JSON)
            _refused(r, "int_out_of_range", loc)
        assert c.get("/v1/users", headers=HA).json() == {"users": []}


def test_integers_at_the_64_bit_bounds_read_back_exactly(direct_routes: bool) -> None:
    meta = {"max": 2**63 - 1, "min": -(2**63), "digits": "12345678901234567890123"}
    with serve(hashing(), direct_routes=direct_routes) as c:
        batch = {"pages": [{"user_id": "u", "user_input": "b", "meta": meta}]}
        for r in (
            c.post("/v1/users/u/pages", json={"user_input": "a", "meta": meta}, headers=HA),
            c.post("/v1/pages", json=batch, headers=HA),
        ):
            assert r.status_code == 201, r.text
            pid = r.json().get("page_id") or r.json()["results"][0]["page_id"]
            assert c.get(f"/v1/users/u/pages/{pid}", headers=HA).json()["extra"] == meta


# ====================================================================== a page naming no assistant
@pytest.mark.parametrize("keys", [True, False], ids=["tenants", "open"])
@pytest.mark.parametrize("direct_routes", [True, False])
def test_a_page_naming_no_assistant_joins_the_users_own(keys: bool, direct_routes: bool) -> None:
    """With API keys, a page without assistant_id was given the tenant's default assistant,
    so every later write of a user created with another one was refused (422 "belongs to
    assistant 'a1', not 'default'"), while the same requests passed in open mode."""
    auth = HA if keys else {}
    opts: dict[str, Any] = {} if keys else {"keys": None}
    with serve(hashing(), direct_routes=direct_routes, **opts) as c:
        r = c.post(
            "/v1/users/pg/pages", json={"user_input": "one", "assistant_id": "a1"}, headers=auth
        )
        assert r.status_code == 201, r.text
        for path, body in (
            ("/v1/users/pg/pages", {"user_input": "two"}),
            ("/v1/pages", {"pages": [{"user_id": "pg", "user_input": "three"}]}),
            ("/v1/mem0/memories", {"messages": "four", "user_id": "pg"}),
        ):
            r = c.post(path, json=body, headers=auth)
            assert r.status_code in (200, 201), (path, r.text)
        # a new user naming none gets the (tenant's) default, whose knowledge it shares
        assert (
            c.post("/v1/users/new/pages", json={"user_input": "x"}, headers=auth).status_code == 201
        )
        users = {
            u: c.get(f"/v1/users/{u}/export", headers=auth).json()["user"] for u in ("pg", "new")
        }
        assert users["pg"]["assistant_id"] == "a1"
        assert users["new"]["assistant_id"] == "default"  # shown without the tenant prefix
        r = c.post(
            "/v1/users/pg/pages", json={"user_input": "x", "assistant_id": "a2"}, headers=auth
        )
        assert r.status_code == 422  # naming another one is still refused


# ====================================================================== D5: tenancy of GET
def test_another_tenants_knowledge_entry_is_not_found_whatever_the_verb() -> None:
    """Not found, as an id that does not exist: a 403 confirmed that the id exists (a tenant
    probing ids counted the others' entries), and the mem0 routes answered 404 already."""
    with serve(hashing()) as c:
        for i in range(14):  # one topic, hot enough to promote (extractive facts)
            r = c.post(
                "/v1/users/kuser/pages",
                json={"user_input": f"I love hiking in the Alps {i}", "timestamp": 100.0 + i},
                headers=HA,
            )
            assert r.status_code == 201
        c.post("/v1/users/kuser/wait", headers=HA)
        entries = c.get("/v1/users/kuser/knowledge", headers=HA).json()["user"]
        if not entries:
            pytest.skip("the engine promoted nothing on this input")
        url = f"/v1/users/kuser/knowledge/{entries[0]['entry_id']}"
        assert c.get(url, headers=HA).status_code == 200
        for r in (
            c.get(url, headers=HB),
            c.patch(url, json={"text": "x"}, headers=HB),
            c.delete(url, headers=HB),
        ):
            assert r.status_code == 404, r.text
            assert r.json()["error"] == "not_found" and "Alps" not in r.text


# ====================================================================== D6: MCP server
def test_mcp_reads_the_embedder_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memoryos_gpu.server.mcp_server import _config, _parser

    toml = tmp_path / "engine.toml"
    toml.write_text('embedder = "onnx"\n')
    monkeypatch.delenv("MEMORYOS_GPU_EMBEDDER", raising=False)
    args = ["--store", str(tmp_path / "s")]
    assert _config(_parser().parse_args(args))[0].embedder == "transformers"  # the default
    assert _config(_parser().parse_args([*args, "--config", str(toml)]))[0].embedder == "onnx"
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    assert _config(_parser().parse_args(args))[0].embedder == "hashing"
    assert _config(_parser().parse_args([*args, "--config", str(toml)]))[0].embedder == "hashing"
    flag = _parser().parse_args([*args, "--embedder", "onnx"])
    assert _config(flag)[0].embedder == "onnx"  # the flag wins


def test_an_mcp_server_whose_engine_cannot_open_stops_naming_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memoryos_gpu.server.mcp_server import main, start_serving

    bad = hashing(tmp_path / "s").model_copy(update={"embedder": "openai"})  # no model, URL

    async def start() -> None:
        service = MemoryService(bad)
        try:
            await start_serving(service)
        finally:
            await service.close()

    with pytest.raises(Unavailable, match=r"failed to load: .*embedding_model"):
        asyncio.run(start())
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # main sets it; restored after the test
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "openai")  # the variable is read (D6)
    with pytest.raises(SystemExit) as stopped:  # before reading a byte of the stdio protocol
        main(["--store", str(tmp_path / "s2")])
    assert re.search(
        r"MCP server: the engine failed to load: .*embedding_model", str(stopped.value)
    )


def test_an_mcp_server_on_a_store_another_writer_holds_stops_naming_it(tmp_path: Path) -> None:
    """The HTTP server waits for a held store; an MCP server says so and stops instead (a
    client shows what it says, a waiting stdio server shows it nothing)."""
    from memoryos_gpu.engine import MemoryEngine
    from memoryos_gpu.server.mcp_server import start_serving

    cfg = hashing(tmp_path / "s")
    holder = MemoryEngine(cfg)
    try:

        async def start() -> None:
            service = MemoryService(cfg)
            try:
                await asyncio.wait_for(start_serving(service), 60)
            finally:
                await service.close()

        with pytest.raises(Unavailable, match=r"cannot be opened now: .*open for writing"):
            asyncio.run(start())
    finally:
        holder.close()


# ====================================================================== D7: refusal metrics
def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = line[len(name) + 1 : line.rindex("}")]
            if all(part in got.split(",") for part in want.split(",")):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_every_413_counts_and_refusals_name_their_route(direct_routes: bool) -> None:
    limits = {"max_body_bytes": 4096, "max_text_chars": 100, "max_batch_items": 2}
    h = {"headers": HA}
    with serve(hashing(), direct_routes=direct_routes, metrics_public=True, **limits) as c:

        def chunks() -> Any:  # no Content-Length: counted while read
            yield b'{"user_input": "'
            yield b"x" * 5000
            yield b'"}'

        answers = [
            c.post("/v1/users/u/pages", content=b"x" * 5000, headers=JSON),  # Content-Length
            c.post("/v1/users/u/pages", content=chunks(), headers=JSON),  # chunked
            c.post("/v1/users/u/pages", json={"user_input": "x" * 101}, headers=HA),  # a text
            c.post("/v1/users/u/pages", json={"user_input": "x", "meta": {"k": "x" * 200}}, **h),
            c.post("/v1/pages", json={"pages": [{"user_id": "u", "user_input": "x"}] * 3}, **h),
            c.post("/v1/users/u/retrieve", json={"query": "q" * 101}, headers=HA),
            c.post("/v1/mem0/memories", json={"messages": "m" * 101, "user_id": "u"}, headers=HA),
            c.post("/v1/mem0/search", json={"query": "q" * 101, "user_id": "u"}, headers=HA),
        ]  # fmt: skip
        assert [r.status_code for r in answers] == [413] * len(answers), [r.text for r in answers]
        assert {r.json()["error"] for r in answers} == {"too_large"}
        bad_url = c.post("/v1/users/col%FEid/pages", json={"user_input": "x"}, headers=HA)
        assert bad_url.status_code == 422
        no_key = c.post("/v1/users/u/pages", json={"user_input": "x"})
        assert no_key.status_code == 401
        missing = c.get("/v1/no/such/route", headers=HA)
        assert missing.status_code == 404
        text = c.get("/metrics").text
    assert _metric(text, "memoryos_rejected_total", reason="too_large") == len(answers)
    seconds = "memoryos_http_request_duration_seconds_count"
    pages = "/v1/users/{user_id}/pages"
    assert _metric(text, seconds, route=pages, status="413") == 4
    assert _metric(text, seconds, route=pages, status="422") == 1
    assert _metric(text, seconds, route=pages, status="401") == 1
    assert _metric(text, seconds, route="unmatched") == 1  # the one path no route matches


# ====================================================================== D8: content types
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_415_on_every_route(
    content_type: str | None, direct_routes: bool
) -> None:
    headers = {**HA, **({"content-type": content_type} if content_type else {})}
    with serve(hashing(), direct_routes=direct_routes) as c:
        c.post("/v1/users/keep/pages", json={"user_input": "kept"}, headers=HA)
        for method, path, body in (
            ("POST", "/v1/users/u/pages", b'{"user_input": "x"}'),
            ("POST", "/v1/users/u/retrieve", b'{"query": "x"}'),
            ("POST", "/v1/pages", b'{"pages": [{"user_id": "u", "user_input": "x"}]}'),
            ("POST", "/v1/mem0/memories", b'{"messages": "x", "user_id": "u"}'),
            ("PATCH", "/v1/users/keep/pages/1", b'{"user_input": "x"}'),
        ):
            r = c.request(method, path, content=body, headers=headers)
            assert r.status_code == 415, (path, r.status_code, r.text)
            assert r.json()["error"] == "unsupported_media_type"
            assert "application/json" in r.json()["detail"]
        assert c.get("/v1/users", headers=HA).json() == {"users": ["keep"]}
        for media in ("application/json; charset=utf-8", "application/merge-patch+json"):
            r = c.post(
                "/v1/users/u/pages",
                content=b'{"user_input": "x"}',
                headers={**HA, "content-type": media},
            )
            assert r.status_code == 201, (media, r.text)  # fmt: skip


# ====================================================================== behind a worker
def test_a_worker_process_answers_these_edges_alike(tmp_path: Path) -> None:
    """The same rules under ``serve --workers 1`` (the worker's own app, the engine in another
    process, metrics summed over the processes)."""
    from tests.test_serve_workers import UNLIMITED, Supervised

    server = Supervised(tmp_path / "store", tmp_path / "server.log", workers=1, **UNLIMITED)
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.base, timeout=30) as c:
            for method, path, body in _surrogate_requests():
                r = c.request(method, path, content=body.encode(), headers=JSON)
                _refused(r, "json_invalid")
            wide = f'{{"user_input": "b", "meta": {{"n": {BIG}}}}}'.encode()
            r = c.post("/v1/users/u/pages", content=wide, headers=JSON)
            _refused(r, "int_out_of_range", ["body", "meta", "n"])
            plain = {**HA, "content-type": "text/plain"}
            r = c.post("/v1/users/u/pages", content=b'{"user_input": "x"}', headers=plain)
            assert r.status_code == 415 and r.json()["error"] == "unsupported_media_type"
            assert c.get("/v1/users", headers=HA).json() == {"users": []}
            big = c.post("/v1/users/u/pages", content=b"x" * (9 << 20), headers=JSON)
            long = c.post("/v1/users/u/pages", json={"user_input": "x" * 100_001}, headers=HA)
            assert (big.status_code, long.status_code) == (413, 413)
            text = c.get("/metrics", headers=HADMIN).text  # the Supervised's admin key
    finally:
        server.stop()
    assert _metric(text, "memoryos_rejected_total", reason="too_large") == 2
    seconds = "memoryos_http_request_duration_seconds_count"
    assert _metric(text, seconds, route="/v1/users/{user_id}/pages", status="413") == 2


def _unavailable() -> Exception:
    from memoryos_gpu.store import StoreUnavailableError

    return StoreUnavailableError("store postgresql://u@db/x: connection refused")


def _locked() -> Exception:
    from memoryos_gpu.store.writer import StoreLockedError

    return StoreLockedError("store s/memory.sqlite3 is open for writing by pid 7 (an engine)")


@pytest.mark.parametrize(("failure", "said"), [(_unavailable, "refused"), (_locked, "pid 7")])
def test_a_server_started_before_its_store_loads_once_the_store_answers(
    monkeypatch: pytest.MonkeyPatch, failure: Any, said: str
) -> None:
    """A store that is unavailable at start (its database server down), or that another
    writer still holds (the engine process of a killed server, draining behind a slow LLM),
    is tried again, with /ready saying why meanwhile; before, the first failure was final and
    the server stayed not-ready for good while /health said it was alive."""
    from memoryos_gpu.config import EngineConfig
    from memoryos_gpu.engine import MemoryEngine
    from memoryos_gpu.server import service as service_mod

    monkeypatch.setattr(service_mod, "LOAD_RETRY_FIRST_S", 0.05)
    tries: list[float] = []  # one entry a try
    go = threading.Event()  # the third try (the store answers) waits for the test's checks

    def build() -> MemoryEngine:
        tries.append(0.0)
        if len(tries) < 3:
            raise failure()
        go.wait(30)
        return MemoryEngine(EngineConfig(embedder="hashing", auto_process=False))

    async def run() -> tuple[str, str, str]:
        svc = MemoryService(build)
        await svc.start(wait=False)
        for _ in range(3000):  # the first try has failed (no sleep that a busy host outlasts)
            if svc.error:
                break
            await asyncio.sleep(0.01)
        waiting = (svc.state, svc.error or "")
        with pytest.raises(Unavailable, match="waiting for the store"):
            svc.check_ready()
        go.set()
        assert await svc.loaded()  # waits for the third try's load, through the public call
        ready = svc.state
        await svc.close()
        return waiting[0], waiting[1], ready

    state, error, ready = asyncio.run(run())
    assert state == "starting" and said in error
    assert ready == "ready" and len(tries) == 3


def test_close_ends_a_load_that_waits_for_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from memoryos_gpu.server import service as service_mod
    from memoryos_gpu.store import StoreUnavailableError

    monkeypatch.setattr(service_mod, "LOAD_RETRY_FIRST_S", 60.0)

    def build() -> Any:
        raise StoreUnavailableError("store down")

    async def run() -> str:
        svc = MemoryService(build)
        await svc.start(wait=False)
        await asyncio.sleep(0.05)
        await asyncio.wait_for(svc.close(), 5)  # not the 60 s wait
        assert not await svc.loaded()  # the load ended without an engine
        return svc.state

    assert asyncio.run(run()) == "closed"

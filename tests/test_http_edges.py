"""HTTP edge cases found by testing as a new user would: every body the server cannot use is a
422 with the offending field, odd URLs and headers are refused, disconnects are quiet, stats
are per tenant, key guessing is slowed down, the docs work offline, operationIds are stable."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from served import ADMIN_KEYS, HA, HADMIN, KEY_A, hashing, serve

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(params=[True, False], ids=["direct", "fastapi"])
def direct_routes(request: pytest.FixtureRequest) -> bool:
    """The single-page route is served by the edge itself or by FastAPI: both must agree."""
    return request.param


def _is_422(r: Any, field: str | None = None) -> None:
    assert r.status_code == 422, (r.status_code, r.text)
    body = r.json()
    assert body["error"] in ("validation_error", "invalid_input", "invalid_user_id"), body
    if field is not None:
        assert field in str(body["detail"]), body


def test_timestamps_that_are_not_times_are_refused(direct_routes: bool) -> None:
    with serve(hashing(), direct_routes=direct_routes) as c:
        for bad, field in ((True, "boolean"), (1.7e12, "milliseconds"), ("1700000000000", "milli")):
            page = {"user_input": "hi", "timestamp": bad}
            _is_422(c.post("/v1/users/u/pages", json=page, headers=HA), field)
            batch = {"pages": [{"user_id": "u", **page}]}
            _is_422(c.post("/v1/pages", json=batch, headers=HA), field)
        r = c.post("/v1/users/u/pages", json={"user_input": "hi", "timestamp": 1.7e9}, headers=HA)
        assert r.status_code == 201
        assert c.get("/v1/users", headers=HA).json() == {"users": ["u"]}  # nothing else stored


@pytest.mark.parametrize(
    "body",
    [b'{"user_input": "caf\xe9"}', DEEP.encode(), b'{"user_input": "x"', b"\xff\xfe"],
    ids=["latin-1", "deep", "truncated", "garbage"],
)
@pytest.mark.parametrize(
    "path", ["/v1/users/u/pages", "/v1/pages", "/v1/users/u/retrieve", "/v1/mem0/memories"]
)
def test_unusable_json_is_one_422_on_every_route(
    body: bytes, path: str, direct_routes: bool
) -> None:
    with serve(hashing(), direct_routes=direct_routes) as c:
        headers = {**HA, "content-type": "application/json"}
        r = c.post(path, content=body, headers=headers)
        _is_422(r, "json_invalid")


def test_user_ids_that_are_not_utf8_are_refused() -> None:
    with serve(hashing()) as c:
        for raw in ("col%FEid", "col%FFid", "%C3%28"):
            r = c.post(f"/v1/users/{raw}/pages", json={"user_input": "x"}, headers=HA)
            _is_422(r, "UTF-8")
        r = c.get("/v1/mem0/memories?user_id=a%FF", headers=HA)
        _is_422(r, "UTF-8")
        ok = c.post("/v1/users/caf%C3%A9/pages", json={"user_input": "x"}, headers=HA)
        assert ok.status_code == 201 and ok.json()["user_id"] == "café"


def test_oversized_headers_answer_431() -> None:
    with serve(hashing(), max_header_bytes=4096) as c:
        r = c.get("/v1/users", headers={**HA, "x-filler": "a" * 6000})
        assert r.status_code == 431 and r.json()["error"] == "headers_too_large"
        assert c.get("/v1/users", headers={**HA, "x-filler": "a" * 1000}).status_code == 200


def _disconnect_mid_body(port: int, path: str) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
            "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
            '{"user_input": "half'.encode()
        )
        time.sleep(0.2)


def test_a_client_disconnect_logs_no_traceback(
    direct_routes: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO), serve(hashing(), direct_routes=direct_routes) as c:
        port = int(str(c.base_url).rsplit(":", 1)[1])
        for path in ("/v1/users/u/pages", "/v1/pages"):
            _disconnect_mid_body(port, path)
        deadline = time.monotonic() + 5
        while sum("client disconnected" in r.getMessage() for r in caplog.records) < 2:
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
        assert c.get("/v1/users", headers=HA).status_code == 200  # the server is fine
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [(r.name, r.getMessage()) for r in errors]


def test_stats_are_per_tenant_and_admin_keys_see_the_server() -> None:
    with serve(hashing(), keys=ADMIN_KEYS) as c:
        c.post("/v1/users/u/pages", json={"user_input": "x"}, headers=HA)
        assert c.get("/v1/stats", headers=HA).json() == {"tenant": "acme", "users": 1}
        full = c.get("/v1/stats", headers=HADMIN).json()
        assert full["users"] == 1 and full["engine"]["counters"]["pages_added"] == 1
        assert full["server"]["batching"]["write"]["items"] == 1
        for meth, url in (("GET", "/v1/users"), ("POST", "/v1/users/u/retrieve")):
            r = c.request(meth, url, json={"query": "x"}, headers=HADMIN)
            assert r.status_code == 403 and r.json()["error"] == "forbidden", (meth, url)


def test_unknown_keys_are_rate_limited_per_address() -> None:
    with serve(hashing(), auth_failures_per_s=0.01, auth_failures_burst=3) as c:
        wrong = {"Authorization": "Bearer guess-guess-guess"}
        assert [c.get("/v1/users", headers=wrong).status_code for _ in range(3)] == [401] * 3
        r = c.get("/v1/users", headers=wrong)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert c.get("/v1/users", headers=HA).status_code == 200  # a real key still works


def test_docs_are_served_from_the_package() -> None:
    with serve(hashing()) as c:
        for page in ("/docs", "/redoc"):
            html = c.get(page).text
            assert "/docs-static/" in html and "cdn." not in html, page
        js = c.get("/docs-static/swagger-ui-bundle.js")
        assert js.status_code == 200 and len(js.content) > 100_000
    with serve(hashing(), docs=False) as c:
        assert c.get("/docs").status_code == 404 and c.get("/openapi.json").status_code == 200


def test_operation_ids_are_the_handlers_names() -> None:
    with serve(hashing()) as c:
        spec = c.get("/openapi.json").json()
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    assert all(i.isidentifier() and "_v1_" not in i for i in ids), ids
    for name in ("add_page", "add_pages", "retrieve", "retrieve_many", "mem0_search", "stats"):
        assert name in ids, name

"""The HTTP API's answers at its edges, from a sweep of every route: ids that would collide
across tenants or cannot be addressed, tenant prefixes kept out of messages, one error code
per id rule, pages of no words, the statuses OpenAPI documents, the last second of the year
9999, and HEAD on the probes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from served import HA, KEYS, hashing, serve  # noqa: E402

from memoryos_gpu.formats.timestamps import parse_timestamp  # noqa: E402


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A server with keys (tenant ``acme`` is :data:`HA`) over a fresh store."""
    with serve(hashing(tmp_path_factory.mktemp("keyed") / "s"), keys=KEYS) as c:
        yield c


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A server without keys (open mode) over a fresh store."""
    with serve(hashing(tmp_path_factory.mktemp("open") / "s"), keys=None) as c:
        yield c


def add(c: httpx.Client, user: str, headers: dict | None = None, **body: Any) -> httpx.Response:
    return c.post(f"/v1/users/{user}/pages", json={"user_input": "hi", **body}, headers=headers)


# ====================================================================== 1: '/' in written ids
@pytest.mark.parametrize("field, value", [("source", "acme/s1"), ("assistant_id", "acme/default")])
def test_open_mode_refuses_a_slash_in_a_written_source_or_assistant(
    open_server: httpx.Client, field: str, value: str
) -> None:
    """Stored as given in open mode, ``acme/s1`` would be tenant ``acme``'s source ``s1``
    once the store is served with keys (and refuse that tenant's own ``s1``)."""
    r = add(open_server, "bob", **{field: value})
    assert r.status_code == 422, r.text
    assert "must not contain '/'" in r.text and field in r.text
    r = open_server.post(
        "/v1/pages", json={"pages": [{"user_id": "bob", "user_input": "x", field: value}]}
    )
    assert r.status_code == 422 and field in r.text
    assert open_server.get("/v1/users").json() == {"users": []}  # nothing stored


def test_mem0_add_refuses_a_slash_in_agent_id(open_server: httpx.Client) -> None:
    body = {"messages": "hi", "user_id": "carol", "agent_id": "acme/default"}
    r = open_server.post("/v1/mem0/memories", json=body)
    assert r.status_code == 422 and "agent_id must not contain '/'" in r.text


def test_store_written_open_then_keyed_keeps_tenants_sources_free(tmp_path: Path) -> None:
    """The report's scenario end to end: the open-mode write is refused, so the tenant's own
    source ``s1`` is its to use later."""
    store = hashing(tmp_path / "s")
    with serve(store, keys=None) as c:
        assert add(c, "bob", source="acme/s1").status_code == 422
    with serve(hashing(tmp_path / "s"), keys=KEYS) as c:
        r = add(c, "alice", HA, source="s1")
        assert r.status_code == 201 and r.json()["duplicate"] is False


# ====================================================================== 2: no tenant prefix
def test_messages_never_show_the_tenant_prefix(keyed: httpx.Client) -> None:
    assert add(keyed, "x1", HA, source="src1").status_code == 201
    r = add(keyed, "y1", HA, source="src1")
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "source 'src1' of a page of user 'y1'" in detail and "acme/" not in detail
    r = add(keyed, "x1", HA, assistant_id="other")
    detail = r.json()["detail"]
    assert r.status_code == 422 and "'default', not 'other'" in detail, detail
    assert "user 'x1'" in detail and "acme/" not in detail
    body = {"messages": "hi", "user_id": "x1", "agent_id": "other"}
    r = keyed.post("/v1/mem0/memories", json=body, headers=HA)
    assert r.status_code == 422 and "acme/" not in r.json()["detail"], r.text
    assert "'default', not 'other'" in r.json()["detail"]


# ====================================================================== 3: OpenAPI statuses
def test_openapi_documents_the_statuses_routes_answer(open_server: httpx.Client) -> None:
    spec = open_server.get("/openapi.json").json()
    ops = {
        op["operationId"]: (path, method, op["responses"])
        for path, item in spec["paths"].items()
        for method, op in item.items()
    }
    # every route that answered a 404 in the sweep, and those whose descriptions say 404
    for name in (
        "list_pages", "get_page", "update_page", "delete_page", "delete_user", "profile",
        "knowledge", "get_knowledge", "update_knowledge", "delete_knowledge", "history",
        "export_user", "respond", "mem0_get", "mem0_update", "mem0_delete", "mem0_history",
    ):  # fmt: skip
        assert "404" in ops[name][2], name
    for name in ("add_page", "retrieve", "wait_user", "add_pages", "list_users"):
        assert "404" not in ops[name][2], name  # an unknown user is no 404 there
    for name, (path, method, responses) in ops.items():
        if path.startswith("/v1/"):
            assert {"405", "431"} <= set(responses), name
            assert ("507" in responses) == (method != "get"), name
        body = "requestBody" in spec["paths"][path][method]
        assert ("413" in responses) == body and ("415" in responses) == body, name
    for name in ("add_page", "add_pages", "mem0_add"):
        assert "partially_committed" in ops[name][2]["500"]["description"]


def test_an_unknown_user_answers_a_documented_404(open_server: httpx.Client) -> None:
    spec = open_server.get("/openapi.json").json()
    r = open_server.get("/v1/users/nobody/pages")
    assert r.status_code == 404
    assert "404" in spec["paths"]["/v1/users/{user_id}/pages"]["get"]["responses"]


# ====================================================================== 4 and 7: user ids
@pytest.mark.parametrize("raw", ["%2E", "%2E%2E", "%2e%2e"])
def test_dot_segments_are_refused_as_written_user_ids(open_server: httpx.Client, raw: str) -> None:
    """httpx, requests, browsers and proxies drop ``.`` and ``..`` path segments: such a
    user could never be read back (``/v1/users/../pages`` reaches ``/v1/pages``)."""
    r = open_server.post(f"/v1/users/{raw}/pages", json={"user_input": "x"})
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "invalid_user_id" and "segments" in r.json()["detail"]
    for uid in (".", ".."):
        r = open_server.post("/v1/pages", json={"pages": [{"user_id": uid, "user_input": "x"}]})
        assert r.status_code == 422 and r.json()["error"] == "invalid_user_id", r.text


@pytest.mark.parametrize("raw", ["%09x", "%C2%85x", "%E2%80%AE", "x%E2%80%8By", "a%2Fb"])
def test_every_invalid_written_user_id_is_invalid_user_id(
    open_server: httpx.Client, raw: str
) -> None:
    r = open_server.post(f"/v1/users/{raw}/pages", json={"user_input": "x"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_user_id", r.text


def test_a_read_of_a_c1_control_user_id_is_invalid_user_id(open_server: httpx.Client) -> None:
    r = open_server.post("/v1/users/%C2%85x/retrieve", json={"query": "q"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_user_id", r.text


# ====================================================================== 6: pages of no words
@pytest.mark.parametrize(
    "body",
    [
        {"user_input": ""},
        {"user_input": "  ", "agent_response": "\n"},
        {"user_input": "\u0000", "agent_response": "\u0001"},  # stored as "" and ""
    ],
)
def test_a_page_of_no_words_is_refused(open_server: httpx.Client, body: dict) -> None:
    r = open_server.post("/v1/users/emptyp/pages", json=body)
    assert r.status_code == 422 and "both blank" in r.json()["detail"], r.text
    r = open_server.post("/v1/pages", json={"pages": [{"user_id": "emptyp", **body}]})
    assert r.status_code == 422 and "both blank" in r.json()["detail"], r.text


def test_one_blank_side_is_still_a_page(open_server: httpx.Client) -> None:
    assert add(open_server, "halfp", user_input="", agent_response="an answer").status_code == 201


def test_a_page_edit_that_blanks_both_sides_is_refused(open_server: httpx.Client) -> None:
    pid = add(open_server, "blankedit", user_input="text", agent_response="").json()["page_id"]
    url = f"/v1/users/blankedit/pages/{pid}"
    r = open_server.patch(url, json={"user_input": "\u0000 "})
    assert r.status_code == 422 and "delete the page instead" in r.json()["detail"], r.text
    assert open_server.get(url).json()["user_input"] == "text"
    r = open_server.patch(url, json={"user_input": "", "agent_response": "kept"})
    assert r.status_code == 200 and r.json()["agent_response"] == "kept"


@pytest.mark.parametrize("field", ["text", "data"])
def test_mem0_put_that_blanks_a_page_is_refused(open_server: httpx.Client, field: str) -> None:
    """The page's only words are its user side: a text of control characters and blanks
    (stored as nothing) would leave a page of no words, as the pages routes refuse."""
    r = open_server.post("/v1/mem0/memories", json={"messages": "q", "user_id": f"m0{field}"})
    mid = r.json()["results"][0]["id"]
    r = open_server.put(f"/v1/mem0/memories/{mid}", json={field: " \u0000"})
    assert r.status_code == 422 and "delete the page instead" in r.json()["detail"], r.text
    assert open_server.get(f"/v1/mem0/memories/{mid}").json()["memory"] == "User: q"


# ====================================================================== 9: year 9999
@pytest.mark.parametrize(
    "value",
    [253402300799.5, "253402300799.99999", "9999-12-31T23:59:59.5", "9999-12-31T23:59:59.999999Z"],
)
def test_the_last_second_of_year_9999_is_accepted(open_server: httpx.Client, value: Any) -> None:
    assert parse_timestamp(value) < 253402300800.0
    r = add(open_server, "tsu", timestamp=value)
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("value", [253402300800.0, "9999-12-31T22:00:00-02:00"])
def test_the_year_10000_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="year"):
        parse_timestamp(value)


# ====================================================================== 10: HEAD on the probes
@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_head_on_the_probes_answers_as_get_without_a_body(
    open_server: httpx.Client, path: str
) -> None:
    got = open_server.get(path)
    r = open_server.head(path)
    assert r.status_code == got.status_code == 200
    assert r.content == b"" and r.headers["content-type"] == got.headers["content-type"]
    assert r.headers["content-length"] == got.headers["content-length"]
    assert open_server.head("/v1/users").status_code == 405  # only the probes

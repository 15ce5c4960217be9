"""Request bodies are read with their documented JSON types (strict): a string, a boolean or a
fraction where an integer is documented is a 422 naming the field, on every route that takes
numbers, before anything is stored; what the docs promise (JSON integers for number fields,
timestamps as epoch or ISO-8601 strings, numbers in query strings) is still accepted."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from served import HA, hashing, serve

# (route, body, the field's location in the 422): each a value of the wrong JSON type that
# pydantic's lax mode coerced ("3" -> 3, true -> 1, 3.0 -> 3, "true" -> True, "0.5" -> 0.5)
WRONG_TYPES = [
    ("/v1/users/u/retrieve", {"query": "q", "top_pages": "3"}, ["body", "top_pages"]),
    ("/v1/users/u/retrieve", {"query": "q", "top_pages": True}, ["body", "top_pages"]),
    ("/v1/users/u/retrieve", {"query": "q", "top_pages": 3.0}, ["body", "top_pages"]),
    ("/v1/users/u/retrieve", {"query": "q", "top_segments": "2"}, ["body", "top_segments"]),
    ("/v1/users/u/retrieve", {"query": "q", "sources": "true"}, ["body", "sources"]),
    ("/v1/users/u/retrieve", {"query": "q", "sources": 1}, ["body", "sources"]),
    (
        "/v1/retrieve",
        {"queries": [{"user_id": "u", "query": "q", "top_pages": "3"}]},
        ["body", "queries", 0, "top_pages"],
    ),
    (
        "/v1/retrieve",
        {"queries": [{"user_id": "u", "query": "q", "sources": "false"}]},
        ["body", "queries", 0, "sources"],
    ),
    ("/v1/mem0/search", {"user_id": "u", "query": "q", "top_k": "5"}, ["body", "top_k"]),
    ("/v1/mem0/search", {"user_id": "u", "query": "q", "limit": True}, ["body", "limit"]),
    ("/v1/mem0/search", {"user_id": "u", "query": "q", "threshold": "0.5"}, ["body", "threshold"]),
    ("/v1/mem0/memories", {"user_id": "u", "messages": "hi", "infer": "false"}, ["body", "infer"]),
]


@pytest.fixture(params=[True, False], ids=["direct", "fastapi"])
def direct_routes(request: pytest.FixtureRequest) -> bool:
    """The hot routes (one page, one user's retrieval) served by the edge or by FastAPI."""
    return request.param


def _refused_naming(r: Any, loc: list[Any]) -> None:
    assert r.status_code == 422, (r.status_code, r.text)
    body = r.json()
    assert body["error"] == "validation_error", body
    assert [e["loc"] for e in body["detail"]] == [loc], body


def test_a_value_of_another_json_type_is_a_422_naming_its_field(direct_routes: bool) -> None:
    with serve(hashing(), direct_routes=direct_routes) as c:
        for path, body, loc in WRONG_TYPES:
            _refused_naming(c.post(path, json=body, headers=HA), loc)
        assert c.get("/v1/users", headers=HA).json() == {"users": []}  # nothing stored


def test_documented_bodies_and_query_strings_are_still_accepted(direct_routes: bool) -> None:
    with serve(hashing(), keys=None, direct_routes=direct_routes) as c:
        for ts in (1_700_000_000, 1_700_000_000.5, "1700000000", "2024-06-03T08:15:00Z"):
            r = c.post("/v1/users/u/pages", json={"user_input": f"at {ts}", "timestamp": ts})
            assert r.status_code == 201, (ts, r.text)
        batch = {"pages": [{"user_id": "v", "user_input": "hi", "timestamp": 1_700_000_000}]}
        assert c.post("/v1/pages", json=batch).status_code == 201
        q = {"query": "at", "top_pages": 3, "top_segments": 2, "sources": True}
        r = c.post("/v1/users/u/retrieve", json=q)
        assert r.status_code == 200 and len(r.json()["stm"]) == 4, r.text
        r = c.post("/v1/retrieve", json={"queries": [{"user_id": "v", **q}]})
        assert r.status_code == 200 and r.json()["results"][0]["known_user"], r.text
        search = {"user_id": "u", "query": "at", "top_k": 2, "limit": 2, "threshold": 0}
        r = c.post("/v1/mem0/search", json=search)  # a JSON integer for a float
        assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
        add = {"user_id": "w", "messages": "hi", "infer": False, "timestamp": 1_700_000_000}
        assert c.post("/v1/mem0/memories", json=add).status_code == 200
        # query strings are text by nature: their numbers and booleans are read from it
        r = c.get("/v1/users/u/pages", params={"offset": "1", "limit": "2"})
        assert r.status_code == 200 and (r.json()["offset"], r.json()["limit"]) == (1, 2)
        assert len(r.json()["pages"]) == 2
        r = c.get("/v1/mem0/memories", params={"user_id": "u", "page": "2", "page_size": "3"})
        assert r.status_code == 200 and r.json()["page_size"] == 3, r.text
        r = c.get("/v1/users/u/knowledge", params={"history": "true"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/users/u/wait", params={"timeout": "2.5"})
        assert r.status_code == 200 and r.json()["done"], r.text
        assert c.get("/v1/users/u/pages/1").json()["user_input"].startswith("at")

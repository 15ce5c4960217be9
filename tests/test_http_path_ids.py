"""User ids holding '/' (the library and ``ingest`` store them; an open server serves their
store) are addressed with ``%2F`` in paths: a path is split on '/' first, then each segment
decoded, so ``/v1/users/a/pages`` is always user ``a``'s pages and ``/v1/users/a%2Fpages/pages``
user ``a/pages``'s. Pages are still never written under such an id over HTTP (422)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from served import HA, HB, hashing, serve

from memoryos_gpu.engine import MemoryEngine

#: Users as the library stores them: "a" beside "a/pages", which a whole-path reading of
#: /v1/users/a/pages would confuse; a '/' id; and one holding a literal "%2F".
USERS = ["a", "a/pages", "team/alice", "50%2Foff"]
SLASH_REFUSED = "user_id must not contain '/'"


@pytest.fixture(params=[True, False], ids=["direct", "fastapi"])
def direct_routes(request: pytest.FixtureRequest) -> bool:
    """The hot routes (one page, one user's retrieval) served by the edge or by FastAPI."""
    return request.param


@pytest.fixture
def library_engine() -> Iterator[MemoryEngine]:
    """An engine holding one page of each of :data:`USERS`, written through the library."""
    engine = MemoryEngine(hashing())
    for u in USERS:
        engine.add(user_id=u, user_input=f"page of {u}", agent_response="ok")
    yield engine
    engine.close()


def _path(user: str, rest: str = "") -> str:
    return f"/v1/users/{quote(user, safe='')}{rest}"


def _texts(r: Any) -> list[str]:
    assert r.status_code == 200, r.text
    return [p["user_input"] for p in r.json()["pages"]]


def test_every_path_route_addresses_a_user_id_with_a_slash(
    library_engine: MemoryEngine, direct_routes: bool
) -> None:
    with serve(library_engine, keys=None, direct_routes=direct_routes) as c:
        assert c.get("/v1/users").json() == {"users": sorted(USERS)}
        for u in USERS:
            assert _texts(c.get(_path(u, "/pages"))) == [f"page of {u}"], u
            r = c.post(_path(u, "/retrieve"), json={"query": "page"})
            assert r.status_code == 200 and r.json()["user_id"] == u, r.text
            assert [p["user_input"] for p in r.json()["stm"]] == [f"page of {u}"]
        # split first: "v1/users" is one segment, of no route (the edge's direct routes agree)
        assert c.post("/v1%2Fusers/a/retrieve", json={"query": "page"}).status_code == 404
        u = "team/alice"
        for rest in ("/profile", "/knowledge", "/history", "/export"):
            r = c.get(_path(u, rest))
            assert r.status_code == 200, (rest, r.text)
        assert c.post(_path(u, "/wait"), params={"timeout": 5}).json()["user_id"] == u
        pid = c.get(_path(u, "/pages")).json()["pages"][0]["page_id"]
        assert c.get(_path(u, f"/pages/{pid}")).json()["user_id"] == u
        r = c.patch(_path(u, f"/pages/{pid}"), json={"user_input": "edited"})
        assert r.status_code == 200 and r.json()["user_input"] == "edited", r.text
        r = c.get(_path(u, "/knowledge/424242"))  # reached the route, for this user
        assert r.status_code == 404 and "'team/alice' has no knowledge entry" in r.text, r.text
        # the ids in bodies and query strings that name a user to read it
        r = c.post("/v1/retrieve", json={"queries": [{"user_id": u, "query": "edited"}]})
        assert r.json()["results"][0]["stm"][0]["user_input"] == "edited", r.text
        assert c.get("/v1/mem0/memories", params={"user_id": u}).json()["count"] == 1
        r = c.post("/v1/mem0/search", json={"user_id": u, "query": "edited"})
        assert [x["user_input"] for x in r.json()["results"]] == ["edited"], r.text
        assert c.delete(_path(u, f"/pages/{pid}")).json() == {"deleted": True}
        assert c.delete(_path(u)).json() == {"deleted": True}
        assert c.get("/v1/users").json() == {"users": ["50%2Foff", "a", "a/pages"]}


def test_a_literal_slash_always_separates_path_segments(library_engine: MemoryEngine) -> None:
    """The rule: split on '/', then decode each segment (RFC 3986). What another reading would
    take for user "a/pages" is user "a"'s page list, and "%252F" is a literal "%2F"."""
    with serve(library_engine, keys=None) as c:
        assert _texts(c.get("/v1/users/a/pages")) == ["page of a"]
        assert _texts(c.get("/v1/users/a%2Fpages/pages")) == ["page of a/pages"]
        assert _texts(c.get("/v1/users/a%2fpages/pages")) == ["page of a/pages"]
        assert _texts(c.get("/v1/users/50%252Foff/pages")) == ["page of 50%2Foff"]
        assert c.get("/v1/users/50%2Foff/pages").json()["error"] == "unknown_user"  # "50/off"
        assert c.get("/v1/users/a%2Fpages").status_code == 405  # DELETE only: not "a"'s pages
        assert c.get("/v1/users/team/alice/pages").status_code == 404  # no such route
        assert c.delete("/v1/users/a%2Fpages").json() == {"deleted": True}
        assert _texts(c.get("/v1/users/a/pages")) == ["page of a"]  # "a" untouched
        assert c.get("/v1/users").json() == {"users": ["50%2Foff", "a", "team/alice"]}


def test_pages_are_not_written_under_an_id_with_a_slash(
    library_engine: MemoryEngine, direct_routes: bool
) -> None:
    """Refused where pages are written, also for a user that exists: an open server stores ids
    as given, and a new "team/alice" would read as tenant "team"'s user once keys are set."""
    with serve(library_engine, keys=None, direct_routes=direct_routes) as c:
        for r in (
            c.post(_path("team/alice", "/pages"), json={"user_input": "x"}),
            c.post("/v1/pages", json={"pages": [{"user_id": "team/bob", "user_input": "x"}]}),
            c.post("/v1/mem0/memories", json={"user_id": "team/bob", "messages": "x"}),
        ):
            assert r.status_code == 422, r.text
            assert r.json() == {"error": "invalid_user_id", "detail": SLASH_REFUSED}
        assert _texts(c.get(_path("team/alice", "/pages"))) == ["page of team/alice"]
        assert c.get("/v1/users").json() == {"users": sorted(USERS)}


def test_a_tenants_user_with_a_slash_is_its_own(library_engine: MemoryEngine) -> None:
    """Tenant names hold no '/', so the prefix of "acme/team/alice" is "acme/" alone: tenant
    acme addresses its user "team/alice", and another tenant's same path is its own (none)."""
    library_engine.add(user_id="acme/team/alice", user_input="acme's", agent_response="ok")
    with serve(library_engine) as c:
        assert c.get("/v1/users", headers=HA).json() == {"users": ["team/alice"]}
        assert _texts(c.get(_path("team/alice", "/pages"), headers=HA)) == ["acme's"]
        r = c.get(_path("team/alice", "/pages"), headers=HB)
        assert r.status_code == 404 and r.json()["error"] == "unknown_user", r.text

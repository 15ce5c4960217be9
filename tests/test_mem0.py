"""The mem0-shaped API: messages to pages, filters, the Python ``Memory`` and ``/v1/mem0``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from memoryos_gpu.mem0 import Memory
from memoryos_gpu.mem0.filters import compile_filter, to_epoch
from memoryos_gpu.mem0.shapes import messages_to_pages, parse_memory_id


# ====================================================================== messages -> pages
def _pairs(messages: Any) -> list[tuple[str, str]]:
    return [(p.user_input, p.agent_response) for p in messages_to_pages(messages, user_id="u")]


def test_messages_pair_into_pages() -> None:
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi, I'm Ana."},
        {"role": "assistant", "content": "Hello Ana!"},
        {"role": "user", "content": "I like tea."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "jazz."}],
        },
        {"role": "assistant", "content": "Noted."},
        {"role": "tool", "content": "ignored"},
        {"role": "assistant", "content": "Anything else?"},
    ]
    assert _pairs(msgs) == [
        ("Hi, I'm Ana.", "Hello Ana!"),
        ("I like tea.", ""),
        ("And\njazz.", "Noted."),
        ("", "Anything else?"),
    ]
    assert _pairs("just a string") == [("just a string", "")]
    assert _pairs({"role": "user", "content": "one dict"}) == [("one dict", "")]
    pages = messages_to_pages(
        "x", user_id="u", assistant_id="bot", metadata={"a": 1}, run_id="r9", timestamp=5.0
    )
    assert (pages[0].assistant_id, pages[0].meta, pages[0].timestamp) == (
        "bot",
        {"a": 1, "run_id": "r9"},
        5.0,
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "critic", "content": "x"}], "role 'critic'"),
        ([{"role": "user"}], "'role' and 'content'"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text"),
        ([{"role": "system", "content": "only a system prompt"}], "no user or assistant text"),
        ([{"role": "user", "content": "   "}], "no user or assistant text"),
        (42, "must be a string"),
    ],
)
def test_bad_messages_are_refused(messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        messages_to_pages(messages, user_id="u")


def test_memory_ids() -> None:
    assert str(parse_memory_id("page-12")) == "page-12"
    assert parse_memory_id("knowledge-3").kind == "knowledge"
    for bad in ("page-", "page-x", "fact-1", "page--1", 12, "page-" + "9" * 30, "page-١"):
        assert parse_memory_id(bad) is None, bad


# ====================================================================== filters
ITEMS = [
    {"id": "page-1", "memory": "User: I love Jazz", "kind": "page", "tier": "stm",
     "metadata": {"topic": "music", "n": 3}, "_created_at_ts": to_epoch("2024-07-01T12:00:00")},
    {"id": "page-2", "memory": "User: tea time", "kind": "page", "tier": "mtm",
     "metadata": {"topic": "food", "n": 10}, "_created_at_ts": to_epoch("2024-08-15")},
    {"id": "knowledge-1", "memory": "Likes jazz", "kind": "knowledge", "tier": "lpm",
     "metadata": None, "_created_at_ts": 0.0 + to_epoch("2024-09-01")},
]  # fmt: skip


def _ids(flt: dict[str, Any]) -> list[str]:
    keep = compile_filter(flt)
    return [i["id"] for i in ITEMS if keep(i)]


@pytest.mark.parametrize(
    ("flt", "expected"),
    [
        ({}, ["page-1", "page-2", "knowledge-1"]),
        ({"topic": "music"}, ["page-1"]),
        ({"topic": {"ne": "music"}}, ["page-2", "knowledge-1"]),  # a missing key is "not equal"
        ({"topic": {"in": ["music", "food"]}}, ["page-1", "page-2"]),
        ({"topic": {"nin": ["music"]}}, ["page-2", "knowledge-1"]),
        ({"n": {"gt": 3}}, ["page-2"]),
        ({"n": {"gte": 3, "lt": 10}}, ["page-1"]),
        ({"n": {"lte": "a"}}, []),  # unlike types compare False, not an error
        ({"topic": "*"}, ["page-1", "page-2"]),
        ({"memory": {"contains": "jazz"}}, ["knowledge-1"]),
        ({"memory": {"icontains": "jazz"}}, ["page-1", "knowledge-1"]),
        ({"kind": "knowledge"}, ["knowledge-1"]),
        ({"created_at": {"gte": "2024-08-01", "lt": "2024-09-01T00:00:00Z"}}, ["page-2"]),
        ({"created_at": {"lt": to_epoch("2024-07-02")}}, ["page-1"]),
        ({"OR": [{"topic": "food"}, {"kind": "knowledge"}]}, ["page-2", "knowledge-1"]),
        ({"AND": [{"kind": "page"}, {"n": {"gt": 1}}], "tier": "stm"}, ["page-1"]),
        ({"NOT": [{"kind": "page"}]}, ["knowledge-1"]),
    ],
)
def test_filters(flt: dict[str, Any], expected: list[str]) -> None:
    assert _ids(flt) == expected


@pytest.mark.parametrize(
    ("flt", "match"),
    [
        ({"n": {"between": [1, 2]}}, "unknown filter operator 'between'"),
        ({"n": {"in": 3}}, "in takes a list"),
        ({"AND": {"n": 1}}, "AND takes a list"),
        ({"created_at": {"gt": "yesterday"}}, "not an ISO-8601 time"),
        ({"created_at": {"gt": True}}, "not a time"),
    ],
)
def test_bad_filters_fail_when_compiled(flt: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compile_filter(flt)


# ====================================================================== the Python Memory
def _facts(req: Any) -> dict[str, Any]:
    return {
        "profile_updates": {},
        "user_facts": ["Ana keeps bees on her roof."],
        "assistant_facts": ["The assistant recommended a bee suit."],
    }


@pytest.fixture
def memory(make_engine: Any, kit: Any) -> Memory:
    eng = make_engine(script=kit.Script(promotion=_facts), stm_capacity=2)
    return Memory(engine=eng)


def _chat(m: Memory, user: str, n: int, **kw: Any) -> list[str]:
    ids = []
    for i in range(n):
        out = m.add(
            [
                {"role": "user", "content": f"{user} message number {i} about gardening"},
                {"role": "assistant", "content": f"answer {i}"},
            ],
            user_id=user,
            timestamp=1_700_000_000 + 60 * i,
            **kw,
        )
        assert [r["event"] for r in out["results"]] == ["ADD"]
        ids.append(out["results"][0]["id"])
    return ids


def test_add_then_list_reads_what_was_written(memory: Memory) -> None:
    ids = _chat(memory, "ana", 5, metadata={"topic": "garden"})
    memory.engine.flush()
    memory.engine.promote("ana")
    facts = memory.engine.store.owner_knowledge("user", "ana")
    assert facts
    total = 5 + len(facts)
    listing = memory.get_all(user_id="ana", page_size=2)
    assert listing["count"] == total and listing["has_more"]
    seen: list[str] = []
    last = -(-total // 2)
    for page in range(1, last + 1):
        got = memory.get_all(filters={"user_id": "ana"}, page=page, page_size=2)
        seen += [r["id"] for r in got["results"]]
        assert got["has_more"] == (page < last)
    assert seen[:5] == ids  # oldest first, facts after the pages
    assert seen[5:] == [f"knowledge-{f['entry_id']}" for f in facts]
    item = memory.get(ids[0])
    assert item["memory"] == "User: ana message number 0 about gardening\nAssistant: answer 0"
    assert item["metadata"] == {"topic": "garden"} and item["user_id"] == "ana"
    assert item["created_at"].startswith("2023-11-14T22:13:20")
    assert {r["tier"] for r in memory.get_all(user_id="ana")["results"]} == {"stm", "mtm", "lpm"}
    assert memory.get_all(user_id="nobody")["results"] == []
    fact = memory.get(seen[5])
    assert fact["memory"] == "Ana keeps bees on her roof." and fact["kind"] == "knowledge"


def test_search_scores_are_cosines_best_first(memory: Memory) -> None:
    _chat(memory, "ana", 5)
    memory.engine.flush()
    memory.engine.promote("ana")
    query = "ana message number 3 about gardening"
    res = memory.search(query, user_id="ana", top_k=50)["results"]
    scores = [r["score"] for r in res]
    assert scores == sorted(scores, reverse=True) and len(res) >= 3
    emb = memory.engine.embedder
    q = emb.encode([query])[0]
    for r in res:
        text = r["memory"] if r["kind"] == "knowledge" else None
        if r["kind"] == "page":
            page = memory.engine.store.page_embeddings([int(r["id"].split("-")[1])], emb.dim)[0]
            want = float(page @ q / np.linalg.norm(page) / np.linalg.norm(q))
        else:
            v = emb.encode([text])[0]
            want = float(v @ q / np.linalg.norm(v) / np.linalg.norm(q))
        assert r["score"] == pytest.approx(want, abs=1e-4), r["id"]
    assert any(r["agent_id"] and r["kind"] == "knowledge" for r in res)  # the assistant's facts
    cut = scores[1]
    assert all(
        r["score"] >= cut for r in memory.search(query, user_id="ana", threshold=cut)["results"]
    )
    assert len(memory.search(query, user_id="ana", limit=2)["results"]) == 2
    only_pages = memory.search(query, filters={"user_id": "ana", "kind": "page"})["results"]
    assert only_pages and all(r["kind"] == "page" for r in only_pages)
    assert memory.search(query, user_id="stranger")["results"] == []


def test_run_and_agent_ids_narrow_a_users_memories(memory: Memory) -> None:
    memory.add("first session talk", user_id="bo", run_id="s1")
    memory.add("second session talk", user_id="bo", run_id="s2", metadata={"mood": "calm"})
    got = memory.get_all(filters={"user_id": "bo", "run_id": "s2"})["results"]
    assert [r["memory"] for r in got] == ["User: second session talk"]
    assert got[0]["metadata"] == {"mood": "calm", "run_id": "s2"}
    hits = memory.search("session talk", filters={"user_id": "bo", "run_id": "s1"})["results"]
    assert [r["memory"] for r in hits] == ["User: first session talk"]
    assert memory.get_all(filters={"user_id": "bo", "agent_id": "default"})["count"] == 2
    assert memory.get_all(filters={"user_id": "bo", "agent_id": "other"})["count"] == 0


def test_scope_arguments_narrow_as_filters_do(memory: Memory) -> None:
    """mem0 1's ``agent_id=`` / ``run_id=`` arguments (were a TypeError) mean what the same
    keys in ``filters`` and the HTTP routes mean, in search, get_all and delete_all alike."""
    memory.add("first session talk", user_id="bo", run_id="s1")
    memory.add("second session talk", user_id="bo", run_id="s2")
    hits = memory.search("session talk", user_id="bo", run_id="s1")["results"]
    assert [r["memory"] for r in hits] == ["User: first session talk"]
    assert len(memory.search("session talk", user_id="bo", agent_id="default")["results"]) == 2
    assert memory.search("session talk", user_id="bo", agent_id="other")["results"] == []
    got = memory.get_all(user_id="bo", run_id="s2")["results"]
    assert [r["memory"] for r in got] == ["User: second session talk"]
    assert memory.get_all(user_id="bo", agent_id="default")["count"] == 2
    memory.delete_all(user_id="bo", agent_id="other")  # selects nothing: deletes nothing
    memory.delete_all(user_id="bo", run_id="s1")  # that run's memories; the user stays
    got = memory.get_all(user_id="bo")["results"]
    assert [r["memory"] for r in got] == ["User: second session talk"]
    assert memory.engine.users() == ["bo"]


def test_update_delete_and_history(memory: Memory) -> None:
    (pid,) = _chat(memory, "cy", 1)
    assert memory.update(pid, "cy moved to Boston") == {"message": "Memory updated successfully!"}
    assert memory.get(pid)["user_input"] == "cy moved to Boston"
    assert memory.get(pid)["updated_at"] is not None
    memory.update(pid, agent_response="Welcome!")
    assert memory.get(pid)["memory"] == "User: cy moved to Boston\nAssistant: Welcome!"
    hist = memory.history(pid)
    assert [h["event"] for h in hist] == ["ADD", "UPDATE", "UPDATE"]
    assert hist[0]["new_memory"].startswith("User: cy message number 0")
    assert hist[1]["old_memory"] == hist[0]["new_memory"]
    assert hist[1]["new_memory"] == "User: cy moved to Boston\nAssistant: answer 0"
    memory.delete(pid)
    assert memory.get(pid) is None
    hist = memory.history(pid)  # the events stay, the deleted text does not
    assert [h["event"] for h in hist] == ["ADD", "UPDATE", "UPDATE", "DELETE"]
    assert "Boston" not in str(hist) and "message number" not in str(hist)
    assert hist[3]["is_deleted"] and hist[3]["new_memory"] is None
    with pytest.raises(ValueError, match=f"Memory with id {pid} not found"):
        memory.delete(pid)
    with pytest.raises(ValueError, match="not found"):
        memory.update("page-999999", "x")
    assert memory.history("nonsense") == []


def test_deleting_the_user_erases_its_history_a_run_keeps_it(memory: Memory) -> None:
    """As docs/migrating-from-mem0.md says: ``delete_all`` of one run deletes its memories one
    by one (each keeps its events), ``delete_all`` of the user erases the user, history too."""
    memory.add("first session talk", user_id="di", run_id="s1")
    memory.add("second session talk", user_id="di", run_id="s2")
    first, second = (r["id"] for r in memory.get_all(user_id="di")["results"])
    memory.delete_all(user_id="di", run_id="s1")
    assert [h["event"] for h in memory.history(first)] == ["ADD", "DELETE"]
    memory.delete_all(user_id="di")
    assert memory.history(first) == [] and memory.history(second) == []


def test_knowledge_update_and_delete(memory: Memory) -> None:
    _chat(memory, "di", 4)
    memory.engine.flush()
    memory.engine.promote("di")
    fact = next(r for r in memory.get_all(user_id="di")["results"] if r["kind"] == "knowledge")
    memory.update(fact["id"], data="Di keeps three hives.")
    assert memory.get(fact["id"])["memory"] == "Di keeps three hives."
    added, edited = memory.history(fact["id"])
    assert added["created_at"] == fact["created_at"] != edited["created_at"]  # not the edit's
    with pytest.raises(ValueError, match="no agent_response"):
        memory.update(fact["id"], agent_response="x")
    memory.delete(fact["id"])
    assert [h["event"] for h in memory.history(fact["id"])] == ["ADD", "UPDATE", "DELETE"]


def test_delete_all_and_reset(memory: Memory) -> None:
    _chat(memory, "ed", 2)
    _chat(memory, "flo", 2)
    assert memory.delete_all(user_id="ed") == {"message": "Memories deleted successfully!"}
    assert memory.get_all(user_id="ed")["count"] == 0
    assert memory.get_all(user_id="flo")["count"] == 2
    memory.reset()
    assert memory.engine.users() == [] and memory.get_all(user_id="flo")["count"] == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.search("q"), "give user_id"),
        (lambda m: m.search("q", user_id="a", filters={"user_id": "b"}), "disagree"),
        (lambda m: m.search("", user_id="a"), "non-empty"),
        (lambda m: m.search("q", user_id="a", top_k=0), "top_k"),
        (lambda m: m.search("q", user_id="a", filters={"x": {"like": 1}}), "operator"),
        (lambda m: m.get_all(user_id="a", page=0), "page must be"),
        (lambda m: m.get_all(user_id="a", page_size=5000), "page_size"),
        (lambda m: m.add("x"), "give user_id"),
        (lambda m: m.update("page-1", "a", data="b"), "not both"),
        (lambda m: m.search("q", user_id="a", run_id="r1", filters={"run_id": "r2"}), "disagree"),
        (lambda m: m.get_all(user_id="a", agent_id=" "), "agent_id must be a non-empty"),
        (lambda m: m.delete_all(run_id="r1"), "give user_id"),
        (lambda m: m.search("q", user_id="a", top_k=3, limit=4), "not both"),
        (lambda m: m.add("x", user_id="a", metadata={"tier": "gold"}), r"\['tier'\] name item"),
        (lambda m: m.add("x", user_id="a", run_id="r1", metadata={"run_id": "r2"}), "disagree"),
    ],
)
def test_bad_calls_say_why(memory: Memory, call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(memory)


def test_metadata_keys_are_what_filters_select(memory: Memory) -> None:
    """A refused ``{"tier": "gold"}`` (a filter on ``tier`` tests the item's tier) left nothing
    stored; any other key is stored and filtered on as metadata."""
    with pytest.raises(ValueError, match="reserved: agent_id, created_at, hash, id, kind"):
        memory.add("gold member", user_id="ivy", metadata={"tier": "gold", "kind": "purchase"})
    assert memory.get_all(user_id="ivy")["count"] == 0
    memory.add("gold member", user_id="ivy", metadata={"plan_tier": "gold"})
    memory.add("free member", user_id="ivy", metadata={"plan_tier": "free"})
    got = memory.get_all(filters={"user_id": "ivy", "plan_tier": "gold"})["results"]
    assert [r["memory"] for r in got] == ["User: gold member"]
    assert memory.get_all(filters={"user_id": "ivy", "tier": "stm"})["count"] == 2


def test_a_page_is_not_blanked_by_update(memory: Memory) -> None:
    (added,) = memory.add("I love sushi", user_id="jo")["results"]
    with pytest.raises(ValueError, match="both sides of the page blank"):
        memory.update(added["id"], text="")
    assert memory.get(added["id"])["memory"] == "User: I love sushi"


def test_from_config_refuses_mem0_settings_and_builds_an_engine(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="mem0 settings"):
        Memory.from_config({"vector_store": {"provider": "qdrant"}})
    with pytest.raises(ValueError, match="mem0 settings"):
        Memory.from_config({"llm": {"provider": "openai", "config": {}}})
    store = tmp_path / "m.sqlite3"
    with Memory.from_config({"store": str(store), "embedder": "hashing"}) as m:
        m.add("kept on disk", user_id="gus")
    with Memory.from_config({"store": str(store), "embedder": "hashing"}) as m:
        assert [r["memory"] for r in m.get_all(user_id="gus")["results"]] == ["User: kept on disk"]


# ====================================================================== HTTP: /v1/mem0
def _http_add(c: Any, user: str, text: str, headers: dict, **kw: Any) -> str:
    body = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}
    r = c.post("/v1/mem0/memories", json={**body, "user_id": user, **kw}, headers=headers)
    assert r.status_code == 200, r.text
    (res,) = r.json()["results"]
    assert res["event"] == "ADD"
    return res["id"]


def test_http_mem0_roundtrip_and_tenancy() -> None:
    pytest.importorskip("fastapi")
    from served import HA, HB, hashing, serve

    with serve(hashing()) as c:
        a1 = _http_add(c, "ana", "I moved to Boston", HA, agent_id="helper", run_id="s1")
        a2 = _http_add(c, "ana", "My cat is Miso", HA, agent_id="helper", metadata={"pet": True})
        b1 = _http_add(c, "ana", "Tenant beta's ana", HB)
        r = c.get("/v1/mem0/memories", params={"user_id": "ana", "page_size": 1}, headers=HA)
        body = r.json()
        assert (body["count"], body["has_more"], body["results"][0]["id"]) == (2, True, a1)
        assert body["results"][0]["agent_id"] == "helper" and body["results"][0]["user_id"] == "ana"
        for name in ("limit", "top_k"):  # mem0's names for the page size (were ignored)
            r = c.get("/v1/mem0/memories", params={"user_id": "ana", name: 1}, headers=HA)
            assert [x["id"] for x in r.json()["results"]] == [a1], name
        r = c.get(
            "/v1/mem0/memories", params={"user_id": "ana", "limit": 1, "top_k": 2}, headers=HA
        )
        assert r.status_code == 422
        r = c.get("/v1/mem0/memories", params={"user_id": "ana", "run_id": "s1"}, headers=HA)
        assert [x["id"] for x in r.json()["results"]] == [a1]
        r = c.get("/v1/mem0/memories", params={"user_id": "ana", "agent_id": "helper"}, headers=HA)
        assert r.json()["count"] == 2
        r = c.post("/v1/mem0/search", json={"query": "Boston", "user_id": "ana"}, headers=HA)
        hits = r.json()["results"]
        assert {h["id"] for h in hits} == {a1, a2} and all("score" in h for h in hits)
        flt = {"user_id": "ana", "pet": True}
        r = c.post("/v1/mem0/search", json={"query": "cat", "filters": flt}, headers=HA)
        assert [h["id"] for h in r.json()["results"]] == [a2]
        # another tenant's memory is not found, whatever the verb
        for meth, url in (
            ("GET", f"/v1/mem0/memories/{b1}"),
            ("DELETE", f"/v1/mem0/memories/{b1}"),
            ("GET", f"/v1/mem0/memories/{b1}/history"),
        ):
            assert c.request(meth, url, headers=HA).status_code == 404, (meth, url)
        r = c.put(f"/v1/mem0/memories/{b1}", json={"text": "hijack"}, headers=HA)
        assert r.status_code == 404
        assert (
            c.get(f"/v1/mem0/memories/{b1}", headers=HB).json()["memory"].startswith("User: Tenant")
        )
        r = c.put(f"/v1/mem0/memories/{a1}", json={"text": "I moved to Seattle"}, headers=HA)
        assert r.json() == {"message": "Memory updated successfully!"}
        assert (
            c.get(f"/v1/mem0/memories/{a1}", headers=HA).json()["user_input"]
            == "I moved to Seattle"
        )
        assert c.delete(f"/v1/mem0/memories/{a1}", headers=HA).status_code == 200
        hist = c.get(f"/v1/mem0/memories/{a1}/history", headers=HA).json()
        assert [h["event"] for h in hist] == ["ADD", "UPDATE", "DELETE"]
        assert c.get(f"/v1/mem0/memories/{a1}", headers=HA).status_code == 404
        assert c.post("/v1/mem0/reset", headers=HA).status_code == 200
        r = c.get("/v1/mem0/memories", params={"user_id": "ana"}, headers=HA)
        assert r.json()["count"] == 0
        r = c.get("/v1/mem0/memories", params={"user_id": "ana"}, headers=HB)
        assert r.json()["count"] == 1  # the other tenant's memory survives its neighbour's reset
        r = c.delete("/v1/mem0/memories", params={"user_id": "ana"}, headers=HB)
        assert r.status_code == 200
        assert c.get("/v1/users", headers=HB).json() == {"users": []}


def test_http_scope_ids_narrow_search_listing_and_deletion() -> None:
    """``DELETE /v1/mem0/memories?user_id=&run_id=`` deletes that run's memories only (it
    ignored run_id and deleted the whole user); body ids and filters must agree."""
    pytest.importorskip("fastapi")
    from served import HA, hashing, serve

    with serve(hashing()) as c:
        s1 = _http_add(c, "ana", "I like tea", HA, agent_id="helper", run_id="s1")
        s2 = _http_add(c, "ana", "I like coffee", HA, agent_id="helper", run_id="s2")
        body = {"query": "drinks", "user_id": "ana", "run_id": "s1"}
        r = c.post("/v1/mem0/search", json=body, headers=HA)
        assert [h["id"] for h in r.json()["results"]] == [s1]
        for bad, why in (
            ({**body, "filters": {"run_id": "s2"}}, "disagree"),
            ({**body, "top_k": 1, "limit": 2}, "not both"),
        ):
            r = c.post("/v1/mem0/search", json=bad, headers=HA)
            assert r.status_code == 422 and why in r.json()["detail"], bad
        r = c.put(f"/v1/mem0/memories/{s1}", json={"text": ""}, headers=HA)  # "ok" stays
        assert r.status_code == 200, r.text
        r = c.put(f"/v1/mem0/memories/{s1}", json={"text": "", "agent_response": ""}, headers=HA)
        assert r.status_code == 422 and "blank" in r.json()["detail"]
        q = {"user_id": "ana", "run_id": "s1"}
        assert c.delete("/v1/mem0/memories", params=q, headers=HA).status_code == 200
        r = c.get("/v1/mem0/memories", params={"user_id": "ana"}, headers=HA)
        assert [x["id"] for x in r.json()["results"]] == [s2]
        q = {"user_id": "ana", "agent_id": "helper"}  # the tenant's own name for its assistant
        assert c.delete("/v1/mem0/memories", params=q, headers=HA).status_code == 200
        r = c.get("/v1/mem0/memories", params={"user_id": "ana"}, headers=HA)
        assert r.json()["count"] == 0
        meta = {"messages": "x", "user_id": "ana", "metadata": {"hash": "h"}}
        r = c.post("/v1/mem0/memories", json=meta, headers=HA)
        assert r.status_code == 422 and "['hash']" in r.json()["detail"]


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        (
            "/v1/mem0/memories",
            {"messages": [{"role": "critic", "content": "x"}], "user_id": "u"},
            422,
        ),
        ("/v1/mem0/memories", {"messages": "x"}, 422),
        ("/v1/mem0/memories", {"messages": "x", "user_id": "a/b"}, 422),
        ("/v1/mem0/search", {"query": "q"}, 422),
        ("/v1/mem0/search", {"query": "q", "user_id": "u", "filters": {"a": {"like": 1}}}, 422),
        ("/v1/mem0/search", {"query": "q", "user_id": "u", "top_k": 0}, 422),
    ],
)
def test_http_mem0_bad_bodies_answer_422(path: str, body: dict, code: int) -> None:
    pytest.importorskip("fastapi")
    from served import HA, hashing, serve

    with serve(hashing()) as c:
        r = c.post(path, json=body, headers=HA)
        assert r.status_code == code, r.text
        assert r.json()["error"] in ("invalid_input", "validation_error", "invalid_user_id")


def test_http_lists_a_users_pages() -> None:
    pytest.importorskip("fastapi")
    from served import HA, hashing, serve

    with serve(hashing()) as c:
        for i in range(5):
            body = {"user_input": f"page {i}", "timestamp": 1000.0 + i}
            assert c.post("/v1/users/ana/pages", json=body, headers=HA).status_code == 201
        r = c.get("/v1/users/ana/pages", params={"offset": 1, "limit": 3}, headers=HA).json()
        assert [p["user_input"] for p in r["pages"]] == ["page 1", "page 2", "page 3"]
        assert (r["total"], r["offset"], r["limit"], r["pages"][0]["user_id"]) == (5, 1, 3, "ana")
        assert c.get("/v1/users/nobody/pages", headers=HA).status_code == 404
        assert c.get("/v1/users/ana/pages", params={"limit": 0}, headers=HA).status_code == 422


def test_memory_on_each_store(backend: Any, make_engine: Any, kit: Any) -> None:
    """Listing windows, per-item history and edit times come from the store: both kinds."""
    eng = make_engine(store=backend.spec("mem0"), script=kit.Script(promotion=_facts))
    m = Memory(engine=eng)
    ids = _chat(m, "hal", 3)
    m.update(ids[1], "hal changed his mind")
    got = m.get_all(user_id="hal", page=2, page_size=2)
    assert [r["id"] for r in got["results"]] == [ids[2]] and got["count"] == 3
    assert m.get(ids[1])["updated_at"] is not None and m.get(ids[0])["updated_at"] is None
    m.delete(ids[1])
    assert [h["event"] for h in m.history(ids[1])] == ["ADD", "UPDATE", "DELETE"]
    assert eng.list_pages("hal", 0, 10)[1] == 2


def test_a_blank_side_is_left_out_of_the_memory_whatever_its_whitespace(memory: Memory) -> None:
    """Pages the engine keeps with blank sides (the MemoryOS drop-in stores them, as the
    reference does) read alike: a side of spaces was labelled (``User:    ``), an empty one not."""
    from memoryos_gpu.types import PageInput

    memory.engine.add_many([PageInput("eve", "", ""), PageInput("eve", "   ", " tea? ")])
    got = [r["memory"] for r in memory.get_all(user_id="eve")["results"]]
    assert sorted(got) == ["", "Assistant:  tea? "]

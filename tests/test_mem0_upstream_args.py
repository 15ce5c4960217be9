"""mem0 2.0.18 code run unchanged against memoryos_gpu.mem0: the times of a searched fact, mem0's
reading of scope ids, and the arguments and body fields mem0 2 has (accepted where they can be
honoured, refused saying why where they cannot), in Python and over ``/v1/mem0``."""

from __future__ import annotations

import math
from typing import Any

import pytest
from test_mem0 import _chat, _facts

from memoryos_gpu.mem0 import Memory


@pytest.fixture
def memory(make_engine: Any, kit: Any) -> Memory:
    return Memory(engine=make_engine(script=kit.Script(promotion=_facts), stm_capacity=2))


def _derive(m: Memory, user: str) -> None:
    _chat(m, user, 4)
    m.engine.flush()
    m.engine.promote(user)
    assert m.engine.store.owner_knowledge("user", user)


def _without_score(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in ("score", "score_details")}


# ---------------------------------------------------------------------- 1. fact times
def test_a_searched_fact_is_the_item_get_gives_times_included(memory: Memory) -> None:
    """Search built its facts with ``created_at: None`` (and no ``updated_at``): a time filter
    dropped every fact, and an edit did not show. Each result is now ``get``'s item."""
    _derive(memory, "dana")
    query = "Who keeps bees on the roof?"
    since = {"user_id": "dana", "kind": "knowledge", "created_at": {"gte": "2000-01-01"}}
    listed = memory.get_all(filters=since)
    assert listed["count"] >= 1
    found = memory.search(query, filters=since, top_k=50)["results"]
    assert found, "a created_at filter kept no fact"
    users_facts = {r["id"] for r in found if r["user_id"] == "dana"}  # not the assistant's
    assert users_facts and users_facts <= {r["id"] for r in listed["results"]}
    everything = memory.search(query, user_id="dana", top_k=50)["results"]
    facts = [r for r in everything if r["kind"] == "knowledge"]
    assert {f["agent_id"] for f in facts} == {"default"} and {f["user_id"] for f in facts} == {
        "dana",
        None,  # the assistant's knowledge: agent_id only
    }
    for r in everything:  # pages and facts alike: get's item plus the score
        assert _without_score(r) == memory.get(r["id"]), r["id"]
        assert r["created_at"] is not None
    fact = next(f for f in facts if f["user_id"] == "dana")
    memory.update(fact["id"], text="Ana keeps three hives of bees on her roof.")
    edited = memory.get(fact["id"])
    assert edited["updated_at"] is not None
    again = memory.search(query, user_id="dana", top_k=50)["results"]
    (hit,) = [r for r in again if r["id"] == fact["id"]]
    assert (hit["memory"], hit["updated_at"]) == (edited["memory"], edited["updated_at"])
    edited_since = {"user_id": "dana", "updated_at": {"gte": edited["updated_at"]}}
    assert [r["id"] for r in memory.search(query, filters=edited_since)["results"]] == [fact["id"]]


def test_a_fact_deleted_after_the_retrieval_is_not_ranked(memory: Memory) -> None:
    _derive(memory, "eli")
    eng = memory.engine
    r = eng.retrieve("eli", "Who keeps bees on the roof?")
    (entry, *_) = r.user_knowledge
    assert eng.delete_knowledge(entry.entry_id)
    ranked = memory._ops.rank(r, r.query, keep=lambda _: True, threshold=None, top_k=50)
    assert f"knowledge-{entry.entry_id}" not in {i["id"] for i in ranked}


# ---------------------------------------------------------------------- 2. scope ids
def test_ids_are_read_as_mem0_reads_them(memory: Memory) -> None:
    """An integer id is its text, surrounding whitespace is trimmed, inner whitespace is
    refused naming the field (an integer raised "give user_id", " pad " was another user)."""
    (added,) = memory.add("I like tea.", user_id=42, agent_id=" bot ", run_id=7)["results"]
    item = memory.get(added["id"])
    assert (item["user_id"], item["agent_id"], item["run_id"]) == ("42", "bot", "7")
    assert memory.get_all(user_id="42")["count"] == 1
    assert memory.get_all(filters={"user_id": 42, "run_id": 7})["count"] == 1
    assert [r["id"] for r in memory.search("tea", filters={"user_id": 42})["results"]] == [
        added["id"]
    ]
    memory.add("padded", user_id=" pad ")
    memory.add("plain", user_id="pad")
    assert memory.get_all(user_id="pad")["count"] == 2
    assert memory.search("padded", user_id="pad ", filters={"user_id": " pad"})["results"]
    assert "pad" in memory.engine.users() and " pad " not in memory.engine.users()
    memory.delete_all(user_id=42)
    assert memory.get_all(user_id="42")["count"] == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.add("x", user_id="a b"), "user_id must not contain whitespace"),
        (lambda m: m.add("x", user_id="   "), "user_id must be a non-empty id"),
        (lambda m: m.add("x", user_id="u", agent_id="a\tb"), "agent_id must not contain"),
        (lambda m: m.add("x", user_id="u", run_id=""), "run_id must be a non-empty id"),
        (lambda m: m.add("x", user_id=True), "user_id must be a string or an integer"),
        (lambda m: m.search("q", filters={"user_id": "a b"}), "user_id must not contain"),
        (lambda m: m.get_all(user_id="u", run_id=["r"]), "run_id must be a string or an"),
        (lambda m: m.delete_all(user_id="two words"), "user_id must not contain"),
    ],
)
def test_bad_ids_are_refused_naming_the_field(memory: Memory, call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(memory)
    assert memory.engine.users() == []


# ---------------------------------------------------------------------- 4. mem0 2 arguments
def test_search_takes_mem0_2s_arguments(memory: Memory) -> None:
    _chat(memory, "fay", 2)
    plain = memory.search("gardening", user_id="fay")["results"]
    assert plain
    same = memory.search(
        "gardening",
        filters={"user_id": "fay"},
        rerank=False,
        explain=False,
        show_expired=True,
        reference_date=None,
    )["results"]
    assert same == plain
    explained = memory.search("gardening", user_id="fay", explain=True)["results"]
    assert [_without_score(r) for r in explained] == [_without_score(r) for r in plain]
    for r in explained:
        d = r["score_details"]
        assert d["semantic_score"] == d["final_score"] == r["score"]
        assert (d["bm25_score"], d["entity_boost"], d["threshold"]) == (0.0, 0.0, None)
    kept = memory.search("gardening", user_id="fay", explain=True, threshold=0.0)["results"]
    assert kept and all(r["score_details"]["threshold"] == 0.0 for r in kept)
    assert memory.get_all(user_id="fay", show_expired=True)["count"] == 2
    with pytest.raises(ValueError, match="no reranker"):
        memory.search("gardening", user_id="fay", rerank=True)
    with pytest.raises(ValueError, match="reference_date not supported"):
        memory.search("gardening", user_id="fay", reference_date="2024-01-01")
    with pytest.raises(ValueError, match="explain must be True or False"):
        memory.search("gardening", user_id="fay", explain="yes")


def test_add_and_update_take_mem0_2s_arguments(memory: Memory) -> None:
    (added,) = memory.add("I like tea.", user_id="gus", expiration_date=None)["results"]
    with pytest.raises(ValueError, match="no expiry dates"):
        memory.add("I like coffee.", user_id="gus", expiration_date="2030-01-01")
    assert memory.get_all(user_id="gus")["count"] == 1
    pid = added["id"]
    with pytest.raises(ValueError, match="metadata not editable"):
        memory.update(pid, text="I like mint tea.", metadata={"topic": "drinks"})
    with pytest.raises(ValueError, match="no expiry dates"):
        memory.update(pid, text="I like mint tea.", expiration_date="2030-01-01")
    assert memory.get(pid)["memory"] == "User: I like tea."
    out = memory.update(pid, text="I like mint tea.", metadata=None, expiration_date=None)
    assert out == {"message": "Memory updated successfully!"}
    assert memory.get(pid)["user_input"] == "I like mint tea."
    assert memory.update(pid, expiration_date=None) == {"message": "Memory updated successfully!"}
    assert memory.get(pid)["user_input"] == "I like mint tea."
    with pytest.raises(ValueError, match="not found"):
        memory.update("page-999", expiration_date=None)
    memory.update(pid, "I like green tea.", None)  # mem0's positional order: text, metadata
    assert memory.get(pid)["user_input"] == "I like green tea."


# ---------------------------------------------------------------------- 8. threshold, query
@pytest.mark.parametrize("threshold", [2, -0.1, 1.5, math.nan, math.inf])
def test_a_threshold_outside_0_to_1_is_refused(memory: Memory, threshold: float) -> None:
    _chat(memory, "hal", 1)
    with pytest.raises(ValueError, match="Must be between 0 and 1"):
        memory.search("gardening", user_id="hal", threshold=threshold)


def test_thresholds_0_and_1_are_served(memory: Memory) -> None:
    _chat(memory, "hal", 3)
    plain = memory.search("gardening", user_id="hal")["results"]
    assert plain
    for threshold in (0, 1):
        kept = memory.search("gardening", user_id="hal", threshold=threshold)["results"]
        assert kept == [r for r in plain if r["score"] >= threshold]


def test_a_query_with_a_lone_surrogate_is_read_as_add_reads_text(memory: Memory) -> None:
    """``add`` stores a lone surrogate as U+FFFD; search embedded the raw query again after the
    engine's retrieval, and an embedder's tokenizer refused it (a TypeError from MiniLM's, a
    UnicodeEncodeError from the test embedder)."""
    memory.add("bad \ud800 news", user_id="ivy")
    assert memory.get_all(user_id="ivy")["results"][0]["user_input"] == "bad \ufffd news"
    got = memory.search("bad \ud800 news", user_id="ivy")["results"]
    assert got == memory.search("bad \ufffd news", user_id="ivy")["results"]
    assert [r["id"] for r in got] == ["page-1"]


def test_add_answers_with_the_text_it_stored(memory: Memory) -> None:
    """``add``'s answer echoed the text given, lone surrogate and all, while the page (and a
    ``get`` of the id it named) held U+FFFD: the answer and the memory disagreed."""
    (added,) = memory.add("I like \ud800 things.", user_id="ivy")["results"]
    assert added["memory"] == memory.get(added["id"])["memory"]
    assert "\ufffd" in added["memory"] and "\ud800" not in added["memory"]


# ---------------------------------------------------------------------- HTTP
def _msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]


def test_http_reads_ids_as_mem0_does() -> None:
    pytest.importorskip("fastapi")
    from served import HA, hashing, serve

    with serve(hashing()) as c:
        body = {"messages": _msgs("I like tea"), "user_id": 42, "agent_id": 9, "run_id": 7}
        r = c.post("/v1/mem0/memories", json=body, headers=HA)
        assert r.status_code == 200, r.text  # was 422: not a string
        (added,) = r.json()["results"]
        item = c.get(f"/v1/mem0/memories/{added['id']}", headers=HA).json()
        assert (item["user_id"], item["agent_id"], item["run_id"]) == ("42", "9", "7")
        r = c.post("/v1/mem0/search", json={"query": "tea", "user_id": 42}, headers=HA)
        assert [h["id"] for h in r.json()["results"]] == [added["id"]], r.text
        flt = {"user_id": 42, "run_id": 7}
        r = c.post("/v1/mem0/search", json={"query": "tea", "filters": flt}, headers=HA)
        assert [h["id"] for h in r.json()["results"]] == [added["id"]], r.text
        for user in (" pad ", "pad"):
            body = {"messages": _msgs(f"from {user!r}"), "user_id": user}
            assert c.post("/v1/mem0/memories", json=body, headers=HA).status_code == 200
        r = c.get("/v1/mem0/memories", params={"user_id": " pad"}, headers=HA)
        assert r.json()["count"] == 2, r.text
        assert sorted(c.get("/v1/users", headers=HA).json()["users"]) == ["42", "pad"]
        for bad, field in (
            ({"messages": "x", "user_id": "a b"}, "user_id"),
            ({"messages": "x", "user_id": True}, "user_id"),
            ({"messages": "x", "user_id": "u", "run_id": "r 1"}, "run_id"),
            ({"messages": "x", "user_id": "u", "agent_id": " "}, "agent_id"),
            ({"messages": "x", "user_id": 1.5}, "user_id"),
        ):
            r = c.post("/v1/mem0/memories", json=bad, headers=HA)
            assert r.status_code == 422 and field in r.text, (bad, r.text)
        r = c.post("/v1/mem0/search", json={"query": "q", "user_id": "a b"}, headers=HA)
        assert r.status_code == 422 and "user_id must not contain whitespace" in r.text
        r = c.get("/v1/mem0/memories", params={"user_id": "a b"}, headers=HA)
        assert r.status_code == 422 and "user_id must not contain whitespace" in r.text


def test_http_takes_mem0s_rest_fields() -> None:
    """Fields of mem0's own ``MemoryCreate``, ``SearchRequest`` and ``MemoryUpdate`` were
    422 ``extra_forbidden`` even when null; a value the engine cannot honour is a 422 that
    says why."""
    pytest.importorskip("fastapi")
    from served import HA, hashing, serve

    with serve(hashing()) as c:
        nulls = {"expiration_date": None, "infer": False, "memory_type": None, "prompt": None}
        body = {"messages": _msgs("I like tea"), "user_id": "ana", **nulls}
        r = c.post("/v1/mem0/memories", json=body, headers=HA)
        assert r.status_code == 200, r.text
        (added,) = r.json()["results"]
        for field, value, why in (
            ("prompt", "Extract facts.", "derives memories with its own stages"),
            ("memory_type", "procedural_memory", "derives memories with its own stages"),
            ("expiration_date", "2030-01-01", "no expiry dates"),
        ):
            bad = {"messages": "x", "user_id": "ana", field: value}
            r = c.post("/v1/mem0/memories", json=bad, headers=HA)
            assert (r.status_code, r.json()["error"]) == (422, "invalid_input"), r.text
            assert field in r.json()["detail"] and why in r.json()["detail"], r.text
        assert (
            c.get("/v1/mem0/memories", params={"user_id": "ana"}, headers=HA).json()["count"] == 1
        )
        q = {"query": "tea", "filters": {"user_id": "ana"}}
        for extra in ({"explain": None, "show_expired": None}, {"show_expired": True}):
            r = c.post("/v1/mem0/search", json={**q, **extra}, headers=HA)
            assert r.status_code == 200 and r.json()["results"], r.text
            assert all("score_details" not in h for h in r.json()["results"])
        r = c.post("/v1/mem0/search", json={**q, "explain": True}, headers=HA)
        (hit,) = r.json()["results"]
        assert hit["score_details"]["semantic_score"] == hit["score"], r.text
        r = c.post("/v1/mem0/search", json={**q, "threshold": 2}, headers=HA)
        assert r.status_code == 422 and "Must be between 0 and 1" in r.text, r.text
        r = c.get(
            "/v1/mem0/memories", params={"user_id": "ana", "show_expired": "true"}, headers=HA
        )
        assert r.json()["count"] == 1
        url = f"/v1/mem0/memories/{added['id']}"
        r = c.put(url, json={"text": "I like mint tea", "metadata": None}, headers=HA)
        assert r.status_code == 200, r.text
        assert c.put(url, json={"expiration_date": None}, headers=HA).status_code == 200
        for bad, why in (
            ({"text": "x", "metadata": {"topic": "drinks"}}, "metadata not editable"),
            ({"text": "x", "expiration_date": "2030-01-01"}, "no expiry dates"),
        ):
            r = c.put(url, json=bad, headers=HA)
            assert r.status_code == 422 and why in r.json()["detail"], r.text
        assert c.get(url, headers=HA).json()["user_input"] == "I like mint tea"
        r = c.put("/v1/mem0/memories/page-999", json={"expiration_date": None}, headers=HA)
        assert r.status_code == 404


@pytest.mark.parametrize("ts", [1_796_599_999.1234567, 1_796_599_999.9999996, 1_700_000_000.0])
def test_a_time_an_item_shows_selects_that_item(ts: float) -> None:
    """An item's ISO time is rounded to the microsecond (up, for these): a filter on the time
    an item showed (``updated_at >= <its updated_at>``, as a client pages by it) missed it."""
    from memoryos_gpu.mem0.filters import compile_filter
    from memoryos_gpu.mem0.shapes import iso

    item = {"_updated_at_ts": ts, "updated_at": iso(ts)}
    for op in ("gte", "lte", "eq"):
        assert compile_filter({"updated_at": {op: item["updated_at"]}})(item), op
    assert not compile_filter({"updated_at": {"gt": item["updated_at"]}})(item)

"""mem0 code run unchanged against memoryos_gpu.mem0: the scope, history and argument rules a
drop-in replacement must keep (the findings of a migration test)."""

from __future__ import annotations

from typing import Any

import pytest
from test_mem0 import _chat, _facts

from memoryos_gpu.mem0 import Memory


@pytest.fixture
def memory(make_engine: Any, kit: Any) -> Memory:
    return Memory(engine=make_engine(script=kit.Script(promotion=_facts), stm_capacity=2))


def _with_facts(m: Memory, user: str, **kw: Any) -> list[str]:
    """Pages for ``user`` with facts derived from them; the page ids."""
    ids = _chat(m, user, 4, **kw)
    m.engine.flush()
    m.engine.promote(user)
    assert m.engine.store.owner_knowledge("user", user)
    return ids


def _knowledge(m: Memory, user: str) -> dict[str, str]:
    listed = m.get_all(user_id=user, filters={"kind": "knowledge"})["results"]
    return {r["id"]: r["memory"] for r in listed}


# ---------------------------------------------------------------------- finding 1: agent_id
def test_the_users_own_agent_id_keeps_their_facts(memory: Memory) -> None:
    _with_facts(memory, "ana", agent_id="travel-bot")
    facts = _knowledge(memory, "ana")
    assert facts and all(memory.get(f)["agent_id"] == "travel-bot" for f in facts), (
        "user knowledge carries the user's assistant"
    )
    listed = [r["id"] for r in memory.get_all(user_id="ana")["results"]]
    scoped = [r["id"] for r in memory.get_all(user_id="ana", agent_id="travel-bot")["results"]]
    assert scoped == listed and set(facts) <= set(scoped)
    query = "Who keeps bees on the roof?"
    plain = memory.search(query, user_id="ana", top_k=50)["results"]
    narrowed = memory.search(query, user_id="ana", agent_id="travel-bot", top_k=50)["results"]
    assert [r["id"] for r in narrowed] == [r["id"] for r in plain]
    assert set(facts) & {r["id"] for r in narrowed}
    # another assistant's scope still selects none of the user's memories
    assert memory.get_all(user_id="ana", agent_id="other-bot")["results"] == []


# ---------------------------------------------------------------------- finding 2: history
def test_history_of_a_knowledge_id_that_never_existed_is_empty(memory: Memory) -> None:
    _chat(memory, "bo", 1)
    for missing in ("knowledge-999", "knowledge-0"):
        assert memory.history(missing) == []
        assert memory.get(missing) is None


def test_http_history_of_a_knowledge_id_that_never_existed_is_404() -> None:
    pytest.importorskip("fastapi")
    from served import HA, hashing, serve

    with serve(hashing()) as c:
        body = {"messages": "I like tea.", "user_id": "bo"}
        assert c.post("/v1/mem0/memories", json=body, headers=HA).status_code == 200
        for missing in ("knowledge-999", "page-999"):
            r = c.get(f"/v1/mem0/memories/{missing}/history", headers=HA)
            assert (r.status_code, r.json()["error"]) == (404, "not_found"), r.text


# ---------------------------------------------------------------------- finding 3: cascades
def test_a_fact_gone_with_its_deleted_page_has_a_delete_event(
    backend: Any, make_engine: Any, kit: Any
) -> None:
    """On each store: the owners are read with one recursive query before the rows go."""
    eng = make_engine(
        store=backend.spec("cascade"), script=kit.Script(promotion=_facts), stm_capacity=2
    )
    memory = Memory(engine=eng)
    pages = _with_facts(memory, "cy")
    before = _knowledge(memory, "cy")
    for page in pages:
        memory.delete(page)
    gone = set(before) - set(_knowledge(memory, "cy"))
    assert gone
    for fact in gone:
        events = memory.history(fact)
        assert [e["event"] for e in events] == ["ADD", "DELETE"], events
        assert events[-1]["created_at"] is not None
    audited = {
        e["item_id"]
        for e in memory.engine.history("cy")
        if (e["action"], e["item_kind"]) == ("delete", "knowledge")
    }
    assert {int(f.removeprefix("knowledge-")) for f in gone} <= audited


def test_a_fact_gone_with_an_edit_of_its_page_has_a_delete_event(memory: Memory) -> None:
    pages = _with_facts(memory, "di")
    before = _knowledge(memory, "di")
    for page in pages:
        memory.update(page, "di now talks about the weather")
    gone = set(before) - set(_knowledge(memory, "di"))
    assert gone
    for fact in gone:
        assert [e["event"] for e in memory.history(fact)] == ["ADD", "DELETE"]


# ---------------------------------------------------------------------- finding 5: AND user_id
def test_a_user_id_inside_a_top_level_and_names_the_user(memory: Memory) -> None:
    _chat(memory, "bob", 2)
    _chat(memory, "eve", 2)
    flt = {"AND": [{"user_id": "bob"}, {"kind": "page"}]}
    found = memory.search("bees", filters=flt)["results"]
    assert found and {r["user_id"] for r in found} == {"bob"}
    assert memory.get_all(filters=flt)["count"] == 2
    with pytest.raises(ValueError, match="disagree"):
        memory.search("bees", user_id="eve", filters=flt)
    with pytest.raises(ValueError, match="name two users"):
        memory.search("bees", filters={"AND": [{"user_id": "bob"}, {"user_id": "eve"}]})


@pytest.mark.parametrize(
    "flt",
    [
        {"OR": [{"user_id": "bob"}, {"kind": "page"}]},
        {"NOT": [{"user_id": "bob"}]},
        {"AND": [{"OR": [{"user_id": "bob"}]}]},
    ],
)
def test_a_user_id_inside_or_or_not_says_where_it_goes(memory: Memory, flt: dict) -> None:
    _chat(memory, "bob", 1)
    with pytest.raises(ValueError, match="top level of filters or in a top-level AND"):
        memory.search("bees", filters=flt)


def test_http_search_takes_a_user_id_inside_and() -> None:
    pytest.importorskip("fastapi")
    from served import HA, hashing, serve

    with serve(hashing()) as c:
        body = {"messages": "I like tea.", "user_id": "bob"}
        assert c.post("/v1/mem0/memories", json=body, headers=HA).status_code == 200
        flt = {"AND": [{"user_id": "bob"}, {"kind": "page"}]}
        r = c.post("/v1/mem0/search", json={"query": "tea", "filters": flt}, headers=HA)
        assert r.status_code == 200, r.text
        assert [h["memory"] for h in r.json()["results"]] == ["User: I like tea."]
        flt = {"OR": [{"user_id": "bob"}]}
        r = c.post("/v1/mem0/search", json={"query": "tea", "filters": flt}, headers=HA)
        assert r.status_code == 422 and "top-level AND" in r.text


# ---------------------------------------------------------------------- finding 8: add's extras
def test_add_takes_mem0s_prompt_and_memory_type_only_as_none(memory: Memory) -> None:
    out = memory.add("I like tea.", user_id="fay", prompt=None, memory_type=None)
    assert [r["event"] for r in out["results"]] == ["ADD"]
    for extra in ({"prompt": "Extract facts."}, {"memory_type": "procedural_memory"}):
        with pytest.raises(ValueError, match="derives memories with its own stages"):
            memory.add("I like coffee.", user_id="fay", **extra)
    assert memory.get_all(user_id="fay")["count"] == 1


# ---------------------------------------------------------------------- finding 9: page sizes
def test_get_all_refuses_page_size_with_a_different_limit(memory: Memory) -> None:
    _chat(memory, "gil", 2)
    for extra in ({"limit": 2}, {"top_k": 2}):
        with pytest.raises(ValueError, match="give one of page_size, limit and top_k"):
            memory.get_all(user_id="gil", page_size=1, **extra)
    assert len(memory.get_all(user_id="gil", page_size=1, limit=1)["results"]) == 1
    assert len(memory.get_all(user_id="gil", limit=2)["results"]) == 2

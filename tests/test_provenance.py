"""Provenance and deletion that leaves nothing (issue 17, items 1 and 2), on both stores.

The scripted LLM here is the worst case for deletion: it copies a page's marker word into every
item it derives (chain meta, topic summary, keywords, profile value, user and assistant facts),
so a marker left anywhere -- a fact served to another user of the assistant, a segment summary,
the keyword statistics, the audit log, the file's free pages or its write-ahead log -- fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from store_backends import Backend

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm.base import ChatRequest
from memoryos_gpu.llm.scripted import ScriptedBackend
from memoryos_gpu.profile_dims import DIMENSION_KEYS

MARK = re.compile(r"zq[a-z]{6,}")


def echo(req: ChatRequest) -> Any:
    """Every derived item names the marker words of the pages it was derived from (of the new
    pages of a promotion: the known facts it is shown are what it decides against)."""
    text = req.messages[-1]["content"].split("New pages:")[-1]
    marks = sorted(set(MARK.findall(text))) or ["plain"]
    said = " ".join(marks)
    if req.stage == "page":
        return {
            "continuous": True,
            "meta": f"thread {said}",
            "summary": f"topic {said}",
            "keywords": marks,
        }
    if req.stage == "promotion":
        return {
            "profile_updates": {DIMENSION_KEYS[0]: f"High: said {said}"},
            "user_facts": [f"The user said {said}."],
            "assistant_facts": [f"The assistant heard {said}."],
        }
    return "ok"


def config(store: str, mode: str = "llm") -> EngineConfig:
    return EngineConfig(
        store=store,
        embedder="hashing",
        device="cpu",
        memory=preset("paper", stm_capacity=2, mtm_capacity=8, tau=100.0),
        llm=LLMConfig(mode=mode, backend="scripted"),
    )


def open_engine(store: str, mode: str = "llm") -> MemoryEngine:
    llm = ScriptedBackend(echo) if mode == "llm" else None
    return MemoryEngine(config(store, mode), llm=llm)


def talk(e: MemoryEngine, user: str, lines: list[str], t0: float = 1.7e9) -> list[int]:
    ids = [
        e.add(user, line, "I see.", timestamp=t0 + 60 * i).page_id for i, line in enumerate(lines)
    ]
    e.flush()
    e.promote(user)
    e.flush()
    return ids


def dumped(e: MemoryEngine, user: str) -> str:
    """Everything a user can see: export, knowledge history, a retrieval with sources."""
    r = e.retrieve_many([(user, "what did I say")], sources=True, update_heat=False)[0]
    return json.dumps([e.export_user(user), e.knowledge(user, history=True), r.to_dict()])


def store_holds(backend: Backend, spec: str, word: str) -> list[str]:
    """Where the store still holds ``word``: the SQLite file and its log, byte for byte; on
    PostgreSQL, any row of any table as text."""
    if backend.kind == "sqlite":
        return [
            f.name
            for f in (Path(spec), Path(f"{spec}-wal"))
            if f.exists() and word.encode() in f.read_bytes()
        ]
    db = backend.connect(spec)
    try:
        return [
            t
            for t in backend.tables(spec)
            if db.execute(
                f"SELECT COUNT(*) FROM {t} x WHERE strpos(x::text, ?) > 0", (word,)
            ).fetchone()[0]
        ]
    finally:
        db.close()


def test_delete_user_leaves_nothing(backend: Backend) -> None:
    spec = backend.spec("forget-user")
    e = open_engine(spec)
    talk(e, "other", ["I like tea.", "My garden is big.", "We walk daily.", "I read books."])
    talk(e, "victim", [f"I keep a zqsecretword {i} note." for i in range(6)])
    assert "zqsecretword" in dumped(e, "other")  # the shared assistant learned it
    assert store_holds(backend, spec, "zqsecretword")
    learned = {k["entry_id"] for k in e.knowledge("other")["assistant"]}
    assert e.delete_user("victim")
    assert e.store.rows_about("victim") == 0
    assert "zqsecretword" not in dumped(e, "other")
    gone = learned - {k["entry_id"] for k in e.knowledge("other")["assistant"]}
    deleted = {
        h["item_id"]
        for h in e.history("assistant:default")
        if (h["action"], h["item_kind"]) == ("delete", "knowledge")
    }
    assert gone and gone <= deleted  # the assistant's history says what went with the user
    assert "zqsecretword" not in e.extractor.df
    e.close()
    assert store_holds(backend, spec, "zqsecretword") == []
    e = open_engine(spec)
    try:
        assert "zqsecretword" not in dumped(e, "other")
        assert [h["action"] for h in e.history("victim")] == ["delete"]  # the event, no content
        assert "plain" in json.dumps(e.knowledge("other"))  # the other user's facts stay
    finally:
        e.close()


def test_store_only_delete_user_forgets_too(backend: Backend) -> None:
    """``memoryos-gpu delete`` deletes through the store alone (no engine): the assistant's
    facts from the user and the saved keyword statistics go too, and the next open refits the
    statistics from the pages left."""
    spec = backend.spec("forget-cli")
    e = open_engine(spec)
    talk(e, "other", ["I like tea.", "My garden is big.", "We walk daily.", "I read books."])
    talk(e, "victim", [f"I keep a zqstoreonly {i} note." for i in range(6)])
    e.close()
    st = backend.open(spec)
    try:
        assert st.get_meta("keyword_extractor") and "zqstoreonly" in st.get_meta(
            "keyword_extractor"
        )
        assert st.delete_user("victim") is not None
        assert st.rows_about("victim") == 0 and st.get_meta("keyword_extractor") is None
    finally:
        st.close()
    assert store_holds(backend, spec, "zqstoreonly") == []
    e = open_engine(spec)
    try:
        assert "zqstoreonly" not in e.extractor.df and e.extractor.n_docs > 0
        assert "zqstoreonly" not in dumped(e, "other")
    finally:
        e.close()


def test_delete_page_leaves_nothing(backend: Backend) -> None:
    spec = backend.spec("forget-page")
    e = open_engine(spec)
    lines = [
        "I like tea.",
        "I swim at dawn.",
        "I met zqpagemarker today.",
        "I read books.",
        "I cook pasta.",
        "I run on Sundays.",
        "I garden at night.",
        "I visit my aunt.",
    ]
    ids = talk(e, "alice", lines)
    talk(e, "bob", ["I fish.", "I sail.", "I knit.", "I sing."])
    victim = ids[2]
    assert e.get_page(victim)["tier"] == "mtm"
    assert "zqpagemarker" in dumped(e, "alice") and "zqpagemarker" in dumped(e, "bob")
    e.update_page(victim, agent_response="Nice, zqpagemarker again.")  # an audited edit
    assert e.delete_page(victim)
    e.flush()  # the re-analysis of the pages that shared its facts
    for user in ("alice", "bob"):
        assert "zqpagemarker" not in dumped(e, user), user
    alice = e.export_user("alice")
    assert all(victim not in s["sources"] for s in alice["segments"])
    assert all(s["summary"] for s in alice["segments"])  # re-derived, not emptied
    assert e.knowledge("alice")["user"]  # facts of the other pages came back
    e.close()
    assert store_holds(backend, spec, "zqpagemarker") == []
    e = open_engine(spec)
    try:
        assert "zqpagemarker" not in dumped(e, "alice") + dumped(e, "bob")
        assert [h for h in e.history("alice") if h["item_id"] == victim][-1]["detail"] == {}
    finally:
        e.close()


def test_provenance_is_recorded_and_shown(backend: Backend) -> None:
    e = open_engine(backend.spec("sources"))
    try:
        ids = talk(e, "ana", ["I play chess.", "I bake bread.", "I paint walls.", "I hike."])
        k = e.knowledge("ana")
        fact = k["user"][-1]
        assert fact["sources"] and set(fact["sources"]) <= set(ids)
        assert fact["source_user"] == "ana" and fact["valid_to"] is None
        assert k["assistant"][-1]["sources"] == fact["sources"]
        assert e.get_knowledge(fact["entry_id"])["sources"] == fact["sources"]
        data = e.export_user("ana")
        assert set(data["profile_sources"][DIMENSION_KEYS[0]]) <= set(ids)
        assert data["segments"] and all(set(s["sources"]) <= set(ids) for s in data["segments"])
        assert data["chains"] and all(c["sources"] for c in data["chains"])
        r = e.retrieve_many([("ana", "chess")], sources=True, update_heat=False)[0]
        assert r.user_knowledge and all(x.sources for x in r.user_knowledge)
        assert e.retrieve("ana", "chess").user_knowledge[0].sources is None
    finally:
        e.close()


def test_extractive_duplicates_merge_and_survive_one_deletion(backend: Backend) -> None:
    e = open_engine(backend.spec("dups"), mode="extractive")
    try:
        dog = "My dog Max comes along."
        said = [dog, "I paint on Mondays.", dog, dog, "I bake.", "I swim."]  # 4 reach MTM
        ids = talk(e, "kim", said)
        max_entries = [k for k in e.knowledge("kim")["user"] if "Max" in k["text"]]
        assert len(max_entries) == 1
        entry = max_entries[0]
        assert entry["strength"] == 3 and len(entry["sources"]) == 3
        e.delete_page(entry["sources"][0])
        e.flush()
        again = [k for k in e.knowledge("kim")["user"] if "Max" in k["text"]]
        assert len(again) == 1 and len(again[0]["sources"]) == 2
        assert set(again[0]["sources"]) < set(ids)
    finally:
        e.close()


def test_a_schema_2_store_migrates(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store written before provenance opens: entries keep their text, gain validity and
    (user entries) their source user, and the provenance table exists (both dialects)."""
    import memoryos_gpu.store.sqlite_schema as sq

    spec = backend.spec("v2")
    monkeypatch.setattr(sq, "SCHEMA_VERSION", 2)
    monkeypatch.setattr(
        sq,
        "REQUIRED_TABLES",
        sq.REQUIRED_TABLES - {"provenance", "chains", "page_vectors", "claims"},
    )
    st = backend.open(spec)
    assert st.schema_version == 2 and "provenance" not in st._table_names()
    with st.transaction() as db:
        st.ensure_users(db, [("u", "default")], 1.0)
    with st.transaction() as db:
        db.execute(
            "INSERT INTO knowledge(owner_kind, owner_id, seq, text, embedding, mode, created) "
            "VALUES ('user', 'u', 0, 'The user skis.', ?, 'llm', 5.0)",
            (b"\0" * 4,),
        )
    st.close()
    monkeypatch.undo()
    st = backend.open(spec)
    try:
        assert st.schema_version == sq.SCHEMA_VERSION and st.check_integrity() == []
        [row] = st.owner_knowledge("user", "u")
        assert row["text"] == "The user skis." and row["valid_from"] == 5.0
        assert row["source_user"] == "u" and row["sources"] == [] and row["strength"] == 1
    finally:
        st.close()


def test_a_schema_3_store_migrates_provenance_keyed_by_user(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 -> 4: provenance rows are kept, and one page id of two users (two shards' files
    number their pages alike) is two sources of the same item."""
    import memoryos_gpu.store.sqlite_schema as sq

    spec = backend.spec("v3")
    monkeypatch.setattr(sq, "SCHEMA_VERSION", 3)
    monkeypatch.setattr(
        sq, "REQUIRED_TABLES", sq.REQUIRED_TABLES - {"chains", "page_vectors", "claims"}
    )
    st = backend.open(spec)
    row = "INSERT INTO provenance(item_kind, item_id, item_key, page_id, user_id) VALUES "
    with st.transaction() as db:
        db.execute(row + "('knowledge', 1, '', 7, 'ann')")
        db.execute(row + "('knowledge', 1, '', 7, 'bo') ON CONFLICT DO NOTHING")
    assert st.query("SELECT COUNT(*) FROM provenance")[0][0] == 1  # the old key: one row
    st.close()
    monkeypatch.undo()
    st = backend.open(spec)
    try:
        assert st.schema_version == sq.SCHEMA_VERSION and st.check_integrity() == []
        with st.transaction() as db:
            db.execute(row + "('knowledge', 1, '', 7, 'bo')")
        got = st.query("SELECT user_id FROM provenance WHERE page_id = 7 ORDER BY user_id")
        assert [r[0] for r in got] == ["ann", "bo"]
    finally:
        st.close()


def test_http_knowledge_entry_shows_its_sources() -> None:
    from served import HA, HB, hashing, serve

    with serve(hashing()) as c:
        pages = [
            c.post(
                "/v1/users/alice/pages",
                json={"user_input": f"I love hiking in the Alps {i}.", "timestamp": 100.0 + i},
                headers=HA,
            ).json()["page_id"]
            for i in range(14)
        ]
        c.post("/v1/users/alice/wait", headers=HA)
        entries = c.get("/v1/users/alice/knowledge", headers=HA).json()["user"]
        assert entries and all(set(e["sources"]) <= set(pages) for e in entries)
        eid = entries[0]["entry_id"]
        r = c.get(f"/v1/users/alice/knowledge/{eid}", headers=HA)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["sources"] == entries[0]["sources"] and got["owner_id"] == "alice"
        assert got["live"] and got["strength"] >= 1 and got["valid_to"] is None
        # another tenant's entry: not found (a 403 confirmed the id), as PATCH and DELETE
        r = c.get(f"/v1/users/alice/knowledge/{eid}", headers=HB)
        assert (
            r.status_code == 404
            and r.json()["detail"] == f"user 'alice' has no knowledge entry {eid}"
        )
        assert (
            c.patch(f"/v1/users/x/knowledge/{eid}", json={"text": "y"}, headers=HB).status_code
            == 404
        )
        assert c.delete(f"/v1/users/x/knowledge/{eid}", headers=HB).status_code == 404
        assert c.get("/v1/users/alice/knowledge/424242", headers=HA).status_code == 404
        q = {"query": "hiking in the Alps", "sources": True}
        r = c.post("/v1/users/alice/retrieve", json=q, headers=HA).json()
        assert r["user_knowledge"] and all(k["sources"] for k in r["user_knowledge"])
        r = c.post("/v1/users/alice/retrieve", json={"query": "Alps"}, headers=HA).json()
        assert all(k["sources"] is None for k in r["user_knowledge"])
        hist = c.get("/v1/users/alice/knowledge?history=true", headers=HA).json()["user"]
        assert len(hist) >= len(entries)


def test_a_shared_fact_outlives_one_of_its_users(backend: Backend) -> None:
    """An assistant fact both users' pages support (merged into one entry) is removed with the
    deleted user's pages and derived again from the other user's."""
    e = open_engine(backend.spec("shared-fact"))
    try:
        mine = talk(e, "keep", ["I like tea.", "I swim.", "I read.", "I cook."])
        talk(e, "gone", ["I knit.", "I sail.", "I fish.", "I sing."])
        [fact] = [k for k in e.knowledge("keep")["assistant"] if "plain" in k["text"]]
        assert fact["strength"] >= 2 and not set(fact["sources"]) <= set(mine)
        e.delete_user("gone")
        e.flush()
        [again] = [k for k in e.knowledge("keep")["assistant"] if "plain" in k["text"]]
        assert again["sources"] and set(again["sources"]) <= set(mine)
        assert again["source_user"] == "keep"
    finally:
        e.close()


def served_facts(e: MemoryEngine, user: str, query: str) -> str:
    """What a user is served of facts and profile: live knowledge (theirs and the assistant's),
    the profile, and a retrieval's knowledge."""
    r = e.retrieve_many([(user, query)], update_heat=False)[0]
    said = [k.text for k in (*r.user_knowledge, *r.assistant_knowledge)]
    return json.dumps([e.knowledge(user), e.profile(user), said])


def test_editing_a_page_rederives_what_it_implied(backend: Backend) -> None:
    """LLM mode: the facts and profile value its old text implied are no longer served (to
    the user, or to another user of the assistant); those of its new text are, after the
    re-analysis; its segment summary holds the new text, not the old."""
    e = open_engine(backend.spec("edit-llm"))
    try:
        ids = talk(e, "alice", ["I like tea.", "I met zqoldmarker today.", "I read.", "I cook."])
        talk(e, "bob", ["I fish.", "I sail.", "I knit.", "I sing."])
        edited = ids[1]
        assert e.get_page(edited)["analysed"]
        assert "zqoldmarker" in served_facts(e, "alice", "who did I meet")
        assert "zqoldmarker" in served_facts(e, "bob", "who did they meet")
        e.update_page(edited, user_input="I met zqnewmarker today.")
        e.flush()  # the re-analysis of the page and of the pages behind the same facts
        for user in ("alice", "bob"):
            got = served_facts(e, user, "who did I meet")
            assert "zqoldmarker" not in got and "zqnewmarker" in got, user
        segments = json.dumps(e.export_user("alice")["segments"])
        assert "zqoldmarker" not in segments and "zqnewmarker" in segments
        assert e.get_page(edited)["analysed"]
    finally:
        e.close()


def test_editing_a_page_rederives_an_extractive_fact(backend: Backend) -> None:
    e = open_engine(backend.spec("edit-extractive"), mode="extractive")
    try:
        ids = talk(e, "cy", ["I live in Seattle.", "I paint on Mondays.", "I bake.", "I swim."])
        assert "I live in Seattle." in [k["text"] for k in e.knowledge("cy")["user"]]
        e.update_page(ids[0], user_input="I live in Denver.")
        e.flush()
        texts = [k["text"] for k in e.knowledge("cy", history=True)["user"]]
        assert "I live in Denver." in texts and "I live in Seattle." not in texts
        assert "I paint on Mondays." in texts  # the other pages' facts are untouched
        [denver] = [k for k in e.knowledge("cy")["user"] if k["text"] == "I live in Denver."]
        assert denver["sources"] == [ids[0]]
        said = [k.text for k in e.retrieve("cy", "Where do I live?").user_knowledge]
        assert "I live in Denver." in said and "I live in Seattle." not in said
    finally:
        e.close()


def test_a_statement_on_several_pages_names_them_all(backend: Backend) -> None:
    """A sentence said on several promoted pages is one fact whose sources are every one of
    them, even past the promotion's fact cap in repetitions: editing the pages it names leaves
    no page behind that still says it, analysed, with nothing derived from it."""
    e = open_engine(backend.spec("repeated-statement"), mode="extractive")
    try:
        lines = ["I keep bees on the roof.", "I play the cello.", "I grow tomatoes."] * 3
        ids = talk(e, "dee", lines)
        [bees] = [k for k in e.knowledge("dee")["user"] if "bees" in k["text"]]
        said_bees = [
            p
            for p, line in zip(ids, lines, strict=True)
            if "bees" in line and e.get_page(p)["analysed"]
        ]
        assert len(said_bees) > 1 and sorted(bees["sources"]) == sorted(said_bees)
        for p in bees["sources"]:
            e.update_page(p, user_input="I breed snails in the cellar.")
        e.flush()
        texts = [k["text"] for k in e.knowledge("dee")["user"]]
        assert not any("bees" in t for t in texts) and any("snails" in t for t in texts)
    finally:
        e.close()


def test_http_page_edit_rederives_its_facts() -> None:
    """PATCH of a page's text: after /wait the fact from its old text is gone, the new one is
    served (the server's derived-work thread runs the re-analysis). The derived work gathers
    until /wait asks for it (a long ``derived_max_wait_ms``: the bound, 60 s), so the pages
    are analysed in one round: a round that ran halfway through the writes would promote the
    segment before its last "bees" page joined it, and that page, analysed only at the
    re-analysis, would rightly say "bees" again after the entry's sources were edited."""
    from served import HA, hashing, serve

    with serve(hashing(), derived_max_wait_ms=60_000) as c:
        lines = ["I keep bees on the roof.", "I play the cello.", "I grow tomatoes."] * 5
        pages = [
            c.post(
                "/v1/users/alice/pages",
                json={"user_input": line, "timestamp": 100.0 + i},
                headers=HA,
            ).json()["page_id"]
            for i, line in enumerate(lines)
        ]
        c.post("/v1/users/alice/wait", headers=HA)
        entries = c.get("/v1/users/alice/knowledge", headers=HA).json()["user"]
        [bees] = [k for k in entries if "bees" in k["text"]]
        for p in bees["sources"]:
            r = c.patch(
                f"/v1/users/alice/pages/{p}",
                json={"user_input": "I breed zqnewsnails in the cellar."},
                headers=HA,
            )
            assert r.status_code == 200, r.text
        assert set(bees["sources"]) <= set(pages)
        assert c.post("/v1/users/alice/wait", headers=HA).json()["done"]
        texts = [k["text"] for k in c.get("/v1/users/alice/knowledge", headers=HA).json()["user"]]
        assert not any("bees" in t for t in texts)
        assert any("zqnewsnails" in t for t in texts)

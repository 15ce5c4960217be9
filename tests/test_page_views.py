"""The in-memory views retrievals are assembled from: through random adds, edits, deletes,
chain meta rewrites, promotions, knowledge edits and user deletion, every retrieval shows what
the store holds, never reads the store, and a reopened engine shows the same."""

from __future__ import annotations

import random

import pytest

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm.scripted import ScriptedBackend


def _engine(kit, store: str) -> MemoryEngine:
    # every page after a user's first continues the chain: its meta is rewritten for the
    # whole chain on each new page, the case the views must not show stale
    pages = {f"u{u} p{i}": {"continuous": i % 4 != 0} for u in range(3) for i in range(40)}
    facts = {"user_facts": ["User likes tea.", "User has a cat."], "assistant_facts": ["A."]}
    cfg = EngineConfig(
        memory=preset("paper", stm_capacity=3, mtm_capacity=4, tau=1.5, relevance_floor=-1.0),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
        store=store,
    )
    return MemoryEngine(
        cfg,
        embedder=kit.TableEmbedder(),
        llm=ScriptedBackend(kit.Script(pages=pages, promotion=facts)),
    )


def _check_against_store(eng: MemoryEngine, r) -> None:
    """Everything ``r`` shows is the store's current row."""
    rows = eng.store.page_rows([p.page_id for p in r.all_pages()])
    for p in r.all_pages():
        row = rows[p.page_id]
        assert (p.user_input, p.agent_response, p.timestamp) == (
            row["user_input"],
            row["agent_response"],
            row["timestamp"],
        )
        assert p.meta == row["meta"] and p.extra == row["extra"]
        assert row["tier"] == ("stm" if p.tier == "stm" else "mtm")
    entries = [*r.user_knowledge, *r.assistant_knowledge]
    krows = eng.store.knowledge_rows([e.entry_id for e in entries])
    assert all(krows[e.entry_id]["text"] == e.text and krows[e.entry_id]["live"] for e in entries)
    assert r.profile == eng.store.user_row(r.user_id)["profile"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retrievals_show_the_store_and_never_read_it(seed: int, kit, tmp_path) -> None:
    rng = random.Random(seed)
    path = str(tmp_path / "views.sqlite3")
    eng = _engine(kit, path)
    users = ["u0", "u1", "u2"]
    added = {u: 0 for u in users}
    pages: dict[str, list[int]] = {u: [] for u in users}
    for step in range(60):
        u = rng.choice(users)
        action = rng.random()
        if action < 0.45 or not pages[u]:
            ui = f"{u} p{added[u]}"
            added[u] += 1
            meta = {"mood": rng.choice(["calm", "busy"])} if rng.random() < 0.5 else {}
            pages[u].append(eng.add(u, ui, f"r {ui}", timestamp=step, meta=meta).page_id)
        elif action < 0.6:
            eng.update_page(rng.choice(pages[u]), agent_response=f"edited {step}")
        elif action < 0.7:
            eng.delete_page(pages[u].pop(rng.randrange(len(pages[u]))))
        elif action < 0.8:
            entries = [e["entry_id"] for e in eng.knowledge(u)["user"]]
            if entries and rng.random() < 0.5:
                eng.update_knowledge(rng.choice(entries), f"fact {step}")
            elif entries:
                eng.delete_knowledge(rng.choice(entries))
        elif action < 0.83:
            eng.delete_user(u)
            pages[u] = []
        for v in users:  # retrievals heat segments, so promotions (knowledge) follow
            if pages[v]:
                _check_against_store(eng, eng.retrieve(v, f"{v} p{rng.randrange(40)}"))
    stats = eng.stats()
    assert stats["counters"]["promotions"] > 0 and stats["views"]["knowledge"] > 0
    assert stats["views"]["store_reads"] == 0
    # a chain's meta is held once, while a page of the chain is in MTM (none left behind)
    in_mtm = eng.store.query("SELECT DISTINCT chain_id FROM pages WHERE tier = 'mtm'")
    assert stats["views"]["chains"] == len(in_mtm) > 0
    live = [(v, f"{v} p1") for v in users if pages[v]]
    before = [r.to_dict() for r in eng.retrieve_many(live, update_heat=False)]
    eng.close()
    again = _engine(kit, path)
    try:
        assert [r.to_dict() for r in again.retrieve_many(live, update_heat=False)] == before
        assert again.stats()["views"]["store_reads"] == 0
    finally:
        again.close()


def test_read_only_extra_survives_pickling_read_only() -> None:
    """A retrieval crosses the channel to the HTTP workers pickled: a page's read-only
    metadata arrives equal and still read-only."""
    import pickle

    from memoryos_gpu.types import ReadOnlyDict, RetrievedPage

    page = RetrievedPage(1, "hi", "", 0.0, "stm", extra=ReadOnlyDict({"speaker_a": "Ann"}))
    back = pickle.loads(pickle.dumps(page, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == page and type(back.extra) is ReadOnlyDict
    with pytest.raises(TypeError, match="read-only"):
        back.extra["speaker_a"] = "Bob"

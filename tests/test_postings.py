"""BM25 postings of long histories through the engine: whatever the engine does to a user's
pages (segments evicted, pages deleted or edited, the store reopened), a user scored from its
postings gets exactly what scanning its pages' term rows gives. The kernel-level properties
are in ``tests/test_retrieval_kernel.py``."""

from __future__ import annotations

import functools
import random

import pytest

import memoryos_gpu.engine.facade as facade
from memoryos_gpu.arena import ArenaConfig
from memoryos_gpu.types import PageInput

WORDS = [
    "marathon",
    "shoes",
    "zanzibar",
    "violin",
    "painting",
    "garden",
    "puppy",
    "camping",
    "museum",
    "recipe",
]
QUERIES = [
    "When did we talk about the marathon?",
    "What did Caroline say about zanzibar and the violin?",
    "Melanie garden puppy",
    "recipe museum painting camping shoes",
]


@pytest.fixture
def postings_from_three_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines of this test give postings to every user with 3 indexed pages."""
    monkeypatch.setattr(facade, "ArenaConfig", functools.partial(ArenaConfig, postings_min_pages=3))


def _pages(user: str, n: int, seed: int) -> list[PageInput]:
    rng = random.Random(seed)
    return [
        PageInput(
            user_id=user,
            user_input=f"Caroline: day {i} was about {rng.choice(WORDS)} and {rng.choice(WORDS)}",
            agent_response=f"Melanie: the {rng.choice(WORDS)} sounds {rng.choice(WORDS)}",
            timestamp=1_700_000_000.0 + 3600.0 * i,
        )
        for i in range(n)
    ]


def _same_either_way(eng) -> list:
    """Retrieve for both users with the postings, then scanning the rows: identical."""
    lex = eng.arena.lexical
    queries = [(u, q) for u in ("a", "b") for q in QUERIES]
    got = eng.retrieve_many(queries, update_heat=False)
    postings, lex.postings = lex.postings, None
    try:
        scanned = eng.retrieve_many(queries, update_heat=False)
    finally:
        lex.postings = postings

    def ranked(rs):
        return [[(p.page_id, p.score) for p in r.pages] for r in rs]

    assert ranked(got) == ranked(scanned)
    assert any(r.pages for r in got)
    return got


def test_postings_match_the_scan_through_the_engines_mechanics(
    make_engine, kit, tmp_path, postings_from_three_pages
) -> None:
    if kit.device != "cpu":
        pytest.skip("postings are the CPU arena's index (the CUDA pass scans the rows)")
    store = str(tmp_path / "memory.db")
    kw = {"mode": "extractive", "store": store, "stm_capacity": 2, "mtm_capacity": 4}
    eng = make_engine(**kw)
    eng.add_many(_pages("a", 40, 1) + _pages("b", 12, 2))
    eng.process_pending()
    slots = [eng._state.users[u].slot for u in ("a", "b")]
    assert all(eng.arena.lexical.postings.has(s) for s in slots)
    assert eng.stats()["counters"]["segments_created"] > 4  # segments were evicted
    first = _same_either_way(eng)

    page = first[0].pages[0].page_id  # the best page of a's first query: edited, then gone
    eng.update_page(page, agent_response="Melanie: only the marathon, the marathon again")
    _same_either_way(eng)
    assert eng.delete_page(page)
    for r in first[1:3]:
        for p in r.pages[:2]:
            eng.delete_page(p.page_id)
    _same_either_way(eng)
    eng.close()

    reopened = make_engine(**kw)  # the postings are rebuilt as the rows load
    assert reopened.arena.lexical.postings.has(reopened._state.users["a"].slot)
    _same_either_way(reopened)

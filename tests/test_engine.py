"""Deterministic tests of the MemoryOS mechanics of :class:`MemoryEngine`.

The LLM is a :class:`ScriptedBackend` whose answers the tests choose (continuity, chain meta,
topic summaries, keywords, promoted facts), and the embedder maps chosen texts to chosen
vectors (``kit.TableEmbedder``), so every decision of the engine is known in advance. The
logical clock is the pages' own timestamps unless a test says otherwise.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from memoryos_gpu import ops
from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import InvalidInputError, MemoryEngine
from memoryos_gpu.engine.derived import FULL_WAVE_SHARE, full_waves
from memoryos_gpu.engine.state import to_host
from memoryos_gpu.text.keywords import hash_keywords, keyword_tokens
from memoryos_gpu.types import PageInput

# ---------------------------------------------------------------------------- helpers


def unit(dim_index: int, dim: int = 8) -> list[float]:
    v = [0.0] * dim
    v[dim_index] = 1.0
    return v


def add_pages(eng, user, inputs, *, t0=1.0, step=1.0, response="r"):
    """Add one page per input, one ``add`` call each, timestamps t0, t0+step, ..."""
    return [
        eng.add(user, ui, f"{response} {ui}", timestamp=t0 + i * step).page_id
        for i, ui in enumerate(inputs)
    ]


def peek(eng, user, query):
    """A retrieval that leaves heat alone."""
    return eng.retrieve_many([(user, query)], update_heat=False)[0]


def page(eng, pid):
    row = eng.get_page(pid)
    assert row is not None, f"page {pid} is missing"
    return row


def segment_stats(eng, user):
    """{segment_id: row} of the user's live segments (from the store)."""
    return {s["segment_id"]: s for s in eng.export_user(user)["segments"]}


def keyword_row(eng, keywords):
    """The arena's hashed keyword row of an LLM keyword list."""
    row = np.full((1, eng.memory.keyword_width), -1, np.int32)
    ids = hash_keywords(keyword_tokens(keywords))
    row[0, : ids.size] = ids
    return row


def arena_slot(eng, user, segment_id):
    u = eng._users[user]
    return u.slot, int(np.flatnonzero(eng._segment_of[u.slot] == segment_id)[0])


def arena_stat(eng, name, user, segment_id):
    us, ss = arena_slot(eng, user, segment_id)
    return eng.arena.host(name)[us, ss]


# ---------------------------------------------------------------------------- STM


def test_stm_overflow_keeps_newest_and_moves_oldest_to_mtm_in_order(make_engine):
    eng = make_engine(stm_capacity=3, relevance_floor=-1.0)  # every page is a candidate
    ids = add_pages(eng, "u", ["p1", "p2", "p3", "p4", "p5"])
    r = eng.retrieve("u", "anything", top_pages=10)
    assert [p.user_input for p in r.stm] == ["p3", "p4", "p5"]
    assert all(p.tier == "stm" for p in r.stm)
    mtm = eng.store.user_pages("u", "mtm")
    assert [p["user_input"] for p in mtm] == ["p1", "p2"]  # ordered by seq
    assert [p["page_id"] for p in mtm] == ids[:2]
    # p1 was processed before p2: p2's "previous page" in the page prompt is p1
    reqs = [q for q in eng.llm.requests if q.stage == "page"]
    assert len(reqs) == 2
    assert "User: p1" in reqs[0].messages[-1]["content"].split("CURRENT page:")[1]
    assert "User: p1" in reqs[1].messages[-1]["content"].split("CURRENT page:")[0]
    assert {p.user_input for p in r.pages} == {"p1", "p2"}
    assert eng.pending_count() == 0


def test_one_add_many_overflowing_stm_by_several_pages(make_engine):
    eng = make_engine(stm_capacity=2)
    eng.add_many([PageInput("u", f"p{i}", "r", float(i)) for i in range(1, 7)])
    assert [p["user_input"] for p in eng.store.user_pages("u", "stm")] == ["p5", "p6"]
    assert [p["user_input"] for p in eng.store.user_pages("u", "mtm")] == ["p1", "p2", "p3", "p4"]


# ---------------------------------------------------------------------------- never drop


def test_never_drop_empty_duplicate_and_very_long_pages(make_engine):
    eng = make_engine(stm_capacity=2)
    long_text = ("lorem ipsum dolor sit amet " * 8000)[:200_000]
    assert len(long_text) == 200_000
    inputs = [
        ("hello", ""),  # empty response (the reference used to drop these)
        ("same question", "same answer"),
        ("same question", "same answer"),  # exact duplicate, no source key
        ("same question", "same answer"),
        (long_text, long_text),
        ("", ""),  # entirely empty page
        ("last", "one"),
        ("tail", ""),
    ]
    ids = [eng.add("u", q, a, timestamp=float(i)).page_id for i, (q, a) in enumerate(inputs)]
    assert len(set(ids)) == len(inputs)
    counts = eng.stats()["store"]
    assert sum(v for k, v in counts.items() if k.startswith("pages_")) == len(inputs)
    assert counts["pages_mtm"] == len(inputs) - 2 and counts["pages_stm"] == 2
    assert len(eng.export_user("u")["pages"]) == len(inputs)
    for pid, (q, a) in zip(ids, inputs, strict=True):
        row = page(eng, pid)
        assert (row["user_input"], row["agent_response"]) == (q, a)
    big = page(eng, ids[4])
    assert len(big["user_input"]) == 200_000 and len(big["agent_response"]) == 200_000
    assert big["tier"] == "mtm"


def test_source_key_is_idempotent_but_identical_text_is_not(make_engine):
    eng = make_engine()
    a = eng.add("u", "q", "a", timestamp=1.0, source="log:1")
    b = eng.add("u", "q", "a", timestamp=1.0, source="log:1")
    c = eng.add("u", "q", "a", timestamp=1.0)
    assert b.duplicate and b.page_id == a.page_id
    assert not c.duplicate and c.page_id != a.page_id
    assert len(eng.export_user("u")["pages"]) == 2


# ---------------------------------------------------------------------------- chain


def test_chain_links_and_meta_regeneration(make_engine, kit):
    script = kit.Script(
        pages={
            "p1": {"continuous": False, "meta": "meta-A1"},
            "p2": {"continuous": True, "meta": "meta-A2"},
            "p3": {"continuous": True, "meta": "meta-A3"},
            "p4": {"continuous": False, "meta": "meta-B1"},
        }
    )
    eng = make_engine(stm_capacity=1, script=script)
    p1, p2, p3, p4, _p5 = add_pages(eng, "u", ["p1", "p2", "p3", "p4", "p5"])
    r1, r2, r3, r4 = (page(eng, p) for p in (p1, p2, p3, p4))
    assert (r1["prev_page"], r1["next_page"]) == (None, p2)
    assert (r2["prev_page"], r2["next_page"]) == (p1, p3)
    assert (r3["prev_page"], r3["next_page"]) == (p2, None)
    # every page of the chain carries the newest meta
    assert r1["meta"] == r2["meta"] == r3["meta"] == "meta-A3"
    # continuity false: a new chain, no link, its own meta; the old chain is untouched
    assert (r4["prev_page"], r4["next_page"]) == (None, None)
    assert r4["meta"] == "meta-B1"
    # the page prompt carried the previous page and its chain meta
    req = [q for q in eng.llm.requests if q.stage == "page"][2]  # p3's
    content = req.messages[-1]["content"]
    assert "User: p2" in content and "meta-A2" in content


def test_first_page_cannot_continue_a_chain(make_engine, kit):
    script = kit.Script(pages={"p1": {"continuous": True, "meta": "m1"}})
    eng = make_engine(stm_capacity=1, script=script)
    p1, _ = add_pages(eng, "u", ["p1", "p2"])
    assert page(eng, p1)["prev_page"] is None and page(eng, p1)["meta"] == "m1"


def test_chain_continues_across_segments(make_engine, kit):
    """Chain (topic continuity) and segment (topic similarity) are independent structures."""
    emb = kit.TableEmbedder(table={"sum p1": unit(0), "sum p2": unit(1)})
    script = kit.Script(pages={"p2": {"continuous": True, "meta": "m2"}})
    eng = make_engine(stm_capacity=1, script=script, embedder=emb)
    p1, p2, _ = add_pages(eng, "u", ["p1", "p2", "p3"])
    r1, r2 = page(eng, p1), page(eng, p2)
    assert r1["segment_id"] != r2["segment_id"]
    assert r2["prev_page"] == p1 and r1["next_page"] == p2
    assert r1["meta"] == r2["meta"] == "m2"


# ---------------------------------------------------------------------------- theta

THETA_CASES = [
    # (page-2 summary vector vs segment [1,0,0,0], page-2 keywords vs the segment's
    #  {alpha, bravo}, F = cos + Jaccard, joins?).
    pytest.param([3.0, 4.0, 0.0, 0.0], ["zed"], 0.6, True, id="cos=3/5,J=0"),
    pytest.param(
        [0.5999, math.sqrt(1 - 0.5999**2), 0.0, 0.0], ["zed"], 0.5999, False, id="cos=.5999,J=0"
    ),
    pytest.param(
        [0.60001, math.sqrt(1 - 0.60001**2), 0.0, 0.0], ["zed"], 0.60001, True, id="cos=.60001"
    ),
    pytest.param(
        [1.0, 7.0, 7.0, 1.0],
        ["alpha"],
        0.6,
        True,
        id="cos=1/10,J=1/2",
    ),
    pytest.param(
        [0.0999, math.sqrt(1 - 0.0999**2), 0.0, 0.0],
        ["alpha"],
        0.5999,
        False,
        id="cos=.0999,J=1/2",
    ),
]


@pytest.mark.parametrize(("vec", "keywords", "score", "joins"), THETA_CASES)
def test_theta_boundary_insert_or_new_segment(make_engine, kit, vec, keywords, score, joins):
    """F = cos(e_s, e_p) + Jaccard(K_s, K_p) >= theta = 0.6 joins the best segment.

    cos = 3/5 and cos = 1/10 (|[1,7,7,1]| = 10) are exact up to the final correctly rounded
    fp32 division, so F is the fp32 value nearest to 0.6 (0.6000000238): the closest the fp32
    kernels can get to "exactly theta", and it must join. 0.5999 must not.
    """
    emb = kit.TableEmbedder(table={"sum p1": [1.0, 0.0, 0.0, 0.0], "sum p2": vec})
    script = kit.Script(
        pages={"p1": {"keywords": ["alpha", "bravo"]}, "p2": {"keywords": keywords}}
    )
    eng = make_engine(stm_capacity=1, script=script, embedder=emb)
    assert eng.memory.theta == 0.6
    # the kernel's score of page 2's summary against segment 1 is the intended F
    p1, p2 = add_pages(eng, "u", ["p1", "p2"])
    us = eng._users["u"].slot
    got, _ = ops.match_segments(
        eng.arena, np.asarray([emb.vector("sum p2")]), [us], keyword_row(eng, keywords)
    )
    f = float(to_host(got)[0])
    assert f == pytest.approx(score, abs=2e-7)
    assert (f >= 0.6) == joins
    eng.add("u", "p3", "r", timestamp=3.0)  # evicts p2 into MTM
    s1, s2 = page(eng, p1)["segment_id"], page(eng, p2)["segment_id"]
    segs = segment_stats(eng, "u")
    if joins:
        assert s1 == s2 and len(segs) == 1
        assert segs[s1]["n_pages"] == 2 and segs[s1]["l_interaction"] == 2
    else:
        assert s1 != s2 and len(segs) == 2


def test_theta_is_a_setting(make_engine, kit):
    emb = kit.TableEmbedder(table={"sum p1": unit(0), "sum p2": [0.5, math.sqrt(0.75)]})
    eng = make_engine(stm_capacity=1, theta=0.5, embedder=emb)
    p1, p2, _ = add_pages(eng, "u", ["p1", "p2", "p3"])
    assert page(eng, p1)["segment_id"] == page(eng, p2)["segment_id"]


def test_keywords_are_matched_as_whole_words(make_engine, kit):
    """Orthogonal summaries, keywords {kwp1} vs {kwp2}: F = 0 + 0, a new segment. (A former
    bug split keyword strings into letters: {k,w,p,1} vs {k,w,p,2} gave J = 3/5 and a join.)"""
    emb = kit.TableEmbedder(table={"sum p1": unit(0), "sum p2": unit(1)})
    script = kit.Script(pages={"p1": {"keywords": ["kwp1"]}, "p2": {"keywords": ["kwp2"]}})
    eng = make_engine(stm_capacity=1, script=script, embedder=emb)
    p1, p2, _ = add_pages(eng, "u", ["p1", "p2", "p3"])
    assert page(eng, p1)["segment_id"] != page(eng, p2)["segment_id"]


def test_shared_keywords_lift_a_weak_cosine_over_theta(make_engine, kit):
    """Jaccard counts: cos 0.35 alone stays below theta; identical keyword sets (J = 1) join."""
    emb = kit.TableEmbedder(table={"sum p1": unit(0), "sum p2": [0.35, math.sqrt(1 - 0.35**2)]})
    script = kit.Script(
        pages={"p1": {"keywords": ["garden", "tomato"]}, "p2": {"keywords": ["tomato", "garden"]}}
    )
    eng = make_engine(stm_capacity=1, script=script, embedder=emb)
    p1, p2, _ = add_pages(eng, "u", ["p1", "p2", "p3"])
    seg = page(eng, p1)["segment_id"]
    assert page(eng, p2)["segment_id"] == seg
    assert segment_stats(eng, "u")[seg]["keywords"] == {"garden": 2, "tomato": 2}


# ---------------------------------------------------------------------------- heat


def test_heat_formula_values(make_engine, kit):
    """Heat = alpha*N_visit + beta*L_interaction + gamma*exp(-dt/mu) on the logical clock."""
    alpha, beta, gamma, mu = 0.5, 2.0, 3.0, 100.0
    emb = kit.TableEmbedder(
        table={"sum p1": unit(0), "sum p2": unit(0), "sum p3": unit(1), "query a": unit(0)}
    )
    eng = make_engine(
        stm_capacity=1,
        alpha=alpha,
        beta=beta,
        gamma=gamma,
        mu_seconds=mu,
        tau=1e9,
        embedder=emb,
        relevance_floor=-1.0,  # the pages' own vectors are random: serve them anyway
    )
    p1, p2 = add_pages(eng, "u", ["p1", "p2"], t0=10.0, step=10.0)
    seg_a = page(eng, p1)["segment_id"]
    # p1 entered MTM when p2 (t=20) arrived: the segment's last access is the user clock, 20
    assert segment_stats(eng, "u")[seg_a]["last_access"] == 20.0
    assert arena_stat(eng, "heat", "u", seg_a) == pytest.approx(beta * 1 + gamma)
    p3 = eng.add("u", "p3", "r", timestamp=30.0).page_id  # p2 joins segment A
    assert page(eng, p2)["segment_id"] == seg_a
    r = eng.retrieve("u", "query a", top_segments=1)  # one visit, at the clock (30)
    assert {p.page_id for p in r.pages} == {p1, p2}
    assert arena_stat(eng, "heat", "u", seg_a) == pytest.approx(alpha * 1 + beta * 2 + gamma)
    eng.add("u", "p4", "r", timestamp=75.0)  # p3 opens segment B at t=75
    seg_b = page(eng, p3)["segment_id"]
    assert seg_b != seg_a
    segs = segment_stats(eng, "u")
    a, b = segs[seg_a], segs[seg_b]
    assert (a["n_visit"], a["l_interaction"], a["last_access"]) == (1, 2, 30.0)
    assert (b["n_visit"], b["l_interaction"], b["last_access"]) == (0, 1, 75.0)
    want_a = alpha * 1 + beta * 2 + gamma * math.exp(-(75.0 - 30.0) / mu)
    want_b = alpha * 0 + beta * 1 + gamma * math.exp(0.0)
    assert arena_stat(eng, "heat", "u", seg_a) == pytest.approx(want_a, rel=1e-6)
    assert arena_stat(eng, "heat", "u", seg_b) == pytest.approx(want_b, rel=1e-6)
    # the arena's statistics match the store's
    for sid, row in segs.items():
        assert arena_stat(eng, "n_visit", "u", sid) == row["n_visit"]
        assert arena_stat(eng, "l_interaction", "u", sid) == row["l_interaction"]
        assert arena_stat(eng, "last_access", "u", sid) == row["last_access"]


def test_a_join_keeps_a_visit_credited_while_its_round_ran(make_engine, kit):
    """A retrieval that credits a segment while a derived round's stages run (without the
    engine lock) is not rolled back when the round's page joins that segment: the join takes
    the heat statistics from the arena, where the store's wait for the write-behind."""
    emb = kit.TableEmbedder(table={"sum p1": unit(0), "sum p2": unit(0), "query a": unit(0)})
    eng = make_engine(stm_capacity=1, tau=1e9, embedder=emb, relevance_floor=-1.0)
    p1, p2 = add_pages(eng, "u", ["p1", "p2"], t0=10.0, step=10.0)
    seg_a = page(eng, p1)["segment_id"]
    run_stages = eng.stages.pages

    def during(work):
        eng.retrieve("u", "query a", top_segments=1, at=500.0)
        return run_stages(work)

    eng.stages.pages = during
    eng.add("u", "p3", "r", timestamp=30.0)  # p2 leaves STM and joins segment A
    assert page(eng, p2)["segment_id"] == seg_a
    assert arena_stat(eng, "last_access", "u", seg_a) == 500.0
    assert arena_stat(eng, "l_interaction", "u", seg_a) == 2
    eng.flush()  # the write-behind takes the arena's values to the store
    row = segment_stats(eng, "u")[seg_a]
    assert (row["last_access"], row["n_visit"], row["l_interaction"]) == (500.0, 1, 2)


def test_retrieval_counts_a_visit_and_refreshes_recency(make_engine, kit):
    emb = kit.TableEmbedder(
        table={"sum p1": unit(0), "sum p2": unit(1), "query a": unit(0), "query b": unit(1)}
    )
    eng = make_engine(stm_capacity=1, tau=1e9, embedder=emb, relevance_floor=-1.0)
    p1, p2, _ = add_pages(eng, "u", ["p1", "p2", "p3"], t0=100.0, step=100.0)
    seg_a, seg_b = page(eng, p1)["segment_id"], page(eng, p2)["segment_id"]
    before = segment_stats(eng, "u")
    assert before[seg_a]["last_access"] == 200.0 and before[seg_b]["last_access"] == 300.0
    # no explicit time: the visit happens at the user's logical clock (300)
    eng.retrieve("u", "query a", top_segments=1)
    s = segment_stats(eng, "u")
    assert (s[seg_a]["n_visit"], s[seg_a]["last_access"]) == (1, 300.0)
    assert (s[seg_b]["n_visit"], s[seg_b]["last_access"]) == (0, 300.0)
    # an explicit query time
    eng.retrieve("u", "query a", top_segments=1, at=1000.0)
    eng.retrieve("u", "query a", top_segments=1, at=500.0)  # older: recency never goes back
    s = segment_stats(eng, "u")
    assert (s[seg_a]["n_visit"], s[seg_a]["last_access"]) == (3, 1000.0)
    assert arena_stat(eng, "n_visit", "u", seg_a) == 3
    assert arena_stat(eng, "last_access", "u", seg_a) == 1000.0
    # top_segments=2 visits both
    eng.retrieve("u", "query b", top_segments=2, at=2000.0)
    s = segment_stats(eng, "u")
    assert (s[seg_a]["n_visit"], s[seg_b]["n_visit"]) == (4, 1)
    assert s[seg_b]["last_access"] == 2000.0
    # update_heat=False is a read-only peek
    eng.retrieve_many([("u", "query b")], update_heat=False)
    assert segment_stats(eng, "u")[seg_b]["n_visit"] == 1


# ---------------------------------------------------------------------------- promotion

PROMOTION = {
    "profile_updates": {"extraversion": "outgoing", "not_a_dimension": "dropped"},
    "user_facts": ["User drinks green tea every morning."],
    "assistant_facts": ["Assistant recommended a tea shop."],
}


@pytest.mark.parametrize("preset_name", ["paper", "reference"])
def test_promotion_at_tau_writes_lpm_and_resets_heat(make_engine, kit, preset_name):
    emb = kit.TableEmbedder(table={"sum p1": unit(0), "sum p2": unit(0), "query a": unit(0)})
    eng = make_engine(
        preset=preset_name,
        stm_capacity=1,
        tau=3.0,
        mu_seconds=1e7,
        embedder=emb,
        script=kit.Script(promotion=PROMOTION),
        relevance_floor=-1.0,
    )
    p1, _ = add_pages(eng, "u", ["p1", "p2"])
    seg = page(eng, p1)["segment_id"]
    # heat 0 + 1 + 1 = 2 < tau: nothing promoted yet
    assert not [q for q in eng.llm.requests if q.stage == "promotion"]
    assert not page(eng, p1)["analysed"]
    eng.retrieve("u", "query a")  # N_visit 1 -> heat 3 >= tau: flagged, written behind
    assert not [q for q in eng.llm.requests if q.stage == "promotion"]  # retrieval: no LLM
    assert eng.flush()["promotions"] == 1  # the write-behind queued it, derived work ran it
    reqs = [q for q in eng.llm.requests if q.stage == "promotion"]
    assert len(reqs) == 1 and "User: p1" in reqs[0].messages[-1]["content"]
    assert page(eng, p1)["analysed"]
    s = segment_stats(eng, "u")[seg]
    assert s["l_interaction"] == 0
    assert s["n_visit"] == (0 if preset_name == "reference" else 1)
    assert arena_stat(eng, "l_interaction", "u", seg) == 0
    assert arena_stat(eng, "n_visit", "u", seg) == s["n_visit"]
    assert eng.profile("u") == {"extraversion": "outgoing"}
    kn = eng.knowledge("u")
    assert [e["text"] for e in kn["user"]] == ["User drinks green tea every morning."]
    assert [e["text"] for e in kn["assistant"]] == ["Assistant recommended a tea shop."]
    assert kn["user"][0]["mode"] == "llm"
    assert eng.stats()["counters"]["promotions"] == 1
    # the next page of the segment: only it is unanalysed; the paper's kept N_visit makes the
    # segment hot again at once (1 + 1 + 1 >= 3), the reference's reset one does not (0 + 1 + 1)
    p3 = eng.add("u", "p3", "r", timestamp=3.0).page_id
    p2 = p3 - 1
    assert page(eng, p2)["segment_id"] == seg
    reqs = [q for q in eng.llm.requests if q.stage == "promotion"]
    if preset_name == "paper":
        assert len(reqs) == 2
        content = reqs[1].messages[-1]["content"]
        assert "User: p2" in content and "User: p1" not in content
        assert page(eng, p2)["analysed"]
    else:
        assert len(reqs) == 1 and not page(eng, p2)["analysed"]
    # the retrieved knowledge and profile are what was promoted
    r = eng.retrieve("u", "User drinks green tea every morning.")
    assert r.user_knowledge[0].text == "User drinks green tea every morning."
    assert r.profile == {"extraversion": "outgoing"}


def test_flush_leaves_no_pending_work_after_promotion(make_engine, kit):
    emb = kit.TableEmbedder(table={"sum p1": unit(0), "query a": unit(0)})
    eng = make_engine(stm_capacity=1, tau=2.0, embedder=emb)
    add_pages(eng, "u", ["p1", "p2"])  # heat 0 + 1 + 1 = 2 >= tau: promoted, L reset
    assert eng.stats()["counters"]["promotions"] == 1
    eng.retrieve("u", "query a")  # N_visit 1: heat 1 + 0 + 1 >= tau, nothing left to analyse
    eng.flush()
    assert eng.pending_count() == 0


def test_promotion_invalid_output_falls_back_and_still_marks_pages(make_engine, kit):
    emb = kit.TableEmbedder(table={"sum p1": unit(0)})
    eng = make_engine(
        stm_capacity=1,
        tau=2.0,
        embedder=emb,
        script=kit.Script(promotion="this is not json"),
    )
    p1, _ = add_pages(eng, "u", ["I love hiking in the Alps with my dog.", "p2"])
    row = page(eng, p1)
    assert row["analysed"]
    llm = eng.stats()["llm"]
    assert llm["per_stage"]["promotion"]["fallbacks"] == 1
    # extractive fallback: first-person sentences become user facts, marked as a fallback
    kn = eng.knowledge("u")["user"]
    assert [e["text"] for e in kn] == ["I love hiking in the Alps with my dog."]
    assert kn[0]["mode"] == "llm-fallback"


# ---------------------------------------------------------------------------- eviction


def _fill_mtm(make_engine, kit, eviction):
    """200 segments (every page its own topic: random summary vectors, no keywords), except
    that segment slot 90 holds 5 pages of one topic; one more page waits in STM."""
    inputs = [f"t{i}" for i in range(90)]
    inputs += [f"t90{c}" for c in "abcde"]
    inputs += [f"t{i}" for i in range(91, 200)]
    inputs += ["filler"]
    script = kit.Script(pages={f"t90{c}": {"summary": "sum t90"} for c in "abcde"})
    emb = kit.TableEmbedder()
    eng = make_engine(
        stm_capacity=1,
        mtm_capacity=200,
        tau=1e9,
        eviction=eviction,
        embed_dates=False,
        script=script,
        embedder=emb,
        relevance_floor=-1.0,  # random page vectors: every page of a chosen segment is served
    )
    eng.add_many([PageInput("u", ui, "r", float(i + 1)) for i, ui in enumerate(inputs)])
    segs = segment_stats(eng, "u")
    assert len(segs) == 200
    by_slot = {s["slot"]: s for s in segs.values()}
    assert by_slot[90]["n_pages"] == 5 and by_slot[57]["n_pages"] == 1
    return eng, emb, by_slot


@pytest.mark.parametrize(
    ("eviction", "cold_slot"),
    [("heat", 57), ("lfu", 90)],
)
def test_eviction_at_the_201st_segment(make_engine, kit, eviction, cold_slot):
    """Heat: slot 57 (never visited, one page) is the coldest. LFU: slot 90 (never visited, but
    five pages, so the *hottest* by heat) goes; every other segment was visited once."""
    eng, emb, by_slot = _fill_mtm(make_engine, kit, eviction)
    victim = by_slot[cold_slot]
    victim_pages = [
        p["page_id"] for p in eng.store.user_pages("u") if p["segment_id"] == victim["segment_id"]
    ]
    # one retrieval visiting every segment but the cold one (it scores cos = -1)
    summary = "sum t90" if cold_slot == 90 else f"sum t{cold_slot}"
    emb.table["avoid"] = -emb.vector(summary)
    eng.retrieve("u", "avoid", top_segments=199, top_pages=1000)  # every page of them served
    visits = {s["slot"]: s["n_visit"] for s in segment_stats(eng, "u").values()}
    assert visits[cold_slot] == 0 and sum(visits.values()) == 199
    heat = eng.arena.host("heat")[eng._users["u"].slot]
    if eviction == "heat":
        assert int(np.argmin(heat)) == cold_slot
    else:
        assert int(np.argmax(heat)) == cold_slot  # LFU ignores heat
    last = eng.add("u", "last", "r", timestamp=1000.0)  # "filler" opens segment 201
    segs = segment_stats(eng, "u")
    assert len(segs) == 200
    assert victim["segment_id"] not in segs
    assert eng.stats()["counters"]["segments_evicted"] == 1
    for pid in victim_pages:
        row = page(eng, pid)
        assert row["tier"] == "evicted" and row["segment_id"] is None
    filler = page(eng, last.page_id - 1)
    assert filler["tier"] == "mtm"
    assert segs[filler["segment_id"]]["slot"] == cold_slot  # the freed slot is reused
    # every other segment survived; evicted pages are never retrieved again
    assert {s["slot"] for s in segs.values()} == set(range(200))
    hit = set()
    for pid in victim_pages:
        r = eng.retrieve("u", f"User: {page(eng, pid)['user_input']} Assistant: r", top_pages=10)
        hit |= {p.page_id for p in r.pages}
    assert not hit & set(victim_pages)
    history = [h for h in eng.history("u") if h["action"] == "evict"]
    assert [h["item_id"] for h in history] == [victim["segment_id"]]


def test_the_arena_widens_for_more_segments_and_a_reopen_restores_the_width(
    make_engine, kit, tmp_path
):
    """Segment rows start 8 slots wide per user and double as a user needs more; a reopen
    places the stored slots, so retrieval and each segment's slot are as before."""
    store = str(tmp_path / "wide.sqlite3")
    eng = make_engine(store=store, stm_capacity=1, tau=1e9)
    assert eng.arena.segment_width == 8
    add_pages(eng, "u", [f"topic {i}" for i in range(21)])  # 20 leave STM, 20 segments
    slots = {sid: st["slot"] for sid, st in segment_stats(eng, "u").items()}
    assert sorted(slots.values()) == list(range(20))
    assert eng.arena.segment_width == 32  # 8 -> 16 -> 32
    want = [p.page_id for p in eng.retrieve("u", "User: topic 17 Assistant: r topic 17").pages]
    assert want
    eng.close()
    again = make_engine(store=store, stm_capacity=1, tau=1e9)
    assert again.arena.segment_width >= 20
    assert {sid: st["slot"] for sid, st in segment_stats(again, "u").items()} == slots
    got = [p.page_id for p in again.retrieve("u", "User: topic 17 Assistant: r topic 17").pages]
    assert got == want


# ---------------------------------------------------------------------------- LPM FIFO


def test_knowledge_fifo_keeps_the_newest_100(make_engine, kit):
    counter = {"n": 0}

    def promotion(_req):
        base = counter["n"]
        counter["n"] += 10
        return {
            "user_facts": [f"user fact {base + i:03d}" for i in range(10)],
            "assistant_facts": [f"assistant fact {base + i:03d}" for i in range(10)],
        }

    eng = make_engine(
        stm_capacity=1, tau=1.5, knowledge_top_k=100, script=kit.Script(promotion=promotion)
    )
    # every evicted page opens its own segment (heat 0 + 1 + 1 >= 1.5) and is promoted
    add_pages(eng, "u", [f"p{i}" for i in range(13)])
    assert counter["n"] == 120
    kn = eng.knowledge("u")
    want_user = [f"user fact {i:03d}" for i in range(20, 120)]
    assert [e["text"] for e in kn["user"]] == want_user
    assert [e["text"] for e in kn["assistant"]] == [
        f"assistant fact {i:03d}" for i in range(20, 120)
    ]
    everything = eng.export_user("u")["user_knowledge"]
    assert len(everything) == 120
    assert [e["text"] for e in everything if not e["live"]] == [
        f"user fact {i:03d}" for i in range(20)
    ]
    # retrieval only ever sees live entries, even for a query equal to a dropped fact
    for q in ("user fact 000", "user fact 019", "assistant fact 005"):
        r = eng.retrieve("u", q)
        assert len(r.user_knowledge) == 100 and len(r.assistant_knowledge) == 100
        assert {e.text for e in r.user_knowledge} == set(want_user)
        assert all(int(e.text.split()[-1]) >= 20 for e in r.assistant_knowledge)
    r = eng.retrieve("u", "user fact 020")
    assert r.user_knowledge[0].text == "user fact 020"
    assert r.user_knowledge[0].score == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------------------- isolation


def test_users_are_isolated(make_engine, kit):
    emb = kit.TableEmbedder()
    eng = make_engine(
        stm_capacity=1,
        tau=1.5,
        embedder=emb,
        script=kit.Script(promotion={"user_facts": ["I live in Paris."]}),
    )
    for user in ("alice", "bob"):
        add_pages(eng, user, ["I live in Paris.", "same text", "more text"], response="ok")
    a, b = eng.retrieve("alice", "I live in Paris."), eng.retrieve("bob", "I live in Paris.")
    for r, other in ((a, "bob"), (b, "alice")):
        others_pages = {p["page_id"] for p in eng.store.user_pages(other)}
        others_kn = {e["entry_id"] for e in eng.knowledge(other)["user"]}
        mine = {p.page_id for p in r.all_pages()}
        assert mine and not mine & others_pages
        assert all(eng.get_page(pid)["user_id"] == r.user_id for pid in mine)
        assert r.user_knowledge and not {e.entry_id for e in r.user_knowledge} & others_kn
    assert [e.text for e in a.user_knowledge] == [e.text for e in b.user_knowledge]
    # the same assistant is shared: its knowledge ring is one
    assert eng.knowledge("alice")["assistant"] == eng.knowledge("bob")["assistant"]
    # segments live in separate arena rows
    assert eng._users["alice"].slot != eng._users["bob"].slot
    with pytest.raises(KeyError):
        eng.retrieve("carol", "I live in Paris.")


# ---------------------------------------------------------------------------- ordering


def _seq_order(eng, user):
    return [p["user_input"] for p in eng.store.user_pages(user)]  # ordered by seq


def test_per_user_order_with_concurrent_threads(make_engine, kit):
    """8 threads add (and retrieve) concurrently; each user's pages keep submission order in
    seq, in MTM, and in the dialogue chain (every page continues the previous one)."""

    def continuous(req):
        if req.stage == "page":
            return {"continuous": True, "meta": "m", "summary": "s", "keywords": []}
        raise AssertionError(req.stage)

    eng = make_engine(stm_capacity=2, tau=1e9, script=continuous)
    users = [f"u{i}" for i in range(8)]
    n = 12
    errors: list[BaseException] = []

    def worker(user):
        try:
            for k in range(n):
                eng.add(user, f"{user} msg {k}", "ok", timestamp=float(k))
                if k % 4 == 3:
                    eng.retrieve(user, "anything")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for u in users:
        assert _seq_order(eng, u) == [f"{u} msg {k}" for k in range(n)]
        mtm = eng.store.user_pages(u, "mtm")
        assert [p["user_input"] for p in mtm] == [f"{u} msg {k}" for k in range(n - 2)]
        assert [p["prev_page"] for p in mtm] == [None] + [p["page_id"] for p in mtm[:-1]]


def test_per_user_order_with_asyncio_tasks(make_engine):
    eng = make_engine(stm_capacity=2, mode="extractive")
    users = [f"u{i}" for i in range(6)]

    async def feed(user):
        for k in range(0, 12, 3):  # batches of 3 pages, awaited in order
            await eng.aadd_many(
                [PageInput(user, f"{user} msg {j}", "ok", float(j)) for j in range(k, k + 3)]
            )

    async def main():
        # plus one batch interleaving every user
        mixed = [PageInput(u, f"{u} mixed {j}", "ok", 100.0 + j) for j in range(3) for u in users]
        await asyncio.gather(*(feed(u) for u in users))
        await eng.aadd_many(mixed)

    asyncio.run(main())
    for u in users:
        want = [f"{u} msg {j}" for j in range(12)] + [f"{u} mixed {j}" for j in range(3)]
        assert _seq_order(eng, u) == want
        assert [p["seq"] for p in eng.store.user_pages(u)] == list(range(15))


# ---------------------------------------------------------------------------- scheduler


def test_page_stage_batches_across_users(make_engine):
    eng = make_engine(stm_capacity=1)
    users = [f"u{i:02d}" for i in range(20)]
    eng.add_many([PageInput(u, f"{u} first", "r", 1.0) for u in users])
    assert eng.llm.batches == []  # nothing evicted yet
    eng.add_many([PageInput(u, f"{u} second", "r", 2.0) for u in users])
    assert eng.llm.batch_sizes("page") == [20]
    (batch,) = eng.llm.batches
    from_batch = sorted(
        r.messages[-1]["content"].split("CURRENT page:")[1].split("User: ")[1].split()[0]
        for r in batch
    )
    assert from_batch == users
    assert eng.stats()["llm"]["per_stage"]["page"] == {
        "calls": 20,
        "batches": 1,
        "mean_batch": 20.0,
        "prompt_tokens": eng.stats()["llm"]["per_stage"]["page"]["prompt_tokens"],
        "completion_tokens": eng.stats()["llm"]["per_stage"]["page"]["completion_tokens"],
        "fallbacks": 0,
    }


def test_pending_pages_of_one_user_take_successive_rounds(make_engine, kit):
    eng = make_engine(stm_capacity=1)
    others = [f"o{i}" for i in range(4)]
    eng.add_many([PageInput(u, f"{u} a", "r", 1.0) for u in others])
    batch = [PageInput("x", f"x{k}", "r", float(k)) for k in range(4)]  # x0..x2 are evicted
    batch += [PageInput(u, f"{u} b", "r", 2.0) for u in others]
    eng.add_many(batch)
    assert eng.llm.batch_sizes("page") == [5, 1, 1]
    rounds = [[kit.current_user_input(r) for r in b] for b in eng.llm.batches]
    assert rounds[0] == ["x0", *[f"{u} a" for u in others]]
    assert rounds[1:] == [["x1"], ["x2"]]
    # each round saw the previous round's page as x's previous page (chain context in order)
    assert "User: x0" in eng.llm.batches[1][0].messages[-1]["content"].split("CURRENT")[0]
    assert "User: x1" in eng.llm.batches[2][0].messages[-1]["content"].split("CURRENT")[0]


@pytest.mark.parametrize("bad", ["{not json at all", "", RuntimeError("server hiccup")])
def test_invalid_llm_output_falls_back_and_keeps_the_page(make_engine, kit, bad):
    script = kit.Script(pages={"p2": {"continuous": True, "meta": "m2"}})

    def responder(req):
        if req.stage == "page" and kit.current_user_input(req) == "p1":
            return bad
        return script(req)

    eng = make_engine(stm_capacity=1, script=responder)
    p1, p2, _ = add_pages(eng, "u", ["p1", "p2", "p3"])
    llm = eng.stats()["llm"]
    assert llm["fallbacks"] == 1 and llm["per_stage"]["page"]["fallbacks"] == 1
    assert llm["llm_calls"] == 2
    r1, r2 = page(eng, p1), page(eng, p2)
    assert r1["tier"] == "mtm" and r1["mode"] == "llm-fallback"
    assert r1["summary"] and r1["meta"]  # extractive summary / meta
    assert r2["mode"] == "llm" and r2["prev_page"] == p1
    assert eng.stats()["store"]["pages_mtm"] == 2


def test_separate_stage_calls_when_not_fused(make_engine):
    def responder(req):
        return {
            "continuity": {"continuous": True},
            "chain_meta": {"meta": "chain meta"},
            "topic_summary": {"summary": "a topic", "keywords": []},
        }[req.stage]

    eng = make_engine(stm_capacity=1, fused=False, script=responder)
    p1, p2, _ = add_pages(eng, "u", ["p1", "p2", "p3"])
    per = eng.stats()["llm"]["per_stage"]
    # continuity is only asked when there is a previous page
    assert {s: per[s]["calls"] for s in per} == {
        "continuity": 1,
        "chain_meta": 2,
        "topic_summary": 2,
    }
    assert page(eng, p2)["prev_page"] == p1 and page(eng, p1)["meta"] == "chain meta"
    assert page(eng, p2)["mode"] == "llm"


# ---------------------------------------------------------------------------- presets


def test_presets():
    ref = preset("reference")
    assert (ref.stm_capacity, ref.mtm_capacity, ref.eviction) == (10, 2000, "lfu")
    assert ref.mu_seconds == 86400 and ref.query_keyword_weight == 0
    assert ref.reset_visits_on_promotion and ref.heat_params().evict_by_visits
    paper = preset("paper")
    assert (paper.stm_capacity, paper.mtm_capacity, paper.eviction) == (7, 200, "heat")
    assert (paper.theta, paper.tau, paper.mu_seconds) == (0.6, 5.0, 1e7)
    assert (paper.alpha, paper.beta, paper.gamma) == (1.0, 1.0, 1.0)
    assert (paper.top_segments, paper.top_pages, paper.knowledge_capacity) == (5, 10, 100)
    assert paper.query_keyword_weight == 1.0 and not paper.reset_visits_on_promotion
    assert preset("reference", stm_capacity=3).stm_capacity == 3
    with pytest.raises(ValueError):
        preset("nope")


def test_engine_reports_its_preset(make_engine):
    eng = make_engine(preset="reference", mode="extractive")
    assert eng.stats()["preset"] == "reference" and eng.memory.stm_capacity == 10


# ---------------------------------------------------------------------------- clock


def test_logical_clock_follows_page_timestamps(make_engine, kit, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 5e9)
    emb = kit.TableEmbedder(table={"query a": unit(0), "sum p1": unit(0)})
    eng = make_engine(stm_capacity=1, tau=1e9, embedder=emb)
    p1, _ = add_pages(eng, "u", ["p1", "p2"], t0=1000.0, step=500.0)
    seg = page(eng, p1)["segment_id"]
    assert segment_stats(eng, "u")[seg]["last_access"] == 1500.0
    eng.retrieve("u", "query a")
    assert segment_stats(eng, "u")[seg]["last_access"] == 1500.0
    # a page older than the clock does not move it back
    eng.add("u", "late", "r", timestamp=10.0)
    assert eng._users["u"].clock == 1500.0


def test_wall_clock_uses_time_time(make_engine, kit, monkeypatch):
    now = {"t": 1_000_000.0}
    monkeypatch.setattr(time, "time", lambda: now["t"])
    emb = kit.TableEmbedder(table={"query a": unit(0), "sum p1": unit(0)})
    eng = make_engine(
        stm_capacity=1,
        tau=1e9,
        clock="wall",
        mu_seconds=1000.0,
        embedder=emb,
        relevance_floor=-1.0,
    )
    p1, _ = add_pages(eng, "u", ["p1", "p2"], t0=5.0)  # old log timestamps
    seg = page(eng, p1)["segment_id"]
    assert segment_stats(eng, "u")[seg]["last_access"] == 1_000_000.0
    now["t"] = 1_000_500.0
    eng.retrieve("u", "query a")
    s = segment_stats(eng, "u")[seg]
    assert (s["n_visit"], s["last_access"]) == (1, 1_000_500.0)
    # heat decays on the wall clock: 700 s later, when another page arrives
    now["t"] = 1_001_200.0
    eng.add("u", "p3", "r", timestamp=6.0)
    want = 1 * 1 + 1 * 1 + math.exp(-700.0 / 1000.0)
    assert arena_stat(eng, "heat", "u", seg) == pytest.approx(want, rel=1e-6)
    # a page without a timestamp gets the wall time
    pid = eng.add("u", "no time", "r").page_id
    assert page(eng, pid)["timestamp"] == 1_001_200.0


# ---------------------------------------------------------------------------- item control


def test_one_promotion_that_wraps_the_ring_keeps_its_newest_facts(make_engine, kit, tmp_path):
    """Ten facts into a ring of four in one batch: the last four are live, in the arena and in
    what retrievals show; the six before them are history only, also after a reopen."""

    made = []

    def promotion(_req):  # new facts each time (a repeated fact would strengthen its entry)
        made.extend(f"wrapped fact {len(made) + i}" for i in range(10))
        return {"user_facts": made[-10:], "assistant_facts": []}

    store = str(tmp_path / "s.sqlite3")
    memory = dict(stm_capacity=1, tau=1.5, knowledge_capacity=4, knowledge_top_k=10)
    eng = make_engine(store=store, script=kit.Script(promotion=promotion), **memory)
    add_pages(eng, "u", ["p0", "p1"])  # p0 leaves STM, opens a segment, is promoted
    assert len(made) == 10
    want = made[-4:]
    assert [e["text"] for e in eng.knowledge("u")["user"]] == want
    assert [e["text"] for e in eng.export_user("u")["user_knowledge"]][:6] == made[:6]
    shown = {e.text for e in eng.retrieve("u", "wrapped fact").user_knowledge}
    assert shown == set(want)
    eng.close()
    again = make_engine(store=store, script=kit.Script(promotion=promotion), **memory)
    assert {e.text for e in again.retrieve("u", "wrapped fact").user_knowledge} == set(want)


def test_knowledge_rings_widen_for_more_entries_and_a_reopen_restores_them(
    make_engine, kit, tmp_path
):
    """Rings start 8 positions wide per owner and double as an owner needs more: 10 facts (a
    promotion's most) in a ring of capacity 20 widen it to 16, and every fact stays
    retrievable, also after a reopen (which places the stored positions)."""
    topics = "apples boats cellos dunes ember ferns glass harbor islands jazz"
    facts = [f"widening fact about {t}" for t in topics.split()]  # 10, none a repeat

    def promotion(_req):
        return {"user_facts": facts, "assistant_facts": []}

    store = str(tmp_path / "s.sqlite3")
    memory = dict(stm_capacity=1, tau=1.5, knowledge_capacity=20, knowledge_top_k=20)
    eng = make_engine(store=store, script=kit.Script(promotion=promotion), **memory)
    assert eng.arena.knowledge_width == 8
    add_pages(eng, "u", ["p0", "p1"])  # p0 leaves STM, opens a segment, is promoted
    assert eng.arena.knowledge_width == 16
    assert {e.text for e in eng.retrieve("u", "widening fact").user_knowledge} == set(facts)
    eng.close()
    again = make_engine(store=store, script=kit.Script(promotion=promotion), **memory)
    assert 10 <= again.arena.knowledge_width <= 20
    assert {e.text for e in again.retrieve("u", "widening fact").user_knowledge} == set(facts)


def test_a_reopen_widens_segment_rows_and_rings_before_it_loads_them(
    make_engine, kit, tmp_path, monkeypatch
):
    """A reopen reserves the stored segment slots and ring positions while the arena is empty
    (store.arena_extent): widening a filled arena holds its old and new rows at once, which
    at 100,000 users was the reopen's peak memory."""
    import memoryos_gpu.store.reads as store_reads
    from memoryos_gpu.arena import Arena

    facts = [f"wide fact {i}" for i in range(10)]
    store = str(tmp_path / "s.sqlite3")
    memory = dict(stm_capacity=1, tau=1.5, knowledge_capacity=20, knowledge_top_k=20)
    script = kit.Script(promotion=lambda _req: {"user_facts": facts, "assistant_facts": []})
    eng = make_engine(store=store, script=script, **memory)
    add_pages(eng, "u", [f"topic {i}" for i in range(12)])  # 11 segments, 10 facts
    assert eng.arena.segment_width == 16 and eng.arena.knowledge_width == 16
    eng.close()

    widened_with_rows: list[str] = []
    grow_width, fit_rings = Arena._grow_width, Arena._fit_rings

    def _grow_width(self, needed):
        if self._h_seg_live.any():
            widened_with_rows.append("segments")
        return grow_width(self, needed)

    def _fit_rings(self, ring_slots):
        if ring_slots.size and ring_slots.max() >= self.knowledge_width and self.kn_live.any():
            widened_with_rows.append("rings")
        return fit_rings(self, ring_slots)

    monkeypatch.setattr(Arena, "_grow_width", _grow_width)
    monkeypatch.setattr(Arena, "_fit_rings", _fit_rings)
    monkeypatch.setattr(store_reads, "LOAD_CHUNK_BYTES", 1)  # a row a chunk
    again = make_engine(store=store, script=script, **memory)
    assert widened_with_rows == []
    assert again.arena.segment_width >= 11 and again.arena.knowledge_width >= 10
    assert {e.text for e in again.retrieve("u", "wide fact").user_knowledge} == set(facts)


def test_get_update_delete_page_and_knowledge_with_history(make_engine, kit):
    emb = kit.TableEmbedder()
    eng = make_engine(
        stm_capacity=1,
        tau=1.5,
        embed_dates=False,  # a page's vector is the vector of "User: ... Assistant: ..."
        lexical_weight=0.0,  # page scores are cosines (the paper's dense pipeline)
        embedder=emb,
        script=kit.Script(promotion={"user_facts": ["User owns a red bike.", "User is 30."]}),
    )
    p1, p2, p3 = add_pages(eng, "u", ["p1", "p2", "p3"])
    assert eng.get_page(10_000) is None
    assert page(eng, p1)["tier"] == "mtm" and page(eng, p3)["tier"] == "stm"
    # update an MTM page: text and the vector retrieval sees both change
    new_text = "completely new question about sailing"
    implied = [e["entry_id"] for e in eng.knowledge("u")["user"] if p1 in e["sources"]]
    assert implied  # the edit deletes them (what p1's old text implied), each audited
    row = eng.update_page(p1, user_input=new_text)
    assert row["user_input"] == new_text and row["agent_response"] == "r p1"
    r = peek(eng, "u", f"User: {new_text} Assistant: r p1")
    assert r.pages[0].page_id == p1 and r.pages[0].score == pytest.approx(1.0, abs=1e-5)
    # update an STM page
    assert eng.update_page(p3, agent_response="edited")["agent_response"] == "edited"
    assert [p.agent_response for p in peek(eng, "u", "x").stm] == ["edited"]
    # delete an MTM page: gone from the store and from retrieval; links are cut
    assert eng.delete_page(p1) is True
    assert eng.get_page(p1) is None and eng.delete_page(p1) is False
    assert page(eng, p2)["prev_page"] is None
    r = peek(eng, "u", f"User: {new_text} Assistant: r p1")
    assert p1 not in {p.page_id for p in r.all_pages()}
    # delete an STM page
    assert eng.delete_page(p3) and peek(eng, "u", "x").stm == []
    with pytest.raises(KeyError):
        eng.update_page(p1, user_input="x")
    # the facts derived from p1 went with it; the re-analysis of p2 derives them again
    assert all(p1 not in e["sources"] for e in eng.knowledge("u")["user"])
    eng.flush()
    # knowledge entries
    kn = eng.knowledge("u")["user"]
    assert [e["text"] for e in kn[:2]] == ["User owns a red bike.", "User is 30."]
    bike, age = kn[0]["entry_id"], kn[1]["entry_id"]
    assert eng.update_knowledge(bike, "User owns a blue bike.")["text"] == "User owns a blue bike."
    r = peek(eng, "u", "User owns a blue bike.")
    assert r.user_knowledge[0].entry_id == bike
    assert r.user_knowledge[0].score == pytest.approx(1.0, abs=1e-5)
    assert eng.delete_knowledge(age) is True and eng.delete_knowledge(age) is False
    r = peek(eng, "u", "User is 30.")
    assert age not in {e.entry_id for e in r.user_knowledge}
    assert age not in {e["entry_id"] for e in eng.knowledge("u")["user"]}
    with pytest.raises(KeyError):
        eng.update_knowledge(age, "x")
    # the audit trail, in order
    events = [(h["action"], h["item_kind"], h["item_id"]) for h in eng.history("u")]
    adds = [e for e in events if e[0] == "add"]
    assert adds == [("add", "page", p) for p in (p1, p2, p3)]
    edits = [e for e in events if e[0] in ("update", "delete")]
    assert edits == [
        ("update", "page", p1),
        *[("delete", "knowledge", e) for e in implied],
        ("update", "page", p3),
        ("delete", "page", p1),
        ("delete", "page", p3),
        ("update", "knowledge", bike),
        ("delete", "knowledge", age),
    ]
    assert [h["event_id"] for h in eng.history("u")] == sorted(
        h["event_id"] for h in eng.history("u")
    )
    # the events of deleted items keep no content; a live item's edit keeps before / after
    upd = next(h for h in eng.history("u") if h["action"] == "update" and h["item_id"] == p1)
    assert upd["detail"] == {}
    assert all(h["detail"] == {} for h in eng.history("u") if h["action"] == "delete")
    updates = [h for h in eng.history("u") if h["action"] == "update"]
    kupd = next(h for h in updates if h["item_kind"] == "knowledge")
    assert kupd["detail"] == {"before": "User owns a red bike.", "after": "User owns a blue bike."}


# ---------------------------------------------------------------------------- extractive


def test_extractive_mode_makes_no_llm_calls(make_engine):
    eng = make_engine(mode="extractive", stm_capacity=2, tau=1.5)
    assert eng.llm is None
    texts = [
        ("I adopted a cat named Miso last week.", "Congratulations on Miso!"),
        ("My cat Miso loves tuna.", "Cats often do."),
        ("What is the capital of Peru?", "Lima."),
        ("Tell me a joke", "Why did the chicken cross the road?"),
        ("I work as a nurse in Lyon.", "That sounds demanding."),
    ]
    ids = [eng.add("u", q, a, timestamp=float(i)).page_id for i, (q, a) in enumerate(texts)]
    for pid in ids[:3]:
        row = page(eng, pid)
        assert row["tier"] == "mtm" and row["mode"] == "extractive"
        assert row["summary"] and row["keywords"]
    st = eng.stats()
    assert st["mode"] == "extractive"
    assert st["llm"]["llm_calls"] == 0 and st["llm"]["fallbacks"] == 0
    kn = eng.knowledge("u")["user"]
    assert kn and all(e["mode"] == "extractive" for e in kn)
    assert "I adopted a cat named Miso last week." in {e["text"] for e in kn}
    r = eng.retrieve("u", "What is my cat called?")
    assert r.pages and r.stm
    with pytest.raises(Exception, match="LLM"):
        eng.respond("u", "hello")


# ---------------------------------------------------------------------------- respond, reopen


def test_respond_retrieves_prompts_and_remembers(make_engine, kit):
    eng = make_engine(stm_capacity=2, script=kit.Script(response="Your cat is called Miso."))
    add_pages(eng, "u", ["My cat is called Miso.", "p2", "p3"])
    res = eng.respond("u", "What is my cat called?")
    assert res.text == "Your cat is called Miso." and res.error is None
    assert res.prompt_tokens > 0 and res.completion_tokens == 5
    (prompt,) = [q for q in eng.llm.requests if q.stage == "response"]
    assert prompt.json_schema is None
    content = " ".join(m["content"] for m in prompt.messages)
    assert "What is my cat called?" in content and "My cat is called Miso." in content
    row = page(eng, res.page_id)
    assert (row["user_input"], row["agent_response"]) == (
        "What is my cat called?",
        "Your cat is called Miso.",
    )
    assert eng.stats()["counters"]["responses"] == 1
    assert eng.stats()["llm"]["per_stage"]["response"]["calls"] == 1


def test_reopen_restores_every_tier(make_engine, kit, tmp_path):
    path = str(tmp_path / "mem.sqlite")
    emb = kit.TableEmbedder(table={"sum p1": unit(0), "sum p2": unit(0), "query a": unit(0)})
    script = kit.Script(
        pages={"p2": {"continuous": True, "meta": "m2"}},
        promotion={"user_facts": ["User likes chess."]},
    )
    cfg = {"stm_capacity": 2, "tau": 2.5, "embedder": emb, "relevance_floor": -1.0}
    eng = make_engine(store=path, script=script, **cfg)
    add_pages(eng, "u", ["p1", "p2", "p3", "p4"])
    eng.retrieve("u", "query a")  # N_visit 1 -> heat 1 + 2 + 1 >= 2.5: flagged
    eng.flush()  # written behind, then promoted
    before = eng.export_user("u")
    assert before["segments"][0]["n_visit"] == 1
    assert [e["text"] for e in before["user_knowledge"]] == ["User likes chess."]
    eng.close()
    again = make_engine(store=path, script=script, **cfg)
    after = again.export_user("u")
    assert after["pages"] == before["pages"] and after["segments"] == before["segments"]
    assert after["user_knowledge"] == before["user_knowledge"]
    r = again.retrieve_many([("u", "query a")], update_heat=False)[0]
    assert [p.user_input for p in r.stm] == ["p3", "p4"]
    assert {p.user_input for p in r.pages} == {"p1", "p2"}
    assert [e.text for e in r.user_knowledge] == ["User likes chess."]
    seg = before["segments"][0]["segment_id"]
    assert arena_stat(again, "n_visit", "u", seg) == 1
    # the chain continues where it stopped
    p5 = again.add("u", "p5", "r", timestamp=5.0).page_id
    assert page(again, p5 - 2)["prev_page"] is None  # p3: scripted not continuous
    assert again._users["u"].chain_tail == p5 - 2


def _interleaved_in_the_pool(eng) -> list[str]:
    """Users with another user's page block between their own MTM pages' blocks."""
    block_user, bs = eng.arena._block_user, eng.arena.config.block_size
    out = []
    for uid, user in eng._users.items():
        mtm = [p["page_id"] for p in eng.store.user_pages(uid) if p["tier"] == "mtm"]
        blocks = np.unique(np.flatnonzero(np.isin(eng._page_of_slot, mtm)) // bs)
        if (block_user[blocks.min() : blocks.max() + 1] != user.slot).any():
            out.append(uid)
    return out


def test_a_reopen_lays_each_users_pages_together_in_the_pool(make_engine, tmp_path, monkeypatch):
    """Pages reach MTM a wave at a time, each user's between other users', so the pool
    interleaves users; a reopen sizes the pool in (user, segment) order, so a query reads its
    user's page rows from one stretch of memory -- also when the segments stream in many
    chunks, as a large store's do. Retrievals do not change."""
    monkeypatch.setattr("memoryos_gpu.store.reads.LOAD_CHUNK_BYTES", 1)  # a segment a chunk
    path = str(tmp_path / "mem.sqlite")
    users = [f"u{i}" for i in range(5)]
    topics = ["chess openings", "hiking boots", "tax forms", "sourdough bread", "jazz piano"]
    eng = make_engine(store=path, mode="extractive", stm_capacity=2)
    for t in range(8):
        eng.add_many(
            [
                PageInput(u, f"{topics[(t + i) % 5]} talk {t}", "r", float(t))
                for i, u in enumerate(users)
            ]
        )
    eng.flush()
    assert _interleaved_in_the_pool(eng) == users  # as ingested: interleaved
    queries = [(u, topics[i]) for i, u in enumerate(users)]
    before = [[p.page_id for p in r.pages] for r in eng.retrieve_many(queries, update_heat=False)]
    eng.close()
    again = make_engine(store=path, mode="extractive", stm_capacity=2)
    assert _interleaved_in_the_pool(again) == []
    after = [[p.page_id for p in r.pages] for r in again.retrieve_many(queries, update_heat=False)]
    assert after == before


def test_a_failed_add_leaves_no_trace(make_engine, monkeypatch):
    eng = make_engine(stm_capacity=3, mode="extractive")
    eng.add("u", "p0", "r", timestamp=0.0)
    real_audit = eng.store.audit_many

    def failing_audit(db, rows):  # the batch's last statement: everything before it is written
        real_audit(db, rows)
        raise RuntimeError("disk I/O error")

    monkeypatch.setattr(eng.store, "audit_many", failing_audit)
    with pytest.raises(RuntimeError):
        eng.add_many([PageInput("u", "p1", "r", 1.0), PageInput("u", "p2", "r", 2.0)])
    monkeypatch.setattr(eng.store, "audit_many", real_audit)
    assert len(eng.export_user("u")["pages"]) == 1  # the store rolled back
    eng.add("u", "p3", "r", timestamp=3.0)
    r = eng.retrieve("u", "anything")
    assert [p.user_input for p in r.stm] == ["p0", "p3"]
    assert [p["seq"] for p in eng.store.user_pages("u")] == [0, 1]


def test_a_failed_add_that_overflowed_stm_puts_every_stm_back(make_engine, monkeypatch):
    """A failed batch whose pages pushed others (and some of its own) out of full STMs: each
    user's STM is what it was, in order, and the next pages push out the right ones."""
    eng = make_engine(stm_capacity=2, mode="extractive")
    for i in range(2):
        eng.add("u", f"u{i}", "r", timestamp=float(i))
        eng.add("v", f"v{i}", "r", timestamp=float(i))
    real_audit = eng.store.audit_many

    def failing_audit(db, rows):
        real_audit(db, rows)
        raise RuntimeError("disk I/O error")

    monkeypatch.setattr(eng.store, "audit_many", failing_audit)
    batch = [PageInput("u", f"x{i}", "r", 5.0 + i) for i in range(3)]
    batch += [PageInput("v", "y0", "r", 5.0), PageInput("w", "z0", "r", 5.0)]
    with pytest.raises(RuntimeError):
        eng.add_many(batch)
    monkeypatch.setattr(eng.store, "audit_many", real_audit)
    assert [p.user_input for p in eng.retrieve("u", "q").stm] == ["u0", "u1"]
    assert [p.user_input for p in eng.retrieve("v", "q").stm] == ["v0", "v1"]
    assert eng.store.count_pending() == 0
    eng.add("u", "u2", "r", timestamp=2.0)
    eng.flush()
    assert [p.user_input for p in eng.retrieve("u", "q").stm] == ["u1", "u2"]
    assert [p["user_input"] for p in eng.store.user_pages("u") if p["tier"] == "mtm"] == ["u0"]


def test_respond_to_a_first_time_user(make_engine, kit):
    eng = make_engine(script=kit.Script(response="Hello!"))
    res = eng.respond("newcomer", "Hi, I'm new here.")
    assert res.text == "Hello!" and res.retrieval.pages == [] and res.retrieval.stm == []
    assert page(eng, res.page_id)["user_input"] == "Hi, I'm new here."


def _backlog_engine() -> tuple[MemoryEngine, list[list[tuple[int, str, int]]]]:
    """An extractive engine (STM of 1, no automatic derived work) holding 4 pages of each of
    3 users, and the list its derived rounds' items are recorded in."""
    cfg = EngineConfig(
        memory=preset("paper", stm_capacity=1),
        llm=LLMConfig(mode="extractive"),
        embedder="hashing",
        device="cpu",
        auto_process=False,
    )
    eng = MemoryEngine(cfg)
    rounds: list[list[tuple[int, str, int]]] = []
    real = eng._process_pages

    def spy(items: list[tuple[int, str, int]]) -> int:
        rounds.append(list(items))
        return real(items)

    eng._process_pages = spy  # type: ignore[method-assign]
    for i in range(4):
        eng.add_many([PageInput(f"u{u}", f"page {i} of u{u}", "ok") for u in range(3)])
    return eng, rounds


@pytest.mark.parametrize("max_batch", [1, 2, 256])
def test_derived_rounds_are_capped_and_keep_each_users_order(max_batch: int) -> None:
    """process_pending(max_batch=k) runs rounds of at most k pages, in waves (every user's
    j-th page of the round after every user's (j-1)-th), each user's pages in acceptance
    order; a backlog that fits in k goes in one round; the result does not depend on k."""
    eng, rounds = _backlog_engine()
    done = eng.process_pending(max_batch=max_batch)
    assert done["pages"] == 9  # 12 pages, STM keeps the newest of each user
    assert all(0 < len(r) <= max_batch for r in rounds)
    for r in rounds:
        waves = [sum(uid == v for _, v, _ in r[: i + 1]) for i, (_, uid, _) in enumerate(r)]
        assert waves == sorted(waves), r  # wave 2 starts after wave 1 ends, and so on
    assert len(rounds) == (1 if max_batch >= 9 else -(-9 // max_batch))
    order = [ref for r in rounds for _, _, ref in r]
    for u in range(3):
        mine = [p for p in order if eng.get_page(p)["user_id"] == f"u{u}"]
        assert mine == sorted(mine)
    assert [len(eng.export_user(f"u{u}")["pages"]) for u in range(3)] == [4, 4, 4]
    with pytest.raises(InvalidInputError):
        eng.process_pending(max_batch=0)
    eng.close()


def test_a_gathering_round_takes_full_waves_and_a_drain_takes_the_backlog() -> None:
    """``max_rounds=1`` (the server's scheduler) takes the waves at least half as full as the
    first: with 3 pages pending for each of 3 users, all three; a drain takes the rest in
    waves of one round; every page ends in MTM in its user's order, as one page at a time
    would place it."""
    eng, rounds = _backlog_engine()  # 3 pages of each user pending, the 4th in STM
    eng.add_many([PageInput("u0", "page 4 of u0", "ok")])  # u0: a 4th pending page
    assert eng.process_pending(max_rounds=1)["pages"] == 9  # waves of 3, 3, 3 (not u0's 1)
    assert [uid for _, uid, _ in rounds[0]] == ["u0", "u1", "u2"] * 3
    assert eng.process_pending()["pages"] == 1
    assert [uid for _, uid, _ in rounds[1]] == ["u0"]
    one, _ = _backlog_engine()  # the reference's order: one page at a time
    one.add_many([PageInput("u0", "page 4 of u0", "ok")])
    one.process_pending(max_batch=1)
    for u in range(3):
        assert _mtm_layout(eng, f"u{u}") == _mtm_layout(one, f"u{u}")
    assert [p for p, *_ in _mtm_layout(eng, "u0")] == [f"page {i} of u0" for i in range(4)]
    eng.close()
    one.close()


@pytest.mark.parametrize(
    ("pending", "taken"),
    [
        ({"a": 1}, ["a"]),
        ({"a": 3, "b": 1, "c": 1, "d": 1}, ["a", "b", "c", "d"]),  # wave 2 holds 1 of 4
        ({"a": 3, "b": 2, "c": 1, "d": 1}, ["a", "b", "c", "d", "a", "b"]),  # 2 of 4: taken
        ({"a": 3, "b": 3, "c": 2, "d": 1}, ["a", "b", "c", "d", "a", "b", "c", "a", "b"]),
    ],
)
def test_full_waves_keeps_the_leading_waves_at_least_half_as_full_as_the_first(
    pending: dict[str, int], taken: list[str]
) -> None:
    """``full_waves`` over items listed wave by wave: a later wave is kept while it holds at
    least half the first wave's items, and every wave after a smaller one is dropped."""
    waves = [[u for u, n in pending.items() if n > k] for k in range(max(pending.values()))]
    items = [(i, u, 100 + i) for i, u in enumerate(u for wave in waves for u in wave)]
    assert [u for _, u, _ in full_waves(items, FULL_WAVE_SHARE)] == taken
    assert full_waves([], FULL_WAVE_SHARE) == []


def _mtm_layout(eng: MemoryEngine, user: str) -> list[tuple]:
    """A user's MTM pages in order: text, which earlier page (by position) it links to and
    shares a segment with, its chain's meta, summary and keywords."""
    mtm = eng.store.user_pages(user, "mtm")
    at = {p["page_id"]: i for i, p in enumerate(mtm)}
    first_in_segment: dict[int, int] = {}
    return [
        (
            p["user_input"],
            at.get(p["prev_page"]),
            first_in_segment.setdefault(p["segment_id"], i),
            p["meta"],
            p["summary"],
            p["keywords"],
        )
        for i, p in enumerate(mtm)
    ]

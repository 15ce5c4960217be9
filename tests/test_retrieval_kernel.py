"""The fused retrieval pass and the heat credit of served pages against their NumPy reference, on
random ragged arenas (hypothesis): CPU always, CUDA when a device exists (under
MEMORYOS_GPU_REQUIRE_CUDA=1 a skip is a failure); and the native term splitter against the
Python tokenizer it restates."""

from __future__ import annotations

import hashlib
import math
import os
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from keyword_reference import term_words

from memoryos_gpu import _C, ops
from memoryos_gpu.arena import Arena, ArenaConfig
from memoryos_gpu.errors import ArenaError
from memoryos_gpu.lexical import date_words, page_terms, query_terms
from memoryos_gpu.ops.params import HeatParams
from memoryos_gpu.ops.retrieval import QueryTerms, RetrievalParams, credit_served, retrieve
from memoryos_gpu.ops.retrieval_reference import credit_served_ref, retrieve_ref, standardized
from memoryos_gpu.text.keywords import hash_keyword
from memoryos_gpu.text.unicode_ranges import UNSPACED_RANGES


def _cuda_available() -> bool:
    try:
        return bool(ops.build_info()["cuda_usable"])
    except Exception:
        return False


def _backend(name: str):
    if name == "cpu":
        return pytest.param("cpu", id="cpu")
    marks = [pytest.mark.cuda]
    if not _cuda_available() and os.environ.get("MEMORYOS_GPU_REQUIRE_CUDA") != "1":
        marks.append(pytest.mark.skip(reason="no CUDA device (MEMORYOS_GPU_REQUIRE_CUDA=1 fails)"))
    return pytest.param("cuda", id="cuda", marks=marks)


BACKENDS = [_backend("cpu"), _backend("cuda")]
TOL = {"cpu": 2e-4, "cuda": 5e-2}  # fused scores are z-scores: fp32 CPU, fp16 storage on GPU
# ... plus this times the query's conditioning (retrieval_reference.conditioning): fp32 moments
# of close scores (the best few BM25 scores of a short list) lose digits to cancellation
ROUNDING = {"cpu": 1e-5, "cuda": 2e-3}
VOCAB = 12  # a small vocabulary makes shared terms (and BM25 ties) common
# BM25 term ids (31-bit hashes, -1 pads): several alike modulo 1,024, so the CPU's 1,024-bit
# term filter lets page terms through that are no query term
TERM_IDS = np.array(
    [0, 1, 2, 1024, 1025, 2048, 63, 1087, 2**31 - 1, 2**31 - 1025, 7, 1031], np.int32
)


@dataclass
class World:
    arena: Arena
    q_emb: np.ndarray
    q_user: np.ndarray
    terms: QueryTerms
    params: RetrievalParams
    k: int


@st.composite
def worlds(draw, device: str = "cpu") -> World:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_users = draw(st.integers(1, 4))
    slots = draw(st.sampled_from([1, 3, 8, 40]))
    dim = draw(st.sampled_from([3, 16, 384]))
    kw_width = draw(st.integers(1, 6))
    arena = Arena(
        ArenaConfig(
            dim=dim,
            segment_slots=slots,
            keyword_width=kw_width,
            block_size=draw(st.integers(1, 4)),
            device=device,
            initial_users=1,
            initial_blocks=1,
            initial_owners=1,
            postings_min_pages=draw(st.sampled_from([0, 1, 3])),  # off, everyone, some users
        )
    )
    arena.add_users(n_users)
    live = rng.random((n_users, slots)) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    palette = rng.normal(size=(3, dim)).astype(np.float32)  # repeated vectors -> exact ties

    def vectors(n: int) -> np.ndarray:
        own = rng.normal(size=(n, dim)).astype(np.float32)
        return np.where(rng.random((n, 1)) < 0.3, palette[rng.integers(0, 3, n)], own)

    u, s = np.nonzero(live)
    kw = np.full((u.size, kw_width), -1, np.int32)
    for i in range(u.size):
        ids = rng.choice(VOCAB, size=int(rng.integers(0, kw_width + 1)), replace=False)
        kw[i, : ids.size] = ids
    arena.write_segments(u, s, vectors(u.size), kw, l_interaction=rng.integers(0, 3, u.size))
    n_pages = int(rng.integers(0, 6 * u.size + 1))
    seg_of = rng.integers(0, max(u.size, 1), n_pages)  # ragged: some segments get many pages
    if n_pages:
        pool = arena.append_pages(u[seg_of], s[seg_of], vectors(n_pages))
        counts = rng.integers(0, 5, n_pages)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        ids = np.concatenate(
            [np.sort(TERM_IDS[rng.choice(VOCAB, c, replace=False)]) for c in counts]
            or [np.zeros(0)]
        ).astype(np.int32)
        tf = rng.integers(1, 4, ids.size).astype(np.int32)
        length = np.add.reduceat(np.r_[tf, 0], offsets[:-1]) if ids.size else np.zeros(n_pages)
        length = np.where(counts > 0, length, 0) + rng.integers(0, 3, n_pages)
        arena.write_terms(pool, offsets, ids, tf, length.astype(np.int32))
        arena.delete_pages(pool[rng.random(n_pages) < 0.15])
    b = draw(st.one_of(st.integers(0, 6), st.just(40)))  # 40: a team's size (with team work 0)
    q_terms = [list(TERM_IDS[rng.permutation(VOCAB)[: int(rng.integers(0, 6))]]) for _ in range(b)]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in q_terms])]).astype(np.int64)
    ids = np.array([t for ts in q_terms for t in ts], np.int32)
    params = RetrievalParams(
        top_segments=draw(st.one_of(st.integers(1, 6), st.just(40))),  # above a warp
        keyword_weight=draw(st.sampled_from([0.0, 1.0, 2.5])),
        jaccard_terms=draw(st.integers(0, 6)),
        dense_floor=draw(st.sampled_from([-math.inf, 0.0, 0.1, 0.5])),
        lexical_weight=draw(st.sampled_from([0.0, 0.67, 1.0, 3.0])),
        lexical_candidates=draw(st.sampled_from([0, 1, 2, 5])),  # 1, 2: most users' lists cut
    )
    return World(
        arena,
        vectors(b),
        rng.integers(0, n_users, b).astype(np.int32),
        QueryTerms(offsets, ids),
        params,
        draw(st.sampled_from([1, 3, 10, 50])),
    )


def assert_ranked(full, got, tol: np.ndarray) -> None:
    """``full``: the reference ranking of every candidate. The kernel's top k must have the same
    padding, and at each position a page whose reference score is within ``tol`` (per query) of
    the reference's score there (the same page, or one of a near-tie that fp32 may order either
    way), each page once."""
    gs, gp, gg = (np.asarray(x.cpu() if hasattr(x, "cpu") else x) for x in got)
    k = gs.shape[1]
    ws, wp = full[0][:, :k], full[1][:, :k]
    np.testing.assert_array_equal(gp == -1, wp == -1)
    np.testing.assert_array_equal(np.isinf(gs), np.isinf(ws))
    fin = np.isfinite(ws)
    assert (np.abs(gs[fin] - ws[fin]) <= np.broadcast_to(tol[:, None], ws.shape)[fin]).all()
    for r in range(gs.shape[0]):
        score_of = dict(zip(full[1][r].tolist(), full[0][r].tolist(), strict=True))
        seg_of = dict(zip(full[1][r].tolist(), full[2][r].tolist(), strict=True))
        row = [p for p in gp[r].tolist() if p >= 0]
        assert len(set(row)) == len(row)
        for c, p in enumerate(row):
            assert p in score_of and abs(score_of[p] - ws[r, c]) <= tol[r], (r, c, gp[r], wp[r])
            assert gg[r, c] == seg_of[p]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_retrieve_matches_reference(backend, data) -> None:
    w = data.draw(worlds(backend))
    got = retrieve(w.arena, w.q_emb, w.q_user, w.terms, w.k, w.params)
    cond = np.zeros(w.q_user.size)
    full = retrieve_ref(w.arena, w.q_emb, w.q_user, w.terms, 10_000, w.params, cond)
    assert_ranked(full, got, TOL[backend] + ROUNDING[backend] * cond)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_postings_give_the_row_scans_results_to_the_bit(data) -> None:
    """Users with postings are scored from them, the others by scanning their pages' rows: the
    same integer df, N and lengths and fixed-point sums, so both give identical results."""
    w = data.draw(worlds("cpu"))
    lex = w.arena.lexical
    with_postings = retrieve(w.arena, w.q_emb, w.q_user, w.terms, w.k, w.params)
    postings, lex.postings = lex.postings, None
    try:
        scanned = retrieve(w.arena, w.q_emb, w.q_user, w.terms, w.k, w.params)
    finally:
        lex.postings = postings
    for a, b in zip(with_postings, scanned, strict=True):
        np.testing.assert_array_equal(a, b)


def _history(min_pages: int, pages: int) -> tuple[Arena, np.ndarray]:
    """One user whose segment holds ``pages`` pages, page i holding terms 1 (tf 1) and
    i + 2 (tf i % 3 + 1), one token more than its terms."""
    arena = Arena(
        ArenaConfig(dim=2, segment_slots=2, keyword_width=1, postings_min_pages=min_pages)
    )
    arena.add_users(1)
    arena.write_segments([0], [0], np.array([[1.0, 0.0]]), np.full((1, 1), -1))
    angle = np.linspace(0.0, 1.5, pages)
    pool = arena.append_pages(
        np.zeros(pages, np.int32),
        np.zeros(pages, np.int32),
        np.stack([np.cos(angle), np.sin(angle)], 1),
    )
    ids = np.stack([np.ones(pages), np.arange(pages) + 2], 1).astype(np.int32).ravel()
    tf = np.stack([np.ones(pages), np.arange(pages) % 3 + 1], 1).astype(np.int32).ravel()
    offsets = np.arange(pages + 1, dtype=np.int64) * 2
    arena.write_terms(pool, offsets, ids, tf, (tf.reshape(-1, 2).sum(1) + 1).astype(np.int32))
    return arena, pool


def test_postings_follow_rewrites_deletions_and_compaction() -> None:
    """A long history's postings stay right through what the engine does to rows: a page
    re-indexed (its row rewritten), pages deleted, the same slot rewritten thousands of times
    (stale postings compacted away), and a user below the threshold keeps scanning."""
    arena, pool = _history(min_pages=8, pages=40)
    twin, _ = _history(min_pages=0, pages=40)  # no postings: the row scan
    assert arena.lexical.postings.has(0) and twin.lexical.postings is None
    q = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)
    terms = QueryTerms(np.array([0, 2, 3]), np.array([1, 7, 30], np.int32))
    params = RetrievalParams(top_segments=1, dense_floor=0.99, lexical_candidates=5)

    def same() -> None:
        got = retrieve(arena, q, [0, 0], terms, 12, params)
        want = retrieve(twin, q, [0, 0], terms, 12, params)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)

    same()
    for a in (arena, twin):  # page 5 re-indexed: now it holds term 30, not 7
        a.write_terms(pool[5:6], np.array([0, 2]), np.array([1, 30]), np.array([1, 4]), [6])
        a.delete_pages(pool[10:20])
    same()
    for i in range(5000):  # one slot rewritten over and over: > 4,096 stale postings
        for a in (arena, twin):
            a.write_terms(pool[30:31], np.array([0, 2]), np.array([1, 7]), [1, i % 5 + 1], [9])
    assert arena.lexical.postings.nbytes() < 200_000  # compacted, not 5,000 dead entries
    same()
    for a in (arena, twin):  # down to 5 pages: the postings stay (they go at 0)
        a.delete_pages(pool[np.r_[0:5, 20:30, 31:40]])
    same()


def test_a_user_reaching_the_threshold_gets_postings_and_loses_them_when_emptied() -> None:
    arena, _ = _history(min_pages=40, pages=39)
    assert not arena.lexical.postings.has(0)
    extra = arena.append_pages([0], [0], np.array([[0.0, 1.0]]))
    arena.write_terms(extra, np.array([0, 1]), np.array([1]), np.array([2]), [3])
    assert arena.lexical.postings.has(0)
    arena.free_segments([0], [0])
    assert not arena.lexical.postings.has(0)


def test_postings_reject_bad_input() -> None:
    p = _C.Postings(2)
    p.grow_slots(4)
    one = np.array([0], np.int64)
    with pytest.raises(IndexError, match="outside"):
        p.write([0], [9], [0, 1], [5], [1])
    with pytest.raises(ValueError, match="offsets"):
        p.write([0], one, [0, 2], [5], [1])
    with pytest.raises(ValueError, match="pool"):
        p.build(0, one, np.zeros(3, np.int64), np.zeros(4, np.int32), [1], [1])
    with pytest.raises(ValueError, match="outside the term pool"):
        p.build(0, one, np.zeros(4, np.int64), np.full(4, 3, np.int32), [1], [1])
    with pytest.raises(ValueError, match="postings_min_pages"):
        ArenaConfig(dim=2, postings_min_pages=-1)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_thread_and_a_team_give_the_same_results(data) -> None:
    w = data.draw(worlds("cpu"))
    default = ops.build_info()["cpu_threads"]
    try:
        ops.set_cpu_threads(1)
        assert ops.build_info()["cpu_threads"] == 1
        one = retrieve(w.arena, w.q_emb, w.q_user, w.terms, w.k, w.params)
        ops.set_cpu_threads(4)  # more threads than this machine's cores is allowed
        ops.set_cpu_team_work(0)  # a team from 16 queries, whatever their work
        team = retrieve(w.arena, w.q_emb, w.q_user, w.terms, w.k, w.params)
    finally:
        ops.set_cpu_threads(None)
        ops.set_cpu_team_work(None)
    assert ops.build_info()["cpu_threads"] == default
    for x, y in zip(one, team, strict=True):
        np.testing.assert_array_equal(x, y)


def test_team_work_is_a_setting_that_results_ignore() -> None:
    assert ops.build_info()["cpu_team_work"] == 1_500_000
    with pytest.raises(ValueError, match="team work"):
        ops.set_cpu_team_work(-1)


def test_cpu_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        ops.set_cpu_threads(0)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), tau=st.sampled_from([0.5, 2.0, 5.0]))
def test_credit_served_matches_reference(backend, data, tau) -> None:
    w = data.draw(worlds(backend))
    _, _, segs = retrieve(w.arena, w.q_emb, w.q_user, w.terms, w.k, w.params)
    segs_h = np.asarray(segs.cpu() if hasattr(segs, "cpu") else segs)
    a = w.arena
    stats = {n: a.host(n).copy() for n in ("n_visit", "l_interaction", "last_access")}
    stats["live"] = a.host("seg_live")
    now = np.linspace(10.0, 20.0, w.q_user.size)
    p = HeatParams(tau=tau)
    want = credit_served_ref(stats, w.q_user, segs_h, now, p)
    got = credit_served(a, w.q_user, segs, now, p)
    for x, y in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(y.cpu() if hasattr(y, "cpu") else y), x)
    np.testing.assert_array_equal(a.host("n_visit"), stats["n_visit"])
    np.testing.assert_array_equal(a.host("last_access"), stats["last_access"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_queries_of_one_batch_see_a_shared_segment_after_every_credit(backend) -> None:
    """Two queries of one user in one batch serve the same segment: together their visits lift
    its heat to tau (one alone would not), and both positions are flagged on every backend, as
    the CUDA threads of a batch have no order (the CPU once flagged only the second query)."""
    arena = Arena(
        ArenaConfig(dim=2, segment_slots=2, keyword_width=1, initial_users=1, device=backend)
    )
    arena.add_users(1)
    emb = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    arena.write_segments([0, 0], [0, 1], emb, np.full((2, 1), -1), l_interaction=[1, 1])
    arena.append_pages([0, 0], [0, 1], emb)
    q = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]], np.float32)
    terms = QueryTerms(np.zeros(4, np.int64), np.zeros(0, np.int32))
    _, _, segs = retrieve(arena, q, [0, 0, 0], terms, 1, RetrievalParams(top_segments=1))
    # heat = N_visit + L_interaction + recency 1: 3 after one visit, 4 after two
    credited, promote = credit_served(arena, [0, 0, 0], segs, 100.0, HeatParams(tau=3.5))
    host = [np.asarray(x.cpu() if hasattr(x, "cpu") else x) for x in (segs, credited, promote)]
    assert host[0][:, 0].tolist() == [0, 0, 1]
    assert host[1][:, 0].tolist() == [1, 1, 1]
    assert host[2][:, 0].tolist() == [1, 1, 0]  # slot 1: one visit, heat 3
    assert arena.host("n_visit")[0].tolist() == [2, 1]
    np.testing.assert_allclose(arena.host("heat")[0], [4.0, 3.0])


def test_matching_page_ranks_above_a_non_matching_one() -> None:
    """The defect of standardising each list alone: the lowest BM25 candidate scored the same 0
    as a page BM25 did not return. Here page A (cosine 0.9, matches the term) and page B (cosine
    0.9, no match) differ only in the match: A must come first, by the full BM25 spread."""
    arena = Arena(ArenaConfig(dim=2, segment_slots=2, keyword_width=1, initial_users=1))
    arena.add_users(1)
    e = np.array([[0.9, math.sqrt(1 - 0.81)]], np.float32)
    arena.write_segments([0, 0], [0, 1], np.repeat(e, 2, 0), np.full((2, 1), -1))
    pool = arena.append_pages([0, 0], [0, 1], np.repeat(e, 2, 0))
    arena.write_terms(pool[:1], np.array([0, 1]), np.array([7]), np.array([1]), np.array([3]))
    q = np.array([[1.0, 0.0]], np.float32)
    terms = QueryTerms(np.array([0, 1]), np.array([7], np.int32))
    scores, slots, _ = retrieve(arena, q, [0], terms, 2, RetrievalParams(top_segments=2))
    assert slots.tolist() == [[int(pool[0]), int(pool[1])]]
    assert scores[0, 0] > scores[0, 1]


def test_near_equal_bm25_scores_do_not_outvote_a_clear_cosine() -> None:
    """The quick start's marathon case: three pages match the only query term with BM25 scores
    within 4 % of each other; the page with by far the best cosine must rank first."""
    arena = Arena(ArenaConfig(dim=3, segment_slots=6, keyword_width=1, initial_users=1))
    arena.add_users(1)
    cos = np.array([0.697, 0.568, 0.515, 0.355, 0.346, 0.30])
    emb = np.stack([cos, np.sqrt(1 - cos**2), np.zeros(6)], 1).astype(np.float32)
    arena.write_segments([0] * 6, range(6), emb, np.full((6, 1), -1))
    pool = arena.append_pages([0] * 6, range(6), emb)
    # pages 0, 1 and 5 contain the term once; page 0 is a little longer
    match = [0, 1, 5]
    arena.write_terms(
        pool[match], np.array([0, 1, 2, 3]), np.array([9, 9, 9]), np.ones(3), np.array([9, 8, 8])
    )
    q = np.array([[1.0, 0.0, 0.0]], np.float32)
    terms = QueryTerms(np.array([0, 1]), np.array([9], np.int32))
    _, slots, _ = retrieve(arena, q, [0], terms, 3, RetrievalParams(top_segments=5))
    assert int(slots[0, 0]) == int(pool[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bm25_scores_equal_in_exact_arithmetic_contribute_nothing(backend) -> None:
    """tf 1 in 1 token and tf 3 in 5 tokens (mean length 3) have the same BM25 in exact
    arithmetic, but float32 rounds the two formulas an ulp apart. Standardising that residue
    once made a full +-1 spread of it (the reference test's rare failure): the lexical signal
    must count as flat, and the fused scores be the standardised cosines alone."""
    n = 4
    arena = Arena(
        ArenaConfig(dim=2, segment_slots=n, keyword_width=1, initial_users=1, device=backend)
    )
    arena.add_users(1)
    angle = np.linspace(0.1, 0.8, n)
    emb = np.stack([np.cos(angle), np.sin(angle)], 1).astype(np.float32)
    arena.write_segments([0] * n, range(n), emb, np.full((n, 1), -1))
    pool = arena.append_pages([0] * n, range(n), emb)
    tf, length = np.array([1, 3, 1, 3]), np.array([1, 5, 1, 5])
    arena.write_terms(pool, np.arange(n + 1), np.full(n, 7), tf, length)
    q = np.array([[1.0, 0.0]], np.float32)
    terms = QueryTerms(np.array([0, 1]), np.array([7], np.int32))
    scores, slots, _ = retrieve(arena, q, [0], terms, n, RetrievalParams(top_segments=n))
    scores, slots = (np.asarray(x.cpu() if hasattr(x, "cpu") else x) for x in (scores, slots))
    assert slots[0].tolist() == pool.tolist()  # by cosine, the first page first
    want = standardized(emb.astype(np.float64) @ np.array([1.0, 0.0]))
    np.testing.assert_allclose(scores[0], want, atol=TOL[backend])


@pytest.mark.parametrize(
    "cap, listed", [(0, {1, 2, 3, 4, 5}), (1, {3, 4}), (2, {3, 4}), (3, {2, 3, 4})]
)
def test_the_lexical_list_keeps_the_best_bm25_pages_and_their_ties(cap, listed) -> None:
    """A long history where a common word matches most pages must not make every page a
    candidate: with ``lexical_candidates`` = L only the L best BM25 pages join the top
    segments' pages, and pages tied at the L-th score stay together (tf 3, 3: both or none)."""
    n = 6
    arena = Arena(ArenaConfig(dim=2, segment_slots=n, keyword_width=1, initial_users=1))
    arena.add_users(1)
    angle = np.linspace(0.0, 1.2, n)  # page 0 alone in the best segment; the rest further off
    emb = np.stack([np.cos(angle), np.sin(angle)], 1).astype(np.float32)
    arena.write_segments([0] * n, range(n), emb, np.full((n, 1), -1))
    pool = arena.append_pages([0] * n, range(n), emb)
    tf = np.array([1, 2, 3, 3, 1])  # pages 1..5 hold term 7, equally long
    arena.write_terms(pool[1:], np.arange(6), np.full(5, 7), tf, np.full(5, 4))
    q = np.array([[1.0, 0.0]], np.float32)
    terms = QueryTerms(np.array([0, 1]), np.array([7], np.int32))
    params = RetrievalParams(top_segments=1, lexical_candidates=cap, dense_floor=0.0)
    _, slots, _ = retrieve(arena, q, [0], terms, n, params)
    got = {int(x) for x in slots[0] if x >= 0}
    assert got == {int(pool[0])} | {int(pool[i]) for i in listed}


def test_users_without_pages_and_k_above_the_candidates_are_padded() -> None:
    arena = Arena(ArenaConfig(dim=2, segment_slots=2, keyword_width=1, initial_users=2))
    arena.add_users(2)
    arena.write_segments([1], [0], np.array([[1.0, 0.0]]), np.full((1, 1), -1))
    pool = arena.append_pages([1], [0], np.array([[1.0, 0.0]]))
    q = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)
    terms = QueryTerms(np.array([0, 0, 0]), np.zeros(0, np.int32))
    scores, slots, segs = retrieve(arena, q, [0, 1], terms, 4, RetrievalParams())
    assert slots.tolist() == [[-1] * 4, [int(pool[0]), -1, -1, -1]]
    assert segs.tolist()[1] == [0, -1, -1, -1]
    assert np.isneginf(scores[0]).all() and scores[1, 0] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda a, t: retrieve(a, np.zeros((1, 3)), [0], t, 2, RetrievalParams()), ArenaError),
        (
            lambda a, t: retrieve(a, np.full((1, 2), np.nan), [0], t, 2, RetrievalParams()),
            ArenaError,
        ),
        (lambda a, t: retrieve(a, np.ones((1, 2)), [5], t, 2, RetrievalParams()), ArenaError),
        (lambda a, t: retrieve(a, np.ones((1, 2)), [0], t, 0, RetrievalParams()), ArenaError),
        (
            lambda a, t: retrieve(
                a,
                np.ones((1, 2)),
                [0],
                QueryTerms(np.array([0, 3]), np.zeros(1)),
                2,
                RetrievalParams(),
            ),
            ArenaError,
        ),
        (lambda a, t: RetrievalParams(top_segments=0), ArenaError),
        (lambda a, t: RetrievalParams(lexical_weight=-1.0), ArenaError),
        (lambda a, t: RetrievalParams(lexical_candidates=-1), ArenaError),
        (lambda a, t: RetrievalParams(dense_floor=math.nan), ArenaError),
    ],
)
def test_bad_input_raises_clear_errors(call, error) -> None:
    arena = Arena(ArenaConfig(dim=2, segment_slots=2, keyword_width=1, initial_users=1))
    arena.add_users(1)
    with pytest.raises(error):
        call(arena, QueryTerms(np.array([0, 0]), np.zeros(0, np.int32)))


# ------------------------------------------------------------------------ the term splitter
WORDS = st.text(
    alphabet=st.sampled_from(
        [
            *"abcXYZ019 '’.,-_\n\t",
            *["é", "É", "ß", "İ", "ﬁ", "Ω", "日", "本", "١", "ǅ", "½", "\u0301"],
            # unspaced letters and their marks, Indic vowel signs and viramas, harakat, a dot
            *["の", "カ", "ー", "ก", "ั", "\u0e48", "\u3099", "म", "\u0948", "\u094d"],
            *["ق", "\u064e", "\u0307"],
        ]
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(WORDS, max_size=6))
def test_native_terms_equal_the_python_tokenizer(texts) -> None:
    """Every page's row is the sorted set of the ids of its words (``keyword_reference.
    term_words``: the tokenizer's, less the stopwords of the text's language) with counts."""
    got = page_terms(texts, None)
    for i, text in enumerate(texts):
        toks = term_words(text)
        ids = [hash_keyword(t) for t in toks]
        want = sorted(set(ids))
        row_ids, row_tf, length = got.row(i)
        assert row_ids.tolist() == want
        assert row_tf.tolist() == [ids.count(x) for x in want]
        assert length == len(toks)


def test_query_terms_keep_first_occurrence_order_and_cap() -> None:
    t = query_terms(["Marathon training: the marathon date", "", "a dog and a cat"])
    ids = [t.ids[t.offsets[i] : t.offsets[i + 1]].tolist() for i in range(3)]
    assert ids[0] == [hash_keyword(w) for w in ("marathon", "training", "date")]
    assert ids[1] == [] and ids[2] == [hash_keyword("dog"), hash_keyword("cat")]  # stopwords
    long = query_terms([" ".join(f"w{i}" for i in range(1000))])
    assert long.offsets[1] == 256 and long.ids[0] == hash_keyword("w0")


def test_term_ids_stay_right_when_words_share_a_cache_entry() -> None:
    """The splitter keeps each thread's hashed words in a direct-mapped cache of 32,768
    entries: 140,000 distinct words (most entries taken by several), split twice, and words
    too long for an entry, give BLAKE2b ids every time."""
    words = [f"w{i}" for i in range(139_000)] + [f"long{'x' * 30}{i}" for i in range(1000)]
    texts = [" ".join(words[i : i + 1000]) for i in range(0, len(words), 1000)]
    for _ in range(2):
        t = page_terms(texts, None)
        for i in (0, 69, 130, 139):  # before, around and after the clear
            want = sorted(hash_keyword(w) for w in words[i * 1000 : (i + 1) * 1000])
            assert t.row(i)[0].tolist() == want


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_term_id_is_blake2b(word) -> None:
    data = word.encode("utf-8", "surrogatepass")
    want = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & 0x7FFFFFFF
    try:
        word.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates never reach the splitter (the engine replaces them)
    assert _C.term_id(word) == want


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-62_135_596_800, max_value=253_402_300_799, allow_nan=False))
def test_native_date_words_equal_python(ts) -> None:
    assert " ".join(_C.date_words(ts)) == date_words(ts).lower()


@settings(max_examples=300, deadline=None)
@given(
    st.floats(min_value=-62_135_596_800, max_value=253_402_300_799, allow_nan=False)
    | st.integers(-720_000, 2_900_000).map(lambda d: d * 86_400.0 - 1e-6)  # a day's last instant
)
def test_date_words_are_each_instants_utc_date(ts) -> None:
    """Cached by UTC day, the words are still the instant's own date's."""
    try:
        dt = datetime.fromtimestamp(ts, tz=UTC)
    except (OverflowError, OSError, ValueError):
        assert date_words(ts) == ""
        return
    assert date_words(ts) == f"{dt:%A} {dt.day} {dt:%B %Y}"


def test_date_words_out_of_range_and_pages_get_them() -> None:
    assert _C.date_words(1e300) == [] and _C.date_words(math.inf) == []
    assert date_words(1e300) == date_words(math.inf) == date_words(math.nan) == ""
    ts = datetime(2023, 5, 8, 13, 56, tzinfo=UTC).timestamp()
    row = page_terms(["Caroline went"], [ts]).row(0)
    words = ["caroline", "went", "monday", "8", "may", "2023"]
    assert row[0].tolist() == sorted(hash_keyword(w) for w in words)


def _q_tokens(c: str) -> int:
    """Tokens of "q" + c + "q": three around a letter of an unspaced script (a run of one
    letter is a token), one when c joins or continues the word (a letter or digit, a
    combining mark, an apostrophe), else two."""
    if any(a <= ord(c) < b for a, b in UNSPACED_RANGES):
        return 3
    return 1 if c.isalnum() or unicodedata.category(c)[0] == "M" or c in "'\u2019" else 2


def test_unicode_table_matches_this_python() -> None:
    """The native word test is Python's str.isalnum, the mark test its category M*, and the
    unspaced letters those of memoryos_gpu/text/unicode_ranges.py (generated tables;
    regenerate them with scripts/gen_unicode_table.py when the Unicode version changes)."""
    from pathlib import Path

    from memoryos_gpu.lexical import _splitter

    inc = Path(__file__).resolve().parents[1] / "csrc/include/memoryos/unicode_tables.inc"
    version = inc.read_text().split('MOS_UNICODE_VERSION "')[1].split('"')[0]
    if version != unicodedata.unidata_version:
        pytest.skip(f"table is Unicode {version}, this Python has {unicodedata.unidata_version}")
    chars = [chr(c) for c in range(1, 0x110000) if not 0xD800 <= c < 0xE000]
    _, _, _, length = _splitter().split("\x00".join(f"q{c}q" for c in chars), len(chars))
    want = np.array([_q_tokens(c) for c in chars])
    np.testing.assert_array_equal(length, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e-30, 1e20])
def test_cosines_of_extreme_magnitudes_are_exact(backend, scale) -> None:
    """A page of v x 1e20 has a squared norm above FLT_MAX, one of v x 1e-30 below the normal
    range; both are still cosine 1 with v (the power-of-two rescale, as in the other kernels).
    On a GPU the rows are stored as bfloat16, whose range is fp32's."""
    arena = Arena(
        ArenaConfig(dim=384, segment_slots=2, keyword_width=1, device=backend, gpu_dtype="bfloat16")
    )
    arena.add_users(1)
    v = np.random.default_rng(0).normal(size=(1, 384)).astype(np.float32)
    v /= np.linalg.norm(v)
    arena.write_segments([0], [0], v, np.full((1, 1), -1))
    pool = arena.append_pages([0], [0], v * np.float32(scale))
    terms = QueryTerms(np.array([0, 0]), np.zeros(0, np.int32))
    scores, slots, _ = retrieve(
        arena, v * np.float32(1e25), [0], terms, 1, RetrievalParams(lexical_weight=0.0)
    )
    host = np.asarray(scores.cpu() if hasattr(scores, "cpu") else scores)
    assert int(np.asarray(slots.cpu() if hasattr(slots, "cpu") else slots)[0, 0]) == pool[0]
    assert host[0, 0] == pytest.approx(1.0, abs=TOL[backend])

"""Fusion of the dense and BM25 signals: properties of the rule (``fuse_union``, the reference
the kernels are tested against) on generated candidates, and how the engine applies it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.engine.page_text import page_terms_of
from memoryos_gpu.ops.retrieval_reference import bm25_scores, fuse_union, standardized

# candidates of one query: (cosine, BM25) pairs, cosines in [-1, 1], BM25 >= 0 on a grid of
# quarters (finite and moderate, as they are; the grid keeps distinct scores apart)
pair = st.tuples(
    st.integers(-40, 40).map(lambda i: i / 40), st.integers(0, 80).map(lambda i: i / 4)
)
candidates = st.lists(pair, min_size=1, max_size=30)
weight_st = st.floats(min_value=0.05, max_value=20, allow_nan=False, allow_infinity=False)


def split(cands):
    return np.array([c for c, _ in cands]), np.array([b for _, b in cands])


@settings(max_examples=300, deadline=None)
@given(
    cands=candidates,
    w=weight_st,
    scale=st.floats(min_value=1e-3, max_value=1e3),
    offset=st.floats(min_value=-100, max_value=100),
)
def test_fusion_ignores_each_signals_scale_and_offset(cands, w, scale, offset):
    """A BM25 score and a cosine live on unrelated scales: a positive affine change of either
    signal changes no fused score. (The shift is in units of the scale: one that dwarfs a
    signal's spread below float32's resolution makes it flat, ``is_flat``.)"""
    cos, bm = split(cands)
    shift = offset * scale
    want = fuse_union(cos, bm, w)
    np.testing.assert_allclose(fuse_union(cos, bm * scale + shift, w), want, atol=1e-6)
    np.testing.assert_allclose(fuse_union(cos * scale + shift, bm, w), want, atol=1e-6)


@settings(max_examples=300, deadline=None)
@given(cands=candidates, w=weight_st, scale=st.floats(min_value=1e-3, max_value=1e3))
def test_a_signal_equal_on_every_candidate_contributes_exactly_nothing(cands, w, scale):
    """The flaky case of the earlier rule: equal scores times 0.001 have a standard deviation
    that is a rounding residue, not 0. Equality is decided on the values, so such a signal adds
    exactly 0 whatever its scale, and the ranking is the other signal's."""
    cos, _ = split(cands)
    flat = np.full(cos.size, 0.75) * scale
    fused = fuse_union(cos, flat, w)
    np.testing.assert_array_equal(fused, standardized(cos))
    assert not standardized(flat).any()


@settings(max_examples=300, deadline=None)
@given(cands=candidates, w=weight_st, cos=st.integers(-40, 40).map(lambda i: i / 40))
def test_a_matching_page_ranks_above_a_non_matching_one(cands, w, cos):
    """Two candidates with the same cosine, one matching a query term (BM25 > 0) and one not:
    the matching one scores strictly higher, by w times its BM25 z-distance, whatever the rest
    of the candidates. (The earlier rule gave a list's lowest candidate the score of a page the
    list lacked.)"""
    c, b = split(cands)
    c = np.r_[c, cos, cos]
    b = np.r_[b, max(b.min(), 0.25), 0.0]  # the matching one has the lowest positive BM25
    fused = fuse_union(c, b, w)
    assert fused[-2] > fused[-1]


@settings(max_examples=200, deadline=None)
@given(cands=candidates, w=weight_st, c=st.floats(min_value=0.1, max_value=10))
def test_fusion_depends_on_the_weights_ratio_only(cands, w, c):
    cos, bm = split(cands)
    order = np.lexsort((np.arange(cos.size), -fuse_union(cos, bm, w)))
    scaled = standardized(cos) * c + c * w * standardized(bm)
    assert (np.lexsort((np.arange(cos.size), -scaled)) == order).all()


def test_without_the_lexical_signal_the_score_is_the_cosine():
    cos = np.array([0.3, 0.9, -0.2])
    np.testing.assert_array_equal(fuse_union(cos, np.array([5.0, 0.0, 1.0]), 0.0), cos)


# ------------------------------------------------------------------------------ in the engine

COS = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]  # cosine of page i with the query
QUERY = "where did we go in zanzibar"  # "zanzibar" is the only word of it a page holds
WORDS = ["quiet morning", "long lunch", "rainy evening", "busy week", "zanzibar", "zanzibar"]


def _texts():
    return [f"day {i} {w}" + (" zanzibar" if i == 5 else "") for i, w in enumerate(WORDS)]


def _pages_engine(make_engine, kit, **memory):
    """Six MTM pages with known cosines to QUERY's vector; the two least similar ones name a
    rare place (the last one twice), so BM25 matches pages 5 and 4 only, 5 first."""
    emb = kit.TableEmbedder(dim=8)
    emb.table[QUERY] = [1.0] + [0.0] * 7
    eng = make_engine(
        mode="extractive",
        stm_capacity=1,
        top_segments=200,
        embed_dates=False,
        embedder=emb,
        **memory,
    )
    for i, (c, text) in enumerate(zip(COS, _texts(), strict=True)):
        emb.table[f"User: {text} Assistant: ok"] = [c, math.sqrt(1 - c * c)] + [0.0] * 6
        eng.add("u", text, "ok", timestamp=float(i + 1))
    eng.add("u", "filler stays in STM", "ok", timestamp=10.0)
    return eng


def _ranked(eng, query, k=6):
    r = eng.retrieve_many([("u", query)], top_pages=k, update_heat=False)[0]
    index = {p.page_id: int(p.user_input.split()[1]) for p in r.pages}
    return [index[p.page_id] for p in r.pages], [p.score for p in r.pages]


def _bm25():
    """BM25 of the six pages for "zanzibar" (the reference's formula, their own term rows)."""
    t = page_terms_of([(text, "ok", float(i + 1), {}) for i, text in enumerate(_texts())])
    from memoryos_gpu.text.keywords import hash_keyword

    return bm25_scores([t.row(i) for i in range(6)], [hash_keyword("zanzibar")], 1.2, 0.75)


def test_lexical_weight_zero_is_the_dense_pipeline(make_engine, kit):
    eng = _pages_engine(make_engine, kit, lexical_weight=0.0)
    order, scores = _ranked(eng, QUERY)  # the rare word changes nothing
    assert order == [0, 1, 2, 3, 4, 5]
    assert scores == pytest.approx(COS, abs=kit.score_tol(1e-5))


def test_a_dominant_bm25_puts_every_matching_page_first(make_engine, kit):
    """At a large BM25 weight both pages naming the place come first, best BM25 first, then the
    rest by cosine. (The earlier rule scored page 4, its list's lowest candidate, like a page
    the list lacked, and ranked it last.)"""
    order, _ = _ranked(_pages_engine(make_engine, kit, lexical_weight=50.0), QUERY)
    assert order == [5, 4, 0, 1, 2, 3]


@pytest.mark.parametrize("weight", [0.3, 0.67, 1.5])
def test_engine_scores_are_the_fused_standardised_scores(make_engine, kit, weight):
    order, scores = _ranked(_pages_engine(make_engine, kit, lexical_weight=weight), QUERY)
    want = fuse_union(np.array(COS), np.array(_bm25()), weight)
    want_by_page = pytest.approx(dict(enumerate(want)), abs=kit.score_tol(1e-4))
    assert dict(zip(order, scores, strict=True)) == want_by_page
    assert order == sorted(range(6), key=lambda i: -want[i])


@pytest.mark.parametrize("cap, want", [(0, {4, 5}), (1, {5}), (2, {4, 5})])
def test_lexical_candidates_bounds_the_bm25_list(make_engine, kit, cap, want):
    """``lexical_candidates`` reaches the pass: with no page close enough for the dense path
    (floor 1.0), the pages returned are the BM25 list, the best ``cap`` of the two matches."""
    eng = _pages_engine(make_engine, kit, relevance_floor=1.0, lexical_candidates=cap)
    order, _ = _ranked(eng, QUERY)
    assert set(order) == want

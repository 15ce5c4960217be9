"""Fusion of the dense and BM25 page rankings: properties of ``zscore_fusion`` and
``reciprocal_rank_fusion`` on generated lists, and how the engine wires them (``lexical_weight``,
``fusion``)."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.lexical import reciprocal_rank_fusion, zscore_fusion

# (id, score) lists: unique ids, scores on a grid of quarters in [-50, 50] (as cosines and BM25
# scores are, finite and moderate; the grid keeps distinct scores apart beyond rounding)
scores_st = st.integers(-200, 200).map(lambda i: i / 4)
scored_list = st.dictionaries(st.integers(0, 40), scores_st, max_size=25).map(
    lambda d: list(d.items())
)
weight_st = st.floats(min_value=0.05, max_value=20, allow_nan=False, allow_infinity=False)


def as_dict(fused):
    return dict(fused)


def is_best_first(fused):
    return all((-a[1], a[0]) <= (-b[1], b[0]) for a, b in pairwise(fused))


# ------------------------------------------------------------------------------- zscore_fusion


@settings(max_examples=200, deadline=None)
@given(dense=scored_list, lexical=scored_list, w=weight_st)
def test_zscore_fusion_is_every_candidate_once_best_first(dense, lexical, w):
    fused = zscore_fusion([(dense, 1.0), (lexical, w)])
    ids = [p for p, _ in fused]
    assert len(ids) == len(set(ids))
    assert set(ids) == {p for p, _ in dense} | {p for p, _ in lexical}
    assert is_best_first(fused)
    assert all(s >= 0 and math.isfinite(s) for _, s in fused)


@settings(max_examples=200, deadline=None)
@given(
    dense=scored_list,
    lexical=scored_list,
    w=weight_st,
    scale=st.floats(min_value=1e-3, max_value=1e3),
    shift=st.floats(min_value=-100, max_value=100),
)
def test_zscore_fusion_ignores_each_lists_scale_and_offset(dense, lexical, w, scale, shift):
    """A BM25 score and a cosine live on unrelated scales: a positive affine change of one
    list's scores changes nothing fused."""
    before = as_dict(zscore_fusion([(dense, 1.0), (lexical, w)]))
    moved = [(p, s * scale + shift) for p, s in lexical]
    after = as_dict(zscore_fusion([(dense, 1.0), (moved, w)]))
    assert after.keys() == before.keys()
    for pid, s in before.items():
        assert after[pid] == pytest.approx(s, rel=1e-6, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(dense=scored_list, lexical=scored_list, w=weight_st, c=st.floats(0.01, 100))
def test_zscore_fusion_depends_on_the_weights_ratio_only(dense, lexical, w, c):
    a = as_dict(zscore_fusion([(dense, 1.0), (lexical, w)]))
    b = as_dict(zscore_fusion([(dense, c), (lexical, c * w)]))
    assert b.keys() == a.keys()
    for pid, s in a.items():
        assert b[pid] == pytest.approx(c * s, rel=1e-6, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(dense=scored_list, lexical=scored_list)
def test_weight_zero_or_empty_list_keeps_the_other_lists_order(dense, lexical):
    by_score = [p for p, _ in sorted(dense, key=lambda t: (-t[1], t[0]))]
    assert [p for p, _ in zscore_fusion([(dense, 1.0), (lexical, 0.0)])] == by_score
    assert [p for p, _ in zscore_fusion([(dense, 1.0), ([], 3.0)])] == by_score
    assert [p for p, _ in zscore_fusion([(dense, 1.0)])] == by_score
    assert zscore_fusion([(dense, 0.0), (lexical, -1.0)]) == []


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n_lists=st.integers(1, 3),
    weights=st.lists(weight_st, min_size=3, max_size=3),
)
def test_a_page_at_least_as_good_everywhere_ranks_above(data, n_lists, weights):
    """Dominance: if page a scores at least as high as page b in every list that holds b (and
    is in it), and strictly higher in a list with spread, a ranks above b."""
    lists = [data.draw(scored_list) for _ in range(n_lists)]
    fused = zscore_fusion(list(zip(lists, weights, strict=False)))
    rank = {p: i for i, (p, _) in enumerate(fused)}
    ids = sorted(rank)
    for a in ids:
        for b in ids:
            if a == b:
                continue
            dominates, strictly = True, False
            for lst in lists:
                d = dict(lst)
                if b in d and (a not in d or d[a] < d[b]):
                    dominates = False
                    break
                if a not in d:
                    continue
                spread = len(set(d.values())) > 1
                if b in d:
                    strictly |= spread and d[a] > d[b]
                else:  # absent scores as the list's lowest candidate
                    strictly |= not spread or d[a] > min(d.values())
            if dominates and strictly:
                assert rank[a] < rank[b], (a, b, lists)


def test_zscore_fusion_values_and_ties():
    dense = [(1, 0.9), (2, 0.5), (3, 0.1)]  # std 0.3266: (s - 0.1) / std
    lexical = [(3, 12.0), (4, 2.0)]  # std 5: (s - 2) / 5
    fused = as_dict(zscore_fusion([(dense, 1.0), (lexical, 1.0)]))
    std = float(np.std([0.9, 0.5, 0.1]))
    assert fused[1] == pytest.approx(0.8 / std)
    assert fused[2] == pytest.approx(0.4 / std)
    assert fused[3] == pytest.approx(0.0 + 10.0 / 5.0)
    assert fused[4] == pytest.approx(0.0)
    # mirror-image lists tie everywhere: lower id first
    mirror = zscore_fusion([([(7, 1.0), (3, 0.0)], 1.0), ([(3, 5.0), (7, 2.0)], 1.0)])
    assert [p for p, _ in mirror] == [3, 7] and mirror[0][1] == mirror[1][1]


def test_a_list_without_spread_still_counts_its_pages():
    """One BM25 match (a rare name) cannot be standardised; it scores 1, above absent pages."""
    dense = [(1, 0.30), (2, 0.20), (3, 0.10)]
    fused = as_dict(zscore_fusion([(dense, 1.0), ([(9, 4.2)], 2.0)]))
    assert fused[9] == pytest.approx(2.0) and fused[3] == pytest.approx(0.0)
    equal = as_dict(zscore_fusion([([(5, 0.7), (6, 0.7)], 1.0)]))
    assert equal == {5: 1.0, 6: 1.0}


# ----------------------------------------------------------------------- reciprocal_rank_fusion


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(0, 30), unique=True, max_size=20),
    b=st.lists(st.integers(0, 30), unique=True, max_size=20),
    w=weight_st,
)
def test_rrf_scores_and_order(a, b, w):
    fused = reciprocal_rank_fusion([(a, 1.0), (b, w)])
    assert {p for p, _ in fused} == set(a) | set(b)
    assert is_best_first(fused)
    for pid, s in fused:
        want = (1 / (60 + a.index(pid) + 1) if pid in a else 0.0) + (
            w / (60 + b.index(pid) + 1) if pid in b else 0.0
        )
        assert s == pytest.approx(want)
    assert [p for p, _ in reciprocal_rank_fusion([(a, 1.0), (b, 0.0)])] == a


# ------------------------------------------------------------------------------ in the engine

COS = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]  # cosine of page i with the query
QUERY = "where did we go in zanzibar"  # "zanzibar" is the only word of it a page holds


def _pages_engine(make_engine, kit, **memory):
    """Six MTM pages with known cosines to QUERY's vector; the two least similar ones name a
    rare place (the last one twice), so BM25 holds pages 5 and 4 only, 5 first."""
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
    words = ["quiet morning", "long lunch", "rainy evening", "busy week", "zanzibar", "zanzibar"]
    for i, (c, w) in enumerate(zip(COS, words, strict=True)):
        text = f"day {i} {w}" + (" zanzibar" if i == 5 else "")
        emb.table[f"User: {text} Assistant: ok"] = [c, math.sqrt(1 - c * c)] + [0.0] * 6
        eng.add("u", text, "ok", timestamp=float(i + 1))
    eng.add("u", "filler stays in STM", "ok", timestamp=10.0)
    return eng


def _ranked(eng, query, k=6):
    r = eng.retrieve_many([("u", query)], top_pages=k, update_heat=False)[0]
    index = {p.page_id: int(p.user_input.split()[1]) for p in r.pages}
    return [index[p.page_id] for p in r.pages], [p.score for p in r.pages]


def test_lexical_weight_zero_is_the_dense_pipeline(make_engine, kit):
    eng = _pages_engine(make_engine, kit, lexical_weight=0.0)
    assert eng.lexical is None
    order, scores = _ranked(eng, QUERY)  # the rare word changes nothing
    assert order == [0, 1, 2, 3, 4, 5]
    assert scores == pytest.approx(COS, abs=1e-5)


@pytest.mark.parametrize(
    ("memory", "want"),
    [
        # z-scores, equal weights: page 5 (cosine lowest, BM25 best: +2 units) passes pages 2-4
        ({"lexical_weight": 1.0}, [0, 1, 5, 2, 3, 4]),
        # BM25 dominating: its best page first; its other page is its lowest candidate, which
        # scores as a page it lacks, so the cosines order the rest
        ({"lexical_weight": 50.0}, [5, 0, 1, 2, 3, 4]),
        # the earlier rule, reciprocal rank at BM25 weight 5 and 1: dense ranks 6 + 1 and 5 + 2
        # beat rank 1 alone
        ({"fusion": "rrf", "lexical_weight": 5.0}, [5, 4, 0, 1, 2, 3]),
        ({"fusion": "rrf", "lexical_weight": 1.0}, [5, 4, 0, 1, 2, 3]),
    ],
)
def test_engine_fuses_dense_and_bm25(make_engine, kit, memory, want):
    eng = _pages_engine(make_engine, kit, **memory)
    order, scores = _ranked(eng, QUERY)
    assert order == want
    assert scores == sorted(scores, reverse=True)


def test_engine_zscore_scores_are_the_fused_standardised_scores(make_engine, kit):
    eng = _pages_engine(make_engine, kit, lexical_weight=0.5)
    order, scores = _ranked(eng, QUERY)
    std = float(np.std(COS))
    dense = {i: (c - min(COS)) / std for i, c in enumerate(COS)}
    # BM25: two candidates, so (s - lowest) / std = 2 for the better one, 0 for the other
    want = {i: dense[i] + (0.5 * 2.0 if i == 5 else 0.0) for i in range(6)}
    assert dict(zip(order, scores, strict=True)) == pytest.approx(want, abs=1e-4)

"""Plain NumPy specification of the fused retrieval pass and the heat credit of served pages.

Slow and obvious: one Python loop per query, float64 arithmetic. The tests compare
:mod:`memoryos_gpu.ops.retrieval` (C++ and CUDA) with it; the steps and formulas follow
``csrc/include/memoryos/retrieval.h`` line by line.
"""

from __future__ import annotations

import math

import numpy as np

from memoryos_gpu.arena import NO_ID, Arena
from memoryos_gpu.ops.params import HeatParams
from memoryos_gpu.ops.reference import cosine_ref, heat_ref, jaccard_ref
from memoryos_gpu.ops.retrieval import QueryTerms, RetrievalParams


def user_pages(arena: Arena, user: int) -> list[tuple[int, int]]:
    """(pool slot, segment slot) of every live page of the user's live segments, in the order
    the kernels walk them (segment slot, then position)."""
    live, page_live = arena.host("seg_live"), arena.host("page_live")
    out = []
    for s in np.flatnonzero(live[user]).tolist():
        for slot in arena.segment_pages(user, s).tolist():
            if page_live[slot]:
                out.append((slot, s))
    return out


#: Relative slack under the L-th highest BM25 (``kLexicalTieSlack`` in retrieval.h).
LEXICAL_TIE_SLACK = 1e-5


def bm25_scores(
    rows: list[tuple[np.ndarray, np.ndarray, int]], terms: list[int], k1: float, b: float
) -> list[float]:
    """BM25 of each page row for the query terms, with df, N and the mean length over ``rows``."""
    n = len(rows)
    if not n or not terms:
        return [0.0] * n
    total = sum(length for _, _, length in rows)
    avg = total / n if total > 0 else 1.0
    sets = [dict(zip(ids.tolist(), tf.tolist(), strict=True)) for ids, tf, _ in rows]
    df = {t: sum(t in s for s in sets) for t in terms}
    out = []
    for s, (_, _, length) in zip(sets, rows, strict=True):
        fixed = 0  # the terms' sum in fixed point, 2^-32 steps (order-free: retrieval.h)
        for t in terms:
            if t in s:
                idf = math.log(1.0 + (n - df[t] + 0.5) / (df[t] + 0.5))
                tf = s[t]
                term = idf * tf * (k1 + 1.0) / (tf + k1 * (1.0 - b + b * length / avg))
                fixed += math.floor(term * 2.0**32 + 0.5)
        out.append(fixed / 2.0**32)
    return out


def lexical_floor(scores: list[float], cap: int) -> float:
    """The lowest BM25 that makes the lexical list: every positive score when at most ``cap``
    pages match (or ``cap`` is 0), else the ``cap``-th highest less the tie slack (a near-tie
    that fp32 kernels and this float64 reference could order either way stays together)."""
    positive = sorted((x for x in scores if x > 0), reverse=True)
    if cap == 0 or len(positive) <= cap:
        return 0.0
    return positive[cap - 1] * (1.0 - LEXICAL_TIE_SLACK)


#: A signal whose spread is within this fraction of its magnitude is flat (``kFlatSpread`` in
#: retrieval.h): scores equal in exact arithmetic come out of fp32 formulas an ulp apart, and
#: standardising that residue would make a full +-1 spread of it.
FLAT_SPREAD = 1e-5


def is_flat(x: np.ndarray) -> bool:
    """Whether a signal counts as equal on every candidate (``flat_spread`` in retrieval.h)."""
    x = np.asarray(x, np.float64)
    return x.size == 0 or x.max() - x.min() <= FLAT_SPREAD * float(np.abs(x).max())


def standardized(x: np.ndarray) -> np.ndarray:
    """``(x - mean) / std`` over the candidates; exactly 0 for a flat signal (``is_flat``)."""
    x = np.asarray(x, np.float64)
    if is_flat(x):
        return np.zeros_like(x)
    return (x - x.mean()) / x.std()


def fuse_union(cosine: np.ndarray, lexical: np.ndarray, lexical_weight: float) -> np.ndarray:
    """The fused score of each candidate of the union: both signals standardised over the
    union, weighted, summed; without the lexical signal, the cosine itself."""
    if lexical_weight <= 0:
        return np.asarray(cosine, np.float64)
    return standardized(cosine) + lexical_weight * standardized(lexical)


def conditioning(cosine: np.ndarray, lexical: np.ndarray, lexical_weight: float) -> float:
    """How many times a relative rounding error of the inputs the fused scores can move: for
    each standardised signal, its weight times max|x| / std(x) (0 without fusion, or for a flat
    signal). Candidates whose scores are close together against their size (the best few BM25
    scores, say) are ill-conditioned: fp32 kernels agree with this float64 reference only to
    about 1e-7 times this."""
    if lexical_weight <= 0:
        return 0.0
    out = 0.0
    for x, weight in ((np.asarray(cosine, np.float64), 1.0), (np.asarray(lexical), lexical_weight)):
        if not is_flat(x):
            out += weight * float(np.abs(x).max() / x.std())
    return out


def retrieve_ref(
    arena: Arena,
    q_emb,
    q_user,
    terms: QueryTerms,
    k: int,
    p: RetrievalParams,
    cond: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pass for each query in turn; ``cond`` (float [B]), when given, receives each query's
    :func:`conditioning`."""
    seg_emb, seg_kw, seg_live = arena.host("seg_emb"), arena.host("seg_kw"), arena.host("seg_live")
    page_emb = arena.host("page_emb")
    q_emb = np.asarray(q_emb, np.float32)
    b_n = q_emb.shape[0]
    scores = np.full((b_n, k), -np.inf, np.float32)
    pages = np.full((b_n, k), NO_ID, np.int32)
    segs = np.full((b_n, k), NO_ID, np.int32)
    for b, u in enumerate(np.asarray(q_user).tolist()):
        q = q_emb[b]
        qt = terms.ids[terms.offsets[b] : terms.offsets[b + 1]].tolist()
        kq = np.array(sorted(qt[: p.jaccard_terms]) or [-1], np.int32)
        seg_pairs = [
            (cosine_ref(q, seg_emb[u, s]) + p.keyword_weight * jaccard_ref(kq, seg_kw[u, s]), s)
            for s in np.flatnonzero(seg_live[u]).tolist()
        ]
        chosen = {s for _, s in sorted(seg_pairs, key=lambda t: (-t[0], t[1]))[: p.top_segments]}
        walk = user_pages(arena, u)
        lexical = p.lexical_weight > 0 and bool(qt)
        lex = (
            bm25_scores(arena.lexical.rows_of([s for s, _ in walk]), qt, p.bm25_k1, p.bm25_b)
            if lexical
            else [0.0] * len(walk)
        )
        floor = lexical_floor(lex, p.lexical_candidates)
        cand = []  # (slot, segment, cosine, bm25)
        for (slot, s), lx in zip(walk, lex, strict=True):
            listed = lx > 0 and lx >= floor
            if s not in chosen and not listed:
                continue
            cos = cosine_ref(q, page_emb[slot])
            if listed or cos >= p.dense_floor:
                cand.append((slot, s, cos, lx))
        if not cand:
            continue
        signals = np.array([c[2] for c in cand]), np.array([c[3] for c in cand])
        weight = p.lexical_weight if lexical else 0.0
        fused = fuse_union(*signals, weight)
        if cond is not None:
            cond[b] = conditioning(*signals, weight)
        order = sorted(range(len(cand)), key=lambda i: (-fused[i], cand[i][0]))[:k]
        for j, i in enumerate(order):
            scores[b, j], pages[b, j], segs[b, j] = fused[i], cand[i][0], cand[i][1]
    return scores, pages, segs


def credit_served_ref(
    stats: dict[str, np.ndarray], q_user, segments, now, p: HeatParams
) -> tuple[np.ndarray, np.ndarray]:
    """In place on host copies (``n_visit``, ``l_interaction``, ``last_access``, ``live``):
    returns (credited, promote) [B, k] as the kernel does: every credit of the batch first,
    then each credited position's heat and flag from the credited statistics."""
    segments = np.asarray(segments)
    credited = np.zeros(segments.shape, np.uint8)
    promote = np.zeros(segments.shape, np.uint8)
    now = np.broadcast_to(np.asarray(now, np.float64), (segments.shape[0],))
    users = np.asarray(q_user).tolist()
    for b, u in enumerate(users):
        seen: set[int] = set()
        for j, s in enumerate(segments[b].tolist()):
            if s < 0 or s in seen or not stats["live"][u, s]:
                continue
            seen.add(s)
            stats["n_visit"][u, s] += 1
            stats["last_access"][u, s] = max(stats["last_access"][u, s], now[b])
            credited[b, j] = 1
    for b, j in zip(*np.nonzero(credited), strict=True):
        u, s = users[b], int(segments[b, j])
        n, inter, last = (stats[k][u, s] for k in ("n_visit", "l_interaction", "last_access"))
        h = float(heat_ref(p, n, inter, now[b], last))
        promote[b, j] = np.float32(h) >= np.float32(p.tau) and inter > 0
    return credited, promote

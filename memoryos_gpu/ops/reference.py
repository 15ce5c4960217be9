"""Plain NumPy specification of every kernel: slow, obvious, and the oracle the tests compare to.

Each function takes the same arguments as its counterpart in :mod:`memoryos_gpu.ops` and
returns the same outputs. Formulas follow ``csrc/include/memoryos/formulas.h`` line by line.
"""

from __future__ import annotations

import numpy as np

from memoryos_gpu.arena import KEYWORD_PAD, NO_ID, Arena
from memoryos_gpu.ops.params import HeatParams


def keyword_set(row: np.ndarray) -> set[int]:
    """The ids of a padded keyword row, up to its first pad."""
    out: set[int] = set()
    for v in np.asarray(row).tolist():
        if v == KEYWORD_PAD:
            break
        out.add(int(v))
    return out


def jaccard_ref(a: np.ndarray, b: np.ndarray) -> float:
    sa, sb = keyword_set(a), keyword_set(b)
    if not sa or not sb:
        return 0.0
    return len(sa & sb) / len(sa | sb)


def cosine_ref(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    denom = np.linalg.norm(a64) * np.linalg.norm(b64)
    return float(a64 @ b64 / denom) if denom > 0 else 0.0


def _topk(pairs: list[tuple[float, int]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Higher score first, then lower id; padded with -inf / -1."""
    pairs = sorted(pairs, key=lambda p: (-p[0], p[1]))[:k]
    scores = np.full(k, -np.inf, dtype=np.float32)
    ids = np.full(k, NO_ID, dtype=np.int32)
    for j, (s, i) in enumerate(pairs):
        scores[j], ids[j] = s, i
    return scores, ids


def score_segments_ref(arena: Arena, q_emb, q_user, q_kw, m: int, keyword_weight: float = 1.0):
    seg_emb, seg_kw, live = arena.host("seg_emb"), arena.host("seg_kw"), arena.host("seg_live")
    q_emb, q_kw = np.asarray(q_emb, np.float32), np.asarray(q_kw, np.int32)
    out_s, out_i = [], []
    for b, u in enumerate(np.asarray(q_user).tolist()):
        pairs = [
            (
                cosine_ref(q_emb[b], seg_emb[u, s])
                + keyword_weight * jaccard_ref(q_kw[b], seg_kw[u, s]),
                s,
            )
            for s in range(live.shape[1])
            if live[u, s]
        ]
        s_, i_ = _topk(pairs, m)
        out_s.append(s_)
        out_i.append(i_)
    return _stack(out_s, out_i, m)


def select_pages_ref(arena: Arena, q_emb, q_user, chosen, k: int, min_score: float = -np.inf):
    page_emb, page_live = arena.host("page_emb"), arena.host("page_live")
    q_emb = np.asarray(q_emb, np.float32)
    out_s, out_i = [], []
    for b, u in enumerate(np.asarray(q_user).tolist()):
        pairs = []
        for s in np.asarray(chosen[b]).tolist():
            if s < 0:
                continue
            for slot in arena.segment_pages(u, s).tolist():
                if not page_live[slot]:
                    continue
                score = cosine_ref(q_emb[b], page_emb[slot])
                if score >= min_score:
                    pairs.append((score, slot))
        s_, i_ = _topk(pairs, k)
        out_s.append(s_)
        out_i.append(i_)
    return _stack(out_s, out_i, k)


def heat_ref(p: HeatParams, n_visit, l_interaction, now, last_access):
    dt = np.maximum(np.asarray(now, np.float64) - np.asarray(last_access, np.float64), 0.0)
    return p.alpha * n_visit + p.beta * l_interaction + p.gamma * np.exp(-dt / p.mu)


def apply_hits_ref(stats: dict[str, np.ndarray], hit_user, hit_slot, hit_now) -> None:
    """In-place on host copies: stats holds n_visit, last_access and live ([U, S] each)."""
    for u, s, t in zip(
        np.asarray(hit_user).tolist(),
        np.asarray(hit_slot).tolist(),
        np.asarray(hit_now).tolist(),
        strict=True,
    ):
        if stats["live"][u, s]:
            stats["n_visit"][u, s] += 1
            stats["last_access"][u, s] = max(stats["last_access"][u, s], t)


def recompute_heat_ref(
    stats: dict[str, np.ndarray],
    users,
    now,
    need_evict,
    p: HeatParams,
    evict_by_visits: bool = False,
):
    """Returns (heat rows [n, S], promote [n, S] bool, evict slot [n])."""
    users = np.asarray(users)
    heats, promote, evict = [], [], []
    for r, u in enumerate(users.tolist()):
        live = stats["live"][u].astype(bool)
        h = heat_ref(
            p, stats["n_visit"][u], stats["l_interaction"][u], now[r], stats["last_access"][u]
        ).astype(np.float32)
        heats.append(np.where(live, h, 0.0))
        promote.append(live & (h >= np.float32(p.tau)))
        key = stats["n_visit"][u].astype(np.float32) if evict_by_visits else h
        candidates = [(float(key[s]), s) for s in np.flatnonzero(live).tolist()]
        victim = min(candidates)[1] if (candidates and need_evict[r]) else NO_ID
        evict.append(victim)
    s = stats["live"].shape[1]
    return (
        np.array(heats, np.float32).reshape(-1, s),
        np.array(promote, bool).reshape(-1, s),
        np.array(evict, np.int32),
    )


def knowledge_topk_ref(arena: Arena, q_emb, q_owner, k: int):
    kn_emb, kn_live = arena.host("kn_emb"), arena.host("kn_live")
    q_emb = np.asarray(q_emb, np.float32)
    out_s, out_i = [], []
    for b, o in enumerate(np.asarray(q_owner).tolist()):
        pairs = [
            (cosine_ref(q_emb[b], kn_emb[o, e]), e)
            for e in range(kn_live.shape[1])
            if kn_live[o, e]
        ]
        s_, i_ = _topk(pairs, k)
        out_s.append(s_)
        out_i.append(i_)
    return _stack(out_s, out_i, k)


def _stack(scores: list, ids: list, k: int) -> tuple[np.ndarray, np.ndarray]:
    if not scores:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int32)
    return np.stack(scores), np.stack(ids)

"""Plain NumPy specification of every kernel: slow, obvious, and the oracle the tests compare to.

Two layers. The ``*_raw_ref`` functions take the kernels' own arrays (exactly what
``memoryos_gpu._C`` receives, embeddings as float32 values of whatever was stored) and define
the result for *every* input, inside the contract or not: unsorted keyword rows and duplicate
ids (set semantics), out-of-range slots (padded rows, skipped segments), non-finite queries
(padded rows), NaN scores (ranked as -inf), a segment chosen twice (counted once). The arena
functions (``score_segments_ref`` ...) take the same arguments as :mod:`memoryos_gpu.ops` and
call the raw ones on the arena's host copies. Formulas follow
``csrc/include/memoryos/formulas.h``; cosines are computed in float64.
"""

from __future__ import annotations

import numpy as np

from memoryos_gpu.arena import KEYWORD_PAD, NO_ID, Arena
from memoryos_gpu.ops.params import HeatParams


def keyword_set(row: np.ndarray) -> set[int]:
    """The keyword set of a row: its distinct ids before the first pad, in any order."""
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


def cosines_ref(q: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """cos(q, rows[i]) for every row, in float64: 0 where either vector is zero, NaN where a
    row holds NaN or infinity. Each vector is first divided by its largest |component|, so no
    finite input overflows or underflows, whatever its magnitude."""
    q64 = np.asarray(q, np.float64)
    r64 = np.asarray(rows, np.float64).reshape(-1, q64.shape[-1])
    with np.errstate(invalid="ignore", over="ignore"):
        scale = np.max(np.abs(r64), axis=1, keepdims=True, initial=0.0)
        unit = np.divide(r64, scale, out=np.zeros_like(r64), where=scale > 0)
        unit[~np.isfinite(scale[:, 0])] = np.nan
        q_max = np.max(np.abs(q64), initial=0.0)
        qu = q64 / q_max if q_max > 0 else q64
        # elementwise products summed per row, not a BLAS matrix-vector product: identical rows
        # must get identical cosines (exact ties), and BLAS kernels differ across positions
        denom = np.sqrt((unit * unit).sum(axis=1)) * np.sqrt((qu * qu).sum())
        cos = (unit * qu).sum(axis=1) / np.where(denom > 0, denom, 1.0)
    return np.where(denom > 0, cos, np.where(np.isnan(denom), np.nan, 0.0))


def topk_ref(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Higher score first, then lower id; NaN ranks as -inf; padded with -inf / -1."""
    s = np.where(np.isnan(scores), -np.inf, np.asarray(scores, np.float64))
    order = np.lexsort((np.asarray(ids), -s))[:k]
    out_s = np.full(k, -np.inf, dtype=np.float32)
    out_i = np.full(k, NO_ID, dtype=np.int32)
    out_s[: order.size] = s[order]
    out_i[: order.size] = np.asarray(ids)[order]
    return out_s, out_i


def _topk(pairs: list[tuple[float, int]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`topk_ref` over (score, id) pairs."""
    if not pairs:
        return topk_ref(np.zeros(0), np.zeros(0, np.int32), k)
    s, i = zip(*pairs, strict=True)
    return topk_ref(np.array(s, np.float64), np.array(i, np.int32), k)


def _finite_query(q: np.ndarray) -> bool:
    return bool(np.isfinite(q).all())


# ---------------------------------------------------------------------- raw kernels
def score_segments_raw_ref(
    q_emb, q_user, q_kw, seg_emb, seg_kw, seg_live, m: int, keyword_weight: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Top-m live slots of each query's user by cos + w * Jaccard (keyword sets)."""
    q_emb, seg_emb = np.asarray(q_emb, np.float32), np.asarray(seg_emb, np.float32)
    q_kw = np.asarray(q_kw, np.int32)
    n_users = seg_live.shape[0]
    out_s, out_i = [], []
    for b, u in enumerate(np.asarray(q_user).tolist()):
        if not (0 <= u < n_users and _finite_query(q_emb[b])):
            out_s.append(np.full(m, -np.inf, np.float32))
            out_i.append(np.full(m, NO_ID, np.int32))
            continue
        live = np.flatnonzero(seg_live[u])
        cos = cosines_ref(q_emb[b], seg_emb[u, live])
        qset = keyword_set(q_kw[b])
        jac = np.array([_jaccard_sets(qset, keyword_set(seg_kw[u, s])) for s in live.tolist()])
        s_, i_ = topk_ref(cos + keyword_weight * jac.reshape(cos.shape), live, m)
        out_s.append(s_)
        out_i.append(i_)
    return _stack(out_s, out_i, m)


def _jaccard_sets(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a and b else 0.0


def segment_page_slots(
    npages: int, table_row: np.ndarray, block_size: int, num_pages: int
) -> np.ndarray:
    """Pool slots of a segment's pages in order (capped at its table), without invalid ones."""
    n = min(max(int(npages), 0), table_row.shape[0] * block_size)
    i = np.arange(n)
    block = np.asarray(table_row, np.int64)[i // block_size]
    slot = block * block_size + i % block_size
    return slot[(block >= 0) & (slot < num_pages)]


def select_pages_raw_ref(
    q_emb,
    q_user,
    chosen,
    page_emb,
    page_live,
    seg_npages,
    block_table,
    block_size: int,
    min_score: float,
    k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k live pages by cosine inside each query's chosen segments (each counted once)."""
    q_emb, page_emb = np.asarray(q_emb, np.float32), np.asarray(page_emb, np.float32)
    n_users, slots = seg_npages.shape
    out_s, out_i = [], []
    for b, u in enumerate(np.asarray(q_user).tolist()):
        cand: list[np.ndarray] = []
        if 0 <= u < n_users and _finite_query(q_emb[b]):
            for s in dict.fromkeys(np.asarray(chosen[b]).tolist()):  # first occurrences, in order
                if 0 <= s < slots:
                    cand.append(
                        segment_page_slots(
                            seg_npages[u, s], block_table[u, s], block_size, page_emb.shape[0]
                        )
                    )
        pool = np.concatenate(cand) if cand else np.zeros(0, np.int64)
        pool = pool[page_live[pool].astype(bool)]
        score = cosines_ref(q_emb[b], page_emb[pool]) if pool.size else np.zeros(0)
        score = np.where(np.isnan(score), -np.inf, score)
        keep = ~(score < min_score)
        s_, i_ = topk_ref(score[keep], pool[keep].astype(np.int32), k)
        out_s.append(s_)
        out_i.append(i_)
    return _stack(out_s, out_i, k)


def knowledge_topk_raw_ref(q_emb, q_owner, kn_emb, kn_live, k: int):
    """Top-k live ring slots of each query's owner by cosine."""
    q_emb, kn_emb = np.asarray(q_emb, np.float32), np.asarray(kn_emb, np.float32)
    out_s, out_i = [], []
    for b, o in enumerate(np.asarray(q_owner).tolist()):
        if not (0 <= o < kn_live.shape[0] and _finite_query(q_emb[b])):
            out_s.append(np.full(k, -np.inf, np.float32))
            out_i.append(np.full(k, NO_ID, np.int32))
            continue
        live = np.flatnonzero(kn_live[o])
        s_, i_ = topk_ref(cosines_ref(q_emb[b], kn_emb[o, live]), live, k)
        out_s.append(s_)
        out_i.append(i_)
    return _stack(out_s, out_i, k)


# ---------------------------------------------------------------------- arena kernels
def score_segments_ref(arena: Arena, q_emb, q_user, q_kw, m: int, keyword_weight: float = 1.0):
    q_emb = np.asarray(q_emb, np.float32)
    q_kw = np.asarray(q_kw if q_kw is not None else np.zeros((q_emb.shape[0], 0)), np.int32)
    return score_segments_raw_ref(
        q_emb,
        q_user,
        q_kw,
        arena.host("seg_emb"),
        arena.host("seg_kw"),
        arena.host("seg_live"),
        m,
        keyword_weight,
    )


def select_pages_ref(arena: Arena, q_emb, q_user, chosen, k: int, min_score: float = -np.inf):
    return select_pages_raw_ref(
        q_emb,
        q_user,
        np.asarray(chosen),
        arena.host("page_emb"),
        arena.host("page_live"),
        arena.host("seg_npages"),
        arena.host("block_table"),
        arena.config.block_size,
        min_score,
        k,
    )


def knowledge_topk_ref(arena: Arena, q_emb, q_owner, k: int):
    return knowledge_topk_raw_ref(q_emb, q_owner, arena.host("kn_emb"), arena.host("kn_live"), k)


def heat_ref(p: HeatParams, n_visit, l_interaction, now, last_access):
    dt = np.maximum(np.asarray(now, np.float64) - np.asarray(last_access, np.float64), 0.0)
    return p.alpha * n_visit + p.beta * l_interaction + p.gamma * np.exp(-dt / p.mu)


def apply_hits_ref(stats: dict[str, np.ndarray], hit_user, hit_slot, hit_now) -> None:
    """In-place on host copies: stats holds n_visit, last_access and live ([U, S] each).
    Hits on out-of-range slots or dead segments are skipped."""
    n_users, slots = stats["live"].shape
    for u, s, t in zip(
        np.asarray(hit_user).tolist(),
        np.asarray(hit_slot).tolist(),
        np.asarray(hit_now).tolist(),
        strict=True,
    ):
        if 0 <= u < n_users and 0 <= s < slots and stats["live"][u, s]:
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
    """Returns (heat rows [n, S], promote [n, S] bool, evict slot [n]); an out-of-range user
    gets zeros, no promotion and -1."""
    users = np.asarray(users)
    n_users, s = stats["live"].shape
    heats, promote, evict = [], [], []
    for r, u in enumerate(users.tolist()):
        if not 0 <= u < n_users:
            heats.append(np.zeros(s, np.float32))
            promote.append(np.zeros(s, bool))
            evict.append(NO_ID)
            continue
        live = stats["live"][u].astype(bool)
        h = heat_ref(
            p, stats["n_visit"][u], stats["l_interaction"][u], now[r], stats["last_access"][u]
        ).astype(np.float32)
        heats.append(np.where(live, h, 0.0))
        promote.append(live & (h >= np.float32(p.tau)))
        key = stats["n_visit"][u].astype(np.float32) if evict_by_visits else h
        candidates = [(float(key[j]), j) for j in np.flatnonzero(live).tolist()]
        victim = min(candidates)[1] if (candidates and need_evict[r]) else NO_ID
        evict.append(victim)
    return (
        np.array(heats, np.float32).reshape(-1, s),
        np.array(promote, bool).reshape(-1, s),
        np.array(evict, np.int32),
    )


def _stack(scores: list, ids: list, k: int) -> tuple[np.ndarray, np.ndarray]:
    if not scores:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int32)
    return np.stack(scores), np.stack(ids)

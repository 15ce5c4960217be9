"""The fused retrieval pass and the heat credit of served pages (``memoryos/retrieval.h``).

:func:`retrieve` runs, for a batch of queries, everything between the query embedding and the
ranked pages in one native call: segment scores (cos + Jaccard) and the top m, BM25 over each
user's MTM pages from the arena's lexical index, the fusion of both candidate sets and the top k.
:func:`credit_served` then folds the served pages into their segments' heat. On a CUDA arena both
run on the device, queued on the current stream: nothing is copied back and nothing waits until
the caller reads the outputs.

Inputs are checked where that costs no device round trip: queries (finite, shaped) on the host
before they are uploaded; slots and offsets on the host. Stored embeddings are checked where
they are written (:class:`~memoryos_gpu.arena.Arena`), not on every query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memoryos_gpu.arena import Arena
from memoryos_gpu.errors import ArenaError
from memoryos_gpu.ops import _per_row
from memoryos_gpu.ops.params import HeatParams

#: Distinct terms of one query the pass uses (the rest of a very long query is ignored).
MAX_QUERY_TERMS = 256


@dataclass(frozen=True)
class RetrievalParams:
    """How the pass ranks (``MemoryConfig`` holds the defaults and their reasons)."""

    top_segments: int = 5
    keyword_weight: float = 1.0
    jaccard_terms: int = 8
    dense_floor: float = 0.1
    lexical_weight: float = 1.0
    lexical_candidates: int = 0
    bm25_k1: float = 1.2
    bm25_b: float = 0.75

    def __post_init__(self) -> None:
        if self.top_segments < 1:
            raise ArenaError("top_segments must be >= 1")
        if self.jaccard_terms < 0 or self.lexical_candidates < 0:
            raise ArenaError("jaccard_terms and lexical_candidates must be >= 0")
        if not (np.isfinite(self.keyword_weight) and np.isfinite(self.lexical_weight)):
            raise ArenaError("keyword_weight and lexical_weight must be finite")
        if self.lexical_weight < 0 or np.isnan(self.dense_floor):
            raise ArenaError("lexical_weight must be >= 0 and dense_floor not NaN")


@dataclass(frozen=True)
class QueryTerms:
    """Each query's distinct term ids in order of first occurrence (CSR)."""

    offsets: np.ndarray  # int64 [B + 1]
    ids: np.ndarray  # int32 [offsets[-1]]


def _native() -> Any:
    from memoryos_gpu.ops import _native as native

    return native()


def _host_queries(arena: Arena, emb: Any) -> np.ndarray:
    a = np.require(np.asarray(emb, dtype=np.float32), requirements=("C", "W"))
    if a.ndim != 2 or a.shape[1] != arena.config.dim:
        raise ArenaError(f"q_emb must be [B, {arena.config.dim}], got {a.shape}")
    if not np.isfinite(a).all():
        raise ArenaError("q_emb contains NaN or infinity")
    return a


def _terms(terms: QueryTerms, batch: int) -> tuple[np.ndarray, np.ndarray]:
    off = np.require(np.asarray(terms.offsets, np.int64), requirements=("C", "W"))
    ids = np.require(np.asarray(terms.ids, np.int32), requirements=("C", "W"))
    if off.shape != (batch + 1,) or off[0] != 0 or off[-1] != ids.size or (np.diff(off) < 0).any():
        raise ArenaError("query term offsets must be [B + 1], from 0 to len(ids), non-decreasing")
    if (np.diff(off) > MAX_QUERY_TERMS).any():
        raise ArenaError(f"a query has more than {MAX_QUERY_TERMS} terms")
    return off, ids


def retrieve(
    arena: Arena,
    q_emb: Any,
    q_user: Any,
    terms: QueryTerms,
    k: int,
    params: RetrievalParams,
) -> tuple[Any, Any, Any]:
    """Top-``k`` pages per query: ``(fused scores [B, k], pool slots [B, k], segment slots
    [B, k])``, best first, padded with ``-inf`` / ``-1``; arrays on the arena's device."""
    q = _host_queries(arena, q_emb)
    users = np.require(np.asarray(q_user, np.int32), requirements=("C", "W"))
    if users.shape != (q.shape[0],):
        raise ArenaError(f"q_user must be [{q.shape[0]}] user slots")
    arena.check_users(users)
    off, ids = _terms(terms, q.shape[0])
    if int(k) < 1:
        raise ArenaError(f"k must be >= 1, got {k}")
    b = q.shape[0]
    lex = arena.lexical
    dev = arena.device_array
    if arena.on_cuda:
        import torch

        device = arena.seg_emb.device
        out = (
            torch.empty((b, k), dtype=torch.float32, device=device),
            torch.empty((b, k), dtype=torch.int32, device=device),
            torch.empty((b, k), dtype=torch.int32, device=device),
        )
        width = max(1, arena.page_positions(users))
        scratch = torch.empty((b, 2 * width), dtype=torch.float32, device=device)
        stream = int(torch.cuda.current_stream(device).cuda_stream)
    else:
        out = (
            np.empty((b, k), np.float32),
            np.empty((b, k), np.int32),
            np.empty((b, k), np.int32),
        )
        scratch, stream = None, 0
    _native().retrieve(
        dev(q),
        dev(users),
        dev(off),
        dev(ids),
        arena.seg_emb,
        arena.seg_kw,
        arena.seg_live,
        arena.page_emb,
        arena.page_live,
        arena.seg_npages,
        arena.block_table,
        arena.config.block_size,
        lex.start,
        lex.count,
        lex.length,
        lex.terms,
        lex.tf,
        params.top_segments,
        float(params.keyword_weight),
        params.jaccard_terms,
        float(params.dense_floor),
        float(params.lexical_weight),
        int(params.lexical_candidates),
        float(params.bm25_k1),
        float(params.bm25_b),
        *out,
        scratch,
        stream,
        lex.postings,
    )
    return out


def credit_served(
    arena: Arena, q_user: Any, segments: Any, now: Any, params: HeatParams
) -> tuple[Any, Any]:
    """Fold served pages into heat: each query's distinct served segments get ``N_visit += 1``
    and ``last_access = max(last_access, now)``, and their heat recomputed. Returns
    ``(credited [B, k], promote [B, k])`` as uint8: 1 at the first position of each credited
    segment, and where that segment's heat reached tau with pages not yet analysed.

    The queries of one batch are concurrent, not ordered: promotion flags read each segment's
    heat after every credit of the batch (two queries of a user that share a segment both see
    both visits), which the CUDA path can give without ordering its threads."""
    users = np.require(np.asarray(q_user, np.int32), requirements=("C", "W"))
    arena.check_users(users)
    now_arr = _per_row(now, np.float64, users.shape)
    if not np.isfinite(now_arr).all():
        raise ArenaError("now must be finite")
    b, k = users.shape[0], int(segments.shape[1])
    dev = arena.device_array
    if arena.on_cuda:
        import torch

        device = arena.seg_emb.device
        credited = torch.empty((b, k), dtype=torch.uint8, device=device)
        promote = torch.empty((b, k), dtype=torch.uint8, device=device)
        stream = int(torch.cuda.current_stream(device).cuda_stream)
    else:
        credited, promote, stream = np.empty((b, k), np.uint8), np.empty((b, k), np.uint8), 0
    _native().credit_served(
        dev(users),
        segments,
        dev(now_arr),
        arena.n_visit,
        arena.l_interaction,
        arena.last_access,
        arena.heat,
        arena.seg_live,
        params.alpha,
        params.beta,
        params.gamma,
        float(params.mu),
        params.tau,
        credited,
        promote,
        stream,
    )
    return credited, promote


def to_host(arena: Arena, *arrays: Any) -> list[np.ndarray]:
    """Kernel outputs as NumPy arrays. On a CUDA arena every copy is queued on the stream and
    the stream is waited for once: one synchronisation per batch, at the end."""
    if not arena.on_cuda:
        return [np.asarray(a) for a in arrays]
    import torch

    copies = [a.to("cpu", non_blocking=True) for a in arrays]
    torch.cuda.current_stream(arena.seg_emb.device).synchronize()
    return [c.numpy() for c in copies]

"""Public kernel API: one function per kernel, dispatched on where the arena lives.

Every function validates its inputs (shapes, dtypes, NaN, unknown slots, k < 1) with a clear
Python exception before anything native runs, allocates outputs on the arena's device, and calls
the C++ (CPU) or CUDA implementation in :mod:`memoryos_gpu._C`. Outputs are fixed ``[B, k]``
arrays padded with ``-inf`` scores and ``-1`` ids, ranked by score then lower id.

The backend follows the arena: a CPU arena runs the OpenMP loops, a CUDA arena the CUDA kernels.
``MEMORYOS_GPU_DEVICE`` only chooses where new engines put their arena (see ``env.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memoryos_gpu.arena import Arena, normalize_keyword_rows
from memoryos_gpu.errors import ArenaError, NativeUnavailableError
from memoryos_gpu.ops.params import HeatParams

__all__ = [
    "HeatParams",
    "apply_hits",
    "build_info",
    "knowledge_topk",
    "match_segments",
    "recompute_heat",
    "score_segments",
    "select_pages",
]


def _native() -> Any:
    try:
        from memoryos_gpu import _C
    except ImportError as exc:  # pragma: no cover - only without a build
        raise NativeUnavailableError(
            "memoryos_gpu._C is not built: install the package with `pip install .` "
            "(scikit-build-core compiles csrc/)"
        ) from exc
    return _C


def build_info() -> dict[str, Any]:
    """What was compiled and what is usable now.

    Keys: ``cpu`` (always True), ``openmp``, ``cpu_threads``, ``cuda_compiled``,
    ``cuda_device_count``, ``cuda_usable`` (compiled and a device present), ``cuda_archs``,
    ``version``.
    """
    info = dict(_native().build_info())
    info["cuda_usable"] = bool(info["cuda_compiled"] and info["cuda_device_count"] > 0)
    return info


# ---------------------------------------------------------------------- input normalisation
def _queries(arena: Arena, emb: Any, name: str = "q_emb") -> Any:
    """Queries as float32 [B, d] on the arena's device, finite."""
    if arena.on_cuda:
        import torch

        t = torch.as_tensor(emb, dtype=torch.float32, device=arena.seg_emb.device)
        if t.ndim != 2 or t.shape[1] != arena.config.dim:
            raise ArenaError(f"{name} must be [B, {arena.config.dim}], got {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise ArenaError(f"{name} contains NaN or infinity")
        return t.contiguous()
    a = _writable(np.asarray(emb, dtype=np.float32))
    if a.ndim != 2 or a.shape[1] != arena.config.dim:
        raise ArenaError(f"{name} must be [B, {arena.config.dim}], got {a.shape}")
    if not np.isfinite(a).all():
        raise ArenaError(f"{name} contains NaN or infinity")
    return a


def _host_int(values: Any, name: str, batch: int | None = None, ndim: int = 1) -> np.ndarray:
    a = np.asarray(values.cpu() if hasattr(values, "cpu") else values)
    if a.size and a.dtype.kind not in "iu":
        raise ArenaError(f"{name} must hold integers, got dtype {a.dtype}")
    a = _writable(a.astype(np.int32, copy=False))
    if a.ndim != ndim or (batch is not None and a.shape[0] != batch):
        raise ArenaError(f"{name} must have {ndim} dimension(s) and {batch} rows, got {a.shape}")
    return a


def _writable(a: np.ndarray) -> np.ndarray:
    """C-contiguous and writable: DLPack (unversioned) cannot export read-only arrays."""
    return np.require(a, requirements=("C", "W"))


def _device(arena: Arena, host: np.ndarray) -> Any:
    if not arena.on_cuda:
        return host
    import torch

    return torch.from_numpy(host).to(arena.seg_emb.device)


def _alloc_topk(arena: Arena, batch: int, k: int) -> tuple[Any, Any]:
    if int(k) < 1:
        raise ArenaError(f"k must be >= 1, got {k}")
    if arena.on_cuda:
        import torch

        dev = arena.seg_emb.device
        return (
            torch.empty((batch, k), dtype=torch.float32, device=dev),
            torch.empty((batch, k), dtype=torch.int32, device=dev),
        )
    return np.empty((batch, k), np.float32), np.empty((batch, k), np.int32)


def _stream(arena: Arena) -> int:
    if not arena.on_cuda:
        return 0
    import torch

    return int(torch.cuda.current_stream(arena.seg_emb.device).cuda_stream)


# ---------------------------------------------------------------------- kernels
def score_segments(
    arena: Arena, q_emb: Any, q_user: Any, q_kw: Any, m: int, keyword_weight: float = 1.0
) -> tuple[Any, Any]:
    """Top-``m`` segments per query by ``cos(e_s, q) + keyword_weight * Jaccard(K_s, K_q)``.

    Each query sees only its own user's live segment slots. ``q_kw`` is ``[B, Q]`` int32 hashed
    keyword ids (sorted, padded with -1; Q may be 0). Returns ``(scores [B, m], slots [B, m])``.
    """
    q = _queries(arena, q_emb)
    users = _host_int(q_user, "q_user", q.shape[0])
    arena.check_users(users)
    kw = (
        normalize_keyword_rows(_host_int(q_kw, "q_kw", q.shape[0], ndim=2))
        if q_kw is not None
        else np.zeros((q.shape[0], 0), np.int32)
    )
    if not np.isfinite(keyword_weight):
        raise ArenaError("keyword_weight must be finite")
    scores, ids = _alloc_topk(arena, q.shape[0], m)
    _native().score_segments(
        q,
        _device(arena, users),
        _device(arena, kw),
        arena.seg_emb,
        arena.seg_kw,
        arena.seg_live,
        float(keyword_weight),
        scores,
        ids,
        _stream(arena),
    )
    return scores, ids


def match_segments(arena: Arena, emb: Any, users: Any, keywords: Any) -> tuple[Any, Any]:
    """Best existing segment per new (summary embedding, keywords): ``(score [n], slot [n])``.

    The paper's insertion score ``cos + Jaccard`` (weight 1); the caller compares it with theta.
    A user with no live segment gets ``(-inf, -1)``.
    """
    scores, ids = score_segments(arena, emb, users, keywords, m=1, keyword_weight=1.0)
    return scores[:, 0], ids[:, 0]


def select_pages(
    arena: Arena, q_emb: Any, q_user: Any, chosen: Any, k: int, min_score: float = float("-inf")
) -> tuple[Any, Any]:
    """Top-``k`` pages by cosine inside each query's ``chosen`` segment slots ``[B, m]`` (-1 =
    none), skipping pages scoring below ``min_score``. Returns ``(scores, pool slots)``."""
    q = _queries(arena, q_emb)
    users = _host_int(q_user, "q_user", q.shape[0])
    arena.check_users(users)
    ch = _host_int(chosen, "chosen", q.shape[0], ndim=2)
    if ((ch < -1) | (ch >= arena.config.segment_slots)).any():
        raise ArenaError("chosen holds a segment slot out of range")
    if np.isnan(min_score):
        raise ArenaError("min_score must not be NaN")
    scores, ids = _alloc_topk(arena, q.shape[0], k)
    _native().select_pages(
        q,
        _device(arena, users),
        _device(arena, ch),
        arena.page_emb,
        arena.page_live,
        arena.seg_npages,
        arena.block_table,
        arena.config.block_size,
        float(min_score),
        scores,
        ids,
        _stream(arena),
    )
    return scores, ids


def apply_hits(arena: Arena, hit_user: Any, hit_slot: Any, now: Any) -> None:
    """Fold retrieval hits into heat statistics: ``N_visit += 1``, ``last_access = max(., now)``.

    ``now`` is per hit (float64 seconds): the user's logical clock when replaying logs, the wall
    clock when serving. Hits on segments that are no longer live are ignored.
    """
    hu = _host_int(hit_user, "hit_user")
    hs = _host_int(hit_slot, "hit_slot", hu.shape[0])
    hn = _writable(np.broadcast_to(np.asarray(now, np.float64), hu.shape))
    arena.check_users(hu)
    if ((hs < 0) | (hs >= arena.config.segment_slots)).any():
        raise ArenaError("hit_slot out of range")
    if not np.isfinite(hn).all():
        raise ArenaError("now must be finite")
    _native().apply_hits(
        _device(arena, hu),
        _device(arena, hs),
        _device(arena, hn),
        arena.n_visit,
        arena.l_interaction,
        arena.last_access,
        arena.heat,
        arena.seg_live,
        _stream(arena),
    )


def recompute_heat(
    arena: Arena, users: Any, now: Any, params: HeatParams, need_evict: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Recompute heat of each user's live segments at that user's ``now``.

    Returns ``(promote [n, S] bool, evict [n] int32)`` on the host: promote marks live segments
    whose heat reached ``params.tau``; evict is the victim slot for users flagged in
    ``need_evict`` (lowest heat, or lowest N_visit when ``params.evict_by_visits``; ties to the
    lower slot), else -1. Heat values are stored in ``arena.heat``.
    """
    us = _host_int(users, "users")
    arena.check_users(us)
    nw = _writable(np.broadcast_to(np.asarray(now, np.float64), us.shape))
    if not np.isfinite(nw).all():
        raise ArenaError("now must be finite")
    ne = (
        np.zeros(us.shape, np.uint8)
        if need_evict is None
        else _writable(np.broadcast_to(np.asarray(need_evict, np.uint8), us.shape))
    )
    n, s = us.shape[0], arena.config.segment_slots
    promote = _device(arena, np.zeros((n, s), np.uint8))
    evict = _device(arena, np.full(n, -1, np.int32))
    _native().recompute_heat(
        _device(arena, us),
        _device(arena, nw),
        _device(arena, ne),
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
        params.evict_by_visits,
        promote,
        evict,
        _stream(arena),
    )
    if arena.on_cuda:
        return promote.cpu().numpy().astype(bool), evict.cpu().numpy()
    return promote.astype(bool), evict


def knowledge_topk(arena: Arena, q_emb: Any, q_owner: Any, k: int) -> tuple[Any, Any]:
    """Top-``k`` knowledge entries by cosine inside each query owner's ring:
    ``(scores [B, k], ring slots [B, k])``."""
    q = _queries(arena, q_emb)
    owners = _host_int(q_owner, "q_owner", q.shape[0])
    arena.check_owners(owners)
    scores, ids = _alloc_topk(arena, q.shape[0], k)
    _native().knowledge_topk(
        q, _device(arena, owners), arena.kn_emb, arena.kn_live, scores, ids, _stream(arena)
    )
    return scores, ids

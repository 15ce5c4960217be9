"""Public kernel API: one function per kernel, dispatched on where the arena lives.

Every function validates its host inputs (shapes, dtypes, NaN, unknown slots, k < 1) with a
clear Python exception before anything native runs, allocates outputs on the arena's device, and
calls the C++ (CPU) or CUDA implementation in :mod:`memoryos_gpu._C`. Outputs are fixed
``[B, k]`` arrays padded with ``-inf`` scores and ``-1`` ids, ranked by score then lower id.

The backend follows the arena: a CPU arena runs the OpenMP loops, a CUDA arena the CUDA kernels
(``EngineConfig.device`` chooses where new engines put their arena). On a CUDA arena no function
but :func:`recompute_heat` (which returns host arrays) waits for the device: host inputs travel
in one asynchronous copy per call, and device inputs are used where they are, unchecked on the
host (the kernels bounds-check every index; a device query holding NaN gets a padded row), so
the ``chosen`` tensor of :func:`score_segments` can go straight into :func:`select_pages`.
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
    "set_cpu_team_work",
    "set_cpu_threads",
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

    Keys: ``cpu`` (always True), ``openmp``, ``cpu_threads`` (the CPU kernels' team size now:
    :func:`set_cpu_threads`), ``cpu_team_work`` (:func:`set_cpu_team_work`), ``cuda_compiled``,
    ``cuda_device_count``, ``cuda_usable`` (compiled and a device present), ``cuda_archs``,
    ``version``.
    """
    info = dict(_native().build_info())
    info["cuda_usable"] = bool(info["cuda_compiled"] and info["cuda_device_count"] > 0)
    return info


def set_cpu_threads(n: int | None) -> None:
    """Limit the CPU kernels to ``n`` OpenMP threads (None: OpenMP's default, every core or
    ``OMP_NUM_THREADS``). Process-wide: it applies to kernels called from any thread.

    Why: a team as wide as the machine only pays when the kernels have the cores to
    themselves. Beside other busy processes (HTTP workers, an embedder, another engine) a team
    member the scheduler parked holds the whole batch for a time slice; on two cores with one
    of them busy, a retrieval batch's kernels took 5-10x longer with two threads than with one.
    ``EngineConfig.cpu_threads`` sets it when an engine opens; ``serve --workers N`` gives the
    engine process the cores the workers leave.
    """
    if n is not None and int(n) < 1:
        raise ValueError(f"cpu_threads must be >= 1 or None, got {n}")
    _native().set_cpu_threads(0 if n is None else int(n))


def set_cpu_team_work(n: int | None) -> None:
    """Multiply-adds a batch must hold before a CPU kernel runs it on an OpenMP team (None: the
    default, ~0.5 ms of one core's work; 0: a team from 16 queries whatever their work).

    Why a threshold: waking a sleeping team costs more than a small batch's work (70-100 us
    on a 2-core VM under ``OMP_WAIT_POLICY=PASSIVE``, against ~80 us for a knowledge top-k of
    64 queries), so small batches run on the calling thread. Results do not depend on it; the
    tests set 0 to run the team path on small inputs.
    """
    if n is not None and int(n) < 0:
        raise ValueError(f"team work must be >= 0 or None, got {n}")
    _native().set_cpu_team_work(-1 if n is None else int(n))


# ---------------------------------------------------------------------- input normalisation
# On a CUDA arena nothing here waits for the device: host inputs are checked on the host, packed
# into one pinned buffer and sent with one asynchronous copy per call (a pageable .to(device) per
# array would wait for the stream each time), and device inputs are used where they are (the
# kernels bounds-check every index and give a non-finite query a padded row, so no device-side
# check, which would need a sync, is required).
def _is_device_tensor(x: Any) -> bool:
    return bool(getattr(x, "is_cuda", False))


def _host_queries(arena: Arena, emb: Any, name: str) -> np.ndarray:
    a = _writable(np.asarray(emb, dtype=np.float32))
    if a.ndim != 2 or a.shape[1] != arena.config.dim:
        raise ArenaError(f"{name} must be [B, {arena.config.dim}], got {a.shape}")
    if not np.isfinite(a).all():
        raise ArenaError(f"{name} contains NaN or infinity")
    return a


def _device_queries(arena: Arena, emb: Any, name: str) -> Any:
    """A CUDA tensor as float32 [B, d] on the arena's device, without a finiteness check."""
    t = emb.to(device=arena.seg_emb.device, dtype=_torch().float32).contiguous()
    if t.ndim != 2 or t.shape[1] != arena.config.dim:
        raise ArenaError(f"{name} must be [B, {arena.config.dim}], got {tuple(t.shape)}")
    return t


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


def _per_row(values: Any, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``values`` (one per row, or one for all) as a writable C array of ``shape``: an array
    that already is one is used as it is (``np.broadcast_to`` costs more than a small
    kernel call)."""
    a = np.asarray(values, dtype)
    if a.shape != shape:
        a = np.broadcast_to(a, shape)
    return _writable(a)


def _torch() -> Any:
    import torch

    return torch


def _to_arena(arena: Arena, *arrays: np.ndarray) -> list[Any]:
    """The host arrays on the arena's device: themselves on a CPU arena; on a CUDA arena views
    of one device buffer filled by one asynchronous copy from one pinned host buffer (torch's
    pinned allocator keeps that buffer until the copy is done)."""
    if not arena.on_cuda:
        return list(arrays)
    torch = _torch()
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 16) * 16  # 16-byte aligned views
    staging = torch.empty(max(total, 16), dtype=torch.uint8, pin_memory=True)
    host = staging.numpy()
    for a, off in zip(arrays, offsets, strict=True):
        host[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = staging.to(arena.seg_emb.device, non_blocking=True)
    out = []
    for a, off in zip(arrays, offsets, strict=True):
        dt = getattr(torch, a.dtype.name)
        out.append(dev[off : off + a.nbytes].view(dt).view(a.shape))
    return out


def _alloc_topk(arena: Arena, batch: int, k: int) -> tuple[Any, Any]:
    if int(k) < 1:
        raise ArenaError(f"k must be >= 1, got {k}")
    if arena.on_cuda:
        torch = _torch()
        dev = arena.seg_emb.device
        return (
            torch.empty((batch, k), dtype=torch.float32, device=dev),
            torch.empty((batch, k), dtype=torch.int32, device=dev),
        )
    return np.empty((batch, k), np.float32), np.empty((batch, k), np.int32)


def _stream(arena: Arena) -> int:
    if not arena.on_cuda:
        return 0
    return int(_torch().cuda.current_stream(arena.seg_emb.device).cuda_stream)


def _query_args(arena: Arena, q_emb: Any, *host_ints: np.ndarray) -> list[Any]:
    """[queries, *ints] on the arena's device; host queries ride in the same copy as the ints."""
    if arena.on_cuda and _is_device_tensor(q_emb):
        return [_device_queries(arena, q_emb, "q_emb"), *_to_arena(arena, *host_ints)]
    return _to_arena(arena, _host_queries(arena, q_emb, "q_emb"), *host_ints)


def _batch_of(q_emb: Any) -> int:
    shape = getattr(q_emb, "shape", None)
    if shape is None:
        q_emb = np.asarray(q_emb, np.float32)
        shape = q_emb.shape
    if len(shape) != 2:
        raise ArenaError(f"q_emb must be [B, d], got {tuple(shape)}")
    return int(shape[0])


# ---------------------------------------------------------------------- kernels
def score_segments(
    arena: Arena, q_emb: Any, q_user: Any, q_kw: Any, m: int, keyword_weight: float = 1.0
) -> tuple[Any, Any]:
    """Top-``m`` segments per query by ``cos(e_s, q) + keyword_weight * Jaccard(K_s, K_q)``.

    Each query sees only its own user's live segment slots. ``q_kw`` is ``[B, Q]`` int32 hashed
    keyword ids (sorted, padded with -1; Q may be 0). Returns ``(scores [B, m], slots [B, m])``.
    """
    b = _batch_of(q_emb)
    users = _host_int(q_user, "q_user", b)
    arena.check_users(users)
    kw = (
        normalize_keyword_rows(_host_int(q_kw, "q_kw", b, ndim=2))
        if q_kw is not None
        else np.zeros((b, 0), np.int32)
    )
    if not np.isfinite(keyword_weight):
        raise ArenaError("keyword_weight must be finite")
    q, users_d, kw_d = _query_args(arena, q_emb, users, kw)
    scores, ids = _alloc_topk(arena, b, m)
    _native().score_segments(
        q,
        users_d,
        kw_d,
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
    none), skipping pages scoring below ``min_score``. Returns ``(scores, pool slots)``.

    On a CUDA arena ``chosen`` may be the device tensor :func:`score_segments` returned: it is
    used in place (no copy through the host between the two kernels), and slots outside
    ``[0, S)`` in it are skipped by the kernel instead of raising. A segment chosen twice counts
    once."""
    b = _batch_of(q_emb)
    users = _host_int(q_user, "q_user", b)
    arena.check_users(users)
    if np.isnan(min_score):
        raise ArenaError("min_score must not be NaN")
    device_chosen = arena.on_cuda and _is_device_tensor(chosen)
    if device_chosen:
        ch = chosen.to(device=arena.seg_emb.device, dtype=_torch().int32).contiguous()
        if ch.ndim != 2 or ch.shape[0] != b:
            raise ArenaError(f"chosen must be [{b}, m], got {tuple(ch.shape)}")
        q, users_d = _query_args(arena, q_emb, users)
    else:
        ch = _host_int(chosen, "chosen", b, ndim=2)
        if ((ch < -1) | (ch >= arena.segment_width)).any():
            raise ArenaError("chosen holds a segment slot out of range")
        q, users_d, ch = _query_args(arena, q_emb, users, ch)
    scores, ids = _alloc_topk(arena, b, k)
    _native().select_pages(
        q,
        users_d,
        ch,
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
    hn = _per_row(now, np.float64, hu.shape)
    arena.check_users(hu)
    if ((hs < 0) | (hs >= arena.segment_width)).any():
        raise ArenaError("hit_slot out of range")
    if not np.isfinite(hn).all():
        raise ArenaError("now must be finite")
    hu_d, hs_d, hn_d = _to_arena(arena, hu, hs, hn)
    _native().apply_hits(
        hu_d,
        hs_d,
        hn_d,
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
    nw = _per_row(now, np.float64, us.shape)
    if not np.isfinite(nw).all():
        raise ArenaError("now must be finite")
    ne = (
        np.zeros(us.shape, np.uint8)
        if need_evict is None
        else _per_row(need_evict, np.uint8, us.shape)
    )
    n, s = us.shape[0], arena.segment_width
    us_d, nw_d, ne_d = _to_arena(arena, us, nw, ne)
    promote, evict, packed = _heat_outputs(arena, n, s)
    _native().recompute_heat(
        us_d,
        nw_d,
        ne_d,
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
    if packed is None:
        return promote.astype(bool), evict
    out = packed.cpu().numpy()  # one device-to-host copy for both outputs
    off = _evict_offset(n, s)
    return out[: n * s].reshape(n, s).astype(bool), out[off : off + 4 * n].view(np.int32).copy()


def _evict_offset(n: int, s: int) -> int:
    return -(-n * s // 16) * 16


def _heat_outputs(arena: Arena, n: int, s: int) -> tuple[Any, Any, Any]:
    """promote [n, S] uint8 and evict [n] int32, plus (on a CUDA arena, where both are views of
    one device buffer) that buffer."""
    if not arena.on_cuda:
        return np.zeros((n, s), np.uint8), np.full(n, -1, np.int32), None
    torch = _torch()
    off = _evict_offset(n, s)
    buf = torch.zeros(off + 4 * max(n, 1), dtype=torch.uint8, device=arena.seg_emb.device)
    return buf[: n * s].view(n, s), buf[off : off + 4 * n].view(torch.int32), buf


def knowledge_topk(arena: Arena, q_emb: Any, q_owner: Any, k: int) -> tuple[Any, Any]:
    """Top-``k`` knowledge entries by cosine inside each query owner's ring:
    ``(scores [B, k], ring slots [B, k])``."""
    b = _batch_of(q_emb)
    owners = _host_int(q_owner, "q_owner", b)
    arena.check_owners(owners)
    q, owners_d = _query_args(arena, q_emb, owners)
    scores, ids = _alloc_topk(arena, b, k)
    _native().knowledge_topk(q, owners_d, arena.kn_emb, arena.kn_live, scores, ids, _stream(arena))
    return scores, ids

"""Kernels against the NumPy oracle on random ragged arenas (hypothesis), CPU always, CUDA when a
device exists (MEMORYOS_GPU_REQUIRE_CUDA=1 turns the CUDA skips into failures)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memoryos_gpu import ops
from memoryos_gpu.arena import Arena, ArenaConfig
from memoryos_gpu.errors import ArenaError
from memoryos_gpu.ops import reference as ref


def _cuda_available() -> bool:
    try:
        return bool(ops.build_info()["cuda_usable"])
    except Exception:
        return False


def _backend_param(name: str):
    if name == "cpu":
        return pytest.param("cpu", id="cpu")
    marks = [pytest.mark.cuda]
    if not _cuda_available() and os.environ.get("MEMORYOS_GPU_REQUIRE_CUDA") != "1":
        marks.append(
            pytest.mark.skip(reason="no CUDA device (set MEMORYOS_GPU_REQUIRE_CUDA=1 to fail)")
        )
    return pytest.param("cuda", id="cuda", marks=marks)


BACKENDS = [_backend_param("cpu"), _backend_param("cuda")]
TOL = {"cpu": 1e-5, "cuda": 1e-4}  # the oracle reads the stored (fp16 on GPU) values


@dataclass
class Spec:
    """A random arena: users with ragged segments, pages and knowledge."""

    dim: int
    slots: int
    kw_width: int
    block_size: int
    live: np.ndarray  # [U, S] bool
    seg_emb: np.ndarray
    seg_kw: np.ndarray
    pages: list  # (user, slot, emb) in insertion order
    deleted: list  # indices into pages
    kn_live_counts: list
    kn_emb: np.ndarray
    queries: np.ndarray
    q_user: np.ndarray
    q_kw: np.ndarray


def keyword_rows(
    rng: np.random.Generator, n: int, width: int, universe: int, duplicates: bool = False
) -> np.ndarray:
    rows = np.full((n, width), -1, np.int32)
    for i in range(n):
        count = int(rng.integers(0, width + 1))
        ids = rng.choice(universe, size=count, replace=duplicates)
        ids = np.sort(ids) if duplicates else np.sort(np.unique(ids))
        rows[i, : ids.size] = ids
    return rows


@st.composite
def specs(draw, full: bool = False) -> Spec:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_users = draw(st.integers(1, 5))
    slots = 200 if full else draw(st.integers(1, 9))
    dim = draw(st.sampled_from([3, 7, 16, 33]))
    kw_width = draw(st.integers(1, 6))
    block_size = draw(st.integers(1, 4))
    live = rng.random((n_users, slots)) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    # a small palette of vectors makes exact ties frequent
    palette = rng.normal(size=(4, dim)).astype(np.float32)
    pick = rng.integers(0, 4, size=(n_users, slots))
    seg_emb = np.where(
        rng.random((n_users, slots, 1)) < 0.5, palette[pick], rng.normal(size=(n_users, slots, dim))
    ).astype(np.float32)
    seg_kw = keyword_rows(rng, n_users * slots, kw_width, 8).reshape(n_users, slots, kw_width)
    pages = []
    for u in range(n_users):
        for s in np.flatnonzero(live[u]):
            for _ in range(int(rng.integers(0, 7))):
                emb = palette[rng.integers(0, 4)] if rng.random() < 0.3 else rng.normal(size=dim)
                pages.append((u, int(s), np.asarray(emb, np.float32)))
    rng.shuffle(pages)
    deleted = [i for i in range(len(pages)) if rng.random() < 0.15]
    kn_counts = [int(rng.integers(0, 12)) for _ in range(n_users)]
    kn_emb = rng.normal(size=(sum(kn_counts), dim)).astype(np.float32)
    b = draw(st.integers(0, 7))
    queries = np.where(
        rng.random((b, 1)) < 0.3, palette[rng.integers(0, 4, size=b)], rng.normal(size=(b, dim))
    ).astype(np.float32)
    q_user = rng.integers(0, n_users, size=b).astype(np.int32)
    q_kw = keyword_rows(rng, b, draw(st.integers(0, 5)), 8, duplicates=True)
    return Spec(
        dim,
        slots,
        kw_width,
        block_size,
        live,
        seg_emb,
        seg_kw,
        pages,
        deleted,
        kn_counts,
        kn_emb,
        queries,
        q_user,
        q_kw,
    )


def build(spec: Spec, device: str) -> tuple[Arena, np.ndarray]:
    arena = Arena(
        ArenaConfig(
            dim=spec.dim,
            segment_slots=spec.slots,
            keyword_width=spec.kw_width,
            block_size=spec.block_size,
            device=device,
            initial_users=1,
            initial_blocks=1,
            initial_owners=1,
        )
    )
    n_users = spec.live.shape[0]
    arena.add_users(n_users)
    u, s = np.nonzero(spec.live)
    arena.write_segments(
        u,
        s,
        spec.seg_emb[u, s],
        spec.seg_kw[u, s],
        l_interaction=np.arange(u.size) % 4,
        last_access=np.zeros(u.size),
    )
    if spec.pages:
        pu = np.array([p[0] for p in spec.pages])
        ps = np.array([p[1] for p in spec.pages])
        slots = arena.append_pages(pu, ps, np.stack([p[2] for p in spec.pages]))
        arena.delete_pages(slots[spec.deleted])
    arena.add_owners(n_users)
    owners = np.repeat(np.arange(n_users), spec.kn_live_counts)
    arena.push_knowledge(owners, spec.kn_emb)
    return arena, u


def assert_topk(ref_out, got_out, tol: float) -> None:
    rs, ri = ref_out
    gs, gi = (np.asarray(x.cpu()) if hasattr(x, "cpu") else np.asarray(x) for x in got_out)
    assert gs.shape == rs.shape and gi.shape == ri.shape
    np.testing.assert_array_equal(np.isinf(gs), np.isinf(rs))
    finite = np.isfinite(rs)
    np.testing.assert_allclose(gs[finite], rs[finite], atol=tol, rtol=0)
    # exact ids, except where two reference scores are closer than the tolerance (near-ties
    # may legitimately order differently between fp32 and the float64 oracle)
    for row in range(rs.shape[0]):
        for j in range(rs.shape[1]):
            if gi[row, j] != ri[row, j]:
                near = np.abs(rs[row] - rs[row, j]) <= tol
                assert near.sum() > 1, f"row {row} pos {j}: id {gi[row, j]} != {ri[row, j]}"
    assert (gi[~finite] == -1).all()


# ---------------------------------------------------------------- properties against the oracle
# MEMORYOS_GPU_KERNEL_GRID=small: the compute-sanitizer runs of benchmarks/gpu_check.sh
SMALL = os.environ.get("MEMORYOS_GPU_KERNEL_GRID") == "small"
COMMON = settings(
    max_examples=4 if SMALL else 60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("backend", BACKENDS)
@COMMON
@given(spec=specs(), m=st.integers(1, 6), weight=st.sampled_from([0.0, 1.0, 0.5]))
def test_score_segments_matches_reference(backend, spec, m, weight):
    arena, _ = build(spec, backend)
    got = ops.score_segments(arena, spec.queries, spec.q_user, spec.q_kw, m, weight)
    want = ref.score_segments_ref(arena, spec.queries, spec.q_user, spec.q_kw, m, weight)
    assert_topk(want, got, TOL[backend])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(
    max_examples=2 if SMALL else 8, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(spec=specs(full=True), m=st.integers(1, 12))
def test_score_segments_full_200_slots(backend, spec, m):
    arena, _ = build(spec, backend)
    got = ops.score_segments(arena, spec.queries, spec.q_user, spec.q_kw, m)
    want = ref.score_segments_ref(arena, spec.queries, spec.q_user, spec.q_kw, m)
    assert_topk(want, got, TOL[backend])


@pytest.mark.parametrize("backend", BACKENDS)
@COMMON
@given(
    spec=specs(),
    m=st.integers(1, 4),
    k=st.integers(1, 30),
    min_score=st.sampled_from([float("-inf"), 0.0, 0.3]),
)
def test_select_pages_matches_reference(backend, spec, m, k, min_score):
    arena, _ = build(spec, backend)
    _, chosen = ops.score_segments(arena, spec.queries, spec.q_user, spec.q_kw, m)
    chosen = np.asarray(chosen.cpu() if hasattr(chosen, "cpu") else chosen)
    got = ops.select_pages(arena, spec.queries, spec.q_user, chosen, k, min_score)
    want = ref.select_pages_ref(arena, spec.queries, spec.q_user, chosen, k, min_score)
    assert_topk(want, got, TOL[backend])


@pytest.mark.parametrize("backend", BACKENDS)
@COMMON
@given(spec=specs(), k=st.integers(1, 15))
def test_knowledge_topk_matches_reference(backend, spec, k):
    arena, _ = build(spec, backend)
    owners = spec.q_user  # owner slot u holds user u's knowledge here
    got = ops.knowledge_topk(arena, spec.queries, owners, k)
    want = ref.knowledge_topk_ref(arena, spec.queries, owners, k)
    assert_topk(want, got, TOL[backend])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), k=st.integers(1, 9), m=st.integers(1, 4))
def test_a_team_gives_the_results_of_one_thread(spec, k, m):
    """The CPU kernels split a batch over an OpenMP team only when it holds enough work
    (``ops.set_cpu_team_work``); forced onto a team, a batch (the spec's queries repeated past
    16) gives exactly the one-thread results, query by query."""
    if not spec.queries.shape[0]:
        return
    arena, _ = build(spec, "cpu")
    reps = -(-20 // spec.queries.shape[0])
    q, users = np.tile(spec.queries, (reps, 1)), np.tile(spec.q_user, reps)
    kw = np.tile(spec.q_kw, (reps, 1))

    def run() -> list[np.ndarray]:
        seg = ops.score_segments(arena, q, users, kw, m)
        pages = ops.select_pages(arena, q, users, np.asarray(seg[1]), k, float("-inf"))
        know = ops.knowledge_topk(arena, q, users, k)
        return [np.asarray(x) for x in (*seg, *pages, *know)]

    try:
        ops.set_cpu_threads(1)
        one = run()
        ops.set_cpu_threads(4)
        ops.set_cpu_team_work(0)
        team = run()
    finally:
        ops.set_cpu_threads(None)
        ops.set_cpu_team_work(None)
    for x, y in zip(one, team, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
@COMMON
@given(
    spec=specs(),
    data=st.data(),
    by_visits=st.booleans(),
    mu=st.sampled_from([1.0, 3600.0, 1e7]),
    tau=st.sampled_from([0.5, 2.0, 5.0]),
)
def test_heat_matches_reference(backend, spec, data, by_visits, mu, tau):
    arena, _ = build(spec, backend)
    n_users = spec.live.shape[0]
    slots = arena.segment_width  # rows widen as segments are written: hits past them are refused
    hits_u = np.array(data.draw(st.lists(st.integers(0, n_users - 1), max_size=10)), np.int32)
    hits_s = np.array(
        data.draw(st.lists(st.integers(0, slots - 1), min_size=hits_u.size, max_size=hits_u.size)),
        np.int32,
    )
    hits_t = np.array(
        data.draw(st.lists(st.floats(0, 1e6), min_size=hits_u.size, max_size=hits_u.size)),
        np.float64,
    )
    stats = {k: arena.host(k).copy() for k in ("n_visit", "l_interaction", "last_access")}
    stats["live"] = arena.host("seg_live").copy()
    ops.apply_hits(arena, hits_u, hits_s, hits_t)
    ref.apply_hits_ref(stats, hits_u, hits_s, hits_t)
    np.testing.assert_array_equal(arena.host("n_visit"), stats["n_visit"])
    np.testing.assert_array_equal(arena.host("last_access"), stats["last_access"])

    users = np.arange(n_users, dtype=np.int32)
    now = np.array(data.draw(st.lists(st.floats(0, 2e6), min_size=n_users, max_size=n_users)))
    need = np.array(data.draw(st.lists(st.booleans(), min_size=n_users, max_size=n_users)))
    params = ops.HeatParams(mu=mu, tau=tau, evict_by_visits=by_visits)
    promote, evict = ops.recompute_heat(arena, users, now, params, need)
    heat_want, promote_want, evict_want = ref.recompute_heat_ref(
        stats, users, now, need, params, by_visits
    )
    np.testing.assert_allclose(np.where(stats["live"], arena.host("heat"), 0), heat_want, atol=1e-5)
    # promotion and eviction decisions agree except exactly at float rounding of the threshold
    borderline = np.abs(heat_want - tau) < 1e-5
    assert ((promote == promote_want) | borderline).all()
    for r in range(n_users):
        if evict[r] != evict_want[r]:
            h = heat_want[r]
            assert abs(h[evict[r]] - h[evict_want[r]]) < 1e-5


# ---------------------------------------------------------------- isolation
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=4 if SMALL else 40, deadline=None)
@given(spec=specs(), seed=st.integers(0, 2**31))
def test_no_query_sees_another_users_memory(backend, spec, seed):
    """Rewriting every other user's segments, pages and knowledge changes nothing for a query."""
    if spec.queries.shape[0] == 0:
        return
    arena, _ = build(spec, backend)
    target = int(spec.q_user[0])
    q, qu, qk = spec.queries[:1], spec.q_user[:1], spec.q_kw[:1]

    def results(a: Arena):
        _, segs = ops.score_segments(a, q, qu, qk, 3)
        segs = np.asarray(segs.cpu() if hasattr(segs, "cpu") else segs)
        ps, pi = ops.select_pages(a, q, qu, segs, 8)
        ks, ki = ops.knowledge_topk(a, q, qu, 8)
        return [np.asarray(x.cpu() if hasattr(x, "cpu") else x) for x in (segs, ps, pi, ks, ki)]

    before = results(arena)
    rng = np.random.default_rng(seed)
    others = [u for u in range(spec.live.shape[0]) if u != target]
    ids = np.unique(qk[0][qk[0] >= 0])[: spec.kw_width]
    kw_row = np.full((1, spec.kw_width), -1, np.int32)
    kw_row[0, : ids.size] = ids
    for u in others:  # make the other users' memory a perfect match for the query
        slots = np.arange(spec.slots, dtype=np.int32)
        arena.write_segments(
            np.full(spec.slots, u),
            slots,
            np.repeat(q, spec.slots, 0),
            np.repeat(kw_row, spec.slots, 0),
        )
        arena.append_pages(np.full(3, u), np.zeros(3, np.int32), np.repeat(q, 3, 0))
        noise = rng.normal(size=(5, spec.dim)) * 1e-3
        arena.push_knowledge(np.full(5, u), np.repeat(q, 5, 0) + noise)
    after = results(arena)
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    # and every returned id is the target's own
    assert all(spec.live[target, s] for s in before[0][0] if s >= 0)
    own_pages = set()
    for s in np.flatnonzero(spec.live[target]):
        own_pages.update(arena.segment_pages(target, int(s)).tolist())
    assert all(p in own_pages for p in before[2][0] if p >= 0)


# ---------------------------------------------------------------- edge cases and bad input
@pytest.fixture
def small_arena() -> Arena:
    arena = Arena(ArenaConfig(dim=4, segment_slots=3, keyword_width=2, block_size=2))
    arena.add_users(2)
    arena.write_segments([0], [1], np.eye(4)[:1], np.array([[1, 2]]))
    arena.append_pages([0, 0, 0], [1, 1, 1], np.eye(4)[:3])
    arena.add_owners(1)
    return arena


def test_k_larger_than_available_is_padded(small_arena):
    scores, ids = ops.score_segments(small_arena, np.eye(4)[:1], [0], None, m=5)
    assert ids.tolist() == [[1, -1, -1, -1, -1]]
    assert np.isneginf(scores[0, 1:]).all()
    scores, ids = ops.select_pages(small_arena, np.eye(4)[:1], [0], [[1, -1]], k=6)
    assert (ids[0, :3] >= 0).all() and (ids[0, 3:] == -1).all()


def test_empty_user_and_empty_batch(small_arena):
    scores, ids = ops.score_segments(small_arena, np.eye(4)[:1], [1], None, m=2)
    assert ids.tolist() == [[-1, -1]]
    scores, ids = ops.score_segments(small_arena, np.zeros((0, 4)), [], None, m=2)
    assert scores.shape == (0, 2)
    scores, ids = ops.knowledge_topk(small_arena, np.eye(4)[:1], [0], k=3)
    assert ids.tolist() == [[-1, -1, -1]]


def test_jaccard_keyword_term_breaks_cosine_tie():
    arena = Arena(ArenaConfig(dim=2, segment_slots=2, keyword_width=3))
    arena.add_users(1)
    arena.write_segments(
        [0, 0], [0, 1], np.array([[1.0, 0], [1.0, 0]]), np.array([[1, 2, -1], [3, 4, 5]])
    )
    scores, ids = ops.score_segments(arena, np.array([[1.0, 0]]), [0], np.array([[3, 5, 9]]), 2)
    assert ids.tolist() == [[1, 0]]
    assert scores[0, 0] == pytest.approx(1.0 + 2 / 4)
    scores, ids = ops.score_segments(arena, np.array([[1.0, 0]]), [0], np.array([[7, -1, -1]]), 2)
    assert ids.tolist() == [[0, 1]]  # exact tie: lower slot wins


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda a: ops.score_segments(a, np.full((1, 4), np.nan), [0], None, 1), "NaN"),
        (lambda a: ops.score_segments(a, np.ones((1, 5)), [0], None, 1), r"\[B, 4\]"),
        (lambda a: ops.score_segments(a, np.ones((1, 4)), [9], None, 1), "unknown user slot 9"),
        (lambda a: ops.score_segments(a, np.ones((1, 4)), [0], None, 0), "k must be >= 1"),
        (lambda a: ops.score_segments(a, np.ones((1, 4)), [0.5], None, 1), "integers"),
        (lambda a: ops.score_segments(a, np.ones((2, 4)), [0], None, 1), "rows"),
        (lambda a: ops.select_pages(a, np.ones((1, 4)), [0], [[7]], 1), "out of range"),
        (lambda a: ops.knowledge_topk(a, np.ones((1, 4)), [3], 1), "owner slot 3"),
        (lambda a: ops.apply_hits(a, [0], [5], [1.0]), "out of range"),
        (lambda a: ops.recompute_heat(a, [0], [np.inf], ops.HeatParams()), "finite"),
        (lambda a: a.write_segments([0], [0], np.full((1, 4), np.inf), np.zeros((1, 2))), "NaN"),
    ],
)
def test_bad_input_raises_clear_errors(small_arena, call, error):
    with pytest.raises(ArenaError, match=error):
        call(small_arena)


def test_native_rejects_bad_arrays_without_crashing():
    from memoryos_gpu import _C

    q = np.ones((1, 4), np.float32)
    out_s, out_i = np.empty((1, 1), np.float32), np.empty((1, 1), np.int32)
    seg = np.zeros((1, 2, 4), np.float32)
    kw, live = np.full((1, 2, 2), -1, np.int32), np.ones((1, 2), np.uint8)
    with pytest.raises(TypeError, match="float32"):
        _C.score_segments(
            q.astype(np.float64),
            np.zeros(1, np.int32),
            np.zeros((1, 0), np.int32),
            seg,
            kw,
            live,
            1.0,
            out_s,
            out_i,
        )
    # an out-of-range user slot is not an error in the kernels: it gets a padded row, on the
    # CPU as on the GPU (which cannot raise without a device sync); ops validates users first
    out_s[:], out_i[:] = 7.0, 7
    _C.score_segments(
        q, np.array([3], np.int32), np.zeros((1, 0), np.int32), seg, kw, live, 1.0, out_s, out_i
    )
    assert out_i.tolist() == [[-1]] and np.isneginf(out_s).all()
    with pytest.raises(ValueError, match="contiguous"):
        _C.score_segments(
            np.ones((1, 8), np.float32)[:, ::2],
            np.zeros(1, np.int32),
            np.zeros((1, 0), np.int32),
            seg,
            kw,
            live,
            1.0,
            out_s,
            out_i,
        )
    with pytest.raises(TypeError, match="DLPack"):
        _C.score_segments(
            [[1.0]],
            np.zeros(1, np.int32),
            np.zeros((1, 0), np.int32),
            seg,
            kw,
            live,
            1.0,
            out_s,
            out_i,
        )


def test_build_info_reports_capabilities():
    info = ops.build_info()
    assert info["cpu"] is True
    assert info["cuda_usable"] == (info["cuda_compiled"] and info["cuda_device_count"] > 0)
    assert info["cpu_threads"] >= 1


@pytest.mark.parametrize("value", ["1", "0"])
def test_cuda_sync_mode_follows_the_environment(value):
    """MEMORYOS_GPU_CUDA_SYNC=1 (read once per process) makes every CUDA launch synchronise
    and report a device fault in the launcher that caused it; a CPU-only build has no such mode."""
    import subprocess
    import sys

    code = "from memoryos_gpu.ops import build_info; i = build_info(); "
    code += "print(i['cuda_sync_launches'], i['cuda_compiled'])"
    env = {**os.environ, "MEMORYOS_GPU_CUDA_SYNC": value}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == str(value == "1" and out[1] == "True")


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    block_size=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_placing_pages_by_position_equals_appending_them(counts, block_size, seed) -> None:
    """A reload places pages by stored position in any order (arena.size_segments +
    place_pages + write_pages); each segment then holds the same pages in the same order as
    when they were appended one by one, with the same page count."""
    rng = np.random.default_rng(seed)
    cfg = ArenaConfig(dim=4, segment_slots=16, keyword_width=2, block_size=block_size)
    appended, placed = Arena(cfg), Arena(cfg)
    for a in (appended, placed):
        a.add_users(2)
    users = np.arange(len(counts), dtype=np.int32) % 2
    slots = np.arange(len(counts), dtype=np.int32)
    for a in (appended, placed):
        a.write_segments(
            users, slots, rng.standard_normal((len(counts), 4)), np.zeros((len(counts), 2), int)
        )
    rows = [(i, p) for i, n in enumerate(counts) for p in range(n)]
    emb = rng.standard_normal((len(rows), 4)).astype(np.float32)
    for (i, _p), v in zip(rows, emb, strict=True):
        appended.append_pages(users[i : i + 1], slots[i : i + 1], v[None])
    placed.size_segments(users, slots, np.array(counts))
    order = rng.permutation(len(rows))
    seg = np.array([rows[j][0] for j in order], np.int64)
    pos = np.array([rows[j][1] for j in order], np.int64)
    pool = placed.place_pages(users[seg], slots[seg], pos)
    placed.write_pages(pool, emb[order])
    for i in range(len(counts)):
        mine = [
            appended.segment_pages(users[i], slots[i]),
            placed.segment_pages(users[i], slots[i]),
        ]
        assert len(mine[0]) == len(mine[1]) == counts[i]
        np.testing.assert_array_equal(
            appended.host("page_emb")[mine[0]], placed.host("page_emb")[mine[1]]
        )
        assert placed.host("page_live")[mine[1]].all()


@settings(max_examples=25, deadline=None)
@given(
    n_users=st.integers(1, 6),
    grow_to=st.integers(7, 40),
    seed=st.integers(0, 2**16),
)
def test_growing_keeps_live_rows_and_only_them(n_users, grow_to, seed) -> None:
    """Growth copies the embeddings of live segments and live knowledge entries (not the empty
    rows, so their memory is never touched); after it the arena answers exactly as before."""
    rng = np.random.default_rng(seed)
    cfg = ArenaConfig(dim=4, segment_slots=6, keyword_width=2, initial_users=1, initial_owners=1)
    arena = Arena(cfg)
    users = arena.add_users(n_users)
    owners = arena.add_owners(n_users)
    seg_u = np.repeat(users, 4)
    seg_s = np.tile(np.arange(4, dtype=np.int32), n_users)
    arena.write_segments(
        seg_u, seg_s, rng.standard_normal((seg_u.size, 4)), np.zeros((seg_u.size, 2), int)
    )
    dead = rng.random(seg_u.size) < 0.4  # evicted segments: their rows become garbage
    arena.free_segments(seg_u[dead], seg_s[dead])
    ring = arena.push_knowledge(owners, rng.standard_normal((owners.size, 4)))
    gone = rng.random(owners.size) < 0.5
    arena.delete_knowledge(owners[gone], ring[gone])
    seg_before, kn_before = arena.host("seg_emb").copy(), arena.host("kn_emb").copy()
    seg_live, kn_live = arena.host("seg_live").astype(bool), arena.host("kn_live").astype(bool)
    arena.reserve(users=grow_to, owners=grow_to)
    assert arena.user_capacity >= grow_to and arena.owner_capacity >= grow_to
    seg_after, kn_after = arena.host("seg_emb"), arena.host("kn_emb")
    n, o = seg_before.shape[0], kn_before.shape[0]
    np.testing.assert_array_equal(seg_after[:n][seg_live], seg_before[seg_live])
    np.testing.assert_array_equal(kn_after[:o][kn_live], kn_before[kn_live])
    assert not seg_after[:n][~seg_live].any() and not seg_after[n:].any()
    assert not kn_after[:o][~kn_live].any() and not kn_after[o:].any()
    np.testing.assert_array_equal(arena.host("seg_live")[:n].astype(bool), seg_live)


def test_lazy_zeros_is_a_writable_zeroed_array() -> None:
    from memoryos_gpu.arena import lazy_zeros

    for shape in [(3, 5), (1024, 1024, 2)]:  # under and over the lazy-allocation size
        a = lazy_zeros(shape, np.float32)
        assert a.shape == shape and a.dtype == np.float32 and not a.any()
        a[-1] = 1.5
        assert a.flags.writeable and a.flags.c_contiguous and a.sum() == 1.5 * np.prod(shape[1:])


def test_the_page_pool_asks_for_huge_pages_and_keeps_them_when_it_grows() -> None:
    """Only the page pool's embeddings (written densely, read at random) are mapped with
    transparent huge pages; sparse arrays (segments, knowledge rings) are not, and a grown
    pool keeps its mapping's advice, in place or copied to a larger reservation."""
    from memoryos_gpu.arena_memory import _lazy_buffer, lazy_zeros

    assert _lazy_buffer(lazy_zeros((1024, 1024), np.float32, huge=True)).huge
    assert not _lazy_buffer(lazy_zeros((1024, 1024), np.float32)).huge
    arena = Arena(ArenaConfig(dim=256, initial_users=800, initial_owners=800, initial_blocks=8192))
    assert _lazy_buffer(arena.page_emb).huge
    assert not _lazy_buffer(arena.seg_emb).huge and not _lazy_buffer(arena.kn_emb).huge
    for rows in (16_384, 600_000):  # inside the reservation, then past it (a copy)
        grown = arena._b.grow(arena.page_emb, rows, 0.0, live=np.ones(8192, np.uint8), dense=True)
        assert grown.shape == (rows, 256) and _lazy_buffer(grown).huge
    small = Arena(ArenaConfig(dim=8, initial_blocks=4))  # a pool too small to map lazily ...
    assert _lazy_buffer(small.page_emb) is None
    small.reserve(users=1, owners=1, blocks=200_000)  # ... is mapped with huge pages once grown
    assert _lazy_buffer(small.page_emb).huge


@settings(max_examples=50, deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=4),
    capacity=st.integers(1, 9),
    initial=st.integers(1, 4),
)
def test_push_knowledge_takes_each_owners_next_ring_positions(batches, capacity, initial) -> None:
    """Ring positions of a batch: per owner, the next positions in batch order, wrapping at
    the capacity; the heads carry over to the next batch (checked against one-by-one). The
    rings start ``initial`` positions wide and widen as positions need, never past the
    capacity, keeping every entry's row."""
    arena = Arena(
        ArenaConfig(
            dim=2, knowledge_capacity=capacity, initial_owners=1, initial_knowledge_slots=initial
        )
    )
    arena.add_owners(4)
    heads = [0] * 4
    rows = {}  # (owner, position) -> the value its row must hold
    for step, batch in enumerate(batches):
        want = []
        for o in batch:
            want.append(heads[o] % capacity)
            heads[o] += 1
        emb = np.full((len(batch), 2), step + 1.0) + np.arange(len(batch))[:, None]
        got = arena.push_knowledge(np.array(batch, np.int32), emb)
        assert got.tolist() == want
        rows.update({(o, r): emb[i] for i, (o, r) in enumerate(zip(batch, want, strict=True))})
    assert [arena.ring_head(o) for o in range(4)] == heads
    needed = max([r + 1 for _, r in rows] or [0])
    assert min(initial, capacity) <= arena.knowledge_width <= capacity
    assert arena.knowledge_width >= needed
    live = arena.host("kn_live")
    assert {(int(o), int(r)) for o, r in zip(*np.nonzero(live), strict=True)} == set(rows)
    for (o, r), value in rows.items():
        np.testing.assert_array_equal(arena.host("kn_emb")[o, r], value)

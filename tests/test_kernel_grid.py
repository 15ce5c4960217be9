"""The native kernels called directly (``memoryos_gpu._C``) over grids that reach every code
path, against the raw NumPy oracle (``reference.*_raw_ref``), CPU always and CUDA when a device
exists (``MEMORYOS_GPU_REQUIRE_CUDA=1`` turns a CUDA skip into a failure).

Why direct calls: the public ops normalise keyword rows and validate slots first, so through
them the kernels never see unsorted rows, duplicates, out-of-range slots or fp32 storage on a
GPU. Here every input the kernel contract defines is fed as is:

- candidates per query 1 / 255 / 256 / 257 / 1,000 / 5,000 (the CUDA top-k works in passes of
  256) and k 1 / 10 / 300 / 3,500 (warp top-k up to 32, the shared-memory merge above, and the
  shared-memory opt-in past 48 KiB), crossed;
- d 3 / 20 / 384 / 1,024 (scalar, 8- and 16-byte vector loads, the d = 384 specialisation),
  base pointers offset by 0 / 4 / 8 bytes (which vector width the launcher may pick);
- storage fp32, fp16 and bf16 (CUDA; the CPU stores fp32), rows scaled by powers of two,
  including fp32 / bf16 rows whose squared norm overflows or underflows fp32;
- keyword widths 1 / 32 / 40 / 70 (one or several 32-id pieces per warp load), rows sorted,
  sorted with duplicates, or unsorted with duplicates; empty users, dead slots, deleted pages,
  holes in block tables, blocks two segments share (a page reached twice is a candidate
  twice), chosen slots repeated or out of range, out-of-range users.

Exact ids are demanded: rows are drawn from a small palette of vectors (scaled by powers of
two, which leaves every fp32 cosine bit-identical), so equal reference scores are bit-equal
kernel scores (ties broken by the lower id on both sides) and distinct ones are kept at least
``MARGIN`` apart, far beyond fp32 rounding. Scores are checked twice: against the oracle on the
stored values (``ACCUM_TOL``, fp32 accumulation) and against the values before the cast to the
storage type (``STORAGE_TOL``, one entry per dtype).

``MEMORYOS_GPU_KERNEL_GRID=small`` keeps the CUDA sanitizer runs of ``benchmarks/gpu_check.sh``
short (fewer sizes, one example each).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memoryos_gpu import ops
from memoryos_gpu.ops import reference as ref

SMALL = os.environ.get("MEMORYOS_GPU_KERNEL_GRID") == "small"
CANDIDATES = [1, 255, 256, 257, 1000, 5000]
KS = [1, 10, 300, 3500]
DIMS = [3, 20, 384, 1024]
KW_WIDTHS = [1, 32, 40, 70]
LAYOUTS = ["sorted", "duplicates", "unsorted"]
OFFSETS = [0, 4, 8]  # bytes added to an embedding array's base pointer
MARGIN = 2e-4  # least gap between two distinct reference scores of one query
ACCUM_TOL = 2e-5  # kernel vs oracle on the stored values: fp32 sums in another order
STORAGE_TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # vs values before the cast
EXAMPLES = {"cpu": 2, "cuda": 1 if SMALL else 4}


def _cuda_available() -> bool:
    try:
        return bool(ops.build_info()["cuda_usable"])
    except Exception:
        return False


def _backend_param(name: str) -> Any:
    if name == "cpu":
        return pytest.param("cpu", id="cpu")
    marks = [pytest.mark.cuda]
    if not _cuda_available() and os.environ.get("MEMORYOS_GPU_REQUIRE_CUDA") != "1":
        marks.append(
            pytest.mark.skip(reason="no CUDA device (set MEMORYOS_GPU_REQUIRE_CUDA=1 to fail)")
        )
    return pytest.param("cuda", id="cuda", marks=marks)


BACKENDS = [_backend_param("cpu"), _backend_param("cuda")]
# the full cross product; the small grid (sanitizers: 10-100x slower) keeps one pair per path:
# one pass or several, warp top-k / shared-memory merge / shared-memory opt-in
SMALL_SIZES = [(1, 1), (257, 1), (1000, 10), (255, 300), (1000, 300), (257, 3500)]
SIZES = [
    pytest.param(c, k, id=f"c{c}-k{k}")
    for c, k in (SMALL_SIZES if SMALL else [(c, k) for c in CANDIDATES for k in KS])
]


# ------------------------------------------------------------------------------- array helpers
class Device:
    """Puts arrays where a backend's kernels read them and reads results back."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.torch = None
        if backend == "cuda":
            import torch

            self.torch = torch

    def put(self, a: np.ndarray) -> Any:
        a = np.ascontiguousarray(a)
        return a if self.torch is None else self.torch.from_numpy(a).cuda()

    def emb(self, a: np.ndarray, dtype: str, offset: int) -> tuple[Any, np.ndarray]:
        """``a`` stored as ``dtype`` at a base pointer ``offset`` bytes past an aligned one;
        returns (the array the kernel reads, its values as float32 on the host)."""
        a = np.ascontiguousarray(a, np.float32)
        if self.torch is None:
            flat = np.empty(a.size + 4, np.float32)[offset // 4 :][: a.size]
            flat[:] = a.reshape(-1)
            return flat.reshape(a.shape), flat.reshape(a.shape).copy()
        torch = self.torch
        tdt = getattr(torch, dtype)
        item = torch.empty(0, dtype=tdt).element_size()
        flat = torch.empty(a.size + 16, dtype=tdt, device="cuda")[offset // item :][: a.size]
        flat.copy_(torch.from_numpy(a.reshape(-1)).cuda().to(tdt))
        stored = flat.view(a.shape)
        return stored, stored.float().cpu().numpy()

    def out(self, b: int, k: int) -> tuple[Any, Any]:
        s, i = np.empty((b, k), np.float32), np.empty((b, k), np.int32)
        return (s, i) if self.torch is None else (self.torch.from_numpy(s).cuda(), self.put(i))

    def stream(self) -> int:
        return 0 if self.torch is None else int(self.torch.cuda.current_stream().cuda_stream)

    def host(self, x: Any) -> np.ndarray:
        return np.asarray(x.cpu()) if hasattr(x, "cpu") else np.asarray(x)


def storable(dtype: str, a: np.ndarray) -> np.ndarray:
    """``a`` rounded to the storage type and back (what the kernel will read), on the host."""
    if dtype == "float32":
        return a.astype(np.float32)
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float32)
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16  # round to nearest even
    return rounded.astype(np.uint32).view(np.float32)


def scale_exponents(dtype: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """Power-of-two scales per row: cosines keep their bits under them. fp32 and bf16 rows
    also get 2^70 / 2^-70 (squared norms past FLT_MAX / under 2^-60: the rescaled pass);
    fp16 rows only scale up (scaling down would reach its subnormals and round)."""
    if dtype == "float16":
        return rng.integers(0, 4, n)
    common = rng.integers(-3, 4, n)
    extreme = rng.choice([70, -70], n)
    return np.where(rng.random(n) < 0.1, extreme, common)


def keyword_rows(
    rng: np.random.Generator, n: int, width: int, layout: str, universe: int
) -> np.ndarray:
    """n padded keyword rows in a layout: sorted sets, sorted with duplicates, or unsorted
    with duplicates; some rows empty."""
    rows = np.full((n, width), -1, np.int32)
    for r in range(n):
        count = int(rng.integers(0, width + 1))
        ids = rng.integers(0, universe, count)
        if layout == "sorted":
            ids = np.unique(ids)
        elif layout == "duplicates":
            ids = np.sort(ids)
        rows[r, : ids.size] = ids
    return rows


def separated(values: dict[Any, float], extra: tuple[float, ...] = ()) -> bool:
    """Whether distinct score groups (and thresholds in ``extra``) are MARGIN apart."""
    v = np.sort(np.array([*values.values(), *extra], np.float64))
    v = v[np.isfinite(v)]
    return bool(v.size < 2 or np.diff(v).min() >= MARGIN)


def jaccard_fraction(qset: set[int], row: np.ndarray) -> Fraction:
    rset = ref.keyword_set(row)
    return Fraction(len(qset & rset), len(qset | rset)) if qset and rset else Fraction(0)


@dataclass
class Case:
    """What one draw of the grid fixes."""

    backend: str
    dtype: str
    candidates: int
    k: int
    dim: int
    offset: int
    seed: int
    kw_width: int = 1
    q_kw_width: int = 1
    layout: str = "sorted"
    weight: float = 1.0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)


def draw_case(data: st.DataObject, backend: str, candidates: int, k: int) -> Case:
    dtypes = ["float32"] if backend == "cpu" else ["float32", "float16", "bfloat16"]
    return Case(
        backend=backend,
        dtype=data.draw(st.sampled_from(dtypes), label="dtype"),
        candidates=candidates,
        k=k,
        dim=data.draw(st.sampled_from(DIMS), label="dim"),
        offset=data.draw(st.sampled_from(OFFSETS), label="offset"),
        seed=data.draw(st.integers(0, 2**32 - 1), label="seed"),
        kw_width=data.draw(st.sampled_from(KW_WIDTHS), label="kw_width"),
        q_kw_width=data.draw(st.sampled_from(KW_WIDTHS), label="q_kw_width"),
        layout=data.draw(st.sampled_from(LAYOUTS), label="layout"),
        weight=data.draw(st.sampled_from([0.0, 0.5, 1.0]), label="weight"),
    )


def palette(case: Case, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n random vectors as float32 before and after the storage cast."""
    raw = case.rng.standard_normal((n, case.dim)).astype(np.float32)
    return raw, storable(case.dtype, raw)


def queries(case: Case, pal: np.ndarray, b: int) -> np.ndarray:
    """b queries: random, a palette vector (cosine 1 ties), or scaled by 2^+-70."""
    q = case.rng.standard_normal((b, case.dim)).astype(np.float32)
    use_pal = case.rng.random(b) < 0.3
    q[use_pal] = pal[case.rng.integers(0, pal.shape[0], int(use_pal.sum()))]
    exp = case.rng.choice([0, 0, 0, 70, -70], b)
    return np.ldexp(q, exp[:, None]).astype(np.float32)


def scaled_rows(case: Case, pal_stored: np.ndarray, pick: np.ndarray) -> np.ndarray:
    exp = scale_exponents(case.dtype, case.rng, pick.size)
    return np.ldexp(pal_stored[pick], exp[:, None]).astype(np.float32)


def assert_topk(
    got: tuple[Any, Any], want: tuple[np.ndarray, np.ndarray], dev: Device
) -> tuple[np.ndarray, np.ndarray]:
    gs, gi = dev.host(got[0]), dev.host(got[1])
    ws, wi = want
    np.testing.assert_array_equal(gi, wi)
    np.testing.assert_array_equal(np.isneginf(gs), np.isneginf(ws))
    finite = np.isfinite(ws)
    np.testing.assert_allclose(gs[finite], ws[finite], atol=ACCUM_TOL, rtol=0)
    return gs, gi


def check_storage_error(gs: np.ndarray, gi: np.ndarray, score_of: Any, dtype: str) -> None:
    """Kernel scores against the scores of the values before the storage cast."""
    for b in range(gi.shape[0]):
        for j in np.flatnonzero(gi[b] >= 0).tolist():
            if np.isfinite(gs[b, j]):
                assert abs(gs[b, j] - score_of(b, int(gi[b, j]))) <= STORAGE_TOL[dtype]


SETTINGS = {
    name: settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    for name, n in EXAMPLES.items()
}


def _run(backend: str, data: st.DataObject, body: Any, candidates: int, k: int) -> None:
    """Runs one drawn case; when its scores are not separated (rare), the same case with the
    next random stream (hypothesis may replay draws, so the retries do not draw again)."""
    case = draw_case(data, backend, candidates, k)
    for attempt in range(20):
        case.rng = np.random.default_rng([case.seed, attempt])
        if body(case):
            return
    pytest.fail("could not draw a case with separated scores in 20 tries")


def _grid_test(body: Any) -> Any:
    """A (backend x candidates x k) grid test whose remaining dimensions hypothesis draws."""

    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize(("candidates", "k"), SIZES)
    def test(backend: str, candidates: int, k: int) -> None:
        @SETTINGS[backend]
        @given(data=st.data())
        def inner(data: st.DataObject) -> None:
            _run(backend, data, body, candidates, k)

        inner()

    test.__name__ = body.__name__.removeprefix("_")
    test.__doc__ = body.__doc__
    return test


# ------------------------------------------------------------------------------- score_segments
def _score_segments_case(case: Case) -> bool:
    """Top-k of cos + w * Jaccard over one user's live slots; returns False to redraw."""
    rng, dev = case.rng, Device(case.backend)
    n_users, b = 3, int(rng.integers(1, 4))
    dead = int(rng.integers(0, 8))
    slots = case.candidates + dead
    live = np.zeros((n_users, slots), np.uint8)
    live[0, rng.choice(slots, case.candidates, replace=False)] = 1  # user 1 stays empty
    live[2, rng.choice(slots, min(slots, 3), replace=False)] = 1
    raw, stored = palette(case, 6)
    pick = rng.integers(0, 6, (n_users, slots))
    emb = scaled_rows(case, stored, pick.reshape(-1)).reshape(n_users, slots, case.dim)
    emb_raw = raw[pick]  # before the cast (cosines do not see the power-of-two scales)
    universe = max(4, case.kw_width)
    kw_pal = keyword_rows(rng, 4, case.kw_width, case.layout, universe)
    kw_pick = rng.integers(0, 4, (n_users, slots))
    seg_kw = kw_pal[kw_pick]
    q = queries(case, stored, b)
    q_kw = keyword_rows(rng, b, case.q_kw_width, case.layout, universe)
    q_user = rng.choice([0, 0, 1, 2, 3, -1], b).astype(np.int32)  # 3, -1: out of range
    for row in range(b):
        u = int(q_user[row])
        if not 0 <= u < n_users:
            continue
        qset = ref.keyword_set(q_kw[row])
        cos = ref.cosines_ref(q[row], stored)
        # a score is fixed by (palette vector, w x Jaccard as a fraction): equal keys give
        # bit-equal fp32 scores, so only distinct keys need to be apart
        weighted = [Fraction(case.weight) * jaccard_fraction(qset, row) for row in kw_pal]
        groups = {(p, wj): cos[p] + float(wj) for p in range(6) for wj in weighted}
        if not separated(groups):
            return False
    seg_emb, seg_stored = dev.emb(emb, case.dtype, case.offset)
    out = dev.out(b, case.k)
    from memoryos_gpu import _C

    _C.score_segments(
        dev.put(q),
        dev.put(q_user),
        dev.put(q_kw),
        seg_emb,
        dev.put(seg_kw),
        dev.put(live),
        case.weight,
        *out,
        dev.stream(),
    )
    want = ref.score_segments_raw_ref(
        q, q_user, q_kw, seg_stored, seg_kw, live, case.k, case.weight
    )
    gs, gi = assert_topk(out, want, dev)

    def before_cast(row: int, s: int) -> float:
        u = int(q_user[row])
        return ref.cosine_ref(q[row], emb_raw[u, s]) + case.weight * ref.jaccard_ref(
            q_kw[row], seg_kw[u, s]
        )

    check_storage_error(gs, gi, before_cast, case.dtype)
    return True


test_score_segments_grid = _grid_test(_score_segments_case)


# ------------------------------------------------------------------------------- select_pages
def page_layout(
    case: Case, n_pages: list[int], block_size: int, width_extra: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Block tables [S, MB] over a shuffled pool for segments holding n_pages pages, plus now
    and then a hole (-1), a block past the pool, or a block another segment holds too (its
    pages are then candidates twice); returns (table, npages, pool blocks)."""
    rng = case.rng
    need = [-(-n // block_size) for n in n_pages]
    width = max([*need, 1]) + width_extra
    blocks = sum(need)
    order = rng.permutation(max(blocks, 1))
    table = np.full((len(n_pages), width), -1, np.int32)
    at = 0
    for s, nb in enumerate(need):
        table[s, :nb] = order[at : at + nb]
        at += nb
        if nb > 1 and rng.random() < 0.2:
            table[s, int(rng.integers(0, nb))] = rng.choice([-1, blocks + 5])  # hole, past pool
        if nb > 0 and at > nb and rng.random() < 0.15:  # a block of another segment, again:
            table[s, int(rng.integers(0, nb))] = order[int(rng.integers(0, at - nb))]  # twice
    npages = np.array(n_pages, np.int32)
    if npages.size and rng.random() < 0.3:  # a count past the table is capped at MB * P
        npages[int(rng.integers(0, npages.size))] += width * block_size + 3
    return table, npages, max(blocks, 1)


def _select_pages_case(case: Case) -> bool:
    """Top-k pages by cosine inside the chosen segments of one user; False to redraw."""
    rng, dev = case.rng, Device(case.backend)
    block_size = int(rng.choice([1, 4, 16]))
    n_seg = int(rng.integers(1, 5))
    cuts = np.sort(rng.integers(0, case.candidates + 1, n_seg - 1))
    live_per_seg = np.diff(np.r_[0, cuts, case.candidates]).tolist()
    deleted = [int(rng.integers(0, 3)) for _ in range(n_seg)]
    n_pages = [a + d for a, d in zip(live_per_seg, deleted, strict=True)]
    slots = n_seg + 2  # two more segment slots that are never chosen
    table, npages, blocks = page_layout(case, [*n_pages, 3, 0], block_size, int(rng.integers(0, 2)))
    n_users = 2
    bt = np.full((n_users, slots, table.shape[1]), -1, np.int32)
    bt[0] = table
    seg_np = np.zeros((n_users, slots), np.int32)
    seg_np[0] = npages
    pool = blocks * block_size
    page_live = np.ones(pool, np.uint8)
    for s, d in enumerate(deleted):  # delete d of each segment's pages
        slots_s = ref.segment_page_slots(seg_np[0, s], bt[0, s], block_size, pool)
        if slots_s.size and d:
            page_live[rng.choice(slots_s, min(d, slots_s.size), replace=False)] = 0
    raw, stored = palette(case, 12)
    pick = rng.integers(0, 12, pool)
    emb = scaled_rows(case, stored, pick)
    b = int(rng.integers(1, 4))
    q = queries(case, stored, b)
    q_user = rng.choice([0, 0, 0, 1, 2], b).astype(np.int32)  # user 1 has nothing, 2 invalid
    m = int(rng.integers(1, 6))
    chosen = rng.choice([*range(n_seg), -1, slots + 1, -7], (b, m)).astype(np.int32)
    chosen[:, 0] = rng.integers(0, n_seg, b)
    if m > 1:
        chosen[:, 1] = chosen[:, 0]  # a repeated segment counts once
    min_score = float(rng.choice([-np.inf, 0.0, 0.3]))
    for row in range(b):
        cos = ref.cosines_ref(q[row], stored)
        if not separated(dict(enumerate(cos)), (min_score,)):
            return False
    page_emb, page_stored = dev.emb(emb, case.dtype, case.offset)
    out = dev.out(b, case.k)
    from memoryos_gpu import _C

    _C.select_pages(
        dev.put(q),
        dev.put(q_user),
        dev.put(chosen),
        page_emb,
        dev.put(page_live),
        dev.put(seg_np),
        dev.put(bt),
        block_size,
        min_score,
        *out,
        dev.stream(),
    )
    want = ref.select_pages_raw_ref(
        q, q_user, chosen, page_stored, page_live, seg_np, bt, block_size, min_score, case.k
    )
    gs, gi = assert_topk(out, want, dev)
    check_storage_error(gs, gi, lambda r, p: ref.cosine_ref(q[r], raw[pick[p]]), case.dtype)
    return True


test_select_pages_grid = _grid_test(_select_pages_case)


# ------------------------------------------------------------------------------- knowledge_topk
def _knowledge_topk_case(case: Case) -> bool:
    """Top-k ring entries by cosine of one owner; False to redraw."""
    rng, dev = case.rng, Device(case.backend)
    n_owners, cap = 2, case.candidates + int(rng.integers(0, 8))
    live = np.zeros((n_owners, cap), np.uint8)
    live[0, rng.choice(cap, case.candidates, replace=False)] = 1  # owner 1 is empty
    raw, stored = palette(case, 12)
    pick = rng.integers(0, 12, (n_owners, cap))
    emb = scaled_rows(case, stored, pick.reshape(-1)).reshape(n_owners, cap, case.dim)
    b = int(rng.integers(1, 4))
    q = queries(case, stored, b)
    owner = rng.choice([0, 0, 1, 5], b).astype(np.int32)
    for row in range(b):
        if not separated(dict(enumerate(ref.cosines_ref(q[row], stored)))):
            return False
    kn_emb, kn_stored = dev.emb(emb, case.dtype, case.offset)
    out = dev.out(b, case.k)
    from memoryos_gpu import _C

    _C.knowledge_topk(dev.put(q), dev.put(owner), kn_emb, dev.put(live), *out, dev.stream())
    want = ref.knowledge_topk_raw_ref(q, owner, kn_stored, live, case.k)
    gs, gi = assert_topk(out, want, dev)
    check_storage_error(
        gs, gi, lambda r, e: ref.cosine_ref(q[r], raw[pick[owner[r], e]]), case.dtype
    )
    return True


test_knowledge_topk_grid = _grid_test(_knowledge_topk_case)


# ------------------------------------------------------------------------------- one meaning
def _one_segment_score(backend: str, q_kw: list[int], seg_kw: list[int], emb: np.ndarray) -> float:
    from memoryos_gpu import _C

    dev = Device(backend)
    width = max(len(q_kw), len(seg_kw))
    qk = np.full((1, width), -1, np.int32)
    qk[0, : len(q_kw)] = q_kw
    sk = np.full((1, 1, width), -1, np.int32)
    sk[0, 0, : len(seg_kw)] = seg_kw
    e, _ = dev.emb(emb[None, None, :], "float32", 0)
    s, i = dev.out(1, 1)
    q = dev.put(np.ones((1, emb.size), np.float32))
    _C.score_segments(
        q, dev.put(np.zeros(1, np.int32)), dev.put(qk), e, dev.put(sk),
        dev.put(np.ones((1, 1), np.uint8)), 1.0, s, i, dev.stream(),
    )  # fmt: skip
    return float(dev.host(s)[0, 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("q_kw", "seg_kw", "jac"),
    [
        ([1, 1, 2], [1, 2], 1.0),  # duplicates in the query collapse (the example)
        ([2, 1], [1, 2, 2], 1.0),  # unsorted query, duplicates in the row
        ([3, 1, 2], [2, 5, 2, 1], 2 / 4),  # both unsorted
        ([7, -1, 7], [7], 1.0),  # the row ends at its first pad
    ],
)
def test_keyword_rows_are_sets_on_every_path(backend, q_kw, seg_kw, jac) -> None:
    """Jaccard is a set measure on the CPU, the GPU and the oracle, whatever the row order."""
    emb = np.ones(4, np.float32)
    got = _one_segment_score(backend, q_kw, seg_kw, emb)
    want = ref.score_segments_raw_ref(
        np.ones((1, 4), np.float32),
        np.zeros(1, np.int32),
        np.array([q_kw + [-1] * (4 - len(q_kw))], np.int32),
        emb[None, None, :],
        np.array([[seg_kw + [-1] * (4 - len(seg_kw))]], np.int32),
        np.ones((1, 1), np.uint8),
        1,
    )[0][0, 0]
    assert got == pytest.approx(1.0 + jac, abs=1e-6)
    assert want == pytest.approx(1.0 + jac, abs=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("exponent", [66, 100, -70, -100])
def test_rows_of_extreme_magnitude_keep_their_cosine(backend, exponent) -> None:
    """A finite fp32 row of v x 2^66 (squared norm past FLT_MAX) or v x 2^-70 (squares lost to
    underflow) has cosine 1 with v, as in float64; a zero row has cosine 0."""
    v = np.random.default_rng(exponent & 0xFF).standard_normal(384).astype(np.float32)
    rows = np.stack([np.ldexp(v, exponent), np.zeros_like(v), v]).astype(np.float32)
    from memoryos_gpu import _C

    dev = Device(backend)
    e, _ = dev.emb(rows[None], "float32", 0)
    s, i = dev.out(1, 3)
    _C.knowledge_topk(
        dev.put(v[None]), dev.put(np.zeros(1, np.int32)), e,
        dev.put(np.ones((1, 3), np.uint8)), s, i, dev.stream(),
    )  # fmt: skip
    scores, ids = dev.host(s)[0], dev.host(i)[0]
    assert ids.tolist() == [0, 2, 1]  # the tie of rows 0 and 2 goes to the lower id
    np.testing.assert_allclose(scores, [1.0, 1.0, 0.0], atol=1e-6)
    assert scores[0] == scores[1]  # bit-equal: the rescaled pass sums in the fast path's order


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_queries_and_rows_have_one_meaning(backend) -> None:
    """A query holding NaN gets a padded row; a stored row holding NaN scores -inf (ranked after
    every finite score, before padding), on both paths."""
    from memoryos_gpu import _C

    dev = Device(backend)
    rows = np.array([[[1.0, 0.0], [np.nan, 1.0], [0.0, 1.0]]], np.float32)
    e, _ = dev.emb(rows, "float32", 0)
    q = np.array([[1.0, 0.0], [np.nan, 0.0]], np.float32)
    s, i = dev.out(2, 4)
    _C.knowledge_topk(
        dev.put(q), dev.put(np.zeros(2, np.int32)), e, dev.put(np.ones((1, 3), np.uint8)),
        s, i, dev.stream(),
    )  # fmt: skip
    assert dev.host(i).tolist() == [[0, 2, 1, -1], [-1, -1, -1, -1]]
    scores = dev.host(s)
    assert scores[0, 0] == pytest.approx(1.0) and scores[0, 1] == pytest.approx(0.0)
    assert np.isneginf(scores[0, 2:]).all() and np.isneginf(scores[1]).all()


@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(1, 1100),
    n=st.integers(1, 6),
    exponent=st.sampled_from([0, 0, 3, -5, 70, -70, 120, -140]),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpu_builds_for_every_isa_give_the_same_bits(d, n, exponent, seed) -> None:
    """The baseline (SSE2) and the AVX2 build of the CPU inner loops are bit-equal, whatever d
    (tails included) and magnitude (the rescaled pass included): no FMA in either, the same
    summation order in both, so near-ties, min_score and theta decide alike on every machine.
    On a CPU without AVX2 only the baseline runs and the check is that it matches the oracle."""
    from memoryos_gpu import _C

    rng = np.random.default_rng(seed)
    q = rng.standard_normal(d).astype(np.float32)
    rows = np.ldexp(rng.standard_normal((n, d)), exponent).astype(np.float32)
    rows[0] = np.ldexp(q, exponent) if exponent < 100 else rows[0]  # cosine 1 for row 0
    out = np.full((2, n), np.nan, np.float32)
    builds = _C._cpu_cosines_per_isa(q, rows, out)
    assert builds in (1, 2)
    np.testing.assert_allclose(out[0], ref.cosines_ref(q, rows), atol=ACCUM_TOL)
    if builds == 2:
        np.testing.assert_array_equal(out[0].view(np.uint32), out[1].view(np.uint32))


# ------------------------------------------------------------------------------- CUDA only
cuda_only = pytest.mark.parametrize("backend", [_backend_param("cuda")])


@cuda_only
def test_concurrent_large_k_launches_do_not_race(backend) -> None:
    """Two threads with different k past the 48 KiB shared-memory default launch at once: the
    opt-in attribute only ever grows (under a lock), so neither launch can see it lowered."""
    import torch

    from memoryos_gpu import _C

    rng = np.random.default_rng(3)
    emb = torch.from_numpy(rng.standard_normal((2, 7000, 64)).astype(np.float32)).cuda()
    live = torch.ones((2, 7000), dtype=torch.uint8, device="cuda")
    q = torch.from_numpy(rng.standard_normal((8, 64)).astype(np.float32)).cuda()
    owner = torch.zeros(8, dtype=torch.int32, device="cuda")

    def launch(k: int, stream: Any) -> np.ndarray:
        s = torch.empty((8, k), device="cuda")
        i = torch.empty((8, k), dtype=torch.int32, device="cuda")
        _C.knowledge_topk(q, owner, emb, live, s, i, stream.cuda_stream)
        return i.cpu().numpy()

    # sizes no other test launches this kernel instance with, so the attribute is first set
    # here, by the racing threads; the expected results are computed one at a time after
    ks = (5000, 6000)
    results: dict[int, list[np.ndarray]] = {k: [] for k in ks}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(20):
                    results[k].append(launch(k, stream))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in ks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in ks:
        expected = launch(k, torch.cuda.current_stream())
        for got in results[k]:
            np.testing.assert_array_equal(got, expected)


@cuda_only
def test_fp16_range_is_checked_before_the_cast(backend) -> None:
    """A finite value that float16 cannot hold is rejected before it becomes infinity."""
    from memoryos_gpu.arena import Arena, ArenaConfig
    from memoryos_gpu.errors import ArenaError

    arena = Arena(ArenaConfig(dim=4, segment_slots=2, keyword_width=2, device="cuda"))
    arena.add_users(1)
    ok = np.array([[65504.0, 1.0, 0.0, 0.0]])
    arena.write_segments([0], [0], ok, np.zeros((1, 2), int))
    with pytest.raises(ArenaError, match="float16"):
        arena.write_segments([0], [1], np.array([[70000.0, 1, 0, 0]]), np.zeros((1, 2), int))
    assert not arena.host("seg_live")[0, 1]


@cuda_only
def test_the_retrieval_path_never_waits_for_the_device(backend) -> None:
    """score_segments -> select_pages (chosen stays on the device) -> knowledge_topk with host
    inputs: torch's sync debug mode raises on any synchronising call in between."""
    import torch

    from memoryos_gpu.arena import Arena, ArenaConfig

    arena = Arena(ArenaConfig(dim=8, segment_slots=4, keyword_width=3, device="cuda"))
    arena.add_users(2)
    arena.add_owners(2)
    rng = np.random.default_rng(0)
    arena.write_segments([0, 0, 1], [0, 2, 1], rng.standard_normal((3, 8)), np.ones((3, 3), int))
    arena.append_pages([0, 0, 1], [0, 2, 1], rng.standard_normal((3, 8)))
    arena.push_knowledge([0, 1], rng.standard_normal((2, 8)))
    q, users, kw = rng.standard_normal((2, 8)), np.array([0, 1]), np.array([[1, -1], [2, 1]])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, chosen = ops.score_segments(arena, q, users, kw, 2)
        _, pi = ops.select_pages(arena, q, users, chosen, 3)
        _, ki = ops.knowledge_topk(arena, q, users, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = ref.select_pages_ref(arena, q, users, chosen.cpu().numpy(), 3)
    np.testing.assert_array_equal(pi.cpu().numpy(), want[1])
    np.testing.assert_array_equal(ki.cpu().numpy(), ref.knowledge_topk_ref(arena, q, users, 2)[1])

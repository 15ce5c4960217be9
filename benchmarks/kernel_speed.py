"""Kernel throughput, two routines.

``--routine engine``: this project's kernels through :mod:`memoryos_gpu.ops` (what the engine
calls: input checks and transfers included) vs a reference-style per-user loop vs torch batched.
A synthetic arena of U users x S segments x P pages per segment (d = 384) is queried by batches
of B queries across distinct users: segment scoring (cos + Jaccard, top-5) then page selection
(top-10 inside the chosen segments). All three methods do the same work in the same run:

- ``kernels``: memoryos_gpu.ops (C++/OpenMP on CPU, CUDA on GPU);
- ``reference-loop``: what BAI-LAB/MemoryOS does per query: build a faiss IndexFlatIP over the
  user's segment embeddings, search, then score the chosen segments' pages one np.dot at a time;
- ``torch-batched``: gather + bmm + topk over the whole batch (the obvious vectorised baseline).

``--routine kernel-only``: each native kernel called directly (``memoryos_gpu._C``) on arrays
already where the kernel reads them, per storage dtype (``--dtypes``; the CPU stores float32),
timed with CUDA events on a GPU (wall clock on the CPU), median with p20 / p80 over
``--repeat`` runs after an untimed warm-up; on a GPU the timed calls are issued while a spin
kernel holds the stream, so the events time the kernels and not the host that issues them
(``issue us``: the host's time to issue one call). Reported: the bytes each kernel must read
over its time (GB/s), and on a GPU its fraction of the measured device copy bandwidth (read +
write bytes of a 1 GiB device-to-device copy), the issue-16 target being >= 50 % at B = 1,024,
S = 200, d = 384.

Usage: python benchmarks/kernel_speed.py [--routine engine|kernel-only|all] [--users 10000]
       [--batch 1024] [--pages-per-segment 2] [--dtypes float16 float32]
       [--device auto|cpu|cuda] [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from cli_args import (
    DEVICES,
    Parser,
    apply_defaults,
    check_output,
    positive_int,
    resolve_device,
    run_main,
    today,
    write_json,
)

from memoryos_gpu import ops
from memoryos_gpu.arena import Arena, ArenaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import hardware  # the benchmarks' one description of the host

M_SEGMENTS, K_PAGES, K_KNOWLEDGE, KW_WIDTH, Q_KW, KN_CAPACITY = 5, 10, 10, 16, 8, 100


def build_arena(
    users: int, slots: int, pages_per_segment: int, dim: int, device: str, seed: int = 0
) -> Arena:
    """A full arena: every user has ``slots`` live segments with ``pages_per_segment`` pages."""
    rng = np.random.default_rng(seed)
    # blocks sized to the segments so the pool holds no empty slots (RAM bounds U here)
    block = max(1, min(ArenaConfig().block_size, pages_per_segment))
    arena = Arena(
        ArenaConfig(
            dim=dim,
            segment_slots=slots,
            keyword_width=KW_WIDTH,
            device=device,
            block_size=block,
            initial_users=users,
            initial_blocks=max(1, users * slots * -(-pages_per_segment // block)),
        )
    )
    arena.add_users(users)
    chunk = max(1, 2_000_000 // (slots * max(1, pages_per_segment)))
    for start in range(0, users, chunk):  # bounded temporaries
        us = np.arange(start, min(users, start + chunk), dtype=np.int32)
        u = np.repeat(us, slots)
        s = np.tile(np.arange(slots, dtype=np.int32), us.size)
        emb = rng.standard_normal((u.size, dim), dtype=np.float32)
        kw = np.sort(rng.integers(0, 5000, size=(u.size, KW_WIDTH), dtype=np.int32), axis=1)
        kw[:, KW_WIDTH // 2 :] = -1  # half-full keyword rows
        arena.write_segments(u, s, emb, kw, l_interaction=np.full(u.size, pages_per_segment))
        if pages_per_segment:
            pu, ps = np.repeat(u, pages_per_segment), np.repeat(s, pages_per_segment)
            arena.append_pages(pu, ps, rng.standard_normal((pu.size, dim), dtype=np.float32))
    return arena


def make_queries(arena: Arena, batch: int, seed: int = 1) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    users = rng.choice(arena.user_capacity, size=batch, replace=batch > arena.user_capacity)
    q = rng.standard_normal((batch, arena.config.dim), dtype=np.float32)
    kw = np.sort(rng.integers(0, 5000, size=(batch, Q_KW), dtype=np.int32), axis=1)
    return q, users.astype(np.int32), kw


# ---------------------------------------------------------------------------------- methods
def run_kernels(arena: Arena, q, users, kw) -> Any:
    _, chosen = ops.score_segments(arena, q, users, kw, M_SEGMENTS)
    return ops.select_pages(arena, q, users, chosen, K_PAGES)


def run_reference_loop(arena: Arena, q, users, kw) -> list:
    """Per query, as the reference code does it (faiss index per query, np.dot per page)."""
    import faiss

    seg_emb, live = arena.host("seg_emb"), arena.host("seg_live")
    page_emb = arena.host("page_emb")
    results = []
    for b in range(q.shape[0]):
        u = int(users[b])
        slots = np.flatnonzero(live[u])
        summaries = seg_emb[u, slots]
        summaries = summaries / np.linalg.norm(summaries, axis=1, keepdims=True)
        index = faiss.IndexFlatIP(summaries.shape[1])
        index.add(summaries)
        qv = q[b] / np.linalg.norm(q[b])
        _, idx = index.search(qv[None, :], M_SEGMENTS)
        scored = []
        for i in idx[0]:
            if i < 0:
                continue
            for p in arena.segment_pages(u, int(slots[i])):
                pe = page_emb[p] / np.linalg.norm(page_emb[p])
                scored.append((float(np.dot(pe, qv)), int(p)))
        scored.sort(key=lambda t: -t[0])
        results.append(scored[:K_PAGES])
    return results


class TorchBatched:
    """gather + bmm + topk over the batch, with the same Jaccard term and masking."""

    def __init__(self, arena: Arena) -> None:
        import torch

        self.torch = torch
        dev = "cuda" if arena.on_cuda else "cpu"
        as_t = (lambda a: a) if arena.on_cuda else torch.from_numpy
        self.seg_emb, self.seg_kw = as_t(arena.seg_emb), as_t(arena.seg_kw)
        self.live = as_t(arena.seg_live).bool()
        self.npages, self.table = as_t(arena.seg_npages), as_t(arena.block_table)
        self.page_emb = as_t(arena.page_emb)
        self.bs, self.dev = arena.config.block_size, dev

    def __call__(self, q, users, kw):
        torch = self.torch
        q = torch.as_tensor(q, device=self.dev).to(self.seg_emb.dtype)
        u = torch.as_tensor(users, device=self.dev).long()
        kw = torch.as_tensor(kw, device=self.dev)
        seg = self.seg_emb[u]  # [B, S, d]
        cos = torch.bmm(seg, q[:, :, None])[..., 0].float()
        cos = cos / (seg.float().norm(dim=-1) * q.float().norm(dim=-1, keepdim=True)).clamp_min(
            1e-30
        )
        skw = self.seg_kw[u]  # [B, S, K]
        eq = (skw[..., :, None] == kw[:, None, None, :]) & (skw[..., :, None] >= 0)
        inter = eq.any(-1).sum(-1)
        na = (skw >= 0).sum(-1)
        nb = (kw >= 0).sum(-1, keepdim=True)
        jac = torch.where((na > 0) & (nb > 0), inter / (na + nb - inter).clamp_min(1), 0.0)
        score = torch.where(self.live[u], cos + jac, float("-inf"))
        _, chosen = score.topk(M_SEGMENTS, dim=1)  # [B, m]
        rows = self.table[u[:, None], chosen]  # [B, m, MB]
        n = self.npages[u[:, None], chosen]  # [B, m]
        i = torch.arange(rows.shape[-1] * self.bs, device=self.dev)
        slots = rows[..., i // self.bs].long() * self.bs + i % self.bs  # [B, m, MB*P]
        valid = i[None, None, :] < n[..., None]
        slots = torch.where(valid, slots, 0).flatten(1)
        pe = self.page_emb[slots]  # [B, C, d]
        pcos = torch.bmm(pe, q[:, :, None])[..., 0].float()
        pcos = pcos / (pe.float().norm(dim=-1) * q.float().norm(dim=-1, keepdim=True)).clamp_min(
            1e-30
        )
        pcos = torch.where(valid.flatten(1), pcos, float("-inf"))
        k = min(K_PAGES, pcos.shape[1])
        return pcos.topk(k, dim=1)


# ---------------------------------------------------------------------------------- timing
def timed(fn, repeat: int, sync=None) -> list[float]:
    fn()  # warm-up, untimed
    if sync:
        sync()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth_gbs(arena: Arena) -> float | None:
    """Device-to-device copy bandwidth (read + write bytes / s), the GPU roofline we compare to."""
    if not arena.on_cuda:
        return None
    import torch

    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=arena.seg_emb.device)
    dst = torch.empty_like(src)
    times = timed(lambda: dst.copy_(src), 10, torch.cuda.synchronize)
    return 2 * src.numel() / statistics.median(times) / 1e9


def kernel_bytes(arena: Arena, users: np.ndarray, pages_per_segment: int) -> int:
    """Bytes the kernels must read: every live segment row of each query's user, then the pages
    of the chosen segments."""
    c = arena.config
    elem = 4 if not arena.on_cuda else 2
    seg_bytes = users.size * c.segment_slots * (c.dim * elem + c.keyword_width * 4 + 1)
    page_bytes = users.size * M_SEGMENTS * pages_per_segment * (c.dim * elem + 1)
    return int(seg_bytes + page_bytes)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    arena = build_arena(args.users, args.slots, args.pages_per_segment, args.dim, args.device)
    build_s = time.perf_counter() - t0
    q, users, kw = make_queries(arena, args.batch)
    sync = None
    if arena.on_cuda:
        import torch

        sync = torch.cuda.synchronize
    rows: dict[str, Any] = {}
    t = timed(lambda: run_kernels(arena, q, users, kw), args.repeat, sync)
    rows["kernels"] = statistics.median(t)
    tb = TorchBatched(arena)
    # torch's gather temporaries grow with B; run it in chunks that fit comfortably
    chunk = min(args.batch, 256)
    t = timed(
        lambda: [
            tb(q[i : i + chunk], users[i : i + chunk], kw[i : i + chunk])
            for i in range(0, args.batch, chunk)
        ],
        args.repeat,
        sync,
    )
    rows["torch-batched"] = statistics.median(t)
    n_ref = min(args.batch, args.reference_queries)
    t = timed(
        lambda: run_reference_loop(arena, q[:n_ref], users[:n_ref], kw[:n_ref]),
        max(1, args.repeat // 2),
    )
    rows["reference-loop"] = statistics.median(t) * args.batch / n_ref  # scaled to the batch
    qps = {name: args.batch / sec for name, sec in rows.items()}
    result: dict[str, Any] = {
        "users": args.users,
        "segments_per_user": args.slots,
        "pages_per_segment": args.pages_per_segment,
        "dim": args.dim,
        "batch": args.batch,
        "device": args.device,
        "arena_bytes": arena.nbytes(),
        "arena_build_s": round(build_s, 2),
        "queries_per_s": {k: round(v, 1) for k, v in qps.items()},
        "ratio_vs_reference_loop": round(qps["kernels"] / qps["reference-loop"], 2),
        "ratio_vs_torch_batched": round(qps["kernels"] / qps["torch-batched"], 2),
        "reference_queries_timed": n_ref,
    }
    if arena.on_cuda:
        moved = kernel_bytes(arena, users, args.pages_per_segment)
        achieved = moved / rows["kernels"] / 1e9
        copy = copy_bandwidth_gbs(arena)
        result.update(
            achieved_gb_s=round(achieved, 1),
            copy_gb_s=round(copy, 1),
            fraction_of_copy=round(achieved / copy, 3),
        )
    return result


# ---------------------------------------------------------------------------------- kernel-only
class Raw:
    """Random kernel inputs in the layout the kernels read, on one device (NumPy on the CPU,
    torch on CUDA, generated there): U users x S segments (every slot live, keyword rows
    sorted and half full), P pages per segment in one block each, R knowledge entries per
    user, and B queries from distinct users."""

    def __init__(
        self,
        users: int,
        slots: int,
        pages: int,
        dim: int,
        batch: int,
        device: str,
        dtype: str,
        seed: int = 0,
    ) -> None:
        self.cuda = device.startswith("cuda")
        self.users, self.slots, self.pages, self.dim, self.batch = users, slots, pages, dim, batch
        self.dtype, self.elem = dtype, np.dtype(dtype).itemsize
        if self.cuda:
            import torch

            self.torch = torch
            self.g = torch.Generator(device=device).manual_seed(seed)
            self.dev = device
        else:
            self.rng = np.random.default_rng(seed)
        u, s, b = users, slots, batch
        self.seg_emb = self.normal((u, s, dim), dtype)
        self.seg_kw = self.keywords((u, s, KW_WIDTH))
        self.seg_live = self.full((u, s), 1, "uint8")
        self.page_emb = self.normal((u * s * max(pages, 1), dim), dtype)
        self.page_live = self.full((u * s * max(pages, 1),), 1, "uint8")
        self.npages = self.full((u, s), pages, "int32")
        self.block_table = self.arange(u * s).reshape(u, s, 1)  # block = u * S + s, size P
        self.kn_emb = self.normal((u, KN_CAPACITY, dim), dtype)
        self.kn_live = self.full((u, KN_CAPACITY), 1, "uint8")
        self.q = self.normal((b, dim), "float32")
        self.q_user = self.choice(u, b)
        self.q_kw = self.keywords((b, Q_KW), half=False)

    # --- generators (one per backend) ---
    def normal(self, shape: tuple[int, ...], dtype: str) -> Any:
        if self.cuda:
            t = self.torch.randn(shape, generator=self.g, device=self.dev)
            return t.to(getattr(self.torch, dtype))
        return self.rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)

    def full(self, shape: tuple[int, ...], value: int, dtype: str) -> Any:
        if self.cuda:
            return self.torch.full(shape, value, dtype=getattr(self.torch, dtype), device=self.dev)
        return np.full(shape, value, dtype=dtype)

    def arange(self, n: int) -> Any:
        if self.cuda:
            return self.torch.arange(n, dtype=self.torch.int32, device=self.dev)
        return np.arange(n, dtype=np.int32)

    def choice(self, n: int, k: int) -> Any:
        if self.cuda:
            perm = self.torch.randperm(n, generator=self.g, device=self.dev)[:k]
            return perm.to(self.torch.int32)
        return self.rng.choice(n, size=k, replace=False).astype(np.int32)

    def keywords(self, shape: tuple[int, ...], half: bool = True) -> Any:
        """Sorted, unique ids (cumulative random gaps), the second half padded when half."""
        if self.cuda:
            gaps = self.torch.randint(1, 600, shape, generator=self.g, device=self.dev)
            ids = self.torch.cumsum(gaps, dim=-1).to(self.torch.int32)
        else:
            ids = np.cumsum(self.rng.integers(1, 600, shape), axis=-1).astype(np.int32)
        if half:
            ids[..., shape[-1] // 2 :] = -1
        return ids

    def out(self, k: int) -> tuple[Any, Any]:
        if self.cuda:
            t = self.torch
            return (
                t.empty((self.batch, k), dtype=t.float32, device=self.dev),
                t.empty((self.batch, k), dtype=t.int32, device=self.dev),
            )
        return np.empty((self.batch, k), np.float32), np.empty((self.batch, k), np.int32)

    def stream(self) -> int:
        return int(self.torch.cuda.current_stream().cuda_stream) if self.cuda else 0

    # --- the bytes each kernel must read ---
    def bytes_score(self) -> int:
        row = self.dim * self.elem + KW_WIDTH * 4 + 1
        return self.batch * (self.slots * row + self.dim * 4 + Q_KW * 4)

    def bytes_select(self) -> int:
        return self.batch * (M_SEGMENTS * self.pages * (self.dim * self.elem + 1) + self.dim * 4)

    def bytes_knowledge(self) -> int:
        return self.batch * (KN_CAPACITY * (self.dim * self.elem + 1) + self.dim * 4)


def kernel_calls(raw: Raw) -> dict[str, tuple[Any, int]]:
    """Each kernel as a no-argument call, with the bytes it reads."""
    from memoryos_gpu import _C

    seg_s, seg_i = raw.out(M_SEGMENTS)
    pg_s, pg_i = raw.out(K_PAGES)
    kn_s, kn_i = raw.out(K_KNOWLEDGE)
    st = raw.stream()

    def score() -> None:
        _C.score_segments(
            raw.q,
            raw.q_user,
            raw.q_kw,
            raw.seg_emb,
            raw.seg_kw,
            raw.seg_live,
            1.0,
            seg_s,
            seg_i,
            st,
        )

    def select() -> None:
        _C.select_pages(
            raw.q,
            raw.q_user,
            seg_i,
            raw.page_emb,
            raw.page_live,
            raw.npages,
            raw.block_table,
            max(raw.pages, 1),
            float("-inf"),
            pg_s,
            pg_i,
            st,
        )

    def knowledge() -> None:
        _C.knowledge_topk(raw.q, raw.q_user, raw.kn_emb, raw.kn_live, kn_s, kn_i, st)

    score()  # select_pages reads the chosen segments it wrote
    return {
        "score_segments": (score, raw.bytes_score()),
        "select_pages": (select, raw.bytes_select()),
        "knowledge_topk": (knowledge, raw.bytes_knowledge()),
    }


#: GPU clock cycles a second that a hold is sized with: the H100 / H200 boost clock or above,
#: so a hold lasts at least as long as asked (a slower clock only lengthens it).
SPIN_HZ = 2.0e9


def time_call(fn: Any, repeat: int, cuda: bool) -> tuple[list[float], float]:
    """Seconds of each call, and the host's seconds to issue one, after an untimed warm-up.

    On the CPU both are the wall clock. On a GPU, CUDA events around each call while a spin
    kernel holds the stream until the host has issued every timed call: the calls then run
    back to back and the events time the kernels alone. Events around calls issued one at a
    time (the first H200 runs) time the host instead wherever issuing a call takes longer than
    running it, as the GPU waits between the events: every kernel read 110-300 us there,
    whatever its bytes, and a second run of the same code 1.8x more."""
    fn()
    if not cuda:
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out, statistics.median(out)
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    hold = 2.0 * repeat * (time.perf_counter() - t0) + 1e-3
    for _ in range(4):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeat)
        ]
        torch.cuda._sleep(int(hold * SPIN_HZ))
        released = torch.cuda.Event()
        released.record()
        t0 = time.perf_counter()
        for start, end in events:
            start.record()
            fn()
            end.record()
        issue = (time.perf_counter() - t0) / repeat
        outran = released.query()  # the hold ended before the host issued the last call
        torch.cuda.synchronize()
        if not outran:
            return [start.elapsed_time(end) / 1e3 for start, end in events], issue
        hold *= 4
    raise RuntimeError("the GPU outran the host however long the hold: time fewer calls")


def device_copy_gbs(repeat: int) -> float:
    """Read + write bytes per second of a 1 GiB device-to-device copy (CUDA events)."""
    import torch

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times, _ = time_call(lambda: dst.copy_(src), repeat, cuda=True)
    return 2 * src.numel() / statistics.median(times) / 1e9


def host_copy_gbs(repeat: int) -> float:
    """Read + write bytes per second of a 256 MiB host copy (the CPU's streaming roofline)."""
    src = np.ones(2**28, np.uint8)
    dst = np.empty_like(src)
    times, _ = time_call(lambda: np.copyto(dst, src), repeat, cuda=False)
    return 2 * src.size / statistics.median(times) / 1e9


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


def bench_kernel_only(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    dtypes = args.dtypes if cuda else ["float32"]
    copy = device_copy_gbs(args.repeat) if cuda else host_copy_gbs(args.repeat)
    users = max(args.users[0], args.batch)  # queries from distinct users
    pages = args.pages_per_segment[0] if args.pages_per_segment else 2
    results = []
    for dtype in dtypes:
        t0 = time.perf_counter()
        raw = Raw(users, args.slots, pages, args.dim, args.batch, args.device, dtype)
        build_s = time.perf_counter() - t0
        for name, (fn, nbytes) in kernel_calls(raw).items():
            times, issue = time_call(fn, args.repeat, cuda)
            med = statistics.median(times)
            gbs = nbytes / med / 1e9
            results.append(
                {
                    "kernel": name,
                    "dtype": dtype,
                    "median_us": round(med * 1e6, 1),
                    "p20_us": round(percentile(times, 20) * 1e6, 1),
                    "p80_us": round(percentile(times, 80) * 1e6, 1),
                    "bytes": nbytes,
                    "gb_s": round(gbs, 1),
                    "fraction_of_copy": round(gbs / copy, 3),
                    "queries_per_s": round(args.batch / med, 1),
                    # the host's time to issue one call (argument conversion included)
                    "issue_us": round(issue * 1e6, 1),
                    "build_s": round(build_s, 2),
                }
            )
        del raw
    return {
        "routine": "kernel-only",
        "device": args.device,
        "users": users,
        "segments_per_user": args.slots,
        "pages_per_segment": pages,
        "dim": args.dim,
        "batch": args.batch,
        "copy_gb_s": round(copy, 1),
        "copy_kind": "device-to-device" if cuda else "host memcpy",
        "timing": "events around calls issued while a spin kernel holds the stream"
        if cuda
        else "wall clock",
        "kernels": results,
    }


def print_kernel_only(r: dict[str, Any]) -> None:
    # on a GPU the host's time to issue a call differs from the kernel's; on the CPU the wall
    # clock is both, so the column would only repeat "median us"
    gpu = r["copy_kind"] != "host memcpy"
    print(
        f"kernel-only on {r['device']}: B = {r['batch']}, S = {r['segments_per_user']}, "
        f"d = {r['dim']}, {r['users']} users, {r['pages_per_segment']} pages/segment; "
        f"{r['copy_kind']} copy {r['copy_gb_s']} GB/s"
    )
    head = (
        f"{'kernel':<16} {'dtype':<9} {'median us':>10} {'p20-p80 us':>16} {'GB/s':>8} "
        f"{'of copy':>8}" + (f" {'issue us':>9}" if gpu else "")
    )
    print(head)
    print("-" * len(head))
    for k in r["kernels"]:
        spread = f"{k['p20_us']}-{k['p80_us']}"
        print(
            f"{k['kernel']:<16} {k['dtype']:<9} {k['median_us']:>10} {spread:>16} "
            f"{k['gb_s']:>8} {k['fraction_of_copy']:>8.1%}"
            + (f" {k['issue_us']:>9}" if gpu else "")
        )
    if gpu:
        print("issue us: the host's time to issue one call (the kernels run behind a spin hold)")


def print_table(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'users':>7} {'pages/seg':>9} {'batch':>6} {'kernels q/s':>12} {'torch q/s':>10} "
        f"{'ref-loop q/s':>12} {'x ref':>7} {'x torch':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        qps = r["queries_per_s"]
        print(
            f"{r['users']:>7} {r['pages_per_segment']:>9} {r['batch']:>6} "
            f"{qps['kernels']:>12.0f} {qps['torch-batched']:>10.0f} {qps['reference-loop']:>12.0f} "
            f"{r['ratio_vs_reference_loop']:>7.1f} {r['ratio_vs_torch_batched']:>7.2f}"
            + (
                f"  {r['achieved_gb_s']} GB/s = {r['fraction_of_copy']:.0%} of copy"
                if "achieved_gb_s" in r
                else ""
            )
        )


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--routine",
        choices=["engine", "kernel-only", "all"],
        default="all",
        help="engine: the engine's kernels vs torch vs a reference-style loop; kernel-only: "
        "each raw kernel's time and bandwidth; all: both (default)",
    )
    p.add_argument(
        "--users",
        type=positive_int,
        nargs="+",
        default=None,
        help="users of the arena, one engine run each (default 1000 10000; --quick: 64)",
    )
    p.add_argument(
        "--pages-per-segment",
        type=positive_int,
        nargs="+",
        default=None,
        help="one per --users entry (default: 20 at <= 1000 users, else 2 to fit RAM; --quick: 4)",
    )
    p.add_argument("--slots", type=positive_int, default=200, help="MTM segments per user")
    p.add_argument("--dim", type=positive_int, default=384, help="embedding dimension")
    p.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="queries per kernel call, each for a distinct user, so at most the smallest "
        "--users (default 1024, or every user when fewer; --quick: 64)",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=None,
        help="timed calls per measurement, after an untimed one (default 5; --quick: 2)",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["float16", "float32"],
        choices=["float16", "bfloat16", "float32"],
        help="kernel-only storage dtypes on a GPU (the CPU stores float32)",
    )
    p.add_argument(
        "--reference-queries",
        type=positive_int,
        default=None,
        help="queries the slow reference loop actually runs (scaled to the batch; default 256; "
        "--quick: 32)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where the arena and kernels run (auto: CUDA when usable)",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: a few seconds, for CI")
    p.add_argument("--json", type=Path, default=None, help="write the report here (JSON)")
    args = p.parse_args(argv)
    check_output(p, args.json)  # a bad output path fails now, not after the run
    args.device = resolve_device(p, args.device)
    apply_defaults(
        args,
        full={"users": [1000, 10000], "repeat": 5, "reference_queries": 256},
        quick={
            "users": [64],
            "pages_per_segment": [4],
            "batch": 64,
            "repeat": 2,
            "reference_queries": 32,
        },
    )
    fewest = min(args.users)
    if args.batch is None:
        args.batch = min(1024, fewest)
    elif args.batch > fewest:
        p.error(
            f"--batch {args.batch} is more than --users {fewest}: each query of a batch is for "
            f"a distinct user; give --batch {fewest} or fewer, or more --users"
        )
    pps = args.pages_per_segment or [20 if u <= 1000 else 2 for u in args.users]
    if len(pps) != len(args.users):
        p.error("--pages-per-segment needs one value per --users value")
    report: dict[str, Any] = {
        "benchmark": "kernels",
        "date": today(),
        "hardware": hardware(),
        "build": ops.build_info(),
    }
    if args.routine in ("kernel-only", "all"):
        ko_args = argparse.Namespace(
            **{**vars(args), "users": [max(args.users)], "pages_per_segment": [pps[-1]]}
        )
        report["kernel_only"] = bench_kernel_only(ko_args)
        print_kernel_only(report["kernel_only"])
    if args.routine in ("engine", "all"):
        results = []
        for users, pages in zip(args.users, pps, strict=True):
            run = argparse.Namespace(**{**vars(args), "users": users, "pages_per_segment": pages})
            results.append(bench(run))
        print_table(results)
        report["results"] = results
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    run_main(main)

"""Kernel throughput: this project's kernels vs a reference-style per-user loop vs torch batched.

A synthetic arena of U users x S segments x P pages per segment (d = 384) is queried by batches
of B queries across distinct users: segment scoring (cos + Jaccard, top-5) then page selection
(top-10 inside the chosen segments). All three methods do the same work in the same run:

- ``kernels``: memoryos_gpu.ops (C++/OpenMP on CPU, CUDA on GPU);
- ``reference-loop``: what BAI-LAB/MemoryOS does per query: build a faiss IndexFlatIP over the
  user's segment embeddings, search, then score the chosen segments' pages one np.dot at a time;
- ``torch-batched``: gather + bmm + topk over the whole batch (the obvious vectorised baseline).

Usage: python benchmarks/kernels.py [--users 10000] [--batch 1024] [--pages-per-segment 2]
       [--device cpu|cuda] [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from memoryos_gpu import ops
from memoryos_gpu.arena import Arena, ArenaConfig

M_SEGMENTS, K_PAGES, KW_WIDTH, Q_KW = 5, 10, 16, 8


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


def hardware() -> dict[str, Any]:
    info = ops.build_info()
    hw = {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_threads": info["cpu_threads"],
        "cuda_usable": info["cuda_usable"],
    }
    if info["cuda_usable"]:
        import torch

        hw["gpu"] = torch.cuda.get_device_name(0)
    return hw


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, nargs="+", default=[1000, 10000])
    p.add_argument(
        "--pages-per-segment",
        type=int,
        nargs="+",
        default=None,
        help="one per --users entry (default: 20 at <= 1000 users, else 2 to fit RAM)",
    )
    p.add_argument("--slots", type=int, default=200)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--reference-queries",
        type=int,
        default=256,
        help="queries the slow reference loop actually runs (scaled to the batch)",
    )
    p.add_argument("--device", default="cuda" if ops.build_info()["cuda_usable"] else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a few seconds, for CI")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.users, args.pages_per_segment, args.batch, args.repeat = [64], [4], 64, 2
        args.reference_queries = 32
    pps = args.pages_per_segment or [20 if u <= 1000 else 2 for u in args.users]
    if len(pps) != len(args.users):
        p.error("--pages-per-segment needs one value per --users value")
    results = []
    for users, pages in zip(args.users, pps, strict=True):
        run = argparse.Namespace(**{**vars(args), "users": users, "pages_per_segment": pages})
        results.append(bench(run))
        print(json.dumps(results[-1]), file=sys.stderr)
    print_table(results)
    report = {
        "benchmark": "kernels",
        "date": time.strftime("%Y-%m-%d"),
        "hardware": hardware(),
        "build": ops.build_info(),
        "results": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Embedding backends compared in one run: ingestion pages/s through the engine and LoCoMo recall.

Backends: ``torch-fp32`` (the default ``Embedder`` on the CPU in fp32, 64 texts a batch) and
``onnx-int8`` (``OnnxEmbedder`` with its defaults: the same bundled MiniLM exported locally,
fused by onnxruntime's transformer optimizer and quantized to int8, 16 texts a batch). Each
LoCoMo dev conversation is ingested as one user into a fresh engine per backend (LLM-free
paper preset), and its questions are ranked by that engine, as ``benchmarks/locomo.py`` does;
the backends take turns conversation by conversation, so a change of load on a shared machine
hits both alike. Reported per backend: pages/s of ``add_many`` (embedding is ~95% of it),
process CPU seconds per page (steadier than wall time when the CPUs are shared), model load
time (the one-off ONNX export included when the cache was cold), and evidence recall at each
page budget. Targets: onnx-int8 >= 2x the pages/s of torch-fp32 with recall within 0.01.

Usage: python benchmarks/embedders.py [--quick] [--json OUT] [--budgets 5 10 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    check_locomo_work,
    check_output,
    load_locomo_data,
    machine_info,
    positive_int,
    run_main,
    today,
    write_json,
)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks/ingest.py and the CLI
sys.path.insert(0, str(Path(__file__).resolve().parent))

from locomo import EngineRanker

from memoryos_gpu.config import preset
from memoryos_gpu.eval.locomo import Conversation, default_locomo_path, evaluate_rankings

TARGET_SPEEDUP, RECALL_TOLERANCE = 2.0, 0.01


def make_backends(cache_dir: str | None) -> dict[str, tuple[Any, float]]:
    """name -> (embedder, load seconds)."""
    from memoryos_gpu.embed import Embedder, OnnxEmbedder

    out = {}
    t0 = time.perf_counter()
    out["torch-fp32"] = (Embedder(device="cpu", dtype="float32"), time.perf_counter() - t0)
    t0 = time.perf_counter()
    out["onnx-int8"] = (OnnxEmbedder(cache_dir=cache_dir), time.perf_counter() - t0)
    return out


def select(convs: list[Conversation], quick: bool) -> list[Conversation]:
    """The conversations the run ingests and scores: all, or with ``--quick`` the first one's
    first 80 pages and first 30 of the questions they answer."""
    if not quick:
        return convs
    convs = [c.truncated(80) for c in convs[:1]]
    for c in convs:
        c.questions = c.questions[:30]
    return convs


def run(args: argparse.Namespace, convs: list[Conversation]) -> dict[str, Any]:
    """Both backends over ``convs`` (:func:`select`'s)."""
    ks = tuple(args.budgets)
    backends = make_backends(args.cache_dir)
    rankings: dict[str, dict[str, list[list[int]]]] = {name: {} for name in backends}
    cpu = dict.fromkeys(backends, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        rankers = {
            name: EngineRanker(
                f"engine-{name}", {"memory": preset("paper")}, emb, max(ks), Path(tmp)
            )
            for name, (emb, _) in backends.items()
        }
        for conv in convs:
            for name, ranker in rankers.items():  # take turns, conversation by conversation
                c0 = time.process_time()
                ranker.ingest(conv)
                cpu[name] += time.process_time() - c0
                rankings[name][conv.sample_id] = ranker.rank(conv, conv.scored_questions)
        rows = []
        for name, ranker in rankers.items():
            reports = evaluate_rankings(
                convs, lambda c, qs, name=name: rankings[name][c.sample_id], ks
            )
            pages = ranker.engine.counters["pages_added"]
            rows.append(
                {
                    "backend": name,
                    "pages": pages,
                    "ingest_s": round(ranker.ingest_s, 2),
                    "pages_per_s": round(pages / ranker.ingest_s, 2),
                    "cpu_ms_per_page": round(1000 * cpu[name] / pages, 2),
                    "load_s": round(backends[name][1], 2),
                    "recall": {str(k): round(reports[k].overall, 4) for k in ks},
                }
            )
            ranker.engine.close()
    return {
        "benchmark": "embedders",
        "date": today(),
        "quick": bool(args.quick),
        "data": str(args.data),
        "conversations": len(convs),
        "questions": sum(len(c.scored_questions) for c in convs),
        "host": {
            **machine_info(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "int8_dot_product": _vnni(),
            "loadavg_at_end": list(os.getloadavg()),
        },
        "results": rows,
        "comparison": compare(rows, ks),
    }


def _vnni() -> list[str]:
    """The CPU's int8 dot-product extensions (int8 matrix products gain most with them)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return sorted({f for f in flags if f in ("avx512_vnni", "avx_vnni", "amx_int8")})


def compare(rows: list[dict[str, Any]], ks: tuple[int, ...]) -> dict[str, Any]:
    base, fast = rows[0], rows[1]
    speedup = fast["pages_per_s"] / base["pages_per_s"]
    cpu_speedup = base["cpu_ms_per_page"] / fast["cpu_ms_per_page"]
    delta = {str(k): round(fast["recall"][str(k)] - base["recall"][str(k)], 4) for k in ks}
    return {
        "speedup_pages_per_s": round(speedup, 2),
        "speedup_cpu_per_page": round(cpu_speedup, 2),
        "recall_delta": delta,
        "target": f">= {TARGET_SPEEDUP}x pages/s, |recall delta| <= {RECALL_TOLERANCE}",
        "speed_target_met": speedup >= TARGET_SPEEDUP,
        "recall_target_met": all(abs(d) <= RECALL_TOLERANCE for d in delta.values()),
    }


def cpu_words(torch_over_onnx: float) -> str:
    """The CPU comparison in words, read under the "onnx-int8 / torch-fp32" heading: the ratio
    is torch's CPU per page over onnx's, so above 1 ONNX uses *less* CPU a page (printed bare,
    "1.65x CPU per page" read as 1.65x more)."""
    if torch_over_onnx >= 1 or torch_over_onnx <= 0:
        return f"{torch_over_onnx:.2f}x less CPU per page"
    return f"{1 / torch_over_onnx:.2f}x more CPU per page"


def print_table(report: dict[str, Any]) -> None:
    ks = list(report["results"][0]["recall"])
    head = (
        f"{'backend':<12} {'pages':>6} {'pages/s':>8} {'CPU ms/page':>12} {'load s':>7}  "
        + "  ".join(f"{'R@' + k:>6}" for k in ks)
    )
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        print(
            f"{r['backend']:<12} {r['pages']:>6} {r['pages_per_s']:>8.1f} "
            f"{r['cpu_ms_per_page']:>12.1f} {r['load_s']:>7.1f}  "
            + "  ".join(f"{r['recall'][k]:>6.3f}" for k in ks)
        )
    c = report["comparison"]
    print(
        f"onnx-int8 / torch-fp32: {c['speedup_pages_per_s']}x pages/s, "
        f"{cpu_words(c['speedup_cpu_per_page'])}, recall delta {c['recall_delta']} "
        f"(target {c['target']}: speed {'met' if c['speed_target_met'] else 'NOT met'}, "
        f"recall {'met' if c['recall_target_met'] else 'NOT met'})"
    )


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--data",
        type=Path,
        default=default_locomo_path(),
        help="LoCoMo file (default: $MEMORYOS_GPU_LOCOMO)",
    )
    p.add_argument(
        "--budgets",
        type=positive_int,
        nargs="+",
        default=[5, 10, 20],
        help="page budgets of the evidence recall (default 5 10 20)",
    )
    p.add_argument("--quick", action="store_true", help="1 conversation, 80 pages (CI)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--cache-dir", help="ONNX export cache (default: memoryos-gpu's cache dir)")
    args = p.parse_args(argv)
    check_output(p, args.json)  # a bad output path fails now, not after the run
    convs = select(load_locomo_data(p, args.data), args.quick)  # not LoCoMo: one line, exit 2
    check_locomo_work(p, args.data, convs, scored=True)
    report = run(args, convs)
    print_table(report)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    run_main(main)

"""Cost over a user's history: a few users with long conversations, not many users with short ones.

The other benchmarks give each user 20 pages and vary the number of users. A deployment also
meets the other axis: an assistant used for months by one person, or a bulk load of a few long
chat logs. This one keeps ``--users`` users (default 4) and grows each one's history to the
last of ``--checkpoints`` pages (LoCoMo pages, consecutive from a random offset, cycled;
hashing embedder, extractive mode, in-memory store, ``add_many`` in batches of ``--batch``
pages interleaving the users). At each checkpoint of pages per user it reports:

- **ingest mem us/page**: the memory system's own time per page accepted since the previous
  checkpoint (total minus embedding; derived work included: ``auto_process``);
- **retrieve mem us/query**: batched retrieval (``--queries`` LoCoMo questions in batches of 64,
  random users, heat left as it is) minus the embedding, and the kernels' share of it; **scan**:
  the same batches, alternated with those, with every user's BM25 scored by scanning each
  page's term row (users with at least ``ArenaConfig.postings_min_pages`` pages are otherwise
  scored from their postings: the ratio is what the postings save);
- the users' MTM pages and segments, and the largest segment's pages.

Why it matters: derived work goes in rounds of one page per user (a user's pages depend on each
other: chain, segment), so with few users each round's fixed cost falls on one page or a few;
and retrieval scores BM25 over every MTM page of the user, so its cost follows the size of MTM,
which segments of unbounded size let grow with the history.

Usage: python benchmarks/history.py [--users 4] [--checkpoints 20 100 500 2000] [--batch 100]
       [--quick] [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    apply_defaults,
    check_locomo_env,
    check_output,
    load_locomo_data,
    positive_int,
    run_main,
    today,
    write_json,
)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import (
    DATA,
    EmbedMeter,
    corpus_of,
    hardware,
    ingest,
    make_embedder,
    make_pages,
    make_queries,
)

from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.engine import MemoryEngine


def mtm_shape(engine: MemoryEngine) -> dict[str, float]:
    """MTM pages and segments per user, and the largest segment's pages (one query)."""
    rows = engine.store.query("SELECT user_id, n_pages FROM segments")
    users = max(1, len({r[0] for r in rows}))
    pages = [int(r[1]) for r in rows]
    return {
        "mtm_pages_per_user": sum(pages) / users,
        "segments_per_user": len(rows) / users,
        "largest_segment_pages": max(pages, default=0),
    }


def retrieval_cost(
    engine: MemoryEngine, meter: EmbedMeter, queries: list[tuple[str, str]]
) -> dict[str, float]:
    """Memory-system and kernel time per query of batched retrieval (batches of 64), and the
    same batches with every user's pages scanned row by row (the BM25 postings of users with
    many pages set aside: ``memoryos_gpu.arena_lexical``), alternated batch by batch."""
    lex = engine.arena.lexical
    postings = lex.postings
    spent = {"": [0.0, 0.0, 0.0], "scan_": [0.0, 0.0, 0.0]}  # total, embedding, kernels
    try:
        for i in range(0, len(queries), 64):
            for mode in spent:
                lex.postings = None if mode else postings
                k0, e0 = engine.stats()["retrieval"]["kernel_s"], meter.seconds
                t0 = time.perf_counter()
                engine.retrieve_many(queries[i : i + 64], update_heat=False)
                s = spent[mode]
                s[0] += time.perf_counter() - t0
                s[1] += meter.seconds - e0
                s[2] += engine.stats()["retrieval"]["kernel_s"] - k0
    finally:
        lex.postings = postings
    n = len(queries)
    out: dict[str, float] = {}
    for mode, (total, embed, kernels) in spent.items():
        out[f"retrieve_{mode}mem_us_per_query"] = (total - embed) / n * 1e6
        out[f"retrieve_{mode}kernel_us_per_query"] = kernels / n * 1e6
    return out


def warm_up(corpus: list, questions: list[str], meter: EmbedMeter) -> None:
    """One throwaway engine through a little of everything first: the first calls build
    native tables and caches (the first checkpoint measured 4.5 ms a page without this)."""
    cfg = EngineConfig(store=":memory:", memory=preset("paper"))
    with MemoryEngine(cfg, embedder=meter) as engine:
        engine.add_many(make_pages(corpus, 2, 40))
        engine.retrieve_many([("u0", questions[0]), ("u1", questions[1])])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    corpus, questions = corpus_of(args.convs)
    queries = make_queries(questions, args.users, args.queries)
    meter = EmbedMeter(make_embedder("hashing"))
    warm_up(corpus, questions, meter)
    engine = MemoryEngine(EngineConfig(store=":memory:", memory=preset("paper")), embedder=meter)
    rows: list[dict[str, Any]] = []
    done = 0  # pages per user ingested so far
    try:
        for point in sorted(set(args.checkpoints)):
            # pages per user done+1 .. point, interleaved (the same stream as one long run)
            pages = make_pages(corpus, args.users, point)[done * args.users :]
            meter.seconds = 0.0
            total = ingest(engine, pages, args.batch)
            row = {
                "pages_per_user": point,
                "ingest_mem_us_per_page": (total - meter.seconds) / len(pages) * 1e6,
                **retrieval_cost(engine, meter, queries),
                **mtm_shape(engine),
            }
            rows.append(row)
            print_row(row)
            done = point
    finally:
        engine.close()
    return rows


def print_header() -> None:
    print(
        f"{'pages/user':>10} | {'ingest mem us/page':>18} | {'retrieve mem us/q':>17} | "
        f"{'kernels us/q':>12} | {'scan mem us/q':>13} | {'scan kernels':>12} | "
        f"{'MTM pages/user':>14} | {'segments/user':>13} | {'largest segment':>15}"
    )


def print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['pages_per_user']:>10,} | {r['ingest_mem_us_per_page']:>18,.0f} | "
        f"{r['retrieve_mem_us_per_query']:>17,.1f} | {r['retrieve_kernel_us_per_query']:>12,.1f} | "
        f"{r['retrieve_scan_mem_us_per_query']:>13,.1f} | "
        f"{r['retrieve_scan_kernel_us_per_query']:>12,.1f} | "
        f"{r['mtm_pages_per_user']:>14,.0f} | {r['segments_per_user']:>13,.1f} | "
        f"{r['largest_segment_pages']:>15,}",
        flush=True,
    )


def plot(rows: list[dict[str, Any]], out: Path, users: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["pages_per_user"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(x, [r["ingest_mem_us_per_page"] for r in rows], "o-")
    ax[0].set(
        xscale="log",
        xlabel="pages per user",
        ylabel="us per page",
        title="ingestion: memory-system time",
    )
    ax[1].plot(x, [r["retrieve_mem_us_per_query"] for r in rows], "o-", label="memory system")
    ax[1].plot(x, [r["retrieve_kernel_us_per_query"] for r in rows], "s--", label="kernels")
    scan = [r["retrieve_scan_mem_us_per_query"] for r in rows]
    ax[1].plot(x, scan, "^:", label="memory system, rows scanned (no postings)")
    ax[1].set(
        xscale="log",
        yscale="log",
        xlabel="pages per user",
        ylabel="us per query",
        title="retrieval (batches of 64)",
    )
    # below the axes, not over the points
    ax[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, frameon=False)
    fig.suptitle(f"{users} users, hashing embedder, extractive mode")
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--users",
        type=positive_int,
        default=None,
        help="users, their pages interleaved (default 4; --quick: 2)",
    )
    p.add_argument(
        "--checkpoints",
        type=positive_int,
        nargs="+",
        default=None,
        help="pages per user at which to measure (default 20 100 500 2000; --quick: 20 100)",
    )
    p.add_argument("--batch", type=positive_int, default=100, help="pages per add_many call")
    p.add_argument(
        "--queries",
        type=positive_int,
        default=None,
        help="questions per checkpoint (default 1024; --quick: 256)",
    )
    p.add_argument("--quick", action="store_true", help="2 users, checkpoints 20 and 100")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write the two curves here (PNG)")
    args = p.parse_args(argv)
    check_output(p, args.json, args.plot)  # a bad output path fails now, not after the run
    apply_defaults(
        args,
        full={"users": 4, "checkpoints": [20, 100, 500, 2000], "queries": 1024},
        quick={"users": 2, "checkpoints": [20, 100], "queries": 256},
    )
    check_locomo_env(p, DATA)  # missing: one line, exit 2, before the run
    args.convs = load_locomo_data(p, DATA)
    print_header()
    rows = run(args)
    if args.json:
        report = {
            "benchmark": "history",
            "date": today(),
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "convs")},
            "hardware": hardware(),
            "results": rows,
        }
        write_json(args.json, report, indent=1, default=str)
    if args.plot:
        plot(rows, args.plot, args.users)
    return 0


if __name__ == "__main__":
    run_main(main)

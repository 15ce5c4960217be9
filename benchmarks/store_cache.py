"""SQLite's page cache and the write path of a file store: ingestion and derived work a page.

A file store (what ``memoryos-gpu ingest`` and ``serve`` write) of U users, each with
``--warm-pages`` LoCoMo pages already through STM, MTM and promotion, then ``--waves`` waves of
``--wave`` pages for random users, as a server receives them: each wave is one ``add_many``
(validation, embedding, the STM commit) and one derived-work round (``process_pending(
max_rounds=1)``: chain, segments, heat, promotions), timed apart. The hashing embedder, its
time subtracted, so what is left is the memory system's own time a page.

Each ``--cache-mb`` size (``EngineConfig.store_cache_mb``; 0 = SQLite's own 2 MiB) runs on a
fresh store, alternated ``--repeat`` times in turning order (the host's speed drifts, and a
process's first run pays first-use costs); the table gives each size's medians and their ratio
to the first size's.

Usage:
  python benchmarks/store_cache.py --users 10000 --cache-mb 0 64 --repeat 2 \\
      --json benchmarks/results/store_cache.json
  python benchmarks/store_cache.py --quick          # seconds: 200 users, tiny waves
"""

from __future__ import annotations

import gc
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    apply_defaults,
    check_locomo_env,
    check_output,
    load_locomo_data,
    nonnegative_int,
    positive_int,
    run_main,
    today,
    write_json,
)
from throughput import DATA, EmbedMeter, corpus_of, hardware, make_embedder, make_pages

from memoryos_gpu import ops
from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.types import PageInput

BULK_BATCH = 512  # pages per add_many of the warm-up (the CLI's ingest batch)


def os_reads() -> int:
    """Read system calls this process made so far (Linux ``/proc/self/io``; 0 elsewhere): what
    a page cache too small costs is SQLite reading the same pages from the OS again, which
    this counts without the host's speed in it."""
    try:
        with open("/proc/self/io") as f:
            return next(int(v) for k, v in (ln.split(":") for ln in f) if k == "syscr")
    except (OSError, StopIteration, ValueError):
        return 0


def waves(corpus: list, users: int, n: int, size: int, seed: int) -> list[list[PageInput]]:
    """``n`` waves of ``size`` LoCoMo pages, each for a random user, timestamps after the
    warm-up's."""
    rng = random.Random(seed)
    out = []
    for w in range(n):
        wave = []
        for _ in range(size):
            ui, ar, _, _ = corpus[rng.randrange(len(corpus))]
            t = 2e9 + 60.0 * w
            wave.append(
                PageInput(
                    user_id=f"u{rng.randrange(users)}",
                    user_input=ui,
                    agent_response=ar,
                    timestamp=t,
                )
            )
        out.append(wave)
    return out


def run(cache_mb: int, warm: list[PageInput], load: list[list[PageInput]]) -> dict[str, Any]:
    """One fresh file store: the warm-up (bulk, then every derived item), then the waves."""
    embedder = EmbedMeter(make_embedder("hashing"))
    with tempfile.TemporaryDirectory(prefix="store-cache-") as tmp:
        cfg = EngineConfig(
            store=str(Path(tmp) / "store"),
            memory=preset("paper"),
            auto_process=False,
            store_cache_mb=cache_mb,
        )
        engine = MemoryEngine(cfg, embedder=embedder)
        try:
            r0, t0 = os_reads(), time.perf_counter()
            for i in range(0, len(warm), BULK_BATCH):
                engine.add_many(warm[i : i + BULK_BATCH])
            engine.process_pending()
            bulk = time.perf_counter() - t0 - embedder.seconds
            bulk_reads, r0 = os_reads() - r0, os_reads()
            add = derived = 0.0
            for wave in load:
                embedder.seconds = 0.0
                t0 = time.perf_counter()
                engine.add_many(wave)
                add += time.perf_counter() - t0 - embedder.seconds
                embedder.seconds = 0.0
                t0 = time.perf_counter()
                engine.process_pending(max_rounds=1)
                derived += time.perf_counter() - t0 - embedder.seconds
            wave_reads = os_reads() - r0
            store_mb = sum(f.stat().st_size for f in Path(tmp).rglob("*")) / 2**20
        finally:
            engine.close()
    gc.collect()
    n = sum(len(w) for w in load)
    return {
        "cache_mb": cache_mb,
        "bulk_us_per_page": bulk / len(warm) * 1e6,
        "add_us_per_page": add / n * 1e6,
        "derived_us_per_page": derived / n * 1e6,
        "bulk_reads_per_page": bulk_reads / len(warm),
        "wave_reads_per_page": wave_reads / n,
        "store_mb": store_mb,
    }


def summarise(runs: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    keys = ("bulk_us_per_page", "add_us_per_page", "derived_us_per_page")
    reads = ("bulk_reads_per_page", "wave_reads_per_page")
    rows = []
    for size in sizes:
        mine = [r for r in runs if r["cache_mb"] == size]
        rows.append(
            {"cache_mb": size, **{k: statistics.median(r[k] for r in mine) for k in keys + reads}}
        )
    for row in rows:
        for k in keys:
            row[k.replace("_us_per_page", "_ratio")] = row[k] / rows[0][k]
    return rows


def print_table(rows: list[dict[str, Any]], users: int) -> None:
    print(
        f"{users} users, file store, memory-system time a page (median of the runs), its "
        "ratio to the first cache size's, and the read system calls a page (SQLite re-reading "
        "pages its cache dropped)"
    )
    print(
        f"{'cache MiB':>10} {'bulk us':>9} {'x':>6} {'add us':>8} {'x':>6} "
        f"{'derived us':>11} {'x':>6} {'OS reads/page bulk':>19} {'waves':>6}"
    )
    for r in rows:
        label = "0 (SQLite)" if r["cache_mb"] == 0 else str(r["cache_mb"])
        print(
            f"{label:>10} {r['bulk_us_per_page']:9.0f} {r['bulk_ratio']:6.2f} "
            f"{r['add_us_per_page']:8.0f} {r['add_ratio']:6.2f} "
            f"{r['derived_us_per_page']:11.0f} {r['derived_ratio']:6.2f} "
            f"{r['bulk_reads_per_page']:19.1f} {r['wave_reads_per_page']:6.1f}"
        )
    print(
        "cache MiB 0 (SQLite): --cache-mb 0, SQLite's own default cache (2 MiB); x: the time "
        f"a page / the first size's ({rows[0]['cache_mb']}): < 1 = faster than it"
    )


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--users",
        type=positive_int,
        default=None,
        help="users of the file store (default 10000; --quick: 200)",
    )
    p.add_argument(
        "--warm-pages",
        type=positive_int,
        default=None,
        help="pages per user before timing (default 10; --quick: 4)",
    )
    p.add_argument(
        "--waves", type=positive_int, default=None, help="timed waves (default 40; --quick: 4)"
    )
    p.add_argument(
        "--wave",
        type=positive_int,
        default=None,
        help="pages per wave, one add_many (default 256; --quick: 32)",
    )
    p.add_argument(
        "--cache-mb",
        type=nonnegative_int,
        nargs="+",
        default=[0, 64],
        help="SQLite page-cache sizes to compare, MiB (EngineConfig.store_cache_mb; 0: "
        "SQLite's own 2 MiB; default 0 64); the first is the ratios' baseline",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=None,
        help="alternated runs per cache size (default 2; --quick: 1)",
    )
    p.add_argument("--quick", action="store_true", help="200 users, 4 waves of 32: seconds")
    p.add_argument("--json", type=Path, default=None, help="write the report here (JSON)")
    args = p.parse_args(argv)
    check_output(p, args.json)  # a bad output path fails now, not after the run
    apply_defaults(
        args,
        full={"users": 10000, "warm_pages": 10, "waves": 40, "wave": 256, "repeat": 2},
        quick={"users": 200, "warm_pages": 4, "waves": 4, "wave": 32, "repeat": 1},
    )
    check_locomo_env(p, DATA)  # missing: one line, exit 2, before the run
    corpus, _ = corpus_of(load_locomo_data(p, DATA))
    warm = make_pages(corpus, args.users, args.warm_pages)
    load = waves(corpus, args.users, args.waves, args.wave, seed=1)
    runs = []
    for rep in range(args.repeat):  # the order turns each time: no size always goes first
        for size in args.cache_mb[:: -1 if rep % 2 else 1]:
            runs.append({"repeat": rep, **run(size, warm, load)})
    rows = summarise(runs, args.cache_mb)
    print_table(rows, args.users)
    if args.json:
        report = {
            "benchmark": "store_cache",
            "date": today(),
            "hardware": hardware(),
            "build": ops.build_info(),
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "runs": runs,
            "summary": rows,
        }
        write_json(args.json, report, default=str)
    return 0


if __name__ == "__main__":
    run_main(main)

"""Where a retrieval's time goes: the memory system's cost per query beside its kernels' own.

For each user count (synthetic users of ``--pages-per-user`` LoCoMo pages each, as
``throughput.py`` builds them, in a SQLite store on disk), the engine answers batches of
``--batch`` LoCoMo questions through ``retrieve_many``:

- **warm**: after ingestion, ``--queries`` questions for random users;
- **cold**: the store is closed and reopened, then every user's *first* question (users in a
  random order; at most ``--queries`` of them), so nothing of theirs was touched since the open.

Reported per query, from the engine's own retrieval counters (``stats()["retrieval"]``): the
total, the embedding (the embedder's share of the same batches), the **memory-system time**
(total minus embedding), and the **kernels' time** (the native calls: fused retrieval, both
knowledge top-k, heat credit); their ratio is the target (<= 3x). A cProfile of warm batches
says where the rest goes. Peak RSS is the process's (``ru_maxrss``, monotone: run a size alone,
``--users 100000``, to read its own peak): on the warm row, up to the end of the warm batches
(ingestion, or the first open of a kept store); on the cold row, up to the end of the run. Sizes
above ``--baseline`` (1,000 users) are also compared with it in the same minutes: the baseline's
engine stays open and answers a warm batch after each of the larger size's, and each row reports
``over_baseline``, the larger size's memory-system time per query over the baseline's (the 1.5x
target), measured alternately. A full garbage collection is counted too (``gc_us``). ``--embedder
minilm`` also reports end-to-end queries/s against the embedder's own on the same questions.

Usage: python benchmarks/retrieval_path.py [--users 1000 10000 100000] [--embedder hashing]
       [--batch 256] [--queries 4096] [--store DIR] [--baseline 1000] [--quick] [--json OUT]
       [--plot OUT.png]
"""

from __future__ import annotations

import cProfile
import gc
import itertools
import pstats
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    apply_defaults,
    check_locomo_work,
    check_output,
    load_locomo_data,
    nonnegative_int,
    positive_int,
    run_main,
    today,
    write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import corpus_of, hardware, iter_pages, make_embedder

from memoryos_gpu import ops
from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.eval.locomo import default_locomo_path

# cProfile rows are grouped by where the function lives
PROFILE_GROUPS = [  # the embedding is timed apart (profile_rows)
    ("kernels (native)", ("memoryos_gpu._C", "retrieve' of", "knowledge_topk' of")),
    ("query terms", ("lexical.py",)),
    ("heat write-behind", ("heat.py",)),
    ("assembly", ("assembly.py", "types.py")),
    ("validation", ("validation.py",)),
    ("retrieval pipeline", ("retrieval.py",)),
    ("ops wrappers", ("ops/__init__.py", "ops/retrieval.py", "arena.py")),
]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def huge_pages_mb() -> float | None:
    """The process's memory in transparent huge pages now (Linux), or None."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kb / 1024.0


def open_engine(store: Path, embedder: Any) -> MemoryEngine:
    cfg = EngineConfig(store=str(store / "memory.sqlite3"), memory=preset("paper"))
    return MemoryEngine(cfg, embedder=embedder)


class GcMeter:
    """Seconds and count of the garbage collector's full (oldest generation) collections while
    active: one pass over every tracked object of the process, which a store of 100,000 users
    makes long enough to show in a per-query cost."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._t0
        self.full += info["generation"] == 2

    def __enter__(self) -> GcMeter:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


class Baseline:
    """The baseline size's engine (``--baseline`` users, its own store), kept open beside a
    larger size's: it answers warm batches of random users between the larger engine's, so
    the per-query ratio of the two is measured alternately, not in runs minutes apart on a
    machine whose speed varies (here the same hashing embedder's time per query varied by
    1.8x between runs)."""

    def __init__(self, engine: MemoryEngine, users: int, questions: list[str], batch: int):
        self.engine, self._batch = engine, batch
        rng = random.Random(-users)
        self._queries = itertools.cycle(
            [(f"u{rng.randrange(users)}", rng.choice(questions)) for _ in range(64 * batch)]
        )
        self.batch()  # first batch: allocations, caches

    def batch(self) -> None:
        self.engine.retrieve_many([next(self._queries) for _ in range(self._batch)])

    def counters(self) -> dict[str, float]:
        return dict(self.engine.stats()["retrieval"])

    def memsys_us_since(self, before: dict[str, float]) -> float:
        now = self.counters()
        n = max(now["queries"] - before["queries"], 1)
        memsys = (now["total_s"] - before["total_s"]) - (now["embed_s"] - before["embed_s"])
        return memsys / n * 1e6


def run_batches(
    engine: MemoryEngine,
    queries: list[tuple[str, str]],
    batch: int,
    baseline: Baseline | None = None,
) -> dict:
    """Retrieve ``queries`` in batches; the per-query split from the engine's counters. With
    a ``baseline``, each batch is followed by one of the baseline's warm batches, and the row
    gets its memory-system time over the baseline's, measured alternately."""
    before = dict(engine.stats()["retrieval"])
    base_before = baseline.counters() if baseline is not None else None
    wall = 0.0
    with GcMeter() as collected:
        for i in range(0, len(queries), batch):
            t0 = time.perf_counter()
            engine.retrieve_many(queries[i : i + batch])
            wall += time.perf_counter() - t0
            if baseline is not None:
                baseline.batch()
    after = engine.stats()["retrieval"]
    d = {k: after[k] - before[k] for k in ("queries", "total_s", "embed_s", "kernel_s")}
    n = max(d["queries"], 1)
    memsys = d["total_s"] - d["embed_s"]
    extra = {}
    if baseline is not None:
        base_us = baseline.memsys_us_since(base_before)
        extra = {"baseline_memsys_us": base_us, "over_baseline": memsys / n * 1e6 / base_us}
    return {
        **extra,
        "queries": d["queries"],
        "queries_per_s": len(queries) / wall,
        "total_us": d["total_s"] / n * 1e6,
        "embed_us": d["embed_s"] / n * 1e6,
        "memsys_us": memsys / n * 1e6,
        "kernel_us": d["kernel_s"] / n * 1e6,
        "memsys_over_kernels": memsys / d["kernel_s"] if d["kernel_s"] > 0 else None,
        "gc_us": collected.seconds / n * 1e6,  # inside the total
        "gc_full_collections": collected.full,
        "huge_pages_mb": huge_pages_mb(),  # the page pool's embeddings ask for them
    }


def profile_rows(engine: MemoryEngine, queries: list, batch: int) -> list[dict[str, Any]]:
    """Own time of warm batches by where the function lives (cProfile; shares, not seconds).
    The embedder's calls are timed whole and left out of the profile: its helpers live in
    other modules (the hashing embedder tokenizes with text/keywords.py, normalises with
    NumPy), which would otherwise count as the memory system's."""
    prof = cProfile.Profile()
    embedder = engine.embedder
    encode, embedding = embedder.encode, [0.0]

    def timed_encode(texts: list[str]) -> Any:
        prof.disable()
        t0 = time.perf_counter()
        try:
            return encode(texts)
        finally:
            embedding[0] += time.perf_counter() - t0
            prof.enable()

    embedder.encode = timed_encode  # an instance attribute: shadows the method
    prof.enable()
    try:
        for i in range(0, len(queries), batch):
            engine.retrieve_many(queries[i : i + batch])
    finally:
        prof.disable()
        del embedder.encode
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    groups: dict[str, float] = {"embedding": embedding[0]}
    for (file, _line, name), (_cc, _nc, tt, _ct, _callers) in stats.items():
        where = f"{file}:{name}"
        label = next((g for g, keys in PROFILE_GROUPS if any(k in where for k in keys)), "other")
        groups[label] = groups.get(label, 0.0) + tt
    total = sum(groups.values())
    return [
        {"where": g, "share": round(t / total, 3)}
        for g, t in sorted(groups.items(), key=lambda kv: -kv[1])
    ]


def embedder_only(embedder: Any, queries: list, batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(queries), batch):
        embedder.encode([q for _, q in queries[i : i + batch]])
    return len(queries) / (time.perf_counter() - t0)


def ingest(engine: MemoryEngine, corpus, users: int, args) -> float | None:
    """Ingest the synthetic users (pages/s), or None when the store already holds them."""
    if engine.stats()["users"] >= users:
        return None  # a --store kept from an earlier run of this size
    pages = iter_pages(corpus, users, args.pages_per_user)  # generated as ingested
    t0 = time.perf_counter()
    while batch := list(itertools.islice(pages, args.ingest_batch)):
        engine.add_many(batch)
    return users * args.pages_per_user / (time.perf_counter() - t0)


def size_dir(users: int, args) -> Path:
    """The store folder of a size: under ``--store`` (kept), else a temporary one."""
    if args.store is None:
        return Path(tempfile.mkdtemp(prefix="retrieval-path-"))
    workdir = args.store / f"{users}x{args.pages_per_user}"
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def open_baseline(corpus, questions, embedder, args) -> tuple[Baseline, Path]:
    """The ``--baseline`` size's engine, ingested first when its store is new."""
    workdir = size_dir(args.baseline, args)
    engine = open_engine(workdir, embedder)
    ingest(engine, corpus, args.baseline, args)
    return Baseline(engine, args.baseline, questions, args.batch), workdir


def run_size(
    users: int, corpus, questions, embedder, args, baseline: Baseline | None = None
) -> dict[str, Any]:
    kept = args.store is not None
    workdir = size_dir(users, args)
    rng = random.Random(users)
    try:
        engine = open_engine(workdir, embedder)
        ingest_pages_per_s = ingest(engine, corpus, users, args)
        warm_q = [(f"u{rng.randrange(users)}", rng.choice(questions)) for _ in range(args.queries)]
        engine.retrieve_many(warm_q[: args.batch])  # first batch: allocations, caches
        warm = run_batches(engine, warm_q, args.batch, baseline)
        prof = profile_rows(engine, warm_q[: 4 * args.batch], args.batch)
        arena_bytes = engine.arena.nbytes()
        warm_peak_rss_mb = peak_rss_mb()  # ingestion (or the first open) and the warm batches
        engine.close()
        del engine
        gc.collect()
        t0 = time.perf_counter()
        engine = open_engine(workdir, embedder)
        reopen_s = time.perf_counter() - t0
        order = rng.sample(range(users), min(users, args.queries))
        cold_q = [(f"u{u}", rng.choice(questions)) for u in order]
        cold = run_batches(engine, cold_q, args.batch, baseline)
        row: dict[str, Any] = {
            "users": users,
            "pages": users * args.pages_per_user,
            "ingest_pages_per_s": ingest_pages_per_s,
            "reopen_s": reopen_s,
            "warm": warm,
            "cold": cold,
            "profile_warm": prof,
            "arena_bytes_per_user": arena_bytes / users,
            "warm_peak_rss_mb": warm_peak_rss_mb,
            "peak_rss_mb": peak_rss_mb(),  # ... and the close, the reopen, the cold batches
        }
        if args.embedder == "minilm":
            row["embedder_queries_per_s"] = embedder_only(embedder, warm_q, args.batch)
            row["end_to_end_over_embedder"] = warm["queries_per_s"] / row["embedder_queries_per_s"]
        engine.close()
        return row
    finally:
        if not kept:
            shutil.rmtree(workdir, ignore_errors=True)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'users':>7} {'mode':>5} {'q/s':>7} {'total us':>9} {'embed us':>9} "
        f"{'memsys us':>9} {'kernel us':>9} {'memsys/k':>8} {'gc us':>6} {'/ base':>6} "
        f"{'RSS MB':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        for mode, rss in (("warm", r["warm_peak_rss_mb"]), ("cold", r["peak_rss_mb"])):
            m = r[mode]
            ratio = m["memsys_over_kernels"]
            print(
                f"{r['users']:>7} {mode:>5} {m['queries_per_s']:>7.0f} {m['total_us']:>9.1f} "
                f"{m['embed_us']:>9.1f} {m['memsys_us']:>9.1f} {m['kernel_us']:>9.1f} "
                f"{'-' if ratio is None else f'{ratio:.2f}':>8} {m['gc_us']:>6.1f} "
                f"{fmt_ratio(m.get('over_baseline')):>6} {rss:>7.0f}"
            )
    for r in rows:
        shares = ", ".join(f"{p['where']} {p['share']:.0%}" for p in r["profile_warm"][:6])
        print(f"profile {r['users']} users (warm, own time): {shares}")


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    xs = [r["users"] for r in rows]
    for mode, style in (("warm", "o-"), ("cold", "s--")):
        ax.plot(xs, [r[mode]["memsys_us"] for r in rows], style, label=f"memory system ({mode})")
    ax.plot(xs, [r["warm"]["kernel_us"] for r in rows], "^:", label="kernels (warm)")
    ax.set_xscale("log")
    ax.set_xlabel("users (x 20 pages)")
    ax.set_ylabel("us per query (embedding excluded)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--users",
        type=positive_int,
        nargs="+",
        default=None,
        help="user counts, one run each (default 1000 10000 100000; --quick: 30 100)",
    )
    p.add_argument(
        "--pages-per-user", type=positive_int, default=20, help="pages per user (default 20)"
    )
    p.add_argument(
        "--embedder", choices=["hashing", "minilm"], default="hashing", help="(default hashing)"
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="queries per retrieve_many call (default 256; --quick: 128)",
    )
    p.add_argument(
        "--queries",
        type=positive_int,
        default=None,
        help="queries per size (default 4096; --quick: 512)",
    )
    p.add_argument(
        "--ingest-batch", type=positive_int, default=2048, help="pages per add_many call"
    )
    p.add_argument(
        "--data",
        type=Path,
        default=default_locomo_path(),
        help="LoCoMo file (default: $MEMORYOS_GPU_LOCOMO)",
    )
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="keep each size's store under this folder and reuse it on the next run "
        "(ingestion is then not re-measured: 100,000 users take most of an hour to ingest)",
    )
    p.add_argument(
        "--baseline",
        type=nonnegative_int,
        default=None,
        help="users of the size the larger ones are compared with: its engine stays open and "
        "answers a warm batch after each of theirs (0: no comparison; default 1000; "
        "--quick: 30)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="30 and 100 users, 512 queries, baseline 30: seconds",
    )
    p.add_argument("--json", type=Path, default=None, help="write the report here (JSON)")
    p.add_argument("--plot", type=Path, default=None, help="draw the results here (PNG)")
    args = p.parse_args(argv)
    check_output(p, args.json, args.plot)  # a bad output path fails now, not after the run
    convs = load_locomo_data(p, args.data)  # not LoCoMo: one line, exit 2, before the run
    check_locomo_work(p, args.data, convs, scored=False)
    apply_defaults(
        args,
        full={"users": [1000, 10000, 100000], "queries": 4096, "batch": 256, "baseline": 1000},
        quick={"users": [30, 100], "queries": 512, "batch": 128, "baseline": 30},
    )
    corpus, questions = corpus_of(convs)
    embedder = make_embedder(args.embedder)
    embedder.encode(["warm-up"] * 2)
    rows = []
    baseline, base_dir = None, None
    for users in sorted(set(args.users)):
        if args.baseline and users > args.baseline and baseline is None:
            # opened once the baseline size's own run (if any) has closed its store
            baseline, base_dir = open_baseline(corpus, questions, embedder, args)
        alternate = baseline if users > args.baseline else None
        rows.append(run_size(users, corpus, questions, embedder, args, alternate))
        print(f"{users} users measured", file=sys.stderr, flush=True)
        report = {
            "benchmark": "retrieval_path",
            "date": today(),
            "hardware": hardware(),
            "build": ops.build_info(),
            "embedder": getattr(embedder, "model_id", args.embedder),
            # JSON values (numbers, lists, null), paths as strings
            "settings": {
                k: str(v) if isinstance(v, Path) else v
                for k, v in vars(args).items()
                if k not in ("json", "plot")
            },
            "results": rows,
        }
        if args.json:
            write_json(args.json, report)
    if baseline is not None:
        baseline.engine.close()
        if args.store is None:
            shutil.rmtree(base_dir, ignore_errors=True)
    print_table(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    run_main(main)

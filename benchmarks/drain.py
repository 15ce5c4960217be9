"""Draining a deferred backlog: memory-system time a page as the backlog grows.

``ingest --process defer`` (and ``ingest --ray``, ``serve`` opening a store with work pending)
leaves every accepted page's derived work in the store's queue; the next writer drains it in
rounds of ``derived_max_batch`` pages. A drain used to read the whole queue for every round,
which made it quadratic in the backlog; it now reads the queue once and hands out the same
rounds from memory (``engine/derived.py``, ``store/rounds.py``'s ``PendingQueue``). This
script measures both in one run: for each backlog size a SQLite file store is filled with
deferred pages, ``--per-user`` pending pages for each of as many users as the backlog needs
(LoCoMo texts, the hashing embedder; a fixed history a user, so a page's own derived work
stays the same as the backlog grows), copied, and drained once with the queue read once and
once with it read every round (the old way); the embedding time (the facts' embeddings of
promotions) is subtracted.

    python benchmarks/drain.py --quick                 # seconds (CI)
    python benchmarks/drain.py --json benchmarks/results/drain.json \\
        --plot benchmarks/results/drain.png            # 10k-100k pages pending, 10 a user
"""

from __future__ import annotations

import gc
import shutil
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
    machine_info,
    positive_int,
    run_main,
    today,
    write_json,
)
from throughput import DATA, EmbedMeter, corpus_of, make_pages

from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.embed import HashingEmbedder
from memoryos_gpu.engine import MemoryEngine, derived

STM = 7  # the paper preset's STM capacity: each user's last 7 pages stay in STM
MODES = ("once", "every_round")


def _engine(path: Path, embedder: Any, batch: int) -> MemoryEngine:
    cfg = EngineConfig(
        store=str(path), memory=preset("paper"), auto_process=False, derived_max_batch=batch
    )
    # held: opening a store with work pending would drain it before the timer starts
    return MemoryEngine(cfg, embedder=embedder, hold_pending=True)


def build(path: Path, pages: list, batch: int) -> int:
    """The deferred store; returns the pages pending."""
    engine = _engine(path, HashingEmbedder(), batch)
    try:
        for i in range(0, len(pages), 2048):
            engine.add_many(pages[i : i + 2048])
        return len(engine.store.pending_items("page"))
    finally:
        engine.close()


def drain(path: Path, batch: int, mode: str) -> dict[str, float]:
    """One drain of the store at ``path``: seconds, rounds, memory-system us a page."""
    meter = EmbedMeter(HashingEmbedder())
    engine = _engine(path, meter, batch)
    holds = derived._QueueRead.holds
    if mode == "every_round":  # the old way: the queue read again for each round
        derived._QueueRead.holds = lambda self, s: False  # type: ignore[method-assign]
    reads = [0]
    read = engine.store.pending_items

    def counted(kind: str) -> list[tuple[int, str, int]]:
        reads[0] += 1
        return read(kind)

    engine.store.pending_items = counted  # type: ignore[method-assign]
    try:
        engine.release_pending()
        gc.collect()
        meter.seconds = 0.0
        t0 = time.perf_counter()
        done = engine.process_pending()
        seconds = time.perf_counter() - t0
    finally:
        derived._QueueRead.holds = holds  # type: ignore[method-assign]
        engine.close()
    pages = max(1, done["pages"])
    return {
        "pages": done["pages"],
        "seconds": seconds,
        "queue_reads": reads[0],
        "memsys_us_per_page": (seconds - meter.seconds) / pages * 1e6,
    }


def run(args: Any, pages_pool: list) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="drain-") as tmp:
        for backlog in args.backlog:
            users = -(-backlog // args.per_user)
            pages = make_pages(pages_pool, users, STM + args.per_user)
            built = Path(tmp) / f"built-{backlog}.sqlite3"
            pending = build(built, pages, args.batch)
            row: dict[str, Any] = {"backlog": pending, "users": users, "batch": args.batch}
            for mode in MODES:
                copy = Path(tmp) / f"{mode}-{backlog}.sqlite3"
                shutil.copyfile(built, copy)  # closed cleanly: no -wal left beside it
                row[mode] = drain(copy, args.batch, mode)
            row["speedup"] = (
                row["every_round"]["memsys_us_per_page"] / row["once"]["memsys_us_per_page"]
            )
            rows.append(row)
            print_row(row)
    return rows


def print_row(row: dict[str, Any]) -> None:
    a, b = row["once"], row["every_round"]
    print(
        f"{row['backlog']:>9,} {row['users']:>6,} {a['queue_reads']:>6} "
        f"{a['memsys_us_per_page']:>10.0f} {b['queue_reads']:>6} "
        f"{b['memsys_us_per_page']:>10.0f} {row['speedup']:>7.2f}",
        flush=True,
    )


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["backlog"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["once"]["memsys_us_per_page"] for r in rows], "o-", label="queue read once")
    ax.plot(
        x, [r["every_round"]["memsys_us_per_page"] for r in rows], "s--", label="read every round"
    )
    ax.set_xlabel("pages pending (deferred backlog)")
    ax.set_ylabel("memory-system us a page drained")
    per_user = rows[0]["backlog"] // rows[0]["users"]
    ax.set_title(f"draining a backlog: {per_user} pages a user, rounds of {rows[0]['batch']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--per-user", type=positive_int, help="pages pending a user (10)")
    p.add_argument(
        "--backlog", type=positive_int, nargs="+", help="pages pending (10000 30000 100000)"
    )
    p.add_argument("--batch", type=positive_int, help="derived_max_batch (256; --quick 64)")
    p.add_argument("--quick", action="store_true", help="tiny backlogs, seconds (CI)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write the curve here (PNG)")
    args = apply_defaults(
        p.parse_args(),
        {"per_user": 10, "backlog": [10000, 30000, 100000], "batch": 256},
        {"backlog": [500, 2000], "batch": 64},
    )
    check_output(p, args.json, args.plot)
    check_locomo_env(p, DATA)  # missing: one line, exit 2, before the run
    pool, _ = corpus_of(load_locomo_data(p, DATA))
    print(
        f"{'backlog':>9} {'users':>6} {'reads':>6} {'once us':>10} {'reads':>6} "
        f"{'every us':>10} {'ratio':>7}"
    )
    rows = run(args, pool)
    if args.json:
        report = {"date": today(), "machine": machine_info(), "rows": rows}
        write_json(args.json, report)
        print(f"JSON: {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    run_main(main)

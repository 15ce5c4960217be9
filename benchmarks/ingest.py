"""End-to-end ingestion throughput: pages/s of ``memoryos_gpu.ingest`` at 1, 100 and 1,000 users.

Input: the LoCoMo dev conversations (../shared/data/locomo/locomo_dev.json, 1,438 pages), written
as one JSONL file per configuration with the user ids rewritten so that each of U users gets a
contiguous slice of the pages (U = 1: one long history, every page goes through STM -> MTM;
U = 1,000: ~1.4 pages per user, nothing leaves STM). Each configuration runs in a fresh
process (clean peak RSS, cold store) through the same library call as ``memoryos-gpu ingest``.

Reported per configuration: pages/s end to end (reader -> store commit -> derived work), the
model load time (not included), peak RSS, and where the time goes: embedding (on the ingest
thread / ahead of it on the prepare thread), native kernels, SQLite (execute + fetch), LLM
generation, and the rest (Python orchestration: keyword extraction, validation, bookkeeping).

Usage:
  python benchmarks/ingest.py                      # full: MiniLM, 1/100/1000 users, results
                                                   # into benchmarks/results/ingest.json
  python benchmarks/ingest.py --quick              # a few seconds (hashing embedder, 150 pages)
  python benchmarks/ingest.py --llm                # also LLM mode (bundled SmolLM2) on a subset
  python benchmarks/ingest.py --users 100 --pages 600 --embedder minilm --json out.json
Options --batch-size, --process auto|batch, --prefetch on|off, --embedding-dtype bfloat16 compare
pipeline variants. ``--encryption both`` (the default) runs each user count twice, on a plain and
on an encrypted store (SQLCipher, ``EngineConfig.encryption_key``), and reports the encrypted
run's pages/s and SQLite time as ratios of the plain one's (``--encryption off``: plain only;
without the ``encryption`` extra installed the encrypted runs are skipped with a note).
--provenance-cost adds, per user count, the plain run with ``MemoryConfig(provenance=False)``
(no provenance rows written: the cost of recording which pages each fact and profile value came
from; conflict handling runs in both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    apply_defaults,
    check_locomo_env,
    check_output,
    machine_info,
    positive_float,
    positive_int,
    run_main,
    today,
    write_json,
)

# as the CLI does: OpenMP threads sleep instead of spinning between the kernels' tiny parallel
# regions (a spinning wait costs a scheduler quantum per call whenever the CPUs are shared)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
from memoryos_gpu.eval.locomo import default_locomo_path  # noqa: E402  (after the OMP setting)

LOCOMO = default_locomo_path()  # $MEMORYOS_GPU_LOCOMO, else shared/ beside the checkout
RESULTS = ROOT / "benchmarks" / "results" / "ingest.json"
#: The passphrase of the encrypted runs (its key derivation is part of the open, not of pages/s).
BENCH_KEY = "benchmark passphrase"


# ============================================================================ input
def write_input(path: Path, users: int, pages: int | None) -> int:
    """JSONL of the LoCoMo pages, user ids rewritten to ``u0000 ..`` in contiguous slices."""
    from memoryos_gpu.formats import Record, read_records

    recs = [r for r in read_records(LOCOMO, "locomo") if isinstance(r, Record)]
    if pages is not None:
        recs = recs[:pages]
    n = len(recs)
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(recs):
            f.write(
                json.dumps(
                    {
                        "user_id": f"u{i * users // n:04d}",
                        "user_input": r.user_input,
                        "agent_response": r.agent_response,
                        "timestamp": r.timestamp,
                        "meta": {"dia_ids": r.meta.get("dia_ids", [])},
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
    return n


# ============================================================================ instrumentation
class _Clock:
    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.lock = threading.Lock()
        self.main = threading.main_thread()

    def add(self, key: str, dt: float) -> None:
        with self.lock:
            self.t[key] = self.t.get(key, 0.0) + dt


class _TimedCursor:
    def __init__(self, cur: Any, clock: _Clock) -> None:
        self._cur, self._clock = cur, clock

    def _timed(self, name: str, *a: Any) -> Any:
        t = time.perf_counter()
        try:
            return getattr(self._cur, name)(*a)
        finally:
            self._clock.add("store", time.perf_counter() - t)

    def fetchall(self) -> Any:
        return self._timed("fetchall")

    def fetchone(self) -> Any:
        return self._timed("fetchone")

    def __iter__(self) -> Any:
        return iter(self.fetchall())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _TimedConn:
    """Proxy of the store's sqlite3 connection timing execute/fetch (SQLite's own time)."""

    def __init__(self, db: Any, clock: _Clock) -> None:
        self._db, self._clock = db, clock

    def execute(self, *a: Any) -> Any:
        t = time.perf_counter()
        try:
            return _TimedCursor(self._db.execute(*a), self._clock)
        finally:
            self._clock.add("store", time.perf_counter() - t)

    def executemany(self, *a: Any) -> Any:
        t = time.perf_counter()
        try:
            return _TimedCursor(self._db.executemany(*a), self._clock)
        finally:
            self._clock.add("store", time.perf_counter() - t)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def instrument(engine: Any, clock: _Clock) -> None:
    from memoryos_gpu import ops

    enc = engine.embedder.encode

    def encode(texts: Any) -> Any:
        t = time.perf_counter()
        try:
            return enc(texts)
        finally:
            key = "embed" if threading.current_thread() is clock.main else "embed_ahead"
            clock.add(key, time.perf_counter() - t)

    engine.embedder.encode = encode
    for name in (
        "match_segments",
        "score_segments",
        "select_pages",
        "recompute_heat",
        "apply_hits",
        "knowledge_topk",
    ):
        fn = getattr(ops, name)

        def wrapped(*a: Any, _fn: Any = fn, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                clock.add("kernels", time.perf_counter() - t)

        setattr(ops, name, wrapped)
    if hasattr(engine.store, "_db"):
        engine.store._db = _TimedConn(engine.store._db, clock)
    llm = getattr(engine, "llm", None)
    if llm is not None and hasattr(llm, "generate"):
        gen = llm.generate

        def generate(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return gen(*a, **k)
            finally:
                clock.add("llm", time.perf_counter() - t)

        llm.generate = generate


# ============================================================================ one configuration
def run_one(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs in a child process: ingest one generated file into a fresh store."""
    import resource

    from memoryos_gpu.cli.options import quiet_model_loading
    from memoryos_gpu.config import EngineConfig, LLMConfig, MemoryConfig
    from memoryos_gpu.engine import MemoryEngine
    from memoryos_gpu.ingest import ingest

    quiet_model_loading()
    work = Path(cfg["workdir"])
    data = work / f"in-{cfg['users']}.jsonl"
    n = write_input(data, cfg["users"], cfg.get("pages"))
    store = work / f"store-{cfg['name']}"
    llm = LLMConfig(mode="llm", backend="transformers") if cfg.get("llm") else LLMConfig()
    econf = EngineConfig(
        store=str(store),
        embedder="hashing" if cfg["embedder"] == "hashing" else "transformers",
        llm=llm,
        auto_process=cfg["process"] == "auto",
        encryption_key=BENCH_KEY if cfg.get("encrypted") else None,
        memory=MemoryConfig(provenance=cfg.get("provenance", True)),
    )
    t0 = time.perf_counter()
    embedder = None
    if cfg.get("embedding_dtype") and cfg["embedder"] != "hashing":
        from memoryos_gpu.embed import Embedder

        embedder = Embedder(dtype=cfg["embedding_dtype"])
    engine = MemoryEngine(econf, embedder=embedder)
    load_s = time.perf_counter() - t0
    clock = _Clock()
    instrument(engine, clock)
    prof = None
    if cfg.get("profile"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    rep = ingest(
        [data],
        engine,
        batch_size=cfg["batch_size"],
        progress=False,
        process="auto" if cfg["process"] == "auto" else "batch",
        prefetch=cfg.get("prefetch"),
    )
    if prof is not None:
        prof.disable()
    engine.close()
    total = rep.elapsed_s
    t = clock.t
    accounted = t.get("embed", 0) + t.get("kernels", 0) + t.get("store", 0) + t.get("llm", 0)
    out = {
        "name": cfg["name"],
        "users": cfg["users"],
        "pages": n,
        "accepted": rep.accepted,
        "embedder": cfg["embedder"],
        "embedding_dtype": cfg.get("embedding_dtype") or "auto",
        "llm": bool(cfg.get("llm")),
        "batch_size": cfg["batch_size"],
        "process": cfg["process"],
        "prefetch": cfg.get("prefetch"),
        "encrypted": bool(cfg.get("encrypted")),
        "provenance": cfg.get("provenance", True),
        "pages_per_s": round(rep.pages_per_s, 2),
        "elapsed_s": round(total, 3),
        "load_s": round(load_s, 3),
        "llm_calls": rep.llm_calls,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "breakdown_s": {
            "embed": round(t.get("embed", 0.0), 3),
            "embed_ahead (prepare thread, overlapped)": round(t.get("embed_ahead", 0.0), 3),
            "kernels": round(t.get("kernels", 0.0), 3),
            "store (SQLite)": round(t.get("store", 0.0), 3),
            "llm": round(t.get("llm", 0.0), 3),
            "python / other": round(max(0.0, total - accounted), 3),
        },
        "pipeline_timings_s": rep.timings,
        "store_counts": rep.store_counts,
    }
    if prof is not None:
        out["profile_top"] = _profile_top(prof)
    return out


def _profile_top(prof: Any, n: int = 15) -> list[dict[str, Any]]:
    import pstats

    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:n]  # by tottime
    return [
        {"function": f"{Path(f).name}:{line}({fn})", "calls": v[1], "tottime_s": round(v[2], 3)}
        for (f, line, fn), v in rows
    ]


def run_child(cfg: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps(cfg)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": cfg["name"], "error": f"timed out after {timeout} s"}
    if p.returncode != 0:
        return {"name": cfg["name"], "error": p.stderr.strip()[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# ============================================================================ main
def llm_available() -> str | None:
    """None when LLM mode can run, else why not."""
    try:
        import memoryos_gpu.llm.transformers_backend  # noqa: F401
    except ImportError as exc:
        return f"memoryos_gpu.llm is not importable ({exc})"
    for mod in ("gguf", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            return f"the bundled SmolLM2 needs `{mod}` (pip install gguf accelerate)"
    return None


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'configuration':<40} {'users':>6} {'pages':>6} {'enc':>4} {'pages/s':>9} "
        f"{'elapsed':>8} {'load':>6} {'RSS MB':>7} {'LLM':>5}  breakdown (s)"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<40} ERROR: {r['error'][-300:]}")
            continue
        b = r["breakdown_s"]
        parts = ", ".join(f"{k.split(' ')[0]} {v:.1f}" for k, v in b.items() if v >= 0.05)
        print(
            f"{r['name']:<40} {r['users']:>6} {r['pages']:>6} "
            f"{'yes' if r.get('encrypted') else 'no':>4} {r['pages_per_s']:>9.1f} "
            f"{r['elapsed_s']:>7.1f}s {r['load_s']:>5.1f}s {r['peak_rss_mb']:>7.0f} "
            f"{r['llm_calls']:>5}  {parts}"
        )


def analyse(rows: list[dict[str, Any]]) -> list[str]:
    """Where the time goes, one line per run: shares of the end-to-end time."""
    out = []
    for r in rows:
        if "error" in r or not r.get("elapsed_s"):
            continue
        b, total = r["breakdown_s"], r["elapsed_s"]
        embed = b["embed"] + (
            b["python / other"] if b.get("embed_ahead (prepare thread, overlapped)") else 0.0
        )
        parts = {
            "embedding": embed,
            "kernels": b["kernels"],
            "SQLite": b["store (SQLite)"],
            "LLM": b["llm"],
        }
        parts["Python/other"] = max(0.0, total - sum(parts.values()))
        shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in parts.items() if v > 0.005)
        out.append(f"{r['name']}: {r['pages_per_s']:.1f} pages/s; {shares}")
    return out


def encryption_cost(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each encrypted run against its plain twin (same settings): pages/s and SQLite time."""
    plain = {r["name"]: r for r in rows if "error" not in r and not r.get("encrypted")}
    out = []
    for r in rows:
        twin = plain.get(r["name"].removesuffix(" enc"))
        if "error" in r or not r.get("encrypted") or twin is None:
            continue
        sql, sql_plain = r["breakdown_s"]["store (SQLite)"], twin["breakdown_s"]["store (SQLite)"]
        out.append(
            {
                "configuration": twin["name"],
                "plain_pages_per_s": twin["pages_per_s"],
                "encrypted_pages_per_s": r["pages_per_s"],
                "ratio_pages_per_s": round(r["pages_per_s"] / twin["pages_per_s"], 3),
                "plain_sqlite_s": sql_plain,
                "encrypted_sqlite_s": sql,
                "ratio_sqlite_s": round(sql / sql_plain, 2) if sql_plain else None,
                "plain_load_s": twin["load_s"],
                "encrypted_load_s": r["load_s"],
            }
        )
    return out


def print_encryption(cost: list[dict[str, Any]], quick: bool = False) -> None:
    if not cost:
        return
    print("\nencryption at rest (SQLCipher) against the plain store, same settings:")
    for c in cost:
        print(
            f"  {c['configuration']}: {c['plain_pages_per_s']:.1f} -> "
            f"{c['encrypted_pages_per_s']:.1f} pages/s (x{c['ratio_pages_per_s']:.2f}); "
            f"SQLite {c['plain_sqlite_s']:.2f} -> {c['encrypted_sqlite_s']:.2f} s; "
            f"open {c['plain_load_s']:.2f} -> {c['encrypted_load_s']:.2f} s"
        )
    if quick:
        print("  (--quick: runs of a fraction of a second, so these ratios are a smoke test)")


def with_encrypted_twins(configs: list[dict[str, Any]], notes: list[str]) -> list[dict[str, Any]]:
    """Each configuration followed by the same one on an encrypted store (when SQLCipher is
    installed; else a note says why there is none)."""
    import importlib.util

    if importlib.util.find_spec("sqlcipher3") is None:
        notes.append("encrypted runs skipped: pip install 'memoryos-gpu[encryption]'")
        print(notes[-1], file=sys.stderr)
        return configs
    out = []
    for c in configs:
        out += [c, {**c, "encrypted": True, "name": c["name"] + " enc"}]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--users",
        type=positive_int,
        nargs="+",
        default=None,
        help="user counts, one run each (default 1 100 1000; --quick: 1 100)",
    )
    ap.add_argument(
        "--pages",
        type=positive_int,
        default=None,
        help="pages of the input (default all; --quick: 150)",
    )
    ap.add_argument(
        "--embedder",
        choices=["minilm", "hashing"],
        default=None,
        help="(default minilm; --quick: hashing)",
    )
    ap.add_argument(
        "--embedding-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the embedder's dtype (default: the library's)",
    )
    ap.add_argument(
        "--batch-size",
        type=positive_int,
        default=512,
        help="pages per engine batch across users (ingest's --batch-size; default 512)",
    )
    ap.add_argument(
        "--process",
        choices=["auto", "batch"],
        default="auto",
        help="when derived work runs (ingest's --process): auto (the library's choice) or "
        "batch (after each batch)",
    )
    ap.add_argument(
        "--prefetch",
        choices=["auto", "on", "off"],
        default="auto",
        help="embed the next batch ahead on the prepare thread (auto: the library default)",
    )
    ap.add_argument(
        "--variants",
        action="store_true",
        help="also compare process=batch, no prefetch and bfloat16 at 100 users",
    )
    ap.add_argument(
        "--encryption",
        choices=["both", "off", "on"],
        default="both",
        help="both: each user count on a plain and on an encrypted store (ratios printed); "
        "on: encrypted only; off: plain only",
    )
    ap.add_argument(
        "--provenance-cost",
        action="store_true",
        help="also each user count with provenance off (MemoryConfig(provenance=False))",
    )
    ap.add_argument("--llm", action="store_true", help="also LLM mode on a small subset")
    ap.add_argument(
        "--llm-pages", type=positive_int, default=24, help="pages of the --llm run (default 24)"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile top functions per run")
    ap.add_argument(
        "--quick", action="store_true", help="a few seconds: hashing, 150 pages, 1 and 100 users"
    )
    ap.add_argument(
        "--timeout",
        type=positive_float,
        default=3600,
        help="seconds each run's child process may take before it is stopped (default 3600)",
    )
    ap.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"write results here (default for a full run: {RESULTS}; --quick writes none "
        "unless given)",
    )
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(json.loads(args.child))))
        return 0
    out = args.json or (None if args.quick else RESULTS)
    check_output(ap, out)  # before the run, not after it
    check_locomo_env(ap, LOCOMO)
    apply_defaults(
        args,
        full={"embedder": "minilm", "users": [1, 100, 1000]},
        quick={"embedder": "hashing", "users": [1, 100], "pages": 150},
    )
    embedder, users, pages = args.embedder, args.users, args.pages
    workdir = tempfile.mkdtemp(prefix="memoryos-ingest-bench-")
    try:
        base = {
            "workdir": workdir,
            "pages": pages,
            "embedder": embedder,
            "embedding_dtype": args.embedding_dtype,
            "batch_size": args.batch_size,
            "process": args.process,
            "prefetch": {"auto": None, "on": True, "off": False}[args.prefetch],
            "profile": args.profile,
        }
        configs = [
            {**base, "users": u, "name": f"{embedder} u{u} b{args.batch_size} {args.process}"}
            for u in users
        ]
        notes: list[str] = []
        if args.encryption == "both":
            configs = with_encrypted_twins(configs, notes)
        elif args.encryption == "on":
            base["encrypted"] = True  # the variants below too
            configs = [{**c, "encrypted": True, "name": c["name"] + " enc"} for c in configs]
        if args.provenance_cost:  # each user count's plain run, then the same without provenance
            configs = [
                run
                for c in configs
                for run in (
                    (c, {**c, "provenance": False, "name": f"{c['name']} no-provenance"})
                    if not c.get("encrypted")
                    else (c,)
                )
            ]
        if args.variants:
            u = 100 if 100 in users else users[-1]
            configs += [
                {**base, "users": u, "process": "batch", "name": f"{embedder} u{u} process=batch"},
                {**base, "users": u, "prefetch": True, "name": f"{embedder} u{u} prefetch on"},
                {**base, "users": u, "batch_size": 128, "name": f"{embedder} u{u} b128"},
            ]
            if embedder == "minilm":
                configs.append(
                    {
                        **base,
                        "users": u,
                        "embedding_dtype": "bfloat16",
                        "name": f"{embedder} u{u} bfloat16",
                    }
                )
        if args.llm:
            why = llm_available()
            if why:
                notes.append(f"LLM mode skipped: {why}")
                print(notes[-1], file=sys.stderr)
            else:
                configs.append(
                    {
                        **base,
                        "users": 2,
                        "pages": args.llm_pages,
                        "llm": True,
                        "name": f"{embedder} LLM(SmolLM2) u2",
                    }
                )
        rows = []
        for cfg in configs:
            print(f"running {cfg['name']} ...", file=sys.stderr, flush=True)
            rows.append(run_child(cfg, args.timeout))
        print_table(rows)
        analysis = analyse(rows)
        print(
            "\nwhere the time goes (share of end-to-end time; with prefetch on, the ingest "
            "thread's wait for the embedding thread counts as embedding):"
        )
        for line in analysis:
            print("  " + line)
        cost = encryption_cost(rows)
        print_encryption(cost, args.quick)
        result = {
            "benchmark": "ingest",
            "date": today(),
            "host": {
                **machine_info(),
                "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            },
            "input": str(LOCOMO),
            "quick": args.quick,
            "notes": notes,
            "analysis": analysis,
            "encryption": cost,
            "runs": rows,
        }
        if out is not None:
            write_json(out, result)
            print(f"results -> {out}", file=sys.stderr)
        return 0 if all("error" not in r for r in rows) else 1
    finally:  # also on Ctrl-C / SIGTERM: the stores and inputs are only scratch
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    run_main(main)

"""Load generator for the HTTP server on loopback: batched vs unbatched.

For each scenario (number of simulated users) the script starts the server in a subprocess
(``memoryos_gpu.server.app.run``, hashing embedder by default, a fresh store), preloads every
user with a few pages, waits for the derived work, then runs a closed loop: every simulated user
is one coroutine that sends a request (a write with probability ``--write-frac``, else a
retrieval), waits for the answer, thinks ``--think-ms`` (exponential; 0 = saturating) and goes
again, until ``--requests`` requests are done or ``--time-limit`` passes. The same load then
runs against a server with batching disabled: "unbatched" (every request its own engine call
and derived work one page at a time as it arrives, as the reference does) and
"requests-unbatched" (request queues of one, derived-work rounds kept); see ``MODES``.
Saturating runs (think 0) measure capacity; a paced run (``--paced-users`` users thinking
``--paced-think-ms`` between requests, like chat users) measures latency below saturation.

``--workers 0 1 2`` repeats every scenario over server layouts: 0 is the single-process
server, N >= 1 is ``serve --workers N`` (N HTTP worker processes in front of one engine
process, or of K with ``--engines K``: the users sharded over them); the throughput of each
over the single process's is reported, measured in the same run, and ``--plot`` draws the
throughput curve over workers (PNG). ``--rounds R`` runs each (mode, layout) R times with the
layouts interleaved and compares medians: on a shared box the load drifts between runs. Server
CPU counts the whole process tree (supervisor, engine processes, workers). The JSON's ``fair``
says whether other work on the box made the ratios unfair (1-minute load average besides this
benchmark over 0.75 per CPU).

Reports throughput and p50/p95/p99 latency per operation, and the batched/unbatched throughput
ratio, as a table and as JSON (``--out``). ``--quick`` is a small run for CI. This file runs the
scenarios (server subprocesses, modes, layouts, rounds); the simulated users are
``serve_load_client.py``'s, the table, ratios and plot ``serve_load_report.py``'s.

    python benchmarks/serve_load.py                 # 100 and 1000 users
    python benchmarks/serve_load.py --users 100 --workers 0 1 2 --rounds 2 --plot W.png
    python benchmarks/serve_load.py --users 100 --workers 0 14 --engines 2   # a 16-core box
    python benchmarks/serve_load.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from cli_args import (
    Parser,
    apply_defaults,
    check_output,
    fraction,
    machine_info,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    run_main,
    today,
    write_json,
)
from serve_load_client import ADMIN_KEY, KEY, load, preload, run_loop
from serve_load_report import fairness, mode_ratios, paired_ratios, plot, table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serve_load.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int | str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and all its descendants (the engine process and
    the workers of ``--workers N``), Linux /proc; 0.0 elsewhere."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit() and (f := _stat(entry.name)) is not None:
            children.setdefault(int(f[1]), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        f = _stat(p)
        if f is not None:
            total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        todo.extend(children.get(p, []))
    return total


# ====================================================================== server subprocess
def _serve(spec: str) -> None:
    kw = json.loads(spec)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from memoryos_gpu.server.app import run

    run(**kw)


class Server:
    def __init__(
        self,
        store: Path,
        settings: dict[str, Any],
        embedder: str,
        workers: int = 0,
        engines: int = 1,
    ) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        spec = {
            "store": str(store),
            "host": "127.0.0.1",
            "port": self.port,
            "api_keys": {KEY: "bench", ADMIN_KEY: "*"},
            "embedder": embedder,
            "log_level": "warning",
            "rate_limit_per_s": 0,
            "workers": workers,
            **({"engines": engines} if workers and engines > 1 else {}),
            **settings,
        }
        env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_API_KEYS"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-json", json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{self.base}/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_UNBATCHED_REQUESTS = {
    "max_batch": 1,
    "write_max_batch": 1,
    "max_wait_ms": 0,
    "write_max_wait_ms": 0,
}
#: Server settings of each mode. "unbatched" turns every cross-request batch off: request queues
#: of one and derived work (chain, MTM placement, promotion) one page at a time as it arrives,
#: as the reference does; "requests-unbatched" keeps the derived-work rounds.
MODES: dict[str, dict[str, Any]] = {
    "batched": {},
    "unbatched": {**_UNBATCHED_REQUESTS, "derived_max_batch": 1, "derived_max_wait_ms": 0},
    "requests-unbatched": dict(_UNBATCHED_REQUESTS),
}


def run_scenario(
    users: int,
    *,
    mode: str,
    think_ms: float,
    args: argparse.Namespace,
    workdir: Path,
    workers: int = 0,
) -> dict[str, Any]:
    settings: dict[str, Any] = dict(MODES[mode])
    if mode == "batched":
        settings.update(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms)
    engines = args.engines if workers else 1
    store = workdir / f"store-{users}-{think_ms:g}-{mode}-w{workers}-e{engines}"
    server = Server(store, settings, args.embedder, workers, engines)
    try:
        server.wait_ready()

        async def go() -> dict[str, Any]:
            async with httpx.AsyncClient(base_url=server.base, timeout=300) as c:
                pre = await preload(c, users, args.preload_pages, args.seed)
            cpu0 = _cpu_seconds(server.proc.pid)
            res = await load(
                server.base,
                users=users,
                requests=args.requests,
                time_limit=args.time_limit,
                write_frac=args.write_frac,
                think_ms=think_ms,
                seed=args.seed,
                client_kind=args.client,
                procs=args.client_procs,
            )
            cpu = _cpu_seconds(server.proc.pid) - cpu0
            res["preload_s"] = round(pre, 2)
            # the load generator's own CPU: on a small box it shares the cores with the server
            # (no per-request figure from 0 answered requests: null in the JSON, "-" printed)
            ok = res["requests_ok"]
            res["client_cpu_ms_per_request"] = (
                round(res["client_cpu_s"] * 1000 / ok, 3) if ok else None
            )
            # CPU the server spent per answered request: independent of other load on the box
            res["server_cpu_ms_per_request"] = round(cpu * 1000 / ok, 3) if ok else None
            res["server_cpu_utilisation"] = round(cpu / res["wall_s"], 2) if res["wall_s"] else 0
            return res

        res = run_loop(go())
    finally:
        server.stop()
    res.update(
        users=users,
        think_ms=think_ms,
        mode=mode,
        workers=workers,
        engines=engines,
        settings=settings,
    )
    res["loadavg_1m_after"] = round(os.getloadavg()[0], 2)  # other work on the box skews results
    return res


def _modes(args: argparse.Namespace, workers: int) -> list[str]:
    """The single process runs every mode; worker layouts batched and unbatched (batched
    only in --quick)."""
    if args.no_unbatched or (args.quick and workers):
        return ["batched"]
    return list(MODES) if workers == 0 else ["batched", "unbatched"]


def _interleaved(
    users: int,
    think: float,
    args: argparse.Namespace,
    workdir: Path,
    results: list[dict[str, Any]],
) -> dict[int, dict[str, dict[str, Any]]]:
    """Every (mode, layout) of one scenario, ``--rounds`` times, the layouts interleaved
    (w0, w1, w2, w0, w1, w2, ...): load from other work on the box drifts over minutes, and
    consecutive runs of one layout would each see a different box. Returns, per layout and
    mode, the run of median throughput (what the ratios compare)."""
    modes = [m for m in MODES if any(m in _modes(args, w) for w in args.workers)]
    out: dict[int, dict[str, dict[str, Any]]] = {w: {} for w in args.workers}
    for mode in modes:
        runs: dict[int, list[dict[str, Any]]] = {w: [] for w in args.workers}
        for rnd in range(args.rounds):
            for w in args.workers:
                if mode not in _modes(args, w):
                    continue
                r = run_scenario(
                    users,
                    mode=mode,
                    think_ms=think,
                    args=args,
                    workdir=workdir / f"r{rnd}",
                    workers=w,
                )
                r["round"] = rnd
                results.append(r)
                runs[w].append(r)
                print(
                    f"users={users} think={think:g}ms workers={w} {mode} round {rnd}: "
                    f"{r['throughput_rps']} req/s, retrieve p95 {r['retrieve']['p95_ms']} ms",
                    file=sys.stderr,
                )
        for w, rs in runs.items():
            if rs:
                out[w][mode] = sorted(rs, key=lambda r: r["throughput_rps"])[len(rs) // 2]
    return out


def main(argv: list[str] | None = None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--serve-json", help=argparse.SUPPRESS)
    p.add_argument(
        "--users",
        type=positive_int,
        nargs="+",
        default=None,
        help="User counts, one saturated run each (default 100 1000; --quick: 50).",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help="Requests per run (bound; default 6000; --quick: 600).",
    )
    p.add_argument(
        "--time-limit",
        type=positive_float,
        default=None,
        help="Seconds per run (bound; default 60; --quick: 15).",
    )
    p.add_argument(
        "--write-frac",
        type=fraction,
        default=0.3,
        help="Share of requests that write a page, the rest retrieve (0 to 1; default 0.3).",
    )
    p.add_argument(
        "--think-ms",
        type=nonnegative_float,
        default=0.0,
        help="Mean think time (0: saturate).",
    )
    p.add_argument(
        "--paced-users",
        type=positive_int,
        default=None,
        help="Users of the extra paced (think-time) run (default 100; --quick: 50).",
    )
    p.add_argument(
        "--paced-think-ms",
        type=nonnegative_float,
        default=500.0,
        help="Think time of the paced run (0: no paced run): latency below saturation.",
    )
    p.add_argument(
        "--preload-pages",
        type=nonnegative_int,
        default=None,
        help="Pages per user before load (default 10; --quick: 4).",
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=64,
        help="The batched server's largest batch of requests (serve's; default 64).",
    )
    p.add_argument(
        "--max-wait-ms",
        type=nonnegative_float,
        default=2.0,
        help="How long the batched server waits to fill a batch (serve's; default 2).",
    )
    p.add_argument(
        "--embedder",
        default="hashing",
        choices=["hashing", "transformers"],
        help="The server's embedder (default hashing).",
    )
    p.add_argument("--no-unbatched", action="store_true", help="Only the batched runs.")
    p.add_argument(
        "--seed", type=int, default=0, help="Seed of the users' request mix (default 0)."
    )
    p.add_argument(
        "--client",
        default="raw",
        choices=["raw", "httpx"],
        help="Load client: minimal asyncio HTTP/1.1 (default) or one httpx client per user.",
    )
    p.add_argument(
        "--client-procs",
        type=positive_int,
        default=1,
        help="Load-generator processes the users are dealt over: one saturates a core near "
        "10,000 requests/s, so a many-core box needs several.",
    )
    p.add_argument(
        "--workers",
        type=nonnegative_int,
        nargs="+",
        default=None,
        help="Server layouts to compare: 0 = the single-process server, N = N HTTP workers in "
        "front of one engine process (the first is the baseline of the ratios; default 0; "
        "--quick: 0 1).",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="Runs of each (mode, layout), interleaved over layouts; ratios use the median run "
        "(the upper one of an even count) and are also given per round.",
    )
    p.add_argument(
        "--engines",
        type=positive_int,
        default=1,
        help="Engine processes behind the workers of every N >= 1 layout (serve --engines): "
        "more than one shards the users over them.",
    )
    p.add_argument("--plot", metavar="PNG", help="Draw throughput over workers into this file.")
    p.add_argument("--quick", action="store_true", help="Small run for CI.")
    p.add_argument(
        "--out",
        default=None,
        help=f"JSON results (default for a full run: {RESULTS}; --quick writes none unless given)",
    )
    args = p.parse_args(argv)
    if args.serve_json:
        _serve(args.serve_json)
        return
    # --quick (CI) never overwrites the committed results
    out = Path(args.out) if args.out else (None if args.quick else RESULTS)
    check_output(p, out, args.plot)
    apply_defaults(
        args,
        full={
            "users": [100, 1000],
            "requests": 6000,
            "time_limit": 60.0,
            "preload_pages": 10,
            "paced_users": 100,
            "workers": [0],
        },
        quick={
            "users": [50],
            "requests": 600,
            "time_limit": 15.0,
            "preload_pages": 4,
            "paced_users": 50,
            "workers": [0, 1],
        },
    )
    load_start = os.getloadavg()
    results: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    cpu_ratios: dict[str, float] = {}
    worker_ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        scenarios = [(u, args.think_ms) for u in args.users]
        if args.paced_think_ms > 0:
            scenarios.append((args.paced_users, args.paced_think_ms))
        for users, think in scenarios:
            by_workers = _interleaved(users, think, args, Path(tmp), results)
            for workers, runs in by_workers.items():
                label = f"{users} users, think {think:g} ms, workers {workers}"
                mode_ratios(runs, label, ratios, cpu_ratios)
            base = by_workers.get(args.workers[0], {})
            for workers, runs in by_workers.items():
                for mode, r in runs.items():
                    b = base.get(mode)
                    if workers == args.workers[0] or b is None or b["throughput_rps"] <= 0:
                        continue
                    name = (
                        f"{mode}: workers {workers} / workers {args.workers[0]}, {users} users, "
                        f"think {think:g} ms"
                    )
                    worker_ratios[name] = round(r["throughput_rps"] / b["throughput_rps"], 2)
    report = {
        "benchmark": "serve_load",
        "date": today(),
        "machine": {
            **machine_info(),
            "loadavg_at_start": [round(x, 2) for x in load_start],
        },
        "args": {k: v for k, v in vars(args).items() if k not in ("serve_json", "out")},
        "results": results,
        "throughput_ratio_batched_over_unbatched": ratios,
        "server_cpu_ratio_unbatched_over_batched": cpu_ratios,
        "throughput_ratio_over_workers": worker_ratios,
        "throughput_ratio_over_workers_per_round": paired_ratios(results),
        "fair": fairness(load_start, results),
    }
    if out is not None:
        write_json(out, report)
    print(table(results, {**ratios, **worker_ratios}, cpu_ratios))
    for name, per_round in report["throughput_ratio_over_workers_per_round"].items():
        print(f"per round, {name}: " + ", ".join(f"{x:.2f}x" for x in per_round))
    print(f"fair: {report['fair']['verdict']}")
    print(f"\nJSON: {out}" if out else "\nJSON: not written (--quick without --out)")
    if args.plot:
        plot(results, Path(args.plot), report["fair"])
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    run_main(main, child_flags=("--serve-json",))

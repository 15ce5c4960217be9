"""One tenant's heavy writes against another tenant's light ones: the server's fairness.

Starts the HTTP server in a subprocess (hashing embedder, fresh SQLite store, two API keys:
tenants ``heavy`` and ``light``). First the light tenant's one-page writes run alone (idle
latency); then the heavy tenant sends the largest request the documented limits allow (by
default 80 pages of 100,000 characters: 8 MB, under the 8 MiB body limit), ``--heavy-clients``
at a time, back to back, as fast as the server takes them (429s are waited out: that is its
maximum allowed load), while the light tenant keeps writing one page at a time. Only light
writes sent and answered while a heavy request was in flight count as "loaded", and the heavy
tenant's committed pages over the window show that its load was being processed.

Reports p50 / p95 / p99 / max of the light tenant's write latency, idle and loaded, whether the
loaded p95 meets the < 100 ms target, and the heavy tenant's pages/s and status codes, as a
table and as JSON (``--json``).

    python benchmarks/tenant_fairness.py                    # ~40 s
    python benchmarks/tenant_fairness.py --quick            # CI size
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    apply_defaults,
    check_output,
    machine_info,
    nonnegative_float,
    positive_int,
    run_main,
    today,
    write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import _free_port, _serve  # one server launcher for both benchmarks
from serve_load_client import RawClient, pct

ROOT = Path(__file__).resolve().parents[1]
HEAVY_KEY, LIGHT_KEY = "heavy-key-0123456789", "light-key-0123456789"
# The light tenant's one-page write p95 beside the heavy tenant: the fairness target (timed
# here, not in tests/test_fair_queues.py, which checks the commit order that buys it).
TARGET_P95_MS = 100.0
WORDS = [
    "morning",
    "weekend",
    "garden",
    "violin",
    "recipe",
    "mountain",
    "river",
    "station",
    "market",
    "library",
    "concert",
    "holiday",
    "project",
    "meeting",
    "journey",
    "harbour",
    "festival",
    "museum",
    "bakery",
    "stadium",
    "orchard",
]


def _summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 50), 2),
        "p95_ms": round(pct(ms, 95), 2),
        "p99_ms": round(pct(ms, 99), 2),
        "max_ms": round(max(ms), 2) if ms else float("nan"),
    }


def heavy_text(chars: int, seed: int) -> str:
    """``chars`` characters of words (so keyword extraction and hashing do real work)."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS) + str(rng.randrange(1000))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def heavy_body(pages: int, chars: int, seed: int) -> bytes:
    text = heavy_text(chars, seed)
    return json.dumps(
        {"pages": [{"user_id": f"h{i % 4}", "user_input": text} for i in range(pages)]}
    ).encode()


# ====================================================================== server subprocess
class Server:
    def __init__(self, store: Path, settings: dict[str, Any]) -> None:
        self.port = _free_port()
        spec = {
            "store": str(store),
            "host": "127.0.0.1",
            "port": self.port,
            "api_keys": {HEAVY_KEY: "heavy", LIGHT_KEY: "light"},
            "embedder": "hashing",
            "log_level": "warning",
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

    async def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            try:
                status, _ = await client(self.port, "").request("GET", "/ready", close=True)
                if status == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("server not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def client(port: int, key: str) -> RawClient:
    """One keep-alive connection to the server, as ``key``'s tenant (``""``: no key)."""
    return RawClient("127.0.0.1", port, {"Authorization": f"Bearer {key}"} if key else {})


async def light_writes(
    port: int, n: int, think_s: float, inflight: list[int] | None, seed: int
) -> dict[str, Any]:
    """``n`` one-page writes of the light tenant; with ``inflight``, only those that started
    and ended while a heavy request was in flight count (the others are reported apart)."""
    conn, rng = client(port, LIGHT_KEY), random.Random(seed)
    loaded: list[float] = []
    outside: list[float] = []
    statuses: dict[str, int] = {}
    try:
        for i in range(n):
            started_during = inflight is None or inflight[0] > 0
            body = json.dumps(
                {"user_input": f"light page {i}: {rng.choice(WORDS)} {rng.choice(WORDS)}"}
            ).encode()
            t0 = time.perf_counter()
            status, _ = await conn.request("POST", f"/v1/users/l{i % 8}/pages", body)
            dt = time.perf_counter() - t0
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status == 201:
                during = started_during and (inflight is None or inflight[0] > 0)
                (loaded if during else outside).append(dt)
            await asyncio.sleep(think_s * (0.5 + rng.random()))
    finally:
        await conn.close()
    return {"latency": _summary(loaded), "outside_heavy": len(outside), "statuses": statuses}


async def heavy_load(
    port: int, bodies: list[bytes], clients: int, stop: asyncio.Event, inflight: list[int]
) -> dict[str, Any]:
    """Heavy requests back to back from ``clients`` connections until ``stop``; a 429 or 503
    is retried after its Retry-After (the most the server lets this tenant send)."""
    statuses: dict[str, int] = {}
    pages = 0
    seconds: list[float] = []

    async def loop(c: int) -> None:
        nonlocal pages
        conn = client(port, HEAVY_KEY)
        k = c
        try:
            while not stop.is_set():
                body = bodies[k % len(bodies)]
                k += 1
                inflight[0] += 1
                t0 = time.perf_counter()
                try:
                    status, payload = await conn.request("POST", "/v1/pages", body)
                finally:
                    inflight[0] -= 1
                statuses[str(status)] = statuses.get(str(status), 0) + 1
                if status == 201:
                    pages += len(json.loads(payload)["results"])
                    seconds.append(time.perf_counter() - t0)
                elif status in (429, 503):
                    await asyncio.sleep(0.2)
                else:
                    raise RuntimeError(f"heavy request answered {status}: {payload[:300]!r}")
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    return {
        "statuses": statuses,
        "pages_committed": pages,
        "pages_per_s": round(pages / wall, 1) if wall else 0.0,
        "request_s": _summary(seconds),
        "wall_s": round(wall, 2),
    }


async def scenario(args: argparse.Namespace, store: Path) -> dict[str, Any]:
    server = Server(store, json.loads(args.settings))
    try:
        await server.wait_ready()
        idle = await light_writes(server.port, args.idle_writes, args.think_ms / 1000, None, 1)
        bodies = [heavy_body(args.pages, args.chars, s) for s in range(3)]
        stop, inflight = asyncio.Event(), [0]
        heavy = asyncio.create_task(
            heavy_load(server.port, bodies, args.heavy_clients, stop, inflight)
        )
        while inflight[0] == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(args.warmup_s)  # the first heavy body is uploaded and being applied
        loaded = await light_writes(
            server.port, args.loaded_writes, args.think_ms / 1000, inflight, 2
        )
        stop.set()
        heavy_res = await heavy
    finally:
        server.stop()
    return {
        "idle": idle,
        "loaded": loaded,
        "heavy": heavy_res,
        "heavy_request": {"pages": args.pages, "chars": args.chars, "bytes": len(bodies[0])},
    }


def main(argv: list[str] | None = None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--serve-json", help=argparse.SUPPRESS)
    p.add_argument(
        "--pages",
        type=positive_int,
        default=None,
        help="Pages per heavy request (default 80; --quick: 8).",
    )
    p.add_argument(
        "--chars",
        type=positive_int,
        default=None,
        help="Characters per heavy page (default 100000; --quick: 20000).",
    )
    p.add_argument(
        "--heavy-clients", type=positive_int, default=2, help="Heavy requests at a time."
    )
    p.add_argument(
        "--idle-writes",
        type=positive_int,
        default=None,
        help="Light writes timed with no heavy load (default 60; --quick: 10).",
    )
    p.add_argument(
        "--loaded-writes",
        type=positive_int,
        default=None,
        help="Light writes timed during the heavy writes (default 150; --quick: 20).",
    )
    p.add_argument(
        "--think-ms",
        type=nonnegative_float,
        default=40.0,
        help="Light tenant's think time (default 40).",
    )
    p.add_argument(
        "--warmup-s",
        type=nonnegative_float,
        default=None,
        help="Seconds of heavy load before timing (default 1.0; --quick: 0.2).",
    )
    p.add_argument("--settings", default="{}", help="ServerSettings overrides, as JSON.")
    p.add_argument("--quick", action="store_true", help="Small run for CI.")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="Write the results here.")
    args = p.parse_args(argv)
    if args.serve_json:
        _serve(args.serve_json)
        return
    try:
        json.loads(args.settings)
    except ValueError as e:
        p.error(f"--settings is not JSON: {e}")
    check_output(p, args.json_out)  # before the run, not after it
    apply_defaults(
        args,
        full={
            "pages": 80,
            "chars": 100_000,
            "idle_writes": 60,
            "loaded_writes": 150,
            "warmup_s": 1.0,
        },
        quick={
            "pages": 8,
            "chars": 20_000,
            "idle_writes": 10,
            "loaded_writes": 20,
            "warmup_s": 0.2,
        },
    )
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res = asyncio.run(scenario(args, Path(tmp) / "store"))
    res.update(
        date=today(),
        machine=machine_info(),
        loadavg_1m_after=round(os.getloadavg()[0], 2),
        settings=json.loads(args.settings),
        heavy_clients=args.heavy_clients,
    )
    i, lo, h = res["idle"]["latency"], res["loaded"]["latency"], res["heavy"]
    res["target"] = {"loaded_p95_ms": TARGET_P95_MS, "met": lo["p95_ms"] < TARGET_P95_MS}
    print(f"{'light write latency':<28}{'n':>5}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}  (ms)")
    for name, s in (("idle", i), ("while heavy writes", lo)):
        print(
            f"{name:<28}{s['n']:>5}{s['p50_ms']:>9.1f}{s['p95_ms']:>9.1f}"
            f"{s['p99_ms']:>9.1f}{s['max_ms']:>9.1f}"
        )
    print(
        f"heavy tenant: {h['pages_committed']} pages committed, {h['pages_per_s']} pages/s, "
        f"statuses {h['statuses']}, request p50 {h['request_s']['p50_ms']:.0f} ms; "
        f"light statuses {res['loaded']['statuses']}; load average {res['loadavg_1m_after']}"
    )
    verdict = "met" if res["target"]["met"] else "MISSED (see the load average)"
    print(f"target: light p95 while heavy writes < {TARGET_P95_MS:.0f} ms: {verdict}")
    if args.json_out:
        write_json(args.json_out, res)


if __name__ == "__main__":
    run_main(main, child_flags=("--serve-json",))

"""Retrieval latency while derived work waits for a slow LLM, against the same engine idle.

``--users`` users (hashing embedder, LLM mode, STM of one page) each have one page pending
(after a first round with an instant LLM, so one-time costs are paid); a scripted LLM answers
every request after ``--llm-seconds`` (1 s: a slow remote model). One
thread runs ``process_pending`` (one round of ``--users`` pages, then nothing more), while the
main thread retrieves for every user in one batch, again and again, until the round is applied.
Reported: retrieval latency idle (before the round) and during it (median, p95, max), the
round's wall time, and a write's latency during the round. The derived round reads under the
engine lock, calls the LLM without it and applies under it, so retrievals during the round
should take what they take idle. The same run with the caller of ``process_pending`` holding
the engine lock (the stages then run under it) is what the engine did before issue 15 (3.83 s
for a retrieval during a 4-page round).

Usage: python benchmarks/derived_latency.py [--users 4] [--llm-seconds 1.0] [--quick]
       [--json OUT]
"""

from __future__ import annotations

import statistics
import threading
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

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm.base import ChatRequest
from memoryos_gpu.llm.scripted import ScriptedBackend


def slow_llm(delay: list[float]) -> ScriptedBackend:
    """A scripted LLM that answers every request after ``delay[0]`` seconds (fused page and
    promotion answers that parse)."""

    def answer(req: ChatRequest) -> Any:
        time.sleep(delay[0])
        if req.stage == "page":
            return {"continuous": False, "meta": "m", "summary": "s", "keywords": []}
        return {"profile_updates": {}, "user_facts": [], "assistant_facts": []}

    return ScriptedBackend(answer)


def latencies(engine: MemoryEngine, users: list[str], until: Any, n: int | None) -> list[float]:
    """Wall times of batched retrievals for ``users``: ``n`` of them, or as many as fit
    before ``until()`` is true."""
    out: list[float] = []
    while (n is not None and len(out) < n) or (n is None and not until()):
        t0 = time.perf_counter()
        engine.retrieve_many([(u, f"what did {u} say about hiking") for u in users])
        out.append(time.perf_counter() - t0)
    return out


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "n": len(xs),
        "median_ms": round(statistics.median(xs) * 1e3, 3),
        "p95_ms": round(xs[min(len(xs) - 1, int(0.95 * len(xs)))] * 1e3, 3),
        "max_ms": round(xs[-1] * 1e3, 3),
    }


def run(users: int, llm_seconds: float, lock_held: bool) -> dict[str, Any]:
    cfg = EngineConfig(
        memory=preset("paper", stm_capacity=1, tau=1e9),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
        auto_process=False,
    )
    delay = [0.0]
    engine = MemoryEngine(cfg, llm=slow_llm(delay))
    ids = [f"user-{i}" for i in range(users)]
    for k in range(3):  # pages pushed out of STM: one per user after the second
        engine.add_many(
            [
                {"user_id": u, "user_input": f"{u} went hiking, day {k}", "agent_response": "ok"}
                for u in ids
            ]
        )
        if k == 1:  # a first round with an instant LLM: one-time costs (lazy imports) paid
            engine.process_pending()
    delay[0] = llm_seconds
    latencies(engine, ids, None, 5)  # warm up
    idle = latencies(engine, ids, None, 50)

    def derived() -> None:
        if lock_held:  # the caller holds the engine lock: the stages run under it (as before)
            with engine._lock:
                engine.process_pending()
        else:
            engine.process_pending()

    worker = threading.Thread(target=derived)
    write_s: list[float] = []

    def write() -> None:
        t = time.perf_counter()
        engine.add("writer", "a write during the round", "ok")
        write_s.append(time.perf_counter() - t)

    writer = threading.Thread(target=write)
    t0 = time.perf_counter()
    worker.start()
    time.sleep(min(0.05, llm_seconds / 4))  # the round is in its LLM call
    writer.start()
    during = latencies(engine, ids, lambda: not worker.is_alive(), None)
    worker.join()
    round_s = time.perf_counter() - t0
    writer.join()
    assert engine.pending_count() == 0
    engine.close()
    return {
        "mode": "lock held" if lock_held else "engine",
        "users": users,
        "llm_seconds_per_request": llm_seconds,
        "round_s": round(round_s, 3),
        "idle": summary(idle),
        "during_round": summary(during),
        "write_during_round_ms": round(write_s[0] * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--users", type=positive_int, default=4, help="users with derived work (default 4)"
    )
    ap.add_argument(
        "--llm-seconds",
        type=nonnegative_float,
        default=None,
        help="seconds each (fake) LLM request takes (default 1.0; --quick: 0.1)",
    )
    ap.add_argument("--quick", action="store_true", help="a 0.1 s LLM (seconds in all)")
    ap.add_argument("--json", type=Path, help="write the results here (JSON)")
    args = ap.parse_args(argv)
    check_output(ap, args.json)  # a bad output path fails now, not after the run
    apply_defaults(args, full={"llm_seconds": 1.0}, quick={"llm_seconds": 0.1})
    llm_s = args.llm_seconds
    res: dict[str, Any] = {
        "benchmark": "derived_latency",
        "date": today(),
        "machine": machine_info(),
        "runs": [run(args.users, llm_s, held) for held in (False, True)],
    }
    print(f"{'':>26} {'n':>5} {'median ms':>10} {'p95 ms':>8} {'max ms':>8} {'write ms':>9}")
    for r in res["runs"]:
        for name, s in (("idle", r["idle"]), ("during round", r["during_round"])):
            label = f"{r['mode']}: {name}"
            w = r["write_during_round_ms"] if name != "idle" else ""
            print(
                f"{label:>26} {s['n']:>5} {s['median_ms']:>10} {s['p95_ms']:>8} "
                f"{s['max_ms']:>8} {w:>9}"
            )
    print("round s: " + ", ".join(f"{r['mode']} {r['round_s']}" for r in res["runs"]))
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    run_main(main)

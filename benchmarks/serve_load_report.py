"""The report side of ``serve_load.py``: its table, ratios, fairness verdict and plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _f(value: float | None, width: int, digits: int = 1) -> str:
    """A number right-aligned in ``width``; "-" for none (no samples)."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def table(
    results: list[dict[str, Any]], ratios: dict[str, float], cpu_ratios: dict[str, float]
) -> str:
    head = (
        f"{'users':>6} {'think':>6} {'workers':>7} {'engines':>7} {'mode':>18} {'req/s':>8} "
        f"{'ret p50':>8} {'ret p95':>8} {'ret p99':>8} {'wr p50':>8} {'wr p95':>8} {'wr p99':>8} "
        f"{'batch r/w':>10} {'cpu ms/req':>10} {'client ms':>9} {'errors':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        mb = r["mean_batch"]
        lines.append(
            f"{r['users']:>6} {r['think_ms']:>6g} {r.get('workers', 0):>7} "
            f"{r.get('engines', 1):>7} {r['mode']:>18} "
            f"{r['throughput_rps']:>8.1f} {_f(r['retrieve']['p50_ms'], 8)} "
            f"{_f(r['retrieve']['p95_ms'], 8)} {_f(r['retrieve']['p99_ms'], 8)} "
            f"{_f(r['write']['p50_ms'], 8)} {_f(r['write']['p95_ms'], 8)} "
            f"{_f(r['write']['p99_ms'], 8)} "
            f"{mb.get('retrieve', 0):>4.1f}/{mb.get('write', 0):<5.1f} "
            f"{_f(r.get('server_cpu_ms_per_request'), 10, 2)} "
            f"{_f(r.get('client_cpu_ms_per_request'), 9, 2)} "
            f"{sum(r['errors'].values()):>7}"
        )
    lines.append("")
    for name, ratio in ratios.items():
        lines.append(f"throughput {name}: {ratio:.2f}x")
    for name, ratio in cpu_ratios.items():
        lines.append(f"server CPU per request, {name}: {ratio:.2f}x")
    lines.append(
        "latencies in ms; req/s counts successful requests; think = mean think time (ms) of "
        "each simulated user between requests (0: closed loop at saturation); workers 0 = the "
        "single-process server, N = N HTTP workers in front of the engines column's engine "
        "processes; cpu ms/req = server CPU (user+sys, whole process tree) per answered "
        "request; client ms = the load generator's own CPU per request (it shares the box)"
    )
    lines.append(
        "1-min load average after each run: "
        + ", ".join(str(r.get("loadavg_1m_after")) for r in results)
        + f" (on {os.cpu_count()} CPUs)"
    )
    lines.append(
        "derived work still pending after each run (pages and promotions; writes per run "
        "in brackets): "
        + ", ".join(
            f"{r.get('derived_backlog_after')} ({r.get('write', {}).get('n')})" for r in results
        )
    )
    return "\n".join(lines)


def mode_ratios(
    runs: dict[str, dict[str, Any]],
    label: str,
    ratios: dict[str, float],
    cpu_ratios: dict[str, float],
) -> None:
    """batched / each other mode: throughput, and server CPU per request the other way."""
    for other, r in runs.items():
        if other == "batched" or r["throughput_rps"] <= 0:
            continue
        ratios[f"batched / {other}, {label}"] = round(
            runs["batched"]["throughput_rps"] / r["throughput_rps"], 2
        )
        if runs["batched"].get("server_cpu_ms_per_request"):
            cpu_ratios[f"{other} / batched, {label}"] = round(
                r["server_cpu_ms_per_request"] / runs["batched"]["server_cpu_ms_per_request"], 2
            )


#: Above this 1-minute load average per CPU (before or during the runs), other work on the box
#: competes with the server and the client: ratios between layouts are not fair.
BUSY_LOAD_PER_CPU = 0.75


def fairness(load_start: tuple[float, ...], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the box was quiet enough for the ratios to mean what they say."""
    cpus = os.cpu_count() or 1
    # the load the runs themselves add: the client and the server, about 2 runnable at
    # saturation, and one more for each HTTP worker process of a --workers layout and for
    # each engine process past the first
    worst = max(
        [load_start[0]]
        + [
            r.get("loadavg_1m_after", 0.0) - 2.0 - r.get("workers", 0) - (r.get("engines", 1) - 1)
            for r in results
        ]
    )
    fair = worst / cpus <= BUSY_LOAD_PER_CPU
    verdict = (
        "yes: the box was quiet"
        if fair
        else f"NO: other work on the box (1-min load ~{worst:.1f} besides this benchmark on "
        f"{cpus} CPUs): the ratios between layouts are not a fair measurement"
    )
    return {"fair": fair, "other_load_1m": round(worst, 2), "cpus": cpus, "verdict": verdict}


def plot(results: list[dict[str, Any]], path: Path, fair: dict[str, Any]) -> None:
    """Throughput over workers, one line per (users, think, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, dict[int, list[float]]] = {}
    for r in results:
        key = f"{r['users']} users, think {r['think_ms']:g} ms, {r['mode']}"
        runs.setdefault(key, {}).setdefault(r.get("workers", 0), []).append(r["throughput_rps"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, by_w in runs.items():
        if len(by_w) < 2:
            continue
        ws = sorted(by_w)
        med = [sorted(by_w[w])[len(by_w[w]) // 2] for w in ws]
        line = ax.plot(ws, med, marker="o", label=key)[0]
        for w in ws:  # every round's run, faint: the spread a busy box adds
            ax.scatter([w] * len(by_w[w]), by_w[w], color=line.get_color(), alpha=0.3, s=12)
    ax.set_xlabel("HTTP workers (0 = single-process server)")
    ax.set_ylabel("requests/s (median of the rounds; dots: each run)")
    ax.set_xticks(sorted({r.get("workers", 0) for r in results}))
    title = f"serve_load: throughput over workers ({fair['cpus']} CPUs)"
    if not fair["fair"]:
        title += "\nbusy machine: not a fair measurement"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def paired_ratios(results: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per round, each layout's throughput over the first layout's in the same round (runs
    next to each other, so on a busy box the fairest comparison there is)."""
    by: dict[tuple[Any, ...], dict[int, float]] = {}
    for r in results:
        key = (r["users"], r["think_ms"], r["mode"], r.get("round", 0))
        by.setdefault(key, {})[r.get("workers", 0)] = r["throughput_rps"]
    out: dict[str, list[float]] = {}
    for (users, think, mode, _), tp in sorted(by.items()):
        base_w = min(tp)
        for w, t in sorted(tp.items()):
            if w != base_w and tp[base_w] > 0:
                name = f"{mode}: workers {w} / workers {base_w}, {users} users, think {think:g} ms"
                out.setdefault(name, []).append(round(t / tp[base_w], 2))
    return out

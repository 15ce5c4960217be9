"""The load side of ``serve_load.py``: simulated users against a running server.

``load(base, users=..., ...)`` runs the closed loop (each simulated user one coroutine: a write
with probability ``write_frac``, else a retrieval, then an exponential think time) and returns
throughput, per-operation p50/p95/p99 latency, errors and the server's mean batch sizes over
the run; ``preload`` gives every user pages first and waits for their derived work. The
requests go through :class:`RawClient` (a minimal keep-alive HTTP/1.1 client: the generator's
own CPU must stay well below the server's) or :class:`HttpxClient`.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import re
import time
from typing import Any

import httpx

KEY = "bench-key-0123456789"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ADMIN_KEY = "bench-admin-0123456789"  # reads the server-wide /v1/stats the run compares
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TOPICS = [
    "hiking",
    "cooking",
    "violin",
    "football",
    "gardening",
    "astronomy",
    "travel",
    "chess",
    "painting",
    "running",
    "photography",
    "baking",
]
WORDS = [
    "morning",
    "weekend",
    "friend",
    "sister",
    "Lisbon",
    "Kyoto",
    "recipe",
    "concert",
    "marathon",
    "telescope",
    "tomatoes",
    "camera",
    "museum",
    "birthday",
    "holiday",
    "coffee",
]


def _text(rng: random.Random, user: int) -> str:
    return (
        f"On my {rng.choice(WORDS)} I did some {rng.choice(TOPICS)} with my "
        f"{rng.choice(WORDS)}; user {user} remembers the {rng.choice(WORDS)}"
    )


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (NaN when empty: see ``pct_ms``)."""
    if not values:
        return float("nan")
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


def pct_ms(values: list[float], q: float, scale: float = 1000.0) -> float | None:
    """The ``q``-th percentile of ``values`` times ``scale`` (seconds to ms), rounded; None
    (JSON null) when there are no samples."""
    return round(pct(values, q) * scale, 2) if values else None


async def pending_derived(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    m = re.search(r"^memoryos_pending_derived (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


#: Pages per preload request: small enough that one request stays well inside the client's
#: timeout even unbatched on a loaded box (500 took over 300 s there once).
PRELOAD_BATCH = 100


async def preload(client: httpx.AsyncClient, users: int, pages: int, seed: int) -> float:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    batch: list[dict[str, Any]] = []
    for k in range(pages):
        for u in range(users):
            batch.append({"user_id": f"user{u}", "user_input": _text(rng, u), "timestamp": k})
            if len(batch) == PRELOAD_BATCH:
                r = await client.post("/v1/pages", json={"pages": batch}, headers=HEADERS)
                r.raise_for_status()
                batch = []
    if batch:
        (await client.post("/v1/pages", json={"pages": batch}, headers=HEADERS)).raise_for_status()
    deadline = time.monotonic() + 300
    while await pending_derived(client) > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return time.perf_counter() - t0


class RawClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams (one connection).

    The load generator's own cost must stay well below the server's: on a 2-core box httpx
    spends ~3 ms of CPU per request (and its shared pool slows further with many connections),
    which would cap the measurement near 300 req/s whatever the server does. This client costs
    ~0.3 ms on asyncio's loop and 0.06-0.09 ms on uvloop's (``serve_load.py`` runs it there;
    the JSON's ``client_cpu_ms_per_request`` says what it took). ``--client httpx`` uses one
    httpx.AsyncClient per simulated user instead.
    """

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self._head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: Any = None, *, close: bool = False
    ) -> tuple[int, bytes]:
        """One request; ``body`` is JSON-encoded unless it is bytes already (a prepared
        payload); ``close`` ends the connection after the answer."""
        if isinstance(body, bytes):
            data = body
        else:
            data = json.dumps(body).encode() if body is not None else b""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{self._head}"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        if self._w is None:
            self._r, self._w = await asyncio.open_connection(self.host, self.port)
        assert self._r is not None
        self._w.write(head + data)
        await self._w.drain()
        raw = await self._r.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            k = k.strip().lower()
            if k == b"content-length":
                length = int(v)
            elif k == b"connection" and v.strip().lower() == b"close":
                close = True
        payload = await self._r.readexactly(length)
        if close:
            await self.close()
        return status, payload

    async def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._r = self._w = None


class HttpxClient:
    def __init__(self, base: str, headers: dict[str, str]) -> None:
        self._c = httpx.AsyncClient(
            base_url=base, headers=headers, limits=httpx.Limits(max_connections=1), timeout=120
        )

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        r = await self._c.request(method, path, json=body)
        return r.status_code, r.content

    async def close(self) -> None:
        await self._c.aclose()


def run_loop(coro: Any) -> Any:
    """Run the load generator's event loop: uvloop when installed (the server extra has it),
    whose loop costs the generator less CPU per request than asyncio's, leaving more of a
    small box to the server it measures."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the server extra
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _simulate(
    base: str,
    user_ids: list[int],
    *,
    requests: int,
    time_limit: float,
    write_frac: float,
    think_ms: float,
    seed: int,
    client_kind: str,
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """The closed loop of the simulated users ``user_ids`` (one coroutine each) until this
    process has issued ``requests`` requests or ``time_limit`` seconds pass: latencies of the
    successful requests by operation, and the failures by status or exception."""
    lat: dict[str, list[float]] = {"retrieve": [], "write": []}
    errors: dict[str, int] = {}
    issued = 0
    stop_at = time.monotonic() + time_limit
    host, port = base.removeprefix("http://").split(":")

    async def user_loop(u: int) -> None:
        nonlocal issued
        rng = random.Random(seed * 100_003 + u)
        client: RawClient | HttpxClient = (
            RawClient(host, int(port), HEADERS)
            if client_kind == "raw"
            else HttpxClient(base, HEADERS)
        )
        await asyncio.sleep(rng.random() * 0.05)  # de-synchronise the start
        try:
            while issued < requests and time.monotonic() < stop_at:
                issued += 1
                write = rng.random() < write_frac
                t0 = time.perf_counter()
                try:
                    if write:
                        status, _ = await client.request(
                            "POST",
                            f"/v1/users/user{u}/pages",
                            {"user_input": _text(rng, u), "agent_response": "ok"},
                        )
                    else:
                        q = f"{rng.choice(TOPICS)} {rng.choice(WORDS)}"
                        status, _ = await client.request(
                            "POST", f"/v1/users/user{u}/retrieve", {"query": q}
                        )
                    ok, key = status in (200, 201), str(status)
                except (OSError, asyncio.IncompleteReadError, httpx.HTTPError) as exc:
                    ok, key = False, type(exc).__name__
                    await client.close()
                dt = time.perf_counter() - t0
                if ok:
                    lat["write" if write else "retrieve"].append(dt)
                else:
                    errors[key] = errors.get(key, 0) + 1
                if think_ms > 0:
                    await asyncio.sleep(rng.expovariate(1000.0 / think_ms))
        finally:
            await client.close()

    await asyncio.gather(*(user_loop(u) for u in user_ids))
    return lat, errors


def _simulate_in_process(
    spec: dict[str, Any],
) -> tuple[dict[str, list[float]], dict[str, int], float]:
    """One client process's share of the users (``client_procs`` > 1), with the CPU it took."""
    cpu0 = time.process_time()
    lat, errors = run_loop(_simulate(**spec))
    return lat, errors, time.process_time() - cpu0


def _started(_: int) -> int:
    return os.getpid()


async def _pool_map(pool: Any, fn: Any, items: Any) -> list[Any]:
    """``pool.map`` without blocking the event loop or a thread: an interrupt cancels it."""
    res = pool.map_async(fn, items)
    while not res.ready():
        await asyncio.sleep(0.05)
    return res.get()


async def _simulate_in_processes(
    procs: int, base: str, users: int, requests: int, **kw: Any
) -> tuple[dict[str, list[float]], dict[str, int], float, float]:
    """The users dealt over ``procs`` client processes (user ``u`` to process ``u % procs``),
    started before the clock runs: one asyncio client saturates a core near 10,000 requests/s,
    below what a many-core box serves. Returns the merged latencies and errors, the wall time
    and the children's CPU."""
    ctx = multiprocessing.get_context("spawn")
    # map_async polled from the event loop, not pool.map in a thread: Ctrl-C / SIGTERM reach
    # the loop at once, and leaving the block terminates the pool (a worker killed by the
    # interrupt would otherwise leave pool.map, and the thread waiting on it, hanging forever)
    pool = ctx.Pool(procs)
    try:
        await _pool_map(pool, _started, range(procs))  # every process up and importing done
        specs = [
            dict(
                base=base,
                user_ids=list(range(i, users, procs)),
                requests=requests // procs + (i < requests % procs),
                **kw,
            )
            for i in range(procs)
        ]
        t0 = time.perf_counter()
        parts = await _pool_map(pool, _simulate_in_process, specs)
        wall = time.perf_counter() - t0
        pool.close()
    finally:
        pool.terminate()
        pool.join()
    lat: dict[str, list[float]] = {"retrieve": [], "write": []}
    errors: dict[str, int] = {}
    for part_lat, part_errors, _ in parts:
        for op, values in part_lat.items():
            lat[op].extend(values)
        for k, n in part_errors.items():
            errors[k] = errors.get(k, 0) + n
    return lat, errors, wall, sum(cpu for _, _, cpu in parts)


def _batching(stats: httpx.Response) -> dict[str, dict[str, int]]:
    """Batches and items per queue (retrieve, write, ...), summed over the shards of a
    server with several engine processes (whose statistics come per shard)."""
    raw = stats.json()["server"]["batching"]
    shards = [raw] if all("batches" in q for q in raw.values()) else list(raw.values())
    out: dict[str, dict[str, int]] = {}
    for shard in shards:
        for name, q in shard.items():
            total = out.setdefault(name, {"batches": 0, "items": 0})
            total["batches"] += q["batches"]
            total["items"] += q["items"]
    return out


async def load(
    base: str,
    *,
    users: int,
    requests: int,
    time_limit: float,
    write_frac: float,
    think_ms: float,
    seed: int,
    client_kind: str = "raw",
    procs: int = 1,
) -> dict[str, Any]:
    """Run the load once; ``procs`` > 1 deals the users over that many client processes.
    ``client_cpu_s`` is the generator's own CPU over the run, its processes' included."""
    kw: dict[str, Any] = dict(
        time_limit=time_limit,
        write_frac=write_frac,
        think_ms=think_ms,
        seed=seed,
        client_kind=client_kind,
    )
    async with httpx.AsyncClient(base_url=base, headers=HEADERS, timeout=120) as control:
        before = _batching(await control.get("/v1/stats", headers=ADMIN))
        cpu0 = time.process_time()
        if procs > 1:
            lat, errors, wall, child_cpu = await _simulate_in_processes(
                procs, base, users, requests, **kw
            )
        else:
            t0 = time.perf_counter()
            lat, errors = await _simulate(base, list(range(users)), requests=requests, **kw)
            wall, child_cpu = time.perf_counter() - t0, 0.0
        client_cpu = time.process_time() - cpu0 + child_cpu
        after = _batching(await control.get("/v1/stats", headers=ADMIN))
        backlog = await pending_derived(control)
    mean_batch = {}
    for k in after:
        nb = after[k]["batches"] - before[k]["batches"]
        mean_batch[k] = round((after[k]["items"] - before[k]["items"]) / nb, 2) if nb else 0.0
    done = len(lat["retrieve"]) + len(lat["write"])
    out: dict[str, Any] = {
        "requests_ok": done,
        "errors": errors,
        "wall_s": round(wall, 3),
        "throughput_rps": round(done / wall, 1) if wall > 0 else 0.0,
        "mean_batch": mean_batch,
        # derived work still owed when the load stops: a server that put it off would look
        # faster than one that keeps up (a steady state keeps this to about one round)
        "derived_backlog_after": int(backlog),
        "client_procs": procs,
        "client_cpu_s": round(client_cpu, 3),
    }
    for op, values in lat.items():
        out[op] = {
            "n": len(values),
            "p50_ms": pct_ms(values, 50),
            "p95_ms": pct_ms(values, 95),
            "p99_ms": pct_ms(values, 99),
        }
    return out

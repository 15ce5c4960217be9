"""``serve --workers N``: HTTP worker processes in front of one engine process.

Real processes throughout: a supervisor subprocess (``app.run(workers=2)``) on a fresh store;
workers and the engine process are killed with SIGKILL under a write load, and every write the
server acknowledged must be in the store afterwards.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("uvicorn")

from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.server.shared_limits import SharedKeyLimits, create_bucket_file
from tests.served import HA, HADMIN, HB, KEY_ADMIN, KEYS, ROOT, fake_engine, free_port, wait_ready

SCRIPT = """
import json, sys
from memoryos_gpu.server.app import run
kw = json.loads(sys.argv[1])
run(**kw)
"""


#: The failure tests' load (16 writers, no think time) can outrun the default per-key limit
#: (500 requests/s: a 429 failed one run) and a 429 is not what they test, so their servers
#: run without request and page limits (0 disables one; the limits themselves are tested
#: across workers below).
UNLIMITED = {"rate_limit_per_s": 0, "rate_limit_pages_per_s": 0}


class Supervised:
    """A ``serve --workers`` server in a subprocess; its log names the processes' pids."""

    def __init__(self, store: Path, log: Path, workers: int = 2, **settings: Any) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.store = store
        spec = {
            "store": str(store),
            "port": self.port,
            "embedder": "hashing",
            "api_keys": {**KEYS, KEY_ADMIN: "*"},
            "workers": workers,
            "log_level": "info",
            "graceful_timeout_s": 10,
            **settings,
        }
        env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_API_KEYS"}
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def pids(self, what: str) -> list[int]:
        """Pids of ``engine process`` or ``HTTP worker N`` starts, in log order."""
        text = self.log.read_text()
        return [int(p) for p in re.findall(rf"{what} started \(pid (\d+)\)", text)]

    def wait_ready(self, timeout: float = 120) -> None:
        wait_ready(self.proc, self.base, lambda: self.log.read_text()[-3000:], timeout, 0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    d = tmp_path_factory.mktemp("workers")
    s = Supervised(d / "store", d / "server.log", **UNLIMITED)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ============================================================================ the routes
def test_routes_answer_as_in_one_process(server: Supervised) -> None:
    with httpx.Client(base_url=server.base, headers=HA, timeout=30) as c:
        page = {"user_input": "I play the violin in Lisbon", "meta": {"speaker_a": "Ann"}}
        r = c.post("/v1/users/ann/pages", json=page)
        assert r.status_code == 201, r.text
        page_id = r.json()["page_id"]
        r = c.post("/v1/users/ann/retrieve", json={"query": "violin"})
        assert r.status_code == 200, r.text  # the page's metadata crosses the engine's channel
        got = r.json()
        assert got["known_user"] is True
        assert [p["page_id"] for p in got["stm"]] == [page_id]
        assert got["stm"][0]["extra"] == {"speaker_a": "Ann"}
        assert c.post("/v1/users/ann/wait").json()["done"] is True
        assert c.get(f"/v1/users/ann/pages/{page_id}").json()["user_input"].startswith("I play")
        assert "ann" in c.get("/v1/users").json()["users"]
        # an engine-side error comes back as its own type: the same 404 body
        r = c.get("/v1/users/nobody/history")
        assert r.status_code == 404 and r.json()["error"] == "unknown_user"
        assert "acme/" not in r.json()["detail"]
        # the mem0 verbs run in a worker thread, calling the engine process one call at a time
        hits = c.post("/v1/mem0/search", json={"query": "violin", "user_id": "ann"}).json()
        assert [h["id"] for h in hits["results"]] == [f"page-{page_id}"]
        stats = c.get("/v1/stats", headers=HADMIN).json()
        assert stats["server"]["batching"]["write"]["items"] >= 1


#: A session of every route, errors included (method, path, tenant headers, body): each must
#: answer behind a worker exactly as the single process does.
_T = 1.7e9
_SESSION: list[tuple[str, str, dict[str, str], Any]] = [
    ("POST", "/v1/users/ann/pages", HA, {"user_input": "I play the violin", "timestamp": _T}),
    ("POST", "/v1/users/ann/pages", HA, {"user_input": "Eva teaches piano", "source": "s1"}),
    ("POST", "/v1/users/ann/pages", HA, {"user_input": "Eva teaches piano", "source": "s1"}),
    ("POST", "/v1/users/ann/pages", HA, {"user_input": "x", "timestamp": "not a time"}),
    ("POST", "/v1/users/ann/pages", HA, {"user_input": "x", "bogus": 1}),
    ("POST", "/v1/pages", HA, {"pages": [{"user_id": "bob", "user_input": "I like chess"}]}),
    ("POST", "/v1/pages", HA, {"pages": [{"user_id": "", "user_input": "bad"}]}),
    ("POST", "/v1/users/ann/wait", HA, {}),
    ("POST", "/v1/users/ann/retrieve", HA, {"query": "violin"}),
    ("POST", "/v1/users/ann/retrieve", HA, {"query": "violin", "top_pages": 0}),
    ("POST", "/v1/users/nobody/retrieve", HA, {"query": "violin"}),
    ("POST", "/v1/retrieve", HA, {"queries": [{"user_id": u, "query": "chess"} for u in "ab"]}),
    ("POST", "/v1/users/ann/respond", HA, {"query": "what do I play?"}),
    ("GET", "/v1/users/ann/pages?limit=1", HA, None),
    ("GET", "/v1/users/ann/pages/1", HA, None),
    ("GET", "/v1/users/ann/pages/99999", HA, None),
    ("GET", "/v1/users/bob/pages/1", HA, None),
    ("PATCH", "/v1/users/ann/pages/1", HA, {"user_input": "I play the cello"}),
    ("PATCH", "/v1/users/ann/pages/99999", HA, {"user_input": "x"}),
    ("PATCH", "/v1/users/ann/pages/1", HA, {}),
    ("DELETE", "/v1/users/ann/pages/99999", HA, None),
    *[
        ("GET", f"/v1/users/{u}/{what}", HA, None)
        for u in ("ann", "nobody")
        for what in ("pages", "profile", "knowledge", "history", "export")
    ],
    ("GET", "/v1/users/ann/knowledge/99999", HA, None),
    ("PATCH", "/v1/users/ann/knowledge/99999", HA, {"text": "x"}),
    ("DELETE", "/v1/users/ann/knowledge/99999", HA, None),
    ("POST", "/v1/users/nobody/wait", HA, {}),
    ("GET", "/v1/users", HB, None),
    ("GET", "/v1/users/ann/pages", HB, None),  # another tenant's user
    ("POST", "/v1/mem0/memories", HA, {"messages": "I love tea", "user_id": "cat"}),
    ("POST", "/v1/mem0/memories", HA, {"messages": [], "user_id": "cat"}),
    ("POST", "/v1/mem0/search", HA, {"query": "tea", "user_id": "cat"}),
    ("POST", "/v1/mem0/search", HA, {"query": "tea"}),
    ("GET", "/v1/mem0/memories?user_id=cat", HA, None),
    ("GET", "/v1/mem0/memories/page-99999", HA, None),
    ("PUT", "/v1/mem0/memories/page-99999", HA, {"text": "x"}),
    ("GET", "/v1/mem0/memories/page-99999/history", HA, None),
    ("DELETE", "/v1/users/ann/pages/2", HA, None),
    ("DELETE", "/v1/users/ann/pages/2", HA, None),
    ("DELETE", "/v1/users/bob", HA, None),
    ("DELETE", "/v1/users/bob", HA, None),
    ("POST", "/v1/mem0/reset", HA, {}),
    ("GET", "/v1/users", HA, None),
]
#: What differs between two runs of one session: clocks.
_CLOCKS = {
    "ts",
    "timestamp",
    "clock",
    "created",
    "waited_s",
    "valid_from",
    "created_at",
    "updated_at",
}


def _answers(
    store: Path | str, log: Path, session: list[Any] = _SESSION, **layout: int
) -> list[tuple[str, int, Any]]:
    """A session's answers (status, body without clock fields) from a fresh server."""

    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in _CLOCKS}
        return [strip(x) for x in v] if isinstance(v, list) else v

    s = Supervised(store, log, **layout, **UNLIMITED)  # type: ignore[arg-type]
    try:
        s.wait_ready()
        with httpx.Client(base_url=s.base, timeout=30) as c:
            return [
                (f"{method} {path}", r.status_code, strip(r.json()))
                for method, path, headers, body in session
                for r in [c.request(method, path, headers=headers, json=body)]
            ]
    finally:
        s.stop()


def test_every_route_answers_as_in_one_process_errors_included(tmp_path: Path) -> None:
    """The same session of requests (writes, reads, edits, deletes, mem0 verbs; bad input,
    unknown users and pages, another tenant, no LLM) against the single process and against a
    worker: every answer the same. (Behind a worker, the engine's own errors -- a timestamp
    that does not parse, an unknown user's profile, respond without an LLM -- once never
    answered.) Shard engines: tests/test_serve_engines.py."""
    single = _answers(tmp_path / "single", tmp_path / "single.log", workers=0)
    assert {status for _, status, _ in single} >= {200, 201, 404, 422, 501}  # errors reached
    behind = _answers(tmp_path / "worker", tmp_path / "worker.log", workers=1)
    for one, other in zip(single, behind, strict=True):
        assert one == other


def test_a_write_is_visible_from_every_worker_at_once(server: Supervised) -> None:
    """Read-your-writes across processes: the next request, on a new connection (any worker),
    sees the acknowledged page."""
    for i in range(20):
        uid = f"ryw{i}"
        with httpx.Client(base_url=server.base, headers=HA, timeout=30) as c:
            assert c.post(f"/v1/users/{uid}/pages", json={"user_input": "x"}).status_code == 201
        with httpx.Client(base_url=server.base, headers=HA, timeout=30) as c:
            assert c.get(f"/v1/users/{uid}/history").status_code == 200
            assert c.post(f"/v1/users/{uid}/retrieve", json={"query": "x"}).json()["known_user"]


def test_a_second_writer_is_refused_naming_the_engine_process(server: Supervised) -> None:
    """The engine process holds the store's writer lock; the refusal names it and the server's
    command line."""
    from memoryos_gpu.engine import MemoryEngine
    from memoryos_gpu.store.writer import StoreLockedError
    from tests.served import hashing

    with pytest.raises(StoreLockedError) as err:
        MemoryEngine(hashing(server.store))
    msg = str(err.value)
    assert f"pid {server.pids('engine process')[-1]} " in msg
    assert f"[engine process of pid {server.proc.pid}]" in msg


def test_metrics_add_up_over_workers(server: Supervised) -> None:
    """Each request on its own connection, so the workers share them; any worker's /metrics
    counts all of them."""

    def count() -> float:
        text = httpx.get(f"{server.base}/metrics", headers=HADMIN).text
        pat = (
            r"memoryos_http_request_duration_seconds_count"
            r'\{method="GET",route="/health",status="200"\} (\S+)'
        )
        m = re.search(pat, text)
        return float(m.group(1)) if m else 0.0

    before = count()
    for _ in range(40):
        assert httpx.get(f"{server.base}/health").status_code == 200
    assert count() - before == 40
    text = httpx.get(f"{server.base}/metrics", headers=HADMIN).text
    assert re.search(r'memoryos_batch_size_count\{queue="write"\} [1-9]', text)  # engine's
    assert re.search(r"^memoryos_pending_derived \S+$", text, re.M)


# ============================================================================ limits
def _take_all(path: str, key_id: str, n: int, out: Any) -> None:
    settings = ServerSettings(rate_limit_per_s=0.001, rate_limit_burst=30)
    limits = SharedKeyLimits(settings, path, [key_id])
    out.put(sum(limits.request(key_id) is None for _ in range(n)))


def test_rate_limits_hold_for_all_workers_together(tmp_path: Path) -> None:
    """Three processes draw on one key's bucket of 30: 30 requests pass in all, not 90."""
    path = str(tmp_path / "limits")
    create_bucket_file(path, 1)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_take_all, args=(path, "fp-a", 25, out)) for _ in range(3)]
    for p in procs:
        p.start()
    passed = sum(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert passed == 30
    # another key has its own bucket; the refusal is the same 429 as in one process
    limits = SharedKeyLimits(
        ServerSettings(rate_limit_per_s=0.001, rate_limit_burst=30), path, ["fp-a"]
    )
    assert limits.request("fp-a")[0] == 429
    assert limits.request("fp-b") is None


# ============================================================================ failures
async def _write_load(
    base: str, stop: asyncio.Event, first_ack: asyncio.Event | None = None, users: int = 16
) -> dict[str, Any]:
    """Writers on fresh connections after each failure; the acknowledged page ids and the
    failures (connection errors, 503) by kind. ``first_ack`` is set once a write is
    acknowledged."""
    acked: dict[int, str] = {}
    failures: dict[str, int] = {}

    async def writer(u: int) -> None:
        n = 0
        client = httpx.AsyncClient(base_url=base, headers=HA, timeout=30)
        try:
            while not stop.is_set():
                n += 1
                try:
                    r = await client.post(
                        f"/v1/users/load{u}/pages", json={"user_input": f"load {u} page {n}"}
                    )
                except httpx.TransportError as exc:
                    failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                    await client.aclose()
                    client = httpx.AsyncClient(base_url=base, headers=HA, timeout=30)
                    await asyncio.sleep(0.05)
                    continue
                if r.status_code == 201:
                    acked[r.json()["page_id"]] = f"load {u} page {n}"
                    if first_ack is not None:
                        first_ack.set()
                else:
                    assert r.status_code == 503, r.text
                    assert int(r.headers["Retry-After"]) >= 1
                    failures["503"] = failures.get("503", 0) + 1
                    await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    await asyncio.gather(*(writer(u) for u in range(users)))
    return {"acked": acked, "failures": failures}


def _under_load(base: str, during: Any, seconds: float = 6.0) -> dict[str, Any]:
    """Run ``during`` while writers load the server: once a write has been acknowledged (on a
    machine loaded by other work the first can take well over a second; a fixed wait made the
    checks of acknowledged writes fail with none to check), and 1.5 s of load at least."""

    async def go() -> dict[str, Any]:
        stop, first_ack = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(_write_load(base, stop, first_ack))
        await asyncio.sleep(1.5)
        await asyncio.wait_for(first_ack.wait(), timeout=60)
        await asyncio.get_running_loop().run_in_executor(None, during)
        await asyncio.sleep(seconds)
        stop.set()
        return await task

    return asyncio.run(go())


def _assert_stored(base: str, acked: dict[int, str]) -> None:
    """Every acknowledged page is stored with its text: each load user's pages listed (a few
    requests, within the key's rate limit however many writes were acknowledged)."""
    assert acked, "no write was acknowledged"
    stored: dict[int, str] = {}
    with httpx.Client(base_url=base, headers=HA, timeout=30) as c:
        for user in sorted({text.split()[1] for text in acked.values()}):
            offset, total = 0, 1
            while offset < total:
                r = c.get(f"/v1/users/load{user}/pages", params={"offset": offset, "limit": 1000})
                assert r.status_code == 200, r.text
                body = r.json()
                stored.update((p["page_id"], p["user_input"]) for p in body["pages"])
                offset, total = offset + len(body["pages"]), body["total"]
    missing = {pid: text for pid, text in acked.items() if stored.get(pid) != text}
    assert not missing, f"{len(missing)} acknowledged pages not stored as written"


def test_a_killed_worker_is_restarted_and_loses_no_acknowledged_write(server: Supervised) -> None:
    victim = server.pids("HTTP worker 0")[-1]
    res = _under_load(server.base, lambda: os.kill(victim, signal.SIGKILL))
    deadline = time.monotonic() + 60
    while server.pids("HTTP worker 0")[-1] == victim:
        assert time.monotonic() < deadline, "worker 0 was not restarted"
        time.sleep(0.1)
    assert not _alive(victim)
    server.wait_ready()
    _assert_stored(server.base, res["acked"])


def test_a_killed_engine_means_503_until_the_store_is_reopened(server: Supervised) -> None:
    victim = server.pids("engine process")[-1]
    seen_not_ready: list[httpx.Response] = []
    probes: list[tuple[float, int]] = []  # (seconds after the kill, status): what a failure shows

    def kill() -> None:
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() < t0 + 5 and not seen_not_ready:
            r = httpx.get(f"{server.base}/ready", timeout=5)
            probes.append((round(time.monotonic() - t0, 3), r.status_code))
            if r.status_code == 503:
                seen_not_ready.append(r)
            time.sleep(0.005)

    res = _under_load(server.base, kill)
    assert seen_not_ready, (
        f"never not-ready: {probes[:5]} ... {probes[-5:]}\n" + (server.log.read_text()[-4000:])
    )
    assert int(seen_not_ready[0].headers["Retry-After"]) >= 1
    assert res["failures"].get("503", 0) >= 1
    assert server.pids("engine process")[-1] != victim
    server.wait_ready()
    _assert_stored(server.base, res["acked"])  # read from the new engine process's store


def test_a_status_request_lost_with_the_engine_does_not_hide_its_death(tmp_path: Path) -> None:
    """The engine dies holding the worker's status request (it never answers): the worker
    reports not-ready as soon as the pid changes and stays so for the new engine, not ready
    again on the old engine's word after the request's 5 s timeout (the killed-engine test
    failed so ~1 run in 8)."""
    import zmq
    import zmq.asyncio

    from memoryos_gpu.server.ipc import dump, load
    from memoryos_gpu.server.remote_service import RemoteService

    async def go() -> tuple[float, bool]:
        address = f"ipc://{tmp_path}/engine.sock"
        ctx = zmq.asyncio.Context()
        engine = ctx.socket(zmq.ROUTER)
        engine.bind(address)
        pid = [os.getpid()]  # a running process: the worker takes a dead one's pid for none
        service = RemoteService(address, lambda: pid[0])
        await service.start(wait=False)
        try:
            ident, payload = await asyncio.wait_for(engine.recv_multipart(), 5)
            (rid, method, _args, _kw), *_ = load(payload)
            assert method == "status"
            await engine.send_multipart([ident, dump([(rid, True, {"state": "ready"})])])
            deadline = time.monotonic() + 5
            while not service.ready:
                assert time.monotonic() < deadline, "never ready"
                await asyncio.sleep(0.01)
            # the next refresh reaches the engine, which dies without answering it
            ident, payload = await asyncio.wait_for(engine.recv_multipart(), 5)
            assert load(payload)[0][1] == "status"
            t0 = time.monotonic()
            pid[0] = 0  # the supervisor saw it die; a new one starts
            while service.ready:
                assert time.monotonic() < t0 + 4, "still ready 4 s after the engine died"
                await asyncio.sleep(0.005)
            noticed = time.monotonic() - t0
            pid[0] = os.getppid()  # the new engine: it has not answered anything yet
            await asyncio.sleep(0.3)
            return noticed, service.ready
        finally:
            await service.close()
            engine.close(0)
            ctx.term()

    noticed, ready_after = asyncio.run(go())
    assert noticed < 1.0, noticed
    assert not ready_after


def test_a_request_is_not_refused_for_the_workers_older_view(tmp_path: Path) -> None:
    """The engine became ready after this worker's last status refresh (another worker may
    already have answered /ready): a write sent now asks the engine first and is served, not
    answered 503 "still loading" from the snapshot (a flaky failure of the two-engine test);
    while the engine really is starting, the write is refused."""
    import zmq
    import zmq.asyncio

    from memoryos_gpu.server.batching import Unavailable
    from memoryos_gpu.server.ipc import dump, load
    from memoryos_gpu.server.remote_service import RemoteService
    from memoryos_gpu.types import AddResult, PageInput

    async def go() -> tuple[list[AddResult], list[str]]:
        address = f"ipc://{tmp_path}/engine.sock"
        ctx = zmq.asyncio.Context()
        engine = ctx.socket(zmq.ROUTER)
        engine.bind(address)
        state, asked = ["starting"], []

        async def answer() -> None:
            while True:
                ident, payload = await engine.recv_multipart()
                out = []
                for rid, method, args, _kw in load(payload):
                    asked.append(method)
                    if method == "status":
                        out.append((rid, True, {"state": state[0]}))
                    else:
                        out.append((rid, True, [AddResult(7, p.user_id) for p in args[0]]))
                await engine.send_multipart([ident, dump(out)])

        server = asyncio.get_running_loop().create_task(answer())
        service = RemoteService(address, os.getpid)  # a running "engine process"
        await service.start(wait=False)
        try:
            while "status" not in asked:
                await asyncio.sleep(0.01)
            with pytest.raises(Unavailable, match="still loading"):
                await service.add_pages([PageInput("u", "hi")])
            state[0] = "ready"  # the snapshot still says starting: no refresh since
            assert service.state == "starting"
            asked.clear()
            got = await service.add_pages([PageInput("u", "hello")])
            return got, asked
        finally:
            server.cancel()
            await service.close()
            engine.close(0)
            ctx.term()

    got, asked = asyncio.run(go())
    assert [(r.page_id, r.user_id) for r in got] == [(7, "u")]
    assert asked[0] == "status" and "add_pages" in asked


def test_an_engine_gone_while_its_pid_is_still_published_fails_what_waits(tmp_path: Path) -> None:
    """A supervisor killed by SIGKILL unpublishes nothing: its engine process stops (the
    kernel's SIGTERM) while the workers still publish its pid. The worker sees the process
    gone itself: the write waiting for its answer fails with EngineGone (503 + Retry-After)
    and the worker reports not-ready, instead of the write waiting until the worker's own
    graceful shutdown cancelled it (a 500)."""
    import zmq
    import zmq.asyncio

    from memoryos_gpu.server.ipc import EngineGone, dump, load
    from memoryos_gpu.server.remote_service import RemoteService
    from memoryos_gpu.types import PageInput

    engine_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    async def go() -> bool:
        address = f"ipc://{tmp_path}/engine.sock"
        ctx = zmq.asyncio.Context()
        engine = ctx.socket(zmq.ROUTER)
        engine.bind(address)
        writes: list[int] = []

        async def answer() -> None:  # status: ready; a write: never answered (it dies)
            while True:
                ident, payload = await engine.recv_multipart()
                out = []
                for rid, method, _args, _kw in load(payload):
                    if method == "status":
                        out.append((rid, True, {"state": "ready"}))
                    else:
                        writes.append(rid)
                if out:
                    await engine.send_multipart([ident, dump(out)])

        server = asyncio.get_running_loop().create_task(answer())
        service = RemoteService(address, lambda: engine_proc.pid)
        await service.start(wait=True)
        try:
            write = asyncio.ensure_future(service.add_pages([PageInput("u", "hi")]))
            while not writes:
                await asyncio.sleep(0.01)
            engine_proc.kill()  # its pid stays published: no supervisor to clear it
            with pytest.raises(EngineGone):
                await asyncio.wait_for(write, 30)
            return service.ready
        finally:
            server.cancel()
            await service.close()
            engine.close(0)
            ctx.term()

    try:
        assert asyncio.run(go()) is False
    finally:
        engine_proc.kill()
        engine_proc.wait()


def test_an_engine_error_fails_only_its_request_in_a_batch_of_answers(tmp_path: Path) -> None:
    """The engine answers a loop iteration's requests in one message: one request's error is
    raised to its caller as its own type (message and attributes kept), and the answers beside
    it in that message still reach theirs. (An error used to be raised while being delivered:
    its caller and every answer after it in the message waited forever.)"""
    from memoryos_gpu.distributed.ray_common import BoxedError
    from memoryos_gpu.errors import UnknownUserError

    def answer(method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        if method == "bad":
            err = UnknownUserError(f"no user {args[0]}")
            err.user_id = args[0]
            return False, BoxedError.of(err)
        return True, args[0] * 2

    async def go() -> list[Any]:
        async with fake_engine(f"ipc://{tmp_path}/engine.sock", answer) as client:
            calls = [client.request("bad", "ann"), client.request("x", 2), client.request("x", 5)]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)

    err, *rest = asyncio.run(go())
    assert isinstance(err, UnknownUserError), err
    assert str(err) == "no user ann" and err.user_id == "ann"
    assert rest == [4, 10]


def test_sigterm_drains_and_stops_every_process(tmp_path: Path) -> None:
    s = Supervised(tmp_path / "store", tmp_path / "server.log", workers=1, **UNLIMITED)
    s.wait_ready()
    children = s.pids("engine process") + s.pids("HTTP worker 0")

    def stop() -> None:
        s.proc.send_signal(signal.SIGTERM)

    res = _under_load(s.base, stop, seconds=2.0)
    assert s.stop() == 0, s.log.read_text()[-3000:]
    assert not any(_alive(p) for p in children)
    # the engine process's last line says what its close left pending (it said "store closed")
    engine_lines = [ln for ln in s.log.read_text().splitlines() if "[engine]: " in ln]
    assert engine_lines[-1].endswith(
        "engine process: queues drained, derived work done, engine closed"
    ), engine_lines[-3:]
    from memoryos_gpu.engine import MemoryEngine
    from tests.served import hashing

    eng = MemoryEngine(hashing(tmp_path / "store"))
    try:
        for page_id, text in res["acked"].items():
            assert eng.get_page(page_id)["user_input"] == text
        assert eng.pending_count() == 0  # the derived work was finished before the store closed
    finally:
        eng.close()


def _wait_gone(pids: list[int], within: float) -> list[int]:
    """Poll until none of ``pids`` runs or ``within`` seconds passed; those still running are
    SIGKILLed (no orphan outlives the test) and returned."""
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_the_supervisor_stops_its_processes_and_frees_the_store(
    tmp_path: Path,
) -> None:
    """The supervisor killed outright (SIGKILL: no shutdown of its own) under a write load: the
    engine process and the worker get SIGTERM from the kernel and stop as on a normal
    shutdown, so a new ``serve`` on the same store opens it (before, they were reparented to
    PID 1, kept answering on the old port and kept the store's writer claim: the new server's
    engine was refused with StoreLockedError), and every write acknowledged before is there."""
    s = Supervised(tmp_path / "store", tmp_path / "server.log", workers=1, **UNLIMITED)
    try:
        s.wait_ready()
        children = s.pids("engine process") + s.pids("HTTP worker 0")
        res = _under_load(s.base, s.proc.kill, seconds=1.0)
        s.proc.wait(30)
        left = _wait_gone(children, within=90)  # generous: each drains and closes first
        assert not left, f"orphans {left} still running:\n{s.log.read_text()[-3000:]}"
    finally:
        s.stop()
    again = Supervised(tmp_path / "store", tmp_path / "server2.log", workers=1, **UNLIMITED)
    try:
        again.wait_ready()
        _assert_stored(again.base, res["acked"])
    finally:
        assert again.stop() == 0, again.log.read_text()[-3000:]

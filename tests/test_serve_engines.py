"""``serve --workers N --engines K``: users sharded over K engine processes.

In process first: two shard engines behind real ZeroMQ engine servers and the workers' router
(:class:`~memoryos_gpu.server.shard_router.ShardedRemoteService`) in one event loop, with a
scripted LLM whose promotions find assistant facts: pages go to their user's shard, assistant
knowledge is the same on both shards after a sync, and deleting a user forgets what its pages
taught on both (SQLite, and PostgreSQL when a test server is set). Then the exchange lock
across processes, and the whole server in a subprocess: every worker serves every user, an
engine killed with SIGKILL fails only its own users, layouts that cannot work are refused, a
store ingested with ``ingest --workers 2`` is served by two engines, SIGTERM keeps every write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("uvicorn")

from memoryos_gpu.distributed.layout import ShardMap, prepare_layout, shard_store
from memoryos_gpu.distributed.sharding import ShardEngine
from memoryos_gpu.llm.scripted import ScriptedBackend
from memoryos_gpu.types import PageInput
from tests.served import HA, ROOT
from tests.test_distributed import (
    BACKENDS,
    _assistant_script,
    conversation,
    engine_config,
    store_for,
)
from tests.test_serve_workers import UNLIMITED, Supervised

SHARDS = ShardMap(2)


# ------------------------------------------------------------------------------ in process
@contextlib.asynccontextmanager
async def _sharded(tmp_path: Path, store: str) -> AsyncIterator[Any]:
    """Two shard engines (LLM mode, scripted) behind engine servers, and a worker's service;
    ``store``: a directory (a SQLite store per shard) or a PostgreSQL URL (one database)."""
    import zmq

    from memoryos_gpu.server.engine_process import EngineServer
    from memoryos_gpu.server.service import MemoryService
    from memoryos_gpu.server.settings import ServerSettings
    from memoryos_gpu.server.shard_router import ShardedRemoteService

    prepare_layout(store, 2)
    ctx = zmq.Context()
    servers, addresses = [], []
    for i in range(2):
        cfg = engine_config(shard_store(store, i, 2), mode="llm", auto_process=False)
        svc = MemoryService(
            lambda cfg=cfg, i=i: ShardEngine(
                cfg, shard=i, count=2, llm=ScriptedBackend(_assistant_script)
            ),
            ServerSettings(),
        )
        addresses.append(f"ipc://{tmp_path}/engine-{i}.sock")
        servers.append(EngineServer(svc, ctx, addresses[-1]))
        await svc.start(wait=True)
        servers[-1].sock.start()
    service = ShardedRemoteService(
        addresses,
        [lambda: os.getpid()] * 2,
        ServerSettings(),
        lock_path=str(tmp_path / "exchange.lock"),
        sync=True,
        sync_interval_s=3600,  # the test syncs when it wants to
    )
    await service.start(wait=True)
    try:
        yield service
    finally:
        await service.close()
        for s in servers:
            s.sock.pause()
            await s.service.close()
            await s.finish()
            s.sock.close()
        ctx.term()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pages_go_to_their_shard_and_assistant_knowledge_reaches_both(
    backend: str, tmp_path: Path
) -> None:
    rows = conversation(users=6, per_user=10)
    users = sorted({r["user_id"] for r in rows})

    async def go() -> None:
        async with _sharded(tmp_path, store_for(backend, tmp_path)) as service:
            for i in range(0, len(rows), 16):  # each batch holds users of both shards
                batch = [PageInput(**r) for r in rows[i : i + 16]]
                res = await service.add_pages(batch)
                assert [r.user_id for r in res] == [p.user_id for p in batch]  # in order
            for u in users:
                assert (await service.wait_for_user(u, 60))["done"]
            assert await service.users() == users
            stats = await service.call(service.engine.stats)
            for shard in (0, 1):
                mine = [u for u in users if SHARDS.shard(u) == shard]
                assert stats["shards"][shard]["users"] == len(mine) > 0
            await service.router.sync()
            asst0 = [u for u in users if int(u.split("-")[1]) % 2 == 0]
            assert {SHARDS.shard(u) for u in asst0} == {0, 1}

            async def assistant_texts(u: str) -> list[str]:
                kn = await service.call(service.engine_for(u).knowledge, u)
                return sorted(k["text"] for k in kn["assistant"])

            seen = [await assistant_texts(u) for u in asst0]
            assert seen[0] and all(s == seen[0] for s in seen)  # one ring on both shards
            taught = [t for t in seen[0] if "from user 0" in t]
            assert taught, "user-0's promotions taught its assistant nothing to forget"
            assert await service.delete_user("user-0")
            assert not await service.known("user-0")
            for u in asst0[1:]:
                after = await assistant_texts(u)
                assert not any("from user 0" in t for t in after), u
                assert set(after) == set(seen[0]) - set(taught)

    asyncio.run(go())


def test_shard_engines_on_one_postgres_store_answer_as_one_process(tmp_path: Path) -> None:
    """The session of every route (tests/test_serve_workers.py) through a worker in front of two
    shard engines sharing one PostgreSQL store answers as the single process does, errors
    included; the mem0 verbs are left out (refused under shard engines: their memory ids are
    page ids, and a SQLite layout numbers pages per shard)."""
    from store_backends import make_backend

    from tests.test_serve_workers import _SESSION, _answers

    pg = make_backend("postgres", tmp_path)
    session = [r for r in _SESSION if not r[1].startswith("/v1/mem0")]
    try:
        single = _answers(pg.spec("single"), tmp_path / "single.log", session, workers=0)
        sharded = _answers(
            pg.spec("sharded"), tmp_path / "sharded.log", session, workers=1, engines=2
        )
    finally:
        pg.cleanup()
    assert {status for _, status, _ in single} >= {200, 201, 404, 422, 501}
    for one, other in zip(single, sharded, strict=True):
        assert one == other


def test_the_exchange_lock_excludes_other_processes_and_cancelled_waiters(tmp_path: Path) -> None:
    from memoryos_gpu.server.shard_router import ExchangeLock

    path = str(tmp_path / "exchange.lock")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({path!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(3.0)\n",  # the test asserts a wait > 0.5 s: room for a stall
        ],
        stdout=subprocess.PIPE,
        text=True,
    )

    async def go() -> tuple[float, bool]:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        async with ExchangeLock(path):
            waited = time.monotonic() - t0
            # held here: a second waiter in this process waits, and a cancelled one never
            # takes the lock afterwards
            waiter = asyncio.create_task(ExchangeLock(path).__aenter__())
            await asyncio.sleep(0.1)
            blocked = not waiter.done()
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
        async with ExchangeLock(path):  # free again: nothing kept it
            pass
        return waited, blocked

    waited, blocked = asyncio.run(go())
    holder.wait(10)
    assert waited > 0.5  # it waited for the other process's lock
    assert blocked


# ------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp("engines")
    s = Supervised(d / "store", d / "server.log", workers=2, engines=2, **UNLIMITED)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _users() -> dict[int, list[str]]:
    """User ids by the shard that holds them (tenant ``acme``: stored as ``acme/<id>``)."""
    out: dict[int, list[str]] = {0: [], 1: []}
    for i in range(40):
        out[SHARDS.shard(f"acme/e{i}")].append(f"e{i}")
    return out


def test_every_worker_serves_every_users_shard(server: Supervised) -> None:
    by_shard = _users()
    users = by_shard[0][:3] + by_shard[1][:3]
    body = {"pages": [{"user_id": u, "user_input": f"{u} plays the cello"} for u in users]}
    r = httpx.post(f"{server.base}/v1/pages", json=body, headers=HA, timeout=30)
    assert r.status_code == 201, r.text
    assert [x["user_id"] for x in r.json()["results"]] == users
    for u in users:
        for _ in range(4):  # a fresh connection each time: either worker answers
            got = httpx.post(
                f"{server.base}/v1/users/{u}/retrieve",
                json={"query": "cello"},
                headers=HA,
                timeout=30,
            ).json()
            assert got["known_user"] and [p["user_input"] for p in got["stm"]] == [
                f"{u} plays the cello"
            ]
    listed = httpx.get(f"{server.base}/v1/users", headers=HA, timeout=30).json()["users"]
    assert set(users) <= set(listed)
    # mem0's memory ids are page ids, unique per shard only: every verb refused, saying why
    # (adding too: nothing written that the other verbs could not read back)
    for path, body in [
        ("search", {"query": "cello", "user_id": users[0]}),
        ("memories", {"messages": "I play the harp", "user_id": users[0]}),
    ]:
        r = httpx.post(f"{server.base}/v1/mem0/{path}", json=body, headers=HA)
        assert r.status_code == 501 and "--engines" in r.json()["detail"], path
    assert (server.store / "shard-0").is_dir() and (server.store / "shard-1").is_dir()


def test_a_killed_engine_fails_only_its_own_users(server: Supervised) -> None:
    by_shard = _users()
    mine, other = by_shard[1][5], by_shard[0][5]
    for u in (mine, other):
        r = httpx.post(
            f"{server.base}/v1/users/{u}/pages",
            json={"user_input": f"{u} keeps bees"},
            headers=HA,
            timeout=30,
        )
        assert r.status_code == 201, r.text
    victim = server.pids("engine process 1")[-1]
    os.kill(victim, signal.SIGKILL)

    def ask(u: str) -> httpx.Response:
        return httpx.post(
            f"{server.base}/v1/users/{u}/retrieve",
            json={"query": "bees"},
            headers=HA,
            timeout=30,
        )

    deadline = time.monotonic() + 10
    while (r := ask(mine)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text
    assert ask(other).status_code == 200  # the other shard's users are served meanwhile
    deadline = time.monotonic() + 120
    while (r := ask(mine)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    assert [p["user_input"] for p in r.json()["stm"]] == [f"{mine} keeps bees"]
    assert len(server.pids("engine process 1")) == 2


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--engines", "2", "--workers", "0"], "needs --workers >= 1"),
        (["--engines", "3", "--workers", "1"], "holds 2 shards"),
        (["--engines", "1", "--workers", "1"], "holds 2 shards"),
        (["--engines", "2", "--ray"], "--ray has its own router"),
    ],
)
def test_engines_are_refused_where_they_cannot_work(
    tmp_path: Path, args: list[str], says: str
) -> None:
    store = tmp_path / "store"
    prepare_layout(str(store), 2)
    out = subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", "serve", "--store", str(store), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert says in out.stderr


def test_a_store_ingested_by_workers_is_served_by_as_many_engines(tmp_path: Path) -> None:
    """Bulk ingestion sharded two ways, then ``serve`` on that store with no --engines: two
    engine processes, every ingested user served from its shard (the layout is the same)."""
    from memoryos_gpu.ingest import shard_of
    from tests.served import free_port
    from tests.test_cli import _env, cli, write_synthetic

    src, store = tmp_path / "in.jsonl", tmp_path / "store"
    write_synthetic(src, users=20, per_user=2)
    assert cli("ingest", src, "--store", store, "--workers", "2").returncode == 0
    port = free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "memoryos_gpu", "serve", "--store", str(store)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*command, "--workers", "1", "--port", str(port)],
            cwd=ROOT,
            env=_env(None, True),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        users = httpx.get(f"{base}/v1/users", timeout=30).json()["users"]
        assert len(users) == 20
        stats = httpx.get(f"{base}/v1/stats", timeout=30).json()["engine"]
        assert stats["shard_count"] == 2
        assert [s["users"] for s in stats["shards"]] == [
            sum(shard_of(u, 2) == i for u in users) for i in (0, 1)
        ]
        got = httpx.post(
            f"{base}/v1/users/user-0003/retrieve", json={"query": "topic"}, timeout=30
        ).json()
        assert got["known_user"] and {p["user_input"] for p in got["stm"]} == {
            "note 0 from user 3: topic 0 and item 0",
            "note 1 from user 3: topic 1 and item 3",
        }
        assert "1 HTTP worker(s) in front of 2 engine process(es)" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)


def test_sigterm_drains_every_engine_and_keeps_every_write(tmp_path: Path) -> None:
    """SIGTERM stops the workers, then both engine processes: the server exits 0 (no process
    had to be killed) and the sharded store, read back by the CLI, holds every page the server
    acknowledged, users of both shards."""
    from tests.test_cli import cli

    s = Supervised(tmp_path / "store", tmp_path / "server.log", workers=1, engines=2, **UNLIMITED)
    try:
        s.wait_ready()
        users = _users()[0][:4] + _users()[1][:4]
        for u in users:
            r = httpx.post(
                f"{s.base}/v1/users/{u}/pages",
                json={"user_input": f"{u} grows tomatoes", "source": f"{u}:1"},
                headers=HA,
                timeout=30,
            )
            assert r.status_code == 201, r.text
    finally:
        code = s.stop()
    assert code == 0, s.log.read_text()[-3000:]
    stats = cli("stats", "--store", tmp_path / "store", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["pages"] == len(users)

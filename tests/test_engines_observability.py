"""``serve --engines K``: ``/metrics`` and ``/v1/stats`` as an operator reads them.

1. ``memoryos_engine_events_total`` summed the shards into one series with no ``shard``
   label: when one engine process restarted, the sum fell part way, and Prometheus's
   ``rate()``/``increase()`` took the drop for a reset to 0 and counted a false increase of
   the other shards' whole total. Now each engine process has its own series (``shard``, as
   ``memoryos_queue_depth``), which resets only with its own engine; a single engine's series
   keeps no ``shard`` label.
2. ``/v1/stats`` changed shape: ``server.batching`` was per shard only, and ``engine`` lacked
   ``store``, ``views``, ``retrieval``, ``llm``, ``embedder``, ``native`` and ``preset``. Now
   it has the single engine's shape, summed over the shards, each shard's own figures under
   ``server.shards`` and ``engine.shards``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("uvicorn")

from memoryos_gpu.distributed.layout import ShardMap
from tests.served import HA, HADMIN, hashing, serve
from tests.test_serve_workers import UNLIMITED, Supervised

SHARDS = ShardMap(2)
EVENT = re.compile(r"^memoryos_engine_events_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$", re.M)


def _events(text: str, event: str) -> dict[str, float]:
    """``{shard label (None: no label): value}`` of one event's series."""
    out: dict[str, float] = {}
    for m in EVENT.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if labels.get("event") == event:
            out[labels.get("shard")] = float(m["value"])  # type: ignore[index]
    return out


def _scrape(base: str) -> str:
    r = httpx.get(f"{base}/metrics", headers=HADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    d = tmp_path_factory.mktemp("observed")
    s = Supervised(d / "store", d / "server.log", workers=1, engines=2, **UNLIMITED)
    try:
        s.wait_ready()
        users = {0: [], 1: []}  # type: dict[int, list[str]]
        for i in range(40):
            users[SHARDS.shard(f"acme/o{i}")].append(f"o{i}")
        # 3 pages on shard 0, 2 on shard 1
        pages = [{"user_id": u, "user_input": f"{u} grows tomatoes"} for u in users[0][:3]]
        pages += [{"user_id": u, "user_input": f"{u} grows basil"} for u in users[1][:2]]
        r = httpx.post(f"{s.base}/v1/pages", json={"pages": pages}, headers=HA, timeout=30)
        assert r.status_code == 201, r.text
        yield s
    finally:
        s.stop()


def test_stats_have_the_single_engines_shape(server: Supervised) -> None:
    r = httpx.get(f"{server.base}/v1/stats", headers=HADMIN, timeout=30)
    assert r.status_code == 200, r.text
    got = r.json()
    batching = got["server"]["batching"]
    assert set(batching) == {"retrieve", "write", "respond"}, batching
    assert batching["write"]["items"] == 5 and batching["write"]["batches"] == 2
    assert batching["write"]["mean_batch"] == 2.5
    shards = got["server"]["shards"]
    assert [s["shard"] for s in shards] == [0, 1]
    assert [s["batching"]["write"]["items"] for s in shards] == [3, 2]
    assert all(s["state"] == "ready" and s["degraded"] == [] for s in shards)
    engine = got["engine"]
    for key in ("store", "views", "retrieval", "llm", "embedder", "native", "preset", "counters"):
        assert key in engine, sorted(engine)
    assert engine["store"]["pages_stm"] == 5 and engine["users"] == 5
    assert engine["counters"]["pages_added"] == 5
    assert [s["store"]["pages_stm"] for s in engine["shards"]] == [3, 2]
    assert engine["shard_count"] == 2


def test_engine_counters_are_per_engine_and_reset_only_with_their_engine(
    server: Supervised,
) -> None:
    before = _events(_scrape(server.base), "pages_added")
    assert before == {"0": 3.0, "1": 2.0}, before  # no summed series without a shard label
    victim = server.pids("engine process 1")[-1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while True:  # back once the new engine process serves (its counters start at 0)
        restarted = len(server.pids("engine process 1")) == 2
        ready = httpx.get(f"{server.base}/ready", timeout=10).status_code == 200
        after = _events(_scrape(server.base), "pages_added")
        if restarted and ready and "1" in after:
            break
        assert time.monotonic() < deadline, (after, server.log.read_text()[-2000:])
        time.sleep(0.1)
    assert after == {"0": 3.0, "1": 0.0}, after  # shard 0's series did not move


def test_a_single_engine_keeps_its_series_without_a_shard_label() -> None:
    with serve(hashing(), keys=None) as c:
        assert c.post("/v1/users/u1/pages", json={"user_input": "hi"}).status_code == 201
        text = c.get("/metrics").text
    assert _events(text, "pages_added") == {None: 1.0}
    assert 'memoryos_engine_events_total{event="pages_added"} 1.0' in text

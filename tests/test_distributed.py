"""Scale-out (memoryos_gpu.distributed): users sharded over engines.

Without Ray: a ShardedEngine gives the same pages, segments, knowledge and retrievals as one
MemoryEngine fed the same calls; assistant knowledge is the same on every shard. With local Ray
(``ray.init(num_cpus=2)``; skipped when Ray is not installed): bulk ingestion on Ray Data equals
the single-process ingestion, a shard actor killed mid-ingest loses nothing acknowledged, shards
are isolated, and the Ray Serve app answers the single-box HTTP API with its auth.

SQLite (one file per shard) always; PostgreSQL too when ``MEMORYOS_GPU_TEST_PG_URL`` is set
(``eval "$(bash scripts/pg_test_server.sh start)"``).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.distributed.layout import ShardMap, prepare_layout, shard_store
from memoryos_gpu.distributed.sharding import ShardedEngine
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.errors import UnknownUserError
from memoryos_gpu.llm.scripted import ScriptedBackend

PG_URL = os.environ.get("MEMORYOS_GPU_TEST_PG_URL")
BACKENDS = ["sqlite", *(["postgres"] if PG_URL else [])]

TOPICS = [
    "I love hiking in the Alps with my dog Rex every summer",
    "My sister Anna moved to Lisbon and works as a nurse there",
    "I am learning to play the cello, lessons are on Tuesday",
    "We adopted a cat named Miso from the shelter in March",
    "I started a new job at the bakery on Elm street last week",
    "My favourite book is Dune, I reread it every winter",
]
REPLIES = [
    "Rex must love the mountains.",
    "Lisbon is a great city for nurses.",
    "The cello takes patience.",
    "Miso is a cute name for a cat.",
    "Bakery mornings start early.",
    "Dune is a classic.",
]


def memory_config(**kw: Any) -> Any:
    # small STM and a low promotion threshold: chains, segments, evictions and promotions all
    # happen within a few dozen pages
    return preset("paper", stm_capacity=3, mtm_capacity=3, tau=2.5, **kw)


def engine_config(store: str, mode: str = "extractive", **kw: Any) -> EngineConfig:
    return EngineConfig(
        memory=memory_config(),
        llm=LLMConfig(mode=mode, backend="scripted"),
        embedder="hashing",
        device="cpu",
        store=store,
        **kw,
    )


def conversation(users: int, per_user: int, prefix: str = "user") -> list[dict[str, Any]]:
    """Interleaved pages of ``users`` users, topics drifting so segments split and merge."""
    rows = []
    for j in range(per_user):
        for u in range(users):
            k = (j // 3 + u) % len(TOPICS)
            rows.append(
                {
                    "user_id": f"{prefix}-{u}",
                    "user_input": f"{TOPICS[k]}. Note {j} from {prefix} {u}.",
                    "agent_response": REPLIES[k],
                    "timestamp": 1_700_000_000 + 3600 * j + u,
                    "assistant_id": f"asst-{u % 2}",
                    "source": f"{prefix}-{u}:{j}",
                }
            )
    return rows


QUERIES = ["hiking with the dog", "where does Anna live", "cello lessons", "new job bakery"]


def store_for(backend: str, tmp_path: Path) -> str:
    if backend == "sqlite":
        return str(tmp_path / f"store-{uuid.uuid4().hex[:6]}")
    return _fresh_pg_url()


def _fresh_pg_url() -> str:
    """A new, empty database on the test server (shards of one test share it)."""
    import psycopg

    name = f"mos_dist_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = PG_URL.rpartition("/")
    return f"{base}/{name}"


# ------------------------------------------------------------------------------ snapshots
def user_snapshot(data: dict[str, Any]) -> dict[str, Any]:
    """A user's export with store-specific ids replaced by what they point at."""
    seq_of = {p["page_id"]: p["seq"] for p in data["pages"]}
    slot_of = {s["segment_id"]: s["slot"] for s in data["segments"]}
    pages = [
        (
            p["seq"],
            p["user_input"],
            p["tier"],
            slot_of.get(p["segment_id"]),
            seq_of.get(p["prev_page"]),
            seq_of.get(p["next_page"]),
            p["meta"],
            p["summary"],
            json.dumps(p["keywords"]),
            p["analysed"],
            p["source"],
        )
        for p in data["pages"]
    ]
    segments = [
        (
            s["slot"],
            s["summary"],
            json.dumps(s["keywords"], sort_keys=True),
            s["n_visit"],
            s["l_interaction"],
            s["n_pages"],
        )
        for s in data["segments"]
    ]
    knowledge = [(k["seq"], k["text"], k["live"]) for k in data["user_knowledge"]]
    return {
        "pages": pages,
        "segments": segments,
        "knowledge": knowledge,
        "profile": data["user"]["profile"],
        "assistant": sorted(k["text"] for k in data["assistant_knowledge"]),
    }


def retrieval_snapshot(r: Any, seq_of: dict[int, int]) -> tuple:
    return (
        r.user_id,
        [seq_of[p.page_id] for p in r.stm],
        # pages of equal score come in pool-slot order, which follows the arena's layout (slots
        # freed by an eviction are reused), not the pages: compare ties in page order
        sorted(
            ((seq_of[p.page_id], round(p.score, 5)) for p in r.pages), key=lambda x: (-x[1], x[0])
        ),
        r.profile,
        [(k.text, round(k.score, 5)) for k in r.user_knowledge],
        sorted(k.text for k in r.assistant_knowledge),
        r.retrieval_tokens,
    )


def seq_map(engine: Any, users: list[str]) -> dict[tuple[str, int], int]:
    out = {}
    for u in users:
        for p in engine.export_user(u)["pages"]:
            out[(u, p["page_id"])] = p["seq"]
    return out


def retrievals(engine: Any, users: list[str]) -> list[tuple]:
    ids = seq_map(engine, users)
    queries = [(u, q) for u in users for q in QUERIES]
    res = engine.retrieve_many(queries)
    return [
        retrieval_snapshot(r, {pid: s for (u, pid), s in ids.items() if u == r.user_id})
        for r in res
    ]


def feed(engine: Any, rows: list[dict[str, Any]], batch: int = 16) -> None:
    for i in range(0, len(rows), batch):
        engine.add_many(rows[i : i + batch])


# ------------------------------------------------------------------------------ no Ray
def test_shard_map_and_layout(tmp_path):
    m = ShardMap(2)
    assert {m.shard(f"u{i}") for i in range(50)} == {0, 1}
    assert m.group(["u0", "u1", "u0"]) == {0: [0, 2], 1: [1]}
    store = str(tmp_path / "s")
    prepare_layout(store, 2)
    assert json.loads((tmp_path / "s" / "shards.json").read_text())["count"] == 2
    assert shard_store(store, 1, 2).endswith("shard-1")
    with pytest.raises(ValueError, match="holds 2 shards"):
        prepare_layout(store, 3)
    with pytest.raises(ValueError, match="single SQLite file"):
        prepare_layout(str(tmp_path / "x.sqlite3"), 2)
    assert shard_store("postgresql://h/db", 1, 2) == "postgresql://h/db"


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_engine_equals_one_engine(backend, tmp_path):
    rows = conversation(users=8, per_user=14)
    users = sorted({r["user_id"] for r in rows})
    single = MemoryEngine(engine_config(str(tmp_path / "single")))
    sharded = ShardedEngine(engine_config(store_for(backend, tmp_path)), shards=2)
    try:
        assert {sharded.shard_map.shard(u) for u in users} == {0, 1}
        feed(single, rows)
        feed(sharded, rows)
        for u in users:
            assert user_snapshot(sharded.export_user(u)) == user_snapshot(single.export_user(u))
        assert sharded.stats()["counters"]["promotions"] == single.counters["promotions"] > 0
        assert (
            sharded.stats()["counters"]["segments_evicted"] == single.counters["segments_evicted"]
        )
        assert retrievals(sharded, users) == retrievals(single, users)
        # heat fed back by those retrievals: still equal after a second round
        assert retrievals(sharded, users) == retrievals(single, users)
        # idempotent: re-adding the same sources adds nothing on either
        feed(sharded, rows)
        assert sum(len(sharded.export_user(u)["pages"]) for u in users) == len(rows)
    finally:
        single.close()
        sharded.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_engine_reopens_and_isolates(backend, tmp_path):
    store = store_for(backend, tmp_path)
    rows = conversation(users=6, per_user=6)
    with ShardedEngine(engine_config(store), shards=2) as eng:
        feed(eng, rows)
        before = {u: user_snapshot(eng.export_user(u)) for u in eng.users()}
        per_shard = [set(e.users()) for e in eng.engines]
    assert per_shard[0] and per_shard[1] and not per_shard[0] & per_shard[1]
    with ShardedEngine(engine_config(store), shards=2) as eng:
        assert [set(e.users()) for e in eng.engines] == per_shard
        assert {u: user_snapshot(eng.export_user(u)) for u in eng.users()} == before
        victim = sorted(per_shard[0])[0]
        other = eng.engines[1]
        with pytest.raises(UnknownUserError):
            other.retrieve(victim, "hiking")  # a user lives on one shard only
        assert eng.delete_user(victim)
        assert victim not in eng.users()
        with pytest.raises(UnknownUserError):
            eng.retrieve_many([(sorted(per_shard[1])[0], "x"), (victim, "x")])
        assert len(eng.users()) == len(before) - 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shard_without_segments_reopens(backend, tmp_path):
    """One shard's users have MTM segments, the other shard's none yet: on a shared store the
    second shard's view of a chunk of MTM pages is empty, which was read as "an MTM page names
    a missing segment; the store is corrupt" (every sharded open, ``serve --ray`` and a resumed
    ``ingest --ray`` failed until a shard got a segment)."""
    from memoryos_gpu.ingest import shard_of

    store = store_for(backend, tmp_path)
    a = next(f"u{i}" for i in range(100) if shard_of(f"u{i}", 2) == 0)
    b = next(f"u{i}" for i in range(100) if shard_of(f"u{i}", 2) == 1)
    with ShardedEngine(engine_config(store), shards=2) as eng:
        for i in range(12):  # past the STM: segments for a
            eng.add(a, f"I went hiking on trail {i} near the lake", "Nice hike.")
        eng.add(b, "hello there", "hi")  # b: one page, still in STM
        eng.flush()
        segments = [len(eng.export_user(u)["segments"]) for u in (a, b)]
    assert segments[0] > 0 and segments[1] == 0
    with ShardedEngine(engine_config(store), shards=2) as eng:
        assert [len(eng.export_user(u)["segments"]) for u in (a, b)] == segments
        assert eng.retrieve(a, "hiking").all_pages()


def _assistant_script(req: Any) -> Any:
    """A scripted LLM whose promotions find one assistant fact per promoted segment."""
    content = req.messages[-1]["content"]
    if req.stage == "page":
        return {"continuous": False, "meta": "m", "summary": "s", "keywords": []}
    if req.stage == "promotion":
        user = content.split("Note ")[-1].split(".")[0] if "Note " in content else "?"
        pages = content.split("New pages:")[-1]  # not the known facts: a shard's may lag
        return {
            "profile_updates": {},
            "user_facts": [],
            "assistant_facts": [f"the assistant helped with note {user} ({len(pages)})"],
        }
    return "ok"


@pytest.mark.parametrize("backend", BACKENDS)
def test_assistant_knowledge_is_the_same_on_every_shard(backend, tmp_path):
    rows = conversation(users=6, per_user=10)
    cfg = engine_config(store_for(backend, tmp_path), mode="llm")
    single = MemoryEngine(
        engine_config(str(tmp_path / "one"), mode="llm"), llm=ScriptedBackend(_assistant_script)
    )
    sharded = ShardedEngine(cfg, shards=2, llm=ScriptedBackend(_assistant_script))
    try:
        feed(single, rows)
        feed(sharded, rows)
        users = sorted({r["user_id"] for r in rows})
        for aid in ("asst-0", "asst-1"):
            mine = [u for u in users if int(u.split("-")[1]) % 2 == int(aid[-1])]
            shards = {sharded.shard_map.shard(u) for u in mine}
            assert shards == {0, 1}, "the test needs an assistant's users on both shards"
            seen = {
                u: [(k["seq"], k["text"]) for k in sharded.knowledge(u)["assistant"]] for u in mine
            }
            first = next(iter(seen.values()))
            assert first and all(v == first for v in seen.values())  # one ring, every shard
            expected = sorted(k["text"] for k in single.knowledge(mine[0])["assistant"])
            assert sorted(t for _, t in first) == expected
            # retrieval reads the local replica: the same entries from users on both shards
            res = sharded.retrieve_many([(u, "note") for u in mine], update_heat=False)
            got = {tuple(sorted(k.text for k in r.assistant_knowledge)) for r in res}
            assert len(got) == 1 and next(iter(got))
    finally:
        single.close()
        sharded.close()
    # the replicas survive a restart
    with ShardedEngine(cfg, shards=2, llm=ScriptedBackend(_assistant_script)) as again:
        mine = [u for u in users if int(u.split("-")[1]) % 2 == 0]
        rings = {
            again.shard_map.shard(u): [
                (k["seq"], k["text"]) for k in again.knowledge(u)["assistant"]
            ]
            for u in mine
        }
        assert rings[0] == rings[1] and rings[0]


# ------------------------------------------------------------------------------ local Ray
@pytest.fixture(scope="module")
def ray_local(ray_local):
    """conftest's local Ray, for the tests here that also need Ray Data (ingest_ray)."""
    pytest.importorskip("ray.data", reason="Ray Data is not installed")
    return ray_local


def write_input(path: Path, rows: list[dict[str, Any]]) -> Path:
    lines = [json.dumps(r) for r in rows]
    lines.insert(len(lines) // 2, "{not json")  # a read-stage reject
    bad = {**rows[0], "user_input": 5, "source": "bad-type"}  # refused by the reader
    lines.insert(3, json.dumps(bad))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def reject_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ray_ingest_equals_single_process(ray_local, backend, tmp_path):
    from memoryos_gpu.distributed.ray_ingest import ingest_ray
    from memoryos_gpu.ingest import ingest

    rows = conversation(users=8, per_user=12)
    src = write_input(tmp_path / "chats.jsonl", rows)
    users = sorted({r["user_id"] for r in rows})
    one = MemoryEngine(engine_config(str(tmp_path / "one"), auto_process=False))
    rep1 = ingest(
        [src],
        one,
        batch_size=16,
        process="defer",
        rejects_path=tmp_path / "r1.jsonl",
        progress=False,
    )
    one.flush()
    store = store_for(backend, tmp_path)
    rep2 = ingest_ray(
        [src],
        engine_config(store),
        2,
        batch_size=16,
        rejects_path=tmp_path / "r2.jsonl",
        window=50,
    )
    for key in ("accepted", "skipped", "rejected", "users", "reject_reasons", "exit_code"):
        assert rep2[key] == rep1.to_dict()[key], key
    assert reject_rows(tmp_path / "r2.jsonl") == reject_rows(tmp_path / "r1.jsonl")
    assert rep2["pending"] == 0 and rep2["accepted"] == len(rows)
    with ShardedEngine(engine_config(store), shards=2) as sharded:
        for i, e in enumerate(sharded.engines):  # isolation: a shard holds its users only
            assert e.users() and all(sharded.shard_map.shard(u) == i for u in e.users())
        for u in users:
            assert user_snapshot(sharded.export_user(u)) == user_snapshot(one.export_user(u))
        assert retrievals(sharded, users) == retrievals(one, users)
    one.close()
    again = ingest_ray([src], engine_config(store), 2, batch_size=16)  # idempotent
    assert (again["accepted"], again["skipped"]) == (0, len(rows))


def test_killed_shard_actor_restarts_and_loses_nothing(ray_local, tmp_path):
    import threading

    from memoryos_gpu.distributed.ray_ingest import actor_name, ingest_ray

    ray = ray_local
    rows = conversation(users=24, per_user=10, prefix="k")
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    store = str(tmp_path / "store")
    run = f"kill{uuid.uuid4().hex[:6]}"
    pids: list[int] = []

    def on_window(n: int, report: Any) -> None:
        actor = ray.get_actor(actor_name(run, 0))
        pids.append(ray.get(actor.info.remote())["pid"])
        if n == 0:  # kill shard 0 while the next window's chunks are on their way to it
            threading.Timer(0.5, lambda: ray.kill(actor, no_restart=False)).start()

    rep = ingest_ray(
        [src],
        engine_config(store),
        2,
        batch_size=10,
        window=60,
        run_id=run,
        on_window=on_window,
    )
    assert len(set(pids)) > 1, "shard 0 was not restarted"
    assert (rep["accepted"], rep["skipped"], rep["rejected"]) == (len(rows), 0, 0)
    with ShardedEngine(engine_config(store), shards=2) as eng:
        sources = [p["source"] for u in eng.users() for p in eng.export_user(u)["pages"]]
        assert len(sources) == len(set(sources)) == len(rows)  # every page exactly once
        assert eng.pending_count() == 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_serve(serve: Any, attempts: int = 3) -> int:
    """Start Ray Serve's HTTP proxy on a free port; returns the port. Ray waits a hard-coded
    60 s for the proxy actor, which a 2-core machine under load can exceed: retry then."""
    import ray

    for attempt in range(attempts):
        port = _free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except (ray.exceptions.RayError, TimeoutError):
            serve.shutdown()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _pages_added_by_shard(c: Any, admin: dict[str, str], total: int) -> dict[str, float]:
    """``memoryos_engine_events_total{event="pages_added"}`` by ``shard`` from ``/metrics``,
    once the router's refresh (every sync) has the shards' counts of ``total`` pages."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    added: dict[str, float] = {}
    for _ in range(60):
        text = c.get("/metrics", headers=admin).text
        added = {
            s.labels.get("shard", ""): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "memoryos_engine_events_total" and s.labels["event"] == "pages_added"
        }
        if sum(added.values()) >= total:
            break
        time.sleep(0.5)
    return added


def test_serve_app_answers_the_http_api_with_auth(ray_local, tmp_path):
    import httpx

    pytest.importorskip("ray.serve", reason="Ray Serve is not installed")
    from ray import serve

    from memoryos_gpu.distributed.ray_serve import APP_NAME, build_app

    port = _start_serve(serve)
    app = build_app(
        engine_config(str(tmp_path / "store")),
        2,
        api_keys={"key-aaaa-1111": "acme", "key-bbbb-2222": "globex", "key-admin-333": "*"},
        sync_interval_s=0.5,
    )
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        a = {"Authorization": "Bearer key-aaaa-1111"}
        b = {"Authorization": "Bearer key-bbbb-2222"}
        with httpx.Client(base_url=base, timeout=60) as c:
            assert c.get("/health").json() == {"status": "ok"}
            for _ in range(60):  # the router answers 503 until every shard has loaded
                if c.get("/ready").status_code == 200:
                    break
                import time

                time.sleep(0.5)
            assert c.post("/v1/pages", json={"pages": []}).status_code == 401
            assert c.get("/v1/users", headers={"Authorization": "Bearer nope"}).status_code == 401
            rows = conversation(users=6, per_user=4)
            pages = [{k: v for k, v in r.items() if k != "source"} for r in rows]
            r = c.post("/v1/pages", json={"pages": pages}, headers=a)
            assert r.status_code == 201, r.text
            res = r.json()["results"]
            assert [x["user_id"] for x in res] == [p["user_id"] for p in pages]  # request order
            users = sorted({p["user_id"] for p in pages})
            assert {ShardMap(2).shard(f"acme/{u}") for u in users} == {0, 1}
            assert sorted(c.get("/v1/users", headers=a).json()["users"]) == users
            assert c.get("/v1/users", headers=b).json()["users"] == []  # tenants are apart
            for u in users:
                w = c.post(f"/v1/users/{u}/wait", headers=a).json()
                assert w["done"], w
                got = c.post(f"/v1/users/{u}/retrieve", json={"query": "hiking"}, headers=a)
                body = got.json()
                assert got.status_code == 200 and body["known_user"], body
                assert len(body["stm"]) + len(body["pages"]) > 0
                assert all(p["page_id"] for p in body["stm"])
                other = c.post(f"/v1/users/{u}/retrieve", json={"query": "x"}, headers=b).json()
                assert other["known_user"] is False and other["stm"] == []
            page_id = res[0]["page_id"]
            u0 = res[0]["user_id"]
            assert c.get(f"/v1/users/{u0}/pages/{page_id}", headers=a).json()["page_id"] == page_id
            assert c.get(f"/v1/users/{u0}/export", headers=a).json()["user"]["user_id"] == u0
            assert c.get("/v1/stats", headers=a).json() == {"tenant": "acme", "users": len(users)}
            admin = {"Authorization": "Bearer key-admin-333"}
            added = _pages_added_by_shard(c, admin, len(pages))
            assert set(added) == {"0", "1"} and sum(added.values()) == len(pages), added
            stats = c.get("/v1/stats", headers=admin).json()
            assert stats["engine"]["shard_count"] == 2 and stats["users"] == len(users)
            shards = stats["server"]["shards"]  # each shard's state and health, as --engines
            assert [(s["shard"], s["state"], s["degraded"]) for s in shards] == [
                (0, "ready", []),
                (1, "ready", []),
            ], shards
            url = f"/v1/users/{u0}/pages/{page_id}"  # page changes: the router, every shard
            edited = c.patch(url, json={"user_input": "I sail in Oslo now."}, headers=a)
            assert edited.status_code == 200, edited.text
            assert edited.json()["user_input"] == "I sail in Oslo now."
            assert c.delete(url, headers=a).json() == {"deleted": True}
            assert c.get(url, headers=a).status_code == 404
            assert c.delete(f"/v1/users/{u0}", headers=a).json() == {"deleted": True}
            assert c.get(f"/v1/users/{u0}/history", headers=a).status_code == 404
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()


def test_ray_missing_says_how_to_install(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from memoryos_gpu.cli import cli
    from memoryos_gpu.distributed.ray_common import RayUnavailableError, require_ray

    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(RayUnavailableError, match=r"pip install 'memoryos-gpu\[ray\]'"):
        require_ray()
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps(conversation(1, 1)[0]) + "\n")
    res = CliRunner().invoke(
        cli, ["ingest", str(src), "--ray", "--store", str(tmp_path / "s"), "--no-progress"]
    )
    assert res.exit_code == 1 and "memoryos-gpu[ray]" in res.output


def test_cli_ingest_ray_then_retrieve(ray_local, tmp_path):
    from click.testing import CliRunner

    from memoryos_gpu.cli import cli

    src = tmp_path / "chats.jsonl"
    rows = conversation(users=4, per_user=5)
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    store = str(tmp_path / "store")
    env = {"MEMORYOS_GPU_EMBEDDER": "hashing"}
    args = ["ingest", str(src), "--ray", "--shards", "2", "--store", store, "--json"]
    res = CliRunner().invoke(cli, [*args, "--no-progress"], env=env)
    assert res.exit_code == 0, res.output
    report = json.loads(res.output.strip().splitlines()[-1])
    assert report["accepted"] == len(rows) and len(report["shards"]) == 2
    assert json.loads((tmp_path / "store" / "shards.json").read_text())["count"] == 2
    res = CliRunner().invoke(
        cli, ["retrieve", "hiking", "--user", "user-1", "--store", store, "--json"], env=env
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["user_id"] == "user-1"


# ====================================================================== router membership (no Ray)
class _Remote:
    """``handle.method.remote(...)`` of a Ray Serve handle, as a coroutine."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _GatedShard:
    """A shard whose status answer is taken when asked but delivered only once ``gate`` opens,
    so a delete can overtake it (what the Ray router's sync loop meets under load)."""

    def __init__(self, users: set[str]) -> None:
        import asyncio

        self.users = set(users)
        self.gate = asyncio.Event()
        self.status = _Remote(self._status)
        self.delete_user = _Remote(self._delete)
        self.call = _Remote(self._call)  # the other shards' side of a delete: nothing held

    async def _status(self) -> dict[str, Any]:
        snapshot = sorted(self.users)
        await self.gate.wait()
        return {"shard": 0, "users": snapshot, "pending": 0, "derived_runs": 0, "batching": {}}

    async def _call(self, name: str, args: tuple, kw: dict) -> Any:
        if name == "forget_learned_from":
            return {"entries": [], "elsewhere": []}
        return {"n_docs": 0, "df": {}} if name == "user_keyword_delta" else 0

    async def _delete(self, user_id: str) -> bool:
        found = user_id in self.users
        self.users.discard(user_id)
        return found


def test_router_refresh_keeps_a_user_deleted_while_it_ran_deleted() -> None:
    import asyncio

    from memoryos_gpu.distributed.ray_serve import RouterService

    async def scenario() -> tuple[bool, bool]:
        shard = _GatedShard({"alice", "bob"})
        router = RouterService([shard], EngineConfig(embedder="hashing"))
        router.state = "ready"
        await asyncio.wait_for(asyncio.gather(router.refresh(), _open(shard)), 5)
        assert router.known_users() == ["alice", "bob"]
        shard.gate.clear()
        refresh = asyncio.create_task(router.refresh())  # takes the list with alice in it
        await asyncio.sleep(0.01)
        assert await router.delete_user("alice") is True
        shard.gate.set()
        await refresh
        return router.is_known("alice"), router.is_known("bob")

    async def _open(shard: _GatedShard) -> None:
        shard.gate.set()

    assert asyncio.run(scenario()) == (False, True)

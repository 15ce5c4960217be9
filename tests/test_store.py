"""The durable store behind the engine: every tier round-trips through SQLite, a reopened engine
equals the one that was closed, concurrent writers, export / delete, bad input, schema
versions and forward migrations.

Engines here use the hashing embedder, the CPU arena and tiny memory settings (STM 3, MTM 5
segments, tau 2, knowledge rings of 6) so that every tier fills, segments get evicted and the
knowledge FIFOs wrap within a few dozen LoCoMo pages. Knowledge and profile come from LLM mode
with a deterministic scripted backend.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sqlite3
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from store_backends import Backend, make_backend

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.embed import HashingEmbedder
from memoryos_gpu.engine import InvalidInputError, MemoryEngine
from memoryos_gpu.errors import UnknownUserError
from memoryos_gpu.eval.locomo import default_locomo_path
from memoryos_gpu.formats import Record, read_records
from memoryos_gpu.llm.base import ChatRequest
from memoryos_gpu.llm.scripted import ScriptedBackend
from memoryos_gpu.profile_dims import DIMENSION_KEYS
from memoryos_gpu.store import sqlite as sqlite_mod
from memoryos_gpu.store import sqlite_schema
from memoryos_gpu.store.errors import StoreError, StoreFullError
from memoryos_gpu.store.rows import emb_blob, kw_matrix
from memoryos_gpu.store.sqlite import SQLiteStore
from memoryos_gpu.text.keywords import KeywordExtractor
from memoryos_gpu.types import PageInput

LOCOMO = default_locomo_path()
TOPICS = ["adoption", "painting", "dance", "camping", "school", "music", "career", "family"]
USERS = ("conv-26", "conv-30")


# ============================================================================ helpers
@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The backend-agnostic tests run on both stores: a SQLite file, and a fresh schema of the
    PostgreSQL test server (skipped without one, see tests/store_backends.py)."""
    b = make_backend(request.param, tmp_path_factory.mktemp(request.param))
    yield b
    b.cleanup()


@functools.lru_cache(maxsize=1)
def _locomo_records() -> tuple[Record, ...]:
    if not LOCOMO.exists():
        pytest.skip(f"{LOCOMO} is not available")
    return tuple(r for r in read_records(LOCOMO) if isinstance(r, Record))


def locomo_pages(users: tuple[str, ...] = USERS, per_user: int = 36) -> list[dict[str, Any]]:
    """LoCoMo pages of ``users``, interleaved (u1 p0, u2 p0, u1 p1, ...), with real sources."""
    by: dict[str, list[dict[str, Any]]] = {u: [] for u in users}
    for r in _locomo_records():
        if r.user_id in by and len(by[r.user_id]) < per_user:
            by[r.user_id].append(r.to_page())
    return [by[u][i] for i in range(per_user) for u in users]


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def responder(req: ChatRequest) -> Any:
    """Deterministic fused-stage answers: 8 topics (so 5 segment slots overflow), chains that
    sometimes continue, one profile update and one fact per side on every promotion."""
    content = req.messages[-1]["content"]
    h = _h(content)
    if req.stage == "page":
        topic = TOPICS[h % len(TOPICS)]
        return {
            "continuous": h % 3 != 0,
            "meta": f"thread about {topic} {h % 101}",
            "summary": f"{topic} {topic[::-1]}",
            "keywords": [topic],
        }
    if req.stage == "promotion":
        return {
            "profile_updates": {DIMENSION_KEYS[h % 6]: f"High: evidence {h % 1000}"},
            "user_facts": [f"The user fact {h % 100003}"],
            "assistant_facts": [f"The assistant fact {h % 100019}"],
        }
    return "scripted reply"


def config(path: Path | str, *, auto_process: bool = True, mode: str = "llm") -> EngineConfig:
    return EngineConfig(
        store=str(path),
        embedder="hashing",
        device="cpu",
        auto_process=auto_process,
        memory=preset("paper", stm_capacity=3, mtm_capacity=5, tau=2.0, knowledge_capacity=6),
        llm=LLMConfig(mode=mode, backend="scripted"),
    )


def open_engine(path: Path | str, **kw: Any) -> MemoryEngine:
    cfg = config(path, **kw)
    llm = ScriptedBackend(responder) if cfg.llm.mode == "llm" else None
    return MemoryEngine(cfg, llm=llm)


def ingest(engine: MemoryEngine, pages: list[dict[str, Any]], batch: int = 5) -> None:
    for i in range(0, len(pages), batch):
        engine.add_many(pages[i : i + batch])


def table_dump(db: Any) -> dict[str, list[tuple]]:
    """Every row of every table (meta's extractor state excluded), for 'unchanged' checks."""
    q = db.query if isinstance(db, SQLiteStore) else (lambda s: db.execute(s).fetchall())
    out = {}
    for table in ("users", "assistants", "segments", "pages", "knowledge", "pending", "audit"):
        out[table] = q(f"SELECT * FROM {table} ORDER BY rowid")
    out["meta"] = q("SELECT * FROM meta WHERE key != 'keyword_extractor' ORDER BY key")
    return out


def dump_of(backend: Backend, path: str) -> dict[str, list[tuple]]:
    """:func:`table_dump` through a raw connection of its own (closed after)."""
    db = backend.connect(path)
    try:
        return table_dump(db)
    finally:
        db.close()


def arena_snapshot(e: MemoryEngine) -> dict[str, Any]:
    """The arena keyed by store ids (segment_id, page_id, entry_id), so slot renumbering on
    reopen does not matter."""
    a = e.arena
    seg_emb, seg_kw = a.host("seg_emb"), a.host("seg_kw")
    stats = {n: a.host(n) for n in ("n_visit", "l_interaction", "last_access", "seg_npages")}
    page_emb, page_live = a.host("page_emb"), a.host("page_live")
    kn_emb, kn_live = a.host("kn_emb"), a.host("kn_live")
    segments, seg_pages, users = {}, {}, {}
    for uid, u in e._users.items():
        users[uid] = (u.assistant_id, u.clock, u.next_seq, u.chain_tail, u.chain_meta, list(u.stm))
        for s in a.live_segments(u.slot):
            sid = int(e._segment_of[u.slot, s])
            segments[sid] = {
                "user": uid,
                "emb": seg_emb[u.slot, s].copy(),
                "kw": np.sort(seg_kw[u.slot, s]),
                **{n: stats[n][u.slot, s].item() for n in stats},
            }
            pool = a.segment_pages(u.slot, int(s))
            seg_pages[sid] = [int(e._page_of_slot[p]) for p in pool if page_live[p]]
    live = np.flatnonzero(page_live)
    pages = {int(e._page_of_slot[p]): page_emb[p].copy() for p in live}
    owners = {("user", uid): u.owner for uid, u in e._users.items()}
    owners |= {("assistant", aid): o for aid, o in e._assistant_owner.items()}
    knowledge = {}
    for key, o in owners.items():
        ring = np.flatnonzero(kn_live[o])
        knowledge[key] = {
            "head": a.ring_head(o),
            "entries": {int(e._entry_of_ring[o, r]): (int(r), kn_emb[o, r].copy()) for r in ring},
        }
    return {
        "users": users,
        "user_live": int(a.user_live.sum()),
        "segments": segments,
        "seg_pages": seg_pages,
        "pages": pages,
        "knowledge": knowledge,
    }


def assert_same_arena(s1: dict[str, Any], s2: dict[str, Any]) -> None:
    assert s1["users"] == s2["users"]
    assert s1["user_live"] == s2["user_live"]
    assert s1["segments"].keys() == s2["segments"].keys()
    for sid, a in s1["segments"].items():
        b = s2["segments"][sid]
        np.testing.assert_array_equal(a["emb"], b["emb"], err_msg=f"segment {sid}")
        np.testing.assert_array_equal(a["kw"], b["kw"], err_msg=f"segment {sid}")
        for k in ("user", "n_visit", "l_interaction", "last_access", "seg_npages"):
            assert a[k] == b[k], (sid, k, a[k], b[k])
    assert s1["seg_pages"] == s2["seg_pages"]
    assert s1["pages"].keys() == s2["pages"].keys()
    for pid, v in s1["pages"].items():
        np.testing.assert_array_equal(v, s2["pages"][pid], err_msg=f"page {pid}")
    assert s1["knowledge"].keys() == s2["knowledge"].keys()
    for key, k1 in s1["knowledge"].items():
        k2 = s2["knowledge"][key]
        assert k1["head"] == k2["head"], key
        assert k1["entries"].keys() == k2["entries"].keys(), key
        for eid, (r, v) in k1["entries"].items():
            assert k2["entries"][eid][0] == r, (key, eid)
            np.testing.assert_array_equal(v, k2["entries"][eid][1])


QUERIES = [
    ("conv-26", "Caroline adoption agency support group"),
    ("conv-26", "Melanie painting a lake sunrise"),
    ("conv-30", "Jon dance studio business"),
    ("conv-30", "Gina lost her job clothing store"),
]


def retrieval_view(results: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "stm": [p.page_id for p in r.stm],
            "pages": [(p.page_id, p.score, p.meta) for p in r.pages],
            "uk": [(k.entry_id, k.text, k.score) for k in r.user_knowledge],
            "ak": [(k.entry_id, k.text, k.score) for k in r.assistant_knowledge],
            "profile": r.profile,
        }
        for r in results
    ]


def assert_same_retrieval(v1: list[dict[str, Any]], v2: list[dict[str, Any]]) -> None:
    for a, b in zip(v1, v2, strict=True):
        assert a["stm"] == b["stm"]
        assert a["profile"] == b["profile"]
        for key in ("pages", "uk", "ak"):
            assert [x[:-1] if key != "pages" else (x[0], x[2]) for x in a[key]] == [
                x[:-1] if key != "pages" else (x[0], x[2]) for x in b[key]
            ], key
            scores_a = [x[1] if key == "pages" else x[2] for x in a[key]]
            scores_b = [x[1] if key == "pages" else x[2] for x in b[key]]
            np.testing.assert_allclose(scores_a, scores_b, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def populated(backend: Backend) -> dict[str, Any]:
    """One engine fed 2 x 36 LoCoMo pages, then closed; what it held just before closing."""
    path = backend.spec("roundtrip")
    e = open_engine(path)
    ingest(e, locomo_pages())
    e.flush()
    before = {
        "arena": arena_snapshot(e),
        "retrieval": retrieval_view(e.retrieve_many(QUERIES, update_heat=False)),
        "exports": {u: e.export_user(u) for u in e.users()},
        "tables": table_dump(e.store),
        "counters": dict(e.counters),
        "heat": {u: e.arena.pull_heat(np.array([e._users[u].slot])) for u in e.users()},
    }
    e.close()
    return {"path": path, "backend": backend, **before}


# ============================================================================ round trip
def test_every_tier_is_written_to_the_store(populated: dict[str, Any]) -> None:
    """STM, MTM (segments, pages, chain links, meta), profile, user and assistant knowledge all
    reach the store; the scenario really exercises eviction, chains and FIFO wrap-around."""
    t, c = populated["tables"], populated["counters"]
    assert c["segments_evicted"] > 0 and c["promotions"] > 0
    db = populated["backend"].connect(populated["path"])
    try:
        tiers = dict(db.execute("SELECT tier, COUNT(*) FROM pages GROUP BY tier").fetchall())
        assert tiers["stm"] == 3 * len(USERS)
        assert tiers["mtm"] > 0 and tiers["evicted"] > 0 and "pending" not in tiers
        assert db.execute("SELECT COUNT(*) FROM pending").fetchone()[0] == 0
        # chain links are symmetric, a chain is its first page's, and its meta is one row
        links = db.execute(
            "SELECT a.page_id, b.page_id, a.chain_id, b.chain_id FROM pages a "
            "JOIN pages b ON b.prev_page = a.page_id"
        ).fetchall()
        assert links, "no page continued a chain"
        assert all(
            db.execute("SELECT next_page FROM pages WHERE page_id = ?", (a,)).fetchone()[0] == b
            for a, b, *_ in links
        )
        assert all(ca == cb for _, _, ca, cb in links)
        heads = db.execute("SELECT MIN(page_id), chain_id FROM pages GROUP BY chain_id").fetchall()
        assert all(first == chain for first, chain in heads if chain is not None)
        mtm = db.execute(
            "SELECT c.meta, p.summary, p.keywords, p.mode, p.segment_id FROM pages p "
            "JOIN chains c ON c.chain_id = p.chain_id WHERE p.tier = 'mtm'"
        ).fetchall()
        assert len(mtm) == tiers["mtm"]
        assert all(
            m and s and json.loads(k) and mode == "llm" and sid for m, s, k, mode, sid in mtm
        )
        # segments: summary, keywords, embedding of the right size, page counts that add up
        for sid, summary, kws, kw_ids, emb, n_pages in db.execute(
            "SELECT segment_id, summary, keywords, kw_ids, embedding, n_pages FROM segments"
        ):
            assert summary and json.loads(kws) and len(kw_ids) % 4 == 0 and len(kw_ids)
            assert len(emb) == 384 * 4
            assert (
                n_pages
                == db.execute("SELECT COUNT(*) FROM pages WHERE segment_id = ?", (sid,)).fetchone()[
                    0
                ]
            )
        profiles = [json.loads(p) for (p,) in db.execute("SELECT profile FROM users")]
        assert all(p and set(p) <= set(DIMENSION_KEYS) for p in profiles)
        kn = dict(
            db.execute(
                "SELECT owner_kind || ':' || live, COUNT(*) FROM knowledge GROUP BY 1"
            ).fetchall()
        )
        # rings of 6: older entries are kept but marked not live (FIFO wrapped)
        assert kn["user:1"] == 6 * len(USERS) and kn["user:0"] > 0
        assert kn["assistant:1"] == 6 * len(USERS) and kn["assistant:0"] > 0
        heads = db.execute("SELECT knowledge_head FROM users").fetchall()
        assert all(h > 6 for (h,) in heads)
        dims = db.execute("SELECT value FROM meta WHERE key = 'embedding_dim'").fetchone()
        assert dims == ("384",)
    finally:
        db.close()
    assert t["users"] and t["assistants"] and t["audit"]


def test_reopen_equals_before(populated: dict[str, Any]) -> None:
    """A new engine on the same file: same arena (modulo slots), same store rows and exports,
    same retrieval (page ids, scores within 1e-6, knowledge, profile), nothing resumed."""
    e = open_engine(populated["path"])
    try:
        assert e.pending_count() == 0
        assert_same_arena(populated["arena"], arena_snapshot(e))
        assert e.store.load_stm() == {u: list(x.stm) for u, x in e._users.items()}
        assert table_dump(e.store) == populated["tables"]
        assert {u: e.export_user(u) for u in e.users()} == populated["exports"]
        assert_same_retrieval(
            populated["retrieval"], retrieval_view(e.retrieve_many(QUERIES, update_heat=False))
        )
        # reopening did no derived work and no LLM call
        assert e.counters["promotions"] == 0 and e.counters["segments_created"] == 0
        assert e.llm.batches == []
        assert e.store.check_integrity() == []
    finally:
        e.close()


def test_a_reopen_reads_views_and_knowledge_owner_by_owner(populated: dict[str, Any]) -> None:
    """The pages were written interleaved across users, and knowledge entries too; a reopen
    reads the page views user by user (in seq order) and the knowledge owner by owner, so the
    records one retrieval reads are made together (docs/storage.md)."""
    e = open_engine(populated["path"])
    try:
        views = [(uid, pid) for chunk in e.store.iter_page_views() for pid, uid, _ in chunk]
        assert len({pid for _, pid in views}) == len(views) == len(e._views.pages)  # each once
        seq = {p["page_id"]: (u, p["seq"]) for u in e.users() for p in e.store.user_pages(u)}
        keys = [seq[pid] for _, pid in views]
        assert keys == sorted(keys)
        assert [p for _, p in views] != sorted(p for _, p in views)  # not the id order
        dim = e.embedder.dim
        owners = [
            (k, o, q)
            for c in e.store.iter_knowledge(dim)
            for k, o, q in zip(c["owner_kind"], c["owner_id"], c["seq"].tolist(), strict=True)
        ]
        assert len({o for _, o, _ in owners}) > 1 and owners == sorted(owners)
    finally:
        e.close()


def test_reopen_restores_heat(populated: dict[str, Any]) -> None:
    e = open_engine(populated["path"])
    try:
        for uid, before in populated["heat"].items():
            after = e.arena.pull_heat(np.array([e._users[uid].slot]))
            live = before["live"].astype(bool)
            assert (before["heat"][live] > 0).all()
            np.testing.assert_allclose(after["heat"][live], before["heat"][live], atol=1e-6)
    finally:
        e.close()


def test_pending_work_survives_restart_and_is_done_exactly_once(backend: Backend) -> None:
    """Pages accepted with auto_process off leave pending rows; a restart resumes them, and the
    result equals the same work done without a restart (nothing lost, nothing twice)."""
    pages = locomo_pages(per_user=20)
    twin = open_engine(backend.spec("twin"), auto_process=False)
    ingest(twin, pages)
    twin.flush()

    path = backend.spec("restart")
    e = open_engine(path, auto_process=False)
    ingest(e, pages)
    pending = e.pending_count()
    assert pending == len(pages) - 3 * len(USERS)
    e.close()
    db = backend.connect(path)
    rows = db.execute("SELECT kind, COUNT(*) FROM pending GROUP BY kind").fetchall()
    tiers = dict(db.execute("SELECT tier, COUNT(*) FROM pages GROUP BY tier").fetchall())
    db.close()
    assert rows == [("page", pending)] and tiers == {"pending": pending, "stm": 3 * len(USERS)}

    e = open_engine(path, auto_process=False)  # _rebuild resumes whatever auto_process says
    try:
        assert e.pending_count() == 0

        def by_source(x: MemoryEngine) -> dict[str, Any]:
            q = x.store.query
            src = dict(q("SELECT page_id, source FROM pages"))
            seg_src: dict[int, list[str]] = {}
            for pid, sid in q("SELECT page_id, segment_id FROM pages ORDER BY segment_id, seg_pos"):
                seg_src.setdefault(sid, []).append(src[pid])
            return {
                "pages": sorted(
                    (src[r[0]], r[1], src.get(r[2]), src.get(r[3]), r[4], r[5], r[6])
                    for r in q(
                        "SELECT p.page_id, p.tier, p.prev_page, p.next_page, c.meta, p.summary, "
                        "p.analysed FROM pages p LEFT JOIN chains c ON c.chain_id = p.chain_id"
                    )
                ),
                "segments": sorted(v for k, v in seg_src.items() if k is not None),
                "knowledge": q(
                    "SELECT owner_kind, owner_id, seq, text, live FROM knowledge "
                    "ORDER BY owner_kind, owner_id, seq"
                ),
                "profiles": q("SELECT user_id, profile, knowledge_head FROM users ORDER BY 1"),
                "events": q("SELECT action, COUNT(*) FROM audit GROUP BY action ORDER BY 1"),
            }

        assert by_source(e) == by_source(twin)
        assert_same_retrieval(
            retrieval_view(twin.retrieve_many(QUERIES, update_heat=False)),
            retrieval_view(e.retrieve_many(QUERIES, update_heat=False)),
        )
    finally:
        e.close()
        twin.close()


# ============================================================================ concurrency
def test_concurrent_writers_keep_every_page_once_and_in_order(backend: Backend) -> None:
    """4 threads x 50 pages: each thread owns one user and also writes to two shared users."""
    path = backend.spec("threads")
    e = open_engine(path, mode="extractive")
    n_threads, per_thread = 4, 50
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def work(t: int) -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                user = f"own-{t}" if i % 2 == 0 else f"shared-{i % 4 // 2}"
                e.add(
                    user,
                    f"thread {t} message {i} about topic{i % 7}",
                    f"reply {t}/{i}",
                    timestamp=1.7e9 + i * 60 + t,
                    source=f"t{t}-{i}",
                )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    e.flush()
    q = e.store.query
    assert q("SELECT COUNT(*) FROM pages")[0][0] == n_threads * per_thread
    assert q("SELECT source FROM pages GROUP BY source HAVING COUNT(*) > 1") == []
    for t in range(n_threads):
        own = [
            s
            for (s,) in q("SELECT source FROM pages WHERE user_id = ? ORDER BY seq", (f"own-{t}",))
        ]
        assert own == [f"t{t}-{i}" for i in range(0, per_thread, 2)]
        for shared in ("shared-0", "shared-1"):
            got = [
                s
                for (s,) in q("SELECT source FROM pages WHERE user_id = ? ORDER BY seq", (shared,))
                if s.startswith(f"t{t}-")
            ]
            want = [
                f"t{t}-{i}" for i in range(per_thread) if i % 2 and f"shared-{i % 4 // 2}" == shared
            ]
            assert got == want
    for uid in e.users():  # seq is dense per user and next_seq follows it
        seqs = [s for (s,) in q("SELECT seq FROM pages WHERE user_id = ? ORDER BY seq", (uid,))]
        assert seqs == list(range(len(seqs))) == list(range(e._users[uid].next_seq))
    assert e.pending_count() == 0
    assert e.store.check_integrity() == []
    mtm = q("SELECT COUNT(*) FROM pages WHERE tier = 'mtm'")[0][0]
    assert int(np.count_nonzero(e.arena.host("page_live"))) == mtm
    e.close()
    e = open_engine(path, mode="extractive")
    try:
        assert int(np.count_nonzero(e.arena.host("page_live"))) == mtm
        assert e.retrieve("own-0", "topic3").pages
    finally:
        e.close()


# ============================================================================ export / delete
def test_export_then_delete_leaves_nothing(backend: Backend) -> None:
    path = backend.spec("gdpr")
    e = open_engine(path)
    pages = locomo_pages(per_user=24)
    victim, other = USERS
    marker = "ZQXMARKER"  # a string only the deleted user's pages hold
    pages = [
        {**p, "user_input": f"{p['user_input']} {marker}"} if p["user_id"] == victim else p
        for p in pages
    ]
    ingest(e, pages)
    e.flush()
    # export: JSON-ready, complete
    data = e.export_user(victim)
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text) == data
    held = e.store.query("SELECT COUNT(*) FROM pages WHERE user_id = ?", (victim,))[0][0]
    assert len(data["pages"]) == held == 24
    assert {p["tier"] for p in data["pages"]} >= {"stm", "mtm"}
    assert data["segments"] and data["user_knowledge"] and data["user"]["profile"]
    assert data["assistant_knowledge"] and data["history"] and data["pending"] == 0
    assert all(marker in p["user_input"] for p in data["pages"])
    other_before = e.export_user(other)
    other_view = retrieval_view(e.retrieve_many(QUERIES[2:], update_heat=False))
    # delete
    u = e._users[victim]
    slot, owner = u.slot, u.owner
    pool = np.concatenate(
        [e.arena.segment_pages(slot, int(s)) for s in e.arena.live_segments(slot)]
    )
    assert e.store.rows_about(victim) > 0
    assert e.delete_user(victim) is True
    assert e.store.rows_about(victim) == 0
    assert victim not in e.users()
    assert e.arena.user_live[slot] == 0 and e.arena.owner_live[owner] == 0
    assert not e.arena.host("seg_live")[slot].any()
    assert not e.arena.host("page_live")[pool].any()
    assert not e.arena.host("kn_live")[owner].any()
    assert not np.isin(e._page_of_slot, [p["page_id"] for p in data["pages"]]).any()
    with pytest.raises(UnknownUserError):
        e.export_user(victim)
    with pytest.raises(UnknownUserError):
        e.retrieve(victim, "anything")
    assert e.delete_user(victim) is False
    assert e.export_user(other) == other_before  # the other user is untouched
    assert e.store.check_integrity() == []
    # the deleted text is gone from the database file and its write-ahead log (SQLite; on
    # PostgreSQL old row versions wait for VACUUM, see PostgresStore.delete_user)
    for suffix in ("", "-wal") if backend.kind == "sqlite" else ():
        f = Path(f"{path}{suffix}")
        if f.exists():
            assert marker.encode() not in f.read_bytes(), f.name
    e.close()
    e = open_engine(path)
    try:
        assert victim not in e.users() and e.store.rows_about(victim) == 0
        assert_same_retrieval(
            other_view, retrieval_view(e.retrieve_many(QUERIES[2:], update_heat=False))
        )
        # the id can be used again, from scratch
        r = e.add(victim, "a new beginning", "hello", timestamp=1.7e9)
        assert e.get_page(r.page_id)["seq"] == 0
        assert len(e.export_user(victim)["pages"]) == 1
    finally:
        e.close()


# ============================================================================ bad input
@pytest.fixture
def small_engine(backend: Backend) -> Any:
    e = open_engine(backend.spec("bad"), mode="extractive")
    for i in range(8):
        e.add(
            "alice", f"I like hiking trip {i}", "nice", timestamp=1.7e9 + i * 3600, source=f"s{i}"
        )
    yield e
    e.close()


LONG = "x" * 1_000_001

BAD_CALLS: list[tuple[str, Any, type[BaseException]]] = [
    ("bytes input", lambda e: e.add("alice", b"caf\xc3\xa9"), InvalidInputError),
    ("invalid utf-8 bytes", lambda e: e.add("alice", b"\xff\xfe\x80abc"), InvalidInputError),
    ("bytes response", lambda e: e.add("alice", "ok", b"\x80"), InvalidInputError),
    ("None input", lambda e: e.add("alice", None), InvalidInputError),
    ("int input", lambda e: e.add("alice", 42), InvalidInputError),
    ("list response", lambda e: e.add("alice", "hi", ["a"]), InvalidInputError),
    ("long input", lambda e: e.add("alice", LONG), InvalidInputError),
    ("long response", lambda e: e.add("alice", "hi", LONG), InvalidInputError),
    ("timestamp words", lambda e: e.add("alice", "x", timestamp="not a date"), InvalidInputError),
    (
        "timestamp month 13",
        lambda e: e.add("alice", "x", timestamp="2023-13-45"),
        InvalidInputError,
    ),
    ("timestamp 'nan'", lambda e: e.add("alice", "x", timestamp="nan"), InvalidInputError),
    ("timestamp nan", lambda e: e.add("alice", "x", timestamp=math.nan), InvalidInputError),
    ("timestamp inf", lambda e: e.add("alice", "x", timestamp=math.inf), InvalidInputError),
    ("timestamp bool", lambda e: e.add("alice", "x", timestamp=True), InvalidInputError),
    ("timestamp list", lambda e: e.add("alice", "x", timestamp=[1]), InvalidInputError),
    ("empty user id", lambda e: e.add("", "x"), InvalidInputError),
    ("blank user id", lambda e: e.add("   ", "x"), InvalidInputError),
    ("None user id", lambda e: e.add(None, "x"), InvalidInputError),
    ("int user id", lambda e: e.add(7, "x"), InvalidInputError),
    ("long user id", lambda e: e.add("u" * 257, "x"), InvalidInputError),
    ("control char user id", lambda e: e.add("a\x00b", "x"), InvalidInputError),
    ("bad assistant id", lambda e: e.add("bob", "x", assistant_id="a\nb"), InvalidInputError),
    ("bad source", lambda e: e.add("alice", "x", source="s\x07"), InvalidInputError),
    ("meta not a dict", lambda e: e.add("alice", "x", meta=["a"]), InvalidInputError),
    ("meta object", lambda e: e.add("alice", "x", meta={"a": object()}), InvalidInputError),
    ("meta set", lambda e: e.add("alice", "x", meta={"a": {1, 2}}), InvalidInputError),
    (
        "unknown field",
        lambda e: e.add_many([{"user_id": "a", "user_input": "x", "bogus": 1}]),
        InvalidInputError,
    ),
    ("not a page", lambda e: e.add_many([("alice", "x")]), InvalidInputError),
    (
        "bad page last in batch",  # validation precedes the transaction: nothing of the batch
        lambda e: e.add_many(
            [{"user_id": "bob", "user_input": "fine"}, {"user_id": "bob", "user_input": None}]
        ),
        InvalidInputError,
    ),
    ("retrieve unknown user", lambda e: e.retrieve("nobody", "x"), UnknownUserError),
    ("retrieve bytes query", lambda e: e.retrieve("alice", b"x"), InvalidInputError),
    ("retrieve long query", lambda e: e.retrieve("alice", LONG), InvalidInputError),
    ("retrieve top_pages -1", lambda e: e.retrieve("alice", "x", top_pages=-1), InvalidInputError),
    ("export unknown user", lambda e: e.export_user("nobody"), UnknownUserError),
    ("profile unknown user", lambda e: e.profile("nobody"), UnknownUserError),
    ("knowledge unknown user", lambda e: e.knowledge("nobody"), UnknownUserError),
]


@pytest.mark.parametrize(("call", "exc"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_and_the_store_unchanged(small_engine, call, exc) -> None:
    e = small_engine
    before, users = table_dump(e.store), e.users()
    with pytest.raises(exc) as info:
        call(e)
    assert str(info.value)  # a message that says what was wrong
    assert table_dump(e.store) == before
    assert e.users() == users
    assert e.store.check_integrity() == []
    # and the engine still works
    e.add("alice", "still here", "yes", timestamp=1.8e9)
    assert e.retrieve("alice", "hiking").stm


def test_documented_normalisation_of_text(small_engine) -> None:
    """Control characters other than \\n and \\t are stripped, text is NFC, lone surrogates
    become U+FFFD; what is stored is valid UTF-8."""
    e = small_engine
    r = e.add("alice", "a\x00b\x07c\rd\n\te\x7f\x85f", "caf\u0065\u0301", timestamp=1.8e9)
    row = e.get_page(r.page_id)
    assert row["user_input"] == "abcd\n\tef"
    assert row["agent_response"] == "caf\u00e9"
    r = e.add("alice", "lone \ud800 surrogate", "", timestamp="2023-05-08T13:56:00Z")
    row = e.get_page(r.page_id)
    assert "\ufffd" in row["user_input"] and not any(
        0xD800 <= ord(c) <= 0xDFFF for c in row["user_input"]
    )
    row["user_input"].encode("utf-8")
    assert row["timestamp"] == 1683554160.0
    assert row["agent_response"] == ""
    assert e.store.check_integrity() == []


def test_one_replacement_character_per_lone_surrogate(small_engine) -> None:
    r = small_engine.add("alice", "a\ud800b", timestamp=1.8e9)
    assert small_engine.get_page(r.page_id)["user_input"] == "a\ufffdb"


@pytest.mark.parametrize("field", ["user_id", "source"])
def test_surrogate_in_an_id_is_invalid_input(small_engine, field) -> None:
    page = {"user_id": "alice", "user_input": "x", field: "u\ud800"}
    with pytest.raises(InvalidInputError):
        small_engine.add_many([page])


def test_a_batch_is_one_transaction(small_engine, monkeypatch) -> None:
    """A failure at the batch's last statement (the pages, the STM overflow and the users'
    clocks all written before it) leaves none of the batch in the store."""
    e = small_engine
    real_audit = e.store.audit_many

    def failing_audit(db, rows):
        real_audit(db, rows)
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(e.store, "audit_many", failing_audit)
    before = table_dump(e.store)
    batch = [PageInput("alice", f"batch page {i}", "", 1.8e9 + i, source=f"b{i}") for i in range(4)]
    with pytest.raises(sqlite3.OperationalError):
        e.add_many(batch)
    assert table_dump(e.store) == before
    assert e.store.check_integrity() == []


def _full_disk(engine: MemoryEngine) -> type[BaseException]:
    """What the tests' simulated full disk (a raised ``sqlite3.OperationalError("database or
    disk is full")``) comes out as: a SQLite store says what happened (``StoreFullError``); a
    PostgreSQL store passes the foreign error on (its own full disk is psycopg's DiskFull)."""
    return StoreFullError if type(engine.store) is SQLiteStore else sqlite3.OperationalError


def test_failed_batch_leaves_no_ghost_state(small_engine, monkeypatch) -> None:
    """An SQL failure mid-batch (disk full) rolls back the store AND the engine's memory: no
    ghost new user, the STM deque and next_seq of existing users as before (regression test of
    an _accept bug)."""
    e = small_engine
    alice = e._users["alice"]
    stm_before, seq_before = list(alice.stm), alice.next_seq
    real_audit = e.store.audit_many

    def failing_audit(db, rows):  # the batch's last write fails, as on a full disk
        real_audit(db, rows)
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(e.store, "audit_many", failing_audit)
    before = table_dump(e.store)
    with pytest.raises(_full_disk(small_engine)):
        e.add_many(
            [
                {"user_id": "carol", "user_input": "hi", "timestamp": 1.8e9},
                {"user_id": "alice", "user_input": "x", "timestamp": 1.8e9},
            ]
        )
    monkeypatch.setattr(e.store, "audit_many", real_audit)
    assert table_dump(e.store) == before  # the store itself is fine: one rolled-back batch
    assert (list(alice.stm), alice.next_seq) == (stm_before, seq_before)
    assert "carol" not in e.users()
    e.add("carol", "hello again", timestamp=1.8e9)
    assert [p.user_input for p in e.retrieve("carol", "hello").stm] == ["hello again"]


@pytest.mark.parametrize("meta", [{"x": math.nan}, {"x": "y" * 1_000_001}], ids=["nan", "huge"])
def test_meta_must_be_strict_bounded_json(small_engine, meta) -> None:
    with pytest.raises(InvalidInputError):
        small_engine.add("alice", "x", meta=meta)


# ============================================================================ opening a store
def _make_store(path: Path | str) -> None:
    e = open_engine(path, mode="extractive")
    e.add("alice", "I like hiking", "nice", timestamp=1.7e9, source="s0")
    e.close()


@pytest.mark.parametrize("cache_mb", [0, 1, 64])
def test_a_file_store_opens_with_the_configured_page_cache(tmp_path: Path, cache_mb: int) -> None:
    """EngineConfig.store_cache_mb reaches the connection (PRAGMA cache_size, in KiB when
    negative); 0 keeps SQLite's own default, and a bad size is refused before any file is
    made."""
    sqlite_default = sqlite3.connect(":memory:").execute("PRAGMA cache_size").fetchone()[0]
    path = tmp_path / f"c{cache_mb}"
    cfg = config(path, mode="extractive").model_copy(update={"store_cache_mb": cache_mb})
    e = MemoryEngine(cfg)
    try:
        want = -cache_mb * 1024 if cache_mb else sqlite_default
        assert e.store.query("PRAGMA cache_size") == [(want,)]
    finally:
        e.close()
    reader = SQLiteStore(path / "memory.sqlite3", writer=False)  # a tool's default
    try:
        assert reader.query("PRAGMA cache_size") == [(-sqlite_mod.DEFAULT_CACHE_MB * 1024,)]
    finally:
        reader.close()
    with pytest.raises(StoreError, match="cache_mb must be >= 0"):
        SQLiteStore(tmp_path / "bad.sqlite3", cache_mb=-1)
    assert not (tmp_path / "bad.sqlite3").exists()


def test_page_size_is_larger_in_memory_only(tmp_path: Path) -> None:
    """An in-memory store takes MEMORY_PAGE_SIZE (set before its schema: an existing database
    keeps the page size it was made with); a file store keeps SQLite's default."""
    default = sqlite3.connect(":memory:").execute("PRAGMA page_size").fetchone()[0]
    assert default != sqlite_mod.MEMORY_PAGE_SIZE
    for path, want in ((":memory:", sqlite_mod.MEMORY_PAGE_SIZE), (tmp_path / "f", default)):
        e = MemoryEngine(config(path, mode="extractive"))
        try:
            e.add("alice", "I like hiking", "nice", timestamp=1.7e9)
            assert e.store.query("PRAGMA page_size") == [(want,)]
        finally:
            e.close()


def test_newer_schema_is_refused(backend: Backend) -> None:
    path = backend.spec("newer")
    _make_store(path)
    db = backend.connect(path)
    db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    before = table_dump(db)
    db.close()
    raw = Path(path).read_bytes() if backend.kind == "sqlite" else None
    supports = rf"supports \({sqlite_schema.SCHEMA_VERSION}\)"
    with pytest.raises(StoreError, match=r"schema version 99, newer than .* " + supports):
        open_engine(path)
    with pytest.raises(StoreError, match="upgrade memoryos-gpu"):
        backend.open(path)
    if raw is not None:
        assert Path(path).read_bytes() == raw
    db = backend.connect(path)
    assert table_dump(db) == before
    db.close()


@pytest.mark.parametrize(
    "embedder", [HashingEmbedder(dim=128), HashingEmbedder(seed=1)], ids=["dim", "model"]
)
def test_other_embedding_model_is_refused(backend: Backend, embedder: HashingEmbedder) -> None:
    path = backend.spec("model")
    _make_store(path)
    with pytest.raises(StoreError, match="built with embedding model hashing-384"):
        MemoryEngine(config(path, mode="extractive"), embedder=embedder)
    e = open_engine(path, mode="extractive")  # still fine with the right model
    assert e.users() == ["alice"]
    e.close()


@pytest.mark.parametrize(
    "content",
    [b"this is not a database at all, just text\n" * 200, b"SQLite format 3\x00" + b"\x01" * 5000],
    ids=["text", "bad-header"],
)
def test_non_sqlite_file_is_refused_cleanly(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.sqlite3"
    path.write_bytes(content)
    with pytest.raises(StoreError, match="not a usable memoryos-gpu store"):
        open_engine(path)
    assert path.read_bytes() == content
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0


def test_foreign_database_is_refused_untouched(backend: Backend) -> None:
    path = backend.spec("other_app")
    db = backend.connect(path)
    db.execute("CREATE TABLE users(name TEXT)")
    db.execute("INSERT INTO users VALUES ('x')")
    with pytest.raises(StoreError, match="not a memoryos-gpu store"):
        backend.open(path)
    assert backend.tables(path) == ["users"]
    assert db.execute("SELECT name FROM users").fetchall() == [("x",)]
    db.close()


def test_corrupt_schema_version_and_missing_tables_are_refused(backend: Backend) -> None:
    path = backend.spec("corrupt")
    _make_store(path)
    db = backend.connect(path)
    db.execute("UPDATE meta SET value = 'one' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="unreadable schema_version"):
        backend.open(path)
    db.execute(
        "UPDATE meta SET value = ? WHERE key = 'schema_version'",
        (str(sqlite_schema.SCHEMA_VERSION),),
    )
    db.execute("DROP TABLE audit")
    db.close()
    with pytest.raises(StoreError, match=r"lacks tables \['audit'\]"):
        backend.open(path)


# ============================================================================ migrations
V2 = "ALTER TABLE pages ADD COLUMN lang TEXT; CREATE INDEX pages_lang ON pages(lang)"
BASE = sqlite_schema.SCHEMA_VERSION  # the real version; the tests add steps after it


def _steps(backend: Backend, *extra: Any) -> dict[int, Any]:
    """The dialect's real migrations followed by ``extra`` from version BASE on."""
    return {**backend.module.MIGRATIONS, **{BASE + i: step for i, step in enumerate(extra)}}


def test_forward_migration_upgrades_an_older_store(backend: Backend, monkeypatch) -> None:
    path = backend.spec("old")
    _make_store(path)
    before = dump_of(backend, path)
    monkeypatch.setattr(sqlite_schema, "SCHEMA_VERSION", BASE + 1)
    monkeypatch.setattr(backend.module, "MIGRATIONS", _steps(backend, V2))
    s = backend.open(path)
    assert s.schema_version == BASE + 1
    s.close()
    assert "lang" in backend.columns(path, "pages")
    after = dump_of(backend, path)
    assert after["meta"] != before["meta"]
    assert [r[:-1] for r in after["pages"]] == before["pages"]  # data kept, new column NULL
    assert {k: v for k, v in after.items() if k not in ("pages", "meta")} == {
        k: v for k, v in before.items() if k not in ("pages", "meta")
    }
    e = open_engine(path, mode="extractive")  # the engine works on the migrated store
    try:
        assert [p.user_input for p in e.retrieve("alice", "hiking").stm] == ["I like hiking"]
        e.add("alice", "more", timestamp=1.8e9)
    finally:
        e.close()
    # back on the real version the migrated store is "newer": refused
    monkeypatch.undo()
    with pytest.raises(StoreError, match=f"schema version {BASE + 1}"):
        backend.open(path)


def test_callable_migration_and_new_stores_take_the_same_path(
    backend: Backend, monkeypatch
) -> None:
    def backfill(db: Any) -> None:
        db.execute("ALTER TABLE users ADD COLUMN locale TEXT NOT NULL DEFAULT 'en'")
        db.execute("UPDATE users SET locale = 'de' WHERE user_id = 'alice'")

    old = backend.spec("old")
    _make_store(old)
    monkeypatch.setattr(sqlite_schema, "SCHEMA_VERSION", BASE + 2)
    monkeypatch.setattr(backend.module, "MIGRATIONS", _steps(backend, V2, backfill))
    s = backend.open(old)
    assert s.schema_version == BASE + 2
    assert s.query("SELECT user_id, locale FROM users") == [("alice", "de")]
    s.close()
    fresh_path = backend.spec("fresh")
    fresh = backend.open(fresh_path)  # created at v1, migrated through every step
    assert fresh.schema_version == BASE + 2
    fresh.close()
    assert backend.columns(fresh_path, "users") == backend.columns(old, "users")
    assert backend.columns(fresh_path, "pages") == backend.columns(old, "pages")


def test_failed_or_missing_migration_leaves_the_store_as_it_was(backend: Backend, monkeypatch):
    path = backend.spec("old")
    _make_store(path)
    before = dump_of(backend, path)
    monkeypatch.setattr(sqlite_schema, "SCHEMA_VERSION", BASE + 1)
    monkeypatch.setattr(backend.module, "MIGRATIONS", _steps(backend, V2 + "; THIS IS NOT SQL"))
    with pytest.raises(StoreError):
        backend.open(path)
    assert "lang" not in backend.columns(path, "pages")  # the half-done migration rolled back
    assert dump_of(backend, path) == before
    monkeypatch.setattr(sqlite_schema, "SCHEMA_VERSION", BASE + 2)
    monkeypatch.setattr(backend.module, "MIGRATIONS", _steps(backend, V2))
    with pytest.raises(StoreError, match=f"no migration from it to {BASE + 2}"):
        backend.open(path)
    db = backend.connect(path)
    # the step to BASE + 1 committed on its own before the missing step was found
    got = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    assert got == (str(BASE + 1),)
    db.close()


# ============================================================================ store internals
def _concat(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in chunks[0]:
        parts = [c[key] for c in chunks]
        out[key] = (
            [x for p in parts for x in p] if isinstance(parts[0], list) else np.concatenate(parts)
        )
    return out


def test_arena_extent_counts_live_ring_positions(backend: Backend) -> None:
    """The ring width a reopen reserves: the highest live position (seq modulo the capacity)
    plus one, whoever owns it; entries no longer live take no position."""
    s = backend.open(backend.spec("extent"))
    with s.transaction() as db:
        db.execute("INSERT INTO assistants(assistant_id, created) VALUES ('a', 0)")
        db.execute("INSERT INTO users(user_id, assistant_id, created) VALUES ('u0', 'a', 0)")
        for eid, (kind, owner, seq, live) in enumerate(
            [("user", "u0", 3, 1), ("assistant", "a", 12, 1), ("user", "u0", 28, 0)]
        ):
            db.execute(
                "INSERT INTO knowledge(entry_id, owner_kind, owner_id, seq, text, embedding, "
                "live, mode, created) VALUES (?, ?, ?, ?, 't', ?, ?, 'llm', 0)",
                (eid + 1, kind, owner, seq, emb_blob(np.ones(4)), live),
            )
    assert s.arena_extent(1, 10).knowledge_width == 4  # 3 % 10 = 3; 12 % 10 = 2; 28 not live
    assert s.arena_extent(1, 4).knowledge_width == 4  # 3 % 4 = 3
    assert s.arena_extent(1, 100) == (0, 0, 0, 13)
    s.close()


def test_a_shards_view_lists_only_its_own_users_pending_items(backend: Backend) -> None:
    """A shard of a shared store drains its own users' pending pages only: another shard's
    items read by its drain would be derived twice, by two engines."""
    from memoryos_gpu.distributed.layout import OwnedStore
    from memoryos_gpu.ingest import shard_of

    s = backend.open(backend.spec("owned_pending"))
    users = [f"u{i}" for i in range(8)]
    with s.transaction() as db:
        s.ensure_users(db, [(u, "a") for u in users], 0.0)
        db.executemany(
            "INSERT INTO pending(user_id, kind, ref, created) VALUES (?, 'page', ?, 0)",
            [(u, i) for i, u in enumerate(users)],
        )
    every = s.pending_items("page")
    for shard in (0, 1):
        mine = OwnedStore(s, shard, 2).pending_items("page")
        assert mine == [w for w in every if shard_of(w[1], 2) == shard]
        assert mine and len(mine) < len(every)


def test_a_shards_arena_extent_counts_only_what_it_loads(backend: Backend) -> None:
    """A shard reserves for its own users' segments and rings and every assistant's ring (it
    loads all assistant knowledge): the shards' segments and blocks add up to the store's."""
    from memoryos_gpu.distributed.layout import OwnedStore
    from memoryos_gpu.ingest import shard_of

    s = backend.open(backend.spec("owned"))
    users = [f"u{i}" for i in range(8)]
    with s.transaction() as db:
        db.execute("INSERT INTO assistants(assistant_id, created) VALUES ('a', 0)")
        for i, u in enumerate(users):
            db.execute("INSERT INTO users(user_id, assistant_id, created) VALUES (?, 'a', 0)", (u,))
            for slot in range(i + 1):  # user i: slots 0..i, i pages in the last
                db.execute(
                    "INSERT INTO segments(user_id, slot, summary, keywords, kw_ids, embedding, "
                    "last_access, created, n_pages) VALUES (?, ?, '', '{}', ?, ?, 0, 0, ?)",
                    (u, slot, b"", emb_blob(np.ones(4)), i if slot == i else 1),
                )
            db.execute(
                "INSERT INTO knowledge(owner_kind, owner_id, seq, text, embedding, live, mode, "
                "created) VALUES ('user', ?, ?, 't', ?, 1, 'llm', 0)",
                (u, 2 * i, emb_blob(np.ones(4))),
            )
        db.execute(
            "INSERT INTO knowledge(owner_kind, owner_id, seq, text, embedding, live, mode, "
            "created) VALUES ('assistant', 'a', 40, 't', ?, 1, 'llm', 0)",
            (emb_blob(np.ones(4)),),
        )
    whole = s.arena_extent(1, 100)
    # user i: i one-page segments and one of max(i, 1) blocks (an empty one takes a block)
    blocks = sum(i + max(i, 1) for i in range(8))
    assert whole == (36, blocks, 8, 41)
    parts = [OwnedStore(s, shard, 2).arena_extent(1, 100) for shard in (0, 1)]
    assert sum(p.segments for p in parts) == whole.segments
    assert sum(p.blocks for p in parts) == whole.blocks
    for shard, part in enumerate(parts):
        mine = [i for i, u in enumerate(users) if shard_of(u, 2) == shard]
        assert part.segment_width == max(mine) + 1
        assert part.knowledge_width == 41  # the assistant's ring, in every shard
    s.close()


def test_bulk_loaders_stream_in_chunks_and_vectorise_keywords(
    backend: Backend, monkeypatch
) -> None:
    """The loaders stream bounded chunks (segments in id order), every row exactly once, with
    its own embedding, whatever the row order; the keyword matrix is built without a loop."""
    import memoryos_gpu.store.reads as store_reads

    monkeypatch.setattr(store_reads, "LOAD_CHUNK", 5)
    s = backend.open(backend.spec("bulk"))
    rng = np.random.default_rng(0)
    d = 8
    with s.transaction() as db:
        db.execute("INSERT INTO assistants(assistant_id, created) VALUES ('a', 0)")
        for u in ("u0", "u1", "u2"):
            db.execute("INSERT INTO users(user_id, assistant_id, created) VALUES (?, 'a', 0)", (u,))
        kws = [np.arange(k, dtype="<i4") * 7 + 1 for k in (0, 3, 40, 5)]
        for sid, (u, kw) in enumerate(zip(("u2", "u0", "u2", "u1"), kws, strict=True), start=1):
            db.execute(
                "INSERT INTO segments(segment_id, user_id, slot, summary, keywords, kw_ids, "
                "embedding, last_access, created, n_pages) "
                "VALUES (?, ?, ?, '', '{}', ?, ?, 0, 0, 3)",
                (sid, u, sid, kw.tobytes(), emb_blob(rng.standard_normal(d))),
            )
        want = {}
        order = rng.permutation([(sg, pos) for sg in (1, 2, 3, 4) for pos in range(3)])
        for i, (sg, pos) in enumerate(order):
            v = rng.standard_normal(d).astype(np.float32)
            db.execute(
                "INSERT INTO pages(page_id, user_id, seq, user_input, agent_response, timestamp, "
                "tier, segment_id, seg_pos, created) "
                "VALUES (?, 'u0', ?, '', '', 0, 'mtm', ?, ?, 0)",
                (100 + i, i, int(sg), int(pos)),
            )
            db.execute(
                "INSERT INTO page_vectors(page_id, embedding) VALUES (?, ?)", (100 + i, emb_blob(v))
            )
            want[100 + i] = (int(sg), int(pos), v)
    # 3 pages in blocks of 2: two blocks each; slots 1-4 need a width of 5; no knowledge
    assert s.arena_extent(2, 100) == (4, 8, 5, 0)
    seg_chunks = list(s.iter_segments(d, keyword_width=32))
    assert [len(c["segment_id"]) for c in seg_chunks] == [4]
    seg = _concat(seg_chunks)
    assert list(seg["segment_id"]) == [1, 2, 3, 4]
    assert seg["user_id"] == ["u2", "u0", "u2", "u1"]
    loop = np.full((4, 32), -1, np.int32)
    for i, kw in enumerate(kws):
        loop[i, : min(kw.size, 32)] = kw[:32]
    np.testing.assert_array_equal(seg["kw_matrix"], loop)
    np.testing.assert_array_equal(kw_matrix([], 4), np.zeros((0, 4), np.int32))
    page_chunks = list(s.iter_mtm_pages(d))
    assert [len(c["page_id"]) for c in page_chunks] == [5, 5, 2]
    pages = _concat(page_chunks)
    assert sorted(pages["page_id"]) == sorted(want)
    for pid, sg, pos, v in zip(
        pages["page_id"], pages["segment_id"], pages["seg_pos"], pages["embedding"], strict=True
    ):
        assert (sg, pos) == want[pid][:2]
        np.testing.assert_array_equal(v, want[pid][2])
    assert pages["embedding"].flags.writeable and pages["embedding"].dtype == np.float32
    assert s.load_stats["mtm_pages"]["rows"] == 12
    assert list(s.iter_knowledge(d)) == []
    with s.transaction() as db:  # a truncated blob is reported, not reshaped into garbage
        db.execute("UPDATE page_vectors SET embedding = ? WHERE page_id = 100", (b"\x00",))
    with pytest.raises(StoreError, match="corrupt"):
        list(s.iter_mtm_pages(d))
    s.close()
    s.close()  # idempotent


def test_reopen_streams_chunks_and_keeps_deleted_page_holes(backend: Backend, monkeypatch) -> None:
    """A reopen that reads every table in many small chunks rebuilds the same arena, and a page
    deleted from a segment leaves the same empty position after the reopen as before it."""
    import memoryos_gpu.store.reads as store_reads

    path = backend.spec("holes")
    e = open_engine(path)
    ingest(e, locomo_pages(per_user=24))
    e.process_pending()
    seg_page = e.store.query(
        "SELECT page_id FROM pages WHERE tier = 'mtm' AND seg_pos = 0 "
        "AND segment_id IN (SELECT segment_id FROM pages GROUP BY segment_id HAVING COUNT(*) > 1)"
    )
    assert seg_page, "the fixture should give a segment of several pages"
    assert e.delete_page(seg_page[0][0])
    e.process_pending()  # facts the page supported are derived again from their other pages
    before = arena_snapshot(e)
    e.close()
    monkeypatch.setattr(store_reads, "LOAD_CHUNK", 3)
    e2 = open_engine(path)
    assert e2.store.load_stats["mtm_pages"]["rows"] > 3  # several chunks were read
    assert_same_arena(before, arena_snapshot(e2))
    e2.close()


def test_nested_transaction_failure_undoes_only_its_own_work(backend: Backend) -> None:
    s = backend.open(backend.spec("tx"))
    with s.transaction() as db:
        db.execute("INSERT INTO assistants(assistant_id, created) VALUES ('outer', 0)")
        with pytest.raises(RuntimeError), s.transaction() as inner:
            inner.execute("INSERT INTO assistants(assistant_id, created) VALUES ('inner', 0)")
            raise RuntimeError("boom")
        s.set_meta("k", "v")  # another nested transaction, committed with the outer one
    assert s.all_assistants() == [("outer", 0)]
    assert s.get_meta("k") == "v"
    with pytest.raises(backend.IntegrityError), s.transaction() as db:
        db.execute("INSERT INTO assistants(assistant_id, created) VALUES ('x', 0)")
        db.execute("INSERT INTO users(user_id, assistant_id, created) VALUES ('u', 'nope', 0)")
    assert s.all_assistants() == [("outer", 0)]  # rolled back as a whole
    with s.transaction() as db:  # and the connection is usable again
        db.execute("INSERT INTO assistants(assistant_id, created) VALUES ('y', 0)")
    assert len(s.all_assistants()) == 2
    s.close()


def test_pages_are_committed_before_add_returns(backend: Backend) -> None:
    """Write-ahead: another connection sees the page as soon as add returns (auto_process off,
    so the derived work is still pending in the store)."""
    path = backend.spec("wal")
    e = open_engine(path, auto_process=False, mode="extractive")
    try:
        for i in range(5):
            r = e.add_many([PageInput("alice", f"page {i}", "ok", 1.7e9 + i, source=f"p{i}")])[0]
            other = backend.connect(path)
            row = other.execute(
                "SELECT source, tier FROM pages WHERE page_id = ?", (r.page_id,)
            ).fetchone()
            pend = other.execute("SELECT COUNT(*) FROM pending").fetchone()[0]
            other.close()
            assert row == (f"p{i}", "stm")
            assert pend == max(0, i + 1 - 3)
        if backend.kind == "sqlite":
            assert e.store.query("PRAGMA journal_mode") == [("wal",)]
            assert e.store.query("PRAGMA foreign_keys") == [(1,)]
    finally:
        e.close()


def _found(e: MemoryEngine) -> list[tuple[float, int]]:
    """A retrieval's (score, page id) pairs, best first and equal scores by id (the kernels
    break ties by arena slot, which a reopen numbers afresh); no heat credited, so the
    arena stays comparable."""
    (r,) = e.retrieve_many([("u1", "u1 on painting")], update_heat=False)
    return sorted((-round(p.score, 5), p.page_id) for p in r.pages)


def test_a_derived_apply_that_fails_halfway_leaves_memory_as_the_store(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last write of a derived round's transaction fails (a full disk), after the round
    changed the arena (segments opened, pages appended): the store rolls back, and so must the
    memory, or the retry finds segments without rows (it failed for good) or appends the pages
    twice. Then the same for a promotion, and for a round whose reload fails too. After the
    retries the engine's arena is the one a reopen loads from the store."""
    path = backend.spec("halfway")
    e = open_engine(path, auto_process=False)
    heat = e._heat
    real_refresh = heat.refresh

    def full_disk(*a: Any, **kw: Any) -> int:
        real_refresh(*a, **kw)  # the transaction's last write: every memory change is done
        raise sqlite3.OperationalError("database or disk is full")

    try:
        for i in range(10):
            e.add_many(
                [
                    PageInput(f"u{u}", f"u{u} on {TOPICS[(i + u) % 8]} {i}", "ok", 1.7e9 + i)
                    for u in range(3)
                ]
            )
        for run in (e.process_pending, lambda: e.promote("u1")):  # a page round, a promotion
            monkeypatch.setattr(heat, "refresh", full_disk)
            with pytest.raises(_full_disk(e)):
                run()
            monkeypatch.setattr(heat, "refresh", real_refresh)
            run()
            assert e.pending_count() == 0
        assert e.knowledge("u1")["user"]  # the promotion's facts are in
        # the store unreachable for the reload too: the previous state keeps serving (not a
        # half-loaded one) and the reload is owed to the next apply, which does it first
        real_load = e._rebuilder._load

        def unreachable() -> None:
            raise sqlite3.OperationalError("unable to open database file")

        e.add_many(
            [
                PageInput(f"u{u}", f"u{u} again {i}", "ok", 1.8e9 + i)
                for u in range(3)
                for i in range(3)
            ]
        )
        monkeypatch.setattr(heat, "refresh", full_disk)
        monkeypatch.setattr(e._rebuilder, "_load", unreachable)
        with pytest.raises(sqlite3.OperationalError):  # the reload's, raised while handling it
            e.process_pending()
        assert e._state.reload_owed and _found(e)
        monkeypatch.setattr(heat, "refresh", real_refresh)
        monkeypatch.setattr(e._rebuilder, "_load", real_load)
        e.process_pending()
        assert not e._state.reload_owed and e.pending_count() == 0
        got = arena_snapshot(e)
        found = _found(e)
    finally:
        e.close()
    e = open_engine(path, auto_process=False)
    try:
        assert_same_arena(got, arena_snapshot(e))
        assert _found(e) == found
    finally:
        e.close()


def _newest_ids(e: MemoryEngine) -> dict[str, int]:
    q = e.store.query
    return {
        "pages": q("SELECT COALESCE(MAX(page_id), 0) FROM pages")[0][0],
        "segments": q("SELECT COALESCE(MAX(segment_id), 0) FROM segments")[0][0],
        "knowledge": q("SELECT COALESCE(MAX(entry_id), 0) FROM knowledge")[0][0],
    }


def _first_ids(e: MemoryEngine, user: str) -> dict[str, int]:
    q = e.store.query
    return {
        "pages": q("SELECT MIN(page_id) FROM pages WHERE user_id = ?", (user,))[0][0],
        "segments": q("SELECT MIN(segment_id) FROM segments WHERE user_id = ?", (user,))[0][0],
        "knowledge": q("SELECT MIN(entry_id) FROM knowledge WHERE owner_id = ?", (user,))[0][0],
    }


def _fill(e: MemoryEngine, user: str, n: int = 8) -> None:
    """Pages enough to overflow STM into segments, and a promotion (knowledge entries)."""
    e.add_many(
        [PageInput(user, f"{user} says {TOPICS[i % 8]} {i}", "ok", 1.7e9 + i) for i in range(n)]
    )
    e.promote(user)
    e.process_pending()


def test_ids_are_never_reused_after_the_newest_rows_are_deleted(backend: Backend) -> None:
    """The newest page, segment and knowledge entry deleted (bob's, with his user), the next
    user's rows get ids above theirs, also after a reopen: a client holding a deleted id (an
    HTTP page id, a mem0 memory id) must never find another user's row under it. (SQLite's
    own rowid choice gave the deleted newest id to the next row.)"""
    path = backend.spec("ids")
    e = open_engine(path)
    try:
        _fill(e, "alice")
        _fill(e, "bob")
        gone = _newest_ids(e)
        events = e.store.query("SELECT MAX(event_id) FROM audit")[0][0]  # bob's
        assert _first_ids(e, "bob")["pages"] > 1 and all(gone.values()), gone
        assert e.delete_user("bob")
        assert all(v < gone[k] for k, v in _newest_ids(e).items())  # they were bob's
        _fill(e, "carol")
        first = _first_ids(e, "carol")
        assert all(first[k] > gone[k] for k in gone), (first, gone)
        # audit events too: bob's tombstone and carol's first event come after bob's last
        assert e.history("bob")[0]["event_id"] > events
        assert min(h["event_id"] for h in e.history("carol")) > events
        made = _newest_ids(e)
        assert e.delete_user("carol")
    finally:
        e.close()
    e = open_engine(path)  # the next free ids outlive the process
    try:
        _fill(e, "dave")
        first = _first_ids(e, "dave")
        assert all(first[k] > made[k] for k in made), (first, made)
    finally:
        e.close()


def test_a_schema_7_store_gives_no_audit_id_twice_after_its_upgrade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store written before audit ids came from ``new_ids`` has no mark for them: its
    upgrade starts one above every event it holds, or the first event after deleting the
    user whose events were the newest (that deletion's tombstone) took one of their ids."""
    import memoryos_gpu.store.sqlite_schema as sq

    path = str(tmp_path / "v7")
    monkeypatch.setattr(sq, "SCHEMA_VERSION", 7)
    e = open_engine(path)
    with e.store.transaction() as db:  # what this engine writes (schema 9), dropped below
        db.execute("ALTER TABLE pending ADD COLUMN clock REAL")
    _fill(e, "alice")
    _fill(e, "bob")
    newest = e.store.query("SELECT MAX(event_id) FROM audit")[0][0]  # bob's
    with e.store.transaction() as db:  # as a schema 7 store has it: no mark
        db.execute("DELETE FROM meta WHERE key = 'next_id.audit'")
        db.execute("ALTER TABLE pending DROP COLUMN clock")
    e.close()
    monkeypatch.undo()
    e = open_engine(path)
    try:
        assert e.store.schema_version == sq.SCHEMA_VERSION
        assert e.delete_user("bob")
        _fill(e, "alice", n=2)
        assert e.history("bob")[0]["event_id"] > newest
        assert all(h["event_id"] > newest for h in e.history("alice")[-2:])
    finally:
        e.close()


def test_pages_pushed_out_of_stm_are_stored_pending_within_and_across_batches(
    backend: Backend,
) -> None:
    """STM holds 3: a batch of 5 pages stores its first 2 as pending (pushed out by its own
    later pages: inserted so, not rewritten) and the next batch pushes out 2 stored earlier;
    the store's tiers, the pending queue and a reopen's STM agree with memory, and derived
    work then moves exactly the pending pages to MTM."""
    path = backend.spec("stm_tiers")
    e = open_engine(path, auto_process=False)

    def tiers(engine: MemoryEngine) -> dict[str, list[str]]:
        return {
            t: [p["user_input"] for p in engine.store.user_pages("u", t)]
            for t in ("stm", "pending", "mtm")
        }

    try:
        e.add_many([{"user_id": "u", "user_input": f"p{i}", "timestamp": i} for i in range(5)])
        assert tiers(e) == {"stm": ["p2", "p3", "p4"], "pending": ["p0", "p1"], "mtm": []}
        e.add_many([{"user_id": "u", "user_input": f"p{i}", "timestamp": i} for i in (5, 6)])
        assert tiers(e) == {
            "stm": ["p4", "p5", "p6"],
            "pending": ["p0", "p1", "p2", "p3"],
            "mtm": [],
        }
        assert e.pending_count("u") == 4
    finally:
        e.close()
    e = open_engine(path, auto_process=False)
    try:
        stm = e.retrieve("u", "p").stm
        assert [p.user_input for p in stm] == ["p4", "p5", "p6"]
        e.process_pending()
        assert tiers(e) == {
            "stm": ["p4", "p5", "p6"],
            "pending": [],
            "mtm": ["p0", "p1", "p2", "p3"],
        }
    finally:
        e.close()


# ============================================================================ PostgreSQL only
@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Any:
    b = make_backend("postgres", tmp_path_factory.mktemp("pg"))
    yield b
    b.cleanup()


def test_two_engines_share_one_postgres_store(pg: Backend) -> None:
    """Two shard engines with their own connection pools (as two processes on two hosts would)
    see each other's committed pages at once, never reuse each other's ids, and a third engine
    opened later loads both users. (Two whole-store engines are refused: one writer per shard,
    tests/test_writer_lock.py.)"""
    from memoryos_gpu.distributed.sharding import ShardEngine

    url = pg.spec("shared")
    cfg = config(url, auto_process=False, mode="extractive")
    a = ShardEngine(cfg, shard=1, count=2)  # alice's shard
    b = ShardEngine(cfg, shard=0, count=2)  # bob's
    try:
        ra = a.add("alice", "alice writes through engine a", "ok", timestamp=1.7e9, source="a0")
        rb = b.add("bob", "bob writes through engine b", "ok", timestamp=1.7e9, source="b0")
        assert ra.page_id != rb.page_id
        assert b.store.page_rows([ra.page_id])[ra.page_id]["user_input"].startswith("alice")
        assert a.store.page_rows([rb.page_id])[rb.page_id]["user_id"] == "bob"
        assert a.store.known_sources(["a0", "b0"]) == {
            "a0": (ra.page_id, "alice"),
            "b0": (rb.page_id, "bob"),
        }
        assert dict(a.store.query("SELECT user_id, COUNT(*) FROM pages GROUP BY user_id")) == {
            "alice": 1,
            "bob": 1,
        }
    finally:
        a.close()
        b.close()
    c = open_engine(url, mode="extractive")
    try:
        assert sorted(c.users()) == ["alice", "bob"]
        assert [p.user_input for p in c.retrieve("bob", "writes").stm] == [
            "bob writes through engine b"
        ]
    finally:
        c.close()


def test_shard_engines_creating_the_same_new_assistants_at_once_both_commit(pg: Backend) -> None:
    """Two shard engines write, at the same moment, first pages of users whose (new) assistants
    they name in opposite orders: each insert of an assistant the other inserted first waits for
    that transaction, so the engines must take them in one order. (They did not: about one
    such write in three failed with a deadlock, and the server's request with it.)"""
    from memoryos_gpu.distributed.layout import ShardMap
    from memoryos_gpu.distributed.sharding import ShardEngine

    shards = ShardMap(2)
    cfg = config(pg.spec("assistants"), auto_process=False, mode="extractive")
    engines = [ShardEngine(cfg, shard=i, count=2) for i in (0, 1)]
    errors: list[BaseException] = []

    def write(shard: int, assistants: list[str], start: threading.Barrier) -> None:
        ids = (f"{assistants[0]}-user-{k}" for k in range(10_000))  # new users every round
        mine = [u for u in ids if shards.shard(u) == shard][: len(assistants)]
        pages = [
            PageInput(u, "hello", assistant_id=a) for a, u in zip(assistants, mine, strict=True)
        ]
        start.wait()
        try:
            engines[shard].add_many(pages)
        except BaseException as exc:
            errors.append(exc)

    try:
        for r in range(30):
            names = [f"asst-{r}-{k}" for k in range(8)]
            start = threading.Barrier(2)
            threads = [
                threading.Thread(target=write, args=(i, order, start))
                for i, order in ((0, names), (1, names[::-1]))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert not errors, errors[:3]
        counted = engines[0].store.query("SELECT COUNT(*), COUNT(DISTINCT assistant_id) FROM users")
        assert counted == [(2 * 30 * 8, 30 * 8)]
    finally:
        for e in engines:
            e.close()


def test_postgres_errors_are_store_errors_without_the_password(pg: Backend) -> None:
    from memoryos_gpu.store import open_store

    with pytest.raises(StoreError, match="cannot connect") as info:
        open_store("postgresql://someone:s3cretpw@127.0.0.1:1/nowhere")
    assert "s3cretpw" not in str(info.value) and "someone:***@" in str(info.value)
    bad_db = pg.pg_url.rsplit("/", 1)[0] + "/no_such_database_here"
    with pytest.raises(StoreError, match="no_such_database_here"):
        open_store(bad_db)


def test_sql_translation_keeps_literals_and_maps_rowid() -> None:
    from memoryos_gpu.store.pg_connection import translate
    from memoryos_gpu.store.pg_urls import redact

    assert translate("SELECT a FROM pages WHERE b = ? AND c LIKE 'x%?''y' ORDER BY rowid") == (
        "SELECT a FROM pages WHERE b = %s AND c LIKE 'x%%?''y' ORDER BY page_id"
    )
    assert translate("SELECT user_id FROM users ORDER BY rowid") == (
        "SELECT user_id FROM users ORDER BY rowid"  # a real column there
    )
    assert translate('SELECT "?" FROM knowledge WHERE x % 2 = ?') == (
        'SELECT "?" FROM knowledge WHERE x %% 2 = %s'
    )
    assert redact("postgresql://u:pw@h:5/db?password=pw&sslmode=require") == (
        "postgresql://u:***@h:5/db?password=***&sslmode=require"
    )


def test_cli_takes_a_postgres_url(pg: Backend, tmp_path: Path) -> None:
    """ingest / stats / export / delete with --store URL: no local files made for it."""
    from click.testing import CliRunner

    from memoryos_gpu import cli as cli_mod

    url = pg.spec("cli")
    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(
            json.dumps({"user_id": "alice", "user_input": f"note {i}", "agent_response": "ok"})
            + "\n"
            for i in range(5)
        )
    )
    common = ["--store", url, "--embedder", "hashing", "--device", "cpu"]
    run = CliRunner().invoke
    res = run(cli_mod.cli, ["ingest", str(log), *common], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    res = run(cli_mod.cli, ["stats", "--json", *common], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    stats = json.loads(res.output)
    assert stats["pages"] == 5 and stats["users"] == 1 and stats["bytes"] > 0
    res = run(cli_mod.cli, ["export", "--user", "alice", *common], catch_exceptions=False)
    assert res.exit_code == 0 and len(json.loads(res.output)["pages"]) == 5
    res = run(cli_mod.cli, ["delete", "--user", "alice", "-y", *common], catch_exceptions=False)
    assert res.exit_code == 0 and "5 pages" not in res.output and "left" not in res.output
    st = pg.open(url)
    assert st.rows_about("alice") == 0
    st.close()
    assert not Path("postgresql:").exists()


def test_keyword_statistics_saved_while_empty_count_the_pages_added_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saved keyword state whose watermark is 0 (saved while the store was empty, then a
    crash before the next save) covers no page: the reopen refits every page. It was read as
    "no watermark" (0 is falsy), i.e. as covering every page, and the IDF left them out."""
    path = tmp_path / "memory.sqlite3"
    e = open_engine(path, mode="extractive")
    ingest(e, locomo_pages(("conv-26",), per_user=12))
    fitted = e.extractor.to_dict()
    empty = {**KeywordExtractor().to_dict(), "page_watermark": 0}
    e.store.set_meta("keyword_extractor", json.dumps(empty))  # as if saved before the pages
    monkeypatch.setattr(e._derived, "save_extractor", lambda: None)  # the crash: no last save
    e.close()
    e = open_engine(path, mode="extractive")
    try:
        assert e.extractor.n_docs == fitted["n_docs"] > 0
        assert e.extractor.to_dict() == fitted
    finally:
        e.close()

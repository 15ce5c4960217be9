"""Reopen benchmark: how long a MemoryEngine takes to rebuild its arena from a large store.

The store is built synthetically and fast (rows written straight into SQLite with executemany
in big transactions, no engine involved) but with exactly the schema and columns the engine
writes: ``--users`` users x ``--segments`` MTM segments, one MTM page per segment, random
normalised 384-d embeddings, optional STM pages and knowledge entries, and the
HashingEmbedder's model id / dimension in ``meta`` so
``MemoryEngine(EngineConfig(store=..., embedder="hashing"))`` opens it.

The reopen is timed as a whole and broken down by wrapping the store reads, the arena
writers and the engine's helpers with timers (exclusive times, so nothing counts twice); the
streaming loaders report their own SQL and blob-join time (``load_stats``). The store side is
also timed alone at full scale (every chunk read and dropped, no arena).

    python benchmarks/reopen.py --quick          # 200 users, for CI (a few seconds)
    python benchmarks/reopen.py                  # 10,000 users x 200 segments (~3 GB arena),
                                                 # writes benchmarks/results/reopen.json
    python benchmarks/reopen.py --users 1000 --stm-pages 7 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import resource
import shutil
import sqlite3
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from cli_args import (
    Parser,
    apply_defaults,
    check_output,
    machine_info,
    nonnegative_int,
    positive_int,
    run_main,
    today,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memoryos_gpu.arena import Arena  # noqa: E402
from memoryos_gpu.config import EngineConfig  # noqa: E402
from memoryos_gpu.embed import HashingEmbedder  # noqa: E402
from memoryos_gpu.engine import MemoryEngine  # noqa: E402
from memoryos_gpu.engine.rebuild import Rebuild  # noqa: E402
from memoryos_gpu.engine.state import EngineState  # noqa: E402
from memoryos_gpu.lexical import page_terms, terms_to_blobs  # noqa: E402
from memoryos_gpu.store.sqlite import SQLiteStore  # noqa: E402
from memoryos_gpu.text.keywords import KeywordExtractor, hash_keywords  # noqa: E402

DIM = 384
RESULTS = ROOT / "benchmarks" / "results" / "reopen.json"


# ============================================================================ build
def _blobs(rng: np.random.Generator, n: int) -> list[bytes]:
    emb = rng.standard_normal((n, DIM), dtype=np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    raw = emb.astype("<f4").tobytes()
    step = DIM * 4
    return [raw[i * step : (i + 1) * step] for i in range(n)]


def build_store(
    path: Path,
    users: int,
    segments: int,
    *,
    stm_pages: int = 0,
    user_knowledge: int = 10,
    assistant_knowledge: int = 100,
    users_per_assistant: int = 100,
    seed: int = 0,
    chunk_users: int = 250,
) -> dict[str, Any]:
    """Write the synthetic store; returns row counts."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    # the schema exactly as the store creates it (migrations included), then bulk rows
    SQLiteStore(path).close()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = DELETE")
    db.execute("PRAGMA journal_mode = OFF")
    db.execute("PRAGMA synchronous = OFF")
    db.execute("PRAGMA cache_size = -262144")  # 256 MiB
    rng = np.random.default_rng(seed)
    emb = HashingEmbedder()
    vocab = [f"topic{i:04d}" for i in range(4096)]
    vocab_ids = np.array([int(hash_keywords([w])[0]) for w in vocab], np.int32)
    extractor = KeywordExtractor()
    extractor.update(f"user says topic{i:04d} and topic{(i * 7) % 4096:04d}" for i in range(4096))
    db.execute("BEGIN")
    for key, value in (
        ("embedding_model", emb.model_id),
        ("embedding_dim", str(emb.dim)),
        ("keyword_extractor", json.dumps(extractor.to_dict())),
    ):
        db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
    n_assist = max(1, -(-users // users_per_assistant))
    now, t0 = time.time(), 1.6e9
    db.executemany(
        "INSERT INTO assistants(assistant_id, created, knowledge_head) VALUES (?, ?, ?)",
        [(f"asst-{a:04d}", now, assistant_knowledge) for a in range(n_assist)],
    )
    db.execute("COMMIT")
    mtm_total = users * segments
    entry = 0
    for lo in range(0, users, chunk_users):
        hi = min(users, lo + chunk_users)
        nu = hi - lo
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO users(user_id, assistant_id, created, clock, next_seq, chain_tail, "
            "profile, knowledge_head) VALUES (?, ?, ?, ?, ?, ?, '{}', ?)",
            [
                (
                    f"user-{u:05d}",
                    f"asst-{u % n_assist:04d}",
                    now,
                    t0 + (segments + stm_pages) * 60.0,
                    segments + stm_pages,
                    u * segments + segments if segments else None,
                    user_knowledge,
                )
                for u in range(lo, hi)
            ],
        )
        n = nu * segments
        seg_emb, page_emb = _blobs(rng, n), _blobs(rng, n)
        words = rng.integers(0, len(vocab), size=(n, 6))
        visits = rng.integers(0, 6, size=n)
        inter = rng.integers(0, 4, size=n)
        rows_s, rows_p = [], []
        for i in range(n):
            u, s = lo + i // segments, i % segments
            sid = u * segments + s + 1
            w = words[i]
            kw = {vocab[j]: 1 for j in w}
            ts = t0 + s * 60.0
            rows_s.append(
                (
                    sid,
                    f"user-{u:05d}",
                    s,
                    f"summary of {' '.join(kw)}",
                    json.dumps(kw),
                    vocab_ids[w].astype("<i4").tobytes(),
                    seg_emb[i],
                    int(visits[i]),
                    int(inter[i]),
                    ts,
                    ts,
                )
            )
            rows_p.append(
                (
                    sid,
                    f"user-{u:05d}",
                    s,
                    f"user {u} talks about {vocab[w[0]]} and {vocab[w[1]]}",
                    f"reply about {vocab[w[2]]}",
                    ts,
                    sid,
                    sid,
                    f"thread of user {u}",
                    f"summary of {vocab[w[0]]}",
                    json.dumps([vocab[j] for j in w[:3]]),
                    int(visits[i] % 2),
                    page_emb[i],
                    f"synthetic:{u}:{s}",
                    now,
                )
            )
        db.executemany(
            "INSERT INTO segments(segment_id, user_id, slot, summary, keywords, kw_ids, "
            "embedding, n_visit, l_interaction, last_access, created, n_pages) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)",
            rows_s,
        )
        # each page's BM25 term row, as the engine writes it (schema 2): words, no speakers
        terms = terms_to_blobs(
            page_terms([f"{r[3]} {r[4]}" for r in rows_p], [r[5] for r in rows_p])
        )
        db.executemany(
            "INSERT INTO pages(page_id, user_id, seq, user_input, agent_response, timestamp, "
            "tier, segment_id, seg_pos, chain_id, summary, keywords, analysed, mode, "
            "source, extra, created) VALUES (?, ?, ?, ?, ?, ?, 'mtm', ?, 0, "
            "?, ?, ?, ?, 'extractive', ?, '{}', ?)",
            [(*r[:8], *r[9:12], *r[13:]) for r in rows_p],
        )
        # its embedding and term row beside it (schema 6)
        db.executemany(
            "INSERT INTO page_vectors(page_id, embedding, terms) VALUES (?, ?, ?)",
            [(r[0], r[12], t) for r, t in zip(rows_p, terms, strict=True)],
        )
        # each page a chain of its own, whose meta is one row (schema 5)
        db.executemany(
            "INSERT INTO chains(chain_id, user_id, meta) VALUES (?, ?, ?)",
            [(r[7], r[1], r[8]) for r in rows_p],
        )
        del rows_s, rows_p, seg_emb, page_emb
        if stm_pages:
            blobs = _blobs(rng, nu * stm_pages)
            ids = [
                mtm_total + u * stm_pages + j + 1 for u in range(lo, hi) for j in range(stm_pages)
            ]
            db.executemany(
                "INSERT INTO pages(page_id, user_id, seq, user_input, agent_response, timestamp, "
                "tier, source, extra, created) "
                "VALUES (?, ?, ?, ?, ?, ?, 'stm', ?, '{}', ?)",
                [
                    (
                        mtm_total + u * stm_pages + j + 1,
                        f"user-{u:05d}",
                        segments + j,
                        f"recent message {j} of user {u}",
                        "ok",
                        t0 + (segments + j) * 60.0,
                        f"synthetic:{u}:stm{j}",
                        now,
                    )
                    for u in range(lo, hi)
                    for j in range(stm_pages)
                ],
            )
            db.executemany(  # STM pages' term rows are made on open (iter_pages_without_terms)
                "INSERT INTO page_vectors(page_id, embedding) VALUES (?, ?)",
                zip(ids, blobs, strict=True),
            )
        if user_knowledge:
            blobs = _blobs(rng, nu * user_knowledge)
            rows_k = []
            for u in range(lo, hi):
                for q in range(user_knowledge):
                    entry += 1
                    rows_k.append(
                        (
                            entry,
                            "user",
                            f"user-{u:05d}",
                            q,
                            f"The user {u} fact {q}",
                            blobs[(u - lo) * user_knowledge + q],
                            now,
                        )
                    )
            db.executemany(
                "INSERT INTO knowledge(entry_id, owner_kind, owner_id, seq, text, embedding, "
                "live, mode, created) VALUES (?, ?, ?, ?, ?, ?, 1, 'extractive', ?)",
                rows_k,
            )
        db.execute("COMMIT")
    if assistant_knowledge:
        db.execute("BEGIN")
        blobs = _blobs(rng, n_assist * assistant_knowledge)
        rows_k = []
        for a in range(n_assist):
            for q in range(assistant_knowledge):
                entry += 1
                rows_k.append(
                    (
                        entry,
                        "assistant",
                        f"asst-{a:04d}",
                        q,
                        f"The assistant {a} fact {q}",
                        blobs[a * assistant_knowledge + q],
                        now,
                    )
                )
        db.executemany(
            "INSERT INTO knowledge(entry_id, owner_kind, owner_id, seq, text, embedding, "
            "live, mode, created) VALUES (?, ?, ?, ?, ?, ?, 1, 'extractive', ?)",
            rows_k,
        )
        db.execute("COMMIT")
    db.execute("PRAGMA journal_mode = WAL")
    db.close()
    return {
        "users": users,
        "assistants": n_assist,
        "segments": mtm_total,
        "mtm_pages": mtm_total,
        "stm_pages": users * stm_pages,
        "knowledge": users * user_knowledge + n_assist * assistant_knowledge,
    }


# ============================================================================ timing
class Timers:
    """Exclusive wall time per wrapped function (a nested wrapped call is charged to itself,
    not to its caller), plus call counts."""

    def __init__(self) -> None:
        self.excl: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._stack: list[float] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, name: str | None = None) -> None:
        fn = getattr(owner, attr)
        label = name or f"{owner.__name__}.{attr}"
        stack = self._stack

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                child = stack.pop()
                self.excl[label] += dt - child
                self.calls[label] += 1
                if stack:
                    stack[-1] += dt

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def restore(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()


WRAPPED: list[tuple[Any, str]] = [
    (SQLiteStore, "__init__"),
    (SQLiteStore, "check_embedding_model"),
    (SQLiteStore, "all_users"),
    (SQLiteStore, "all_assistants"),
    (SQLiteStore, "query"),
    (SQLiteStore, "get_meta"),
    (SQLiteStore, "count_pending"),
    (SQLiteStore, "load_stm"),
    (SQLiteStore, "arena_extent"),
    (Arena, "__init__"),
    (Arena, "add_users"),
    (Arena, "add_owners"),
    (Arena, "set_ring_head"),
    (Arena, "write_segments"),
    (Arena, "size_segments"),
    (Arena, "place_pages"),
    (Arena, "write_pages"),
    (Arena, "write_knowledge"),
    (Arena, "_grow_users"),
    (Arena, "_grow_blocks"),
    (Arena, "_grow_owners"),
    (MemoryEngine, "_make_embedder"),
    (EngineState, "new_user_state"),
    (EngineState, "grow_maps"),
    (Rebuild, "_refit_extractor"),
    (MemoryEngine, "process_pending"),
    (Rebuild, "_load_segments"),
    (Rebuild, "_load_mtm_pages"),
    (Rebuild, "_load_knowledge"),
    (Rebuild, "rebuild"),
]


def timed_reopen(cfg: EngineConfig) -> tuple[MemoryEngine, dict[str, Any]]:
    timers = Timers()
    for owner, attr in WRAPPED:
        timers.wrap(owner, attr)
    gc.collect()
    t0 = time.perf_counter()
    try:
        engine = MemoryEngine(cfg)
    finally:
        total = time.perf_counter() - t0
        timers.restore()
    e, ls = timers.excl, engine.store.load_stats
    # the loaders are generators: their SQL and blob-join time runs inside the engine's
    # _load_* frames, so it is taken out of those frames' exclusive time here
    store_s = {k: v["sql_s"] + v["join_s"] for k, v in ls.items()}
    sql_s = sum(v["sql_s"] for v in ls.values())
    join_s = sum(v["join_s"] for v in ls.values())
    loaders = e["Rebuild._load_segments"] + e["Rebuild._load_mtm_pages"]
    breakdown = {
        # fetching rows: users/assistants, the segment / page / knowledge scans, STM
        "sql_read": sql_s
        + e["SQLiteStore.all_users"]
        + e["SQLiteStore.all_assistants"]
        + e["SQLiteStore.query"]
        + e["SQLiteStore.load_stm"]
        + e["SQLiteStore.arena_extent"]
        + e["SQLiteStore.count_pending"],
        # rows -> column arrays, blobs -> [k, d] matrices, keyword matrices
        "blob_join": join_s,
        "arena_writes": e["Arena.write_segments"] + e["Arena.set_ring_head"],
        "page_placement": e["Arena.size_segments"] + e["Arena.place_pages"],
        "page_writes": e["Arena.write_pages"],
        # fresh memory for the page pool / user rows (Arena.grow)
        "arena_growth": e["Arena._grow_blocks"] + e["Arena._grow_users"] + e["Arena._grow_owners"],
        "knowledge_writes": e["Arena.write_knowledge"]
        + e["Rebuild._load_knowledge"]
        - store_s.get("knowledge", 0.0),
        "user_slots": e["EngineState.new_user_state"]
        + e["Arena.add_users"]
        + e["Arena.add_owners"]
        + e["EngineState.grow_maps"],
        "extractor_state": e["Rebuild._refit_extractor"] + e["SQLiteStore.get_meta"],
        "pending_work": e["MemoryEngine.process_pending"],
        # Rebuild.rebuild's and its _load_* helpers' own lines (id -> slot maps, searchsorted)
        "engine_glue": e["Rebuild.rebuild"]
        + loaders
        - store_s.get("segments", 0.0)
        - store_s.get("mtm_pages", 0.0),
        "open_store_and_arena": e["SQLiteStore.__init__"]
        + e["SQLiteStore.check_embedding_model"]
        + e["Arena.__init__"]
        + e["MemoryEngine._make_embedder"],
    }
    breakdown["other"] = total - sum(breakdown.values())
    return engine, {
        "total_s": total,
        "breakdown_s": breakdown,
        "calls": dict(timers.calls),
        "exclusive_s": dict(e),
        "load_stats": ls,
    }


def loaders_only(path: Path) -> dict[str, Any]:
    """The store side of a reopen at full scale, without an arena: what SQLite and the bulk
    streaming loaders cost."""
    out: dict[str, Any] = {}
    gc.collect()
    t = time.perf_counter()
    s = SQLiteStore(path)
    out["open_s"] = time.perf_counter() - t
    t = time.perf_counter()
    s.all_users()
    s.all_assistants()
    out["users_s"] = time.perf_counter() - t
    for name, chunks in (
        ("segments_s", s.iter_segments(DIM, keyword_width=32)),
        ("mtm_pages_s", s.iter_mtm_pages(DIM)),
        ("knowledge_s", s.iter_knowledge(DIM)),
    ):
        t = time.perf_counter()
        for _chunk in chunks:  # streamed and dropped: the store side alone
            pass
        out[name] = time.perf_counter() - t
    out["load_stats"] = s.load_stats
    out["total_s"] = sum(v for k, v in out.items() if k.endswith("_s"))
    s.close()
    out["peak_rss_gib"] = _rss_gib()
    return out


def arena_estimate(users: int, segments: int, stm: int = 0, knowledge_owners: int = 0) -> int:
    """Bytes the CPU arena needs for the synthetic store (one page per segment): one block of
    ``ArenaConfig().block_size`` pages per non-empty segment; the reopen reserves every
    capacity once and streams the rows in, so nothing else of that size is held."""
    from memoryos_gpu.arena import ArenaConfig

    block = ArenaConfig().block_size
    seg_bytes = users * segments * (DIM * 4 + 32 * 4 + 1 + 4 + 4 + 8 + 4 + 4 + 4)
    pool = users * segments * block * (DIM * 4 + 1)
    ocap = 16
    while ocap < users + knowledge_owners:
        ocap *= 2
    kn = ocap * 100 * (DIM * 4 + 1)
    return seg_bytes + pool + kn


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ============================================================================ main
def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--users", type=positive_int, default=None, help="users (default 10000; --quick: 200)"
    )
    ap.add_argument(
        "--segments", type=positive_int, default=200, help="MTM segments per user (default 200)"
    )
    ap.add_argument("--quick", action="store_true", help="200 users (CI)")
    ap.add_argument(
        "--stm-pages", type=nonnegative_int, default=0, help="STM pages per user (default 0)"
    )
    ap.add_argument(
        "--user-knowledge",
        type=nonnegative_int,
        default=10,
        help="user-knowledge entries per user (default 10)",
    )
    ap.add_argument(
        "--assistant-knowledge",
        type=nonnegative_int,
        default=100,
        help="assistant-knowledge entries per user (default 100)",
    )
    ap.add_argument("--store", type=Path, help="store path (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the store afterwards")
    ap.add_argument("--reuse", action="store_true", help="reuse an existing --store as is")
    ap.add_argument("--profile", action="store_true", help="cProfile a second reopen")
    ap.add_argument(
        "--engine-users",
        type=positive_int,
        default=1000,
        help="users of the engine reopen when the full arena does not fit in memory",
    )
    ap.add_argument("--force", action="store_true", help="reopen the engine even if it won't fit")
    ap.add_argument("--out", type=Path, help=f"JSON results (default for a full run: {RESULTS})")
    args = ap.parse_args(argv)
    check_output(ap, args.out)  # a bad output path fails now, not after the run
    apply_defaults(args, full={"users": 10_000}, quick={"users": 200})
    tmp = None
    if args.store is None:
        tmp = Path(tempfile.mkdtemp(prefix="memoryos-reopen-"))
        args.store = tmp / "memory.sqlite3"
    path = args.store
    result: dict[str, Any] = {
        "users": args.users,
        "segments_per_user": args.segments,
        "stm_pages_per_user": args.stm_pages,
        "date": today(),
        "machine": {**machine_info(), "sqlite": sqlite3.sqlite_version},
    }
    try:
        if not (args.reuse and path.exists()):
            t = time.perf_counter()
            result["rows"] = build_store(
                path,
                args.users,
                args.segments,
                stm_pages=args.stm_pages,
                user_knowledge=args.user_knowledge,
                assistant_knowledge=args.assistant_knowledge,
            )
            result["build_s"] = time.perf_counter() - t
        result["file_bytes"] = _file_bytes(path)
        result["loaders_full_scale"] = loaders_only(path)
        need = arena_estimate(args.users, args.segments, args.stm_pages, args.users // 100 + 1)
        avail = _mem_available()
        result["arena_estimate_bytes"] = need
        result["mem_available_bytes"] = avail
        engine_path, engine_users = path, args.users
        if need > 0.8 * avail and not args.force:
            result["engine_reopen_skipped"] = (
                f"the arena for {args.users} users x {args.segments} segments needs about "
                f"{need / 2**30:.1f} GiB (one block per segment); {avail / 2**30:.1f} GiB "
                f"available. Engine reopen measured at "
                f"{args.engine_users} users instead (--force to try anyway)."
            )
            engine_users = args.engine_users
            engine_path = path.with_name(f"engine_{engine_users}.sqlite3")
            t = time.perf_counter()
            result["engine_rows"] = build_store(
                engine_path,
                engine_users,
                args.segments,
                stm_pages=args.stm_pages,
                user_knowledge=args.user_knowledge,
                assistant_knowledge=args.assistant_knowledge,
            )
            result["engine_build_s"] = time.perf_counter() - t
            result["engine_file_bytes"] = _file_bytes(engine_path)
        result["engine_users"] = engine_users
        result.update(engine_reopen(engine_path, args.profile))
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(result)
    out = args.out or (RESULTS if not args.quick and args.users == 10_000 else None)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        slim = {k: v for k, v in result.items() if k != "profile_top"}
        write_json(out, slim)
        print(f"wrote {out}")
    return result


def _file_bytes(path: Path) -> int:
    return sum(
        Path(f"{path}{s}").stat().st_size for s in ("", "-wal") if Path(f"{path}{s}").exists()
    )


def engine_reopen(path: Path, profile: bool) -> dict[str, Any]:
    """A MemoryEngine reopen of ``path``, timed and broken down; sanity checks the arena."""
    result: dict[str, Any] = {}
    cfg = EngineConfig(store=str(path), embedder="hashing", device="cpu")
    engine, timing = timed_reopen(cfg)
    result["reopen"] = timing
    result["arena_bytes"] = engine.arena.nbytes()
    result["peak_rss_gib_after_reopen"] = _rss_gib()
    a = engine.arena
    counts = engine.store.counts()
    assert int(np.count_nonzero(a.host("seg_live"))) == counts["segments"], counts
    assert int(np.count_nonzero(a.host("page_live"))) == counts.get("pages_mtm", 0), counts
    some = list(engine.users())[:4]
    t = time.perf_counter()
    # each user's pages say "user N talks about ...": N finds them lexically (the synthetic
    # embeddings are random, below the relevance floor)
    queries = [(u, f"what did user {int(u.split('-')[1])} say") for u in some]
    got = engine.retrieve_many(queries, update_heat=False)
    result["first_retrieve_s"] = time.perf_counter() - t
    assert all(r.pages for r in got)
    engine.store.close()
    del engine, a, got
    gc.collect()
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        MemoryEngine(cfg).store.close()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        result["profile_top"] = buf.getvalue()
    return result


def print_table(r: dict[str, Any]) -> None:
    rows = r.get("rows", {})
    print(
        f"\nreopen benchmark: {r['users']} users x {r['segments_per_user']} segments, 1 MTM page "
        f"per segment, +{r['stm_pages_per_user']} STM pages/user, "
        f"{rows.get('knowledge', '?')} knowledge entries"
    )
    if "build_s" in r:
        print(f"  build                  {r['build_s']:9.2f} s")
    print(f"  file size              {r['file_bytes'] / 2**30:9.2f} GiB")
    lo = r["loaders_full_scale"]
    print(f"  store side of a reopen, all {r['users']} users (no arena): {lo['total_s']:.2f} s")
    for k in ("open_s", "users_s", "segments_s", "mtm_pages_s", "knowledge_s"):
        print(f"    {k:20s} {lo[k]:9.3f} s")
    for name, st in lo["load_stats"].items():
        print(
            f"    loader {name:12s} rows {st['rows']:>9}  sql {st['sql_s']:7.3f} s  "
            f"join {st['join_s']:7.3f} s"
        )
    if "engine_reopen_skipped" in r:
        print(f"  engine reopen at full scale skipped: {r['engine_reopen_skipped']}")
    print(f"  engine reopen of {r['engine_users']} users x {r['segments_per_user']} segments:")
    print(f"    arena                {r['arena_bytes'] / 2**30:9.2f} GiB")
    print(f"    peak RSS             {r['peak_rss_gib_after_reopen']:9.2f} GiB")
    t = r["reopen"]
    print(f"    reopen total         {t['total_s']:9.2f} s")
    for k, v in sorted(t["breakdown_s"].items(), key=lambda kv: -kv[1]):
        print(f"      {k:20s} {v:9.3f} s  ({100 * v / max(t['total_s'], 1e-9):5.1f} %)")
    for name, st in t["load_stats"].items():
        print(
            f"      loader {name:12s} rows {st['rows']:>9}  sql {st['sql_s']:7.3f} s  "
            f"join {st['join_s']:7.3f} s"
        )
    print(f"    first retrieve (4 users) {r['first_retrieve_s'] * 1e3:.1f} ms")
    if r.get("profile_top"):
        print(r["profile_top"])


if __name__ == "__main__":
    run_main(main)

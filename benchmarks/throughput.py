"""End-to-end throughput: the engine in process vs a reference-style per-user implementation.

Synthetic users are built from LoCoMo pages: user ``u{i}`` gets ``--pages-per-user`` consecutive
pages of the dev split, starting at a random offset (cycled over all conversations), with its
speaker names suffixed by the user id so that no two users embed the same text. Timestamps are
synthetic (one minute apart per user). For each user count:

- **ingestion** (LLM-free, extractive mode): ``engine.add_many`` in batches of ``--ingest-batch``
  pages interleaving users, derived work (STM overflow, MTM segments) included; pages/s;
- **retrieval**: ``--queries`` LoCoMo questions, each for a random user, through
  ``retrieve_many`` in batches of ``--batch`` (queries/s), plus ``--latency-queries`` single-query
  calls for p50/p95 latency; the query embedding is always included;
- **memory**: peak RSS of the process after the engine's ingestion (``ru_maxrss``; monotone
  over the run, sizes run in ascending order; the reference's users are built after it) and
  ``arena.nbytes() / users`` (includes the arena's initial capacity, so it is large at small
  user counts).

The **reference** (``ReferenceUser`` below) does what a per-user implementation in the style of
BAI-LAB/MemoryOS does: one object per user, one embedder call per text, an STM of 7 pages whose
overflow is grouped into sessions (new session when cos(page, session mean) < 0.6), and per query
what MemoryOS's ``Retriever.retrieve_context`` does: a fresh ``faiss.IndexFlatIP`` over the
session embeddings (top-5) then ``np.dot`` one page at a time (top-10), the heat of the
sessions that served (N_visit, recency, the heap rebuilt), and a fresh faiss top-k over the
user's and over the assistant's knowledge, beside the STM and the profile: the work the engine
does per query. The reference promotes nothing, so after ingestion it is given the engine's
live knowledge and profiles (the same entries on both sides). Its pages-only cost (what this
reference measured before 2026-12-02) is reported too: ``memsys_pages_only_us_per_query``,
``engine_speedup_memsys_pages_only``. It runs only up to ``--reference-max-users`` users; the
engine's speed-ups over it are reported at the sizes both ran (every ratio of this script is a
speed ratio, > 1 = the first-named side faster: engine pages/s / reference pages/s, reference us /
engine us). Both use the same embedder instance with
its cache disabled. Retrieval alternates: each engine batch is followed by the same queries on
the reference, so both sides see the same load and the same mix of users over the run.

Both sides' embedding time is metered (``EmbedMeter``), so each retrieval row also reports the
**memory-system time per query** (total minus embedding) and its ratio, ``engine_speedup_memsys``
(reference us / engine us): the
cost of the memory system itself, which the choice of embedder does not move.

**Encryption at rest**: the engine above keeps its store in memory; at the sizes up to
``--encryption-max-users`` the same ingestion and retrieval also run on a SQLite file store, once
plain and once encrypted (SQLCipher, ``EngineConfig.encryption_key``), and each row reports the
encrypted store's speed relative to the plain file store's (``encryption.encrypted_speed_*``:
encrypted pages/s or queries/s / plain, plain us / encrypted us; < 1 = what encryption costs;
medians of ``--encryption-repeat`` alternated runs per side; skipped with a note without the
``encryption`` extra installed).

Default sizes are 1, 10, 100, 1,000 users (x 20 pages = 20k pages at 1,000). 10,000 and more are
possible with ``--users 1 10 100 1000 10000``, memory (and patience with MiniLM on CPU) permitting.

``--provenance-cost`` adds, per size, ``row["provenance"]``: the engine's ingestion again with
``MemoryConfig(provenance=False)`` (no provenance rows) and its batched retrieval with
``sources=True`` (each returned knowledge entry names its pages: one store query per batch)
beside the plain one, in the same run.

Usage: python benchmarks/throughput.py [--users 1 10 100 1000] [--pages-per-user 20]
       [--embedder minilm|hashing] [--reference-max-users 100] [--encryption-max-users 100]
       [--quick] [--provenance-cost] [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import importlib.util
import math
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    apply_defaults,
    check_locomo_work,
    check_output,
    load_locomo_data,
    machine_info,
    nonnegative_int,
    positive_int,
    run_main,
    today,
    write_json,
)

# as the CLI and the servers: idle OpenMP threads sleep instead of spinning (faiss, which the
# reference runs between the engine's batches, brings an OpenMP runtime of its own, and two
# runtimes' spinning threads take each other's cores)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np

from memoryos_gpu import ops
from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.engine.page_text import page_text
from memoryos_gpu.eval.locomo import Conversation, default_locomo_path, load_locomo
from memoryos_gpu.types import PageInput

DATA = default_locomo_path()
T0 = 1_700_000_000.0
#: The passphrase of the encrypted store (its key derivation is part of the open, not timed).
BENCH_KEY = "benchmark passphrase"


# ---------------------------------------------------------------------------------- workload
def load_corpus(path: Path) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """All pages (user_input, agent_response, speaker_a, speaker_b) and all question texts."""
    return corpus_of(load_locomo(path))


def corpus_of(convs: list[Conversation]) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """:func:`load_corpus` of conversations already read (``cli_args.load_locomo_data``)."""
    pages = [
        (p.user_input, p.agent_response, p.speaker_a, p.speaker_b or "assistant")
        for c in convs
        for p in c.pages
    ]
    questions = [q.question for c in convs for q in c.questions if q.question]
    return pages, questions


def iter_pages(corpus: list, users: int, per_user: int, seed: int = 0) -> Iterator[PageInput]:
    """Pages of ``users`` synthetic users, interleaved (round-robin), in order per user."""
    rng = random.Random(seed)
    offsets = [rng.randrange(len(corpus)) for _ in range(users)]
    for j in range(per_user):
        for i in range(users):
            ui, ar, sa, sb = corpus[(offsets[i] + j) % len(corpus)]
            yield PageInput(
                user_id=f"u{i}",
                user_input=ui,
                agent_response=ar,
                timestamp=T0 + 60.0 * j,
                meta={"speaker_a": f"{sa} {i}", "speaker_b": f"{sb} {i}"},
            )


def make_pages(corpus: list, users: int, per_user: int, seed: int = 0) -> list[PageInput]:
    return list(iter_pages(corpus, users, per_user, seed))


def make_queries(questions: list[str], users: int, n: int, seed: int = 1) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(f"u{rng.randrange(users)}", rng.choice(questions)) for _ in range(n)]


def ref_text(p: PageInput) -> str:
    return f"{p.meta['speaker_a']}: {p.user_input} {p.meta['speaker_b']}: {p.agent_response}"


# --------------------------------------------------------------------------------- reference
class ReferenceUser:
    """One object per user, as a per-user implementation keeps it (lists + numpy vectors).

    Retrieval does the paper's retrieval work as BAI-LAB/MemoryOS's ``Retriever`` does it:
    sessions by a fresh faiss index, their pages one ``np.dot`` at a time, the heat of each
    session that served a page (N_visit, recency, heat; the heap rebuilt), and a faiss top-k
    over the user's and the assistant's knowledge (``_search_knowledge_deque``), beside the
    STM and the profile. ``retrieve`` reports the seconds of the knowledge and heat part, so
    the pages-only cost can be read too."""

    STM, SESSION_THRESHOLD, TOP_SESSIONS, TOP_PAGES = 7, 0.6, 5, 10
    TAU = 24 * 3600.0  # recency time constant of the heat (the paper's, in seconds)

    def __init__(self, embedder: Any, assistant: list[dict[str, Any]]) -> None:
        self.embedder = embedder
        self.stm: list[dict[str, Any]] = []
        self.sessions: list[dict[str, Any]] = []  # {"pages": [...], "emb": mean vector, heat}
        self.heap: list[tuple[float, int]] = []
        self.knowledge: list[dict[str, Any]] = []  # {"text", "emb"}
        self.assistant = assistant  # shared by the users of one assistant
        self.profile: dict[str, str] = {}

    def _embed(self, text: str) -> np.ndarray:
        v = np.asarray(self.embedder.encode([text])[0], dtype=np.float32)  # one call per text
        return v / max(float(np.linalg.norm(v)), 1e-12)

    def add(self, page: PageInput) -> None:
        text = ref_text(page)
        self.stm.append({"text": text, "ts": page.timestamp, "emb": self._embed(text)})
        while len(self.stm) > self.STM:
            self._to_session(self.stm.pop(0))

    def _to_session(self, page: dict[str, Any]) -> None:
        if self.sessions:
            last = self.sessions[-1]
            s = last["emb"] / max(float(np.linalg.norm(last["emb"])), 1e-12)
            if float(np.dot(s, page["emb"])) >= self.SESSION_THRESHOLD:
                last["pages"].append(page)
                last["emb"] = np.mean([p["emb"] for p in last["pages"]], axis=0)
                return
        self.sessions.append({"pages": [page], "emb": page["emb"].copy(), "n_visit": 0})

    def retrieve(self, query: str, top_k: int) -> tuple[dict[str, Any], float]:
        """(what the query retrieved, seconds of its knowledge and heat work)."""
        import faiss

        qv = self._embed(query)
        scored: list[tuple[float, str]] = []
        visited = []
        if self.sessions:
            summaries = np.stack([s["emb"] for s in self.sessions]).astype(np.float32)
            summaries /= np.maximum(np.linalg.norm(summaries, axis=1, keepdims=True), 1e-12)
            index = faiss.IndexFlatIP(summaries.shape[1])
            index.add(summaries)
            _, idx = index.search(qv[None, :], min(self.TOP_SESSIONS, len(self.sessions)))
            for i in idx[0]:
                if i < 0:
                    continue
                visited.append(self.sessions[int(i)])
                for p in visited[-1]["pages"]:
                    scored.append((float(np.dot(p["emb"], qv)), p["text"]))
            scored.sort(key=lambda t: -t[0])
        t0 = time.perf_counter()
        self._heat(visited)
        out = {
            "stm": [p["text"] for p in self.stm],
            "pages": scored[: self.TOP_PAGES],
            "profile": dict(self.profile),
            "user_knowledge": _search_knowledge(self.knowledge, qv, top_k),
            "assistant_knowledge": _search_knowledge(self.assistant, qv, top_k),
        }
        return out, time.perf_counter() - t0

    def _heat(self, visited: list[dict[str, Any]]) -> None:
        """N_visit, recency and heat of the sessions that served the query; the heap rebuilt."""
        if not visited:
            return
        now = time.time()
        for s in visited:
            s["n_visit"] += 1
            recency = math.exp(-(now - s.get("last_visit", now)) / self.TAU)
            s["last_visit"] = now
            s["heat"] = s["n_visit"] + len(s["pages"]) + recency
        self.heap = [(-s.get("heat", 0.0), j) for j, s in enumerate(self.sessions)]
        heapq.heapify(self.heap)


def _search_knowledge(entries: list[dict[str, Any]], qv: np.ndarray, k: int) -> list:
    """The top ``k`` entries by inner product, through a fresh faiss index (as MemoryOS)."""
    import faiss

    if not entries:
        return []
    emb = np.array([e["emb"] for e in entries], dtype=np.float32)
    index = faiss.IndexFlatIP(emb.shape[1])
    index.add(emb)
    scores, idx = index.search(qv[None, :], min(k, len(entries)))
    hits = zip(scores[0].tolist(), idx[0].tolist(), strict=True)
    return [(sc, entries[i]["text"]) for sc, i in hits if i >= 0]


# ------------------------------------------------------------------------------------ runs
class EmbedMeter:
    """Wraps an embedder and sums the seconds spent in ``encode``, so a run can subtract the
    embedding from its total and report what the memory system itself costs."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def encode(self, texts: Any) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self.inner.encode(texts)
        finally:
            self.seconds += time.perf_counter() - t0

    @property
    def dim(self) -> int:
        return self.inner.dim

    @property
    def model_id(self) -> str:
        return self.inner.model_id


def peak_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb / 1024.0


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def freeze_inputs() -> None:
    """Move the harness's inputs (a size's pages and queries: at 1,000 users ~75,000 tracked
    objects, ~17x what the engine itself keeps) out of the garbage collector's reach.

    Why: every full collection walks every tracked object, and the harness's inputs are not
    the memory system's; at 1,000 users x 20 pages walking them cost ~3.5 us of each ingested
    page's "memory-system time" (three full collections), charged to whichever side ran. Both
    sides are measured after the freeze; the young collections their own allocations cause
    still count."""
    gc.collect()
    gc.freeze()


def ingest(engine: MemoryEngine, pages: list[PageInput], batch: int) -> float:
    """Ingest ``pages`` in ``add_many`` calls of ``batch`` pages; returns the seconds taken."""
    t0 = time.perf_counter()
    for i in range(0, len(pages), batch):
        engine.add_many(pages[i : i + batch])
    return time.perf_counter() - t0


def run_engine(
    embedder: EmbedMeter,
    pages: list[PageInput],
    queries: list,
    users: int,
    args,
    store: str = ":memory:",
    key: str | None = None,
    reference: Reference | None = None,
) -> dict:
    """Ingest ``pages``, then time batched retrieval. With ``reference`` (not yet ingested),
    the reference ingests the same pages after the engine (so the engine's peak RSS is its
    own), and each engine batch is followed by the same queries on the reference, one at a
    time: alternating keeps a change of load on a shared machine, or of what the caches hold,
    from favouring one side."""
    cfg = EngineConfig(store=store, memory=preset("paper"), encryption_key=key)
    engine = MemoryEngine(cfg, embedder=embedder)
    try:
        embedder.seconds = 0.0
        c0 = time.process_time()
        ingest_s = ingest(engine, pages, args.ingest_batch)
        ingest_cpu_s = time.process_time() - c0
        ingest_embed_s = embedder.seconds
        heat = not args.no_heat
        engine.retrieve_many(queries[:2], update_heat=heat)  # warm-up, untimed
        rss_mb = peak_rss_mb()
        if reference is not None:
            reference.ingest(pages)
            reference.copy_knowledge(engine)
            reference.warm_up(queries[0])
        batch_lat = []
        embedder.seconds = retrieve_cpu_s = 0.0
        for i in range(0, len(queries), args.batch):
            batch = queries[i : i + args.batch]
            t1, c1 = time.perf_counter(), time.process_time()
            engine.retrieve_many(batch, update_heat=heat)
            batch_lat.append(time.perf_counter() - t1)
            retrieve_cpu_s += time.process_time() - c1
            if reference is not None:
                reference.retrieve(batch)
        retrieve_s = sum(batch_lat)
        retrieve_embed_s = embedder.seconds
        single = []
        for q in queries[: args.latency_queries]:
            t1 = time.perf_counter()
            engine.retrieve_many([q], update_heat=heat)
            single.append(time.perf_counter() - t1)
        arena = engine.arena.nbytes()
        stats = engine.stats()
        return {
            "ingest_pages_per_s": len(pages) / ingest_s,
            "ingest_s": ingest_s,
            "ingest_memsys_us_per_page": (ingest_s - ingest_embed_s) / len(pages) * 1e6,
            # CPU time of the process (all threads): what encryption adds without the disk's
            # fsync waits, which dominate the wall time of a file store on a shared machine
            "ingest_cpu_us_per_page": ingest_cpu_s / len(pages) * 1e6,
            "retrieval_cpu_us_per_query": retrieve_cpu_s / len(queries) * 1e6,
            "queries_per_s": len(queries) / retrieve_s,
            "memsys_us_per_query": (retrieve_s - retrieve_embed_s) / len(queries) * 1e6,
            "batch_latency_ms_p50": pct(batch_lat, 50) * 1e3,
            "latency_ms_p50": pct(single, 50) * 1e3,
            "latency_ms_p95": pct(single, 95) * 1e3,
            "arena_bytes": arena,
            "arena_bytes_per_user": arena / users,
            "peak_rss_mb": rss_mb,  # before the reference's users exist
            "segments_created": stats["counters"]["segments_created"],
            "device": stats["device"],
        }
    finally:
        engine.close()
        del engine
        gc.collect()


def embedder_alone(kind: str, pages: list[PageInput], args) -> dict:
    """The engine's ingestion pages/s over the embedder's own on the texts the engine embeds
    for these pages: what the memory system (and its extra embeddings: promoted facts) costs
    on top of embedding the pages. Each side gets a fresh embedder (no cache) and, the engine,
    a fresh in-memory store; the two alternate ``--alone-repeat`` times, so a drift of the
    host's speed, which runs show up to 2x, falls on both; the ratio of each pair and their
    median are reported.

    The side that runs first in a pair pays what a process sets up the first time it meets a
    batch shape (torch's CPU kernels keep it for later calls with that shape, whatever model
    instance makes them): four pairs in one process, the order alternating, read 0.78 (the
    process's first) and 0.87 with the engine first, 0.90 and 0.91 with the embedder first.
    So an untimed pair runs first (every shape of these texts is met once) and the order
    alternates."""
    dates = preset("paper").embed_dates
    texts = [page_text(p, dates) for p in pages]

    def engine_side() -> tuple[float, float]:
        meter = EmbedMeter(make_embedder(kind))
        meter.encode(["warm-up"] * 2)
        meter.seconds = 0.0
        engine = MemoryEngine(
            EngineConfig(store=":memory:", memory=preset("paper")), embedder=meter
        )
        try:
            seconds = ingest(engine, pages, args.ingest_batch)
        finally:
            engine.close()
        return seconds, meter.seconds

    def alone_side() -> float:
        fresh = make_embedder(kind)
        fresh.encode(["warm-up"] * 2)
        t0 = time.perf_counter()
        for i in range(0, len(texts), args.ingest_batch):
            fresh.encode(texts[i : i + args.ingest_batch])
        return time.perf_counter() - t0

    engine_side(), alone_side()  # untimed: the process meets every batch shape once
    pairs: list[dict[str, Any]] = []
    for k in range(args.alone_repeat):
        engine_first = k % 2 == 0
        if engine_first:
            (engine_s, embed_s), alone_s = engine_side(), alone_side()
        else:
            alone_s = alone_side()
            engine_s, embed_s = engine_side()
        pairs.append(
            {
                "first": "engine" if engine_first else "embedder",
                "engine_pages_per_s": len(pages) / engine_s,
                "pages_per_s": len(texts) / alone_s,
                "engine_over_embedder": alone_s / engine_s,
                "engine_embedding_share": embed_s / engine_s,
            }
        )
    ratios = sorted(p["engine_over_embedder"] for p in pairs)
    return {"pairs": pairs, "engine_over_embedder": float(np.median(ratios))}


def provenance_cost(embedder: EmbedMeter, pages: list[PageInput], queries: list, args) -> dict:
    """Ingestion with and without provenance rows (alternating, twice each, best kept, so a
    busy neighbour on a shared machine slows both sides alike), and batched retrieval with and
    without ``sources`` on the last engine with provenance (alternating likewise)."""
    out: dict[str, float] = {}
    for on in (False, True, False, True):
        memory = preset("paper", provenance=on)
        engine = MemoryEngine(EngineConfig(store=":memory:", memory=memory), embedder=embedder)
        try:
            pages_per_s = len(pages) / ingest(engine, pages, args.ingest_batch)
            key = f"ingest_pages_per_s_{'with' if on else 'without'}"
            out[key] = max(out.get(key, 0.0), pages_per_s)
            out["knowledge_entries"] = engine.stats()["store"]["knowledge_live"]
            if not on:
                continue
            engine.retrieve_many(queries[:2], update_heat=False)  # warm-up, untimed
            for sources in (False, True, False, True):
                t0 = time.perf_counter()
                for i in range(0, len(queries), args.batch):
                    engine.retrieve_many(
                        queries[i : i + args.batch], update_heat=False, sources=sources
                    )
                key = f"queries_per_s_{'with' if sources else 'without'}_sources"
                out[key] = max(out.get(key, 0.0), len(queries) / (time.perf_counter() - t0))
        finally:
            engine.close()
    return out


class Reference:
    """The reference's users (``ReferenceUser``) and its retrieval timings: ``retrieve`` runs
    queries one at a time, as a per-user implementation answers them, and keeps each one's
    latency, its knowledge and heat seconds and the embedding time (its own meter), for
    :meth:`row`."""

    def __init__(self, embedder: Any) -> None:
        self.meter = EmbedMeter(embedder)  # its own: the engine's meter times the engine
        self.users: dict[str, ReferenceUser] = {}
        self.assistant: list[dict[str, Any]] = []  # the one assistant's knowledge
        self.latencies: list[float] = []
        self.knowledge_s = 0.0
        self.embed_s = 0.0
        self.ingest_s = 0.0
        self.top_k = 10

    def ingest(self, pages: list[PageInput]) -> None:
        t0 = time.perf_counter()
        for p in pages:
            u = self.users.get(p.user_id)
            if u is None:
                u = self.users[p.user_id] = ReferenceUser(self.meter, self.assistant)
            u.add(p)
        self.ingest_s = time.perf_counter() - t0

    def copy_knowledge(self, engine: MemoryEngine) -> None:
        """The engine's live knowledge and profiles, so both sides search the same entries
        (the reference promotes nothing itself; untimed)."""
        self.top_k = engine.config.memory.knowledge_top_k
        assistant: list[str] = []
        for uid, user in self.users.items():
            k = engine.knowledge(uid)
            user.knowledge = self._entries([e["text"] for e in k["user"]])
            assistant = [e["text"] for e in k["assistant"]] or assistant
            user.profile = dict(engine.profile(uid) or {})
        self.assistant[:] = self._entries(assistant)

    def _entries(self, texts: list[str]) -> list[dict[str, Any]]:
        if not texts:
            return []
        emb = np.asarray(self.meter.inner.encode(texts), np.float32)
        emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        return [{"text": t, "emb": v} for t, v in zip(texts, emb, strict=True)]

    def warm_up(self, query: tuple[str, str]) -> None:
        """One untimed query, as the engine's first batch: it imports faiss."""
        self.users[query[0]].retrieve(query[1], self.top_k)

    def retrieve(self, queries: list[tuple[str, str]]) -> None:
        self.meter.seconds = 0.0
        for uid, text in queries:
            t1 = time.perf_counter()
            _, knowledge_s = self.users[uid].retrieve(text, self.top_k)
            self.latencies.append(time.perf_counter() - t1)
            self.knowledge_s += knowledge_s
        self.embed_s += self.meter.seconds

    def row(self, pages: int) -> dict[str, Any]:
        lat = self.latencies
        memsys = sum(lat) - self.embed_s
        return {
            "ingest_pages_per_s": pages / self.ingest_s,
            "ingest_s": self.ingest_s,
            "queries_per_s": len(lat) / sum(lat),
            "memsys_us_per_query": memsys / len(lat) * 1e6,
            # what the earlier reference did: the sessions' pages and the STM only
            "memsys_pages_only_us_per_query": (memsys - self.knowledge_s) / len(lat) * 1e6,
            "latency_ms_p50": pct(lat, 50) * 1e3,
            "latency_ms_p95": pct(lat, 95) * 1e3,
            "queries_timed": len(lat),
        }


def run_encryption(
    embedder: EmbedMeter, pages: list[PageInput], queries: list, users: int, args
) -> dict[str, Any]:
    """The same run on a plain and on an encrypted SQLite file store, alternated
    ``--encryption-repeat`` times (fsync times on a shared disk vary run to run; alternating
    spreads that over both sides), each side's median kept, and their ratios (encrypted /
    plain: below 1 for pages/s and queries/s, above 1 for microseconds, is what encryption
    costs)."""
    runs: dict[str, list[dict]] = {"plain": [], "encrypted": []}
    with tempfile.TemporaryDirectory(prefix="memoryos-throughput-") as d:
        for i in range(args.encryption_repeat):
            for side, key in (("plain", None), ("encrypted", BENCH_KEY)):
                store = f"{d}/{side}-{i}.sqlite3"
                runs[side].append(run_engine(embedder, pages, queries, users, args, store, key))
    plain, enc = (
        {k: float(np.median([r[k] for r in runs[side]])) for k in KEYS_COMPARED}
        for side in ("plain", "encrypted")
    )
    return {
        "plain_file": plain,
        "encrypted_file": enc,
        "repeats": args.encryption_repeat,
        # every one a speed ratio, encrypted / plain (< 1: what encryption costs): rates as
        # they are, times (us) inverted
        "encrypted_speed_ingest": enc["ingest_pages_per_s"] / plain["ingest_pages_per_s"],
        "encrypted_speed_retrieval": enc["queries_per_s"] / plain["queries_per_s"],
        "encrypted_speed_ingest_memsys": plain["ingest_memsys_us_per_page"]
        / enc["ingest_memsys_us_per_page"],
        "encrypted_speed_memsys": plain["memsys_us_per_query"] / enc["memsys_us_per_query"],
        "encrypted_speed_ingest_cpu": plain["ingest_cpu_us_per_page"]
        / enc["ingest_cpu_us_per_page"],
        "encrypted_speed_retrieval_cpu": plain["retrieval_cpu_us_per_query"]
        / enc["retrieval_cpu_us_per_query"],
    }


#: What the encryption comparison keeps of each run (medians over the repeats).
KEYS_COMPARED = (
    "ingest_pages_per_s",
    "ingest_memsys_us_per_page",
    "queries_per_s",
    "memsys_us_per_query",
    "ingest_cpu_us_per_page",
    "retrieval_cpu_us_per_query",
    "latency_ms_p50",
)


def print_encryption(results: list[dict[str, Any]]) -> None:
    rows = [r for r in results if r.get("encryption")]
    if not rows:
        return
    head = (
        f"{'users':>7} {'file p/s':>9} {'enc p/s':>8} {'x':>5} {'cpu x':>6} {'file q/s':>9} "
        f"{'enc q/s':>8} {'x':>5} {'cpu x':>6} {'file us/q':>9} {'enc us/q':>8} {'x':>5}"
    )
    print("\nencryption at rest: a plain SQLite file store vs an encrypted one (SQLCipher)")
    print(head)
    print("-" * len(head))
    for r in rows:
        c = r["encryption"]
        a, b = c["plain_file"], c["encrypted_file"]
        print(
            f"{r['users']:>7} {a['ingest_pages_per_s']:>9.0f} {b['ingest_pages_per_s']:>8.0f} "
            f"{c['encrypted_speed_ingest']:>5.2f} {c['encrypted_speed_ingest_cpu']:>6.2f} "
            f"{a['queries_per_s']:>9.0f} {b['queries_per_s']:>8.0f} "
            f"{c['encrypted_speed_retrieval']:>5.2f} {c['encrypted_speed_retrieval_cpu']:>6.2f} "
            f"{a['memsys_us_per_query']:>9.0f} {b['memsys_us_per_query']:>8.0f} "
            f"{c['encrypted_speed_memsys']:>5.2f}"
        )
    print(
        "x: the encrypted store's speed / the plain one's (pages/s, queries/s; for us the "
        "inverse), cpu x: the same in process CPU time; > 1 = encrypted faster, < 1 = its cost"
    )


def make_embedder(kind: str) -> Any:
    if kind == "hashing":
        from memoryos_gpu.embed import HashingEmbedder

        return HashingEmbedder()
    from memoryos_gpu.embed import Embedder

    return Embedder(cache_size=0)  # no LRU hits across users / repeated questions


def hardware() -> dict[str, Any]:
    """``cli_args.machine_info`` (the benchmarks' one machine description) plus the build's
    threads, the GPU and the load at start."""
    info = ops.build_info()
    hw = {
        **machine_info(),
        "cpu_threads": info["cpu_threads"],
        "cuda_usable": info["cuda_usable"],
    }
    if info["cuda_usable"]:
        import torch

        hw["gpu"] = torch.cuda.get_device_name(0)
    if hasattr(os, "getloadavg"):
        hw["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return hw


def fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'users':>7} {'pages':>7} {'ingest p/s':>10} {'ref p/s':>8} {'x':>6} "
        f"{'retr q/s':>9} {'ref q/s':>8} {'x':>6} {'mem us':>7} {'ref us':>7} {'x':>6} "
        f"{'pages-only x':>12} {'p50 ms':>7} {'p95 ms':>7} "
        f"{'ref p50':>7} {'RSS MB':>7} {'arena B/user':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        e, ref = r["engine"], r.get("reference")
        print(
            f"{r['users']:>7} {r['pages']:>7} {e['ingest_pages_per_s']:>10.0f} "
            f"{fmt(ref and ref['ingest_pages_per_s']):>8} "
            f"{fmt(r.get('engine_speedup_ingest'), '.2f'):>6} {e['queries_per_s']:>9.0f} "
            f"{fmt(ref and ref['queries_per_s']):>8} "
            f"{fmt(r.get('engine_speedup_retrieval'), '.2f'):>6} "
            f"{e['memsys_us_per_query']:>7.0f} {fmt(ref and ref['memsys_us_per_query']):>7} "
            f"{fmt(r.get('engine_speedup_memsys'), '.2f'):>6} "
            f"{fmt(r.get('engine_speedup_memsys_pages_only'), '.2f'):>12} "
            f"{e['latency_ms_p50']:>7.3f} {e['latency_ms_p95']:>7.3f} "
            f"{fmt(ref and ref['latency_ms_p50'], '.3f'):>7} {e['peak_rss_mb']:>7.0f} "
            f"{e['arena_bytes_per_user']:>12.0f}"
        )
    if any(r.get("reference") for r in results):
        print(
            "x: the engine's speed-up over the reference (engine p/s / ref p/s, engine q/s / "
            "ref q/s, ref us / engine us): > 1 = the engine faster"
        )
    for r in results:
        if "embedder_alone" in r:
            a = r["embedder_alone"]
            each = ", ".join(
                f"{p['engine_pages_per_s']:.1f} / {p['pages_per_s']:.1f} ({p['first']} first)"
                for p in a["pairs"]
            )
            print(
                f"{r['users']} users: ingestion / the embedder alone on the same page texts, "
                f"pages/s, after an untimed pair: {each}; median ratio "
                f"{100 * a['engine_over_embedder']:.1f} % (issue 15 asks >= 90 % with MiniLM)"
            )


def _minor_label(v: float, _pos: int) -> str:
    """A log axis' minor tick label: 2, 3 and 5 times a power of ten, in plain numbers."""
    if v <= 0:
        return ""
    mantissa = v / 10 ** math.floor(math.log10(v))
    return f"{v:g}" if any(abs(mantissa - m) < 1e-6 for m in (2, 3, 5)) else ""


def plot(results: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (axes[0], "ingest_pages_per_s", "ingestion pages/s (LLM-free)"),
        (axes[1], "queries_per_s", "retrieval queries/s (embedding included)"),
    ):
        xs = [r["users"] for r in results]
        ax.plot(xs, [r["engine"][key] for r in results], "o-", label="engine (batched)")
        ref = [r for r in results if r.get("reference")]
        if ref:
            ax.plot(
                [r["users"] for r in ref],
                [r["reference"][key] for r in ref],
                "s--",
                label="reference-style per user",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("users")
        ax.set_ylabel(label)
        # a log axis spanning less than a decade has no major tick near the values: label
        # the minor ticks too, in plain numbers
        plain = matplotlib.ticker.FuncFormatter(lambda v, _pos: f"{v:g}")
        minor = matplotlib.ticker.FuncFormatter(_minor_label)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(minor)
        ax.tick_params(axis="both", which="minor", labelsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def write_report(
    results: list[dict[str, Any]], args: argparse.Namespace, hw: dict[str, Any], embedder: str
) -> None:
    """The JSON report and the plot of the sizes measured so far."""
    report = {
        "benchmark": "throughput",
        "date": today(),
        "hardware": hw,
        "build": ops.build_info(),
        "embedder": embedder,
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("json", "plot", "data", "users")
        },
        "results": results,
    }
    if args.json:
        write_json(args.json, report, default=str)
    if args.plot:
        plot(results, args.plot, f"throughput vs users ({embedder}, {hw['machine']})")


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--users",
        type=positive_int,
        nargs="+",
        default=None,
        help="user counts, one run each (default 1 10 100 1000; --quick: 1 10)",
    )
    p.add_argument(
        "--pages-per-user", type=positive_int, default=None, help="(default 20; --quick: 5)"
    )
    p.add_argument(
        "--embedder",
        choices=["minilm", "hashing"],
        default=None,
        help="(default minilm; --quick: hashing)",
    )
    p.add_argument("--ingest-batch", type=positive_int, default=512, help="pages per add_many call")
    p.add_argument("--batch", type=positive_int, default=64, help="queries per retrieve_many call")
    p.add_argument(
        "--queries",
        type=positive_int,
        default=None,
        help="retrieval queries: the engine's in batches, the reference's one at a time "
        "(default 2048; --quick: 16)",
    )
    p.add_argument(
        "--latency-queries",
        type=positive_int,
        default=None,
        help="single-query calls (default 64; --quick: 16)",
    )
    p.add_argument(
        "--reference-max-users",
        type=nonnegative_int,
        default=100,
        help="run the reference-style per-user implementation up to this many users (0: never)",
    )
    p.add_argument(
        "--encryption-max-users",
        type=nonnegative_int,
        default=100,
        help="compare plain and encrypted file stores up to this many users (0: never)",
    )
    p.add_argument(
        "--encryption-repeat", type=positive_int, default=3, help="alternated runs per side"
    )
    p.add_argument("--no-heat", action="store_true", help="retrieve_many(update_heat=False)")
    p.add_argument(
        "--provenance-cost",
        action="store_true",
        help="also ingestion without provenance and retrieval with sources (row['provenance'])",
    )
    p.add_argument(
        "--embedder-alone",
        action="store_true",
        help="also the embedder alone on the same page texts (a fresh instance, in batches of "
        "--ingest-batch), alternated with the engine's ingestion (a fresh engine): the "
        "engine's ingestion pages/s over the embedder's own",
    )
    p.add_argument(
        "--alone-repeat",
        type=positive_int,
        default=4,
        help="timed pairs of --embedder-alone runs, the order alternating (median), after an "
        "untimed pair",
    )
    p.add_argument(
        "--data", type=Path, default=DATA, help="LoCoMo file (default $MEMORYOS_GPU_LOCOMO)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, hashing embedder: seconds (options given explicitly still win)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the report here (JSON)")
    p.add_argument("--plot", type=Path, default=None, help="draw the two curves here (PNG)")
    args = p.parse_args(argv)
    check_output(p, args.json, args.plot)  # a bad output path fails now, not after the run
    convs = load_locomo_data(p, args.data)  # not LoCoMo: one line, exit 2, before the run
    check_locomo_work(p, args.data, convs, scored=False)
    apply_defaults(
        args,
        full={
            "users": [1, 10, 100, 1000],
            "pages_per_user": 20,
            "embedder": "minilm",
            "queries": 2048,
            "latency_queries": 64,
        },
        quick={
            "users": [1, 10],
            "pages_per_user": 5,
            "embedder": "hashing",
            "queries": 16,
            "latency_queries": 16,
        },
    )
    args.users = sorted(set(args.users))

    notes: list[str] = []
    if args.encryption_max_users and importlib.util.find_spec("sqlcipher3") is None:
        notes.append("encryption comparison skipped: pip install 'memoryos-gpu[encryption]'")
        print(notes[-1], file=sys.stderr)
        args.encryption_max_users = 0
    hw = hardware()
    corpus, questions = corpus_of(convs)
    embedder = EmbedMeter(make_embedder(args.embedder))
    embedder.encode(["warm-up"] * 2)
    results: list[dict[str, Any]] = []
    for users in args.users:
        pages = make_pages(corpus, users, args.pages_per_user)
        queries = make_queries(questions, users, args.queries)
        freeze_inputs()
        row: dict[str, Any] = {"users": users, "pages": len(pages)}
        reference = None
        if users <= args.reference_max_users:
            reference = Reference(embedder.inner)
        row["engine"] = run_engine(embedder, pages, queries, users, args, reference=reference)
        if args.embedder_alone:
            row["embedder_alone"] = embedder_alone(args.embedder, pages, args)
        if args.provenance_cost:
            row["provenance"] = provenance_cost(embedder, pages, queries, args)
        if reference is not None:
            ref = row["reference"] = reference.row(len(pages))
            del reference
            # speed ratios, engine / reference (> 1: the engine faster): rates as they are,
            # times (us) inverted
            eng = row["engine"]
            row["engine_speedup_ingest"] = eng["ingest_pages_per_s"] / ref["ingest_pages_per_s"]
            row["engine_speedup_retrieval"] = eng["queries_per_s"] / ref["queries_per_s"]
            eng_us = eng["memsys_us_per_query"]
            row["engine_speedup_memsys"] = ref["memsys_us_per_query"] / eng_us
            row["engine_speedup_memsys_pages_only"] = ref["memsys_pages_only_us_per_query"] / eng_us
        if users <= args.encryption_max_users:
            row["encryption"] = run_encryption(embedder, pages, queries, users, args)
        results.append(row)
        gc.unfreeze()  # this size's inputs are garbage now
        print(f"{users} users measured", file=sys.stderr, flush=True)
        # after every size, so a run stopped at a size that does not fit keeps the others
        write_report(results, args, hw, getattr(embedder, "model_id", args.embedder))
    print_table(results)
    print_encryption(results)
    for n in notes:
        print(n)
    return 0


if __name__ == "__main__":
    run_main(main)

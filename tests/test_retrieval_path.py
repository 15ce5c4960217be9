"""The engine's retrieval path: what it credits, what it writes (nothing, until the write-behind)
and what a crash can lose; the relevance floor; query validation on the fast path."""

from __future__ import annotations

import numpy as np
import pytest

from memoryos_gpu.engine import InvalidInputError


def unit(i: int, dim: int = 256) -> list[float]:
    v = [0.0] * dim
    v[i] = 1.0
    return v


def _engine(make_engine, kit, store=":memory:", **memory):
    """Three one-page segments: "sum p1" points at axis 0, "sum p2" at axis 1, "sum p3" at
    axis 2; the pages' own vectors are the same axes (a page is its segment's topic)."""
    emb = kit.TableEmbedder(
        table={
            "sum p1": unit(0),
            "sum p2": unit(1),
            "sum p3": unit(2),
            "User: p1 Assistant: r": unit(0),
            "User: p2 zanzibar Assistant: r": unit(1),
            "User: p3 Assistant: r": unit(2),
            "query a": unit(0),
            "where is zanzibar": unit(3),  # orthogonal to every page: only BM25 can find p2
            "quantum chromodynamics lattice": unit(4),  # unrelated to everything
        }
    )
    memory = {"stm_capacity": 1, "tau": 1e9, "embed_dates": False, **memory}
    eng = make_engine(embedder=emb, store=store, **memory)
    ids = [
        eng.add("u", text, "r", timestamp=float(i + 1)).page_id
        for i, text in enumerate(["p1", "p2 zanzibar", "p3", "p4"])
    ]
    return eng, ids


def _visits(eng) -> dict[int, int]:
    u = eng._users["u"]
    live = eng.arena.host("seg_live")[u.slot].astype(bool)
    nv = eng.arena.host("n_visit")[u.slot]
    return {int(eng._segment_of[u.slot, s]): int(nv[s]) for s in np.flatnonzero(live)}


def _segment_of_page(eng, page_id: int) -> int:
    return eng.get_page(page_id)["segment_id"]


def test_served_pages_heat_their_segments_and_unrelated_queries_heat_nothing(make_engine, kit):
    eng, ids = _engine(make_engine, kit)
    r = eng.retrieve("u", "query a", top_segments=3)
    assert [p.page_id for p in r.pages] == [ids[0]]  # only p1 clears the relevance floor
    visits = _visits(eng)
    assert visits[_segment_of_page(eng, ids[0])] == 1
    assert sum(visits.values()) == 1  # the two chosen segments whose pages were not served: 0
    eng.retrieve("u", "quantum chromodynamics lattice", top_segments=3)
    assert eng.retrieve("u", "quantum chromodynamics lattice").pages == []
    assert sum(_visits(eng).values()) == 1  # nothing served, nothing heated


def test_a_page_found_only_by_bm25_heats_its_segment(make_engine, kit):
    """ "zanzibar" is orthogonal to every page's vector: the dense list cannot hold p2, the
    lexical one can, and its segment is credited (the earlier rule credited the top-m dense
    segments, so a page found by a name or date never kept its segment warm)."""
    eng, ids = _engine(make_engine, kit)
    r = eng.retrieve("u", "where is zanzibar", top_segments=1)
    assert [p.page_id for p in r.pages] == [ids[1]]
    visits = _visits(eng)
    assert visits[_segment_of_page(eng, ids[1])] == 1 and sum(visits.values()) == 1


def test_retrieval_writes_nothing_until_the_write_behind(make_engine, kit, tmp_path):
    path = str(tmp_path / "wb.sqlite3")
    eng, ids = _engine(make_engine, kit, store=path, tau=2.5)
    seg = _segment_of_page(eng, ids[0])
    opened = []
    real = eng.store.transaction

    def spy():
        opened.append(1)
        return real()

    eng.store.transaction = spy  # type: ignore[method-assign]
    for _ in range(3):
        eng.retrieve("u", "query a")
    assert not opened  # no write transaction, no fsync, on the retrieval path
    assert eng.stats()["heat_marks_unwritten"] == 3
    stored = eng.store.query("SELECT n_visit FROM segments WHERE segment_id = ?", (seg,))
    assert stored == [(0,)]
    # heat 3 visits + 1 page + recency 1 >= 2.5: flagged, but no promotion ran inline
    assert eng.stats()["counters"]["promotions"] == 0
    eng.store.transaction = real  # type: ignore[method-assign]
    assert eng.write_behind() == {"segments": 1, "promotions": 1}
    assert eng.store.query("SELECT n_visit FROM segments WHERE segment_id = ?", (seg,)) == [(3,)]
    assert eng.pending_count("u") == 1  # queued as derived work
    assert eng.flush()["promotions"] == 1
    assert eng.stats()["heat_marks_unwritten"] == 0


def test_a_crash_loses_the_unwritten_heat_and_never_a_page(make_engine, kit, tmp_path):
    path = str(tmp_path / "crash.sqlite3")
    eng, ids = _engine(make_engine, kit, store=path)
    eng.retrieve("u", "query a")
    eng.write_behind()
    eng.retrieve("u", "query a")  # this visit is only in memory when the process dies
    eng.store.close()  # no engine.close(): what a crash leaves
    again, _ = _engine(make_engine, kit, store=path)
    assert _visits(again)[_segment_of_page(again, ids[0])] == 1  # the written visit survived
    assert [again.get_page(p)["user_input"] for p in ids] == ["p1", "p2 zanzibar", "p3", "p4"]


def test_a_failed_write_behind_keeps_its_marks(make_engine, kit, monkeypatch):
    eng, _ = _engine(make_engine, kit)
    eng.retrieve("u", "query a")

    def broken(*_args: object) -> None:  # any durability
        raise RuntimeError("disk full")

    monkeypatch.setattr(eng.store, "transaction", broken)
    with pytest.raises(RuntimeError):
        eng.write_behind()
    monkeypatch.undo()
    assert eng.stats()["heat_marks_unwritten"] == 1
    assert eng.write_behind()["segments"] == 1


def test_update_heat_false_credits_nothing(make_engine, kit):
    eng, _ = _engine(make_engine, kit)
    eng.retrieve_many([("u", "query a")], update_heat=False)
    assert sum(_visits(eng).values()) == 0 and eng.stats()["heat_marks_unwritten"] == 0


def test_queries_are_validated_on_the_fast_path(make_engine, kit):
    eng, _ = _engine(make_engine, kit)
    # control characters dropped (tab and newline kept), NFC applied: the same retrieval
    plain = eng.retrieve_many([("u", "query a")], update_heat=False)[0]
    noisy = eng.retrieve_many([("u", "query\x00 a\x07")], update_heat=False)[0]
    assert noisy.query == "query a" and noisy.pages == plain.pages
    assert eng.retrieve_many([("u", "cafe\u0301")], update_heat=False)[0].query == "caf\u00e9"
    for bad in [("u", 5), ("", "q"), ("u\x00", "q"), ("u", "x" * 1_000_001)]:
        with pytest.raises(InvalidInputError):
            eng.retrieve_many([bad])
    stats = eng.stats()
    assert stats["retrieval"]["queries"] == 3 and stats["views"]["store_reads"] == 0


def test_cpu_threads_in_the_config_limits_the_kernels_team():
    from memoryos_gpu import MemoryEngine, ops
    from memoryos_gpu.config import EngineConfig, LLMConfig
    from memoryos_gpu.server.workers import available_cpus, engine_config

    default = ops.build_info()["cpu_threads"]
    cfg = EngineConfig(embedder="hashing", llm=LLMConfig(mode="extractive"), cpu_threads=1)
    try:
        with MemoryEngine(cfg) as eng:
            assert ops.build_info()["cpu_threads"] == 1
            eng.add("u", "hello there", "hi")
            assert eng.retrieve("u", "hello").stm
    finally:
        ops.set_cpu_threads(None)
    assert ops.build_info()["cpu_threads"] == default
    # serve --workers N: the engine process gets the cores the workers leave, at least one
    assert engine_config(EngineConfig(), 1).cpu_threads == max(1, available_cpus() - 1)
    assert engine_config(EngineConfig(), 64).cpu_threads == 1
    assert engine_config(EngineConfig(cpu_threads=3), 1).cpu_threads == 3
    with pytest.raises(ValueError):
        EngineConfig(cpu_threads=0)

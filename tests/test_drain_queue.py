"""A drain reads the queue of pending pages once (memoryos_gpu/engine/derived.py, ``_QueueRead``).

Reading the whole queue for each round made a drain of a deferred backlog quadratic in it. The
queue read once must give the memory that reading it for every round gives, and be read again
whenever something other than the drain's own rounds changed the queue: pages queued, a
deletion, a round applied only in part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.engine import MemoryEngine, derived
from memoryos_gpu.types import PageInput

USERS = 12
PAGES = 14  # 7 in STM, 7 pending per user
BATCH = 16  # ~6 rounds for the 84 pending pages


def _engine(path: str) -> MemoryEngine:
    cfg = EngineConfig(
        store=path,
        memory=preset("paper"),
        embedder="hashing",
        auto_process=False,
        derived_max_batch=BATCH,
    )
    return MemoryEngine(cfg)


def _pages(users: range, n: int = PAGES, tag: str = "") -> list[PageInput]:
    topics = ["hiking in the alps", "my sister's wedding", "the new job at the bakery"]
    return [
        PageInput(
            user_id=f"u{u}",
            user_input=f"{tag}Page {j}: we talked about {topics[(u + j // 4) % 3]} again.",
            agent_response=f"Noted, {topics[(u + j // 4) % 3]} (note {j}).",
            timestamp=1_700_000_000.0 + 3600 * j + u,
        )
        for j in range(n)
        for u in users
    ]


def _count_reads(engine: MemoryEngine) -> list[int]:
    """Wrap the store's queue read: one entry a read."""
    reads: list[int] = []
    read = engine.store.pending_items

    def counted(kind: str) -> list[tuple[int, str, int]]:
        rows = read(kind)
        reads.append(len(rows))
        return rows

    engine.store.pending_items = counted  # type: ignore[method-assign]
    return reads


def _memory(engine: MemoryEngine) -> list[Any]:
    """Each user's pages by tier and segment, and the segments' keywords: what the rounds made."""
    out = []
    for u in sorted(engine.users()):
        x = engine.export_user(u)
        pages = sorted((p["seq"], p["tier"], p.get("segment_id")) for p in x["pages"])
        segs = sorted((s["segment_id"], sorted(s["keywords"])) for s in x["segments"])
        out.append((u, pages, segs))
    return out


def _drained(path: str, hook: Callable[[MemoryEngine, int], None] | None = None) -> MemoryEngine:
    """A deferred backlog of ``USERS`` users drained; ``hook(engine, round)`` runs after each
    round's pages were applied."""
    engine = _engine(path)
    engine.add_many(_pages(range(USERS)))
    if hook is not None:
        process = engine._process_pages
        rounds = [0]

        def counted(items: list[tuple[int, str, int]]) -> int:
            taken = process(items)
            rounds[0] += 1
            hook(engine, rounds[0])
            return taken

        engine._process_pages = counted  # type: ignore[method-assign]
    return engine


def test_a_drain_reads_the_queue_once_and_makes_the_same_memory(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    once = _drained(str(tmp_path / "once.sqlite3"))
    reads = _count_reads(once)
    assert once.process_pending()["pages"] == USERS * (PAGES - 7)
    assert reads == [USERS * (PAGES - 7)]  # one read for ~6 rounds
    assert once.store.count_pending() == 0 or not once.store.pending_items("page")

    monkeypatch.setattr(derived._QueueRead, "holds", lambda self, s: False)  # read every round
    every = _drained(str(tmp_path / "every.sqlite3"))
    reads_every = _count_reads(every)
    every.process_pending()
    assert len(reads_every) >= USERS * (PAGES - 7) // BATCH
    try:
        assert _memory(once) == _memory(every)
    finally:
        once.close()
        every.close()


def test_pages_queued_during_a_drain_are_left_to_the_next_one(tmp_path: Any) -> None:
    def add_more(engine: MemoryEngine, round_no: int) -> None:
        if round_no == 1:  # another writer between two rounds: new users' pages pushed out
            engine.add_many(_pages(range(USERS, USERS + 3), n=10, tag="late "))

    engine = _drained(str(tmp_path / "s.sqlite3"), add_more)
    reads = _count_reads(engine)
    try:
        done = engine.process_pending()
        assert done["pages"] == USERS * (PAGES - 7)  # what was pending when it began
        assert len(reads) == 2  # read again once the new pages were queued
        assert len(engine.store.pending_items("page")) == 3 * (10 - 7)
        assert engine.process_pending()["pages"] == 3 * (10 - 7)
        assert {f"u{u}" for u in range(USERS + 3)} == set(engine.users())
    finally:
        engine.close()


def test_a_deletion_during_a_drain_makes_it_read_the_queue_again(tmp_path: Any) -> None:
    def delete(engine: MemoryEngine, round_no: int) -> None:
        if round_no == 1:
            engine.delete_user("u5")

    engine = _drained(str(tmp_path / "s.sqlite3"), delete)
    reads = _count_reads(engine)
    try:
        engine.process_pending()
        assert len(reads) == 2
        assert reads[1] < reads[0]  # the deleted user's items went with it
        assert not engine.store.pending_items("page")
        assert "u5" not in engine.users()
    finally:
        engine.close()


def test_a_round_left_partly_pending_makes_it_read_the_queue_again(tmp_path: Any) -> None:
    """An item whose inputs changed during its round stays pending: the queue read once no
    longer says what is left, so the next round reads it (and takes that item, in order)."""
    engine = _drained(str(tmp_path / "s.sqlite3"))
    reads = _count_reads(engine)
    process = engine._process_pages
    calls = [0]

    def first_round_leaves_one(items: list[tuple[int, str, int]]) -> int:
        calls[0] += 1
        if calls[0] == 1:  # as if the last item's page had been edited during its stages
            return process(items[:-1])
        return process(items)

    engine._process_pages = first_round_leaves_one  # type: ignore[method-assign]
    try:
        engine.process_pending()
        assert len(reads) == 2
        assert not engine.store.pending_items("page")
    finally:
        engine.close()

"""Writes commit after the engine lock is released (``EngineState.write_transaction``).

Accepting pages, a derived round and a promotion batch change memory and write the store under
the engine lock, and COMMIT after releasing it: a retrieval (memory only) goes on while a
commit runs. A commit that fails leaves memory as the store (reloaded) and never lets an id the
failed write used -- which retrievals may have shown -- name another row later.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_store import _newest_ids, arena_snapshot, assert_same_arena, open_engine, table_dump

from memoryos_gpu.engine import MemoryEngine, full_disk
from memoryos_gpu.store import StoreFullError
from memoryos_gpu.types import PageInput

TOPICS = ["hiking", "violin", "cooking", "chess"]


class GatedCommit:
    """The store's connection, whose write transaction number ``at`` (counting from 1 after
    arming) has its COMMIT held at a gate until :attr:`opened`, or failed as a full disk
    would; the rows before it began and the newest ids it used are kept."""

    def __init__(self, engine: MemoryEngine) -> None:
        self._engine = engine
        self._db = engine.store._db
        self._count = 0
        self._at = 0
        self._fail = False
        self._mine = False
        self.reached = threading.Event()
        self.opened = threading.Event()
        self.before: dict[str, list[tuple]] = {}
        self.ids_before: dict[str, int] = {}
        self.ids_at_commit: dict[str, int] = {}

    def arm(self, at: int = 1, *, fail: bool = False) -> None:
        self._count, self._at, self._fail = 0, at, fail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "BEGIN IMMEDIATE" and self._at:
            self._count += 1
            if self._count == self._at:
                self._at, self._mine = 0, True
                self.before, self.ids_before = table_dump(self._db), _newest_ids(self._engine)
        elif sql == "COMMIT" and self._mine:
            self._mine = False
            self.ids_at_commit = _newest_ids(self._engine)
            if self._fail:
                raise sqlite3.OperationalError("database or disk is full")
            self.reached.set()
            self.opened.wait(10)
        return self._db.execute(sql, *args)


def pages(round_: int, users: range = range(3)) -> list[PageInput]:
    return [
        PageInput(f"u{u}", f"I do {TOPICS[(round_ + u) % 4]} on day {round_}", "ok", 1.7e9 + round_)
        for u in users
    ]


def seeded(path: Path) -> MemoryEngine:
    """An engine (STM 3, tau 2) whose users have pages pending and segments to promote."""
    e = open_engine(path, auto_process=False)
    for i in range(8):
        e.add_many(pages(i))
    e.process_pending()
    for i in range(8, 10):
        e.add_many(pages(i))  # pending again: the next round has work
    return e


#: Each write, and which of the write transactions it makes is the one tested.
WRITES: dict[str, tuple[Callable[[MemoryEngine], Any], int]] = {
    "accept": (lambda e: e.add_many(pages(20)), 1),
    "derived round": (lambda e: e.process_pending(max_rounds=1), 1),
    "promotion": (lambda e: e.process_pending(max_rounds=1), 2),  # the round's is the 1st
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_retrieval_goes_on_while_a_write_commits(tmp_path: Path, write: str) -> None:
    e = seeded(tmp_path / "s")
    gate = GatedCommit(e)
    e.store._db = gate
    run, at = WRITES[write]
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            run(e)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    w = threading.Thread(target=writer)
    try:
        gate.arm(at)
        w.start()
        assert gate.reached.wait(10), "the write never committed"
        got: list[Any] = []
        r = threading.Thread(
            target=lambda: got.append(e.retrieve_many([("u2", "violin")], update_heat=False))
        )
        r.start()
        r.join(5)
        assert got, "the retrieval waited for the commit: the engine lock was held over it"
    finally:
        gate.opened.set()
        w.join(10)
    assert not errors and not w.is_alive()
    e.store._db = gate._db
    e.close()


@pytest.mark.parametrize("write", list(WRITES))
def test_a_failed_commit_leaves_memory_as_the_store_and_reuses_no_id(
    tmp_path: Path, write: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s"
    e = seeded(path)
    gate = GatedCommit(e)
    e.store._db = gate
    run, at = WRITES[write]
    gate.arm(at, fail=True)
    with pytest.raises(StoreFullError, match="disk is full"):
        run(e)
    before_ids, failed = gate.ids_before, gate.ids_at_commit
    assert table_dump(e.store) == gate.before  # rolled back whole
    assert any(failed[t] > before_ids[t] for t in failed)  # the write had made rows
    _free_space(monkeypatch)  # a full disk refuses writes until it has room (full_disk.py)
    run(e)  # the retry commits
    e.add_many(pages(30))
    e.process_pending()
    for table, column in (
        ("pages", "page_id"),
        ("segments", "segment_id"),
        ("knowledge", "entry_id"),
    ):
        reused = gate._db.execute(
            f"SELECT COUNT(*) FROM {table} WHERE {column} > ? AND {column} <= ?",
            (before_ids[table], failed[table]),
        ).fetchone()[0]
        assert reused == 0, f"{table}: an id of the failed write names another row"
    got = arena_snapshot(e)
    e.store._db = gate._db
    e.close()
    reopened = open_engine(path, auto_process=False)
    try:
        assert_same_arena(got, arena_snapshot(reopened))  # memory was the store's
    finally:
        reopened.close()


def _free_space(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's file system has room again, as the engine's full-disk probe reads it."""
    real = full_disk.shutil.disk_usage

    def roomy(path: str) -> Any:
        usage = real(path)
        return usage._replace(free=usage.free + 2 * full_disk.ROOM_BYTES)

    monkeypatch.setattr(full_disk.shutil, "disk_usage", roomy)


def test_a_failure_after_the_statements_of_an_accept_reloads_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pages written, the views half-updated, then a failure (the users' vocabularies):
    the transaction rolls back and memory is reloaded, not left showing pages never stored."""
    path = tmp_path / "s"
    e = seeded(path)
    before = table_dump(e.store)

    vocabulary = type(e._state.vocabulary)
    real_add = vocabulary.add

    def fails_once(*a: Any, **kw: Any) -> None:
        monkeypatch.setattr(vocabulary, "add", real_add)  # the reload's own calls work
        raise MemoryError("out of memory")

    monkeypatch.setattr(vocabulary, "add", fails_once)
    with pytest.raises(MemoryError):
        e.add_many(pages(20))
    assert table_dump(e.store) == before
    (r,) = e.retrieve_many([("u1", "day 20")], update_heat=False)
    assert all("day 20" not in p.user_input for p in r.stm)  # the views were reloaded
    e.add_many(pages(21))
    e.process_pending()
    got = arena_snapshot(e)
    e.close()
    reopened = open_engine(path, auto_process=False)
    try:
        assert_same_arena(got, arena_snapshot(reopened))
    finally:
        reopened.close()

"""A deletion's erasure is off the read path (``store/erasure.py``, ``engine/forget.py``).

A soak test found every page or user deletion rewriting the whole SQLite file (``VACUUM``)
under the engine lock: one page's delete held every retrieval for 1.3 s on a 119 MB store,
2.2 s on a 186 MB one. The rewrite is kept (deleted text must leave the file), but the store's
erasure thread does it, holding the store lock only, and a retrieval reads memory only, so it
answers meanwhile. Here the rewrite is held open (its ``VACUUM`` waits for the test), so the
order is forced, not timed: a retrieval and the deletion itself answer while it runs.

Also here: the log's truncation after a rewrite no longer loses to the store's own background
checkpoint (it said "a reader holds the log", and the log stayed as large as the file), nor
waits for the rewrite spacing when it fails; the spacing is no warning; the close stops the
background checkpointer before its erasure; a page deletion finds its chain neighbours and
audit events by index, not by scanning ``pages`` and ``audit``.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store.sqlite import SQLiteStore

SECRET = "zqkumquatvault"  # bob's first page only
WAIT_S = 10.0  # how long the test waits for what must happen at once (never reached)


class HeldRewrite:
    """The store's connection, except that ``VACUUM`` waits for :attr:`release` once it has
    begun (:attr:`started`, and the thread it runs on): a rewrite that takes as long as the
    test says, as a large file's does."""

    def __init__(self, store: SQLiteStore) -> None:
        self.real = store._db
        self.started, self.release, self.finished = (threading.Event() for _ in range(3))
        self.thread = ""
        store._db = self

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "VACUUM":
            self.thread = threading.current_thread().name
            self.started.set()
            self.release.wait(WAIT_S)
            try:
                return self.real.execute(sql, *args)
            finally:
                self.finished.set()
        return self.real.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``fn`` started on a thread of its own; its result lands in the list."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def wait_until(cond: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def in_files(path: str, word: str) -> list[str]:
    """The store's files (database, log) that hold ``word``, byte for byte."""
    files = (Path(path), Path(f"{path}-wal"))
    return [f.name for f in files if f.exists() and word.encode() in f.read_bytes()]


@pytest.fixture
def eng(tmp_path: Path) -> Iterator[MemoryEngine]:
    """Bob (a page holding :data:`SECRET`) and alice; ~1.4 MB of file beside them: more than
    a deletion rewrites itself (``ERASURE_INLINE_BYTES``)."""
    e = MemoryEngine(EngineConfig(store=str(tmp_path / "s"), embedder="hashing"))
    e.add_many(
        [{"user_id": "bob", "user_input": f"my vault code is {SECRET}", "agent_response": "ok"}]
        + [
            {
                "user_id": "alice",
                "user_input": f"I run marathons, session {i}.",
                "agent_response": "ok",
            }
            for i in range(5)
        ]
        + [
            {"user_id": f"f{i % 20}", "user_input": f"filler {i} " + "lorem ipsum " * 30}
            for i in range(600)
        ]
    )
    e.flush()
    try:
        yield e
    finally:
        e.close()


def _file_bytes(store: SQLiteStore) -> int:
    return store.query("PRAGMA page_count")[0][0] * store.query("PRAGMA page_size")[0][0]


def _inline_bytes(store: SQLiteStore) -> int:
    """The largest file a deletion rewrites itself (read so, the test says what it did
    before the attribute existed: it rewrote every file itself)."""
    return getattr(store, "ERASURE_INLINE_BYTES", 1 << 20)


def _bobs_page(e: MemoryEngine) -> int:
    return e.store.user_pages("bob")[0]["page_id"]


@pytest.mark.parametrize("kind", ["page", "user"])
def test_retrievals_and_the_deletion_answer_while_the_rewrite_runs(
    eng: MemoryEngine, kind: str
) -> None:
    store = eng.store
    assert _file_bytes(store) > _inline_bytes(store)  # the default: left to the thread
    held = HeldRewrite(store)
    try:
        page = _bobs_page(eng)
        deleting, answer = in_thread(
            lambda: eng.delete_page(page) if kind == "page" else eng.delete_user("bob")
        )
        assert held.started.wait(WAIT_S), "the rewrite never began"
        # the rewrite is running, and held: whatever needs only memory answers meanwhile
        retrieving, got = in_thread(
            lambda: eng.retrieve_many([("alice", "marathons")], update_heat=False)[0]
        )
        retrieving.join(WAIT_S)
        assert got and got[0].all_pages(), "a retrieval waited for the file's rewrite"
        deleting.join(WAIT_S)
        assert answer == [True], "the deletion waited for the file's rewrite"
        assert not held.finished.is_set()  # both answered before the rewrite ended
        assert held.thread == "memoryos-erasure"  # the store's thread, not the deleter's
    finally:
        held.release.set()
    assert wait_until(lambda: not store._erasure_due)
    store._db = held.real
    assert not in_files(store.path, SECRET)
    assert Path(f"{store.path}-wal").stat().st_size == 0


def test_a_small_file_is_rewritten_by_the_deletion_itself(tmp_path: Path) -> None:
    """At most ``ERASURE_INLINE_BYTES`` (~10 ms of rewrite): the deletion returns with its
    text out of the file, as before."""
    with MemoryEngine(EngineConfig(store=str(tmp_path / "s"), embedder="hashing")) as e:
        e.add_many([{"user_id": "bob", "user_input": f"my vault code is {SECRET}"}])
        e.flush()
        assert _file_bytes(e.store) <= _inline_bytes(e.store)
        assert e.delete_user("bob")
        assert not in_files(e.store.path, SECRET) and not e.store._erasure_due


class BusyOnce:
    """The store's connection, except that the first ``wal_checkpoint(TRUNCATE)`` answers
    busy, as SQLite does (without waiting) while another connection's checkpoint runs: the
    store's own background checkpointer, which a rewrite's log, as large as the file, sets
    off."""

    def __init__(self, store: SQLiteStore) -> None:
        self.real = store._db
        self.busy = 0
        store._db = self

    def execute(self, sql: str, *args: Any) -> Any:
        if "wal_checkpoint(TRUNCATE)" in sql and not self.busy:
            self.busy += 1
            return self.real.execute("SELECT 1, -1, -1")
        return self.real.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_the_truncation_does_not_lose_to_the_stores_own_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: "a reader holds the log" with no reader, the erasure left to a retry that waited
    for the next rewrite's turn, and the log as large as the file meanwhile (252 MB beside a
    190 MB file, until shutdown)."""
    with MemoryEngine(EngineConfig(store=str(tmp_path / "s"), embedder="hashing")) as e:
        e.add_many([{"user_id": "bob", "user_input": f"my vault code is {SECRET}"}])
        e.flush()
        busy = BusyOnce(e.store)
        with caplog.at_level(logging.WARNING, logger="memoryos_gpu.store"):
            assert e.delete_user("bob")
        e.store._db = busy.real
        assert busy.busy == 1 and not e.store._erasure_due  # tried again, at once
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        assert Path(f"{e.store.path}-wal").stat().st_size == 0


def test_a_truncation_a_reader_held_up_is_retried_without_waiting_for_the_spacing(
    tmp_path: Path,
) -> None:
    """The rewrite done, a reader of the log held up the truncation: the retry comes on the
    backoff (0.5 s), not when the next rewrite may begin (here: never)."""
    with MemoryEngine(EngineConfig(store=str(tmp_path / "s"), embedder="hashing")) as e:
        e.add_many([{"user_id": "bob", "user_input": f"my vault code is {SECRET}"}])
        e.flush()
        store = e.store
        store.ERASURE_REWRITE_SHARE = 1e-9  # the next rewrite may begin (effectively) never
        reader = sqlite3.connect(store.path, isolation_level=None)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT COUNT(*) FROM pages").fetchall()  # a snapshot on the log
            assert e.delete_user("bob")
            assert store._erasure_due and not store._rewrite_due  # rewritten, not truncated
        finally:
            reader.execute("COMMIT")
            reader.close()
        assert wait_until(lambda: not store._erasure_due, timeout=5.0)
        assert not in_files(store.path, SECRET)


def test_a_rewrite_waiting_for_its_turn_is_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The spacing is the schedule: a WARNING for it came every few seconds under steady
    deletions (203 in 14 minutes), each followed by "the erasure is done"."""
    with MemoryEngine(EngineConfig(store=str(tmp_path / "s"), embedder="hashing")) as e:
        e.add_many([{"user_id": f"u{i}", "user_input": f"secret word{i}x"} for i in range(3)])
        e.flush()
        e.store.ERASURE_REWRITE_SHARE = 1e-9
        with caplog.at_level(logging.INFO, logger="memoryos_gpu.store"):
            assert e.delete_user("u0") and e.delete_user("u1")
            assert e.store._rewrite_due  # owed, on its schedule (done at close here)
        said = [(r.levelname, r.getMessage()) for r in caplog.records]
        assert not [s for s in said if s[0] != "DEBUG"], said
        path = e.store.path
    assert not in_files(path, "word1x")


def test_the_close_stops_the_background_checkpoint_before_its_erasure(tmp_path: Path) -> None:
    """The close's truncation ran beside the store's background checkpointer, which SQLite
    does not wait for: "a reader holds the log ... run memoryos-gpu stats" at every shutdown
    after a deletion, with nothing else on the store."""
    st = SQLiteStore(str(tmp_path / "s.sqlite3"))
    assert st._checkpointer is not None
    thread = st._checkpointer._thread
    erase = st._erase_at_close
    alive: list[bool] = []
    st._erase_at_close = lambda: alive.append(thread.is_alive()) or erase()  # type: ignore[method-assign]
    st.close()
    assert alive == [False]


def test_a_page_deletion_unlinks_and_clears_by_index(kit: Any, tmp_path: Path) -> None:
    """The neighbours' links and the page's audit events were found by scanning ``pages``
    (twice) and ``audit``: ~80 ms a deletion at 60,000 pages, under the engine lock. They are
    found through the page's chain and its user now, and still all of them."""
    eng = kit.chain_engine(str(tmp_path / "c.sqlite3"), 5)
    try:
        ids = [eng.add("u", f"p{i}", f"r{i}", timestamp=float(i)).page_id for i in range(5)]
        eng.process_pending()
        eng.update_page(ids[2], agent_response=f"edited {SECRET}")  # its text in the audit
        links = "SELECT page_id, prev_page, next_page FROM pages WHERE page_id IN (?, ?)"
        assert eng.store.query(links, (ids[1], ids[3])) == [
            (ids[1], ids[0], ids[2]),
            (ids[3], ids[2], None),
        ]
        statements: list[str] = []
        eng.store._db.set_trace_callback(statements.append)
        try:
            assert eng.delete_page(ids[2])
        finally:
            eng.store._db.set_trace_callback(None)
        assert eng.store.query(links, (ids[1], ids[3])) == [
            (ids[1], ids[0], None),
            (ids[3], None, None),
        ]
        details = eng.store.query(
            "SELECT action, detail FROM audit WHERE item_kind = 'page' AND item_id = ?",
            (ids[2],),
        )
        assert {a for a, _ in details} == {"add", "update", "delete"}
        assert {d for _, d in details} == {"{}"}
        scans = [
            (sql, plan[3])
            for sql in statements
            if sql.startswith(("UPDATE", "DELETE"))
            for plan in eng.store.query(f"EXPLAIN QUERY PLAN {sql}")
            if plan[3].startswith(("SCAN pages", "SCAN audit"))
        ]
        assert not scans, scans
    finally:
        eng.close()
    assert not in_files(str(tmp_path / "c.sqlite3"), SECRET)


def test_a_chain_head_with_no_chain_id_is_unlinked_too(kit: Any, tmp_path: Path) -> None:
    """A page that heads its chain with no chain id of its own (its followers bear its page
    id: ``COALESCE(chain_id, page_id)`` in ``mtm.py``) is outside the chain's index: its link
    to a deleted follower is found by the follower's own ``prev_page``."""
    eng = kit.chain_engine(str(tmp_path / "h.sqlite3"), 4)
    try:
        ids = [eng.add("u", f"p{i}", f"r{i}", timestamp=float(i)).page_id for i in range(4)]
        eng.process_pending()
        eng.store.query("UPDATE pages SET chain_id = NULL WHERE page_id = ?", (ids[0],))
        assert eng.delete_page(ids[1])
        links = "SELECT page_id, prev_page, next_page FROM pages WHERE page_id IN (?, ?)"
        assert eng.store.query(links, (ids[0], ids[2])) == [
            (ids[0], None, None),
            (ids[2], None, None),
        ]
    finally:
        eng.close()

"""A write that arrives during a rewrite of the file waits at the store's gate, outside the
engine lock (``store/write_gate.py``).

Before the gate, the erasure thread's rewrite (``VACUUM``, seconds on a large store) held only
the store lock, but an engine write arriving meanwhile took the engine lock and then waited for
the store lock: every retrieval waited behind it (p99 ~1.1-1.3 s under writes). Now the writer
waits at the gate before it takes the engine lock, and retrievals answer throughout. The gate's
own rules are tested first (every wait is a ``join`` with a timeout: a deadlock fails, it does
not hang); then a real engine with its rewrite held open, as in
``tests/test_erasure_off_the_read_path.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.engine.state import EngineState
from memoryos_gpu.shared_gate import SharedGate
from memoryos_gpu.store.sqlite import SQLiteStore
from memoryos_gpu.store.write_gate import NO_REWRITES

WAIT_S = 10.0  # what must happen at once is given this long (never reached)
SHORT_S = 0.3  # how long something that must wait is watched waiting


def started(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``fn`` on a thread of its own; its result lands in the list."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def joined(t: threading.Thread, timeout: float = WAIT_S) -> bool:
    t.join(timeout)
    return not t.is_alive()


class Holder:
    """A thread inside ``cm`` (a context manager factory) until :attr:`leave` is set."""

    def __init__(self, cm: Callable[[], Any]) -> None:
        self.inside, self.leave = threading.Event(), threading.Event()

        def run() -> None:
            with cm():
                self.inside.set()
                self.leave.wait(WAIT_S)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


# ------------------------------------------------------------------------------ the gate
def test_users_overlap() -> None:
    gate = SharedGate()
    a, b = Holder(gate.enter), Holder(gate.enter)
    assert a.inside.wait(WAIT_S) and b.inside.wait(WAIT_S)  # both inside at once
    a.leave.set(), b.leave.set()
    assert joined(a.thread) and joined(b.thread)


def test_a_rewrite_waits_for_the_users_inside_and_holds_new_ones() -> None:
    gate = SharedGate()
    user = Holder(gate.enter)
    assert user.inside.wait(WAIT_S)
    rewrite = Holder(gate.exclusive)
    assert not rewrite.inside.wait(SHORT_S)  # a user is inside
    assert gate.exclusive_waiting
    newcomer = Holder(gate.enter)
    assert not newcomer.inside.wait(SHORT_S)  # a rewrite waits: new users wait behind it
    user.leave.set()
    assert rewrite.inside.wait(WAIT_S)  # the last user left: it runs
    assert not newcomer.inside.wait(SHORT_S)  # still held while it runs
    rewrite.leave.set()
    assert newcomer.inside.wait(WAIT_S)  # let in once it is done
    newcomer.leave.set()
    assert joined(user.thread) and joined(rewrite.thread) and joined(newcomer.thread)
    assert not gate.exclusive_waiting


def test_a_thread_inside_enters_again_without_waiting() -> None:
    gate = SharedGate()
    again, out = threading.Event(), threading.Event()
    waiting = threading.Event()

    def user() -> None:
        with gate.enter():
            waiting.wait(WAIT_S)  # a rewrite waits for this thread now
            with gate.enter():  # nested: must not wait for the rewrite that waits for it
                again.set()
        out.set()

    t = threading.Thread(target=user, daemon=True)
    t.start()
    rewrite = Holder(gate.exclusive)
    assert _until(lambda: gate.exclusive_waiting)
    waiting.set()
    assert again.wait(WAIT_S) and out.wait(WAIT_S)
    assert rewrite.inside.wait(WAIT_S)
    rewrite.leave.set()
    assert joined(t) and joined(rewrite.thread)


def test_an_entry_that_must_not_wait_does_not_wait() -> None:
    """``wait=False`` (the caller holds the engine lock): in while a rewrite waits, and while
    one runs; the rewrite waits for it to leave."""
    gate = SharedGate()
    user = Holder(gate.enter)
    assert user.inside.wait(WAIT_S)
    rewrite = Holder(gate.exclusive)
    assert _until(lambda: gate.exclusive_waiting)
    nowait = Holder(lambda: gate.enter(wait=False))
    assert nowait.inside.wait(WAIT_S)  # a rewrite waits: in all the same
    user.leave.set()
    assert not rewrite.inside.wait(SHORT_S)  # it waits for the no-wait entry too
    nowait.leave.set()
    assert rewrite.inside.wait(WAIT_S)
    during = Holder(lambda: gate.enter(wait=False))
    assert during.inside.wait(WAIT_S)  # a rewrite runs: in all the same
    during.leave.set(), rewrite.leave.set()
    for t in (user.thread, rewrite.thread, nowait.thread, during.thread):
        assert joined(t)


def test_no_rewrites_never_waits() -> None:
    with NO_REWRITES.exclusive(), NO_REWRITES.enter():
        assert not NO_REWRITES.exclusive_waiting


def _state(gate: SharedGate) -> EngineState:
    """An engine state with only what ``locked`` and ``using_store`` read."""
    s = EngineState.__new__(EngineState)
    s.lock, s.gate = threading.RLock(), gate
    return s


def test_the_engine_lock_holder_passes_the_gate_so_no_deadlock() -> None:
    """A, inside the gate, waits for the engine lock that B holds; a rewrite waits for A; B
    then needs the store (a nested write: ``locked``). B must not wait at the gate, or all
    three wait forever. B holds the lock directly (as a retrieval or the shard engine does),
    not through ``locked``: the state asks the lock itself whether B holds it."""
    gate = SharedGate()
    s = _state(gate)
    b_has_lock, b_go, a_inside = threading.Event(), threading.Event(), threading.Event()
    done: list[str] = []

    def b() -> None:
        with s.lock:
            b_has_lock.set()
            b_go.wait(WAIT_S)
            with s.locked(), s.using_store():  # nested: past the gate though a rewrite waits
                done.append("b")

    def a() -> None:
        with s.using_store():
            a_inside.set()
            with s.lock:  # waits for B
                done.append("a")

    tb = threading.Thread(target=b, daemon=True)
    tb.start()
    assert b_has_lock.wait(WAIT_S)
    ta = threading.Thread(target=a, daemon=True)
    ta.start()
    assert a_inside.wait(WAIT_S)
    rewrite = Holder(gate.exclusive)
    assert _until(lambda: gate.exclusive_waiting)
    b_go.set()
    assert joined(tb) and joined(ta), "deadlock: the engine lock holder waited at the gate"
    assert rewrite.inside.wait(WAIT_S)
    rewrite.leave.set()
    assert joined(rewrite.thread)
    assert done == ["b", "a"]


def test_locked_waits_at_the_gate_before_the_engine_lock() -> None:
    """A writer that comes during a rewrite waits at the gate holding nothing: the engine lock
    stays free for whoever reads memory only."""
    gate = SharedGate()
    s = _state(gate)
    rewrite = Holder(gate.exclusive)
    assert rewrite.inside.wait(WAIT_S)
    writer = Holder(s.locked)
    assert not writer.inside.wait(SHORT_S)
    assert s.lock.acquire(timeout=1.0), "the waiting writer holds the engine lock"
    s.lock.release()
    rewrite.leave.set()
    assert writer.inside.wait(WAIT_S)
    writer.leave.set()
    assert joined(writer.thread) and joined(rewrite.thread)


def _until(cond: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_only_a_file_store_has_a_gate(tmp_path: Path) -> None:
    assert SQLiteStore(":memory:").rewrite_gate is NO_REWRITES
    st = SQLiteStore(str(tmp_path / "s.sqlite3"))
    try:
        assert isinstance(st.rewrite_gate, SharedGate)
    finally:
        st.close()


# ------------------------------------------------------------------------------ end to end
class HeldRewrite:
    """The store's connection, except that ``VACUUM`` waits for :attr:`release` once begun
    (:attr:`started`): a rewrite as long as the test says, as a large file's is."""

    def __init__(self, store: SQLiteStore) -> None:
        self.real = store._db
        self.started, self.release = threading.Event(), threading.Event()
        store._db = self

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "VACUUM":
            self.started.set()
            self.release.wait(WAIT_S)
        return self.real.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture
def eng(tmp_path: Path) -> Iterator[MemoryEngine]:
    """Bob, alice and ~1.4 MB of file beside them (more than a deletion rewrites itself),
    with most of the fillers' derived work left pending (``auto_process`` off)."""
    e = MemoryEngine(
        EngineConfig(store=str(tmp_path / "s"), embedder="hashing", auto_process=False)
    )
    e.add_many(
        [{"user_id": "bob", "user_input": "my vault code is 1234", "agent_response": "ok"}]
        + [{"user_id": "alice", "user_input": f"I run marathons, session {i}."} for i in range(5)]
        + [
            {"user_id": f"f{i % 20}", "user_input": f"filler {i} " + "lorem ipsum " * 30}
            for i in range(600)
        ]
    )
    # one round now: its check of the store's derivation mode (a store read before the engine
    # lock, on an engine's first round) is behind it, and work is still pending for "flush"
    e.process_pending(max_rounds=1)
    assert e.pending_count()
    try:
        yield e
    finally:
        e.close()


def _retrieves_promptly(e: MemoryEngine, times: int = 5) -> None:
    """Retrievals, one after another over a second or more, each answering within 1 s."""
    for _ in range(times):
        t, got = started(lambda: e.retrieve_many([("alice", "marathons")], update_heat=False))
        assert joined(t, 1.0), "a retrieval waited for the rewrite (behind a writer)"
        assert got[0][0].all_pages()
        time.sleep(0.25)


#: Writes of each kind, given alice's first page (read before the rewrite): each touches the
#: store under the engine lock, so it waits for the rewrite, at the gate.
WRITES: dict[str, Callable[[MemoryEngine, int], Any]] = {
    "add": lambda e, _: e.add("alice", "I also swim on zebra mondays."),
    "flush": lambda e, _: e.flush(),
    "derived read": lambda e, _: e._derived.process_pending(max_rounds=1),
    "edit": lambda e, page: e.update_page(page, user_input="edited zebra text"),
    "promote": lambda e, _: e.promote("alice"),
    "delete": lambda e, page: e.delete_page(page),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_during_a_rewrite_waits_and_retrievals_answer(
    eng: MemoryEngine, write: str
) -> None:
    store = eng.store
    page = store.user_pages("alice")[0]["page_id"]  # a store read: before the rewrite
    held = HeldRewrite(store)
    try:
        assert eng.delete_page(store.user_pages("bob")[0]["page_id"])
        assert held.started.wait(WAIT_S), "the erasure thread's rewrite never began"
        writing, result = started(lambda: WRITES[write](eng, page))
        time.sleep(SHORT_S)  # at the gate by now
        _retrieves_promptly(eng)
        assert writing.is_alive(), "the write did not wait for the rewrite"
    finally:
        held.release.set()
    assert joined(writing), "the write never finished after the rewrite"
    assert result
    if write != "delete":  # a second deletion's rewrite waits for its turn (the spacing)
        assert _until(lambda: not store._erasure_due)
    store._db = held.real
    if write == "add":
        assert result[0].page_id in {p["page_id"] for p in store.user_pages("alice")}
        got = eng.retrieve_many([("alice", "zebra mondays")], update_heat=False)[0]
        assert "zebra mondays" in str(got.all_pages())


#: A shard engine's own writes (sharding.py, exchange.py, sharded_forget.py take the engine lock
#: themselves, around the engine's methods): each passes the gate before that lock too.
SHARD_WRITES: dict[str, Callable[[Any, int], Any]] = {
    "delete": lambda e, page: e.delete_page(page),
    "edit": lambda e, page: e.update_page(page, user_input="edited zebra text"),
    "keyword marks": lambda e, _: e.save_keywords([0]),
    "reanalyse": lambda e, page: e.reanalyse_pages([(page, "alice")]),
}


@pytest.mark.parametrize("write", list(SHARD_WRITES))
def test_a_shard_engines_write_during_a_rewrite_waits_and_retrievals_answer(
    tmp_path: Path, write: str
) -> None:
    from memoryos_gpu.distributed.sharding import ShardEngine

    e = ShardEngine(EngineConfig(store=str(tmp_path / "s"), embedder="hashing"), shard=0, count=1)
    try:
        e.add_many(
            [{"user_id": "bob", "user_input": "my vault code is 1234"}]
            + [
                {"user_id": "alice", "user_input": f"I run marathons, session {i}."}
                for i in range(5)
            ]
            + [{"user_id": f"f{i % 20}", "user_input": "lorem ipsum " * 30} for i in range(600)]
        )
        store = e.store
        page = store.user_pages("alice")[0]["page_id"]
        held = HeldRewrite(store)
        try:
            assert e.delete_page(store.user_pages("bob")[0]["page_id"])
            assert held.started.wait(WAIT_S), "the erasure thread's rewrite never began"
            writing, _ = started(lambda: SHARD_WRITES[write](e, page))
            time.sleep(SHORT_S)
            _retrieves_promptly(e)
            assert writing.is_alive(), "the write did not wait for the rewrite"
        finally:
            held.release.set()
        assert joined(writing), "the write never finished after the rewrite"
        store._db = held.real
    finally:
        e.close()

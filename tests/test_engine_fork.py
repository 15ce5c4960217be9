"""An engine in a forked child: gunicorn ``--preload``, Celery's prefork pool and
multiprocessing's fork start method hand the parent's open engine to every child.

Before, the child wrote silently through the parent's store connection and writer claim (the
parent's next add then failed with a raw ``UNIQUE constraint failed``), hung on a lock a
parent's thread held at the fork, and a child that merely closed the engine cleared the
parent's lock record. Now every call of an inherited engine raises
:class:`~memoryos_gpu.errors.EngineForkedError`, its close does nothing, and the parent goes on.
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu import EngineConfig, EngineForkedError, MemoryEngine, StoreLockedError
from memoryos_gpu.engine.state import INHERITED

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

#: One call of every public method of an engine, as a forked child would make it.
CALLS: dict[str, Callable[[MemoryEngine], Any]] = {
    "add": lambda e: e.add("alice", "from the child"),
    "add_many": lambda e: e.add_many([{"user_id": "alice", "user_input": "child"}]),
    "aadd_many": lambda e: asyncio.run(e.aadd_many([{"user_id": "alice", "user_input": "c"}])),
    "aflush": lambda e: asyncio.run(e.aflush()),
    "aretrieve_many": lambda e: asyncio.run(e.aretrieve_many([("alice", "tea")])),
    "arespond_many": lambda e: asyncio.run(e.arespond_many([("alice", "tea")])),
    "close": None,  # checked on its own: it must not raise (a with block's exit calls it)
    "count_derived_failure": lambda e: e.count_derived_failure(RuntimeError("x")),
    "delete_knowledge": lambda e: e.delete_knowledge(1),
    "delete_page": lambda e: e.delete_page(1),
    "delete_user": lambda e: e.delete_user("alice"),
    "export_user": lambda e: e.export_user("alice"),
    "flush": lambda e: e.flush(),
    "get_knowledge": lambda e: e.get_knowledge(1),
    "get_page": lambda e: e.get_page(1),
    "history": lambda e: e.history("alice"),
    "knowledge": lambda e: e.knowledge("alice"),
    "knowledge_sources": lambda e: e.knowledge_sources([1]),
    "list_pages": lambda e: e.list_pages("alice"),
    "page_text": lambda e: e.page_text({"user_input": "a", "agent_response": "b"}),
    "pending_count": lambda e: e.pending_count(),
    "process_pending": lambda e: e.process_pending(),
    "profile": lambda e: e.profile("alice"),
    "promote": lambda e: e.promote("alice"),
    "release_pending": lambda e: e.release_pending(),
    "respond": lambda e: e.respond("alice", "tea"),
    "respond_many": lambda e: e.respond_many([("alice", "tea")]),
    "retrieve": lambda e: e.retrieve("alice", "tea"),
    "retrieve_many": lambda e: e.retrieve_many([("alice", "tea")]),
    "stats": lambda e: e.stats(),
    "sync": lambda e: e.sync(),
    "update_knowledge": lambda e: e.update_knowledge(1, "x"),
    "update_page": lambda e: e.update_page(1, user_input="x"),
    "users": lambda e: e.users(),
    "validate_page": lambda e: e.validate_page({"user_id": "a", "user_input": "b"}),
    "write_behind": lambda e: e.write_behind(),
    "__enter__": lambda e: e.__enter__(),
    "store": lambda e: e.store.query("SELECT 1"),  # the store itself, reached around the API
}


def _public_methods() -> set[str]:
    names = {n for n in dir(MemoryEngine) if not n.startswith("_")}
    return {n for n in names if callable(getattr(MemoryEngine, n))} | {"__enter__"}


def _engine(store: Path) -> MemoryEngine:
    return MemoryEngine(EngineConfig(store=str(store), embedder="hashing", device="cpu"))


def _in_child(body: Callable[[], Any], timeout_s: float = 60) -> Any:
    """Run ``body`` in a forked child; its JSON result, or the failure the child reported.
    The child always ends with ``os._exit`` (never this test run's own teardown), and an
    alarm ends a child that hangs."""
    r, w = os.pipe()
    with warnings.catch_warnings():  # Python >= 3.12 warns of a fork beside threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(r)
        out = b"{}"
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
            signal.alarm(int(timeout_s))
            out = json.dumps({"ok": body()}).encode()
        except BaseException as exc:
            out = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        finally:
            os.write(w, out)
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"child ended by signal {os.WTERMSIG(status)} (a hang?)"
    result = json.loads(data or b"{}")
    assert "error" not in result, result["error"]
    return result["ok"]


def _refusals(engine: MemoryEngine) -> dict[str, str]:
    """In the child: what each call raised (the exception's type and message)."""
    said: dict[str, str] = {}
    for name, call in CALLS.items():
        if call is None:
            continue
        try:
            call(engine)
            said[name] = "no error"
        except BaseException as exc:
            said[name] = f"{type(exc).__name__}: {exc}"
    return said


def test_the_table_names_every_public_method() -> None:
    """A method added to the engine without a line here would go unchecked in a child."""
    assert _public_methods() <= set(CALLS), _public_methods() - set(CALLS)


def test_every_call_of_an_inherited_engine_refuses_and_the_parent_goes_on(tmp_path: Path) -> None:
    engine = _engine(tmp_path / "s")
    first = [engine.add("alice", f"before {i}").page_id for i in range(3)]
    said = _in_child(lambda: _refusals(engine))
    parent = os.getpid()
    for name, text in said.items():
        assert text.startswith("EngineForkedError: "), (name, text)
        assert f"opened in process {parent}" in text and "post_fork" in text, text
        assert "worker_process_init" in text, text
    # the parent: its next adds continue the sequence (the child's collided with them before)
    later = [engine.add("alice", f"after {i}").page_id for i in range(3)]
    assert later == [first[-1] + 1, first[-1] + 2, first[-1] + 3]
    assert engine.store.check_integrity() == []
    engine.close()
    with _engine(tmp_path / "s") as again:
        pages = again.list_pages("alice")[0]
    assert [p["page_id"] for p in pages] == first + later


def test_an_inherited_engine_is_an_engine_closed_error_too(tmp_path: Path) -> None:
    """A handler that maps EngineClosedError to 503 covers a child too."""
    from memoryos_gpu import EngineClosedError

    with _engine(tmp_path / "s") as engine:
        engine.add("alice", "hello")

        def check() -> bool:
            try:
                engine.retrieve("alice", "hello")
            except EngineClosedError as exc:
                return isinstance(exc, EngineForkedError)
            return False

        assert _in_child(check)


def test_closing_or_dropping_the_engine_in_a_child_leaves_the_parents_claim(
    tmp_path: Path,
) -> None:
    """Before, the child's close truncated the parent's lock record (a third process was then
    told "another process (it left no record yet)"); dropping the engine did so at GC."""
    store = tmp_path / "s"
    engine = _engine(store)
    engine.add("alice", "hello")
    lock = store / "memory.sqlite3.lock"
    record = lock.read_text()

    def close_twice() -> str:
        engine.close()
        engine.close()  # idempotent, quiet: a with block's exit or a shutdown hook calls it
        try:
            with engine:
                return "entered"
        except EngineForkedError:
            return "refused"

    def drop() -> int:
        nonlocal engine
        engine.close()
        del engine
        gc.collect()
        return len(INHERITED)

    assert _in_child(close_twice) == "refused"
    assert _in_child(drop) >= 1  # what the parent's engine held: kept, never finalized
    assert lock.read_text() == record
    third = subprocess.run(
        [sys.executable, "-c", _OPEN_SCRIPT, str(store)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"refused: store {store}" in third.stdout and f"pid {os.getpid()}" in third.stdout, (
        third.stdout + third.stderr
    )
    assert engine.add("alice", "still mine").page_id == 2
    engine.close()


_OPEN_SCRIPT = textwrap.dedent(
    """
    import sys
    from memoryos_gpu import EngineConfig, MemoryEngine, StoreLockedError
    try:
        MemoryEngine(EngineConfig(store=sys.argv[1], embedder="hashing", device="cpu"))
        print("opened")
    except StoreLockedError as exc:
        print("refused:", exc)
    """
)


def test_a_child_does_not_hang_on_a_lock_a_parents_thread_held_at_the_fork(
    tmp_path: Path,
) -> None:
    """A background thread inside ``add_many`` (the engine lock) or a derived round (the
    derived-work lease) at the fork: 15 of 20 children hung before."""
    with _engine(tmp_path / "s") as engine:
        engine.add("alice", "hello")
        held, release = threading.Event(), threading.Event()

        def holder() -> None:
            with engine._derived.lease(), engine._lock:
                held.set()
                release.wait(60)

        t = threading.Thread(target=holder)
        t.start()
        held.wait(10)
        try:
            said = _in_child(lambda: _refusals(engine), timeout_s=30)
        finally:
            release.set()
            t.join(10)
        assert all(text.startswith("EngineForkedError") for text in said.values()), said
        assert engine.retrieve("alice", "hello").stm[0].user_input == "hello"


def test_a_child_that_exits_normally_leaves_the_parents_store(tmp_path: Path) -> None:
    """A gunicorn worker ends with ``sys.exit``: the interpreter's shutdown collects what the
    child kept of the parent's engine, which must not touch the store or its lock either."""
    script = textwrap.dedent(
        """
        import gc, os, sys
        from memoryos_gpu import EngineConfig, EngineForkedError, MemoryEngine
        store = sys.argv[1]
        e = MemoryEngine(EngineConfig(store=store, embedder="hashing", device="cpu"))
        for i in range(20):
            e.add("alice", f"before {i}")
        record = open(store + "/memory.sqlite3.lock").read()
        pid = os.fork()
        if pid == 0:
            try:
                e.add("alice", "child")
            except EngineForkedError:
                e.close()
                del e
                gc.collect()
                sys.exit(0)
            sys.exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        with open(store + "/memory.sqlite3.lock") as f:
            assert f.read() == record
        ids = [e.add("alice", f"after {i}").page_id for i in range(20)]
        assert ids == list(range(21, 41)), ids
        assert e.store.check_integrity() == []
        e.close()
        with MemoryEngine(EngineConfig(store=store, embedder="hashing", device="cpu")) as e:
            print(len(e.list_pages("alice", 0, 100)[0]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "40", done.stdout + done.stderr


_POOL_ENGINE: MemoryEngine | None = None


def _pool_add(i: int) -> str:
    assert _POOL_ENGINE is not None
    try:
        _POOL_ENGINE.add(f"user{i}", "from a pool worker")
    except EngineForkedError as exc:
        return f"refused: {exc}"
    return "added"


def test_multiprocessing_fork_workers_are_refused(tmp_path: Path) -> None:
    """The Linux default start method before Python 3.14, Celery's prefork pool alike."""
    global _POOL_ENGINE
    _POOL_ENGINE = _engine(tmp_path / "s")
    try:
        _POOL_ENGINE.add("seed", "hello")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with multiprocessing.get_context("fork").Pool(2) as pool:  # its exit kills them
                said = pool.map_async(_pool_add, range(4)).get(timeout=120)  # before: hung
        assert all(s.startswith("refused: this MemoryEngine was opened in process") for s in said)
        assert _POOL_ENGINE.users() == ["seed"]
        assert _POOL_ENGINE.add("seed", "parent").page_id == 2
    finally:
        _POOL_ENGINE.close()
        _POOL_ENGINE = None


def test_an_engine_opened_after_the_fork_works_in_the_child(tmp_path: Path) -> None:
    """The remedy the refusal names: open the engine in the process that uses it."""
    with _engine(tmp_path / "parent") as engine:
        engine.add("alice", "hello")

        def own() -> list[int]:
            with _engine(tmp_path / "child") as mine:
                return [mine.add("bob", f"page {i}").page_id for i in range(3)]

        assert _in_child(own) == [1, 2, 3]
        assert engine.add("alice", "again").page_id == 2


def test_a_second_writer_in_a_child_is_still_refused_by_the_lock(tmp_path: Path) -> None:
    """A child that opens its own engine on the parent's store meets the writer lock, as
    before (the fork hook does not give the claim away)."""
    with _engine(tmp_path / "s") as engine:
        engine.add("alice", "hello")

        def second() -> str:
            try:
                _engine(tmp_path / "s")
            except StoreLockedError as exc:
                return str(exc)
            return "opened"

        assert f"is open for writing by pid {os.getpid()} " in _in_child(second)


def test_a_bare_store_in_a_forked_child_is_refused_and_its_close_leaves_the_parents(
    tmp_path: Path,
) -> None:
    """A store opened without an engine (a tool, a test, the store API) and inherited by a
    child: its statements are refused there, saying why, and the child's close neither clears
    the parent's lock record nor rewrites the parent's file (an erasure owed ran a VACUUM of
    the parent's database from the child)."""
    from memoryos_gpu.store import open_store
    from memoryos_gpu.store.errors import StoreClosedError

    path = str(tmp_path / "memory.sqlite3")
    st = open_store(path)
    with st.transaction() as db:
        db.execute("INSERT INTO meta VALUES ('k', 'parent')")
    record = Path(path + ".lock").read_text()
    st._rewrite_due = st._erasure_due = True  # as after a deletion (the rewrite owed)

    def child() -> dict[str, Any]:
        rewrote = []
        st._rewrite = lambda: rewrote.append(1) or True  # the VACUUM, marked instead
        try:
            st.query("SELECT 1")
            said = "no refusal"
        except StoreClosedError as exc:
            said = str(exc)
        st.close()
        return {"said": said, "rewrote": bool(rewrote), "closed": st._closed}

    out = _in_child(child)
    assert "is a fork of it" in out["said"] and "open the store again" in out["said"], out
    assert out["closed"] and not out["rewrote"], out
    assert Path(path + ".lock").read_text() == record  # the claim's record is the parent's
    with pytest.raises(StoreLockedError, match="this process"):
        open_store(path)  # the parent still holds the store, and says so
    assert st.get_meta("k") == "parent"
    st.set_meta("k", "after")  # the parent's connection and lock are untouched
    st._rewrite_due = st._erasure_due = False
    st.close()
    again = open_store(path)
    try:
        assert again.get_meta("k") == "after" and again.check_integrity() == []
    finally:
        again.close()

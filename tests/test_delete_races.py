"""Deletions racing other requests on the server's one shared engine (a tester's sweep found
each as a 500): the interleavings are forced here, by a hook at the step that lost the race,
not hoped for.

1. The log truncation after a committed delete ran without the store lock beside another
   thread's open statement ("database table is locked"), before memory followed the commit:
   the delete answered 500 and the deleted item kept being retrieved. A truncation that cannot
   run now (a reader on the log, an error) must not fail the delete, and is retried until the
   log no longer holds the deleted text.
2. An edit (or a second delete) of an item deleted between the route's ownership check and the
   engine call: 404 with a JSON body, never a 500 ``KeyError``.
3. A mem0 search ranking a retrieval's pages after one of them was deleted: the page is not a
   result (was a 500 ``KeyError``).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm.scripted import ScriptedBackend
from memoryos_gpu.mem0.ops import Mem0Ops

PAGE_MARK = "zqpagemark"  # in the first page's text only
FACT = "User owns a zqfactmark bike."  # the one fact promoted from the pages
FACT_MARK = "zqfactmark"
HOLD_S = 0.3  # how long a reader keeps its statement open once the delete reaches the log


def open_engine(store: Path, kit: Any) -> MemoryEngine:
    cfg = EngineConfig(
        memory=preset("paper", stm_capacity=1),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
        store=str(store),
        auto_process=False,
    )
    llm = ScriptedBackend(kit.Script(promotion={"user_facts": [FACT]}))
    return MemoryEngine(cfg, embedder=kit.TableEmbedder(), llm=llm)


@pytest.fixture
def eng(tmp_path: Path, kit: Any) -> Iterator[MemoryEngine]:
    """User ``u``: three pages (the first two in MTM, the fact derived from them)."""
    e = open_engine(tmp_path / "store.db", kit)
    lines = [f"I ride {PAGE_MARK} daily", "I ride to work", "I ride at night"]
    for i, line in enumerate(lines):
        e.add("u", line, "ok", timestamp=1.0 + i)
    e.flush()
    e.promote("u")
    e.flush()
    assert [k["text"] for k in e.knowledge("u")["user"]] == [FACT]
    try:
        yield e
    finally:
        e.close()


def entry_id(e: MemoryEngine) -> int:
    return e.knowledge("u")["user"][0]["entry_id"]


def delete(e: MemoryEngine, kind: str) -> tuple[bool, str]:
    """Delete an item of ``kind`` (or the user); (what the engine answered, the marker word of
    the text that must be gone)."""
    if kind == "page":
        return e.delete_page(1), PAGE_MARK
    if kind == "knowledge":
        return e.delete_knowledge(entry_id(e)), FACT_MARK
    return e.delete_user("u"), PAGE_MARK


def retrieved(e: MemoryEngine, kind: str) -> bool:
    """Whether the deleted item is still served (memory did not follow the commit)."""
    if kind == "user":
        return "u" in e.users()
    r = e.retrieve_many([("u", FACT)], update_heat=False)[0]
    if kind == "page":
        return 1 in {p.page_id for p in r.all_pages()}
    return FACT in [k.text for k in r.user_knowledge]


def log_holds(store: str, word: str) -> list[str]:
    """The store's files (database, log) that hold ``word``, byte for byte."""
    files = (Path(store), Path(f"{store}-wal"))
    return [f.name for f in files if f.exists() and word.encode() in f.read_bytes()]


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ====================================================================== 1. the log truncation
def reader_at_checkpoint(monkeypatch: pytest.MonkeyPatch, store: Any) -> None:
    """When the delete reaches the log truncation, another thread is reading through the
    shared connection, its statement open (as any store read is between its steps), for
    :data:`HOLD_S` or until the truncation returns."""
    original = store.checkpoint

    def checkpoint() -> None:
        opened, done = threading.Event(), threading.Event()

        def read() -> None:
            with store._lock:  # as store.query does
                cur = store._db.execute("SELECT event_id FROM audit")
                assert cur.fetchone() is not None  # more rows to come: the statement is open
                opened.set()
                done.wait(HOLD_S)
                cur.close()

        reader = threading.Thread(target=read)
        reader.start()
        assert opened.wait(10)
        try:
            original()
        finally:
            done.set()
            reader.join()

    monkeypatch.setattr(store, "checkpoint", checkpoint)


@pytest.mark.parametrize("kind", ["page", "knowledge"])
def test_delete_beside_a_reader_statement_is_done_and_forgotten(
    eng: MemoryEngine, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    reader_at_checkpoint(monkeypatch, eng.store)
    done, word = delete(eng, kind)
    assert done is True  # was OperationalError: database table is locked, as a 500
    assert not retrieved(eng, kind)  # was still retrieved: memory never followed the commit
    assert not log_holds(eng.store.path, word)


class FailingCheckpoints:
    """The store's connection, except that a log checkpoint fails (as it did beside an open
    statement; a disk error would too)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.failed = 0

    def execute(self, sql: str, *args: Any) -> Any:
        if "wal_checkpoint" in sql:
            self.failed += 1
            raise sqlite3.OperationalError("database table is locked")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


@pytest.mark.parametrize("kind", ["page", "knowledge", "user"])
def test_a_failed_truncation_neither_fails_the_delete_nor_keeps_the_item(
    eng: MemoryEngine, kind: str
) -> None:
    store = eng.store
    real = store._db
    store._db = failing = FailingCheckpoints(real)
    try:
        done, word = delete(eng, kind)
    finally:
        store._db = real
    assert done is True and failing.failed >= 1
    assert not retrieved(eng, kind)  # memory followed the commit
    # the truncation is retried, and then the log no longer holds the deleted text
    assert wait_until(lambda: not log_holds(store.path, word)), log_holds(store.path, word)
    assert Path(f"{store.path}-wal").stat().st_size == 0


@pytest.mark.parametrize("kind", ["page", "knowledge", "user"])
def test_a_reader_holding_the_log_delays_its_truncation_not_the_delete(
    eng: MemoryEngine, kind: str
) -> None:
    """Another process's open read keeps the log: the truncation cannot run (its ``busy``
    result, not an error). The delete answers at once, and the log is truncated once the
    reader is gone."""
    store = eng.store
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN")
    other.execute("SELECT COUNT(*) FROM pages").fetchall()  # a snapshot on the log
    answer: list[Any] = []
    deleting = threading.Thread(target=lambda: answer.append(delete(eng, kind)))
    try:
        deleting.start()
        deleting.join(5)
        assert not deleting.is_alive(), "the delete waited for a reader of the log"
    finally:
        other.execute("COMMIT")
        other.close()
        deleting.join()
    ((done, word),) = answer
    assert done is True and not retrieved(eng, kind)
    assert wait_until(lambda: not log_holds(store.path, word)), log_holds(store.path, word)
    assert Path(f"{store.path}-wal").stat().st_size == 0


# ====================================================================== 2. edits of a deleted item
@pytest.fixture
def client(eng: MemoryEngine) -> Iterator[Any]:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from served import serve

    with serve(eng, keys=None) as c:
        yield c


def lost_to_a_delete(monkeypatch: pytest.MonkeyPatch, e: MemoryEngine, verb: str) -> None:
    """The engine's ``verb`` runs only once a concurrent request deleted the item: as when
    that delete ran between the route's ownership check and this call."""
    original = getattr(e, verb)
    kind = "page" if verb.endswith("page") else "knowledge"
    remove = e.delete_page if kind == "page" else e.delete_knowledge

    def late(item_id: int, *args: Any, **kw: Any) -> Any:
        assert remove(item_id) is True
        return original(item_id, *args, **kw)

    monkeypatch.setattr(e, verb, late)


RACES = [  # (method, path, body, engine verb, status, body expected)
    ("PATCH", "/v1/users/u/pages/1", {"user_input": "new"}, "update_page", 404, "no page 1"),
    ("PATCH", "/v1/users/u/knowledge/{e}", {"text": "new"}, "update_knowledge", 404, "no kn"),
    ("PUT", "/v1/mem0/memories/page-1", {"text": "new"}, "update_page", 404, "Memory with"),
    ("PUT", "/v1/mem0/memories/knowledge-{e}", {"text": "new"}, "update_knowledge", 404, "Mem"),
    ("DELETE", "/v1/users/u/pages/1", None, "delete_page", 200, {"deleted": False}),
    ("DELETE", "/v1/users/u/knowledge/{e}", None, "delete_knowledge", 200, {"deleted": False}),
    ("DELETE", "/v1/mem0/memories/page-1", None, "delete_page", 404, "Memory with id page-1"),
    ("DELETE", "/v1/mem0/memories/knowledge-{e}", None, "delete_knowledge", 404, "Memory"),
]


@pytest.mark.parametrize(("method", "path", "body", "verb", "status", "said"), RACES)
def test_an_item_deleted_after_the_routes_check_is_not_found(
    eng: MemoryEngine,
    client: Any,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    verb: str,
    status: int,
    said: Any,
) -> None:
    """Was a 500 (``KeyError: 'no page 1'``) for an edit; a second delete answers as
    documented: ``{"deleted": false}``, and mem0's 404 as for any memory it does not hold."""
    path = path.format(e=entry_id(eng))
    lost_to_a_delete(monkeypatch, eng, verb)
    r = client.request(method, path, json=body)
    assert r.status_code == status, (r.status_code, r.text)
    if isinstance(said, dict):
        assert r.json() == said
    else:
        assert r.json()["error"] == "not_found" and r.json()["detail"].startswith(said)


def test_the_engine_names_a_missing_item_as_a_key_error(eng: MemoryEngine) -> None:
    from memoryos_gpu.errors import UnknownItemError

    eid = entry_id(eng)
    assert eng.delete_knowledge(eid) and eng.delete_page(1)
    for edit in (
        lambda: eng.update_page(1, user_input="x"),
        lambda: eng.update_knowledge(eid, "x"),
    ):
        with pytest.raises(UnknownItemError) as caught:
            edit()
        assert isinstance(caught.value, KeyError)  # as the engine raised before
        assert str(caught.value) in ("no page 1", f"no knowledge entry {eid}")


# ====================================================================== 3. mem0 search
def test_mem0_rank_leaves_out_a_page_deleted_after_the_retrieval(eng: MemoryEngine) -> None:
    r = eng.retrieve_many([("u", f"I ride {PAGE_MARK} daily")], update_heat=False)[0]
    assert {1, 2, 3} <= {p.page_id for p in r.all_pages()}
    assert eng.delete_page(1)
    items = Mem0Ops(eng).rank(r, "I ride", keep=lambda _: True, threshold=None, top_k=10)
    ids = [i["id"] for i in items]  # was KeyError: 1
    assert "page-1" not in ids and {"page-2", "page-3"} <= set(ids)


def test_mem0_search_racing_a_page_delete_answers_without_it(
    eng: MemoryEngine, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = client.app.state.service
    retrieve = service.retrieve
    raced: list[tuple[set[int], bool]] = []  # (the candidates retrieved, the delete's answer)

    async def then_deleted(*args: Any, **kw: Any) -> Any:
        r = await retrieve(*args, **kw)
        raced.append(({p.page_id for p in r.all_pages()}, await service.call(eng.delete_page, 1)))
        return r

    monkeypatch.setattr(service, "retrieve", then_deleted)
    r = client.post("/v1/mem0/search", json={"query": f"I ride {PAGE_MARK}", "user_id": "u"})
    assert r.status_code == 200, r.text  # was a 500: KeyError: 1
    # the race happened: page 1 was a candidate, then deleted before the ranking
    assert len(raced) == 1 and 1 in raced[0][0] and raced[0][1] is True
    ids = [i["id"] for i in r.json()["results"]]
    assert "page-1" not in ids and "page-2" in ids


# ====================================================================== 3. rebalanced rows
def test_a_deleted_users_rows_leave_no_copy_in_the_file(tmp_path: Path) -> None:
    """``secure_delete`` zeroes the cells a statement frees, but SQLite's rebalancing had left
    copies of the user's earlier row versions in the unallocated gap of a live ``pages`` leaf,
    beside another user's rows: found in the file after ``delete_user`` and ``close``. The
    erasure rewrites the file (``store/erasure.py``). (These rows' sizes put a copy there.)"""
    cfg = EngineConfig(store=str(tmp_path / "s"), embedder="hashing")
    bob = "My cat Zorblax number {} loves tuna. I live in Quuxville."
    with MemoryEngine(cfg) as e:
        for i in range(30):
            e.add_many(
                [
                    {
                        "user_id": "bob",
                        "user_input": bob.format(i),
                        "agent_response": f"Zorblax sounds great {i}",
                        "meta": {"tag": "zorbmeta"},
                    },
                    {
                        "user_id": "alice",
                        "user_input": f"I run marathons, session {i}. I live in Seattle.",
                        "agent_response": "ok",
                    },
                ]
            )
        e.flush()
        assert e.delete_user("bob")
        path = Path(e.store.path)
        assert b"Zorblax" not in path.read_bytes()  # when the deletion returns
        assert e.retrieve("alice", "marathons").pages  # the others' rows are intact
    assert b"Zorblax" not in path.read_bytes()


def test_rewrites_are_spaced_and_a_deletion_between_is_erased_by_the_next(
    tmp_path: Path,
) -> None:
    """A rewrite costs time in proportion to the file: one soon after the last waits (its
    share of the time, ``ERASURE_REWRITE_SHARE``), and the deletions meanwhile are erased by
    the next one, on the timer, or at close."""
    cfg = EngineConfig(store=str(tmp_path / "s"), embedder="hashing")
    with MemoryEngine(cfg) as e:
        for i in range(12):
            e.add_many([{"user_id": f"u{i}", "user_input": f"secret word{i}x here"}])
        store = e.store
        store.ERASURE_REWRITE_SHARE = 1e-6  # the next rewrite waits for (effectively) ever
        assert e.delete_user("u0")
        rewrites: list[float] = []
        store._rewrite = (lambda orig: lambda: rewrites.append(1) or orig())(store._rewrite)
        assert e.delete_user("u1")
        assert rewrites == [] and store._rewrite_due and store._erasure_due
    assert rewrites == [1]  # at close
    data = Path(store.path).read_bytes()
    assert b"word0x" not in data and b"word1x" not in data and b"word5x" in data

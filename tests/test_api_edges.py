"""Edges of the public API: ids of other integer types, derived work failing after an add
commits, a source another user holds, use after close, and the reference facade's timestamp 0
and shared-engine settings."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memoryos_gpu import compat
from memoryos_gpu.compat import Memoryos
from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import InvalidInputError, MemoryEngine
from memoryos_gpu.errors import EngineClosedError
from memoryos_gpu.llm.base import LLMBackendError
from memoryos_gpu.llm.scripted import ScriptedBackend


@pytest.fixture(autouse=True)
def _close_compat_engines() -> Any:
    yield
    compat.close_all()


def _file_engine(store: Path, **memory: Any) -> MemoryEngine:
    """An LLM-free engine on a SQLite file (hashing embedder, CPU arena)."""
    return MemoryEngine(
        EngineConfig(
            store=str(store),
            embedder="hashing",
            device="cpu",
            memory=preset("paper", **memory),
        )
    )


def _hashing_memo(path: Path, user: str, **kw: Any) -> Memoryos:
    from memoryos_gpu.embed import HashingEmbedder

    return Memoryos(
        user, data_storage_path=str(path), device="cpu", _embedder=HashingEmbedder(), **kw
    )


# ---------------------------------------------------------------- 1. item ids
def test_numpy_integer_ids_act_on_the_store(make_engine: Any) -> None:
    e = make_engine(mode="extractive", stm_capacity=1)
    for text in ["My bank password is hunter2", "I live in Oslo.", "I work as a pilot."]:
        e.add("u", text, "ok")
    first, second = (np.int64(p["page_id"]) for p in e.list_pages("u")[0][:2])
    assert e.update_page(second, user_input="I live in Bergen.")["user_input"] == (
        "I live in Bergen."
    )
    assert e.store.page_rows([int(second)])[int(second)]["user_input"] == "I live in Bergen."
    assert e.delete_page(first) is True
    assert e.store.page_rows([int(first)]) == {}  # gone from the store, not only from memory
    assert ("delete", int(first)) in [(h["action"], h["item_id"]) for h in e.history("u")]
    e.promote("u")
    entry = np.int64(e.knowledge("u")["user"][0]["entry_id"])
    assert e.get_knowledge(entry) is not None
    for blank in ("", "  \n\t"):  # was stored: a fact of no words
        with pytest.raises(InvalidInputError, match="text is blank"):
            e.update_knowledge(entry, blank)
    assert e.get_knowledge(entry)["text"].strip()
    assert e.delete_knowledge(entry) is True
    assert e.store.knowledge_rows([int(entry)]) == {}


@pytest.mark.parametrize("bad", [1.9, 2.0, "1", True, 0, -1, 2**63, 2**70, None])
def test_ids_of_other_types_or_out_of_range_are_refused(make_engine: Any, bad: Any) -> None:
    e = make_engine(mode="extractive")
    e.add("u", "page one", "ok")
    for call in (
        lambda: e.get_page(bad),
        lambda: e.update_page(bad, user_input="edited"),
        lambda: e.delete_page(bad),
        lambda: e.get_knowledge(bad),
        lambda: e.update_knowledge(bad, "edited"),
        lambda: e.delete_knowledge(bad),
        lambda: e.knowledge_sources([bad]),
    ):
        with pytest.raises(InvalidInputError, match=r"page_id|entry_id"):
            call()
    assert e.get_page(1)["user_input"] == "page one"  # nothing was edited
    assert [h["action"] for h in e.history("u")] == ["add"]


def test_promote_refuses_a_segment_slot_out_of_range(make_engine: Any) -> None:
    e = make_engine(mode="extractive")
    e.add("u", "page one", "ok")
    with pytest.raises(InvalidInputError, match="segment_slot"):
        e.promote("u", 10**6)


# ---------------------------------------------------------------- 2. derived work failing
class _FlakyBackend(ScriptedBackend):
    """A scripted LLM whose server is down (every batch raises) until ``down`` is cleared."""

    down = True

    def _generate_batch(self, requests: list) -> list:
        if self.down:
            raise LLMBackendError("server down")
        return super()._generate_batch(requests)


def test_add_returns_its_ids_when_the_inline_derived_work_fails(
    kit: Any, caplog: pytest.LogCaptureFixture
) -> None:
    llm = _FlakyBackend(kit.Script())
    cfg = EngineConfig(
        memory=preset("paper", stm_capacity=1),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
    )
    e = MemoryEngine(cfg, embedder=kit.TableEmbedder(), llm=llm)
    try:
        e.add("u", "first exchange", "ok")
        with caplog.at_level(logging.WARNING, logger="memoryos_gpu.engine"):
            r = e.add("u", "I moved to Oslo.", "ok")  # pushes page 1 out: the LLM stage runs
        assert r.page_id == 2 and not r.duplicate
        assert [p["user_input"] for p in e.list_pages("u")[0]] == [
            "first exchange",
            "I moved to Oslo.",
        ]
        assert e.pending_count("u") == 1  # kept for a retry
        assert e.stats()["counters"]["derived_failures"] == 1
        warned = [r for r in caplog.records if "server down" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        llm.down = False
        assert e.process_pending()["pages"] == 1
        assert e.pending_count("u") == 0
    finally:
        e.close()


def test_an_engine_opens_on_pending_work_its_llm_cannot_do(kit: Any, tmp_path: Path) -> None:
    cfg = EngineConfig(
        store=str(tmp_path / "s"),
        memory=preset("paper", stm_capacity=1),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
    )
    with MemoryEngine(cfg, embedder=kit.TableEmbedder(), llm=_FlakyBackend(kit.Script())) as e:
        e.add_many([{"user_id": "u", "user_input": t, "agent_response": "ok"} for t in "abc"])
        assert e.pending_count("u") == 2
    llm = _FlakyBackend(kit.Script())
    e = MemoryEngine(cfg, embedder=kit.TableEmbedder(), llm=llm)  # raised LLMBackendError
    try:
        assert e.pending_count("u") == 2 and e.stats()["counters"]["derived_failures"] == 1
        assert e.retrieve("u", "a").stm  # retrieval needs no LLM
        llm.down = False
        assert e.process_pending()["pages"] == 2
    finally:
        e.close()


# ---------------------------------------------------------------- 3. sources across users
def test_a_source_of_another_users_page_refuses_the_batch(make_engine: Any) -> None:
    e = make_engine(mode="extractive")
    mine = e.add("alice", "My PIN hint is blue", "ok", source="chat-alpha")
    with pytest.raises(InvalidInputError, match="belongs to another user's page") as info:
        e.add_many(
            [
                {"user_id": "bob", "user_input": "I live in Oslo", "source": "chat-beta"},
                {"user_id": "bob", "user_input": "I live in Bergen", "source": "chat-alpha"},
            ]
        )
    assert "chat-alpha" in str(info.value)
    assert not any(c.isdigit() for c in str(info.value))  # alice's page id is not told
    assert e.users() == ["alice"]  # nothing of the batch was written
    assert e.store.query("SELECT COUNT(*) FROM pages")[0][0] == 1
    with pytest.raises(InvalidInputError, match="another user's page"):  # within one batch
        e.add_many(
            [
                {"user_id": "carol", "user_input": "hello", "source": "chat-gamma"},
                {"user_id": "dave", "user_input": "hi", "source": "chat-gamma"},
            ]
        )
    assert e.users() == ["alice"]
    again = e.add("alice", "My PIN hint is blue", "ok", source="chat-alpha")
    assert again.duplicate and again.page_id == mine.page_id  # the owner's retry: idempotent


def test_a_page_for_a_user_of_another_assistant_is_refused(make_engine: Any) -> None:
    e = make_engine(mode="extractive")
    e.add("bob", "My cat is called Tom.", "Cute!", assistant_id="coach")
    e.add("bob", "I swim on Fridays.", "Nice.")  # no assistant given: the user's own
    with pytest.raises(InvalidInputError, match="belongs to assistant 'coach', not 'chef'"):
        e.add("bob", "I bake bread.", "Yum.", assistant_id="chef")  # was filed under coach
    with pytest.raises(InvalidInputError, match="belongs to assistant 'chef', not 'coach'"):
        e.add_many(  # a new user's first page names its assistant; a later one may not differ
            [
                {"user_id": "eve", "user_input": "hi", "assistant_id": "chef"},
                {"user_id": "eve", "user_input": "again", "assistant_id": "coach"},
            ]
        )
    assert e.users() == ["bob"]
    assert e.store.query("SELECT COUNT(*) FROM pages WHERE user_id = 'bob'")[0][0] == 2


# ---------------------------------------------------------------- 4. close
def test_close_is_idempotent_and_later_calls_say_the_engine_is_closed(tmp_path: Path) -> None:
    e = _file_engine(tmp_path / "memory.sqlite3")
    pid = e.add("alice", "I like tea", "ok").page_id
    e.close()
    e.close()
    for call in (
        lambda: e.add("alice", "x"),
        lambda: e.retrieve("alice", "tea"),
        lambda: e.stats(),
        lambda: e.users(),
        lambda: e.profile("alice"),
        lambda: e.export_user("alice"),
        lambda: e.get_page(pid),
        lambda: e.history("alice"),
        lambda: e.delete_page(pid),
        lambda: e.process_pending(),
    ):
        with pytest.raises(EngineClosedError):
            call()
    with _file_engine(tmp_path / "memory.sqlite3") as again:
        again.close()  # an explicit close inside a with block
    from memoryos_gpu.mem0 import Memory

    m = Memory({"store": str(tmp_path / "m0.sqlite3"), "embedder": "hashing", "device": "cpu"})
    m.close()
    m.close()


def test_an_add_that_commits_as_close_runs_is_acknowledged(tmp_path: Path) -> None:
    """close() landing between an add's commit and its derived work: the add returns its id
    (the page is stored), it does not raise."""
    e = _file_engine(tmp_path / "memory.sqlite3", stm_capacity=1)
    e.add("u", "page 0")
    accept = e._accept

    def accept_then_close(*args: Any) -> Any:
        results = accept(*args)
        e.close()
        return results

    e._accept = accept_then_close  # type: ignore[method-assign]
    r = e.add("u", "page 1")
    with _file_engine(tmp_path / "memory.sqlite3", stm_capacity=1) as again:
        assert [p["page_id"] for p in again.list_pages("u")[0]] == [1, r.page_id]


def test_adds_racing_close_are_stored_exactly_when_acknowledged(tmp_path: Path) -> None:
    e = _file_engine(tmp_path / "memory.sqlite3")
    acknowledged: list[int] = []
    errors: list[BaseException] = []

    def adder() -> None:
        for i in range(2000):
            try:
                acknowledged.append(e.add("u", f"page {i}").page_id)
            except BaseException as exc:
                errors.append(exc)
                return

    t = threading.Thread(target=adder)
    t.start()
    while len(acknowledged) < 5 and t.is_alive():
        threading.Event().wait(0.005)
    e.close()
    t.join(30)
    assert errors and isinstance(errors[0], EngineClosedError)
    with _file_engine(tmp_path / "memory.sqlite3") as again:
        stored = [p["page_id"] for p in again.list_pages("u", 0, 5000)[0]]
    assert stored == acknowledged


# ---------------------------------------------------------------- 5, 6. reference facade
def test_add_memory_timestamp_zero_is_the_epoch(tmp_path: Path) -> None:
    memo = _hashing_memo(tmp_path, "u")
    assert memo.engine.get_page(memo.add_memory("old event", "ok", timestamp=0))["timestamp"] == 0
    assert memo.engine.get_page(memo.add_memory("older", "ok", timestamp=0.0))["timestamp"] == 0


def test_a_second_facade_with_other_llm_settings_or_assistant_is_refused(tmp_path: Path) -> None:
    a = _hashing_memo(tmp_path, "u1")  # LLM-free
    with pytest.raises(ValueError, match="openai_base_url"):
        _hashing_memo(tmp_path, "u2", openai_base_url="http://127.0.0.1:9/v1", llm_model="m")
    same = _hashing_memo(tmp_path, "u2")
    assert same.engine is a.engine
    tutor = _hashing_memo(tmp_path, "carol", assistant_id="tutor")
    tutor.add_memory("I study French.", "Bien!")
    with pytest.raises(ValueError, match="assistant_id 'tutor'"):
        _hashing_memo(tmp_path, "carol", assistant_id="chef")
    assert _hashing_memo(tmp_path, "carol", assistant_id="tutor").engine is a.engine


# ---------------------------------------------------------------- arguments of other kinds
def test_arguments_of_the_wrong_kind_are_refused_by_name(make_engine: Any) -> None:
    from memoryos_gpu.mem0 import Memory

    e = make_engine(mode="extractive")
    e.add("u", "I moved to Oslo in 2021.", "Nice.", timestamp="2024-01-01T00:00:00Z")
    for call, says in (
        (lambda: e.retrieve_many(["u"]), r"\(user_id, query\) pairs"),  # was an unpack error
        (lambda: e.retrieve("u", "Oslo", top_pages="3"), "top_pages must be an integer"),
        (lambda: e.retrieve("u", "Oslo", top_segments=0), "top_segments must be between"),
        (lambda: e.retrieve("u", "Oslo", at="yesterday-ish"), "at: timestamp"),
        (lambda: e.add_many(None), "pages must be a list"),
        (lambda: e.add_many({"user_id": "u", "user_input": "x"}), "pages must be a list"),
    ):
        with pytest.raises(InvalidInputError, match=says):
            call()
    iso = e.retrieve("u", "Oslo", at="2024-06-01T00:00:00Z")
    epoch = e.retrieve("u", "Oslo", at=1717200000.0)  # the same instant
    assert [p.page_id for p in iso.all_pages()] == [p.page_id for p in epoch.all_pages()]
    m = Memory(engine=e)
    with pytest.raises(ValueError, match="metadata must be a dict"):
        m.add("I like tea.", user_id="u", metadata=["a"])
    with pytest.raises(ValueError, match="threshold must be a number"):
        m.search("tea", user_id="u", threshold="0.1")


def test_config_refuses_what_would_silently_misbehave(tmp_path: Path) -> None:
    from pydantic import ValidationError

    assert EngineConfig(store=tmp_path / "s").store == str(tmp_path / "s")  # a Path is a path
    with pytest.raises(ValidationError, match="not a store kind"):
        EngineConfig(store="sqlite:///x.db")  # was a directory named 'sqlite:'
    for bad in ({"theta": float("nan")}, {"tau": -1.0}, {"alpha": float("inf")}):
        with pytest.raises(ValidationError):
            preset("paper", **bad)


def test_an_answer_longer_than_a_page_is_returned_not_remembered(
    make_engine: Any, kit: Any
) -> None:
    from memoryos_gpu.engine.validation import MAX_TEXT_CHARS

    e = make_engine(script=kit.Script(response="x" * (MAX_TEXT_CHARS + 1)))
    r = e.respond("newbie", "tell me everything")  # raised InvalidInputError from add_many
    assert len(r.text) == MAX_TEXT_CHARS + 1 and r.page_id is None
    assert "over a page's limit" in r.error
    assert "newbie" not in e.users()

"""Inputs BAI-LAB MemoryOS code passes to ``memoryos.Memoryos`` that the compat facade must take
(or refuse clearly): a user another way in filed under its own assistant, opened with the
defaults; a ``meta_data`` that is not a dict; a timestamp that does not parse."""

from __future__ import annotations

import inspect
import time
import types
from pathlib import Path

import pytest

from memoryos_gpu import compat
from memoryos_gpu.compat import Memoryos
from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.embed import HashingEmbedder
from memoryos_gpu.engine import InvalidInputError
from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.llm.scripted import ScriptedBackend
from memoryos_gpu.mem0 import Memory
from memoryos_gpu.reference import DEFAULT_ASSISTANT_ID


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    compat.close_all()


def _memo(path: Path, user: str, *args: object, **kw: object) -> Memoryos:
    return Memoryos(user, None, str(path), *args, device="cpu", _embedder=HashingEmbedder(), **kw)


def _scripted() -> ScriptedBackend:
    return ScriptedBackend(
        {
            "page": {"continuous": False, "meta": "chat about planes", "summary": "planes"},
            "promotion": {
                "profile_updates": {},
                "user_facts": ["User likes planes."],
                "assistant_facts": ["Assistant recommended an air show."],
            },
            "response": "Planes!",
        }
    )


# ---------------------------------------------------------------------- 5. assistant_id
def test_a_user_filed_under_another_assistant_opens_with_the_default_assistant_id(
    tmp_path: Path,
) -> None:
    """The mem0 API files a new user under assistant 'default'; ``Memoryos(user)`` with the
    reference's defaults used to refuse that user (its default is 'default_assistant_profile')."""
    llm = _scripted()
    config = EngineConfig(
        memory=preset("paper", stm_capacity=1, tau=1.5),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
    )
    same = {"_engine_config": config, "llm_backend": llm}
    first = Memoryos("alice", data_storage_path=str(tmp_path), **same)
    mem0 = Memory(engine=first.engine)
    mem0.add("I like planes.", user_id="newu")
    mem0.add("I flew a glider.", user_id="newu")
    first.engine.process_pending()
    assert first.engine._users["newu"].assistant_id == "default"
    assert first.assistant_id == DEFAULT_ASSISTANT_ID  # a new user: the reference's default

    memo = Memoryos("newu", None, str(tmp_path), **same)  # the reference's defaults
    assert memo.assistant_id == "default"
    # assistant-level calls use the user's assistant: its knowledge, not the default's (none)
    summary = memo.get_assistant_knowledge_summary()
    assert [e["knowledge"] for e in summary] == ["Assistant recommended an air show."]
    assert first.get_assistant_knowledge_summary() == []
    assert memo.get_memory_stats()["assistant_knowledge_count"] == 1
    memo.add_memory("I also like helicopters.", "Nice.")
    assert memo.engine._users["newu"].assistant_id == "default"
    ctx = memo.retrieve_context("planes")
    assert [e["knowledge"] for e in ctx["retrieved_assistant_knowledge"]] == [
        "Assistant recommended an air show."
    ]
    # naming another assistant explicitly is still refused, the default's text included
    for named in (DEFAULT_ASSISTANT_ID, "chef"):
        with pytest.raises(ValueError, match="a user keeps one assistant") as err:
            Memoryos("newu", None, str(tmp_path), None, named, **same)
        assert "leave assistant_id out" in str(err.value)
    named = Memoryos("newu", None, str(tmp_path), None, "default", **same)
    assert named.assistant_id == "default"


def test_the_default_assistant_reads_as_the_reference_default(tmp_path: Path) -> None:
    default = inspect.signature(Memoryos).parameters["assistant_id"].default
    assert default == DEFAULT_ASSISTANT_ID and repr(default) == repr(DEFAULT_ASSISTANT_ID)
    memo = _memo(tmp_path, "bob")
    assert memo.assistant_id == DEFAULT_ASSISTANT_ID and type(memo.assistant_id) is str
    memo.add_memory("hi", "hello")
    assert memo.engine._users["bob"].assistant_id == DEFAULT_ASSISTANT_ID
    # None (config.json's "" too) counts as left out, as in the reference's settings
    assert _memo(tmp_path, "bob", None, None).assistant_id == DEFAULT_ASSISTANT_ID
    assert _memo(tmp_path, "bob", assistant_id="").assistant_id == DEFAULT_ASSISTANT_ID
    coach = _memo(tmp_path, "carol", assistant_id="coach")
    coach.add_memory("I run.", "Great.")
    assert _memo(tmp_path, "carol").assistant_id == "coach"


def test_a_user_filed_elsewhere_after_the_facade_opened_keeps_its_assistant(
    tmp_path: Path,
) -> None:
    memo = _memo(tmp_path, "late")  # not stored yet: the reference's default for now
    Memory(engine=memo.engine).add("I like planes.", user_id="late")  # filed under 'default'
    memo.add_memory("I like gliders too.", "Nice.")  # was: belongs to assistant 'default'
    assert memo.assistant_id == "default"
    assert [p["user_input"] for p in memo.engine.export_user("late")["pages"]] == [
        "I like planes.",
        "I like gliders too.",
    ]


# ---------------------------------------------------------------------- 6. meta_data
@pytest.mark.parametrize("bad", [[1], "channel=web", 5, ("a", "b"), [("k", "v")]])
def test_a_meta_data_that_is_not_a_dict_is_refused_by_name(tmp_path: Path, bad: object) -> None:
    memo = _memo(tmp_path, "u")
    with pytest.raises(InvalidInputError, match="meta_data must be a dict") as err:
        memo.add_memory("I like toads", "ok", meta_data=bad)
    assert isinstance(err.value, ValueError) and isinstance(err.value, MemoryOSError)
    assert memo.get_memory_stats()["short_term_count"] == 0  # nothing stored half-way


def test_a_meta_data_mapping_is_kept(tmp_path: Path) -> None:
    memo = _memo(tmp_path, "u")
    memo.add_memory("I like toads", "ok", meta_data=types.MappingProxyType({"channel": "web"}))
    memo.add_memory("I like frogs", "ok", meta_data={})
    memo.add_memory("I like newts", "ok", meta_data=None)
    (page, *_) = memo.engine.export_user("u")["pages"]
    assert page["extra"] == {"channel": "web"}


# ---------------------------------------------------------------------- 7. timestamps
@pytest.mark.parametrize("bad", ["2025/01/01 10:00:00", "next tuesday", "01/02/2025"])
def test_an_unparseable_timestamp_is_an_input_error(tmp_path: Path, bad: str) -> None:
    memo = _memo(tmp_path, "u")
    with pytest.raises(ValueError, match="timestamp") as err:  # was a bare MemoryOSError
        memo.add_memory("x", "y", timestamp=bad)
    assert isinstance(err.value, InvalidInputError) and isinstance(err.value, MemoryOSError)
    assert "'YYYY-MM-DD HH:MM:SS'" in str(err.value)  # the form that works
    assert memo.get_memory_stats()["short_term_count"] == 0


def test_the_reference_timestamp_forms_are_accepted(tmp_path: Path) -> None:
    memo = _memo(tmp_path, "u")
    now = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())  # the reference's get_timestamp()
    forms = [now, "2025-01-01 10:00", "2025-01-01T10:00:00", "2025-01-01T10:00:00Z", "1735725600"]
    for ts in forms:
        memo.add_memory(f"at {ts}", "ok", timestamp=ts)
    ctx = memo.retrieve_context("at")
    assert {p["timestamp"] for p in ctx["retrieved_pages"]} <= set(forms)
    with pytest.raises(ValueError, match="milliseconds"):
        memo.add_memory("x", "y", timestamp=1.7e15)

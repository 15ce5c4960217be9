"""A user sweep of the library API, mended: a closed ``compat.Memoryos`` refuses its calls while
a sibling facade keeps the shared engine open; ``meta`` keys that are not strings are refused
(the store kept them as strings, so live and stored reads disagreed); the configured counts a
native call takes as a C int, and ``knowledge_capacity``, are bounded when the config is built;
an empty ``source`` or ``assistant_id`` is refused, not read as none; ``list_pages`` takes NumPy
integers as page ids do; ``sync`` and ``write_behind`` after ``close`` raise."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from memoryos_gpu import compat
from memoryos_gpu.compat import Memoryos
from memoryos_gpu.config import MAX_COUNT, MAX_KNOWLEDGE_CAPACITY, EngineConfig, MemoryConfig
from memoryos_gpu.embed import HashingEmbedder
from memoryos_gpu.engine import InvalidInputError, MemoryEngine, validation
from memoryos_gpu.errors import EngineClosedError


@pytest.fixture(autouse=True)
def _close_compat_engines() -> Iterator[None]:
    yield
    compat.close_all()


def _engine(store: str = ":memory:") -> MemoryEngine:
    """An LLM-free engine (hashing embedder, CPU arena)."""
    return MemoryEngine(EngineConfig(store=store, embedder="hashing", device="cpu"))


def _page_count(engine: MemoryEngine) -> int:
    return engine.store.query("SELECT COUNT(*) FROM pages")[0][0]


# ---------------------------------------------------------------- 1. a closed compat facade
_FACADE_CALLS: dict[str, Callable[[Memoryos], Any]] = {
    "add_memory": lambda m: m.add_memory("I adopted a cat named Miso.", "ok"),
    "retrieve_context": lambda m: m.retrieve_context("cat"),
    "get_response": lambda m: m.get_response("What is my cat called?"),
    "get_user_profile_summary": lambda m: m.get_user_profile_summary(),
    "get_assistant_knowledge_summary": lambda m: m.get_assistant_knowledge_summary(),
    "force_mid_term_analysis": lambda m: m.force_mid_term_analysis(),
    "get_memory_stats": lambda m: m.get_memory_stats(),
}


@pytest.mark.parametrize("call", sorted(_FACADE_CALLS))
def test_a_closed_facade_refuses_while_a_sibling_keeps_the_engine_open(
    tmp_path: Path, call: str
) -> None:
    """``bob`` keeps the folder's engine open, so only the facade's own state can say that
    ``alice`` is closed: her calls went on reading and writing her memory."""
    alice = Memoryos("alice", None, str(tmp_path), device="cpu", _embedder=HashingEmbedder())
    bob = Memoryos("bob", None, str(tmp_path), device="cpu", _embedder=HashingEmbedder())
    alice.add_memory("I live in Oslo.", "ok")
    stored = _page_count(bob.engine)
    alice.close()
    with pytest.raises(EngineClosedError, match="this Memoryos is closed"):
        _FACADE_CALLS[call](alice)
    assert _page_count(bob.engine) == stored
    assert bob.add_memory("I work as a pilot.", "ok") >= 1  # the sibling is unaffected
    alice.close()  # still idempotent


# ---------------------------------------------------------------- 2. meta keys
@pytest.mark.parametrize(
    "meta",
    [{1: "a"}, {"outer": {2.5: "x"}}, {"rows": [{"ok": 1}, {None: 1}]}, {"t": ({True: 1},)}],
    ids=["int", "nested float", "in a list", "in a tuple"],
)
def test_meta_keys_that_are_not_strings_are_refused_before_anything_is_written(
    meta: dict[Any, Any],
) -> None:
    """The store keeps JSON, whose keys are strings: ``{1: "a"}`` came back from a live
    retrieval as given but from ``get_page`` (and every retrieval after a reopen) as
    ``{"1": "a"}``."""
    with _engine() as engine:
        with pytest.raises(InvalidInputError, match="meta keys must be strings"):
            engine.add("u", "hello", meta=meta)
        assert _page_count(engine) == 0


def test_meta_keys_are_checked_without_orjson_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """orjson is an extra: without it the keys are walked (at any depth)."""
    monkeypatch.setattr(validation, "_orjson", None, raising=False)
    with _engine() as engine:
        with pytest.raises(InvalidInputError, match="meta keys must be strings"):
            engine.add("u", "hello", meta={"a": [{"b": {3: "c"}}]})
        assert engine.get_page(engine.add("u", "kept", meta={"a": "b"}).page_id)["extra"] == {
            "a": "b"
        }


def test_meta_with_string_keys_and_what_only_the_fallback_encodes_is_kept() -> None:
    """What orjson refuses and JSON allows (an integer past 64 bits, a lone surrogate) still
    goes through the key walk and is stored; a non-string key beside it is still refused."""
    big = {"n": 2**70, "s": "\ud800", "deep": {"k": [1, {"x": None}]}}
    with _engine() as engine:
        page_id = engine.add("u", "hello", meta=big).page_id
        assert engine.get_page(page_id)["extra"]["n"] == 2**70
        with pytest.raises(InvalidInputError, match="meta keys must be strings"):
            engine.add("u", "again", meta={"n": 2**70, "deep": {7: "x"}})


# ---------------------------------------------------------------- 3. config bounds
@pytest.mark.parametrize(
    "field, top, low",
    [
        ("lexical_candidates", MAX_COUNT, 0),
        ("page_keywords", MAX_COUNT, 1),
        ("knowledge_capacity", MAX_KNOWLEDGE_CAPACITY, 1),
    ],
)
def test_counts_past_their_bound_are_refused_naming_the_field(
    field: str, top: int, low: int
) -> None:
    """``lexical_candidates`` or ``page_keywords`` of 2**31 built, then every retrieval failed
    with a native TypeError; ``knowledge_capacity`` of 10**12 failed the open with a
    MemoryError asking for 116 TiB."""
    for value in (2**31, 10**12, top + 1):
        with pytest.raises(ValidationError, match=field):
            MemoryConfig(**{field: value})
    assert getattr(MemoryConfig(**{field: top}), field) == top
    assert getattr(MemoryConfig(**{field: low}), field) == low


# ---------------------------------------------------------------- 4. empty ids
@pytest.mark.parametrize("field", ["source", "assistant_id"])
def test_an_empty_source_or_assistant_id_is_refused_not_read_as_none(field: str) -> None:
    """Two adds with ``source=""`` were both stored: the empty key was taken as no key."""
    with _engine() as engine:
        for text in ("first", "second"):
            with pytest.raises(InvalidInputError, match=f"{field} must be a non-empty string"):
                engine.add("u", text, **{field: ""})
        assert _page_count(engine) == 0
        assert engine.add("u", "none given", **{field: None}).page_id >= 1


# ---------------------------------------------------------------- 5. list_pages
def test_list_pages_takes_numpy_integers_as_page_ids_do() -> None:
    with _engine() as engine:
        for text in ("one", "two", "three"):
            engine.add("u", text)
        pages, total = engine.list_pages("u", np.int64(1), np.int32(1))
        assert total == 3
        assert [p["user_input"] for p in pages] == ["two"]
        for offset, limit in ((True, 1), (0, 1.0), (-1, 1), (0, 0), (0, 2**63)):
            with pytest.raises(InvalidInputError, match=r"^(offset|limit) must"):
                engine.list_pages("u", offset, limit)


# ---------------------------------------------------------------- 6. sync after close
@pytest.mark.parametrize("call", ["sync", "write_behind"])
def test_sync_and_write_behind_after_close_raise(call: str) -> None:
    """With nothing buffered they reached no store statement and returned as if written."""
    engine = _engine()
    engine.add("u", "hello")
    engine.close()
    with pytest.raises(EngineClosedError):
        getattr(engine, call)()

"""Edges of the Python library a caller meets outside the HTTP server: page metadata the caller
or a retrieval result could change after the fact, an engine dropped without ``close()``,
timestamps from NumPy or ``datetime``, and an empty store setting."""

from __future__ import annotations

import gc
import json
import pickle
import warnings
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu.engine.validation import MAX_META_DEPTH, InvalidInputError
from memoryos_gpu.store.writer import StoreLockedError

META = {"speaker": {"name": "Alice"}, "tags": ["a", {"deep": ["x"]}]}


def _meta() -> dict[str, Any]:
    return json.loads(json.dumps(META))  # a fresh nested copy each time


def _engine(store: str | Path = ":memory:") -> MemoryEngine:
    return MemoryEngine(EngineConfig(store=str(store), embedder="hashing", device="cpu"))


# -- nested meta: the engine's own, frozen copy ---------------------------------------------


def test_caller_changing_nested_meta_after_add_changes_no_retrieval() -> None:
    with _engine() as e:
        m = _meta()
        pid = e.add("u", "hello meta", meta=m).page_id
        m["speaker"]["name"] = "changed by the caller"
        m["tags"].append("more")
        m["tags"][1]["deep"].append("y")
        assert e.retrieve("u", "hello").stm[0].extra == META
        assert e.get_page(pid)["extra"] == META


def test_retrieved_extra_is_read_only_at_every_level() -> None:
    with _engine() as e:
        e.add_many([{"user_id": "u", "user_input": f"page {i}", "meta": _meta()} for i in range(3)])
        extra = e.retrieve("u", "page").stm[0].extra
        attempts = [
            lambda: extra["speaker"].__setitem__("name", "x"),
            lambda: extra["speaker"].update(name="x"),
            lambda: extra["tags"].append("x"),
            lambda: extra["tags"].extend(["x"]),
            lambda: extra["tags"].__setitem__(0, "x"),
            lambda: extra["tags"].pop(),
            lambda: extra["tags"].sort(),
            lambda: extra["tags"][1]["deep"].append("x"),
        ]
        for attempt in attempts:
            with pytest.raises(TypeError, match="read-only"):
                attempt()
        tags = extra["tags"]
        with pytest.raises(TypeError, match="read-only"):
            tags += ["x"]
        # nothing reached the engine's copy: every page of the user, and the JSON output
        assert [p.extra for p in e.retrieve("u", "page").stm] == [META] * 3
        body = json.loads(e.retrieve_many([("u", "page")], as_json=True)[0])
        assert [p["extra"] for p in body["stm"]] == [META] * 3  # arrays stay arrays
        assert [p["extra"] for p in e.list_pages("u")[0]] == [META] * 3


def test_extra_loaded_on_reopen_is_read_only_too(tmp_path: Path) -> None:
    with _engine(tmp_path) as e:
        e.add("u", "hello meta", meta=_meta())
    with _engine(tmp_path) as e:
        extra = e.retrieve("u", "hello").stm[0].extra
        with pytest.raises(TypeError, match="read-only"):
            extra["tags"].append("x")
        assert e.retrieve("u", "hello").stm[0].extra == META


def test_frozen_extra_still_behaves_as_plain_data() -> None:
    with _engine() as e:
        e.add("u", "hello meta", meta=_meta())
        r = e.retrieve("u", "hello")
        extra = r.stm[0].extra
        assert extra == META and pickle.loads(pickle.dumps(extra)) == META
        assert isinstance(extra["tags"], list) and r.to_dict()["stm"][0]["extra"] == META
        copy = json.loads(json.dumps(extra))  # a caller's way to a changeable copy
        copy["tags"].append("mine")
        assert e.retrieve("u", "hello").stm[0].extra == META


def test_meta_nested_to_the_limit_is_kept_and_one_level_more_refused() -> None:
    """A meta nests at most MAX_META_DEPTH levels (the meta itself is level 1): every way a
    page is served back recurses per level, so deeper is refused at write, never stored."""
    deep: Any = "leaf"
    for _ in range(MAX_META_DEPTH - 1):  # lists in lists, in {"d": ...}: the limit exactly
        deep = [deep]
    with _engine() as e:
        e.add("u", "deep", meta={"d": deep})
        assert e.retrieve("u", "deep").stm[0].extra == {"d": deep}
        with pytest.raises(InvalidInputError, match=f"the limit is {MAX_META_DEPTH}"):
            e.add("u", "deeper", meta={"d": [deep]})


# -- an engine dropped without close() ------------------------------------------------------


def test_engine_collected_without_close_gives_the_store_up(tmp_path: Path) -> None:
    cfg = EngineConfig(store=str(tmp_path), embedder="hashing", device="cpu")
    engine = MemoryEngine(cfg)
    engine.add("u", "hello")
    with pytest.warns(ResourceWarning, match="garbage-collected"):
        del engine
        gc.collect()
    with MemoryEngine(cfg) as again:  # refused (StoreLockedError) before the fix
        assert again.users() == ["u"]


def test_engine_of_this_process_still_open_is_named_in_the_refusal(tmp_path: Path) -> None:
    cfg = EngineConfig(store=str(tmp_path), embedder="hashing", device="cpu")
    with MemoryEngine(cfg) as first:
        first.add("u", "hello")
        with pytest.raises(StoreLockedError, match="this process") as refused:
            MemoryEngine(cfg)
        assert "not closed" in str(refused.value) and "close()" in str(refused.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # a closed engine warns nothing
        gc.collect()


# -- timestamps from NumPy and datetime -----------------------------------------------------

T = 1_700_000_000


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (np.int64(T), float(T)),
        (np.int32(T), float(T)),
        (np.uint64(T), float(T)),
        (np.float32(1.7e9), float(np.float32(1.7e9))),
        (np.float64(T + 0.5), T + 0.5),
        (datetime.fromtimestamp(T, UTC), float(T)),
        (datetime.fromtimestamp(T, timezone(timedelta(hours=2))), float(T)),
        (datetime.fromtimestamp(T, UTC).replace(tzinfo=None), float(T)),  # naive: UTC
        (date(2023, 11, 14), datetime(2023, 11, 14, tzinfo=UTC).timestamp()),
    ],
    ids=["int64", "int32", "uint64", "float32", "float64", "utc", "+02:00", "naive", "date"],
)
def test_numpy_and_datetime_timestamps_are_accepted(given: Any, expected: float) -> None:
    with _engine() as e:
        pid = e.add("u", "stamped", timestamp=given).page_id
        assert e.get_page(pid)["timestamp"] == expected
        assert e.retrieve("u", "stamped").stm[0].timestamp == expected


def test_naive_datetime_reads_as_a_naive_iso_string_does() -> None:
    naive = datetime(2023, 5, 8, 13, 56)
    with _engine() as e:
        a = e.add("u", "a", timestamp=naive).page_id
        b = e.add("u", "b", timestamp=naive.isoformat()).page_id
        assert e.get_page(a)["timestamp"] == e.get_page(b)["timestamp"]


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (np.int64(1_700_000_000_000), "milliseconds"),
        (np.float64("nan"), "parse"),
        (np.bool_(True), "timestamp"),
        (Decimal("1700000000"), "datetime"),
        (np.datetime64("2023-01-01"), "datetime"),
    ],
    ids=["ms-int64", "nan", "np-bool", "decimal", "datetime64"],
)
def test_bad_timestamps_are_still_refused(given: Any, says: str) -> None:
    with _engine() as e, pytest.raises(InvalidInputError, match=says):
        e.add("u", "x", timestamp=given)


# -- the store setting ----------------------------------------------------------------------


@pytest.mark.parametrize("store", ["", "   ", "\t\n"])
def test_empty_store_is_refused(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValidationError, match="store is empty") as refused:
        EngineConfig(store=store, embedder="hashing")
    for hint in ("directory", ".sqlite3", "postgresql://", ":memory:"):
        assert hint in str(refused.value)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- user ids of lookups
@pytest.mark.parametrize("bad", [None, 5, ["alice"], "", " "])
def test_every_user_lookup_checks_its_id(bad: Any) -> None:
    """delete_user, history, export_user, knowledge, list_pages and pending_count took the id
    straight to SQL or a dict: a list raised sqlite3's ProgrammingError or a TypeError (not a
    MemoryOSError a service catches), None quietly returned False or []."""
    from memoryos_gpu.errors import MemoryOSError

    e = MemoryEngine(EngineConfig(store=":memory:", embedder="hashing"))
    try:
        e.add("alice", "hello")
        for call in (
            e.delete_user,
            e.history,
            e.export_user,
            e.knowledge,
            e.list_pages,
            e.pending_count,
        ):
            if call == e.pending_count and bad is None:
                continue  # None: the whole store's
            with pytest.raises(MemoryOSError, match="user_id"):
                call(bad)
        assert e.history("alice") and e.pending_count("alice") == 0
    finally:
        e.close()


@pytest.mark.parametrize(
    ("first", "second"),
    [({"x": 1}, {"x": True}), ({"x": 1.0}, {"x": 1}), ({"n": {"x": 1}}, {"n": {"x": True}})],
)
def test_metas_equal_only_under_python_equality_are_kept_apart(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    """A user's pages with equal metas share one frozen copy; ``==`` takes True for 1, so a
    page added with ``{"x": True}`` after one with ``{"x": 1}`` showed ``1``."""
    e = MemoryEngine(EngineConfig(store=":memory:", embedder="hashing"))
    try:
        e.add("u", "first page", meta=first)
        e.add("u", "second page", meta=second)
        shown = {p.user_input: p.extra for p in e.retrieve("u", "page").stm}
        assert json.dumps(shown["first page"]) == json.dumps(first)
        assert json.dumps(shown["second page"]) == json.dumps(second)
    finally:
        e.close()

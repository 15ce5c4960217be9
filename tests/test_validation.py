"""``validate_pages``: the batch form of ``validate_page`` with a fast path for pages already in
normal form. It must give exactly what ``validate_page`` gives, page by page, whatever the
input (the same normalised page, or the same error)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.engine import InvalidInputError, validate_page, validate_pages
from memoryos_gpu.engine.validation import MAX_ID_CHARS, MAX_META_BYTES
from memoryos_gpu.formats.timestamps import MAX_EPOCH_S
from memoryos_gpu.types import PageInput

_TEXTS = st.one_of(
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),  # normal form
    st.text(max_size=12),  # control characters, surrogates, non-ASCII, ...
    st.sampled_from(["caf\u00e9", "e\u0301", "a\x00b", "tab\there", "line\nbreak", "\x7f", "\x85"]),
    st.none(),
    st.integers(),
)
_IDS = st.one_of(
    st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12),
    st.sampled_from(["", " ", "  ", "a b", "x" * (MAX_ID_CHARS + 1), "x" * MAX_ID_CHARS]),
    st.sampled_from(["id\x00", "\u00e9t\u00e9", "tab\t", "\ud800"]),
    st.none(),
    st.integers(),
)
_TIMES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.7e9, MAX_EPOCH_S, MAX_EPOCH_S + 1.0, 1.7e12, -1.0]),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.sampled_from(["2023-05-08", "1:56 pm on 8 May, 2023", "soon", True]),
)
_METAS = st.one_of(
    st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
    st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), st.floats(), st.none())),
    st.sampled_from(
        [{}, {"k": "v" * (MAX_META_BYTES // 6)}, {"k": "\u00e9" * (MAX_META_BYTES // 2)}]
    ),
    st.sampled_from([{"n": math.nan}, {"s": {1, 2}}, {1: "int key"}, ["not", "a dict"]]),
)


def _outcome(fn: Any, page: Any) -> Any:
    try:
        return fn(page)
    except InvalidInputError as exc:
        return ("error", str(exc))


_NORMAL = {  # values already in normal form, field by field
    "user_id": _IDS.filter(lambda v: isinstance(v, str) and v.isprintable() and v.isascii()),
    "user_input": st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    "agent_response": st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    "timestamp": st.floats(min_value=-6e10, max_value=2.5e11),
    "assistant_id": st.none(),
    "source": st.none(),
    "meta": st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
}
_ANY = {
    "user_id": _IDS,
    "user_input": _TEXTS,
    "agent_response": _TEXTS,
    "timestamp": _TIMES,
    "assistant_id": st.one_of(st.none(), _IDS),
    "source": st.one_of(st.none(), _IDS),
    "meta": _METAS,
}


@st.composite
def _pages(draw: Any) -> PageInput:
    """A page in normal form with up to two fields replaced by any value (so that each check
    of the fast path meets pages that differ from normal form in that field alone)."""
    fields = {k: draw(v) for k, v in _NORMAL.items()}
    for name in draw(st.lists(st.sampled_from(sorted(_ANY)), max_size=2)):
        fields[name] = draw(_ANY[name])
    return PageInput(**fields)


@settings(max_examples=600, deadline=None)
@given(_pages())
def test_validate_pages_gives_what_validate_page_gives(page: PageInput) -> None:
    one = _outcome(validate_page, page)
    many = _outcome(lambda p: validate_pages([p])[0], page)
    if isinstance(one, tuple):
        assert many == one
        return
    assert not isinstance(many, tuple), many
    assert many == one
    # and the result is in normal form: validating it again changes nothing
    assert validate_pages([many]) == [one]


_BASE = PageInput("alice", "I ran 10 km.", "Nice!", 1.7e9, None, None, {"a": "b"})


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"user_input": "a\x00b"},
        {"agent_response": "a\x07b"},
        {"agent_response": "caf\u00e9"},
        {"agent_response": None},
        {"timestamp": math.nan},
        {"timestamp": 1.7e12},
        {"timestamp": 1_700_000_000},
        {"timestamp": None},
        {"user_id": " "},
        {"user_id": "x" * (MAX_ID_CHARS + 1)},
        {"assistant_id": ""},
        {"source": "tab\t"},
        {"meta": {"k": 1}},
        {"meta": {"k": "\u00e9" * (MAX_META_BYTES // 2)}},  # over the limit once escaped
        {"meta": {"k": "v" * (MAX_META_BYTES - 100)}},  # under it: the slow path says so
    ],
)
def test_each_check_of_the_fast_path_agrees_with_validate_page(change: dict) -> None:
    page = dataclasses.replace(_BASE, **change)
    one = _outcome(validate_page, page)
    many = _outcome(lambda p: validate_pages([p])[0], page)
    if change.get("timestamp", 0.0) is None and not isinstance(one, tuple):
        many = dataclasses.replace(many, timestamp=one.timestamp)
    assert many == one


def test_a_page_in_normal_form_is_taken_as_it_is_and_others_are_normalised() -> None:
    normal = PageInput("alice", "I ran 10 km.", "Nice!", 1.7e9, None, "log#1", {"a": "b"})
    as_int = PageInput("alice", "I ran 10 km.", "Nice!", 1_700_000_000)
    dict_page = {"user_id": "bob", "user_input": "caf\u00e9", "timestamp": "2023-05-08"}
    out = validate_pages([normal, as_int, dict_page])
    assert out[0] is normal  # no copy, no re-encoding
    assert out[1] is not as_int and out[1].timestamp == 1.7e9 and type(out[1].timestamp) is float
    assert out[2] == validate_page(dict_page)


def test_a_bad_page_fails_the_batch_with_its_reason() -> None:
    good = PageInput("alice", "hello", "", 1.7e9)
    with pytest.raises(InvalidInputError, match="user_id"):
        validate_pages([good, PageInput(" ", "hello", "", 1.7e9)])
    with pytest.raises(InvalidInputError, match="milliseconds"):
        validate_pages([good, PageInput("alice", "hello", "", 1.7e12)])

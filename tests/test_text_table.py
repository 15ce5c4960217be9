"""The native table of page and knowledge texts (memoryos_gpu._C.TextTable, page_views.py)
against a dict: the same records after any sequence of puts, removals, text and link changes
(the table grows, probes collide and removals shift records back), every kind of str, and no
reference kept to a removed record's metadata."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu import _C
from memoryos_gpu.page_views import KnowledgeTexts, PageTable, PageView, token_quarters
from memoryos_gpu.types import ReadOnlyDict

# ASCII, Latin-1, BMP and astral code points: the four ways CPython stores a str
TEXTS = st.one_of(
    st.none(),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40),
    st.text(st.sampled_from("aé€😀\x00"), max_size=10),
)


def record(t0, t1, ts, extra, link) -> tuple:
    return (t0, t1, ts, extra, link, token_quarters(t0, t1))


@settings(max_examples=300, deadline=None)
@given(
    t0=TEXTS,
    t1=TEXTS,
    ts=st.floats(allow_nan=False),
    pid=st.integers(-(2**63), 2**63 - 1),
    link=st.integers(-1, 2**63 - 1),
)
def test_a_record_comes_back_as_it_went_in(t0, t1, ts, pid, link) -> None:
    table = _C.TextTable()
    extra = ReadOnlyDict({"speaker": "x"})
    table.put(pid, t0, t1, ts, extra, link)
    got = table.get(pid)
    assert got == record(t0, t1, ts, extra, link)
    assert got[3] is extra and table.link(pid) == link and table.link(pid ^ 1) is None
    for i, t in enumerate((t0, t1)):
        if t is not None:  # the same canonical str: equal, same length, same hash
            assert type(got[i]) is str and hash(got[i]) == hash(t) and len(got[i]) == len(t)
    assert pid in table and len(table) == 1 and table.get(pid ^ 1) is None


def test_many_puts_removals_and_edits_match_a_dict() -> None:
    rng = np.random.default_rng(7)
    ids = np.concatenate([np.arange(3000), [-5, 2**40, -(2**62), 2**63 - 1]]).astype(np.int64)
    table, model = _C.TextTable(), {}
    extras = [ReadOnlyDict({"k": str(i)}) for i in range(4)]
    for step in range(30_000):
        pid = int(rng.choice(ids))
        op = rng.random()
        if op < 0.5:
            rec = (
                f"in {step}",
                None if step % 3 else f"out {pid}",
                float(step),
                extras[step % 4],
                step % 7 - 1,
            )
            table.put(pid, *rec)
            model[pid] = record(*rec)
        elif op < 0.8:
            assert table.pop(pid) == (pid in model)
            model.pop(pid, None)
        elif op < 0.9:
            text = f"edited {step}"
            assert table.set_text(pid, step % 2, text) == (pid in model)
            if pid in model:
                texts = list(model[pid][:2])
                texts[step % 2] = text
                model[pid] = record(*texts, *model[pid][2:5])
        else:
            assert table.set_link(pid, step) == (pid in model)
            if pid in model:
                model[pid] = record(*model[pid][:4], step)
        if step % 5_000 == 0 or step == 29_999:
            assert len(table) == len(model)
            for i in ids.tolist():
                assert table.get(i) == model.get(i)
    assert len(model) > 1024  # the table grew past its first size


@settings(max_examples=200, deadline=None)
@given(
    held=st.sets(st.integers(-50, 50), max_size=30),
    changes=st.lists(st.tuples(st.integers(-60, 60), st.integers(-1, 2**63 - 1)), max_size=40),
)
def test_set_links_is_set_link_of_each_in_order(held, changes) -> None:
    """The batch form relinks exactly what ``set_link`` one at a time would (a later change of
    the same id wins, an id without a record is skipped) and counts the records it found."""
    one, many = _C.TextTable(), _C.TextTable()
    for t in (one, many):
        for pid in held:
            t.put(pid, "a", None, 0.0, None)
    found = sum(one.set_link(pid, link) for pid, link in changes)
    ids, links = [c[0] for c in changes], [c[1] for c in changes]
    assert many.set_links(ids, links) == found
    assert all(many.get(pid) == one.get(pid) for pid in held)
    with pytest.raises(ValueError, match="one link per id"):
        many.set_links(ids, [*links, 0])


def test_bad_texts_are_refused_and_leave_the_record() -> None:
    table = _C.TextTable()
    table.put(1, "a", "b", 0.0, None)
    with pytest.raises(TypeError, match="str or None"):
        table.put(1, b"bytes", "b", 0.0, None)
    with pytest.raises(TypeError, match="str or None"):
        table.set_text(1, 0, 5)
    with pytest.raises(IndexError):
        table.set_text(1, 2, "x")
    assert table.get(1) == ("a", "b", 0.0, None, -1, 2)


def test_metadata_is_released_with_its_record() -> None:
    extra = ReadOnlyDict({"k": "v"})
    before = sys.getrefcount(extra)
    table = _C.TextTable()
    for pid in range(2000):  # growth moves records, never their references
        table.put(pid, "a", "b", 0.0, extra)
    table.put(0, "a", "b", 0.0, ReadOnlyDict())  # replaced
    table.set_text(1, 1, "m")  # rewritten, metadata kept
    table.set_link(2, 5)  # relinked in place
    assert sys.getrefcount(extra) == before + 1999
    for pid in range(1000):
        table.pop(pid)
    assert sys.getrefcount(extra) == before + 1000
    del table
    gc.collect()
    assert sys.getrefcount(extra) == before


def test_the_python_views_speak_page_views_and_dicts() -> None:
    pages, knowledge = PageTable(), KnowledgeTexts()
    pages.put(np.int64(3), "hi", "there", 5, {"speaker": "a"}, chain_id=np.int64(8))
    assert pages[3] == PageView("hi", "there", 5.0, None, {"speaker": "a"}, 2)  # no chain yet
    pages.chains.put(8, "meta", None, 0.0, None)
    assert pages[3] == PageView("hi", "there", 5.0, "meta", {"speaker": "a"}, 3)
    assert isinstance(pages[3].extra, ReadOnlyDict) and np.int64(3) in pages and "3" not in pages
    knowledge.update({1: "one"})
    knowledge.update([(2, "two")])
    assert knowledge[1] == "one" and knowledge.get(3) is None and len(knowledge) == 2
    assert knowledge.pop(2) == "two" and knowledge.pop(2, "gone") == "gone"
    with pytest.raises(KeyError):
        knowledge[2]
    with pytest.raises(KeyError):
        pages[4]

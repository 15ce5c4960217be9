"""The native builder of a retrieval batch's objects against the Python rule
(tests/assembly_reference.py): same objects, same token counts, metadata shared, clear errors,
no references leaked."""

from __future__ import annotations

import gc
import sys
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.engine.assembly import _assembler, _hits, _profile_tokens
from memoryos_gpu.page_views import KnowledgeTexts, PageTable, PageView, approx_tokens
from memoryos_gpu.types import ReadOnlyDict
from tests.assembly_reference import assemble_reference


def page_view(user_input, agent_response, timestamp, meta, extra) -> PageView:
    """A page's view as the model of the tables holds it."""
    tokens = approx_tokens(user_input, agent_response, meta)
    return PageView(user_input, agent_response, timestamp, meta, ReadOnlyDict(extra), tokens)


def tables(views: dict, texts: dict) -> tuple[PageTable, KnowledgeTexts]:
    """The native tables holding the model's pages and entries: pages of equal meta on one
    chain record; of those without, every other one linked to a chain the table lacks (it
    shows no meta either)."""
    pages, knowledge = PageTable(), KnowledgeTexts()
    chain_of: dict[str, int] = {}
    for pid, v in views.items():
        if v.meta is None:
            chain = -1 if pid % 2 else 10**9 + pid
        else:
            chain = chain_of.setdefault(v.meta, len(chain_of))
            pages.chains.put(chain, v.meta, None, 0.0, None)
        pages.put(pid, v.user_input, v.agent_response, v.timestamp, v.extra, chain)
    knowledge.update(texts)
    return pages, knowledge


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)


@st.composite
def batches(draw):
    n_pages = draw(st.integers(0, 12))
    views = {
        pid: page_view(
            draw(TEXT),
            draw(TEXT),
            draw(st.floats(0, 1e9)),
            draw(st.one_of(st.none(), st.sampled_from(["", "chain one", "chain é"]), TEXT)),
            draw(st.dictionaries(st.sampled_from("ab"), TEXT, max_size=2)),
        )
        for pid in range(100, 100 + n_pages)
    }
    n_entries = draw(st.integers(0, 8))
    texts = {eid: draw(TEXT) for eid in range(5_000, 5_000 + n_entries)}
    b = draw(st.integers(0, 6))
    k = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def page_rows() -> np.ndarray:  # live ids first, -1 padding at the end of a row
        ids = np.full((b, k), -1, np.int64)
        for i in range(b):
            m = int(rng.integers(0, min(k, n_pages) + 1))
            ids[i, :m] = rng.choice(list(views) or [0], m, replace=False) if m else []
        return ids

    def entry_rows(width: int) -> np.ndarray:  # padding anywhere
        pool = np.array([*texts, -1, -1], np.int64)
        return rng.choice(pool, (b, width)) if texts else np.full((b, width), -1, np.int64)

    def scores(shape) -> np.ndarray:
        return rng.normal(size=shape).astype(np.float32)

    def some_pages() -> deque:
        return deque(rng.choice(list(views), int(rng.integers(0, 4))).tolist() if views else [])

    users = [SimpleNamespace(pending=some_pages(), stm=some_pages()) for _ in range(b)]
    uids = [draw(st.sampled_from(["u1", "u2", "x"])) for _ in range(b)]
    profiles = {"u1": {"city": "Oslo", "pet": "cat"}, "u2": {}}
    p, uk, ak = page_rows(), entry_rows(k), entry_rows(draw(st.integers(0, 4)))
    cleaned = [(u, f"query {i}") for i, u in enumerate(uids)]
    return (
        cleaned,
        users,
        views,
        texts,
        (scores(p.shape), p),
        (scores(uk.shape), uk),
        (
            scores(ak.shape),
            ak,
        ),
        profiles,
    )


def native(cleaned, users, views, texts, pages, uk, ak, profiles):
    """The native builder on tables made from the model ``views`` and ``texts``."""
    page_table, knowledge = tables(views, texts)
    return _assembler().batch(
        cleaned,
        users,
        page_table.table,
        page_table.chains,
        knowledge.table,
        *_hits(pages),
        *_hits(uk),
        *_hits(ak),
        profiles,
        _profile_tokens,
    )


@settings(max_examples=200, deadline=None)
@given(batch=batches())
def test_native_assembly_equals_the_python_rule(batch) -> None:
    got, got_tokens = native(*batch)
    want, want_tokens = assemble_reference(*batch)
    assert got == want and got_tokens == want_tokens
    views = batch[2]
    for r in got:
        for p in (*r.pages, *r.stm):
            assert p.extra is views[p.page_id].extra  # the metadata is shared, not copied
        assert all(e.sources is None for e in (*r.user_knowledge, *r.assistant_knowledge))
        r.profile["new"] = "x"  # each retrieval owns its profile copy
    assert "new" not in batch[7].get("u1", {})


def test_a_missing_view_or_text_raises_key_error_naming_it() -> None:
    views = {1: page_view("a", "b", 0.0, None, {})}
    one, none = np.zeros((1, 1), np.float32), np.array([[-1]])
    user = [SimpleNamespace(pending=deque(), stm=deque([1]))]

    def batch(pages, user_knowledge):
        return native([("u", "q")], user, views, {}, pages, user_knowledge, (one, none), {})

    with pytest.raises(KeyError, match="7"):
        batch((one, np.array([[7]])), (one, none))
    with pytest.raises(KeyError, match="9"):
        batch((one, np.array([[1]])), (one, np.array([[9]])))
    with pytest.raises(ValueError, match="int64"):  # int32 ids: the engine passes int64
        _assembler().batch(
            [("u", "q")],
            user,
            tables(views, {})[0].table,
            tables(views, {})[0].chains,
            KnowledgeTexts().table,
            np.array([[1]], np.int32),
            one,
            *_hits((one, none)),
            *_hits((one, none)),
            {},
            _profile_tokens,
        )


def test_a_class_that_is_not_a_slots_class_is_refused() -> None:
    import dataclasses

    from memoryos_gpu import _C
    from memoryos_gpu.types import KnowledgeEntry, Retrieval, RetrievedPage

    fields = [(f.name, f.type) for f in dataclasses.fields(RetrievedPage)]
    loose = dataclasses.make_dataclass("Loose", fields)  # the same fields, but in a __dict__
    for cls in (loose, type("Empty", (), {})):
        with pytest.raises(TypeError, match="slot"):
            _C.Assembler(cls, KnowledgeEntry, Retrieval, "mtm", "stm")


def test_no_reference_is_leaked() -> None:
    """The shared metadata, the query's strings and the STM's page ids end where they began,
    after many batches and after the tables are gone."""
    text = "".join(["leak check ", "text"])  # fresh objects, counted alone
    uid, query, stm_id = "".join(["u", "1"]), "".join(["q", "1"]), 10**12
    extra = ReadOnlyDict({"k": text})
    before = [sys.getrefcount(o) for o in (extra, uid, query, stm_id)]
    pages, knowledge = PageTable(), KnowledgeTexts()
    pages.chains.put(3, text, None, 0.0, None)
    pages.put(1, text, text, 0.0, extra, 3)
    pages.put(stm_id, text, text, 0.0, extra)
    knowledge.update({2: text})
    ids, e_ids = np.array([[1]]), np.array([[2]])
    sc = np.zeros((1, 1), np.float32)
    users = [SimpleNamespace(pending=deque(), stm=deque([stm_id]))]
    hits = (*_hits((sc, ids)), *_hits((sc, e_ids)), *_hits((sc, e_ids)))
    for _ in range(1_000):
        out, _ = _assembler().batch(
            [(uid, query)],
            users,
            pages.table,
            pages.chains,
            knowledge.table,
            *hits,
            {},
            _profile_tokens,
        )
        assert out[0].pages[0].extra is extra and out[0].stm[0].page_id is stm_id
        assert out[0].pages[0].meta == text and out[0].stm[0].meta is None
        del out
    gc.collect()
    del pages
    users.clear()
    assert [sys.getrefcount(o) for o in (extra, uid, query, stm_id)] == before

"""The schema versions whose term rows are split again on open, in both dialects, so an
upgraded store's old pages match new queries. Schema 10: the rows of pages with text outside
ASCII (scripts without spaces were split into letter pairs: a Chinese clause was one term);
ASCII pages keep their rows untouched. Schema 12: those of pages with an apostrophe too.
Schema 13: every row (a page in another language loses its language's stopwords)."""

from __future__ import annotations

from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.engine.page_text import page_terms_of
from memoryos_gpu.lexical import page_terms, terms_to_blobs

OLD_ROW = terms_to_blobs(page_terms(["stale"], None))[0]  # what the old split stored


def _engine(spec: str) -> MemoryEngine:
    return MemoryEngine(EngineConfig(store=spec, embedder="hashing", device="cpu"))


def _reopened(
    backend: Any, monkeypatch: pytest.MonkeyPatch, version: int, pages: list[dict]
) -> tuple[list[int], dict[int, bytes], list[dict]]:
    """``pages`` added to a store at schema ``version`` whose term rows are ``OLD_ROW`` (what the
    old split stored), then the store opened by this code at schema ``version + 1`` (that one
    migration): the pages' ids, their term rows now and their store rows."""
    import memoryos_gpu.store.sqlite_schema as sq

    spec = backend.spec(f"v{version}")
    monkeypatch.setattr(sq, "SCHEMA_VERSION", version)
    with _engine(spec) as engine:
        ids = [r.page_id for r in engine.add_many(pages)]
    st = backend.open(spec)
    with st.transaction() as db:
        db.executemany(
            "UPDATE page_vectors SET terms = ? WHERE page_id = ?", [(OLD_ROW, i) for i in ids]
        )
    st.close()
    monkeypatch.setattr(sq, "SCHEMA_VERSION", version + 1)
    with _engine(spec) as engine:
        assert engine.store.schema_version == version + 1
        return ids, engine.store.page_terms(ids), [engine.get_page(i) for i in ids]


def _split_now(page: dict) -> bytes:
    """The term row this code makes of a stored page."""
    row = (page["user_input"], page["agent_response"], page["timestamp"], page["extra"] or {})
    return terms_to_blobs(page_terms_of([row]))[0]


def test_an_upgraded_store_splits_its_non_ascii_pages_again(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = ["去年春天我领养了一只叫麻糬的猫。", "I adopted a cat named Mochi.", "मैं मैराथन दौड़ता हूँ"]
    pages = [{"user_id": "u", "user_input": t} for t in texts]
    ids, rows, stored = _reopened(backend, monkeypatch, 9, pages)
    assert rows[ids[1]] == OLD_ROW  # ASCII: split as before, not rewritten
    for i in (0, 2):
        assert rows[ids[i]] == _split_now(stored[i]) != OLD_ROW


def test_an_upgraded_store_splits_its_pages_with_an_apostrophe_again(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Schema 12: an elided article is a word of its own (``l'été``: ``l``, ``été``) and a page
    in another language has its date in that language's words too, so the rows of pages whose
    text holds an apostrophe (either kind, in either text or the speaker names) or anything
    outside ASCII are computed again; the others keep theirs."""
    pages = [
        {"user_id": "u", "user_input": "J'adore l'été à la plage."},
        {"user_id": "u", "user_input": "no apostrophe here"},
        {"user_id": "u", "user_input": "x", "agent_response": "C\u2019est l\u2019hôtel."},
        {"user_id": "u", "user_input": "y", "meta": {"user_name": "D'Artagnan"}},
        # no apostrophe, but not ASCII: it gets its language's date words now
        {"user_id": "u", "user_input": "Wir waren mit dem Hund am Strand, es war schön."},
    ]
    ids, rows, stored = _reopened(backend, monkeypatch, 11, pages)
    assert rows[ids[1]] == OLD_ROW  # neither: not rewritten
    for i in (0, 2, 3, 4):
        assert rows[ids[i]] == _split_now(stored[i]) != OLD_ROW


def test_an_upgraded_store_splits_every_page_again(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Schema 13: a page in another language loses that language's stopwords from its BM25
    row, and any page may be in one (this Spanish one is ASCII without an apostrophe), so
    every row is computed again."""
    pages = [
        {"user_id": "u", "user_input": "Mañana vamos con los niños a la playa."},
        {"user_id": "u", "user_input": "Manana vamos con los ninos a la playa de Malaga."},
        {"user_id": "u", "user_input": "We went to the beach with the kids."},
    ]
    ids, rows, stored = _reopened(backend, monkeypatch, 12, pages)  # 12 -> 13: every page
    for i in range(3):
        assert rows[ids[i]] == _split_now(stored[i]) != OLD_ROW


def test_pages_to_split_again_are_read_a_chunk_at_a_time(backend: Any) -> None:
    """The open splits the pages without a term row chunk by chunk, writing each chunk's rows
    before reading the next (schema 13 splits every page: one list held every page's text at
    once): each page comes once, in page-id order, however the writes go."""
    spec = backend.spec("chunks")
    with _engine(spec) as engine:
        ids = [
            r.page_id
            for r in engine.add_many(
                [{"user_id": "u", "user_input": f"page {i}"} for i in range(7)]
            )
        ]
    st = backend.open(spec)
    try:
        with st.transaction() as db:
            db.execute("UPDATE page_vectors SET terms = NULL")
        seen: list[list[int]] = []
        for chunk in st.iter_pages_without_terms(chunk=3):
            seen.append([r[0] for r in chunk])
            st.set_page_terms([(r[0], OLD_ROW) for r in chunk[:2]])  # one row of each left
        assert [len(c) for c in seen] == [3, 3, 1]
        assert [i for c in seen for i in c] == sorted(ids)
        left = [r[0] for chunk in st.iter_pages_without_terms(chunk=3) for r in chunk]
        assert left == [seen[0][2], seen[1][2]]  # the rows not written: read again
    finally:
        st.close()

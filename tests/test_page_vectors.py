"""A page's embedding and BM25 term row live in ``page_vectors`` (schema 6), beside the narrow
page row that a page's passage through the tiers rewrites: a store written before is migrated
with every vector kept (both dialects), and a page's vectors go wherever the page goes (a
deleted page or user leaves none behind)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store.rows import blob_matrix, emb_blob, emb_blobs


def _v5_pages(rng: np.random.Generator, dim: int) -> list[tuple]:
    """Rows of a schema-5 ``pages`` table: one per tier, one of them without a term row."""
    tiers = ["evicted", "mtm", "mtm", "pending", "stm"]
    return [
        (
            pid,
            "u",
            pid,
            f"in {pid}",
            f"out {pid}",
            float(pid),
            tier,
            emb_blob(rng.standard_normal(dim).astype(np.float32)),
            None if pid == 5 else np.arange(pid, dtype="<i4").tobytes(),
        )
        for pid, tier in enumerate(tiers, start=1)
    ]


def test_a_schema_5_store_keeps_every_pages_vectors(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memoryos_gpu.store.sqlite_schema as sq

    spec = backend.spec("v5")
    monkeypatch.setattr(sq, "SCHEMA_VERSION", 5)
    monkeypatch.setattr(sq, "REQUIRED_TABLES", sq.REQUIRED_TABLES - {"page_vectors", "claims"})
    st = backend.open(spec)
    rows = _v5_pages(np.random.default_rng(0), 8)
    with st.transaction() as db:
        st.ensure_users(db, [("u", "default")], 1.0)
        db.executemany(
            "INSERT INTO pages(page_id, user_id, seq, user_input, agent_response, timestamp, "
            "tier, embedding, terms, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
            rows,
        )
    st.close()
    # the migration to schema 6 (a later one, 13, sets every term row to be split again)
    monkeypatch.setattr(sq, "SCHEMA_VERSION", 6)
    st = backend.open(spec)
    try:
        assert st.schema_version == 6 and st.check_integrity() == []
        ids = [r[0] for r in rows]
        np.testing.assert_array_equal(
            st.page_embeddings(ids, 8),
            np.stack([np.frombuffer(r[7], "<f4") for r in rows]),
        )
        assert st.page_terms(ids) == {r[0]: r[8] for r in rows}
        for column in ("embedding", "terms"):  # the page row is the narrow one now
            with pytest.raises(Exception, match=column):
                st.query(f"SELECT {column} FROM pages")
        missing = [r[0] for chunk in st.iter_pages_without_terms() for r in chunk]
        assert missing == [5]  # not evicted, no row yet
        assert st.page_rows(ids)[3]["user_input"] == "in 3"
    finally:
        st.close()


def _engine(store: str) -> MemoryEngine:
    cfg = EngineConfig(
        store=store, memory=preset("paper", stm_capacity=2), embedder="hashing", device="cpu"
    )
    return MemoryEngine(cfg)


def _vector_ids(eng: MemoryEngine) -> set[int]:
    return {r[0] for r in eng.store.query("SELECT page_id FROM page_vectors")}


def test_a_pages_vectors_go_where_the_page_goes(tmp_path) -> None:
    """Every accepted page has one vectors row, through STM, pending and MTM; deleting a page
    or a user deletes their vectors (an embedding is derived from the text: erasure must take
    it too); an edited page's vectors are the new text's, after a reopen as well."""
    path = str(tmp_path / "s.sqlite3")
    eng = _engine(path)
    try:
        for u in ("alice", "bob"):
            for i in range(6):
                eng.add(u, f"{u} message {i} about hiking", "ok", timestamp=float(i))
        eng.process_pending()
        pages = {u: [p["page_id"] for p in eng.store.user_pages(u)] for u in ("alice", "bob")}
        assert _vector_ids(eng) == set(pages["alice"]) | set(pages["bob"])
        tiers = {p["tier"] for p in eng.store.user_pages("alice")}
        assert {"stm", "mtm"} <= tiers
        gone = pages["alice"][-1]
        assert eng.delete_page(gone)
        assert gone not in _vector_ids(eng)
        edited = pages["bob"][0]
        before = eng.store.page_embeddings([edited], eng.embedder.dim)[0]
        eng.update_page(edited, user_input="bob now talks about sailing")
        after = eng.store.page_embeddings([edited], eng.embedder.dim)[0]
        assert not np.array_equal(before, after)
        assert eng.store.page_terms([edited])[edited] != b""
        eng.delete_user("alice")
        assert _vector_ids(eng) == set(pages["bob"])
    finally:
        eng.close()
    eng = _engine(path)
    try:
        assert _vector_ids(eng) == set(pages["bob"])
        np.testing.assert_array_equal(
            eng.store.page_embeddings([edited], eng.embedder.dim)[0], after
        )
        hits = eng.retrieve_many([("bob", "sailing")], update_heat=False)[0].pages
        assert hits and hits[0].page_id == edited
    finally:
        eng.close()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 9),
    dim=st.integers(1, 40),
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    transposed=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_matrix_of_embeddings_makes_the_blobs_its_rows_make(
    n: int, dim: int, dtype: type, transposed: bool, seed: int
) -> None:
    """``emb_blobs`` (one conversion for a batch's matrix, its bytes sliced) writes what
    ``emb_blob`` writes row by row, for any float type and a non-contiguous matrix too, and
    ``blob_matrix`` reads them back."""
    m = np.random.default_rng(seed).standard_normal((dim, n) if transposed else (n, dim))
    m = (m.T if transposed else m).astype(dtype)
    blobs = emb_blobs(m)
    assert blobs == [emb_blob(row) for row in m]
    assert blobs == emb_blobs(list(m))  # a list of rows, as a batch's facts come
    np.testing.assert_array_equal(blob_matrix(blobs, dim), m.astype(np.float32))

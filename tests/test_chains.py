"""Dialogue chains keep their meta summary once, in a row of their own (schema 5): a growing
chain writes the same rows per page however long it is, every page shows the chain's newest
meta, a reopened engine shows the same, and a store written before the change is migrated
(both dialects)."""

from __future__ import annotations

from typing import Any

import pytest

from memoryos_gpu.engine import MemoryEngine


def _rows_written(eng: MemoryEngine) -> int:
    with eng.store.transaction() as db:
        return db.total_changes


def test_a_growing_chain_writes_the_same_rows_per_page(kit, tmp_path) -> None:
    n = 60
    eng = kit.chain_engine(str(tmp_path / "chain.sqlite3"), n)
    try:
        written = []
        for i in range(n):
            eng.add("u", f"p{i}", f"r{i}", timestamp=float(i))
            before = _rows_written(eng)
            eng.process_pending()
            written.append(_rows_written(eng) - before)
        # a page's round: its own rows, its segment, the previous page's link, the chain's
        # one row; rewriting the meta on every page of the chain grew this by one per page
        assert max(written[30:]) <= max(written[2:10])
        mtm = eng.store.user_pages("u", tier="mtm")
        assert len(mtm) == n - 1 and {p["meta"] for p in mtm} == {f"meta {n - 2}"}
        chain_rows = eng.store.query("SELECT chain_id, user_id, meta FROM chains")
        assert chain_rows == [(mtm[0]["page_id"], "u", f"meta {n - 2}")]
        shown = eng.retrieve_many([("u", "p3")], update_heat=False)[0]
        assert shown.pages and all(p.meta == f"meta {n - 2}" for p in shown.pages)
        assert eng.stats()["views"]["chains"] == 1
    finally:
        eng.close()
    again = kit.chain_engine(str(tmp_path / "chain.sqlite3"), n)
    try:
        shown = again.retrieve_many([("u", "p3")], update_heat=False)[0]
        assert shown.pages and all(p.meta == f"meta {n - 2}" for p in shown.pages)
    finally:
        again.close()


def test_deleting_a_chains_pages_removes_its_row(kit, tmp_path) -> None:
    eng = kit.chain_engine(str(tmp_path / "gone.sqlite3"), 4)
    try:
        ids = [eng.add("u", f"p{i}", f"r{i}", timestamp=float(i)).page_id for i in range(4)]
        eng.process_pending()
        for pid in ids[:2]:  # the first page's deletion re-derives the meta from the rest
            eng.delete_page(pid)
        [(meta,)] = eng.store.query("SELECT meta FROM chains")
        assert meta == "p2"  # the extractive rule: the first remaining page's first sentence
        assert eng.store.page_rows([ids[2]])[ids[2]]["meta"] == "p2"
        eng.delete_page(ids[2])  # the chain's last page (ids[3] is still in STM)
        assert eng.store.query("SELECT COUNT(*) FROM chains")[0][0] == 0
        assert eng.stats()["views"]["chains"] == 0
    finally:
        eng.close()


def _page_row(pid: int, seq: int, tier: str, chain: int | None, meta: str | None) -> tuple:
    return (pid, "u", seq, f"in {pid}", f"out {pid}", float(seq), tier, chain, meta, b"\0" * 4)


def test_a_schema_4_store_keeps_each_chains_newest_meta(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memoryos_gpu.store.sqlite_schema as sq

    spec = backend.spec("v4")
    monkeypatch.setattr(sq, "SCHEMA_VERSION", 4)
    monkeypatch.setattr(
        sq, "REQUIRED_TABLES", sq.REQUIRED_TABLES - {"chains", "page_vectors", "claims"}
    )
    st = backend.open(spec)
    rows = [
        _page_row(1, 0, "evicted", 1, "older meta"),
        _page_row(2, 1, "mtm", 1, "older meta"),
        _page_row(3, 2, "mtm", 1, "newest meta"),
        _page_row(4, 3, "mtm", 4, "alone"),
        _page_row(5, 4, "stm", None, None),
    ]
    with st.transaction() as db:
        st.ensure_users(db, [("u", "default")], 1.0)
        db.execute("UPDATE users SET chain_tail = 3, chain_meta = 'newest meta'")
        db.executemany(
            "INSERT INTO pages(page_id, user_id, seq, user_input, agent_response, timestamp, "
            "tier, chain_id, meta, embedding, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
            rows,
        )
    st.close()
    monkeypatch.undo()
    st = backend.open(spec)
    try:
        assert st.schema_version == sq.SCHEMA_VERSION and st.check_integrity() == []
        chains = st.query("SELECT chain_id, user_id, meta FROM chains ORDER BY chain_id")
        assert [tuple(r) for r in chains] == [(1, "u", "newest meta"), (4, "u", "alone")]
        got = st.page_rows([1, 2, 3, 4, 5])
        assert [got[p]["meta"] for p in range(1, 6)] == [*["newest meta"] * 3, "alone", None]
        with pytest.raises(Exception, match="meta"):  # the column is gone
            st.query("SELECT meta FROM pages")
        # the user's chain meta is read from its tail's chain, no longer kept as a copy
        assert st.user_row("u")["chain_meta"] == "newest meta"
        with pytest.raises(Exception, match="chain_meta"):
            st.query("SELECT chain_meta FROM users")
    finally:
        st.close()

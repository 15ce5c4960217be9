"""A store whose pages an LLM derived, with derived work pending (an LLM-mode ingest whose LLM
was down): a command opened without the LLM settings derived that work extractively for good,
silently -- ``retrieve`` too, which also waited minutes for a hung LLM before answering.
``retrieve`` now runs none of it, and an engine without an LLM that does run it says so."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memoryos_gpu.cli import cli
from memoryos_gpu.embed.hashing import HashingEmbedder
from memoryos_gpu.store import open_store


def llm_store(tmp_path: Path, make_engine: Any) -> str:
    """Pages derived by the (scripted) LLM, then a page whose derived work stays pending."""
    store = str(tmp_path / "s")
    e = make_engine(mode="llm", store=store, stm_capacity=2, embedder=HashingEmbedder())
    for i in range(5):
        e.add("u1", f"I went hiking on trail {i}", "Nice.", timestamp=1.7e9 + 60 * i)
    e.flush()
    e._hold_pending = True  # the LLM went down: what the next page owes stays pending
    e.add("u1", "I went hiking again", "Great.", timestamp=1.7e9 + 600)
    assert e.pending_count() > 0
    e.close()
    return store


def pending_of(store: str) -> tuple[int, int]:
    """(pending pages, pages derived extractively), read from the store alone."""
    st = open_store(store, writer=False)
    try:
        pages = st.query("SELECT COUNT(*) FROM pending WHERE kind = 'page'")[0][0]
        return pages, st.query("SELECT COUNT(*) FROM pages WHERE mode = 'extractive'")[0][0]
    finally:
        st.close()


def test_retrieve_runs_none_of_the_pending_work(tmp_path: Path, make_engine: Any) -> None:
    store = llm_store(tmp_path, make_engine)
    before = pending_of(store)
    assert before[0] > 0 and before[1] == 0
    args = ["retrieve", "--store", store, "--user", "u1", "hiking", "--embedder", "hashing"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert pending_of(store) == before


def test_an_engine_without_an_llm_says_it_derives_an_llm_stores_work(
    tmp_path: Path, make_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = llm_store(tmp_path, make_engine)
    with caplog.at_level(logging.WARNING, logger="memoryos_gpu.engine"):
        e = make_engine(mode="extractive", store=store, stm_capacity=2, embedder=HashingEmbedder())
    said = [r.getMessage() for r in caplog.records if "derived by an LLM" in r.getMessage()]
    assert len(said) == 1 and "derived extractively, for good" in said[0]
    assert e.pending_count() == 0  # it did derive it: the warning is the whole change


def test_whether_an_llm_derived_a_page_is_read_from_an_index(tmp_path: Path) -> None:
    """The question the warning asks reads the partial index ``pages_llm`` (schema 8), which
    an extractive store's pages stay out of: before, it read every page row of such a store
    (a large one's whole table) the first time an engine derived pending work."""
    st = open_store(str(tmp_path / "s"))
    try:
        plan = " ".join(str(r[-1]) for r in st.query("EXPLAIN QUERY PLAN " + st.LLM_DERIVED_SQL))
        assert "pages_llm" in plan, plan
        assert st.llm_derived() is False
    finally:
        st.close()

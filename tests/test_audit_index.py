"""Schema 11: a knowledge entry's audit events are indexed, so deleting an entry (or a page whose
facts go with it) blanks their detail through the index instead of scanning the whole audit
table under the engine lock (190 ms a deletion at 2 million events); page events, one a page
ingested, stay out of the partial index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine

FACTS = ["I live in Oslo with my sister.", "I work as a pilot for a small airline."]
EDITS = ["I live in Bergen with my sister.", "I fly a glider for a small club."]


def _audit_plans(db: Any, statements: list[str]) -> list[str]:
    """The query plan of each statement that writes the audit table (its parameters expanded
    by SQLite's trace), as one line each."""
    return [
        " ".join(str(r[-1]) for r in db.execute("EXPLAIN QUERY PLAN " + sql).fetchall())
        for sql in statements
        if sql.lstrip().upper().startswith("UPDATE AUDIT")
    ]


def _events_naming(db: Any, word: str) -> int:
    """How many audit events' detail holds ``word`` (an edit's event keeps the new text)."""
    sql = "SELECT COUNT(*) FROM audit WHERE detail LIKE ?"
    return db.execute(sql, (f"%{word}%",)).fetchone()[0]


def test_deleting_knowledge_blanks_its_events_through_the_index(
    make_engine: Any, tmp_path: Path
) -> None:
    e = make_engine(mode="extractive", stm_capacity=1, store=str(tmp_path / "s.sqlite3"))
    for text in [*FACTS, "Nothing else to say today."]:
        e.add("u", text, "ok")
    e.promote("u")
    entries = e.knowledge("u")["user"]
    assert len(entries) == 2
    sources = e.knowledge_sources([entries[1]["entry_id"]])[entries[1]["entry_id"]]
    for entry, text in zip(entries, EDITS, strict=True):  # an edit's event keeps its text
        e.update_knowledge(entry["entry_id"], text)
    db = e.store._db
    assert _events_naming(db, "Bergen") > 0 and _events_naming(db, "glider") > 0
    seen: list[str] = []
    db.set_trace_callback(seen.append)
    try:
        assert e.delete_knowledge(entries[0]["entry_id"]) is True
        assert e.delete_page(sources[0]) is True  # its fact goes with it (provenance)
    finally:
        db.set_trace_callback(None)
    plans = _audit_plans(db, seen)
    assert any("audit_knowledge" in p for p in plans), (seen, plans)
    assert not [p for p in plans if "SCAN audit" in p], plans
    assert e.knowledge("u")["user"] == []
    assert _events_naming(db, "Bergen") == _events_naming(db, "glider") == 0


def test_page_events_stay_out_of_the_partial_index(tmp_path: Path) -> None:
    spec = str(tmp_path / "s.sqlite3")
    with MemoryEngine(EngineConfig(store=spec, embedder="hashing", device="cpu")) as e:
        e.add_many([{"user_id": "u", "user_input": f"page {i}"} for i in range(20)])
        db = e.store._db
        events = db.execute("SELECT COUNT(*) FROM audit WHERE item_kind = 'page'").fetchone()[0]
        indexed = db.execute(
            "SELECT COUNT(*) FROM audit INDEXED BY audit_knowledge WHERE item_kind = 'knowledge'"
        ).fetchone()[0]
    assert events == 20 and indexed == 0


def test_an_upgraded_store_gains_the_index(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import memoryos_gpu.store.sqlite_schema as sq

    spec = backend.spec("v10")
    monkeypatch.setattr(sq, "SCHEMA_VERSION", 10)
    st = backend.open(spec)
    assert st.schema_version == 10
    st.close()
    monkeypatch.undo()
    st = backend.open(spec)
    try:
        assert st.schema_version == sq.SCHEMA_VERSION
    finally:
        st.close()
    db = backend.connect(spec)
    try:
        if backend.kind == "sqlite":
            sql = "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'audit'"
        else:
            sql = "SELECT indexname FROM pg_indexes WHERE tablename = 'audit'"
        names = {r[0] for r in db.execute(sql).fetchall()}
    finally:
        db.close()
    assert "audit_knowledge" in names

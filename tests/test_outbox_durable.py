"""A shard's assistant facts wait for their owner in the store (the ``outbox`` table), not in
the process: a shard, a router or a failed call between the promotion that found them and the
owner's commit lost them for good (their pages were marked analysed, so no later promotion
found them again). The Serve router's side is tested in tests/test_shard_sync_failures.py;
here the store (schema 13 -> 14, both dialects) and the in-process router
(:meth:`ShardedEngine.sync_shards`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_sharded_forget import ASSISTANT, assistant_texts, fact_waiting, sharded, talk, users

from memoryos_gpu.store import StoreError


def test_an_owner_that_fails_leaves_the_facts_for_the_next_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-process router took the facts from the outbox, the owner's commit failed, and
    the facts were gone; now they stay in the outbox, land with the next sync, once, and only
    then leave it."""
    victim, _, home = users()
    e = sharded(str(tmp_path / "store"))
    try:
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        owner = e.engines[e.shard_map.assistant_owner(ASSISTANT)]
        real = owner.append_assistant_facts
        calls: list[int] = []

        def fails_once(sent: Any) -> Any:
            calls.append(len(sent))
            if len(calls) == 1:
                raise StoreError("the owner's store failed")
            return real(sent)

        monkeypatch.setattr(owner, "append_assistant_facts", fails_once)
        shard = fact_waiting(e, victim, "zqoutboxkeep")
        waiting = shard.take_assistant_facts()
        assert any("zqoutboxkeep" in f.fact.text for f in waiting)
        with pytest.raises(StoreError, match="owner's store failed"):
            e.sync_shards()
        assert shard.take_assistant_facts() == waiting
        e.sync_shards()
        assert shard.take_assistant_facts() == []
        held = [t for t in assistant_texts(e, home) if "zqoutboxkeep" in t]
        assert len(held) == 1, held
        e.sync_shards()
        assert [t for t in assistant_texts(e, home) if "zqoutboxkeep" in t] == held
    finally:
        e.close()


def test_facts_in_the_outbox_outlive_the_engine(tmp_path: Path) -> None:
    """Closed (or killed) before any sync, the shards leave the facts in their stores, and
    the sharded engine opened again delivers them (its open syncs the shards)."""
    import sqlite3

    victim, _, home = users()
    store = str(tmp_path / "store")
    e = sharded(store)
    try:
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        path = fact_waiting(e, victim, "zqoutboxlives").store.path
    finally:
        for shard in e.engines:  # the shards alone: the sharded engine's close would sync
            shard.close()
    with sqlite3.connect(path) as db:
        waiting = db.execute("SELECT fact FROM outbox").fetchall()
    assert any("zqoutboxlives" in f for (f,) in waiting)
    e = sharded(store)
    try:
        e.sync_shards()
        assert [t for t in assistant_texts(e, home) if "zqoutboxlives" in t]
        assert e.engine_for(victim).take_assistant_facts() == []
    finally:
        e.close()


def test_deleting_the_user_deletes_its_waiting_facts(tmp_path: Path) -> None:
    """The user's rows in the outbox go with the user, in the deletion's transaction: their
    text is the user's (and a later sync would bring what the user taught back)."""
    victim, _, home = users()
    e = sharded(str(tmp_path / "store"))
    try:
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        shard = fact_waiting(e, victim, "zqoutboxgone")
        assert shard.store.query("SELECT COUNT(*) FROM outbox WHERE source_user = ?", (victim,))[0][
            0
        ]
        assert e.delete_user(victim)
        assert shard.store.query("SELECT COUNT(*) FROM outbox")[0][0] == 0
        e.sync_shards()
        assert not [t for t in assistant_texts(e, home) if "zqoutboxgone" in t]
    finally:
        e.close()


def test_a_schema_13_store_gains_the_outbox(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """13 -> 14 on both dialects: the outbox and the owners' marks, empty; ids of facts come
    from the store's allocator (never one an acknowledged fact had)."""
    import memoryos_gpu.store.sqlite_schema as sq

    spec = backend.spec("v13")
    monkeypatch.setattr(sq, "SCHEMA_VERSION", 13)
    st = backend.open(spec)
    assert st.schema_version == 13 and "outbox" not in st._table_names()
    st.close()
    monkeypatch.undo()
    st = backend.open(spec)
    try:
        assert st.schema_version == sq.SCHEMA_VERSION == 14
        assert {"outbox", "outbox_marks"} <= st._table_names()
        assert st.check_integrity() == []
        with st.transaction() as db:
            first = st.new_ids(db, "outbox", 2)
            db.executemany(
                "INSERT INTO outbox(fact_id, sender, source_user, fact) VALUES (?, 0, 'u', '[]')",
                [(i,) for i in first],
            )
        with st.transaction() as db:
            db.execute("DELETE FROM outbox")
            assert min(st.new_ids(db, "outbox", 1)) > max(first)
    finally:
        st.close()

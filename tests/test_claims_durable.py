"""Promotion claims are rows of the store (schema 7): the wave that makes a segment hot claims
its pages up to its own, and the promotion that runs later takes exactly those. A process killed
between the two (the round committed, its promotions not yet run) resumes with the same
promotions as a run that was never interrupted; held in memory, the claims were lost, and the
resumed promotions took every unanalysed page (later ones too) and merged a segment's queued
promotions into one. A store written at schema 6 is migrated (both dialects)."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine

TOPICS = {
    "running": ["marathon training long run pace", "running shoes marathon race"],
    "cooking": ["cooking pasta recipe sauce", "baking bread sourdough recipe"],
    "travel": ["travel trip japan tokyo flights", "travel hotel tokyo kyoto trip"],
    "pets": ["dog puppy walk vet", "puppy training dog treats"],
}

# The child: the pages in one batch with derived work held back, then a drain that is killed
# right after its first page round commits (its claims and promote rows with it), before any
# promotion runs.
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from memoryos_gpu.config import EngineConfig
    from memoryos_gpu.engine import MemoryEngine
    store, data = sys.argv[1], sys.argv[2]
    engine = MemoryEngine(EngineConfig(store=store, embedder="hashing", device="cpu",
                                       auto_process=False))
    engine.add_many(json.loads(open(data).read()))
    engine._process_promotions = lambda: os.kill(os.getpid(), signal.SIGKILL)
    engine.process_pending()
    """
)


def _records(users: int = 12, exchanges: int = 30, seed: int = 3) -> list[dict[str, Any]]:
    """Users who keep coming back to a few topics, so segments grow hot within one drain."""
    rng = random.Random(seed)
    out = []
    for u in range(users):
        mine = rng.sample(list(TOPICS), 2)
        for e in range(exchanges):
            topic = mine[(e // 4) % 2]
            phrase = rng.choice(TOPICS[topic])
            out.append(
                {
                    "user_id": f"user{u:02d}",
                    "user_input": f"Today I did {phrase}, part {e}.",
                    "agent_response": f"Noted about {phrase}; tell me more about {topic}.",
                    "timestamp": 1_700_000_000.0 + 3600.0 * e + u,
                    "source": f"u{u}:{e}",
                }
            )
    return out


def _config(store: Path) -> EngineConfig:
    return EngineConfig(store=str(store), embedder="hashing", device="cpu", auto_process=False)


def _derived(store: Path) -> dict[str, Any]:
    """Per user: the pages of each promotion in order, the pages analysed, live knowledge."""
    db = sqlite3.connect(f"file:{store / 'memory.sqlite3'}?mode=ro", uri=True)
    try:
        promotions: dict[str, list[int]] = {}
        for uid, detail in db.execute(
            "SELECT user_id, detail FROM audit WHERE action = 'promote' ORDER BY event_id"
        ):
            promotions.setdefault(uid, []).append(json.loads(detail)["pages"])
        analysed = sorted(db.execute("SELECT user_id, seq FROM pages WHERE analysed = 1"))
        knowledge = sorted(db.execute("SELECT owner_id, text FROM knowledge WHERE live = 1"))
        claims_left = db.execute("SELECT COUNT(*) FROM claims").fetchone()[0]
    finally:
        db.close()
    return {
        "promotions": promotions,
        "analysed": analysed,
        "knowledge": knowledge,
        "claims_left": claims_left,
    }


def test_a_kill_between_a_round_and_its_promotions_changes_no_promotion(tmp_path: Path) -> None:
    records = _records()
    data = tmp_path / "pages.json"
    data.write_text(json.dumps(records))

    base = tmp_path / "base"
    engine = MemoryEngine(_config(base))
    engine.add_many(records)
    engine.process_pending()
    engine.close()
    expected = _derived(base)
    # the workload reaches the case: some segment is promoted more than once in the drain
    assert any(len(p) > 1 for p in expected["promotions"].values())

    crashed = tmp_path / "crashed"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(crashed), str(data)], capture_output=True, timeout=300
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    db = sqlite3.connect(f"file:{crashed / 'memory.sqlite3'}?mode=ro", uri=True)
    queued = db.execute("SELECT COUNT(*) FROM pending WHERE kind = 'promote'").fetchone()[0]
    claimed = db.execute("SELECT COUNT(*) FROM claims").fetchone()[0]
    db.close()
    assert queued > 0 and claimed >= queued  # killed with claimed promotions still queued

    engine = MemoryEngine(_config(crashed))  # the reopen resumes the pending work
    engine.process_pending()
    engine.close()
    assert _derived(crashed) == expected
    assert expected["claims_left"] == 0  # applied promotions take their claims with them


def test_a_schema_6_store_gets_the_claims_table(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memoryos_gpu.store.sqlite_schema as sq

    spec = backend.spec("v6")
    monkeypatch.setattr(sq, "SCHEMA_VERSION", 6)
    monkeypatch.setattr(sq, "REQUIRED_TABLES", sq.REQUIRED_TABLES - {"claims"})
    st = backend.open(spec)
    assert "claims" not in st._table_names()
    st.close()
    monkeypatch.undo()
    st = backend.open(spec)
    try:
        assert st.schema_version == sq.SCHEMA_VERSION
        assert st.check_integrity() == []
        assert st.query("SELECT COUNT(*) FROM claims") == [(0,)]
    finally:
        st.close()


def test_an_evicted_segment_or_a_deleted_user_takes_its_claims(tmp_path: Path) -> None:
    """Claims go with their segment (the foreign key cascades): none is left to bind a later
    promotion of a segment that reuses nothing of it."""
    engine = MemoryEngine(_config(tmp_path / "s"))
    try:
        engine.add_many(_records(users=2, exchanges=30))
        engine.process_pending()
        user = "user00"
        engine.promote(user)  # every live segment of the user: claims made and released
        assert engine.store.query("SELECT COUNT(*) FROM claims") == [(0,)]
        sid = engine.store.query("SELECT segment_id FROM segments WHERE user_id = ?", (user,))
        with engine.store.transaction() as db:
            db.execute("INSERT INTO claims VALUES (?, 1, NULL)", (sid[0][0],))
        engine.delete_user(user)
        assert engine.store.query("SELECT COUNT(*) FROM claims") == [(0,)]
    finally:
        engine.close()

"""Crash safety: SIGKILL an ingesting process (tests/crash_child.py) at random times and at
precise points; after reopening, every acknowledged page is present exactly once, pending
derived work has been resumed and finished, nothing was applied twice, retrieval works; a
re-run completes the conversation with every page exactly once. Every test runs on a plain and
on an encrypted store (the child inherits ``$MEMORYOS_GPU_KEY``): encryption keeps the same
WAL and crash guarantees.
"""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from crash_child import LOCOMO, conversation, engine_config

from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store.encryption import ENV_KEY, connect, env_key

CHILD = Path(__file__).resolve().parent / "crash_child.py"
CONV = "conv-30"  # the shortest conversation of the dev split (192 pages)

pytestmark = pytest.mark.skipif(not LOCOMO.exists(), reason=f"{LOCOMO} is not available")
HAVE_SQLCIPHER = importlib.util.find_spec("sqlcipher3") is not None


@pytest.fixture(
    autouse=True,
    params=[
        "plain",
        pytest.param(
            "encrypted",
            marks=pytest.mark.skipif(not HAVE_SQLCIPHER, reason="needs the 'encryption' extra"),
        ),
    ],
)
def store_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on a plain store, then on one encrypted under ``$MEMORYOS_GPU_KEY`` (read by
    the child's EngineConfig and by the parent's checks alike)."""
    if request.param == "encrypted":
        monkeypatch.setenv(ENV_KEY, "crash test key")
    else:
        monkeypatch.delenv(ENV_KEY, raising=False)
    return request.param


def start_child(store: Path, acked: Path, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(store), str(acked), CONV, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()  # the engine is open (pending work resumed)
    if line != "ready":
        proc.kill()
        raise AssertionError(f"child did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc


def run_child(store: Path, acked: Path, *extra: str, timeout: float = 120) -> int:
    proc = start_child(store, acked, *extra)
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"child failed ({proc.returncode}): {err[-3000:]}")
    return proc.returncode


def acked_sources(acked: Path) -> list[str]:
    if not acked.exists():
        return []
    # a kill can interrupt the write of the last line: only whole lines were acknowledged
    text = acked.read_text(encoding="utf-8")
    lines = text.split("\n")
    return [s for s in (lines if text.endswith("\n") else lines[:-1]) if s]


def check_after_crash(store: Path, acked: Path) -> dict[str, int]:
    """Reopen after a crash and check every durability invariant; returns a few counts."""
    expected = [r.source for r in conversation(CONV)]
    # the file the crash left is sound, before anything repairs it
    raw, _ = connect(str(store), env_key())  # the plain or the SQLCipher connection
    assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    pending_at_crash = raw.execute("SELECT COUNT(*) FROM pending").fetchone()[0]
    raw.close()

    e = MemoryEngine(engine_config(str(store)))  # _rebuild resumes the pending work
    try:
        q = e.store.query
        assert e.pending_count() == 0
        assert q("SELECT COUNT(*) FROM pages WHERE tier = 'pending'") == [(0,)]
        counts = Counter(dict(q("SELECT source, COUNT(*) FROM pages GROUP BY source")))
        assert all(c == 1 for c in counts.values()), "a page is stored twice"
        assert None not in counts
        stored = [s for (s,) in q("SELECT source FROM pages ORDER BY seq")]
        acked_list = acked_sources(acked)
        assert set(acked_list) <= set(stored), "an acknowledged page was lost"
        # pages arrive in order, one at a time: the store holds a prefix of the conversation
        assert stored == expected[: len(stored)]
        assert len(stored) >= len(set(acked_list))
        n = len(stored)
        if n == 0:
            return {"pages": 0, "pending_at_crash": pending_at_crash}
        assert q("SELECT seq FROM pages ORDER BY seq") == [(i,) for i in range(n)]
        user = e._users[CONV]
        assert user.next_seq == n == q("SELECT next_seq FROM users")[0][0]
        # STM holds the newest pages; every older page was processed exactly once
        stm = [p for (p,) in q("SELECT page_id FROM pages WHERE tier = 'stm' ORDER BY seq")]
        newest = [p for (p,) in q("SELECT page_id FROM pages ORDER BY seq DESC LIMIT 3")]
        assert stm == newest[::-1] == list(user.stm)
        assert q(
            "SELECT COUNT(*) FROM pages WHERE tier IN ('mtm', 'evicted') AND "
            "(summary IS NULL OR chain_id IS NULL)"
        ) == [(0,)]
        for sid, n_pages in q("SELECT segment_id, n_pages FROM segments"):
            held = q("SELECT COUNT(*) FROM pages WHERE segment_id = ?", (sid,))[0][0]
            assert n_pages == held, f"segment {sid}: a page was applied twice (or lost)"
        assert q("SELECT COUNT(*) FROM audit WHERE action = 'add'") == [(n,)]
        # every promotion analysed fresh pages only: the pages it reports add up
        promoted = sum(
            json.loads(d)["pages"]
            for (d,) in q("SELECT detail FROM audit WHERE action = 'promote'")
        )
        assert promoted == q("SELECT COUNT(*) FROM pages WHERE analysed = 1")[0][0]
        heads = dict(q("SELECT user_id, knowledge_head FROM users"))
        rows = q("SELECT COUNT(*), MIN(seq), MAX(seq) FROM knowledge WHERE owner_id = ?", (CONV,))
        if rows[0][0]:
            assert rows[0] == (heads[CONV], 0, heads[CONV] - 1)
        # the arena matches the store
        mtm = q("SELECT COUNT(*) FROM pages WHERE tier = 'mtm'")[0][0]
        assert int(np.count_nonzero(e.arena.host("page_live"))) == mtm
        assert (
            int(np.count_nonzero(e.arena.host("seg_live")))
            == q("SELECT COUNT(*) FROM segments")[0][0]
        )
        # and retrieval works
        r = e.retrieve_many([(CONV, "Jon dance studio")], update_heat=False)[0]
        assert [p.page_id for p in r.stm] == stm
        assert bool(r.pages) == (mtm > 0)
        assert e.store.check_integrity() == []
        return {"pages": n, "pending_at_crash": pending_at_crash, "mtm": mtm}
    finally:
        e.close()


def test_random_sigkill_loses_nothing_and_does_nothing_twice(tmp_path: Path) -> None:
    store, acked = tmp_path / "crash.sqlite3", tmp_path / "acked.txt"
    progress = []
    for seed in range(4):
        proc = start_child(store, acked)
        time.sleep(random.Random(seed).uniform(0.05, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        got = check_after_crash(store, acked)
        progress.append(got["pages"])
    assert progress == sorted(progress)
    assert run_child(store, acked) == 0  # re-run to completion: duplicates are skipped
    got = check_after_crash(store, acked)
    expected = [r.source for r in conversation(CONV)]
    assert got["pages"] == len(expected)
    assert acked_sources(acked)[-len(expected) :] == expected


@pytest.mark.parametrize(
    "point",
    ["_accept:7", "_process_pages:9", "_process_promotions:3"],
    ids=["after-accept", "after-pages-commit", "after-promotion-commit"],
)
def test_kill_at_a_precise_point_then_finish(tmp_path: Path, point: str) -> None:
    """Killed right after a commit that leaves derived work behind; the reopen finishes it."""
    store, acked = tmp_path / "crash.sqlite3", tmp_path / "acked.txt"
    assert run_child(store, acked, "--limit", "40", "--kill-after", point) == -signal.SIGKILL
    got = check_after_crash(store, acked)
    if point.startswith("_accept"):
        # the 7th page was committed (not acknowledged: add never returned) and its derived
        # work (the page it pushed out of STM) was still pending
        assert got["pages"] == 7 and len(acked_sources(acked)) == 6
        assert got["pending_at_crash"] == 1
    assert run_child(store, acked, "--limit", "40") == 0
    assert check_after_crash(store, acked)["pages"] == 40


def test_keyword_statistics_survive_a_crash_after_acceptance(tmp_path: Path) -> None:
    store, acked = tmp_path / "crash.sqlite3", tmp_path / "acked.txt"
    assert run_child(store, acked, "--limit", "5") == 0  # clean close: statistics saved
    run_child(store, acked, "--limit", "20", "--kill-after", "_accept:9")
    e = MemoryEngine(engine_config(str(store)))
    try:
        pages = e.store.query("SELECT COUNT(*) FROM pages")[0][0]
        assert pages == 9
        assert e.extractor.n_docs == pages
    finally:
        e.close()

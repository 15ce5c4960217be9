"""The order of a derived-work round (memoryos_gpu/store/rounds.py): held to the SQL window
query that computed it before (waves per user, tenants in turn within a wave, queue order),
run by SQLite on the same pending items."""

from __future__ import annotations

import sqlite3

from hypothesis import given, settings
from hypothesis import strategies as st
from store_backends import Backend

from memoryos_gpu.store.rounds import round_order

TENANT = (
    "CASE WHEN instr(user_id, '/') > 0 THEN substr(user_id, 1, instr(user_id, '/') - 1) ELSE '' END"
)
WINDOWS = (
    f"SELECT work_id FROM (SELECT work_id, wave, ROW_NUMBER() OVER (PARTITION BY wave, {TENANT} "
    "ORDER BY work_id) AS turn FROM (SELECT work_id, user_id, ROW_NUMBER() OVER (PARTITION BY "
    "user_id ORDER BY work_id) AS wave FROM pending)) WHERE wave <= ? "
    "ORDER BY wave, turn, work_id LIMIT ?"
)
USERS = ["a", "b", "ab", "t/a", "t/b", "u/a", "t/", "/x", "t/a/b", "é/1", "é"]


def _by_sql(users: list[str], per_user: int, limit: int) -> list[int]:
    db = sqlite3.connect(":memory:")
    try:
        db.execute("CREATE TABLE pending(work_id INTEGER PRIMARY KEY, user_id TEXT)")
        db.executemany("INSERT INTO pending VALUES (?, ?)", enumerate(users))
        return [r[0] for r in db.execute(WINDOWS, (per_user, limit))]
    finally:
        db.close()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(USERS), max_size=40),
    st.integers(1, 6),
    st.integers(1, 50),
)
def test_round_order_is_the_window_querys(users: list[str], per_user: int, limit: int) -> None:
    assert round_order(users, per_user, limit).tolist() == _by_sql(users, per_user, limit)


def test_nothing_pending_or_nothing_asked() -> None:
    assert round_order([], 3, 10).size == 0
    assert round_order(["a", "b"], 1, 0).size == 0


def test_the_store_reads_a_round_of_its_own_pending_items(backend: Backend) -> None:
    """``pending_round`` returns the rows (work_id, user_id, ref) in that order, one kind."""
    st_ = backend.open(backend.spec("rounds"))
    try:
        with st_.transaction() as db:
            st_.ensure_users(db, [(u, "bot") for u in ("x/a", "x/b", "y/c")], 1.0)
            db.executemany(
                "INSERT INTO pending(user_id, kind, ref, created) VALUES (?, ?, ?, 0)",
                [
                    ("x/a", "page", 1),
                    ("x/a", "page", 2),
                    ("x/b", "page", 3),
                    ("y/c", "promote", 9),
                    ("y/c", "page", 4),
                ],
            )
        got = st_.pending_round("page", 10, per_user=2)
        assert [(u, ref) for _, u, ref in got] == [("x/a", 1), ("y/c", 4), ("x/b", 3), ("x/a", 2)]
        assert len({w for w, _, _ in got}) == 4  # each row its own work item
        firsts = st_.pending_round("page", 2, per_user=1)
        assert [(u, ref) for _, u, ref in firsts] == [("x/a", 1), ("y/c", 4)]
    finally:
        st_.close()

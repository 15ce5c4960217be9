"""The order of a derived-work round (memoryos_gpu/store/rounds.py): held to the SQL window
query that computed it before (waves per user, tenants in turn within a wave, queue order),
run by SQLite on the same pending items; a drain's rounds from a queue read once
(``PendingQueue``) held to ``round_order`` over the items left, round after round."""

from __future__ import annotations

import sqlite3

from hypothesis import given, settings
from hypothesis import strategies as st
from rounds_reference import round_order
from store_backends import Backend

from memoryos_gpu.store.rounds import PendingQueue

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


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(USERS), max_size=60),
    st.lists(st.tuples(st.integers(1, 8), st.integers(1, 30)), min_size=1, max_size=12),
)
def test_a_drain_reads_the_queue_once_for_the_same_rounds(
    users: list[str], rounds: list[tuple[int, int]]
) -> None:
    """Round after round (each its own per_user and limit), the queue read once hands out
    what ``round_order`` picks from the items still pending, in its order, until it is empty."""
    left = [(10 * i + 1, u, i) for i, u in enumerate(users)]  # (work id, user, ref)
    queue = PendingQueue(left)
    for per_user, limit in rounds:
        want = [left[i] for i in round_order([u for _, u, _ in left], per_user, limit).tolist()]
        got = queue.next_round(limit, per_user)
        assert got == want
        queue.done(got)
        taken = set(got)
        left = [it for it in left if it not in taken]
        assert bool(queue) == bool(left)
    while left:  # the rest, in the default rounds of a drain
        want = [left[i] for i in round_order([u for _, u, _ in left], 5, 5).tolist()]
        got = queue.next_round(5, 5)
        assert got == want
        queue.done(got)
        left = left[:0] + [it for it in left if it not in set(got)]
    assert not queue and queue.next_round(5, 5) == []


def test_nothing_pending_or_nothing_asked() -> None:
    assert round_order([], 3, 10).size == 0
    assert round_order(["a", "b"], 1, 0).size == 0


def test_the_store_reads_a_round_of_its_own_pending_items(backend: Backend) -> None:
    """``pending_items`` lists the rows (work_id, user_id, ref) of one kind in queue order, and
    a queue read from them hands them out in the round's order."""
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
        items = st_.pending_items("page")
        assert [ref for _, _, ref in items] == [1, 2, 3, 4]
        got = PendingQueue(items).next_round(10, 2)
        assert [(u, ref) for _, u, ref in got] == [("x/a", 1), ("y/c", 4), ("x/b", 3), ("x/a", 2)]
        assert len({w for w, _, _ in got}) == 4  # each row its own work item
        firsts = PendingQueue(items).next_round(2, 1)
        assert [(u, ref) for _, u, ref in firsts] == [("x/a", 1), ("y/c", 4)]
    finally:
        st_.close()

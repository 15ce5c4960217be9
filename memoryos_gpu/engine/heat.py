"""Segment heat: retrieval hits, recomputation, the promotions it queues, and the write-behind
of the statistics retrievals change.

Heat (the paper's ``alpha * N_visit + beta * L_interaction + gamma * R_recency``) is derived: the
kernels recompute it from the arena's statistics at each user's "now", and it is never stored.
What is stored is ``n_visit`` and ``last_access``; retrievals change them in the arena and only
*mark* the segment, and the marks ride along with the next write transaction (or ``sync``), so a
read never waits on an fsync. A crash can lose recent visit counts, never pages.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from memoryos_gpu import ops

from .state import EngineHooks, EngineState, UserState


class Heat:
    """Heat feedback and promotion queueing for every user of one engine."""

    def __init__(self, state: EngineState, hooks: EngineHooks) -> None:
        self._s = state
        self._hooks = hooks
        # (user slot, segment slot) hit since the last write transaction: retrievals stay
        # read-only on the store (no fsync)
        self._dirty: set[tuple[int, int]] = set()

    def feed_hits(self, users: Sequence[UserState], chosen: np.ndarray, at: float | None) -> None:
        """A retrieval's feedback: every segment it chose (``chosen[query]``: segment slots,
        -1 padded) gets a visit at the user's now; heat is recomputed and what became hot is
        promoted (right away when ``config.auto_process``)."""
        s = self._s
        rows, cols = np.nonzero(chosen >= 0)
        if rows.size:
            hit_users = np.array([users[r].slot for r in rows], np.int32)
            now = np.array([s.now(users[r], at) for r in rows])
            ops.apply_hits(s.arena, hit_users, chosen[rows, cols], now)
            self._dirty.update(zip(hit_users.tolist(), chosen[rows, cols].tolist(), strict=True))
        if self.refresh(None, users, at) and s.config.auto_process:
            self._hooks._process_promotions()

    def refresh(self, db: Any, users: Sequence[UserState], at: float | None = None) -> int:
        """Recompute heat for users at their "now" and queue promotions: segments at or over
        tau that hold pages not yet analysed (L_interaction > 0; after a promotion it is 0, so
        a segment hot from visits alone is not promoted again and again). ``db``: the open
        transaction to write in, or None to open one only if something is queued."""
        s = self._s
        uniq = list({u.user_id: u for u in users}.values())
        if not uniq:
            return 0
        slots = np.array([u.slot for u in uniq], np.int32)
        now = np.array([s.now(u, at) for u in uniq])
        promote, _ = ops.recompute_heat(s.arena, slots, now, s.memory.heat_params())
        if promote.any():
            promote &= s.arena.pull_heat(slots)["l_interaction"] > 0
        rows, cols = np.nonzero(promote)
        if not rows.size:
            return 0
        t = time.time()
        items = [
            (uniq[r].user_id, int(s.segment_of[uniq[r].slot, c]), t)
            for r, c in zip(rows, cols, strict=True)
        ]
        if db is None:
            with s.store.transaction() as own:
                self._queue_promotions(own, items)
        else:
            self._queue_promotions(db, items)
        return len(items)

    def _queue_promotions(self, db: Any, items: list[tuple[str, int, float]]) -> None:
        self.flush_stats(db)
        db.executemany(
            "INSERT INTO pending(user_id, kind, ref, created) "
            "VALUES (?, 'promote', ?, ?) ON CONFLICT DO NOTHING",
            items,
        )

    def flush_stats(self, db: Any) -> None:
        """Write the heat statistics changed by retrievals since the last write transaction.

        Retrievals only mark segments dirty, so a read never waits on an fsync; the marks ride
        along with the next write (or close). A crash can lose recent visit counts, never pages.
        """
        if not self._dirty:
            return
        s = self._s
        pairs = sorted(self._dirty)
        self._dirty.clear()
        u = np.array([p[0] for p in pairs], np.int64)
        seg = np.array([p[1] for p in pairs], np.int64)
        sid = s.segment_of[u, seg]
        keep = sid >= 0
        if not keep.any():
            return
        u, seg, sid = u[keep], seg[keep], sid[keep]
        stats = s.arena.pull_heat(u)
        r = np.arange(u.size)
        db.executemany(
            "UPDATE segments SET n_visit = ?, last_access = ? WHERE segment_id = ?",
            [
                (int(nv), float(la), int(x))
                for nv, la, x in zip(
                    stats["n_visit"][r, seg], stats["last_access"][r, seg], sid, strict=True
                )
            ],
        )

    def sync(self) -> None:
        """Write the marked statistics now, in a transaction of their own (if there are any)."""
        with self._s.lock:
            if self._dirty:
                with self._s.store.transaction() as db:
                    self.flush_stats(db)

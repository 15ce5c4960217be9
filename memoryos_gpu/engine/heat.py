"""Segment heat: what retrievals credit, the promotions heat queues, and the write-behind of the
statistics retrievals change.

Heat (the paper's ``alpha * N_visit + beta * L_interaction + gamma * R_recency``) is derived: the
kernels recompute it from the arena's statistics at each user's "now", and it is never stored.
What is stored is ``n_visit`` and ``last_access``.

A retrieval writes nothing to the store. The fused retrieval pass credits the segments of the
pages it served (``ops.credit_served``: N_visit, last access and heat in the arena, and a flag
where heat reached tau) and :meth:`Heat.credit` only appends the credited (user slot, segment
slot) pairs and the flagged ones to in-memory buffers: two array appends per batch. The
buffers go to the store in one transaction by :meth:`Heat.write_behind`, which the server's
background worker calls every second and the engine calls before derived work, on ``sync``,
``export_user`` and ``close``: the visit counts are written, and each flagged segment (if it is
still live and has pages not yet analysed) is queued as pending promotion work, which
``process_pending`` runs like any derived work. A crash loses the visits and promotion flags of
the last interval, never a page (docs/storage.md).

A derived round checks heat as each wave of pages joins MTM (:meth:`Heat.refresh`, the paper's
rule: a segment is promoted when a page makes it hot), and the check *claims* the hot segments'
pages there and then: their ``L_interaction`` (and ``N_visit`` with
``reset_visits_on_promotion``) restarts at 0 in the wave's transaction, and the claim records
the newest page it covers (the user's chain tail). The promotion itself runs after the round,
batched with every other user's (:mod:`~memoryos_gpu.engine.lpm`), on the claimed pages only;
pages that join the segment later count towards its next claim. So which promotions a user gets,
and from which pages, follow from the user's own pages alone: not from where a round was cut,
which depends on how many other users' pages were pending (``derived_max_batch``, server load,
the shard the user is on). A segment claimed twice before its promotion runs (a round of many
waves) gets two promotions, in claim order. The claims are rows of the store (``claims``: the
segment, the claim's order, its bound), written in the wave's transaction and deleted in the
promotion's, so a crash or a reload between the two keeps them: the promotion that resumes
takes the pages it would have taken. A promotion without a claim (queued by retrieval heat, a
forced promotion or a re-analysis) takes every unanalysed page of its segment and restarts its
counters when applied.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from memoryos_gpu import ops

from .state import EngineHooks, EngineState, UserState

#: A claim on a segment's unanalysed pages for a queued promotion: (claim order, the newest page
#: id claimed; None: every unanalysed page of the segment when the promotion runs).
Claim = tuple[int, int | None]
#: Segment ids per query when the claims are read (one ``IN`` list within SQLite's limits).
CLAIM_READ_CHUNK = 500


class Heat:
    """Heat feedback, promotion queueing and the heat write-behind of one engine."""

    def __init__(self, state: EngineState, hooks: EngineHooks) -> None:
        self._s = state
        self._hooks = hooks
        # since the last write-behind: credited (user slot, segment slot) pairs, and the pairs
        # whose heat reached tau, as arrays appended once per retrieval batch
        self._visits: list[tuple[np.ndarray, np.ndarray]] = []
        self._flagged: list[tuple[np.ndarray, np.ndarray]] = []
        self._buffers = threading.Lock()
        self._writer = threading.Lock()  # one write-behind's store write at a time
        # the next claim's order (engine lock): read from the store at the first claim, so a
        # reopened store's new claims come after the ones it holds
        self._claim_order: int | None = None

    def credit(
        self,
        user_slots: np.ndarray,
        segments: np.ndarray,
        credited: np.ndarray,
        promote: np.ndarray,
    ) -> None:
        """Record a retrieval batch's credits (``ops.credit_served`` outputs, ``[B, k]``)."""
        rows, cols = np.nonzero(credited)
        if not rows.size:
            return
        pr, pc = np.nonzero(promote)
        with self._buffers:
            self._visits.append((user_slots[rows], segments[rows, cols]))
            if pr.size:
                self._flagged.append((user_slots[pr], segments[pr, pc]))

    def discard(self) -> None:
        """Drop the credits not yet written: they name slots of an arena being replaced."""
        with self._buffers:
            self._visits, self._flagged = [], []

    def pending_marks(self) -> int:
        """Credited pairs not yet written (for stats)."""
        with self._buffers:
            return int(sum(u.size for u, _ in self._visits))

    def write_behind(self) -> dict[str, int]:
        """Write the buffered visit statistics and queue the flagged promotions, in one store
        transaction. The buffers and the arena values they name are taken under the engine
        lock; the store write runs after it is released, so retrievals do not wait for the
        fsync. On failure the taken marks go back into the buffers. Never call it inside a
        store transaction (it opens its own). EngineClosedError once the engine is closed:
        with nothing buffered it reaches no store statement, so ``sync`` and ``write_behind``
        returned as if they had written (``close`` itself calls it before it closes).

        All of it inside the store's rewrite gate (``EngineState.using_store``), entered
        before the engine lock: a write-behind whose store write waited through a rewrite of
        the file held the writer lock below, and the next one waited for that under the
        engine lock, holding up every retrieval."""
        with self._s.using_store():
            return self._write_behind()

    def _write_behind(self) -> dict[str, int]:
        s = self._s
        with s.lock:
            s.check_open()
            with self._buffers:
                visits, self._visits = self._visits, []
                flagged, self._flagged = self._flagged, []
            if not visits and not flagged:
                return {"segments": 0, "promotions": 0}
            stats = self._visit_rows(visits)
            promotions = self._promotion_rows(flagged)
            # taken in lock order (engine, then writer): writes reach the store in the order
            # their values were read, and a writer never waits for the engine lock
            self._writer.acquire()
        try:
            with s.store.transaction("none") as db:  # heat: lost at most
                db.executemany(
                    "UPDATE segments SET n_visit = ?, last_access = ? WHERE segment_id = ?", stats
                )
                db.executemany(
                    "INSERT INTO pending(user_id, kind, ref, created) "
                    "VALUES (?, 'promote', ?, ?) ON CONFLICT DO NOTHING",
                    promotions,
                )
        except BaseException:
            with self._buffers:
                self._visits[:0] = visits
                self._flagged[:0] = flagged
            raise
        finally:
            self._writer.release()
        return {"segments": len(stats), "promotions": len(promotions)}

    def _visit_rows(self, visits: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple]:
        """(n_visit, last_access, segment id) of every distinct credited segment still live."""
        if not visits:
            return []
        s = self._s
        u = np.concatenate([v[0] for v in visits]).astype(np.int64)
        seg = np.concatenate([v[1] for v in visits]).astype(np.int64)
        key = np.unique(u * s.memory.mtm_capacity + seg)
        u, seg = key // s.memory.mtm_capacity, key % s.memory.mtm_capacity
        sid = s.segment_of[u, seg]
        live = sid >= 0
        u, seg, sid = u[live], seg[live], sid[live]
        if not u.size:
            return []
        users, first = np.unique(u, return_inverse=True)
        heat = s.arena.pull_heat(users)
        nv = heat["n_visit"][first, seg].tolist()
        la = heat["last_access"][first, seg].tolist()
        return list(zip(nv, la, sid.tolist(), strict=True))

    def _promotion_rows(self, flagged: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple]:
        """(user id, segment id, created) of flagged segments still live with pages to analyse."""
        if not flagged:
            return []
        s = self._s
        u = np.concatenate([f[0] for f in flagged]).astype(np.int64)
        seg = np.concatenate([f[1] for f in flagged]).astype(np.int64)
        key = np.unique(u * s.memory.mtm_capacity + seg)
        u, seg = key // s.memory.mtm_capacity, key % s.memory.mtm_capacity
        sid = s.segment_of[u, seg]
        users, first = np.unique(u, return_inverse=True)
        unanalysed = s.arena.pull_heat(users)["l_interaction"][first, seg] > 0
        keep = (sid >= 0) & unanalysed
        owner = s.user_of_slot
        t = time.time()
        return [
            (owner[int(a)], int(b), t)
            for a, b in zip(u[keep].tolist(), sid[keep].tolist(), strict=True)
            if int(a) in owner
        ]

    def refresh(
        self, db: Any, users: Sequence[UserState], at: float | np.ndarray | None = None
    ) -> int:
        """Recompute heat for users at their "now" (``at``: one time for all, or one per user
        of ``users``) and claim the hot segments for promotion:
        segments at or over tau that hold pages not yet claimed (L_interaction > 0; a claim
        sets it to 0, so a segment hot from visits alone is not promoted again and again).
        Runs on the write path (each wave of a derived round, after a promotion batch), inside
        its transaction ``db``: the claimed segments' counters restart (:meth:`reset`), their
        promotions are queued, and each claim covers the user's pages up to its chain tail
        (every page of the segment so far: a user's pages join in order)."""
        s = self._s
        uniq = list({u.user_id: u for u in users}.values())
        if isinstance(at, np.ndarray):  # a user's last time counts, as its last page does
            time_of = dict(zip([u.user_id for u in users], at.tolist(), strict=True))
            now = np.array([time_of[u.user_id] for u in uniq], np.float64)
        else:
            now = np.array([s.now(u, at) for u in uniq])
        if not uniq:
            return 0
        slots = np.array([u.slot for u in uniq], np.int32)
        promote, _ = ops.recompute_heat(s.arena, slots, now, s.memory.heat_params())
        if promote.any():
            promote &= s.arena.pull_heat(slots)["l_interaction"] > 0
        rows, cols = np.nonzero(promote)
        if not rows.size:
            return 0
        uslots = slots[rows]
        sids = s.segment_of[uslots, cols].tolist()
        self.reset(db, uslots, cols, sids)
        t = time.time()
        owners = [uniq[r] for r in rows.tolist()]
        db.executemany(
            "INSERT INTO pending(user_id, kind, ref, created) "
            "VALUES (?, 'promote', ?, ?) ON CONFLICT DO NOTHING",
            [(u.user_id, sid, t) for u, sid in zip(owners, sids, strict=True)],
        )
        self.claim(db, sids, [u.chain_tail for u in owners])
        return int(rows.size)

    def reset(self, db: Any, uslots: np.ndarray, slots: np.ndarray, segment_ids: list[int]) -> None:
        """Restart promoted segments' counters: ``L_interaction`` (and, when
        ``reset_visits_on_promotion``, ``N_visit``) to 0, in the arena and the store."""
        if not segment_ids:
            return
        s = self._s
        zeros = np.zeros(len(segment_ids), np.int32)
        visits = s.memory.reset_visits_on_promotion
        s.arena.set_segment_stats(
            uslots, slots, l_interaction=zeros, **({"n_visit": zeros} if visits else {})
        )
        db.executemany(
            "UPDATE segments SET l_interaction = 0"
            + (", n_visit = 0" if visits else "")
            + " WHERE segment_id = ?",
            [(sid,) for sid in segment_ids],
        )

    # ---------------------------------------------------------------- claims (engine lock)
    def claim(self, db: Any, segment_ids: Sequence[int], upto: Sequence[int | None]) -> None:
        """Record claims on segments' pages up to page ids ``upto`` (None: all, when the
        promotion runs) for their queued promotions, in the transaction ``db`` that queues
        them: both are committed, or neither."""
        if not len(segment_ids):
            return
        if self._claim_order is None:
            top = db.execute("SELECT COALESCE(MAX(claim_order), 0) FROM claims").fetchone()[0]
            self._claim_order = int(top) + 1
        first = self._claim_order
        self._claim_order += len(segment_ids)  # a rolled-back claim leaves a gap, no reuse
        db.executemany(
            "INSERT INTO claims(segment_id, claim_order, upto) VALUES (?, ?, ?)",
            [
                (int(sid), first + i, None if last is None else int(last))
                for i, (sid, last) in enumerate(zip(segment_ids, upto, strict=True))
            ],
        )

    def claims(self, segment_ids: Sequence[int]) -> list[list[Claim]]:
        """The claims on each queued segment, oldest first (one query). A segment's claims go
        with it (evicted, its user deleted: the rows cascade) or with its promotion
        (:meth:`release`)."""
        if not segment_ids:
            return []
        made: dict[int, list[Claim]] = {}
        ids = list(dict.fromkeys(int(x) for x in segment_ids))
        for at in range(0, len(ids), CLAIM_READ_CHUNK):
            chunk = ids[at : at + CLAIM_READ_CHUNK]
            for sid, order, upto in self._s.store.query(
                "SELECT segment_id, claim_order, upto FROM claims "
                f"WHERE segment_id IN ({','.join('?' * len(chunk))})",
                chunk,
            ):
                made.setdefault(int(sid), []).append((int(order), upto))
        for rows in made.values():
            rows.sort()
        return [made.get(int(sid), []) for sid in segment_ids]

    def release(self, db: Any, segment_ids: Iterable[int]) -> None:
        """Delete the claims of promotions applied (or gone), in their transaction ``db``."""
        db.executemany("DELETE FROM claims WHERE segment_id = ?", [(int(x),) for x in segment_ids])

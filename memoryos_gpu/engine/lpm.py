"""Long-term persona memory: promotion of hot segments into the profile and knowledge rings.

A promoted segment (heat >= tau, queued by :mod:`~memoryos_gpu.engine.heat`) sends its pages
not yet analysed to the profile/knowledge stage, batched over every queued promotion. Profile
updates merge into the user's profile; facts go to the user's and the user's assistant's
knowledge rings (FIFO, ``knowledge_capacity`` live entries each, the oldest overwritten); the
pages are marked analysed and the segment's ``L_interaction`` resets, so it is not promoted
again until new pages join it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from memoryos_gpu.stages import PromotionWork
from memoryos_gpu.store.sqlite import emb_blob

from .heat import Heat
from .state import EngineHooks, EngineState, Fact


class LongTerm:
    """Promotions, the knowledge rings, and reads of a user's profile and knowledge."""

    def __init__(self, state: EngineState, heat: Heat, hooks: EngineHooks) -> None:
        self._s = state
        self._heat = heat
        self._hooks = hooks

    def process_promotions(self) -> int:
        """Run every queued promotion as one batch; returns how many were taken off the queue.
        The facts found go through the engine's ``_push_knowledge`` hook."""
        s = self._s
        items = s.store.pending("promote")
        if not items:
            return 0
        sids = [sid for _, _, sid in items]
        marks = ",".join("?" * len(sids))
        unanalysed: dict[int, list[tuple]] = {}
        for row in s.store.query(  # one query for every promoted segment's pages
            "SELECT segment_id, page_id, user_input, agent_response, timestamp FROM pages "
            f"WHERE segment_id IN ({marks}) AND analysed = 0 ORDER BY segment_id, seg_pos",
            sids,
        ):
            unanalysed.setdefault(row[0], []).append(row[1:])
        profiles = s.store.profiles({uid for _, uid, _ in items})
        work, valid = [], []
        for work_id, uid, sid in items:
            pages = unanalysed.get(sid, [])
            if uid not in s.users or not pages:
                valid.append((work_id, uid, sid, None, []))
                continue
            profile = profiles[uid]
            rows = [{"user_input": p[1], "agent_response": p[2], "timestamp": p[3]} for p in pages]
            work.append(PromotionWork(profile, rows))
            valid.append((work_id, uid, sid, profile, [p[0] for p in pages]))
        outcomes = iter(s.stages.promotions(work))
        facts: list[Fact] = []
        results = []
        for work_id, uid, sid, profile, page_ids in valid:
            out = next(outcomes) if profile is not None else None
            results.append((work_id, uid, sid, profile, page_ids, out))
            if out is not None:
                aid = s.users[uid].assistant_id
                facts += [("user", uid, f, out.mode) for f in out.user_facts]
                facts += [("assistant", aid, f, out.mode) for f in out.assistant_facts]
        fact_emb = s.embedder.encode([f[2] for f in facts]) if facts else None
        new_profiles: dict[str, dict[str, Any]] = {}
        with s.store.transaction() as db:
            for work_id, uid, sid, profile, page_ids, out in results:
                db.execute("DELETE FROM pending WHERE work_id = ?", (work_id,))
                if out is None:
                    continue
                if out.profile_updates:
                    profile = {**profile, **out.profile_updates}
                    db.execute(
                        "UPDATE users SET profile = ? WHERE user_id = ?",
                        (json.dumps(profile, ensure_ascii=False), uid),
                    )
                    new_profiles[uid] = profile
                marks = ",".join("?" * len(page_ids))
                db.execute(f"UPDATE pages SET analysed = 1 WHERE page_id IN ({marks})", page_ids)
                self._reset_segment(db, uid, sid)
                s.store.audit(
                    db, uid, "promote", "segment", sid, {"pages": len(page_ids), "mode": out.mode}
                )
                s.counters["promotions"] += 1
            if facts:
                self._hooks._push_knowledge(db, facts, fact_emb)
            self._heat.refresh(db, [s.users[r[1]] for r in results if r[1] in s.users])
        s.profiles.update(new_profiles)  # committed: retrievals show the new profiles
        return len(items)

    def _reset_segment(self, db: Any, user_id: str, segment_id: int) -> None:
        """A promoted segment's pages are analysed: ``L_interaction`` (and, when
        ``reset_visits_on_promotion``, ``N_visit``) back to 0, in the arena and the store."""
        s = self._s
        user = s.users[user_id]
        slot = int(np.flatnonzero(s.segment_of[user.slot] == segment_id)[0])
        reset = {"l_interaction": [0]}
        if s.memory.reset_visits_on_promotion:
            reset["n_visit"] = [0]
        s.arena.set_segment_stats([user.slot], [slot], **reset)
        db.execute(
            "UPDATE segments SET l_interaction = 0"
            + (", n_visit = 0" if s.memory.reset_visits_on_promotion else "")
            + " WHERE segment_id = ?",
            (segment_id,),
        )

    def push_knowledge(self, db: Any, facts: list[Fact], emb: np.ndarray) -> None:
        """Write facts into their owners' rings, arena and store: each gets the ring's next
        ``seq``; the entry it overwrites (``seq - capacity``) stops being live."""
        s = self._s
        cap = s.memory.knowledge_capacity
        owners = np.array(
            [s.users[o].owner if k == "user" else s.assistant_slot(o) for k, o, _, _ in facts],
            np.int32,
        )
        heads = {int(o): s.arena.ring_head(int(o)) for o in owners}
        ring = s.arena.push_knowledge(owners, emb)
        s.grow_maps()
        t = time.time()
        for (kind, owner_id, text, mode), o, r, vec in zip(facts, owners, ring, emb, strict=True):
            seq = heads[int(o)]
            heads[int(o)] += 1
            db.execute(
                "UPDATE knowledge SET live = 0 WHERE owner_kind = ? AND owner_id = ? AND seq <= ?",
                (kind, owner_id, seq - cap),
            )
            cur = db.execute(
                "INSERT INTO knowledge(owner_kind, owner_id, seq, text, embedding, "
                "mode, created) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING entry_id",
                (kind, owner_id, seq, text, emb_blob(vec), mode, t),
            )
            entry_id = cur.fetchone()[0]
            if s.entry_of_ring[o, r] >= 0:  # the FIFO dropped the entry that held this slot
                s.views.drop_knowledge([int(s.entry_of_ring[o, r])])
            s.entry_of_ring[o, r] = entry_id
            s.views.put_knowledge(entry_id, text)
            table = "users" if kind == "user" else "assistants"
            key = "user_id" if kind == "user" else "assistant_id"
            db.execute(
                f"UPDATE {table} SET knowledge_head = ? WHERE {key} = ?", (seq + 1, owner_id)
            )

    def queue_promotions(self, user_id: str, segment_slot: int | None = None) -> None:
        """Queue a user's live segments (or one slot) for promotion, whatever their heat."""
        s = self._s
        user = s.user(user_id)
        slots = (
            s.arena.live_segments(user.slot) if segment_slot is None else np.array([segment_slot])
        )
        with s.store.transaction() as db:
            db.executemany(
                "INSERT INTO pending(user_id, kind, ref, created) "
                "VALUES (?, 'promote', ?, ?) ON CONFLICT DO NOTHING",
                [
                    (user_id, int(s.segment_of[user.slot, slot]), time.time())
                    for slot in slots
                    if s.segment_of[user.slot, slot] >= 0
                ],
            )

    # ---------------------------------------------------------------- reads
    def profile(self, user_id: str) -> dict[str, str]:
        self._s.user(user_id)
        return dict(self._s.profiles.get(user_id, {}))

    def knowledge(self, user_id: str) -> dict[str, list[dict[str, Any]]]:
        """Live user knowledge and the user's assistant's knowledge, oldest first."""
        u = self._s.user(user_id)
        return {
            "user": self._s.store.owner_knowledge("user", user_id),
            "assistant": self._s.store.owner_knowledge("assistant", u.assistant_id),
        }

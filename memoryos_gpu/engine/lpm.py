"""Long-term persona memory: promotion of hot segments into the profile and knowledge rings.

A promoted segment (heat >= tau, queued by :mod:`~memoryos_gpu.engine.heat`) sends its pages
not yet analysed to the profile/knowledge stage, batched over every queued promotion. Profile
updates merge into the user's profile; facts go to the user's and the user's assistant's
knowledge rings (FIFO, ``knowledge_capacity`` live entries each, the oldest overwritten); the
pages are marked analysed and the segment's ``L_interaction`` resets, so it is not promoted
again until new pages join it. Like a page round (:mod:`~memoryos_gpu.engine.derived`), a batch
reads under the engine lock, runs its stage and embeds the facts without it, and applies under
it only the promotions whose inputs still hold.

A segment whose heat a derived round found at tau was *claimed* in that wave
(:class:`~memoryos_gpu.engine.heat.Heat`): its promotion takes the pages up to the claim, not
those that joined later in the round, and its counters restarted at the claim; a segment claimed
twice before the batch ran is promoted twice, and a user's promotions apply in claim order. So
a user's promotions are the same however the rounds were cut, whatever other users' pages
shared them. A queued promotion without a claim takes every unanalysed page of its segment.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from memoryos_gpu.embed.base import encode_checked
from memoryos_gpu.grouping import rank_within
from memoryos_gpu.stages import PromotionOutcome, PromotionWork
from memoryos_gpu.store.derivations import PROFILE, record

from .heat import Claim, Heat
from .knowledge_ring import KnowledgeRing
from .state import EngineHooks, EngineState, Fact, UserState, WorkItem, pending_left

#: Live entries per owner shown to a fused LLM promotion (its add / update / ignore targets).
KNOWN_SHOWN = 30


@dataclass
class _Part:
    """One promotion of a batch: the queued row it belongs to (by index), its pages (page id,
    input, response, time; the row's pages up to its claim) and whether applying it restarts
    the segment's counters (a promotion without a claim: its claim did that already)."""

    row: int
    pages: list[tuple]
    reset: bool


@dataclass
class _PromotionInput:
    """What a promotion batch read under the lock, per queued row: its pending row, the user
    record (None: gone), the segment's unanalysed pages (page id, input, response, time) and
    the profile the stage saw; the promotions (``parts``, one per claim, in the order they
    apply) and the stage inputs of those with pages and a user; the engine's edit count."""

    items: list[WorkItem]
    users: list[UserState | None]
    pages: list[list[tuple]]
    profiles: list[dict[str, Any]]
    parts: list[_Part]
    work: list[PromotionWork]
    edits: int


class LongTerm:
    """Promotions, the knowledge rings, and reads of a user's profile and knowledge."""

    def __init__(self, state: EngineState, heat: Heat, hooks: EngineHooks) -> None:
        self._s = state
        self._heat = heat
        self._hooks = hooks

    def process_promotions(self) -> int:
        """Run every queued promotion as one batch; returns how many were taken off the queue.

        Like a page round: the promoted segments' unanalysed pages and the profiles are read
        under the engine lock, the profile/knowledge stage and the facts' embeddings run
        without it, and the results are applied under it again for the promotions whose
        inputs still hold (:meth:`_current`); the others stay queued. The facts found go
        through the engine's ``_push_knowledge`` hook.
        """
        s = self._s
        with s.locked():
            s.reload_if_owed()
            read = self._read_promotions()
        if not read.items:
            return 0
        found = iter(s.stages.promotions(read.work))
        outcomes = [next(found) if _staged(read, p) else None for p in read.parts]
        facts, fact_of = self._facts(read, outcomes)
        fact_emb = encode_checked(s.embedder, [f[2] for f in facts]) if facts else None
        return s.in_write_transaction(  # redone from pending if lost
            lambda db: self._apply_promotions(db, read, outcomes, facts, fact_of, fact_emb)
        )

    def _read_promotions(self) -> _PromotionInput:
        """The queued promotions and their stage inputs (one query for every promoted
        segment's unanalysed pages, split by the segments' claims: :func:`_parts`); a
        promotion whose user is gone or that has nothing left to analyse gets no stage input
        and is only taken off the queue."""
        s = self._s
        items = s.store.pending("promote")
        if not items:
            return _PromotionInput([], [], [], [], [], [], s.edits)
        sids = [sid for _, _, sid in items]
        unanalysed = self._unanalysed(sids)
        profiles = s.store.profiles({uid for _, uid, _ in items})
        users = [s.users.get(uid) for _, uid, _ in items]
        pages = [
            unanalysed.get(sid, []) if u is not None else []
            for sid, u in zip(sids, users, strict=True)
        ]
        read_profiles = [profiles.get(uid, {}) for _, uid, _ in items]
        parts = _parts(pages, self._heat.claims(sids))
        known = s.stages.mode == "llm"  # only an LLM is shown the live entries
        work = []
        for part in parts:
            u = users[part.row]
            if u is None or not part.pages:
                continue
            work.append(
                PromotionWork(
                    read_profiles[part.row],
                    [
                        {"user_input": p[1], "agent_response": p[2], "timestamp": p[3]}
                        for p in part.pages
                    ],
                    self._known(u.owner) if known else [],
                    self._known(s.assistant_slot(u.assistant_id)) if known else [],
                )
            )
        return _PromotionInput(items, users, pages, read_profiles, parts, work, s.edits)

    def _known(self, owner: int) -> list[tuple[int, str]]:
        """The newest live entries of a ring (id, text), at most ``KNOWN_SHOWN``: what a fused
        LLM promotion decides its facts against."""
        ids = self._s.entry_of_ring[owner]
        ids = np.sort(ids[ids >= 0])[-KNOWN_SHOWN:]
        texts = self._s.views.knowledge
        return [(int(e), texts[int(e)]) for e in ids if int(e) in texts]

    def _unanalysed(self, segment_ids: list[int]) -> dict[int, list[tuple]]:
        """(page id, user input, agent response, timestamp) of each segment's pages not yet
        analysed, in segment order (one query)."""
        marks = ",".join("?" * len(segment_ids))
        out: dict[int, list[tuple]] = {}
        for row in self._s.store.query(
            "SELECT segment_id, page_id, user_input, agent_response, timestamp FROM pages "
            f"WHERE segment_id IN ({marks}) AND analysed = 0 ORDER BY segment_id, seg_pos",
            segment_ids,
        ):
            out.setdefault(row[0], []).append(tuple(row[1:]))
        return out

    def _facts(
        self, read: _PromotionInput, outcomes: list[PromotionOutcome | None]
    ) -> tuple[list[Fact], np.ndarray]:
        """The facts the stage found, and for each the index of the promotion (part) it came
        from (so the facts of a promotion that is not applied are left out)."""
        facts: list[Fact] = []
        of: list[int] = []
        for i, (part, out) in enumerate(zip(read.parts, outcomes, strict=True)):
            user = read.users[part.row]
            if out is None or user is None:
                continue
            uid, aid = user.user_id, user.assistant_id
            rows = part.pages
            every = tuple(int(p[0]) for p in rows)
            newest = max(float(p[3]) for p in rows)
            picks = out.user_fact_pages
            for j, f in enumerate(out.user_facts):
                src = every if picks is None else (int(rows[picks[j]][0]),)
                at = newest if picks is None else float(rows[picks[j]][3])
                facts.append(
                    Fact("user", uid, f, out.mode, src, uid, at, _nth(out.user_decisions, j))
                )
            for j, f in enumerate(out.assistant_facts):
                decision = _nth(out.assistant_decisions, j)
                facts.append(Fact("assistant", aid, f, out.mode, every, uid, newest, decision))
            of += [i] * (len(out.user_facts) + len(out.assistant_facts))
        return facts, np.asarray(of, np.int64)

    def _current(self, read: _PromotionInput) -> tuple[np.ndarray, np.ndarray]:
        """Under the lock, after the stage: (still queued, still current) per promotion.
        Current means the user record is the one read, the segment is still live and -- when
        an item-level edit happened meanwhile -- its unanalysed pages are the ones read (a
        page deleted or edited during the stage must not leave facts behind; the queue, too,
        is asked of the store only then: :func:`pending_left`)."""
        s = self._s
        queued = pending_left(s, [w for w, _, _ in read.items], read.edits)
        current = queued & np.fromiter(
            (
                u is None
                or (s.users.get(u.user_id) is u and bool((s.segment_of[u.slot] == sid).any()))
                for u, (_, _, sid) in zip(read.users, read.items, strict=True)
            ),
            bool,
            len(read.items),
        )
        if s.edits != read.edits and current.any():
            now = self._unanalysed([sid for _, _, sid in read.items])
            current &= np.fromiter(
                (
                    now.get(sid, []) == pages
                    for (_, _, sid), pages in zip(read.items, read.pages, strict=True)
                ),
                bool,
                len(read.items),
            )
        return queued, current

    def _apply_promotions(
        self,
        db: Any,
        read: _PromotionInput,
        outcomes: list[PromotionOutcome | None],
        facts: list[Fact],
        fact_of: np.ndarray,
        fact_emb: np.ndarray | None,
    ) -> int:
        """Apply the current promotions in the transaction ``db`` (profile merge, analysed
        flags, segment reset, facts, pending-row deletes); returns how many rows left the
        queue."""
        s = self._s
        queued, current = self._current(read)
        taken = np.flatnonzero(current).tolist()
        done = [j for j, p in enumerate(read.parts) if current[p.row] and outcomes[j] is not None]
        db.executemany(
            "DELETE FROM pending WHERE work_id = ?", [(read.items[i][0],) for i in taken]
        )
        self._heat.release(
            db, (read.items[i][2] for i in np.flatnonzero(current | ~queued).tolist())
        )
        new_profiles = self._merge_profiles(db, read, outcomes, done)
        db.executemany(
            "UPDATE pages SET analysed = 1 WHERE page_id = ?",
            [(p[0],) for j in done for p in read.parts[j].pages],
        )
        rows = [read.items[read.parts[j].row] for j in done]  # each promotion's queued row
        s.store.audit_many(
            db,
            [(uid, "promote", "segment", sid) for _, uid, sid in rows],
            [{"pages": len(read.parts[j].pages), "mode": outcomes[j].mode} for j in done],
        )
        self._reset_segments(
            db, [r for r, j in zip(rows, done, strict=True) if read.parts[j].reset]
        )
        s.counters["promotions"] += len(done)
        part_rows = np.fromiter((p.row for p in read.parts), np.int64, len(read.parts))
        keep = current[part_rows][fact_of]
        if keep.any():
            # in waves: each user's first promotion of the batch, then each one's second, ...
            # (each wave batched across users): a user's facts reach the rings promotion after
            # promotion, as if each promotion had run in a batch of its own
            _, user_code = np.unique([read.items[r][1] for r in part_rows], return_inverse=True)
            fact_wave = rank_within(user_code)[fact_of]
            for w in np.unique(fact_wave[keep]).tolist():
                sel = keep & (fact_wave == w)
                self._hooks._push_knowledge(
                    db, [facts[i] for i in np.flatnonzero(sel).tolist()], fact_emb[sel]
                )
        self._heat.refresh(db, [u for i in taken if (u := read.users[i]) is not None])
        s.profiles.update(new_profiles)  # a failed commit reloads them with the rest
        return int((~queued).sum() + current.sum())

    def _merge_profiles(
        self,
        db: Any,
        read: _PromotionInput,
        outcomes: list[PromotionOutcome | None],
        done: list[int],
    ) -> dict[str, dict[str, Any]]:
        """Write the profile updates of promotions (parts) ``done`` (in order: a user's later
        promotion of the batch updates on top of its earlier one) with their provenance;
        returns the users' new profiles."""
        new_profiles: dict[str, dict[str, Any]] = {}
        sources: list[tuple[int, str, list[int], str]] = []
        for j in done:
            part = read.parts[j]
            out, uid = outcomes[j], read.items[part.row][1]
            if not out.profile_updates:
                continue
            new_profiles[uid] = {
                **new_profiles.get(uid, read.profiles[part.row]),
                **out.profile_updates,
            }
            page_ids = [p[0] for p in part.pages]
            sources += [(0, k, page_ids, uid) for k in out.profile_updates]
        db.executemany(
            "UPDATE users SET profile = ? WHERE user_id = ?",
            [(json.dumps(p, ensure_ascii=False), uid) for uid, p in new_profiles.items()],
        )
        if self._s.memory.provenance:
            record(db, PROFILE, sources)
        return new_profiles

    def _reset_segments(self, db: Any, items: list[WorkItem]) -> None:
        """Segments promoted without a claim have every page analysed: their counters restart
        (:meth:`Heat.reset`)."""
        if not items:
            return
        s = self._s
        uslots = np.fromiter((s.users[uid].slot for _, uid, _ in items), np.int32, len(items))
        sids = np.fromiter((sid for _, _, sid in items), np.int64, len(items))
        slots = np.argmax(s.segment_of[uslots] == sids[:, None], axis=1)  # each is live there
        self._heat.reset(db, uslots, slots, sids.tolist())

    def push_knowledge(self, db: Any, facts: list[Fact], emb: np.ndarray) -> None:
        """Write facts into their owners' rings, arena and store, each compared first with
        the owner's live entries (:mod:`~memoryos_gpu.engine.conflicts`): the same fact again
        strengthens its entry, a contradicting one supersedes it, the rest are added (each
        gets the ring's next ``seq``; the entry it overwrites stops being live)."""
        facts = [f if isinstance(f, Fact) else Fact(*f) for f in facts]
        ring = KnowledgeRing(self._s, db)
        order, decisions = ring.decide(facts, emb)
        made: dict[int, int] = {}  # fact index -> the entry it made

        def target(t: int | None) -> int | None:  # -(j + 1) names the j-th fact's entry
            return made.get(-t - 1) if t is not None and t < 0 else t

        # what each fact does, in the order said (a target in the batch is made before it is
        # named; one that made nothing, a merged fact, cannot be a target: the fact is added)
        kinds: dict[int, str] = {}
        will_make: set[int] = set()
        for i in order:
            t = decisions[i].target
            named = t is not None and (t >= 0 or -t - 1 in will_make)
            kinds[i] = decisions[i].action if named and decisions[i].action in _NAMING else "add"
            if kinds[i] != "merge":
                will_make.add(i)
        # the additions first, together (each takes its ring's next seq), then the rest in the
        # same order: every entry a decision names exists by then
        made.update(ring.add_all([(i, facts[i], emb[i]) for i in order if kinds[i] == "add"]))
        for i in order:
            fact, d = facts[i], decisions[i]
            if kinds[i] == "merge":
                ring.strengthen(target(d.target), fact)
            elif kinds[i] == "outdated":
                made[i] = ring.add_outdated(fact, emb[i], i, target(d.target), target(d.before))
            elif d.action == "supersede" and target(d.target) is not None:
                ring.supersede(target(d.target), made[i], fact)
        ring.finish()

    def queue_promotions(self, user_id: str, segment_slot: int | None = None) -> None:
        """Queue a user's live segments (or one slot) for promotion, whatever their heat: of
        every unanalysed page (a claim on all of them, after any the segment has already)."""
        s = self._s
        user = s.user(user_id)
        slots = (
            s.arena.live_segments(user.slot) if segment_slot is None else np.array([segment_slot])
        )
        sids = [int(s.segment_of[user.slot, slot]) for slot in slots]
        sids = [sid for sid in sids if sid >= 0]
        with s.store.transaction() as db:
            db.executemany(
                "INSERT INTO pending(user_id, kind, ref, created) "
                "VALUES (?, 'promote', ?, ?) ON CONFLICT DO NOTHING",
                [(user_id, sid, time.time()) for sid in sids],
            )
            self._heat.claim(db, sids, [None] * len(sids))

    # ---------------------------------------------------------------- reads
    def profile(self, user_id: str) -> dict[str, str]:
        self._s.user(user_id)
        return dict(self._s.profiles.get(user_id, {}))

    def knowledge(self, user_id: str, history: bool = False) -> dict[str, list[dict[str, Any]]]:
        """Live user knowledge and the user's assistant's knowledge, oldest first (``history``:
        superseded and dropped entries too)."""
        u = self._s.user(user_id)
        st = self._s.store
        return {
            "user": st.owner_knowledge("user", user_id, live_only=not history),
            "assistant": st.owner_knowledge("assistant", u.assistant_id, live_only=not history),
        }


# the decisions that name an existing entry and take no ring position (an outdated fact is
# stored as history, outside the ring)
_NAMING = ("merge", "outdated")


def _nth(decisions: list[tuple[str, int | None]] | None, j: int) -> tuple[str, int | None] | None:
    return decisions[j] if decisions is not None and j < len(decisions) else None


def _staged(read: _PromotionInput, part: _Part) -> bool:
    """Whether a promotion went to the stage (it has pages and its user a record)."""
    return bool(part.pages) and read.users[part.row] is not None


def _parts(pages: list[list[tuple]], claims: list[list[Claim]]) -> list[_Part]:
    """The promotions of queued rows (their unanalysed pages ``pages``, in segment order, and
    their claims), in the order they apply: the rows without a claim first (each takes every
    page), then the claimed ones in claim order, each claim taking the pages (of a user's, in
    page-id order) after the claim before it up to its own; a claim on all pages (None) takes
    the rest. Pages that joined after a row's last claim stay for its next one."""
    keyed: list[tuple[int, _Part]] = []
    for row, (rows, made) in enumerate(zip(pages, claims, strict=True)):
        if not made:
            keyed.append((-1, _Part(row, rows, True)))
            continue
        ids = [p[0] for p in rows]
        first: dict[int, int] = {}  # a bound -> the first claim that named it
        for order, upto in made:
            if upto is not None:
                first.setdefault(upto, order)
        low = None
        for upto in sorted(first):
            taken = [
                p for p, i in zip(rows, ids, strict=True) if i <= upto and (low is None or i > low)
            ]
            if taken:
                keyed.append((first[upto], _Part(row, taken, False)))
            low = upto
        everything = [order for order, upto in made if upto is None]
        if everything:
            rest = [p for p, i in zip(rows, ids, strict=True) if low is None or i > low]
            if rest:
                keyed.append((max(order for order, _ in made), _Part(row, rest, True)))
    keyed.sort(key=lambda k: k[0])  # stable: rows without a claim in queue order
    return [part for _, part in keyed]

"""Mid-term memory: topic segments, the dialogue chain, and the eviction of cold segments.

A page leaving STM is applied in a *round* of *waves* (a wave: one pending page of each user,
see :mod:`~memoryos_gpu.engine.derived`): its inputs are read under the engine lock, the chain
+ summary stage runs on its waves (an LLM batch a wave; without an LLM, one batch for all) and
the summaries are embedded without it, and under it again the items whose inputs still hold are
matched against their users' segments, a wave at a time, in one kernel call each. A page joins
its best segment when ``cos + Jaccard >= theta`` (the segment's embedding takes the page in:
``e_s <- unit(n * e_s + unit(e_p))`` over its ``n`` pages so far, a running average renormalised
at each page, which weighs a segment's first pages above a plain mean of its pages; its keyword
counts and summary grow), otherwise it opens a segment, the lowest-heat one
being evicted first when every slot is live. A round's effects and the deletion of its pending
rows share one transaction; heat is recomputed and promotions queued in it
(:mod:`~memoryos_gpu.engine.heat`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from memoryos_gpu import ops
from memoryos_gpu.arena import NO_ID
from memoryos_gpu.embed.base import encode_checked
from memoryos_gpu.json_codec import dumps_text, loads
from memoryos_gpu.lexical import terms_from_blobs
from memoryos_gpu.stages import PageOutcome, PageWork
from memoryos_gpu.store.rows import blob_matrix, emb_blobs, select_in
from memoryos_gpu.text.keywords import keyword_tokens

from .heat import Heat
from .mtm_rounds import (
    Round,
    RoundInput,
    RoundOutput,
    RoundWrites,
    SegmentRow,
    Wave,
    kw_blob,
    merge_summary,
)
from .state import (
    EngineState,
    UserState,
    WorkItem,
    keyword_rows,
    pending_clocks,
    pending_left,
    still_pending,
    to_host,
)


class Segments:
    """Matching pages to segments, opening, joining and evicting them, for every user."""

    def __init__(self, state: EngineState, heat: Heat) -> None:
        self._s = state
        self._heat = heat

    def process_pages(self, items: list[WorkItem]) -> int:
        """Apply one round of pending pages to their users' MTM: its *waves* in order (wave
        ``j`` holds the ``j``-th item of each user, as ``PendingQueue.next_round`` lists them).

        The inputs are read under the engine lock, the stages (LLM, summary embeddings) run
        without it, wave after wave (a page's chain context is the previous wave's outcome),
        and the waves are applied under it again in one transaction (committed once the lock
        is released: ``EngineState.write_transaction``), each item only if what it read
        still holds (:meth:`_current`); a changed item, and its user's later ones,
        stay pending for a later round. Several waves in one round give a user's backlog
        (a chat log ingested in order) one read, one stage pass and one commit per round
        instead of one per page. Returns the items taken off the queue: applied, or gone
        (page or user deleted).
        """
        s = self._s
        with s.locked():
            s.reload_if_owed()
            waves, gone = self._read_round(items)
        done = self._run_stages(waves)
        if not done:
            return gone
        # redone from pending if lost
        return gone + s.in_write_transaction(lambda db: self._apply_waves(db, waves, done))

    def _apply_waves(self, db: Any, waves: list[RoundInput], done: list[RoundOutput]) -> int:
        """The round's waves applied in the transaction ``db`` (one for the round, not a
        savepoint a wave: SQLite copies every page a savepoint changes to a journal of its
        own); returns how many items left the queue (applied, or gone)."""
        s = self._s
        gone = 0
        writes = RoundWrites()
        for read, out in zip(waves, done, strict=True):
            gone += self._apply_round(db, read, out, writes)
        writes.flush(db, s.arena)
        s.queue_changes += 1
        return gone + len(writes.done)

    def _read_round(self, items: list[WorkItem]) -> tuple[list[RoundInput], int]:
        """A round's stage inputs by wave, read under the lock: the pages, their embeddings
        and each user's chain tail (for a later wave, the user's page of the wave before;
        its chain meta is that page's outcome, filled in by :meth:`_run_stages`). Items whose
        page or user is gone already are left out, with their user's later items; returns
        them counted when their pending row went with them."""
        s = self._s
        d = s.embedder.dim
        rows = self._work_rows([(ref, uid) for _, uid, ref in items])
        missing: list[int] = []
        blocked: set[str] = set()
        depth: dict[str, int] = {}
        waves: list[list[WorkItem]] = []
        for it in items:
            uid = it[1]
            if uid in blocked:
                continue
            if uid not in s.users or it[2] not in rows:
                missing.append(it[0])
                blocked.add(uid)  # its later items wait: their chain context is unknown
                continue
            k = depth[uid] = depth.get(uid, -1) + 1
            if k == len(waves):
                waves.append([])
            waves[k].append(it)
        gone = int((~still_pending(s.store, missing)).sum()) if missing else 0
        page_ids = [ref for wave in waves for _, _, ref in wave]
        clock_of = pending_clocks(s.store, [w for wave in waves for w, _, _ in wave])
        emb = s.store.page_embeddings(page_ids, d)  # wave after wave: a wave's rows are a slice
        emb_of = dict(zip(page_ids, emb, strict=True))
        stored = s.store.page_terms(page_ids)
        terms = terms_from_blobs([stored.get(p) for p in page_ids])
        first = [s.users[uid] for _, uid, _ in waves[0]] if waves else []
        tails = {u.user_id: (u.chain_tail, u.chain_meta) for u in first}
        prev_ids = [p for p, _ in tails.values() if p is not None]
        prev_rows = self._work_rows([(p, uid) for uid, (p, _) in tails.items() if p is not None])
        prev_embs = dict(zip(prev_ids, s.store.page_embeddings(prev_ids, d), strict=True))
        out: list[RoundInput] = []
        at = 0
        for wave in waves:
            users = [s.users[uid] for _, uid, _ in wave]
            work, wave_tails = [], []
            for _, uid, ref in wave:
                prev, meta = tails[uid]
                work.append(
                    PageWork(rows[ref], emb_of[ref], prev_rows.get(prev), prev_embs.get(prev), meta)
                )
                wave_tails.append((prev, meta))
                tails[uid] = (ref, None)  # the next wave's context: meta once staged
                prev_rows[ref], prev_embs[ref] = rows[ref], emb_of[ref]
            part = np.arange(at, at + len(wave))
            clocks = np.array([clock_of.get(w, np.nan) for w, _, _ in wave], np.float64)
            out.append(
                RoundInput(
                    wave, users, wave_tails, emb[part], work, s.edits, terms.take(part), clocks
                )
            )
            at += len(wave)
        return out, gone

    def _work_rows(self, pages: list[tuple[int, str]]) -> dict[int, dict[str, Any]]:
        """What the stages read of pages ``(page id, user id)``, by page id: from the views,
        which hold every page in STM, pending or in MTM (no SQL, no JSON to decode); a page
        not there (a chain tail evicted meanwhile) from the store; a deleted one is absent."""
        get = self._s.views.pages.get
        out: dict[int, dict[str, Any]] = {}
        missing: list[int] = []
        for pid, uid in pages:
            v = get(pid)
            if v is None:
                missing.append(pid)
                continue
            out[pid] = {
                "page_id": pid,
                "user_id": uid,
                "user_input": v[0],
                "agent_response": v[1],
                "timestamp": v[2],
                "meta": v[3],
                "extra": v[4],
            }
        if missing:
            out.update(self._s.store.page_rows(missing))
        return out

    def _run_stages(self, waves: list[RoundInput]) -> list[RoundOutput]:
        """The round's stages without the engine lock: they read only what the waves hold
        (and the keyword statistics, which only grow). The stage object decides how the
        waves go (:meth:`~memoryos_gpu.stages.ExtractiveStages.page_waves`: one batch without
        an LLM, wave after wave with one); a later wave's pages take their chain meta from
        the previous wave's outcomes, and their tails record it. The summaries of every wave
        are embedded, and the keyword rows made, in one call each."""
        s = self._s
        if not waves:
            return []
        done = s.stages.page_waves([read.work for read in waves])
        for read in waves:  # the chain context each outcome was made in
            read.tails = [(p, w.prev_meta) for (p, _), w in zip(read.tails, read.work, strict=True)]
        outcomes = [o for wave in done for o in wave]
        for o in outcomes:  # LLM keywords may be phrases: one normalised token list, once
            if o.mode != "extractive":  # the extractor's are normalised unigrams already
                o.keywords = keyword_tokens(o.keywords)
        summary_emb = self._summary_embeddings(
            outcomes,
            np.concatenate([read.embs for read in waves]),
            [w.page for read in waves for w in read.work],
        )
        kw_rows = keyword_rows([o.keywords for o in outcomes], s.memory.keyword_width)
        out: list[RoundOutput] = []
        at = 0
        for wave in done:
            part = slice(at, at + len(wave))
            out.append(RoundOutput(wave, summary_emb[part], kw_rows[part]))
            at += len(wave)
        return out

    def _current(self, read: RoundInput) -> tuple[np.ndarray, np.ndarray]:
        """Under the lock, after the stages: (still pending, still current) per item. Current
        means the pending row, the user and its chain tail and meta are the ones read, and --
        when an item-level edit happened meanwhile -- the page and chain-tail texts too (the
        pending rows, too, are asked of the store only then: :func:`pending_left`)."""
        s = self._s
        pending = pending_left(s, [w for w, _, _ in read.items], read.edits)
        same_user = np.fromiter(
            (
                s.users.get(u.user_id) is u and (u.chain_tail, u.chain_meta) == tail
                for u, tail in zip(read.users, read.tails, strict=True)
            ),
            bool,
            len(read.users),
        )
        current = pending & same_user
        if s.edits != read.edits and current.any():
            current &= self._texts_unchanged(read)
        return pending, current

    def _texts_unchanged(self, read: RoundInput) -> np.ndarray:
        """Whether each item's page and chain-tail texts are still the ones its stages saw."""
        page_ids = [ref for _, _, ref in read.items]
        fresh = self._s.store.page_rows(page_ids + [p for p, _ in read.tails if p is not None])
        return np.fromiter(
            (
                _same_text(w.page, fresh.get(pid))
                and (prev is None or _same_text(w.prev_page, fresh.get(prev)))
                for w, pid, (prev, _) in zip(read.work, page_ids, read.tails, strict=True)
            ),
            bool,
            len(page_ids),
        )

    def _apply_round(
        self, db: Any, read: RoundInput, done: RoundOutput, writes: RoundWrites
    ) -> int:
        """Apply the wave's items still current (see :meth:`_current`), noting them in
        ``writes``; returns how many are gone (with their page or user)."""
        pending, current = self._current(read)
        gone = int((~pending).sum())
        if not current.any():
            return gone
        items, users, embs, terms = read.items, read.users, read.embs, read.terms
        outcomes, summary_emb, kw_rows = done.outcomes, done.summary_emb, done.kw_rows
        clocks = read.clocks
        if not current.all():  # the common case (nothing changed) copies nothing
            keep = np.flatnonzero(current)
            items, users = [items[i] for i in keep], [users[i] for i in keep]
            outcomes = [outcomes[i] for i in keep]
            embs, summary_emb, kw_rows = embs[keep], summary_emb[keep], kw_rows[keep]
            terms, clocks = terms.take(keep), clocks[keep]
        wave = Wave(items, users, embs, terms, outcomes, summary_emb, kw_rows, clocks)
        self._apply(db, wave, writes)
        return gone

    def _apply(self, db: Any, wave: Wave, writes: RoundWrites) -> None:
        """Match the pages against their users' segments now, make room, and write the
        wave's segments and chain links in the round's transaction ``db``, each kind of row
        with one statement for the whole wave; its pending rows go with the round's
        (``writes``)."""
        s = self._s
        items, users, embs, outcomes = wave.items, wave.users, wave.embs, wave.outcomes
        summary_emb, kw_rows = wave.summary_emb, wave.kw_rows
        if len({u.slot for u in users}) < len(users):  # the waves' rule (_read_round)
            raise RuntimeError("a wave of pages holds at most one page per user")
        page_ids = [ref for _, _, ref in items]
        uslots = np.array([u.slot for u in users], np.int32)
        best_score, best_slot = ops.match_segments(s.arena, summary_emb, uslots, kw_rows)
        best_score, best_slot = to_host(best_score), to_host(best_slot)
        join = (best_slot >= 0) & (best_score >= s.memory.theta)
        # each page at the time it left STM: a log added in one batch ages as one page a call
        now = s.now_at(users, wave.clocks)
        opening = np.flatnonzero(~join)
        self._make_room(db, [users[i] for i in opening.tolist()], now[opening], writes)
        round_ = Round(users, uslots, outcomes, summary_emb, now)
        self._join_segments(round_, np.flatnonzero(join), best_slot, writes)
        self._open_segments(db, round_, opening, writes)
        chains = self._link_pages(db, round_, page_ids, writes)
        writes.done += [w for w, _, _ in items]
        # the wave's pages into their segments' blocks, in wave order (each segment's
        # positions are the ones the store just gave them), and their term rows
        pools = s.arena.append_pages(uslots, round_.seg_slot, embs)
        s.map_pages(pools, np.asarray(page_ids, np.int64))
        s.arena.write_terms(pools, *wave.terms.columns())
        self._heat.refresh(db, users, now)
        s.views.link_pages(page_ids, chains, [o.meta for o in outcomes])

    def _summary_embeddings(
        self, outcomes: Sequence[PageOutcome], page_emb: np.ndarray, rows: Sequence[dict]
    ) -> np.ndarray:
        """What a page contributes to its segment's embedding e_s.

        LLM mode: the embedding of the LLM's topic summary (the paper). Extractive mode: the
        page's own embedding -- the page is its best extractive summary, while the embedding of
        a first sentence ("Hey Mel, what's up?") routes queries to the wrong segments (LoCoMo
        dev, routed dense recall@10: 0.32 with first-sentence embeddings). It also saves one
        embedding per page.
        """
        if self._s.stages.mode == "extractive":
            return page_emb
        return encode_checked(
            self._s.embedder,
            [o.summary or r["user_input"] for o, r in zip(outcomes, rows, strict=True)],
        )

    def _segment_rows(
        self, segment_ids: list[int], uslots: np.ndarray, slots: np.ndarray, writes: RoundWrites
    ) -> list[SegmentRow]:
        """The rows of segments (at ``uslots``, ``slots``) as the round has them so far: those
        it has not touched yet from the store (one query), kept in ``writes``."""
        have = writes.segments
        missing = [x for x in segment_ids if x not in have]
        if missing:
            marks = ",".join("?" * len(missing))
            read = self._s.store.query(
                "SELECT segment_id, summary, keywords, embedding, n_pages "
                f"FROM segments WHERE segment_id IN ({marks})",
                missing,
            )
            emb = blob_matrix([r[3] for r in read], self._s.embedder.dim)
            at = {x: i for i, x in enumerate(segment_ids)}
            for r, e in zip(read, emb, strict=True):
                i = at[r[0]]
                have[r[0]] = SegmentRow(
                    r[1], loads(r[2]), e, np.empty(0, np.int32), r[4], int(uslots[i]), int(slots[i])
                )
        return [have[x] for x in segment_ids]

    # ---------------------------------------------------------------- eviction
    def _make_room(
        self, db: Any, users: Sequence[UserState], now: np.ndarray, writes: RoundWrites
    ) -> None:
        """Users about to open a segment with every slot live lose their lowest-heat one, its
        heat taken at ``now`` (each user's page's time)."""
        s = self._s
        slots = np.fromiter((u.slot for u in users), np.int32, len(users))
        full_at = np.flatnonzero(s.arena.free_segment_slots(slots) == NO_ID)
        if not full_at.size:
            return
        full = [users[i] for i in full_at.tolist()]
        slots, now = slots[full_at], now[full_at]
        _, victims = ops.recompute_heat(
            s.arena, slots, now, s.memory.heat_params(), np.ones(len(full), np.uint8)
        )
        victim_slots = victims.astype(np.int32)
        sids = s.segment_of[slots, victim_slots].tolist()
        evicted: list[int] = []
        for uslot, slot in zip(slots.tolist(), victim_slots.tolist(), strict=True):
            pool = s.arena.segment_pages(uslot, slot)
            evicted += [int(p) for p in s.page_of_slot[pool] if p >= 0]
            s.page_of_slot[pool] = -1
        s.arena.free_segments(slots, victim_slots)
        s.segment_of[slots, victim_slots] = -1
        self._drop_segments(db, full, victim_slots.tolist(), sids, writes)
        chains = s.views.drop_pages(evicted)  # pages out of MTM are not retrieved any more
        s.views.drop_chains(chains - s.store.live_chains(chains))

    def _drop_segments(
        self,
        db: Any,
        users: Sequence[UserState],
        slots: list[int],
        segment_ids: list[int],
        writes: RoundWrites,
    ) -> None:
        """The evicted segments (one of each of ``users``, at ``slots``) out of the store and
        the round's ``writes``: their pages leave MTM (tier ``evicted``), their queued
        promotions and rows go (claims with them), one audit event each; each kind of
        statement once for the wave (an event each took three statements for its id)."""
        s = self._s
        by_id = [(sid,) for sid in segment_ids]
        db.executemany(
            "UPDATE pages SET tier = 'evicted', segment_id = NULL WHERE segment_id = ?", by_id
        )
        db.executemany("DELETE FROM pending WHERE kind = 'promote' AND ref = ?", by_id)
        db.executemany("DELETE FROM segments WHERE segment_id = ?", by_id)
        for sid in segment_ids:
            writes.segments.pop(sid, None)
        s.store.audit_many(
            db,
            [
                (u.user_id, "evict", "segment", sid)
                for u, sid in zip(users, segment_ids, strict=True)
            ],
            [{"slot": slot} for slot in slots],
        )
        s.counters["segments_evicted"] += len(segment_ids)

    # ---------------------------------------------------------------- applying a round
    def _join_segments(
        self, r: Round, idx: np.ndarray, slots: np.ndarray, writes: RoundWrites
    ) -> None:
        """Fold pages ``idx`` of the round into live segments (their ``slots``): the embedding
        takes the page in (``unit(n * e_s + unit(e_p))``, see the module's docstring), keyword
        counts and summary grow, L_interaction counts the page. The
        rows change in ``writes`` (written once for the round), the arena now."""
        if not idx.size:
            return
        s = self._s
        slots = slots[idx].astype(np.int32)
        uslots = r.uslots[idx]
        sids = s.segment_of[uslots, slots]
        # a wave holds one page a user, so each segment joins once: its row changes in place
        rows = self._segment_rows(sids.tolist(), uslots, slots, writes)
        n = np.fromiter((row.n_pages for row in rows), np.int64, len(rows))
        add = _unit_rows(r.summary_emb[idx])
        emb = _unit_rows(np.asarray([row.emb for row in rows], np.float32) * n[:, None] + add)
        cap = s.memory.summary_chars
        for i, row in zip(idx.tolist(), rows, strict=True):
            out = r.outcomes[i]
            for w in out.keywords:
                row.counts[w] = row.counts.get(w, 0) + 1
            row.summary = merge_summary(row.summary, out.summary, cap)
        # the heat statistics from the arena, not the store: the store's last_access waits for
        # the heat write-behind, and a retrieval that credited the segment while this round's
        # stages ran must not be rolled back by the join
        heat = s.arena.pull_heat(uslots)
        at = (np.arange(idx.size), slots)
        l_inter = heat["l_interaction"][at].astype(np.int64) + 1
        last = np.maximum(heat["last_access"][at], r.now[idx])
        kw_rows = self._kw_matrix([row.counts for row in rows])
        for row, e, k in zip(rows, emb, kw_rows, strict=True):  # as the store keeps them
            row.emb, row.kw_row, row.n_pages, row.joined = (
                e.astype(np.float32),
                k,
                row.n_pages + 1,
                True,
            )
        s.arena.write_segments(uslots, slots, emb, kw_rows, l_interaction=l_inter, last_access=last)
        r.seg_slot[idx], r.segment_id[idx], r.seg_pos[idx] = slots, sids, n

    def _open_segments(self, db: Any, r: Round, idx: np.ndarray, writes: RoundWrites) -> None:
        """A new segment for each of pages ``idx`` in its user's lowest free slot (its row
        also in ``writes``, for a later wave that joins it)."""
        if not idx.size:
            return
        s = self._s
        slots = s.arena.free_segment_slots(r.uslots[idx])
        emb = _unit_rows(r.summary_emb[idx])
        counts = [{w: 1 for w in r.outcomes[i].keywords} for i in idx.tolist()]
        kw_rows = self._kw_matrix(counts)
        cap = s.memory.summary_chars
        ids = s.store.new_ids(db, "segments", idx.size)
        blobs = emb_blobs(emb)
        db.executemany(
            "INSERT INTO segments(segment_id, user_id, slot, summary, keywords, kw_ids, "
            "embedding, n_visit, l_interaction, last_access, created, n_pages) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 0, 1, ?, ?, 1)",
            [
                (
                    ids[j],
                    r.users[i].user_id,
                    int(slots[j]),
                    r.outcomes[i].summary[:cap],
                    dumps_text(counts[j]),
                    kw_blob(kw_rows[j]),
                    blobs[j],
                    float(r.now[i]),
                    float(r.now[i]),
                )
                for j, i in enumerate(idx.tolist())
            ],
        )
        sids = np.asarray(ids, np.int64)
        s.arena.write_segments(
            r.uslots[idx],
            slots,
            emb,
            kw_rows,
            n_visit=np.zeros(idx.size, np.int32),
            l_interaction=np.ones(idx.size, np.int32),
            last_access=r.now[idx],
        )
        s.grow_maps()  # the arena may have widened for these slots
        s.segment_of[r.uslots[idx], slots] = sids
        for j, i in enumerate(idx.tolist()):
            writes.segments[ids[j]] = SegmentRow(
                r.outcomes[i].summary[:cap],
                counts[j],
                emb[j].astype(np.float32),
                kw_rows[j],
                1,
                int(r.uslots[i]),
                int(slots[j]),
            )
        s.counters["segments_created"] += int(idx.size)
        r.seg_slot[idx], r.segment_id[idx], r.seg_pos[idx] = slots, sids, 0

    def _link_pages(self, db: Any, r: Round, page_ids: list[int], writes: RoundWrites) -> list[int]:
        """The pages' MTM rows and the dialogue chain: a continuous page links to its user's
        previous evicted page and joins its chain, whose meta (one row per chain, however long
        it grows) is regenerated; any other page starts a chain of its own. Returns each
        page's chain id. The links, metas and tails go with the round's (``writes``)."""
        chain_of = writes.chains
        prev = [
            u.chain_tail if o.continuous else None for u, o in zip(r.users, r.outcomes, strict=True)
        ]
        linked = [i for i, p in enumerate(prev) if p is not None]
        unknown = [prev[i] for i in linked if prev[i] not in chain_of]
        if unknown:
            chain_of.update(
                select_in(
                    lambda sql, params: db.execute(sql, params).fetchall(),
                    "SELECT page_id, COALESCE(chain_id, page_id) FROM pages WHERE page_id IN",
                    unknown,
                )
            )
        chains = [
            chain_of[prev[i]] if prev[i] is not None else pid for i, pid in enumerate(page_ids)
        ]
        chain_of.update(zip(page_ids, chains, strict=True))
        writes.next_page += [(page_ids[i], prev[i]) for i in linked]
        for chain, u, o in zip(chains, r.users, r.outcomes, strict=True):
            writes.chain_meta[chain] = (u.user_id, o.meta)
        db.executemany(
            "UPDATE pages SET tier = 'mtm', segment_id = ?, seg_pos = ?, prev_page = ?, "
            "chain_id = ?, summary = ?, keywords = ?, mode = ? WHERE page_id = ?",
            [
                (
                    int(r.segment_id[i]),
                    int(r.seg_pos[i]),
                    prev[i],
                    chains[i],
                    o.summary,
                    dumps_text(o.keywords),
                    o.mode,
                    pid,
                )
                for i, (pid, o) in enumerate(zip(page_ids, r.outcomes, strict=True))
            ],
        )
        for pid, o, u in zip(page_ids, r.outcomes, r.users, strict=True):
            u.chain_tail, u.chain_meta = pid, o.meta
            writes.tails[u.user_id] = pid
            _placed(u.pending, pid)
        return chains

    def _kw_matrix(self, counts: Sequence[dict[str, int]]) -> np.ndarray:
        """Segments' keyword rows: each one's most frequent keywords (first seen wins ties)."""
        width = self._s.memory.keyword_width
        # reverse=True keeps a stable sort's order among equal counts: first seen wins ties; a
        # segment with at most `width` keywords keeps them all (a row's order is its ids')
        ranked = [
            list(c) if len(c) <= width else sorted(c, key=c.__getitem__, reverse=True)[:width]
            for c in counts
        ]
        return keyword_rows(ranked, width)


def _placed(pending: deque, page_id: int) -> None:
    """A pending page placed in MTM leaves its user's ``pending`` (retrieved from MTM now).
    A user's pages are placed in the order they left STM, so it is the first."""
    if pending and pending[0] == page_id:
        pending.popleft()
    elif page_id in pending:
        pending.remove(page_id)


def _unit_rows(m: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (a zero row stays zero). The norms as ``np.linalg.norm``
    computes them for real rows (bit for bit), without its dispatch: a wave calls this twice."""
    norms = np.sqrt(np.add.reduce(m * m, axis=1, keepdims=True))
    return m / np.maximum(norms, 1e-12)


def _same_text(before: dict[str, Any] | None, now: dict[str, Any] | None) -> bool:
    """Whether a page still has the text and time a stage saw (``now`` None: deleted)."""
    return (
        before is not None
        and now is not None
        and all(before[k] == now[k] for k in ("user_input", "agent_response", "timestamp"))
    )

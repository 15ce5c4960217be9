"""Mid-term memory: topic segments, the dialogue chain, and the eviction of cold segments.

A page leaving STM is applied in a *round* (one pending page of each user, see
:mod:`~memoryos_gpu.engine.derived`): the chain + summary stage runs on the whole round (one LLM
batch, or extractive), the summaries are embedded, and one kernel call matches them against
every user's segments. A page joins its best segment when ``cos + Jaccard >= theta`` (the
segment's embedding becomes the running mean, its keyword counts and summary grow), otherwise it
opens a segment, the lowest-heat one being evicted first when every slot is live. Each page's
effects and the deletion of its pending row share one transaction; heat is recomputed and
promotions queued in it (:mod:`~memoryos_gpu.engine.heat`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import astuple
from typing import Any

import numpy as np

from memoryos_gpu import ops
from memoryos_gpu.arena import NO_ID
from memoryos_gpu.lexical import terms_from_blobs
from memoryos_gpu.stages import PageOutcome, PageWork
from memoryos_gpu.store.sqlite import blob_matrix, emb_blob
from memoryos_gpu.text.keywords import keyword_tokens

from .heat import Heat
from .state import EngineState, UserState, WorkItem, keyword_rows, to_host


class Segments:
    """Matching pages to segments, opening, joining and evicting them, for every user."""

    def __init__(self, state: EngineState, heat: Heat) -> None:
        self._s = state
        self._heat = heat

    def process_pages(self, items: list[WorkItem]) -> None:
        """Apply one round of pending pages (at most one per user) to their users' MTM."""
        s = self._s
        d = s.embedder.dim
        page_ids = [ref for _, _, ref in items]
        rows = s.store.page_rows(page_ids)
        embs = s.store.page_embeddings(page_ids, d)
        users = [s.user(uid) for _, uid, _ in items]
        prev_ids = [u.chain_tail for u in users]
        prev_rows = s.store.page_rows([p for p in prev_ids if p is not None])
        prev_embs = dict(
            zip(
                [p for p in prev_ids if p is not None],
                s.store.page_embeddings([p for p in prev_ids if p is not None], d),
                strict=True,
            )
        )
        work = [
            PageWork(
                rows[pid],
                embs[i],
                prev_rows.get(prev) if prev else None,
                prev_embs.get(prev) if prev else None,
                u.chain_meta,
            )
            for i, (pid, prev, u) in enumerate(zip(page_ids, prev_ids, users, strict=True))
        ]
        outcomes = s.stages.pages(work)
        for o in outcomes:  # LLM keywords may be phrases: one normalised token list, once
            o.keywords = keyword_tokens(o.keywords)
        summary_emb = self._summary_embeddings(outcomes, embs, [rows[p] for p in page_ids])
        kw_rows = keyword_rows([o.keywords for o in outcomes], s.memory.keyword_width)
        uslots = np.array([u.slot for u in users], np.int32)
        best_score, best_slot = ops.match_segments(s.arena, summary_emb, uslots, kw_rows)
        best_score, best_slot = to_host(best_score), to_host(best_slot)
        join = (best_slot >= 0) & (best_score >= s.memory.theta)
        self._make_room([u for u, j in zip(users, join, strict=True) if not j])
        seg_info = self._segment_rows(
            [
                int(s.segment_of[u.slot, slot])
                for u, slot, j in zip(users, best_slot, join, strict=True)
                if j
            ]
        )
        stored = s.store.page_terms(page_ids)
        terms = terms_from_blobs([stored.get(p) for p in page_ids])
        seg_slots = np.empty(len(items), np.int32)
        metas: list[tuple[list[int], str]] = []  # (pages, chain meta) once committed
        with s.store.transaction() as db:
            for i, (work_id, _uid, pid) in enumerate(items):
                seg_slots[i] = self._apply_page(
                    db,
                    users[i],
                    pid,
                    outcomes[i],
                    summary_emb[i],
                    int(best_slot[i]) if join[i] else None,
                    seg_info,
                    metas,
                )
                db.execute("DELETE FROM pending WHERE work_id = ?", (work_id,))
            # the round's pages into their segments' blocks, in round order (each segment's
            # positions are the ones the store just gave them), and their term rows
            pools = s.arena.append_pages(uslots, seg_slots, embs)
            s.map_pages(pools, np.asarray(page_ids, np.int64))
            s.arena.write_terms(pools, *astuple(terms))
            self._heat.refresh(db, users)
        for page_ids_, meta in metas:
            s.views.set_meta(page_ids_, meta)

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
        return self._s.embedder.encode(
            [o.summary or r["user_input"] for o, r in zip(outcomes, rows, strict=True)]
        )

    def _segment_rows(self, segment_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Current summary, keywords, embedding and statistics of segments (one query)."""
        ids = sorted(set(segment_ids))
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self._s.store.query(
            "SELECT segment_id, summary, keywords, embedding, n_pages, l_interaction, "
            f"last_access FROM segments WHERE segment_id IN ({marks})",
            ids,
        )
        emb = blob_matrix([r[3] for r in rows], self._s.embedder.dim)
        return {
            r[0]: {
                "summary": r[1],
                "keywords": json.loads(r[2]),
                "embedding": e,
                "n_pages": r[4],
                "l_interaction": r[5],
                "last_access": r[6],
            }
            for r, e in zip(rows, emb, strict=True)
        }

    # ---------------------------------------------------------------- eviction
    def _make_room(self, users: Sequence[UserState]) -> None:
        """Users about to open a segment with every slot live lose their lowest-heat one."""
        s = self._s
        full = [u for u in users if s.arena.free_segment_slot(u.slot) == NO_ID]
        if not full:
            return
        slots = np.array([u.slot for u in full], np.int32)
        now = np.array([s.now(u) for u in full])
        _, victims = ops.recompute_heat(
            s.arena, slots, now, s.memory.heat_params(), np.ones(len(full), np.uint8)
        )
        evicted: list[int] = []
        with s.store.transaction() as db:
            for u, v in zip(full, victims, strict=True):
                evicted += self._evict_segment(db, u, int(v))
        s.views.drop_pages(evicted)  # pages out of MTM are not retrieved any more

    def _evict_segment(self, db: Any, user: UserState, slot: int) -> list[int]:
        """Free a segment's arena rows, blocks and term rows; its pages leave MTM (tier
        ``evicted``). Returns their page ids."""
        s = self._s
        sid = int(s.segment_of[user.slot, slot])
        pool = s.arena.segment_pages(user.slot, slot)
        page_ids = [int(p) for p in s.page_of_slot[pool] if p >= 0]
        s.page_of_slot[pool] = -1
        s.arena.free_segments(np.array([user.slot]), np.array([slot]))
        s.segment_of[user.slot, slot] = -1
        db.execute(
            "UPDATE pages SET tier = 'evicted', segment_id = NULL WHERE segment_id = ?", (sid,)
        )
        db.execute("DELETE FROM pending WHERE kind = 'promote' AND ref = ?", (sid,))
        db.execute("DELETE FROM segments WHERE segment_id = ?", (sid,))
        s.store.audit(db, user.user_id, "evict", "segment", sid, {"slot": slot})
        s.counters["segments_evicted"] += 1
        return page_ids

    # ---------------------------------------------------------------- applying a page
    def _apply_page(
        self,
        db: Any,
        user: UserState,
        page_id: int,
        out: PageOutcome,
        summary_emb: np.ndarray,
        join_slot: int | None,
        seg_info: dict[int, dict[str, Any]],
        metas: list[tuple[list[int], str]],
    ) -> int:
        """Put a page in a segment (``join_slot``, or a new one) and link it into the user's
        dialogue chain. Returns the segment slot (the caller places the round's pages in
        their blocks in one call); ``metas`` collects the chain meta updates."""
        s = self._s
        now = s.now(user)
        if join_slot is not None:
            slot = join_slot
            sid, seg_pos = self._join_segment(db, user, slot, out, summary_emb, seg_info, now)
        else:
            slot, sid = self._open_segment(db, user, out, summary_emb, now)
            seg_pos = 0
        metas.append(self._link_page(db, user, page_id, out, sid, seg_pos))
        return slot

    def _join_segment(
        self,
        db: Any,
        user: UserState,
        slot: int,
        out: PageOutcome,
        summary_emb: np.ndarray,
        seg_info: dict[int, dict[str, Any]],
        now: float,
    ) -> tuple[int, int]:
        """Fold a page into a live segment; returns (segment id, the page's position in it).
        ``seg_info`` is updated too: a later page of the round may join the same segment."""
        s = self._s
        sid = int(s.segment_of[user.slot, slot])
        info = seg_info[sid]
        n = info["n_pages"]
        emb = info["embedding"] * n + summary_emb / max(1e-12, np.linalg.norm(summary_emb))
        emb = emb / max(1e-12, float(np.linalg.norm(emb)))
        kw_counts: dict[str, int] = dict(info["keywords"])
        for w in out.keywords:
            kw_counts[w] = kw_counts.get(w, 0) + 1
        summary = _merge_summary(info["summary"], out.summary, s.memory.summary_chars)
        l_inter = info["l_interaction"] + 1
        last = max(info["last_access"], now)
        kw_row = self._kw_matrix(kw_counts)
        info.update(
            embedding=emb,
            keywords=kw_counts,
            summary=summary,
            n_pages=n + 1,
            l_interaction=l_inter,
            last_access=last,
        )
        db.execute(
            "UPDATE segments SET summary = ?, keywords = ?, kw_ids = ?, embedding = ?, "
            "l_interaction = ?, last_access = ?, n_pages = ? WHERE segment_id = ?",
            (
                summary,
                json.dumps(kw_counts),
                _kw_blob(kw_row),
                emb_blob(emb),
                l_inter,
                last,
                n + 1,
                sid,
            ),
        )
        s.arena.write_segments(
            [user.slot], [slot], emb[None], kw_row, l_interaction=[l_inter], last_access=[last]
        )
        return sid, n

    def _open_segment(
        self, db: Any, user: UserState, out: PageOutcome, summary_emb: np.ndarray, now: float
    ) -> tuple[int, int]:
        """A new segment from one page in the user's free slot; returns (slot, segment id)."""
        s = self._s
        slot = s.arena.free_segment_slot(user.slot)
        emb = summary_emb / max(1e-12, float(np.linalg.norm(summary_emb)))
        kw_counts = {w: 1 for w in out.keywords}
        kw_row = self._kw_matrix(kw_counts)
        summary = out.summary[: s.memory.summary_chars]
        cur = db.execute(
            "INSERT INTO segments(user_id, slot, summary, keywords, kw_ids, embedding, "
            "n_visit, l_interaction, last_access, created, n_pages) "
            "VALUES (?, ?, ?, ?, ?, ?, 0, 1, ?, ?, 1) RETURNING segment_id",
            (
                user.user_id,
                slot,
                summary,
                json.dumps(kw_counts),
                _kw_blob(kw_row),
                emb_blob(emb),
                now,
                now,
            ),
        )
        sid = cur.fetchone()[0]
        s.segment_of[user.slot, slot] = sid
        s.arena.write_segments(
            [user.slot],
            [slot],
            emb[None],
            kw_row,
            n_visit=[0],
            l_interaction=[1],
            last_access=[now],
        )
        s.counters["segments_created"] += 1
        return slot, sid

    def _link_page(
        self, db: Any, user: UserState, page_id: int, out: PageOutcome, sid: int, seg_pos: int
    ) -> tuple[list[int], str]:
        """The page's MTM row, and the dialogue chain: a continuous page links to the previous
        evicted page and the chain's meta is regenerated on every page of it. Returns the
        pages whose meta changed and the meta."""
        s = self._s
        prev = user.chain_tail if out.continuous else None
        if prev is not None:
            chain_id = s.store.query(
                "SELECT COALESCE(chain_id, page_id) FROM pages WHERE page_id = ?", (prev,)
            )[0][0]
            db.execute("UPDATE pages SET next_page = ? WHERE page_id = ?", (page_id, prev))
            changed = [
                r[0]
                for r in db.execute(
                    "UPDATE pages SET meta = ? WHERE chain_id = ? RETURNING page_id",
                    (out.meta, chain_id),
                ).fetchall()
            ]
        else:
            chain_id = page_id
            changed = []
        db.execute(
            "UPDATE pages SET tier = 'mtm', segment_id = ?, seg_pos = ?, prev_page = ?, "
            "chain_id = ?, meta = ?, summary = ?, keywords = ?, mode = ? WHERE page_id = ?",
            (
                sid,
                seg_pos,
                prev,
                chain_id,
                out.meta,
                out.summary,
                json.dumps(out.keywords),
                out.mode,
                page_id,
            ),
        )
        user.chain_tail, user.chain_meta = page_id, out.meta
        db.execute(
            "UPDATE users SET chain_tail = ?, chain_meta = ? WHERE user_id = ?",
            (page_id, out.meta, user.user_id),
        )
        return [*changed, page_id], out.meta

    def _kw_matrix(self, counts: dict[str, int]) -> np.ndarray:
        """A segment's keyword row: its most frequent keywords (first seen wins ties)."""
        width = self._s.memory.keyword_width
        ranked = sorted(counts, key=lambda w: -counts[w])  # stable: first seen wins ties
        return keyword_rows([ranked[:width]], width)


def _kw_blob(kw_row: np.ndarray) -> bytes:
    """The store's copy of a segment's hashed keyword ids (one ``[1, K]`` arena row, unpadded)."""
    row = kw_row[0]
    return np.ascontiguousarray(row[row >= 0], "<i4").tobytes()


def _merge_summary(old: str, new: str, cap: int) -> str:
    """A segment's summary: its pages' topic summaries, newest last, capped at ``cap`` chars."""
    if not new or new in old:
        return old
    merged = f"{old} | {new}" if old else new
    return merged if len(merged) <= cap else merged[-cap:]

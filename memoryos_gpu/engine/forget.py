"""Deleting a page so that nothing derived from it is left, and the memory side of deletions.

What a page leaves behind besides its own row, and what happens to it here:

- **knowledge entries and profile values** derived from it (provenance rows): removed, the
  other pages they came from re-analysed (:func:`~memoryos_gpu.store.derivations.forget_pages`),
  each removed entry's deletion audited (:func:`forget_audited`);
- **its segment's summary, keywords and embedding**: re-derived from the segment's remaining
  pages, replaying the rules that built them (the pages keep their own summary, keywords and
  embedding); a segment left with no page is removed;
- **the topic summaries and keywords of the pages after it in its chain** (LLM mode: their
  prompts showed it as the previous page, or inside the thread summary): re-derived from each
  page alone, extractively;
- **its chain's meta** (the chain's row, which the user's ``chain_meta`` is read from):
  re-derived from the chain's remaining pages by the extractive rule (the first page's first
  sentence; an LLM's running summary may hold the deleted text and is not regenerated
  synchronously); a chain left with no page is removed;
- **the keyword statistics**: the in-memory extractor un-counts its text and the saved copy is
  dropped (rewritten on close; a reopen before that refits from the pages); the per-user
  vocabulary un-counts its term row;
- **the audit log**: the deletion is recorded without content, and the content of the page's
  earlier events (edits) is cleared.

SQLite deletes with ``secure_delete``, and the file is rewritten and the write-ahead log
truncated afterwards, so the text is not left in the database file or its log
(:mod:`memoryos_gpu.store.erasure`). That comes last, once memory has followed the commit, and
after the engine lock is released: the store's erasure thread does it (a rewrite takes seconds
on a store of a few hundred MB, which every retrieval waited for under the engine lock), and
it may have to wait for readers of the log; a deleted page must not be retrieved meanwhile.

A deletion's statements find the rows they change by index, not by scanning a table that
grows with the store: the page's chain neighbours through its chain (``pages_chain``), its
audit events through its user (``audit_user``).

Editing a page's text (:meth:`Forgetting.rederive_edited`, from ``update_page``) runs the same
re-derivation with the page kept: what its old text implied goes, and the page is re-analysed
with the other pages behind it, so what its new text says is derived again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from memoryos_gpu import prompts
from memoryos_gpu.embed.base import encode_checked
from memoryos_gpu.lexical import terms_from_blobs
from memoryos_gpu.stages import PageWork
from memoryos_gpu.store.derivations import Forgotten, forget_pages
from memoryos_gpu.store.rows import blob_matrix, emb_blob
from memoryos_gpu.text.keywords import keyword_tokens

from .mtm_rounds import kw_blob, merge_summary
from .state import EngineState, UserState, keyword_rows

log = logging.getLogger(__name__)


@dataclass
class Rederived:
    """What a page change re-derived in its transaction, for the memory side once committed:
    what was forgotten, the segments re-derived ((id, embedding or None, keyword row)) and the
    chain's meta ((chain id, meta, or None when the chain was left with no page), or None)."""

    forgotten: Forgotten
    segments: list[tuple[int, np.ndarray | None, np.ndarray | None]]
    chain: tuple[int, str | None] | None


class Forgetting:
    """``delete_page`` and the memory side of what a deletion forgot."""

    def __init__(self, state: EngineState) -> None:
        self._s = state

    def drop(self, forgotten: Forgotten | None) -> None:
        """Take the entries and profile values a deletion removed out of the rings, views and
        profiles (the store rows are gone already)."""
        if forgotten is None:
            return
        s = self._s
        if forgotten.entries:
            where = np.argwhere(np.isin(s.entry_of_ring, forgotten.entries))
            s.arena.delete_knowledge(where[:, 0], where[:, 1])
            s.entry_of_ring[where[:, 0], where[:, 1]] = -1
            s.views.drop_knowledge(forgotten.entries)
        s.profiles.update(forgotten.profiles)

    def drop_rejects(self, user_id: str) -> None:
        """Remove a deleted user's rows from the rejects files ``memoryos-gpu ingest`` left in
        the store's folder (:func:`memoryos_gpu.rejects.forget_rejects`): they hold the user's
        refused records in plain text. Called after the deletion, outside the engine lock (a
        large file takes a while); a file that cannot be rewritten is logged, not raised: the
        store's rows are gone and memory has followed, so the deletion itself succeeded."""
        from memoryos_gpu.rejects import forget_rejects

        try:
            forget_rejects(self._s.config.store, user_id)
        except OSError as exc:
            log.warning("user %r deleted, but a rejects file keeps their rows: %s", user_id, exc)

    def delete_page(self, page_id: int) -> bool:
        """Remove a page from every tier and everything derived from it (module docstring)."""
        s = self._s
        with s.locked():
            found = s.store.query(
                "SELECT user_id, segment_id, chain_id, user_input || ' ' || agent_response, "
                "prev_page, next_page FROM pages WHERE page_id = ?",
                (int(page_id),),
            )
            if not found:
                return False
            uid, sid, chain, text, *links = found[0]
            user = s.users.get(uid)
            old_terms = terms_from_blobs([s.store.page_terms([page_id]).get(page_id)])
            s.store.begin_erasure()
            with s.store.transaction() as db:
                forgotten = forget_audited(db, s.store, page_id)
                touched = self._rederive_followers(db, page_id, chain)
                self._unlink(db, user, page_id, chain, links)
                redone = self._rederive_around(db, user, {sid, *touched}, chain, forgotten)
                # the page's events (its edits' texts) are its user's: found by audit_user
                db.execute(
                    "UPDATE audit SET detail = '{}' "
                    "WHERE user_id = ? AND item_kind = 'page' AND item_id = ?",
                    (uid, int(page_id)),
                )
                s.store.audit(db, uid, "delete", "page", page_id, {})
            s.edits += 1
            # memory follows the committed store: arena row, term row and view go together
            slots = np.flatnonzero(s.page_of_slot == page_id)
            s.arena.delete_pages(slots)
            s.page_of_slot[slots] = -1
            chains = s.views.drop_pages([page_id])
            s.vocabulary.add([uid], old_terms, sign=-1)
            s.extractor.remove([text])
            self.apply(user, redone)
            s.views.drop_chains(chains - s.store.live_chains(chains))
        s.store.checkpoint()  # last, without the engine lock: never a reason for memory not
        return True  # to follow, nor for a retrieval to wait (module docstring)

    def rederive_edited(self, db: Any, page_id: int) -> Rederived:
        """In ``update_page``'s transaction, once the page's new text is written: what its old
        text implied goes as for a deleted page (its facts and profile values; the other pages
        behind them and the page itself re-analysed, so the next ``process_pending`` derives
        what its new text says), and its own topic summary and keywords, its followers' (LLM
        mode), its segment's and its chain's meta are re-derived from the text now held.
        :meth:`apply` the result once committed."""
        uid, sid, chain = db.execute(
            "SELECT user_id, segment_id, chain_id FROM pages WHERE page_id = ?", (int(page_id),)
        ).fetchone()
        forgotten = forget_audited(db, self._s.store, page_id, edited=True)
        touched = self._rederive_followers(db, page_id, chain, include_self=True)
        user = self._s.users.get(uid)
        return self._rederive_around(db, user, {sid, *touched}, chain, forgotten)

    def _rederive_around(
        self,
        db: Any,
        user: UserState | None,
        segments: set[int | None],
        chain: int | None,
        forgotten: Forgotten,
    ) -> Rederived:
        """The segments and the chain meta a page change touched, again from the pages held;
        the saved keyword statistics are dropped (rewritten on close)."""
        segs = [self._rederive_segment(db, sg) for sg in sorted(segments - {None})]
        meta = self._rederive_chain(db, user, chain) if chain is not None else None
        db.execute("DELETE FROM meta WHERE key = 'keyword_extractor'")
        return Rederived(forgotten, segs, None if chain is None else (chain, meta))

    def apply(self, user: UserState | None, redone: Rederived) -> None:
        """The memory side of a committed :meth:`_rederive_around`: segment rows in the
        arena, chain metas in the views, forgotten entries and profile values out."""
        s = self._s
        for seg in redone.segments if user is not None else ():
            self._apply_segment(user, *seg)
        if redone.chain is not None:
            chain, meta = redone.chain
            if meta is None:
                s.views.drop_chains([chain])
            elif chain in s.views.pages.chains:  # held while a page of it is in MTM
                s.views.set_chain(chain, meta)
        self.drop(redone.forgotten)

    def _unlink(
        self,
        db: Any,
        user: UserState | None,
        page_id: int,
        chain: int | None,
        links: list[int | None],
    ) -> None:
        """The page's row and pending work go; its chain neighbours are unlinked: its own
        ``links`` ``[prev_page, next_page]`` by their ids, and any other page of its chain
        that names it (a link joins a page to its predecessor's chain, ``mtm.py``; a page
        with no chain id heads the chain that bears its page id) through ``pages_chain``.
        Not by scanning the whole ``pages`` table, twice: ~30-150 ms a deletion at 60,000
        pages, under the engine lock."""
        db.execute("DELETE FROM pending WHERE kind = 'page' AND ref = ?", (page_id,))
        prev, nxt = links
        key = page_id if chain is None else chain
        for column, neighbour in (("next_page", prev), ("prev_page", nxt)):
            db.execute(
                f"UPDATE pages SET {column} = NULL WHERE page_id = ? AND {column} = ?",
                (neighbour, page_id),
            )
            db.execute(
                f"UPDATE pages SET {column} = NULL WHERE chain_id = ? AND {column} = ?",
                (key, page_id),
            )
        db.execute("DELETE FROM pages WHERE page_id = ?", (page_id,))
        if user is not None and page_id in user.stm:
            user.stm.remove(page_id)
        if user is not None and page_id in user.pending:
            user.pending.remove(page_id)
        if user is not None and user.chain_tail == page_id:
            user.chain_tail = user.chain_meta = None
            db.execute("UPDATE users SET chain_tail = NULL WHERE user_id = ?", (user.user_id,))

    def _rederive_followers(
        self, db: Any, page_id: int, chain: int | None, *, include_self: bool = False
    ) -> set[int]:
        """The pages after this one in its chain had it in their LLM prompts (as the previous
        page, or inside the thread summary each prompt carries), so their topic summaries and
        keywords may hold its text: they are re-derived from each page alone by the extractive
        rule (their ``mode`` says so). Returns their segments (whose summaries are built from
        theirs). The extractive mode reads neither: nothing to do there. ``include_self``: the
        page was edited, its own summary and keywords (either mode) are re-derived too, unless
        its page work is still pending (it will read the new text)."""
        s = self._s
        cols = (
            "SELECT page_id, user_id, user_input, agent_response, timestamp, segment_id FROM pages"
        )
        rows = []
        if (
            include_self
            and not db.execute(
                "SELECT 1 FROM pending WHERE kind = 'page' AND ref = ?", (page_id,)
            ).fetchall()
        ):
            rows += db.execute(f"{cols} WHERE page_id = ?", (page_id,)).fetchall()
        if s.stages.mode != "extractive" and chain is not None:
            rows += db.execute(
                f"{cols} WHERE chain_id = ? AND seq > (SELECT seq FROM pages WHERE page_id = ?) "
                "ORDER BY seq",
                (chain, page_id),
            ).fetchall()
        if not rows:
            return set()
        fields = ("page_id", "user_id", "user_input", "agent_response", "timestamp")
        blank = np.zeros(s.embedder.dim, np.float32)  # continuity is not asked: no previous page
        work = [
            PageWork(dict(zip(fields, r[:5], strict=True)), blank, None, None, None) for r in rows
        ]
        rule = s.stages if s.stages.mode == "extractive" else s.stages.fallback
        outs = rule.pages(work)
        db.executemany(
            "UPDATE pages SET summary = ?, keywords = ?, mode = 'extractive' WHERE page_id = ?",
            [
                (o.summary, json.dumps(keyword_tokens(o.keywords)), r[0])
                for o, r in zip(outs, rows, strict=True)
            ],
        )
        return {int(r[5]) for r in rows if r[5] is not None}

    def _rederive_segment(
        self, db: Any, sid: int
    ) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """Rebuild a segment's summary, keywords and embedding from its remaining pages, in
        their order, with the rules that built them (mtm.py); returns (segment id, embedding,
        keyword row) for the arena, embedding None when the segment was left empty and
        removed."""
        s = self._s
        rows = db.execute(
            "SELECT p.summary, p.keywords, v.embedding, p.user_input FROM pages p "
            "JOIN page_vectors v ON v.page_id = p.page_id WHERE p.segment_id = ? "
            "ORDER BY p.seg_pos",
            (sid,),
        ).fetchall()
        if not rows:
            db.execute("DELETE FROM pending WHERE kind = 'promote' AND ref = ?", (sid,))
            db.execute("DELETE FROM segments WHERE segment_id = ?", (sid,))
            return sid, None, None
        if s.stages.mode == "extractive":
            vecs = blob_matrix([r[2] for r in rows], s.embedder.dim)
        else:
            vecs = encode_checked(s.embedder, [r[0] or r[3] for r in rows])
        emb = _unit(vecs[0])
        for k, v in enumerate(vecs[1:], start=1):
            emb = _unit(emb * k + _unit(v))
        counts: dict[str, int] = {}
        summary = ""
        cap = s.memory.summary_chars
        for r in rows:
            for w in json.loads(r[1]) if r[1] else []:
                counts[w] = counts.get(w, 0) + 1
            summary = merge_summary(summary, r[0] or "", cap) if summary else (r[0] or "")[:cap]
        width = s.memory.keyword_width
        ranked = sorted(counts, key=lambda w: -counts[w])  # stable: first seen wins ties
        kw_row = keyword_rows([ranked[:width]], width)
        db.execute(
            "UPDATE segments SET summary = ?, keywords = ?, kw_ids = ?, embedding = ? "
            "WHERE segment_id = ?",
            (summary, json.dumps(counts), kw_blob(kw_row[0]), emb_blob(emb), sid),
        )
        return sid, emb, kw_row

    def _apply_segment(
        self, user: UserState, sid: int, emb: np.ndarray | None, kw_row: np.ndarray | None
    ) -> None:
        s = self._s
        at = np.flatnonzero(s.segment_of[user.slot] == sid)
        if not at.size:
            return
        if emb is None:
            s.arena.free_segments(np.array([user.slot]), at[:1])
            s.segment_of[user.slot, at[0]] = -1
        else:
            s.arena.write_segments([user.slot], at[:1], emb[None], kw_row)

    def _rederive_chain(self, db: Any, user: UserState | None, chain: int) -> str | None:
        """The chain's meta again, from its remaining pages (the extractive rule: the first
        page's first sentence), or None when none is left (its row goes); the user's
        in-memory ``chain_meta`` too when its tail is on the chain."""
        first = db.execute(
            "SELECT user_input, agent_response, timestamp FROM pages WHERE chain_id = ? "
            "ORDER BY seq LIMIT 1",
            (chain,),
        ).fetchone()
        if first is None:
            db.execute("DELETE FROM chains WHERE chain_id = ?", (chain,))
            return None
        fields = ("user_input", "agent_response", "timestamp")
        meta = prompts.fallback_chain_meta(None, dict(zip(fields, first, strict=True)))
        db.execute("UPDATE chains SET meta = ? WHERE chain_id = ?", (meta, chain))
        if user is None or user.chain_tail is None:
            return meta
        on_chain = "SELECT 1 FROM pages WHERE page_id = ? AND chain_id = ?"
        if db.execute(on_chain, (user.chain_tail, chain)).fetchone():
            user.chain_meta = meta
        return meta


def forget_audited(db: Any, store: Any, page_id: int, *, edited: bool = False) -> Forgotten:
    """:func:`forget_pages` for one page, with a ``delete`` audit event for each knowledge
    entry it removes, as a direct ``delete_knowledge`` writes one: a fact gone with its page
    (deleted, or edited: its facts are derived again under new ids) must not read in its
    history as never deleted. One batched statement."""
    forgotten = forget_pages(db, [page_id], edited=edited)
    store.audit_many(db, [(owner, "delete", "knowledge", e) for e, owner in forgotten.owners])
    return forgotten


def _unit(v: np.ndarray) -> np.ndarray:
    return v / max(1e-12, float(np.linalg.norm(v)))

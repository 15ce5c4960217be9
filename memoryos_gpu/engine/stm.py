"""Short-term memory: accepting pages, and the STM FIFO whose overflow becomes pending work.

A page is committed to the store's STM, with its embedding and its BM25 term row, in the
transaction of its batch before ``add_many`` returns (that is the acknowledgement). Each
user's STM holds the newest ``stm_capacity`` pages; a page pushed out of a full STM is marked
``pending`` in the same transaction, so the store records the derived work still owed (chain,
segment, promotion), and :mod:`~memoryos_gpu.engine.derived` runs it later, in order per user.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from memoryos_gpu.lexical import terms_from_blobs, terms_to_blobs
from memoryos_gpu.store.sqlite import emb_blob
from memoryos_gpu.types import AddResult, PageInput

from .page_text import page_terms_of, page_text
from .state import DEFAULT_ASSISTANT, EngineHooks, EngineState, UserState


@dataclass(frozen=True)
class Prepared:
    """What accepting pages computes before it needs the engine's state: by position in the
    batch, each new page's embedding and BM25 term-row blob."""

    vec_of: dict[int, np.ndarray]
    blob_of: dict[int, bytes]


class ShortTerm:
    """The acceptance path: embed, deduplicate by ``source``, commit, overflow the STM."""

    def __init__(self, state: EngineState, hooks: EngineHooks) -> None:
        self._s = state
        self._hooks = hooks

    def prepare(self, items: list[PageInput], only: list[int] | None = None) -> Prepared:
        """Embeddings and term rows of the pages not yet stored (by ``source``): the costly,
        state-free part of accepting, which :meth:`accept` lets run outside the engine lock
        (so one caller's large pages do not hold up everyone's writes and retrievals)."""
        s = self._s
        if only is None:
            known = s.store.known_sources(p.source for p in items if p.source)
            only = [i for i, p in enumerate(items) if not (p.source and p.source in known)]
        emb = (
            s.embedder.encode([page_text(items[i], s.memory.embed_dates) for i in only])
            if only
            else []
        )
        terms = page_terms_of(
            [
                (items[i].user_input, items[i].agent_response, items[i].timestamp, items[i].meta)
                for i in only
            ]
        )
        return Prepared(
            dict(zip(only, emb, strict=True)), dict(zip(only, terms_to_blobs(terms), strict=True))
        )

    def accept(self, items: list[PageInput], prepared: Prepared | None = None) -> list[AddResult]:
        """Commit pages (and the pending work their STM overflow creates) in one transaction.

        ``prepared``: :meth:`prepare`'s output made before the engine lock was taken; the
        sources are checked again here (a page stored or deleted meanwhile), and a page that
        became new since is prepared now. The in-memory user state is changed only as the
        transaction goes; if it fails, that state is restored and new users' arena slots are
        released, so memory and store agree. The keyword statistics learn the new pages once
        they are committed.
        """
        s = self._s
        known = s.store.known_sources(p.source for p in items if p.source)
        fresh = [i for i, p in enumerate(items) if not (p.source and p.source in known)]
        prep = prepared or Prepared({}, {})
        late = [i for i in fresh if i not in prep.vec_of]
        if late:
            more = self.prepare(items, late)
            prep = Prepared({**prep.vec_of, **more.vec_of}, {**prep.blob_of, **more.blob_of})
        vec_of, blob_of = prep.vec_of, prep.blob_of
        touched = {p.user_id for p in items}
        snapshot = {
            uid: (u.clock, u.next_seq, deque(u.stm)) for uid, u in s.users.items() if uid in touched
        }
        counters = dict(s.counters)
        new_users: list[UserState] = []
        try:
            results = self._insert_pages(items, known, vec_of, blob_of, new_users)
        except BaseException:
            for uid, (clock, next_seq, stm) in snapshot.items():
                u = s.users[uid]
                u.clock, u.next_seq, u.stm = clock, next_seq, stm
            for u in new_users:
                s.drop_user_state(u)
            s.counters = counters
            raise
        for p, r in zip(items, results, strict=True):  # committed: retrievals may show them
            if not r.duplicate:
                user = s.users[p.user_id]
                user.extra = s.views.shared_extra(p.meta, user.extra)
                s.views.put_page(
                    r.page_id, p.user_input, p.agent_response, p.timestamp, None, user.extra
                )
        self._hooks._learn_keywords(
            [f"{items[i].user_input} {items[i].agent_response}" for i in fresh]
        )
        s.vocabulary.add(  # the rows just committed, read back from their blobs (vectorised)
            [items[i].user_id for i in fresh],
            terms_from_blobs([blob_of[i] for i in fresh]),
            np.fromiter((not results[i].duplicate for i in fresh), bool, len(fresh)),
        )
        return results

    def _insert_pages(
        self,
        items: list[PageInput],
        known: dict[str, int],
        vec_of: dict[int, np.ndarray],
        blob_of: dict[int, bytes],
        new_users: list[UserState],
    ) -> list[AddResult]:
        s = self._s
        seen_sources: dict[str, int] = {}
        results: list[AddResult] = []
        now = time.time()
        with s.store.transaction() as db:
            for i, p in enumerate(items):
                if p.source and (p.source in known or p.source in seen_sources):
                    pid = known.get(p.source, seen_sources.get(p.source))
                    results.append(AddResult(int(pid), p.user_id, duplicate=True))
                    s.counters["duplicates_skipped"] += 1
                    continue
                user = s.users.get(p.user_id)
                if user is None:
                    aid = p.assistant_id or DEFAULT_ASSISTANT
                    s.store.ensure_user(p.user_id, aid, now)
                    user = s.new_user_state(p.user_id, aid)
                    new_users.append(user)
                cur = db.execute(
                    "INSERT INTO pages(user_id, seq, user_input, agent_response, timestamp, tier, "
                    "embedding, terms, source, extra, created) "
                    "VALUES (?, ?, ?, ?, ?, 'stm', ?, ?, ?, ?, ?) RETURNING page_id",
                    (
                        p.user_id,
                        user.next_seq,
                        p.user_input,
                        p.agent_response,
                        p.timestamp,
                        emb_blob(vec_of[i]),
                        blob_of[i],
                        p.source,
                        json.dumps(p.meta, ensure_ascii=False),
                        now,
                    ),
                )
                page_id = cur.fetchone()[0]
                user.next_seq += 1
                user.clock = max(user.clock, float(p.timestamp))
                user.stm.append(page_id)
                self._overflow(db, user, now)
                db.execute(
                    "UPDATE users SET clock = ?, next_seq = ? WHERE user_id = ?",
                    (user.clock, user.next_seq, p.user_id),
                )
                s.store.audit(db, p.user_id, "add", "page", page_id)
                if p.source:
                    seen_sources[p.source] = page_id
                results.append(AddResult(page_id, p.user_id))
                s.counters["pages_added"] += 1
        return results

    def _overflow(self, db: Any, user: UserState, now: float) -> None:
        """Pages pushed out of a full STM become pending derived work (same transaction)."""
        while len(user.stm) > self._s.memory.stm_capacity:
            old = user.stm.popleft()
            db.execute("UPDATE pages SET tier = 'pending' WHERE page_id = ?", (old,))
            db.execute(
                "INSERT INTO pending(user_id, kind, ref, created) VALUES (?, 'page', ?, ?)",
                (user.user_id, old, now),
            )

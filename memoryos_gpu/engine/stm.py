"""Short-term memory: accepting pages, and the STM FIFO whose overflow becomes pending work.

A page is committed to the store's STM, with its embedding and its BM25 term row, in the
transaction of its batch before ``add_many`` returns (that is the acknowledgement). Each
user's STM holds the newest ``stm_capacity`` pages; a page pushed out of a full STM is marked
``pending`` in the same transaction, so the store records the derived work still owed (chain,
segment, promotion), and :mod:`~memoryos_gpu.engine.derived` runs it later, in order per user.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from memoryos_gpu.embed.base import encode_checked
from memoryos_gpu.json_codec import dumps_text
from memoryos_gpu.lexical import terms_from_blobs, terms_to_blobs
from memoryos_gpu.store.rows import emb_blobs
from memoryos_gpu.types import AddResult, PageInput

from .page_text import page_terms_of, page_text
from .state import DEFAULT_ASSISTANT, EngineHooks, EngineState, UserState
from .validation import PageRefusedError


@dataclass(frozen=True)
class Prepared:
    """What accepting pages computes before it needs the engine's state: by position in the
    batch, each new page's embedding (as the store keeps it: a float32 blob) and BM25 term-row
    blob."""

    emb_of: dict[int, bytes]
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
            encode_checked(s.embedder, [page_text(items[i], s.memory.embed_dates) for i in only])
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
            dict(zip(only, emb_blobs(emb), strict=True)),
            dict(zip(only, terms_to_blobs(terms), strict=True)),
        )

    def accept(self, items: list[PageInput], prepared: Prepared | None = None) -> list[AddResult]:
        """Write pages (and the pending work their STM overflow creates) in one transaction,
        committed once the engine lock is released (``EngineState.write_transaction``); the
        caller acknowledges them after that (and the store's ``sync``).

        ``prepared``: :meth:`prepare`'s output made before the engine lock was taken; the
        sources are checked again here (a page stored or deleted meanwhile), and a page that
        became new since is prepared now. The in-memory user state changes as the
        transaction goes; if a statement fails, that state is restored and new users' arena
        slots are released, so memory and store agree (a failed commit reloads the state).
        Retrievals may show the pages, and the keyword statistics learn them, from the end of
        the transaction's statements: learning them there, under the engine lock and before
        the store lock is released, keeps a save of the statistics (engine lock, then a store
        read of the newest page id) from ever seeing the pages committed but not learned. If
        a statement after the learning or the COMMIT fails, they are taken back out
        (:meth:`_unlearn`): a reload does not refit the statistics, and a copy of them saved
        later, with the newest committed page id as watermark, would count the batch twice
        once it is accepted again. A failed ``sync`` after the COMMIT leaves them: the pages
        are committed.
        """
        learned: list[str] = []  # the texts the statistics learned, filled by _show
        return self._s.in_write_transaction(
            lambda db: self._write(db, items, prepared, learned),
            "deferred",
            reload_on_error=False,
            undo=lambda: self._unlearn(learned),
        )

    def _write(
        self, db: Any, items: list[PageInput], prepared: Prepared | None, learned: list[str]
    ) -> list[AddResult]:
        """The body of :meth:`accept`'s transaction: check the sources again, prepare the pages
        that became new, write them and show them. From the first change to memory on,
        ``reload_owed`` is set: whatever cuts the rest short (a failed statement, a Ctrl-C),
        the rollback reloads the memory, unless :meth:`_insert_restoring` put it back."""
        s = self._s
        known = s.store.known_sources(p.source for p in items if p.source)
        fresh = [i for i, p in enumerate(items) if not (p.source and p.source in known)]
        prep = prepared or Prepared({}, {})
        late = [i for i in fresh if i not in prep.emb_of]
        if late:
            more = self.prepare(items, late)
            prep = Prepared({**prep.emb_of, **more.emb_of}, {**prep.blob_of, **more.blob_of})
        s.reload_owed = True  # cleared by write_transaction once the body is done
        results = self._insert_restoring(db, items, known, prep)
        self._show(items, fresh, results, prep.blob_of, learned)
        return results

    def _insert_restoring(
        self, db: Any, items: list[PageInput], known: dict[str, tuple[int, str]], prep: Prepared
    ) -> list[AddResult]:
        """:meth:`_insert_pages`, with the batch's users' in-memory records (clock, next seq,
        STM) and the counters put back if it raises, and the users it created dropped (their
        slots freed). Once that is done after an error, ``reload_owed`` (set by
        :meth:`_write`) is cleared: no reload. After an interrupt (KeyboardInterrupt,
        SystemExit) it stays set, and the rollback reloads the memory from the store: the
        interrupt may have landed between a change and its entry in the undo log (keeping an
        exact log would cost every page of every batch), and a restore cut short by a second
        interrupt ends in the reload as well.

        The STM is put back by undoing its changes, newest first (``stm_log``), not from a copy
        of every touched user's STM made beforehand: the copies cost 0.3-1 us a page of every
        accepted batch (a microbenchmark's 512 pages of ~500 users; sampled in an ingestion)
        for a rollback that almost never comes."""
        s = self._s
        users = s.users  # the batch's users only: a pass over every user cost O(users) a batch
        batch = {p.user_id for p in items}
        snapshot = {uid: (users[uid].clock, users[uid].next_seq) for uid in batch if uid in users}
        counters = dict(s.counters)
        stm_log: list[tuple[str, int | None]] = []
        try:
            return self._insert_pages(db, items, known, prep.emb_of, prep.blob_of, stm_log)
        except BaseException as exc:
            self._restore(stm_log, snapshot, batch, counters)
            # memory is as it was, after a statement's error; an interrupt (Ctrl-C) may have
            # landed between a change and its entry in stm_log: the reload stays owed then
            s.reload_owed = not isinstance(exc, Exception)
            raise

    def _restore(
        self,
        stm_log: list[tuple[str, int | None]],
        snapshot: dict[str, tuple[float, int]],
        batch: set[str],
        counters: dict[str, int],
    ) -> None:
        """Put the in-memory state back as it was before a failed :meth:`_insert_pages`.

        The users it created are the batch's users absent from ``snapshot`` that are now held:
        found that way, not from a list the creation appends to, since an interrupt between
        creating a user and listing it left the user in memory and not in the store (every
        later add for it failed: ``FOREIGN KEY constraint failed``)."""
        s = self._s
        users = s.users
        for uid, popped in reversed(stm_log):
            stm = users[uid].stm
            if popped is None:
                stm.pop()  # undo an append
            else:
                users[uid].pending.pop()
                stm.appendleft(popped)
        for uid, (clock, next_seq) in snapshot.items():
            u = users[uid]
            u.clock, u.next_seq = clock, next_seq
        for uid in batch.difference(snapshot):
            if uid in users:
                s.drop_user_state(users[uid])
        s.counters = counters

    def _show(
        self,
        items: list[PageInput],
        fresh: list[int],
        results: list[AddResult],
        blob_of: dict[int, bytes],
        learned: list[str],
    ) -> None:
        """The written pages into the views (retrievals show them), the keyword statistics
        and the users' vocabularies (from the term rows' blobs, vectorised). The texts the
        statistics learned go to ``learned``, once learned: ``remove`` of texts never added
        would un-count other pages."""
        s = self._s
        s.views.put_pages(
            [(r.page_id, p) for p, r in zip(items, results, strict=True) if not r.duplicate],
            s.users,
        )
        texts = [f"{items[i].user_input} {items[i].agent_response}" for i in fresh]
        self._hooks._learn_keywords(texts)
        learned.extend(texts)
        s.vocabulary.add(
            [items[i].user_id for i in fresh],
            terms_from_blobs([blob_of[i] for i in fresh]),
            np.fromiter((not results[i].duplicate for i in fresh), bool, len(fresh)),
        )

    def _unlearn(self, texts: list[str]) -> None:
        """Take the texts of a batch whose transaction rolled back out of the keyword
        statistics (under the engine lock, as they were learned): they count committed pages
        only, once each, so the copy ``close`` saves, and what a reopen refits from it, match
        an ingestion that never failed."""
        if texts:
            self._hooks._unlearn_keywords(texts)

    def _insert_pages(
        self,
        db: Any,
        items: list[PageInput],
        known: dict[str, tuple[int, str]],
        emb_of: dict[int, bytes],
        blob_of: dict[int, bytes],
        stm_log: list[tuple[str, int | None]],
    ) -> list[AddResult]:
        """In the transaction ``db``, one statement per kind of row for the whole batch: new
        users, the pages (with ids from ``store.new_ids``), the pages the STM overflow makes
        pending, the users' clocks and the audit events. The STM changes go to ``stm_log``
        (:meth:`_push_stm`)."""
        s = self._s
        now = time.time()
        fresh, dup_of = self._plan(items, known)
        new_users: list[UserState] = []
        for i in fresh:  # in-memory state first: restored by the caller if a statement fails
            p = items[i]
            user = s.users.get(p.user_id)
            if user is None:
                assistant = p.assistant_id or p.default_assistant or DEFAULT_ASSISTANT
                new_users.append(s.new_user_state(p.user_id, assistant))
            elif p.assistant_id is not None and p.assistant_id != user.assistant_id:
                raise _other_assistant(p, user.assistant_id)
        rows, clocks = [], []
        for i in fresh:
            p, user = items[i], s.users[items[i].user_id]
            rows.append(
                (
                    p.user_id,
                    user.next_seq,
                    p.user_input,
                    p.agent_response,
                    p.timestamp,
                    p.source,
                    dumps_text(p.meta) if p.meta else "{}",
                    now,
                )
            )
            user.next_seq += 1
            user.clock = max(user.clock, float(p.timestamp))
            clocks.append(user.clock)  # the time of a page this one pushes out of STM
        s.store.ensure_users(db, [(u.user_id, u.assistant_id) for u in new_users], now)
        ids = s.store.new_ids(db, "pages", len(rows))
        pending = self._push_stm([items[i].user_id for i in fresh], ids, clocks, stm_log)
        self._insert_rows(db, ids, rows, {p for _, p, _ in pending})
        db.executemany(  # written once, beside the narrow page row that tiers rewrite
            "INSERT INTO page_vectors(page_id, embedding, terms) VALUES (?, ?, ?)",
            [(p, emb_of[i], blob_of[i]) for p, i in zip(ids, fresh, strict=True)],
        )
        batch = set(ids)
        db.executemany(  # pages of earlier batches pushed out now
            "UPDATE pages SET tier = 'pending' WHERE page_id = ?",
            [(p,) for _, p, _ in pending if p not in batch],
        )
        db.executemany(
            "INSERT INTO pending(user_id, kind, ref, created, clock) VALUES (?, 'page', ?, ?, ?)",
            [(u, p, now, clock) for u, p, clock in pending],
        )
        s.queue_changes += bool(pending)  # never put back: a rollback only costs a drain a read
        touched = [s.users[u] for u in dict.fromkeys(items[i].user_id for i in fresh)]
        db.executemany(
            "UPDATE users SET clock = ?, next_seq = ? WHERE user_id = ?",
            [(u.clock, u.next_seq, u.user_id) for u in touched],
        )
        s.store.audit_many(db, [(r[0], "add", "page", p) for r, p in zip(rows, ids, strict=True)])
        s.counters["pages_added"] += len(ids)
        s.counters["duplicates_skipped"] += len(dup_of)
        id_of = dict(zip(fresh, ids, strict=True))
        for i, ref in dup_of.items():
            id_of[i] = ref if ref >= 0 else id_of[-1 - ref]
        return [AddResult(id_of[i], p.user_id, duplicate=i in dup_of) for i, p in enumerate(items)]

    def _plan(
        self, items: list[PageInput], known: dict[str, tuple[int, str]]
    ) -> tuple[list[int], dict]:
        """Positions of the pages to insert, and of the duplicates (a ``source`` stored before
        or earlier in the batch) with the page id they repeat; ``-1 - j`` names the batch's
        page ``j`` (its id is known once inserted: :meth:`_insert_pages` resolves it).

        A source is unique across the store, so one that another user's page holds (stored,
        or earlier in the batch) refuses the batch before anything is written: as a
        duplicate, the page would be dropped and the caller handed the other user's id."""
        fresh: list[int] = []
        dup_of: dict[int, int] = {}
        first: dict[str, int] = {}
        for i, p in enumerate(items):
            if p.source and p.source in known:
                page_id, owner = known[p.source]
                if owner != p.user_id:
                    raise _foreign_source(p)
                dup_of[i] = page_id
            elif p.source and p.source in first:
                if items[first[p.source]].user_id != p.user_id:
                    raise _foreign_source(p)
                dup_of[i] = -1 - first[p.source]  # resolved once the first one has its id
            else:
                fresh.append(i)
                if p.source:
                    first[p.source] = i
        return fresh, dup_of

    @staticmethod
    def _insert_rows(db: Any, ids: list[int], rows: list[tuple], pending: set[int]) -> None:
        """INSERT the page rows (one statement), each in the tier it ends the batch in: a page
        that the batch's own later pages push out of STM goes in as ``pending`` at once (in
        bulk ingestion most pages do), instead of being inserted and rewritten."""
        db.executemany(
            "INSERT INTO pages(page_id, user_id, seq, tier, user_input, agent_response, "
            "timestamp, source, extra, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (pid, *row[:2], "pending" if pid in pending else "stm", *row[2:])
                for pid, row in zip(ids, rows, strict=True)
            ],
        )

    def _push_stm(
        self,
        user_ids: list[str],
        page_ids: list[int],
        clocks: list[float],
        log: list[tuple[str, int | None]],
    ) -> list[tuple[str, int, float]]:
        """Append the pages to their users' STM, in order; returns the (user, page, clock)
        pushed out of a full STM, oldest first: they become pending derived work, stamped with
        ``clocks`` of the page that pushed them (its user's logical clock once it came: when
        the page left STM, whatever later pages the batch holds), and join their users'
        ``pending`` pages. Each change goes to ``log`` as it is made: (user, None) an append,
        (user, page) a page pushed out."""
        cap = self._s.memory.stm_capacity
        out: list[tuple[str, int, float]] = []
        for uid, pid, clock in zip(user_ids, page_ids, clocks, strict=True):
            user = self._s.users[uid]
            stm = user.stm
            stm.append(pid)
            log.append((uid, None))
            while len(stm) > cap:
                popped = stm.popleft()
                user.pending.append(popped)  # retrieved with the STM until it is in MTM
                log.append((uid, popped))
                out.append((uid, popped, clock))
        return out


def _foreign_source(p: PageInput) -> PageRefusedError:
    """The refusal of a page whose ``source`` another user's page holds (that page is not
    named: its id would tell one user about another's memory)."""
    return PageRefusedError(
        f"source {p.source!r} of a page of user {p.user_id!r} belongs to another user's page; "
        "a source is unique across users"
    )


def _other_assistant(p: PageInput, assistant_id: str) -> PageRefusedError:
    """The refusal of a page for a user of another assistant: a user's pages teach the one
    assistant it was created with (its knowledge ring), so the page is not moved silently."""
    return PageRefusedError(
        f"user {p.user_id!r} belongs to assistant {assistant_id!r}, not {p.assistant_id!r}: a "
        "user's memory is kept for one assistant; use another user id for another assistant"
    )

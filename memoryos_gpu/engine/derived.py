"""Derived work: the rounds that drain the store's pending table.

Pages pushed out of STM are owed a chain link, a segment and maybe a promotion. The store
records that debt (``pending`` rows) in the transaction that accepted the page, so the work
survives a crash and ``process_pending`` can resume it at any time. Work goes in *rounds* of
*waves*: a wave takes the oldest pending page of every user that has one, so one user's pages
are applied in order while every stage batches across users; a drain's round holds as many
waves as fit (a user's backlog in one commit), the server's gathering scheduler the waves at least
half as full as the first (:func:`full_waves`).

A round holds the engine lock only to read its inputs and to apply its results: the stages
(LLM calls, embeddings) run without it, so retrievals and writes go on while an LLM thinks.
Applying checks that what the round read still holds (the pending row, the user, the chain
tail, the page texts) and leaves an item whose inputs changed pending for a later round; an
item stays pending until it is applied, so an exception in a stage loses nothing. One
*lease* per engine keeps a single round (or promotion batch) in flight, so two callers of
``process_pending`` never take, or apply, the same items.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from memoryos_gpu.store.rounds import PendingQueue

from .state import EngineHooks, EngineState, WorkItem
from .validation import InvalidInputError

EXTRACTOR_SAVE_EVERY = 5000  # pages between saves of the keyword statistics

#: A gathering round's later wave (each user's next pending page) is taken only while it holds
#: at least this share of the first wave's pages: see :func:`full_waves`.
FULL_WAVE_SHARE = 0.5


class DerivedWork:
    """The round scheduler; each round's stages run through the engine's hooks."""

    def __init__(self, state: EngineState, hooks: EngineHooks) -> None:
        self._s = state
        self._hooks = hooks
        self._extractor_saved = 0  # pages_added at the last save of the keyword statistics
        # the lease: its holder (a thread id) guarded by the engine lock; waiting on the
        # condition releases that lock (even when the caller holds it), so a waiter never
        # blocks the round it waits for
        self._idle = threading.Condition(state.lock)
        # (holder thread id, depth): one attribute, so that taking or giving the lease back is
        # one assignment a Ctrl-C lands wholly before or after; the holder may take the lease
        # again (a hook that calls promote)
        self._lease: tuple[int | None, int] = (None, 0)

    @contextmanager
    def lease(self) -> Iterator[None]:
        """Hold the engine's one derived-work lease (waiting while another caller holds it).

        Rounds read under the engine lock, run their stages without it and apply under it
        again; the lease is what stops a second caller from taking the same pending items in
        between. Held by each round, each promotion batch and ``close``; re-entrant for the
        thread that holds it.
        """
        me = threading.get_ident()
        taken = (me, -1)  # the lease as this call leaves it taken (-1: not taken yet)
        # ``with`` the engine lock itself, not the condition over it: the condition's
        # ``__exit__`` is Python, where a Ctrl-C can land before it releases the lock
        try:
            with self._s.lock:
                while self._lease[0] not in (None, me):
                    self._idle.wait()
                taken = (me, self._lease[1] + 1)
                self._lease = taken
            yield
        finally:
            # given back as this call found it, judged from the lease itself: with the taking
            # outside the ``try``, a Ctrl-C landing between the two left the lease held for
            # good, every other caller's round waiting on it
            with self._s.lock:
                if self._lease == taken:
                    depth = taken[1] - 1
                    self._lease = (me if depth else None, depth)
                    if not depth:
                        self._idle.notify_all()

    def process_pending(
        self,
        max_batch: int | None = None,
        max_rounds: int | None = None,
        until: Callable[[], bool] | None = None,
    ) -> dict[str, int]:
        """Run every pending derived item (chain, MTM, promotion) to completion, or at most
        ``max_rounds`` page rounds (and the promotions they queue), or until ``until()`` is
        true before a round (a stop asked meanwhile: ``ingest --ray``'s shard actors; what is
        left stays pending).

        Work goes in rounds of at most ``max_batch`` (default ``config.derived_max_batch``)
        pages, in waves: the oldest pending page of each user that has one, then each
        user's second oldest, and so on (so a user's pages keep their order). A wave runs as
        one batch through every stage (the LLM stages split it into ``llm.batch_size``
        calls), the next wave after it (a page's chain context is its predecessor's
        outcome), and the round's waves are applied in one transaction. ``max_batch=1`` is
        the reference's one-page-at-a-time processing.

        Safe to call at any time, from any thread and after a crash: each item is applied and
        removed from the pending table in one transaction, so nothing is done twice. Returns
        the items taken off the queue (applied, or dropped because their page or user was
        deleted meanwhile). A round in which every item's inputs changed while its stages ran
        ends the call (they stay pending for the next one), so a caller never spins against
        concurrent edits. Call it without holding the engine lock, or the stages run under it.

        ``max_rounds`` is for a scheduler that gathers work between rounds (the server's
        derived-work thread): pages that arrive while a round runs wait for the next call,
        instead of forming a train of small rounds, each paying a round's fixed cost (its
        statements, its commit) under the engine lock. Its rounds hold the waves that are at
        least half as full as the first (:func:`full_waves`): a user's second pending page
        waits for company while only a few users have one, and a backlog of several pages
        per user (writes arriving faster than one wave a round) goes in rounds of full waves.
        Without ``max_rounds`` (a drain: ``flush``, bulk ingestion) a round holds as many
        waves as fit in ``max_batch``, so a backlog of many pages per user costs one read,
        one commit and one promotion pass a round instead of one a page of each user; and a
        drain takes only the pages pending when it began: under writers that never pause
        (32 threads adding), a ``flush`` called for read-your-writes drained their new pages
        too and ran as long as they wrote (150 s), every other caller's derived work waiting
        behind it.
        """
        s = self._s
        limit = s.config.derived_max_batch if max_batch is None else max_batch
        if limit < 1:
            raise InvalidInputError("max_batch must be >= 1")
        if max_rounds is not None and max_rounds < 1:
            raise InvalidInputError("max_rounds must be >= 1")
        done = {"pages": 0, "promotions": 0}
        rounds = 0
        queue: _QueueRead | None = None
        # a drain takes the pages pending when it begins, not those written meanwhile
        only: frozenset[int] | None = None
        # one lease per round
        while (max_rounds is None or rounds < max_rounds) and not (until and until()):
            with self.lease():
                with s.locked():  # reads the store: past the rewrite gate first (state.py)
                    if queue is None or not queue.holds(s):
                        queue = _QueueRead(s, only, drain=max_rounds is None)
                        only = queue.ids
                    round_items = queue.items.next_round(limit, limit)
                if max_rounds is not None:
                    round_items = full_waves(round_items, FULL_WAVE_SHARE)
                if not round_items:
                    break
                taken = self._hooks._process_pages(round_items)
                queue = queue.after(round_items, taken)
                rounds += 1
                done["pages"] += taken
                done["promotions"] += self._hooks._process_promotions()
            if not taken:
                break
        with self.lease():
            done["promotions"] += self._hooks._process_promotions()
            with s.locked():
                if s.counters["pages_added"] - self._extractor_saved >= EXTRACTOR_SAVE_EVERY:
                    self.save_extractor()
        return done

    def save_extractor(self) -> None:
        """Persist the keyword statistics (IDF); reopening refits them from the pages if the
        saved copy is missing, so saving is an optimisation, not a durability requirement."""
        s = self._s
        top = s.store.query("SELECT COALESCE(MAX(page_id), 0) FROM pages")[0][0]
        s.store.set_meta(
            "keyword_extractor", json.dumps({**s.extractor.to_dict(), "page_watermark": top})
        )
        self._extractor_saved = s.counters["pages_added"]


class _QueueRead:
    """The queue of pending pages as a drain read it (one query: :class:`PendingQueue`), with
    the engine's counts of the queue's changes at the time. Why: reading the whole queue for
    each round of at most ``max_batch`` made a drain quadratic in its backlog (93,000 pages
    deferred: 150-200 ms of reading a round, whose own work took ~35 ms).

    It holds while the counts move only by the drain's own rounds, each applied whole; a page
    queued, an edit or deletion (``edits``), another caller's round, a reload, or an item of
    the round left pending (its inputs changed) means reading the queue again: what a round
    read from the store before. :meth:`holds` is asked under the engine lock. ``ids``: the
    work ids a drain's first read took, which a read again keeps to (``only``); None for a
    scheduler's read."""

    def __init__(
        self, s: EngineState, only: frozenset[int] | None = None, *, drain: bool = False
    ) -> None:
        rows = s.store.pending_items("page")
        if only is not None:  # a drain's read again: the items of its first read still here
            rows = [r for r in rows if r[0] in only]
        # a scheduler's read (not a drain) keeps to no ids: no set of the whole queue built
        self.ids = only if only is not None or not drain else frozenset(r[0] for r in rows)
        self.items = PendingQueue(rows)
        self._mark = (s.edits, s.queue_changes)

    def holds(self, s: EngineState) -> bool:
        return (s.edits, s.queue_changes) == self._mark

    def after(self, round_items: list[WorkItem], taken: int) -> _QueueRead | None:
        """Itself with the round taken out, when the round was applied whole (None: read the
        queue again). The round's apply is one count of ``queue_changes``; any other change
        since the read is found by :meth:`holds` (a round whose items were all gone, which
        applies nothing, followed a deletion: ``edits``)."""
        if taken != len(round_items):
            return None
        self.items.done(round_items)
        self._mark = (self._mark[0], self._mark[1] + 1)
        return self


def full_waves(items: list[WorkItem], share: float) -> list[WorkItem]:
    """The leading waves of a round's items (listed wave by wave, as ``PendingQueue.next_round``
    gives them) that each hold at least ``share`` of the first wave's items.

    Why: a wave's stages and apply have a fixed cost, so a wave of the few users with a second
    page pending costs nearly a full one and is better left to gather company; but when most
    users have several pages pending (100 users writing ~800 pages/s: ~3.5 each), one wave a
    round caps rounds at one page per user, the backlog never shrinks, and every page pays a
    round's fixed costs and a promotion of its own (a hot segment is promoted once a round)."""
    depth: dict[str, int] = {}
    sizes: list[int] = []
    for _, uid, _ in items:
        k = depth[uid] = depth.get(uid, -1) + 1
        if k == len(sizes):
            sizes.append(0)
        sizes[k] += 1
    keep = next((k for k, n in enumerate(sizes) if n < share * sizes[0]), len(sizes))
    return items[: sum(sizes[:keep])]

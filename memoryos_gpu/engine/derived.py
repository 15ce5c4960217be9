"""Derived work: the rounds that drain the store's pending table.

Pages pushed out of STM are owed a chain link, a segment and maybe a promotion. The store
records that debt (``pending`` rows) in the transaction that accepted the page, so the work
survives a crash and ``process_pending`` can resume it at any time. Work goes in *rounds*: each
round takes the oldest pending page of every user that has one, so one user's pages are applied
in order while every stage batches across users. The lock is released between rounds so
retrievals interleave with a long backlog.
"""

from __future__ import annotations

import json

from .state import EngineHooks, EngineState
from .validation import InvalidInputError

EXTRACTOR_SAVE_EVERY = 5000  # pages between saves of the keyword statistics


class DerivedWork:
    """The round scheduler; each round's stages run through the engine's hooks."""

    def __init__(self, state: EngineState, hooks: EngineHooks) -> None:
        self._s = state
        self._hooks = hooks
        self._extractor_saved = 0  # pages_added at the last save of the keyword statistics

    def process_pending(self, max_batch: int | None = None) -> dict[str, int]:
        """Run every pending derived item (chain, MTM, promotion) to completion.

        Work goes in rounds: each round takes the oldest pending page of each user that has
        one (so a user's pages keep their order), at most ``max_batch`` (default
        ``config.derived_max_batch``) pages, and runs them as one batch through every stage
        (the LLM stages split it into ``llm.batch_size`` calls). ``max_batch=1`` is the
        reference's one-page-at-a-time processing.

        Safe to call at any time and after a crash: each item is applied and removed from the
        pending table in one transaction, so nothing is done twice.
        """
        s = self._s
        limit = s.config.derived_max_batch if max_batch is None else max_batch
        if limit < 1:
            raise InvalidInputError("max_batch must be >= 1")
        done = {"pages": 0, "promotions": 0}
        while True:  # the lock is released between rounds so retrievals interleave
            with s.lock:
                round_items = s.store.pending_round("page", limit)
                if not round_items:
                    break
                self._hooks._process_pages(round_items)
                done["pages"] += len(round_items)
                done["promotions"] += self._hooks._process_promotions()
        with s.lock:
            done["promotions"] += self._hooks._process_promotions()
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

"""Each user's own vocabulary: in how many of the user's pages each hashed term occurs.

Why: the paper's segment match ``cos + Jaccard(K_s, K_p) >= 0.6`` needs pages on one topic to
share keywords. An LLM names the topic ("running", "knee injury"); the extractive mode used to
take each page's most distinctive words instead (names, numbers, words said once), so pages on
one topic shared none and every page opened its own segment. A word can only tie a page to
its topic if the user says it in other pages too, so extractive keywords are chosen against
this table (:func:`memoryos_gpu.text.topics.topic_weights`).

Layout: one native hash table (``_C.KeyCounts``) of ``int64`` keys, one per (user, term) --
the user's index here in the high 32 bits, the term id of
:func:`~memoryos_gpu.text.keywords.hash_keyword` in the low ones -- to page counts. A batch's
additions and lookups are one native call each, one probe a key (a NumPy log-structured
merge of sorted runs cost ~5 us a page of bulk ingestion, most of it re-sorting merged runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from memoryos_gpu import _C

if TYPE_CHECKING:
    from memoryos_gpu.lexical import PageTerms


class UserVocabulary:
    """Document frequencies of term ids per user (a page counts once per distinct term)."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}  # user id -> the user's key prefix
        self._pages = np.zeros(0, np.int64)  # pages counted per user index
        self._counts = _C.KeyCounts()  # (user index << 32 | term id) -> pages

    def clear(self) -> UserVocabulary:
        """Forget every count (a reload counts the stored pages again); returns them, for
        :meth:`restore` should the reload fail."""
        saved = UserVocabulary()
        saved.__dict__, self.__dict__ = self.__dict__, saved.__dict__
        return saved

    def restore(self, saved: UserVocabulary) -> None:
        """Take back the counts :meth:`clear` returned."""
        self.__dict__ = saved.__dict__

    # ---------------------------------------------------------------- updates
    def add(
        self,
        users: Sequence[str],
        terms: PageTerms,
        keep: np.ndarray | None = None,
        sign: int = 1,
    ) -> None:
        """Count pages: row i of ``terms`` belongs to ``users[i]`` and counts where ``keep[i]``
        (default: every row); ``sign=-1`` uncounts them (a deleted page, an edit's old row)."""
        n = terms.length.size
        if len(users) != n:
            raise ValueError("one user per term row")
        keep = np.ones(n, bool) if keep is None else np.asarray(keep, bool)
        if not keep.any():
            return
        idx = self._indices([u for u, k in zip(users, keep.tolist(), strict=True) if k])
        np.add.at(self._pages, idx, sign)
        counts = np.diff(terms.offsets)
        mine = np.repeat(keep, counts)
        keys = (np.repeat(idx, counts[keep]) << 32) | terms.ids[mine].astype(np.int64)
        self._counts.add(keys, sign)  # a row's ids are distinct: one count a page

    def forget(self, user: str) -> None:
        """Drop everything counted for ``user`` (the user was deleted)."""
        i = self._index.get(user)
        if i is None:
            return
        self._pages[i] = 0
        self._counts.erase_range(i << 32, (i + 1) << 32)

    # ---------------------------------------------------------------- lookups
    def pages(self, users: Sequence[str]) -> np.ndarray:
        """Pages counted for each user (0 for a user never seen)."""
        idx = self._known(users)
        if not self._pages.size:
            return np.zeros(len(users), np.int64)
        return np.where(idx >= 0, self._pages[np.maximum(idx, 0)], 0)

    def df(self, users: Sequence[str], ids: np.ndarray, repeats: Sequence[int]) -> np.ndarray:
        """Document frequencies among a user's pages: the first ``repeats[0]`` of ``ids`` are
        looked up for ``users[0]``, the next ``repeats[1]`` for ``users[1]``, and so on."""
        ids = np.asarray(ids, np.int64)
        idx = np.repeat(self._known(users), np.asarray(repeats, np.int64))
        if idx.shape != ids.shape:
            raise ValueError("repeats must add up to the number of ids")
        keys = (np.maximum(idx, 0) << 32) | ids
        return np.where((idx >= 0) & (ids >= 0), self._counts.lookup(keys), 0).astype(np.int64)

    def _known(self, users: Sequence[str]) -> np.ndarray:
        """Each user's index, -1 for a user never counted."""
        return np.fromiter((self._index.get(u, -1) for u in users), np.int64, len(users))

    # ---------------------------------------------------------------- internals
    def _indices(self, users: Sequence[str]) -> np.ndarray:
        index = self._index
        for u in dict.fromkeys(users):  # distinct users of the batch, not its pages
            if u not in index:
                index[u] = len(index)
        if len(index) > self._pages.size:
            grown = np.zeros(max(len(index), 2 * self._pages.size), np.int64)
            grown[: self._pages.size] = self._pages
            self._pages = grown
        return np.fromiter((index[u] for u in users), np.int64, len(users))

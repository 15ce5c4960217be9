"""Each user's own vocabulary: in how many of the user's pages each hashed term occurs.

Why: the paper's segment match ``cos + Jaccard(K_s, K_p) >= 0.6`` needs pages on one topic to
share keywords. An LLM names the topic ("running", "knee injury"); the extractive mode used to
take each page's most distinctive words instead (names, numbers, words said once), so pages on
one topic shared none and every page opened its own segment. A word can only tie a page to
its topic if the user says it in other pages too, so extractive keywords are chosen against
this table (:func:`memoryos_gpu.text.topics.topic_weights`).

Layout: sorted runs of ``int64`` keys, one per (user, term) -- the user's index here in the
high 32 bits, the term id of :func:`~memoryos_gpu.text.keywords.hash_keyword` in the low ones
-- beside their page counts. An addition becomes a new run, and the newest runs are merged
while the one before is at most twice as large (a log-structured merge), so there are
O(log n) runs, every key is re-sorted O(log n) times in its life, and one page costs a few
small NumPy calls instead of a rewrite of the table. A lookup is one ``searchsorted`` per run
for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from memoryos_gpu.lexical import PageTerms

_MERGE_RATIO = 2  # merge the newest run into the one before while that is <= 2x as large


class UserVocabulary:
    """Document frequencies of term ids per user (a page counts once per distinct term)."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}  # user id -> the user's key prefix
        self._pages = np.zeros(0, np.int64)  # pages counted per user index
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted keys, counts), oldest first

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
        keys, counts = np.unique(keys, return_counts=True)
        self._push(keys, sign * counts.astype(np.int32))

    def forget(self, user: str) -> None:
        """Drop everything counted for ``user`` (the user was deleted)."""
        i = self._index.get(user)
        if i is None:
            return
        self._pages[i] = 0
        lo, hi = np.int64(i) << 32, np.int64(i + 1) << 32
        runs = []
        for keys, counts in self._runs:
            keep = (keys < lo) | (keys >= hi)
            runs.append((keys[keep], counts[keep]))
        self._runs = [r for r in runs if r[0].size]

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
        order = np.argsort(keys, kind="stable")  # sorted probes walk each run in order
        probes = keys[order]
        found = np.zeros(keys.size, np.int64)
        for run_keys, run_counts in self._runs:  # O(log n) runs; one list, read once
            found += _lookup(run_keys, run_counts, probes)
        out = np.empty_like(found)
        out[order] = found
        return np.where((idx >= 0) & (ids >= 0), out, 0)

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

    def _push(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """A new run, merged with the newest runs while they are not much larger. The merge
        works on a copy that replaces the list in one assignment, so a lookup running outside
        the engine lock sees the runs before or after an addition, never half of one."""
        runs = [*self._runs, (keys, counts)]
        while len(runs) > 1 and runs[-2][0].size <= _MERGE_RATIO * runs[-1][0].size:
            new_keys, new_counts = runs.pop()
            old_keys, old_counts = runs.pop()
            merged = _combine(old_keys, old_counts, new_keys, new_counts)
            if merged[0].size:
                runs.append(merged)
        self._runs = runs


def _combine(
    keys_a: np.ndarray, counts_a: np.ndarray, keys_b: np.ndarray, counts_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Two sorted tables of unique keys as one, counts of equal keys summed, zeros dropped:
    a linear merge (``searchsorted`` + ``insert``), not a sort."""
    at = np.searchsorted(keys_a, keys_b)
    same = at < keys_a.size
    same[same] = keys_a[at[same]] == keys_b[same]
    counts = counts_a.copy()
    counts[at[same]] += counts_b[same]  # keys_b is unique, so each slot is hit once
    new = ~same
    keys = np.insert(keys_a, at[new], keys_b[new])
    counts = np.insert(counts, at[new], counts_b[new])
    live = counts != 0
    return (keys, counts) if live.all() else (keys[live], counts[live])


def _lookup(keys: np.ndarray, counts: np.ndarray, query: np.ndarray) -> np.ndarray:
    """The count of each query key in a sorted table (0 where absent)."""
    if not keys.size:
        return np.zeros(query.size, np.int32)
    at = np.minimum(np.searchsorted(keys, query), keys.size - 1)
    return np.where(keys[at] == query, counts[at], 0)

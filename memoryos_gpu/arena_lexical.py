"""The arena's lexical index: one row of (term id, tf) per page pool slot, in one shared pool.

Why this layout: BM25 needs, per query, the term frequencies of the query's terms in each of its
user's MTM pages and the user's document frequencies. A page's row is the page's distinct term
ids in ascending order beside their counts, addressed by the page's pool slot, so the fused
retrieval kernel walks a user's pages exactly as it walks their embeddings, finds a query term
in a row by binary search, and derives N, the mean length and every df in the same walk. There
is no per-user structure to keep in step: a page entering MTM writes its row, a page leaving
clears its count, and nothing scans a vocabulary.

Rows are appended to the pool; a cleared or rewritten row leaves dead entries behind, and the
pool is compacted (live rows gathered to the front, in one vectorised pass) when dead entries
outnumber live ones. On a CUDA arena the arrays are device tensors and the row starts and
counts are mirrored on the host, so appends and compaction never read the device.

Long histories: the scan costs every term of every page of the user (~0.1 us a page a query),
so on a CPU arena a user with at least ``postings_min_pages`` indexed pages also gets postings
(``memoryos_gpu._C.Postings``, ``csrc/include/memoryos/postings.h``): for each of its terms,
the pages holding it, kept in step with every row written or cleared here, so that a query
touches only its own terms' pages. The scores are the scan's to the bit. Users below the
threshold (everyone at ~20 pages) cost 8 bytes a page slot of bookkeeping.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_MIN_COMPACT = 1 << 20  # dead entries below this are not worth a compaction
_INITIAL_ENTRIES = 1 << 12


class LexicalRows:
    """Term rows of the page pool. ``backend`` is the arena's allocator (NumPy or torch)."""

    def __init__(self, backend: Any, num_slots: int, postings_min_pages: int = 0) -> None:
        self._b = backend
        b = backend
        self.postings = None  # the CPU pass's postings of users with many pages
        if postings_min_pages > 0 and not b.on_cuda:
            from memoryos_gpu import _C

            self.postings = _C.Postings(postings_min_pages)
            self.postings.grow_slots(num_slots)
        self.start = b.full((num_slots,), 0, np.int64)
        self.count = b.full((num_slots,), 0, np.int32)
        self.length = b.full((num_slots,), 0, np.int32)
        self.terms = b.full((_INITIAL_ENTRIES,), 0, np.int32)
        self.tf = b.full((_INITIAL_ENTRIES,), 0, np.int32)
        self._h_start = self.start if not b.on_cuda else np.zeros(num_slots, np.int64)
        self._h_count = self.count if not b.on_cuda else np.zeros(num_slots, np.int32)
        self.used = 0  # entries appended so far (live and dead)
        self.live = 0  # entries in rows of indexed pages

    # ------------------------------------------------------------------ sizes
    def grow_slots(self, num_slots: int) -> None:
        """Follow the page pool to ``num_slots`` slots (new slots are unindexed)."""
        b = self._b
        self.start = b.grow(self.start, num_slots, 0)
        self.count = b.grow(self.count, num_slots, 0)
        self.length = b.grow(self.length, num_slots, 0)
        if b.on_cuda:
            extra = num_slots - self._h_start.size
            self._h_start = np.concatenate([self._h_start, np.zeros(extra, np.int64)])
            self._h_count = np.concatenate([self._h_count, np.zeros(extra, np.int32)])
        else:
            self._h_start, self._h_count = self.start, self.count
        if self.postings is not None:
            self.postings.grow_slots(num_slots)

    def nbytes(self) -> int:
        """Bytes of the index's arrays (pool capacity included) and of the postings."""
        arrays = (self.start, self.count, self.length, self.terms, self.tf)
        postings = self.postings.nbytes() if self.postings is not None else 0
        return int(sum(_nbytes(a) for a in arrays)) + postings

    def rows_of(self, slots: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """(term ids, tf, length) of pages, on the host (for tests and checks)."""
        terms, tf, length = (self._b.to_host(a) for a in (self.terms, self.tf, self.length))
        out = []
        for s in np.asarray(slots, np.int64).tolist():
            a, n = int(self._h_start[s]), int(self._h_count[s])
            out.append((terms[a : a + n].copy(), tf[a : a + n].copy(), int(length[s])))
        return out

    # ------------------------------------------------------------------ writes
    def write(
        self,
        slots: np.ndarray,
        offsets: np.ndarray,
        ids: np.ndarray,
        tf: np.ndarray,
        length: np.ndarray,
        users: np.ndarray | None = None,
    ) -> list[int]:
        """Give pages their rows: page ``slots[i]`` gets ``ids[offsets[i]:offsets[i+1]]``
        (ascending) with their ``tf`` and its token ``length``. Rewriting a row is allowed.
        ``users[i]``: the user of page ``slots[i]``, for the postings. Returns the users that
        reached the postings' threshold without postings: the caller builds them
        (:meth:`build_postings`, with every slot of the user)."""
        slots = np.asarray(slots, np.int64)
        offsets = np.asarray(offsets, np.int64)
        if slots.size == 0:
            return []
        if offsets.shape != (slots.size + 1,) or offsets[0] != 0 or offsets[-1] != len(ids):
            raise ValueError("offsets must be [n + 1], from 0 to len(ids)")
        self.clear(slots)
        n = int(offsets[-1])
        self._reserve(n)
        at = self.used
        self._b.write_range(self.terms, at, np.asarray(ids, np.int32))
        self._b.write_range(self.tf, at, np.asarray(tf, np.int32))
        starts = at + offsets[:-1]
        counts = np.diff(offsets).astype(np.int32)
        self._h_start[slots] = starts
        self._h_count[slots] = counts
        if self._b.on_cuda:
            self._b.scatter(self.start, slots, starts)
            self._b.scatter(self.count, slots, counts)
        self._b.scatter(self.length, slots, np.asarray(length, np.int32))
        self.used += n
        self.live += n
        if self.postings is None or users is None:
            return []
        return self.postings.write(users, slots, offsets, ids, tf)

    def build_postings(self, user: int, slots: np.ndarray) -> None:
        """Postings of ``user`` from the rows of its page ``slots`` (the other slots' rows and
        unindexed ones are skipped)."""
        if self.postings is not None:
            self.postings.build(user, slots, self.start, self.count, self.terms, self.tf)

    def clear(self, slots: np.ndarray) -> None:
        """Unindex pages (their entries become dead until the next compaction)."""
        slots = np.asarray(slots, np.int64)
        if slots.size == 0:
            return
        slots = np.unique(slots)
        if self.postings is not None:
            self.postings.clear(slots, self._h_count[slots])
        self.live -= int(self._h_count[slots].sum())
        self._h_count[slots] = 0
        if self._b.on_cuda:
            self._b.scatter(self.count, slots, np.zeros(slots.size, np.int32))
        if self.used - self.live > max(self.live, _MIN_COMPACT):
            self.compact()

    def compact(self) -> None:
        """Gather the live rows to the front of the pool (one gather, in slot order)."""
        rows = np.flatnonzero(self._h_count > 0)
        counts = self._h_count[rows].astype(np.int64)
        new_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        total = int(counts.sum())
        src = np.repeat(self._h_start[rows] - new_start, counts) + np.arange(total)
        self.terms = self._b.gather_to_new(self.terms, src, max(total, _INITIAL_ENTRIES))
        self.tf = self._b.gather_to_new(self.tf, src, max(total, _INITIAL_ENTRIES))
        self._h_start[rows] = new_start
        if self._b.on_cuda:
            self._b.scatter(self.start, rows, new_start)
        self.used = self.live = total

    def _reserve(self, extra: int) -> None:
        need = self.used + extra
        cap = int(self.terms.shape[0])
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        self.terms = self._b.grow(self.terms, new_cap, 0)
        self.tf = self._b.grow(self.tf, new_cap, 0)


def _nbytes(a: Any) -> int:
    return a.nbytes if isinstance(a, np.ndarray) else a.numel() * a.element_size()

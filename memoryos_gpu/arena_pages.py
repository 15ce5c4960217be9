"""The arena's page pool: pages placed in fixed-size blocks through each segment's block table
(appended in batch order, or at their stored positions on a reload), their embeddings written,
edited and deleted, their BM25 term rows written (the rows are
:mod:`memoryos_gpu.arena_lexical`'s), and a segment's pages listed.

Also a batch helper of placement, :func:`_sorted_unique`; a page's position among the batch's
pages of its segment is :func:`memoryos_gpu.grouping.rank_within`.
"""

from __future__ import annotations

import numpy as np

from memoryos_gpu.arena_layout import _INT32_MAX
from memoryos_gpu.errors import ArenaError
from memoryos_gpu.grouping import rank_within


class ArenaPages:
    """Page pool of the arena. A mixin of :class:`~memoryos_gpu.arena.Arena`:
    the arrays, the checks and the scatter to the device (``_write``) are the arena's."""

    # ------------------------------------------------------------------ pages
    def append_pages(self, users: np.ndarray, slots: np.ndarray, emb: np.ndarray) -> np.ndarray:
        """Append pages to segments, in order, allocating blocks as needed; returns pool slots.

        Pages of one segment may appear several times in the batch; they are appended in batch
        order. ``L_interaction`` is not touched here: the tiers decide what counts as an
        interaction (the paper: pages in the segment since the last promotion).
        """
        users, slots = np.asarray(users, np.int32), np.asarray(slots, np.int32)
        n = users.size
        emb = self._check_emb(emb, n)
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        self.check_users(users)
        self._check_slots(slots)
        key = users.astype(np.int64) * self.segment_width + slots
        positions = self._h_npages.reshape(-1)[key].astype(np.int64) + rank_within(key)
        out = self._place(users, slots, positions)
        self.write_pages(out, emb)
        return out

    def place_pages(
        self, users: np.ndarray, slots: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """Pool slots for pages at given positions of live segments (allocating blocks where
        a position has none, and raising each segment's page count to cover it).

        Why positions: a reopen streams pages in storage order, not segment order; placing
        each by its stored position gives the same slots whatever order they arrive in, and
        keeps a deleted page's hole where it was.
        """
        users, slots = np.asarray(users, np.int32), np.asarray(slots, np.int32)
        positions = np.asarray(positions, np.int64)
        if users.size == 0:
            return np.zeros(0, dtype=np.int32)
        self.check_users(users)
        self._check_slots(slots)
        return self._place(users, slots, positions)

    def _place(self, users: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """:meth:`place_pages` once the users and slots are checked (int32, int64 positions)."""
        if not self._h_seg_live[users, slots].all():
            raise ArenaError("place_pages: target segment slot is not live")
        if (positions < 0).any():
            raise ArenaError("place_pages: negative page position")
        bs, nslots = self.config.block_size, self.segment_width
        key = users.astype(np.int64) * nslots + slots
        col = positions // bs
        if col.max() >= self._h_table.shape[2]:
            self._grow_table(max(2 * self._h_table.shape[2], int(col.max()) + 1))
        width = self._h_table.shape[2]
        table_flat = self._h_table.reshape(-1, width)
        # a segment's blocks are its first ceil(npages / P) columns: allocate the columns from
        # there up to the highest one asked for, so the columns below npages are never holes
        seg = _sorted_unique(key)
        top = np.zeros(seg.size, np.int64)
        np.maximum.at(top, np.searchsorted(seg, key), col + 1)
        have = self._allocated_columns(self._h_npages.reshape(-1)[seg])
        grow = np.maximum(top - have, 0)
        if grow.any():
            seg_rows = np.repeat(seg, grow)
            new_cols = np.repeat(have, grow) + (
                np.arange(int(grow.sum())) - np.repeat(np.cumsum(grow) - grow, grow)
            )
            blocks = self._alloc_blocks(int(grow.sum()))
            table_flat[seg_rows, new_cols] = blocks
            self._block_user[blocks] = seg_rows // nslots
        out = table_flat[key, col].astype(np.int64) * bs + positions % bs
        if out.max() >= _INT32_MAX:
            raise ArenaError("page pool exceeds 2**31 slots")
        npages_flat = self._h_npages.reshape(-1)
        np.maximum.at(npages_flat, key, (positions + 1).astype(np.int32))
        if self.on_cuda:  # push the touched rows of the host mirrors
            tu, ts = (seg // nslots).astype(np.int32), (seg % nslots).astype(np.int32)
            self._write(self.seg_npages, (tu, ts), self._h_npages[tu, ts])
            self._write(self.block_table, (tu, ts), self._h_table[tu, ts])
        return out.astype(np.int32)

    def _allocated_columns(self, npages: np.ndarray) -> np.ndarray:
        """Block-table columns holding blocks for segments with ``npages`` page positions."""
        return -(-np.asarray(npages, np.int64) // self.config.block_size)

    def size_segments(self, users: np.ndarray, slots: np.ndarray, n_pages: np.ndarray) -> None:
        """Give live segments every block for ``n_pages`` page positions and that page count,
        writing no page: a bulk reload then places the stored pages by position, and a
        position whose page was deleted stays an empty slot, as it was before the reload."""
        users, slots = np.asarray(users, np.int32), np.asarray(slots, np.int32)
        n_pages = np.asarray(n_pages, np.int64)
        keep = n_pages > 0
        users, slots, n_pages = users[keep], slots[keep], n_pages[keep]
        blocks = -(-n_pages // self.config.block_size)
        row = np.repeat(np.arange(n_pages.size), blocks)
        col = np.arange(row.size) - np.repeat(np.cumsum(blocks) - blocks, blocks)
        self.place_pages(users[row], slots[row], col * self.config.block_size)
        self.place_pages(users, slots, n_pages - 1)

    def write_pages(self, pool_slots: np.ndarray, emb: np.ndarray) -> None:
        """Write page embeddings into placed slots and mark them live."""
        pool_slots = np.asarray(pool_slots, np.int64)
        emb = self._check_emb(emb, pool_slots.size)
        self._write(self.page_emb, (pool_slots,), emb, emb_array=True)
        self._write(self.page_live, (pool_slots,), 1)

    def write_page_embeddings(self, pool_slots: np.ndarray, emb: np.ndarray) -> None:
        """Overwrite the embeddings of existing pages (an edited page keeps its slot)."""
        pool_slots = np.asarray(pool_slots, np.int64)
        emb = self._check_emb(
            np.broadcast_to(emb, (pool_slots.size, self.config.dim)), pool_slots.size
        )
        self._write(self.page_emb, (pool_slots,), emb, emb_array=True)

    def delete_pages(self, pool_slots: np.ndarray) -> None:
        """Mark pages deleted; selection skips them (their slot is reclaimed with the segment)."""
        pool_slots = np.asarray(pool_slots, np.int64)
        if pool_slots.size:
            self._write(self.page_live, (pool_slots,), 0)
            self.lexical.clear(pool_slots)

    def write_terms(
        self,
        pool_slots: np.ndarray,
        offsets: np.ndarray,
        ids: np.ndarray,
        tf: np.ndarray,
        length: np.ndarray,
    ) -> None:
        """Index pages for BM25: page ``pool_slots[i]`` gets the ascending term ids
        ``ids[offsets[i]:offsets[i+1]]``, their counts ``tf`` and its token ``length``
        (:func:`memoryos_gpu.lexical.page_terms` makes them)."""
        slots = np.asarray(pool_slots, np.int64)
        users = self._block_user[slots // self.config.block_size]
        crossed = self.lexical.write(slots, offsets, ids, tf, length, users)
        for user, user_slots in self._slots_of_users(crossed):
            self.lexical.build_postings(user, user_slots)

    def _slots_of_users(self, users: list[int]) -> list[tuple[int, np.ndarray]]:
        """Pool slots of every page block serving each of ``users``: one pass over the block
        owners for all of them (a reopen's chunk brings many users to the postings' threshold
        at once)."""
        if not users:
            return []
        bs = self.config.block_size
        blocks = np.flatnonzero(np.isin(self._block_user, users))
        owner = self._block_user[blocks]
        order = np.argsort(owner, kind="stable")
        blocks, owner = blocks[order].astype(np.int64), owner[order]
        want = np.asarray(users, np.int32)
        lo, hi = np.searchsorted(owner, want, "left"), np.searchsorted(owner, want, "right")
        slots = (blocks[:, None] * bs + np.arange(bs)).reshape(blocks.size, bs)
        return [
            (int(u), slots[a:b].ravel())
            for u, a, b in zip(want.tolist(), lo.tolist(), hi.tolist(), strict=True)
        ]

    def segment_pages(self, user: int, slot: int) -> np.ndarray:
        """Pool slots of a segment's pages in insertion order (deleted ones included)."""
        n = int(self._h_npages[user, slot])
        bs = self.config.block_size
        table = self._h_table[user, slot]
        i = np.arange(n)
        return (table[i // bs].astype(np.int64) * bs + i % bs).astype(np.int32)


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` for a small 1-D array, without its general machinery (a derived
    wave calls this with a handful of keys, where that machinery was most of the cost)."""
    s = np.sort(a)
    if s.size < 2:
        return s
    keep = np.empty(s.size, bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]

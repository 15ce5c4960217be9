"""How the arena grows: capacity reserved at once for a bulk load (``reserve``), more users,
owners or page blocks, wider segment rows and block tables, a GPU arena's host mirrors
following, and free page blocks taken from the pool.

Why together: the arrays of one kind grow together (a user's segment scalars, embeddings,
keyword rows and block table), each growth copies only live rows, and on the host it grows in
place where it can (:mod:`memoryos_gpu.arena_memory`).
"""

from __future__ import annotations

import numpy as np

from memoryos_gpu.arena_layout import NO_ID
from memoryos_gpu.arena_memory import grown_capacity, lazy_zeros, move_live_rows

# the [users, slots] arrays of per-segment scalars, and the value of an empty slot
_SEGMENT_SCALARS = (
    ("seg_live", 0),
    ("n_visit", 0),
    ("l_interaction", 0),
    ("last_access", 0.0),
    ("heat", 0.0),
    ("seg_npages", 0),
)


class ArenaGrowth:
    """Growth of the arena's arrays. A mixin of :class:`~memoryos_gpu.arena.Arena`:
    the arrays, the checks and the scatter to the device (``_write``) are the arena's."""

    def reserve(
        self,
        *,
        users: int = 0,
        blocks: int = 0,
        owners: int = 0,
        segment_width: int = 0,
        knowledge_width: int = 0,
    ) -> None:
        """Grow capacity once to at least these counts (bulk loads: no doubling copies), and
        widen to at least these segment slots and ring positions while the rows are empty
        (widening a filled arena holds its old and new rows at once)."""
        if segment_width > self.segment_width:
            self._grow_width(segment_width)
        if knowledge_width > self.knowledge_width:
            self._widen_rings(knowledge_width)
        if users > self.user_capacity:
            self._grow_users(users)
        if blocks > self.num_blocks:
            self._grow_blocks(blocks)
        if owners > self.owner_capacity:
            self._grow_owners(owners)

    def _alloc_blocks(self, n: int) -> np.ndarray:
        """Take ``n`` free blocks (lowest ids first), growing the pool by doubling if needed."""
        if len(self._free_blocks) < n:
            self._grow_blocks(grown_capacity(self.num_blocks, self.num_blocks + n))
        taken = self._free_blocks[-n:][::-1]
        del self._free_blocks[-n:]
        return np.asarray(taken, dtype=np.int32)

    def _grow_users(self, new_users: int) -> None:
        b = self._b
        # segment embeddings: only live segments' rows are copied (see lazy_zeros)
        self.seg_emb = b.grow(self.seg_emb, new_users, 0.0, live=self._h_seg_live)
        self.seg_kw = b.grow(self.seg_kw, new_users, b.dead_kw, live=self._h_seg_live)
        for name, fill in _SEGMENT_SCALARS:
            setattr(self, name, b.grow(getattr(self, name), new_users, fill))
        table_fill = NO_ID if self.on_cuda else 0  # host: lazily zero (see __init__)
        self.block_table = b.grow(self.block_table, new_users, table_fill, live=self._h_seg_live)
        self.user_live = np.concatenate(
            [self.user_live, np.zeros(new_users - self.user_live.size, np.uint8)]
        )
        self._regrow_mirrors()

    def _grow_width(self, needed: int) -> None:
        """Room for ``needed`` segment slots per user: doubling, at most ``segment_slots``.
        Only live segments' rows are copied (on the host the rest stay unwritten)."""
        width = min(self.config.segment_slots, grown_capacity(self.segment_width, needed))
        b, live = self._b, self._h_seg_live
        self.seg_emb = b.grow(self.seg_emb, width, 0.0, axis=1, live=live)
        self.seg_kw = b.grow(self.seg_kw, width, b.dead_kw, axis=1, live=live)
        for name, fill in _SEGMENT_SCALARS:
            setattr(self, name, b.grow(getattr(self, name), width, fill, axis=1))
        table_fill = NO_ID if self.on_cuda else 0  # host: lazily zero (see __init__)
        self.block_table = b.grow(self.block_table, width, table_fill, axis=1, live=live)
        self._regrow_mirrors()

    def _grow_table(self, width: int) -> None:
        if not self.on_cuda:  # lazily zero; only segments with pages have columns to keep
            old = self.block_table
            new = lazy_zeros((old.shape[0], old.shape[1], width), np.int32)
            move_live_rows(new[:, :, : old.shape[2]], old, self._h_npages > 0)
            self.block_table = self._h_table = new
            return
        self.block_table = self._b.grow(self.block_table, width, NO_ID, axis=2)
        u, s, old = self._h_table.shape
        pad = np.full((u, s, width - old), NO_ID, np.int32)
        self._h_table = np.concatenate([self._h_table, pad], axis=2)

    def _grow_blocks(self, new_blocks: int) -> None:
        old = self.num_blocks
        bs = self.config.block_size
        self.page_emb = self._b.grow(
            self.page_emb, new_blocks * bs, 0.0, live=self.page_live, dense=True
        )
        self.page_live = self._b.grow(self.page_live, new_blocks * bs, 0)
        self.lexical.grow_slots(new_blocks * bs)
        self._block_user = np.concatenate(
            [self._block_user, np.full(new_blocks - old, NO_ID, np.int32)]
        )
        self._free_blocks.extend(range(new_blocks - 1, old - 1, -1))

    def _grow_owners(self, new_owners: int) -> None:
        self.kn_emb = self._b.grow(self.kn_emb, new_owners, 0.0, live=self.kn_live)
        self.kn_live = self._b.grow(self.kn_live, new_owners, 0)
        extra = new_owners - self.owner_live.size
        self.owner_live = np.concatenate([self.owner_live, np.zeros(extra, np.uint8)])
        self._ring_head = np.concatenate([self._ring_head, np.zeros(extra, np.int64)])

    def _regrow_mirrors(self) -> None:
        if not self.on_cuda:
            self._h_seg_live, self._h_npages, self._h_table = (
                self.seg_live,
                self.seg_npages,
                self.block_table,
            )
            return
        u, s = self.seg_live.shape  # the device arrays' shape: more users, wider, or both
        old_u, old_s = self._h_seg_live.shape
        live, npages = np.zeros((u, s), np.uint8), np.zeros((u, s), np.int32)
        table = np.full((u, s, self._h_table.shape[2]), NO_ID, np.int32)
        live[:old_u, :old_s], npages[:old_u, :old_s] = self._h_seg_live, self._h_npages
        table[:old_u, :old_s] = self._h_table
        self._h_seg_live, self._h_npages, self._h_table = live, npages, table

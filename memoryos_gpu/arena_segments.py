"""The arena's segment slots (the ``[users, slots]`` arrays): each user's free slots, segments
written (embedding, keyword row, heat statistics), their statistics overwritten, segments freed
with their page blocks.

Why apart: these are the writes of the mid-term memory's segments, a concern of their own
beside the page pool (:mod:`memoryos_gpu.arena_pages`) and the knowledge rings
(:mod:`memoryos_gpu.arena_knowledge`); what they share is the arena's (``arena.py``).
"""

from __future__ import annotations

import numpy as np

from memoryos_gpu.arena_layout import KEYWORD_PAD, NO_ID, normalize_keyword_rows
from memoryos_gpu.errors import ArenaError


class ArenaSegments:
    """Segment slots of the arena. A mixin of :class:`~memoryos_gpu.arena.Arena`:
    the arrays, the checks and the scatter to the device (``_write``) are the arena's."""

    # ------------------------------------------------------------------ segments
    def live_segments(self, user: int) -> np.ndarray:
        return np.flatnonzero(self._h_seg_live[user]).astype(np.int32)

    def free_segment_slots(self, users: np.ndarray) -> np.ndarray:
        """Each user's lowest free segment slot, or -1 where the user holds ``segment_slots``
        live segments (a slot may be past the current width: writing it widens the arena)."""
        free = self._h_seg_live[np.asarray(users, np.int32)] == 0
        full = NO_ID if self.segment_width >= self.config.segment_slots else self.segment_width
        return np.where(free.any(axis=1), free.argmax(axis=1), full).astype(np.int32)

    def _check_slots(self, slots: np.ndarray) -> None:
        """Segment slots a caller names must be held by the arena's current width."""
        if slots.size and ((slots < 0) | (slots >= self.segment_width)).any():
            raise ArenaError("segment slot out of range")

    def write_segments(
        self,
        users: np.ndarray,
        slots: np.ndarray,
        emb: np.ndarray,
        keywords: np.ndarray,
        *,
        n_visit: np.ndarray | None = None,
        l_interaction: np.ndarray | None = None,
        last_access: np.ndarray | None = None,
    ) -> None:
        """Create or overwrite segments: embedding, keyword row, and (optionally) heat stats."""
        users, slots = np.asarray(users, np.int32), np.asarray(slots, np.int32)
        self.check_users(users)
        n = users.size
        emb = self._check_emb(emb, n)
        keywords = np.asarray(keywords)
        if keywords.shape != (n, self.config.keyword_width) or keywords.dtype.kind not in "iu":
            raise ArenaError(f"keywords must be [{n}, {self.config.keyword_width}] integer ids")
        keywords = normalize_keyword_rows(keywords)
        if ((slots < 0) | (slots >= self.config.segment_slots)).any():
            raise ArenaError("segment slot out of range")
        if n and int(slots.max()) >= self.segment_width:
            self._grow_width(int(slots.max()) + 1)
        idx = (users, slots)
        self._write(self.seg_emb, idx, emb, emb_array=True)
        self._write(self.seg_kw, idx, keywords)
        self._write(self.seg_live, idx, 1)
        self._h_seg_live[idx] = 1
        if n_visit is not None:
            self._write(self.n_visit, idx, np.asarray(n_visit, np.int32))
        if l_interaction is not None:
            self._write(self.l_interaction, idx, np.asarray(l_interaction, np.int32))
        if last_access is not None:
            self._write(self.last_access, idx, np.asarray(last_access, np.float64))

    def set_segment_stats(
        self,
        users: np.ndarray,
        slots: np.ndarray,
        *,
        n_visit: np.ndarray | None = None,
        l_interaction: np.ndarray | None = None,
        last_access: np.ndarray | None = None,
    ) -> None:
        """Overwrite heat statistics of live segments (e.g. reset L_interaction after promotion)."""
        idx = (np.asarray(users, np.int32), np.asarray(slots, np.int32))
        self._check_slots(idx[1])
        if n_visit is not None:
            self._write(self.n_visit, idx, np.asarray(n_visit, np.int32))
        if l_interaction is not None:
            self._write(self.l_interaction, idx, np.asarray(l_interaction, np.int32))
        if last_access is not None:
            self._write(self.last_access, idx, np.asarray(last_access, np.float64))

    def free_segments(self, users: np.ndarray, slots: np.ndarray) -> None:
        """Evict segments: their slots become free and their page blocks return to the pool."""
        users, slots = np.asarray(users, np.int32), np.asarray(slots, np.int32)
        if users.size == 0:
            return
        self._check_slots(slots)
        idx = (users, slots)
        blocks = self._h_table[idx]
        have = self._allocated_columns(self._h_npages[idx])
        freed = blocks[np.arange(blocks.shape[1]) < have[:, None]]
        if freed.size:
            pages = freed[:, None] * self.config.block_size + np.arange(self.config.block_size)
            self._write(self.page_live, (pages.ravel(),), 0)
            self.lexical.clear(pages.ravel())
            self._free_blocks.extend(int(x) for x in freed[::-1])
            self._block_user[freed] = NO_ID
        for name in ("seg_live", "n_visit", "l_interaction", "seg_npages"):
            self._write(getattr(self, name), idx, 0)
        self._write(self.last_access, idx, 0.0)
        self._write(self.heat, idx, 0.0)
        self._write(self.seg_kw, idx, KEYWORD_PAD)
        self._write(self.block_table, idx, NO_ID)
        self._h_seg_live[idx] = 0
        self._h_npages[idx] = 0
        self._h_table[idx] = NO_ID

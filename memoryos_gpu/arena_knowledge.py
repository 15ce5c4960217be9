"""The arena's knowledge rings (the ``[owners, positions]`` arrays): a FIFO ring of long-term
entries per owner (a user's knowledge, an assistant's), pushed in batches, written at explicit
positions on a reload or an edit, deleted, and widened as positions are needed.
"""

from __future__ import annotations

import numpy as np

from memoryos_gpu.arena_memory import grown_capacity
from memoryos_gpu.errors import ArenaError
from memoryos_gpu.grouping import rank_within


class ArenaKnowledge:
    """Knowledge rings of the arena. A mixin of :class:`~memoryos_gpu.arena.Arena`:
    the arrays, the checks and the scatter to the device (``_write``) are the arena's."""

    # ------------------------------------------------------------------ knowledge rings
    def push_knowledge(self, owners: np.ndarray, emb: np.ndarray) -> np.ndarray:
        """Append entries to owners' FIFO rings; a full ring overwrites its oldest entry.

        Returns the ring slot each entry took, so callers can map slots to their entry ids (the
        entry previously in that slot is the one the FIFO dropped).
        """
        owners = np.asarray(owners, np.int32)
        n = owners.size
        emb = self._check_emb(emb, n)
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        self.check_owners(owners)
        cap = self.config.knowledge_capacity
        # each entry's rank among the batch's entries of its owner (batch order kept)
        ring = ((self._ring_head[owners] + rank_within(owners)) % cap).astype(np.int32)
        np.add.at(self._ring_head, owners, 1)
        self._fit_rings(ring)
        # if one batch wraps a ring, only the last write per slot survives (FIFO semantics)
        self._write(self.kn_emb, (owners, ring), emb, emb_array=True)
        self._write(self.kn_live, (owners, ring), 1)
        return ring

    def ring_head(self, owner: int) -> int:
        """Entries ever pushed to ``owner``'s ring (the next slot is this modulo capacity)."""
        return int(self._ring_head[owner])

    def set_ring_head(self, owner: int, head: int) -> None:
        """Restore a ring's write position (rebuilding the arena from the store)."""
        self._ring_head[owner] = head

    def write_knowledge(self, owners: np.ndarray, ring_slots: np.ndarray, emb: np.ndarray) -> None:
        """Write entries at explicit ring slots (rebuilding from the store, or editing an entry)."""
        owners, ring_slots = np.asarray(owners, np.int32), np.asarray(ring_slots, np.int32)
        emb = self._check_emb(emb, owners.size)
        if owners.size:
            self.check_owners(owners)
            if ((ring_slots < 0) | (ring_slots >= self.config.knowledge_capacity)).any():
                raise ArenaError("ring slot out of range")
            self._fit_rings(ring_slots)
            self._write(self.kn_emb, (owners, ring_slots), emb, emb_array=True)
            self._write(self.kn_live, (owners, ring_slots), 1)

    def delete_knowledge(self, owners: np.ndarray, ring_slots: np.ndarray) -> None:
        owners, ring_slots = np.asarray(owners, np.int32), np.asarray(ring_slots, np.int32)
        held = ring_slots < self.knowledge_width  # a position past the width holds nothing
        if held.any():
            self._write(self.kn_live, (owners[held], ring_slots[held]), 0)

    def _fit_rings(self, ring_slots: np.ndarray) -> None:
        """Widen every ring when one of ``ring_slots`` needs it."""
        if ring_slots.size and int(ring_slots.max()) >= self.knowledge_width:
            self._widen_rings(int(ring_slots.max()) + 1)

    def _widen_rings(self, needed: int) -> None:
        """Room for ``needed`` positions per ring: doubling, at most the capacity. Only live
        entries' rows are copied (on the host the rest stay unwritten)."""
        width = min(self.config.knowledge_capacity, grown_capacity(self.knowledge_width, needed))
        self.kn_emb = self._b.grow(self.kn_emb, width, 0.0, axis=1, live=self.kn_live)
        self.kn_live = self._b.grow(self.kn_live, width, 0, axis=1)

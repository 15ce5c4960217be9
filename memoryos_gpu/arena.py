"""The arena: every user's MTM segments, pages and LPM knowledge in struct-of-arrays form.

Why struct-of-arrays with fixed slots: the batched kernels then index user ``u``'s segment ``s``
as ``[u, s]`` with no pointer chasing, a query can only ever read its own user's rows, and a
batch of queries from thousands of users is one kernel launch. Pages live in a pool of
fixed-size blocks with a block table per segment (the paged-KV-cache idea, and the paper's own
segment/page metaphor), so segments grow without moving other segments' pages.

The arena holds numbers only (embeddings, hashed keyword ids, heat statistics). Text, ids and
everything else live in the store; the arena is a cache of it that can be rebuilt at any time.

On the CPU every array is a NumPy array that the C++ kernels read and write in place. On a GPU
the arrays are torch tensors on the device; the small structural metadata (which slots are
live, how many pages a segment has, its block table) is mirrored on the host so that slot
allocation never needs a device round trip, and heat statistics (written by the kernels on the
device) are read back on demand with :meth:`Arena.pull_heat`.

This module is the arena's public face (what the engine, the kernels' wrappers, tests and
benchmarks import): :class:`Arena` with its construction, sizes, user and owner slots, heat
read-back and the checked scatter every write goes through. The rest is a module per concern:

* :mod:`~memoryos_gpu.arena_layout`: :class:`ArenaConfig`, the values of empty entries
  (``KEYWORD_PAD``, ``NO_ID``) and keyword rows in the kernels' form;
* :mod:`~memoryos_gpu.arena_memory`: host arrays backed lazily and grown in place;
* :mod:`~memoryos_gpu.arena_backend`: allocation and scatter writes on NumPy or torch;
* :mod:`~memoryos_gpu.arena_segments`, :mod:`~memoryos_gpu.arena_pages` and
  :mod:`~memoryos_gpu.arena_knowledge`: writing segments, the page pool and the knowledge rings
  (mixins of :class:`Arena`);
* :mod:`~memoryos_gpu.arena_growth`: reserving, growing and widening the arrays;
* :mod:`~memoryos_gpu.arena_lexical`: the pages' BM25 term rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memoryos_gpu.arena_backend import _Backend
from memoryos_gpu.arena_growth import ArenaGrowth
from memoryos_gpu.arena_knowledge import ArenaKnowledge
from memoryos_gpu.arena_layout import KEYWORD_PAD, NO_ID, ArenaConfig, normalize_keyword_rows
from memoryos_gpu.arena_lexical import LexicalRows
from memoryos_gpu.arena_memory import grow_in_place, grown_capacity, lazy_zeros, move_live_rows
from memoryos_gpu.arena_pages import ArenaPages
from memoryos_gpu.arena_segments import ArenaSegments
from memoryos_gpu.errors import ArenaError

__all__ = [
    "KEYWORD_PAD",
    "NO_ID",
    "Arena",
    "ArenaConfig",
    "grow_in_place",
    "grown_capacity",
    "lazy_zeros",
    "move_live_rows",
    "normalize_keyword_rows",
]


class Arena(ArenaSegments, ArenaPages, ArenaKnowledge, ArenaGrowth):
    """Slot storage for many users' segments, pages and knowledge rings.

    Slots are small integers: a *user slot* per user, a *segment slot* (0..S-1) inside a user,
    a *pool slot* per page, an *owner slot* per knowledge ring (a user's knowledge and an
    assistant's knowledge are both owners). Callers (the memory tiers) keep the mapping from
    their ids to slots. All mutators take batches so a GPU arena pays one scatter per batch.
    """

    def __init__(self, config: ArenaConfig | None = None) -> None:
        self.config = config or ArenaConfig()
        c = self.config
        self._b = _Backend(c.device, c.gpu_dtype)
        b = self._b
        users, k = max(1, c.initial_users), c.keyword_width
        s = min(c.segment_slots, c.initial_segment_slots)
        # --- segments, [U, S, ...] (device) ---
        self.seg_emb = b.empty_emb((users, s, c.dim))
        # rows of dead slots are never read: on the host they stay unwritten (zero, not resident)
        self.seg_kw = (
            b.full((users, s, k), b.dead_kw, np.int32)
            if b.on_cuda
            else lazy_zeros((users, s, k), np.int32)
        )
        self.seg_live = b.full((users, s), 0, np.uint8)
        self.n_visit = b.full((users, s), 0, np.int32)
        self.l_interaction = b.full((users, s), 0, np.int32)
        self.last_access = b.full((users, s), 0.0, np.float64)
        self.heat = b.full((users, s), 0.0, np.float32)
        self.seg_npages = b.full((users, s), 0, np.int32)
        # a segment's columns past its allocated blocks are never read (pages < npages only): on
        # the host they stay unwritten, so a wide table costs only the rows of live segments
        self.block_table = (
            b.full((users, s, 1), NO_ID, np.int32)
            if b.on_cuda
            else lazy_zeros((users, s, 1), np.int32)
        )
        # --- page pool, [NP, ...] (device) ---
        blocks = max(1, c.initial_blocks)
        self.page_emb = b.empty_emb((blocks * c.block_size, c.dim), dense=True)
        self.page_live = b.full((blocks * c.block_size,), 0, np.uint8)
        # BM25 term rows per pool slot (and postings of users with many pages)
        self.lexical = LexicalRows(b, blocks * c.block_size, c.postings_min_pages)
        self._block_user = np.full(blocks, NO_ID, np.int32)  # the user a page block serves
        # --- knowledge rings, [O, R, ...] (device) ---
        owners = max(1, c.initial_owners)
        ring = min(c.knowledge_capacity, c.initial_knowledge_slots)
        self.kn_emb = b.empty_emb((owners, ring, c.dim))
        self.kn_live = b.full((owners, ring), 0, np.uint8)
        # --- host-side structure (mirrors on GPU, the arrays themselves on CPU) ---
        self.user_live = np.zeros(users, dtype=np.uint8)
        self._h_seg_live = self._host_alias(self.seg_live)
        self._h_npages = self._host_alias(self.seg_npages)
        self._h_table = self._host_alias(self.block_table)
        self._free_blocks: list[int] = list(range(blocks - 1, -1, -1))
        self.owner_live = np.zeros(owners, dtype=np.uint8)
        self._ring_head = np.zeros(owners, dtype=np.int64)  # next write position per owner

    # ------------------------------------------------------------------ properties
    @property
    def on_cuda(self) -> bool:
        return self._b.on_cuda

    @property
    def user_capacity(self) -> int:
        return int(self.user_live.shape[0])

    @property
    def owner_capacity(self) -> int:
        return int(self.owner_live.shape[0])

    @property
    def knowledge_width(self) -> int:
        """Ring positions every owner has room for now (<= ``config.knowledge_capacity``)."""
        return int(self.kn_live.shape[1])

    @property
    def segment_width(self) -> int:
        """Segment slots every user has room for now (<= ``config.segment_slots``)."""
        return int(self._h_seg_live.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.page_live.shape[0]) // self.config.block_size

    def nbytes(self) -> int:
        """Bytes held by the device arrays (what the arena costs in memory)."""
        total = 0
        for name in (
            "seg_emb",
            "seg_kw",
            "seg_live",
            "n_visit",
            "l_interaction",
            "last_access",
            "heat",
            "seg_npages",
            "block_table",
            "page_emb",
            "page_live",
            "kn_emb",
            "kn_live",
        ):
            a = getattr(self, name)
            total += a.nbytes if isinstance(a, np.ndarray) else a.numel() * a.element_size()
        return int(total) + self.lexical.nbytes()

    def device_array(self, host: np.ndarray) -> Any:
        """A host array as the kernels take it on this arena's device (as is on the CPU)."""
        if not self.on_cuda:
            return host
        return self._b.torch.from_numpy(host).to(self.seg_emb.device, non_blocking=True)

    def page_positions(self, users: np.ndarray) -> int:
        """The most page positions any of ``users`` holds over its live segments (what a
        per-query scratch row of the fused retrieval pass needs on a GPU)."""
        users = np.asarray(users, np.int64)
        if users.size == 0:
            return 0
        cap = self._h_table.shape[2] * self.config.block_size
        counts = np.minimum(self._h_npages[users], cap) * (self._h_seg_live[users] > 0)
        return int(counts.sum(axis=1).max())

    def _host_alias(self, array: Any) -> np.ndarray:
        return array if not self.on_cuda else array.cpu().numpy()

    # ------------------------------------------------------------------ users and owners
    def add_users(self, n: int) -> np.ndarray:
        """Allocate ``n`` user slots (lowest free first) and return them."""
        free = np.flatnonzero(self.user_live == 0)
        if free.size < n:
            self._grow_users(grown_capacity(self.user_capacity, self.user_capacity + n - free.size))
            free = np.flatnonzero(self.user_live == 0)
        slots = free[:n].astype(np.int32)
        self.user_live[slots] = 1
        return slots

    def remove_user(self, user: int) -> None:
        """Free a user slot and every segment and page block it held."""
        self.check_users(np.array([user]))
        live = np.flatnonzero(self._h_seg_live[user])
        self.free_segments(np.full(live.size, user, dtype=np.int32), live.astype(np.int32))
        self.user_live[user] = 0

    def add_owners(self, n: int) -> np.ndarray:
        """Allocate ``n`` knowledge-ring owner slots."""
        free = np.flatnonzero(self.owner_live == 0)
        if free.size < n:
            self._grow_owners(
                grown_capacity(self.owner_capacity, self.owner_capacity + n - free.size)
            )
            free = np.flatnonzero(self.owner_live == 0)
        slots = free[:n].astype(np.int32)
        self.owner_live[slots] = 1
        self._ring_head[slots] = 0
        return slots

    def remove_owner(self, owner: int) -> None:
        self.check_owners(np.array([owner]))
        self._write(self.kn_live, (owner,), 0)
        self.owner_live[owner] = 0
        self._ring_head[owner] = 0

    def check_users(self, users: np.ndarray) -> None:
        _check_live(users, self.user_live, "user slot")

    def check_owners(self, owners: np.ndarray) -> None:
        _check_live(owners, self.owner_live, "knowledge owner slot")

    # ------------------------------------------------------------------ heat read-back
    def pull_heat(self, users: np.ndarray) -> dict[str, np.ndarray]:
        """Heat statistics of ``users`` ([n, S] each) on the host."""
        idx = np.asarray(users, np.int64)
        out = {}
        for name in ("n_visit", "l_interaction", "last_access", "heat"):
            a = getattr(self, name)
            out[name] = self._b.to_host(a[self._b.to_device(idx) if self.on_cuda else idx])
        out["live"] = self._h_seg_live[idx].copy()
        return out

    def host(self, name: str) -> np.ndarray:
        """A host copy (or, on CPU, the array itself) of a device array, for tests and checks."""
        return self._b.to_host(getattr(self, name))

    # ------------------------------------------------------------------ internals
    def _check_emb(self, emb: Any, n: int) -> np.ndarray:
        """Embeddings as float32 [n, d], finite, and finite in the storage type too.

        Why the second check: a GPU arena stores float16 or bfloat16, and a finite float32
        value at or beyond the type's rounding limit (65520 for float16) becomes infinity in
        the cast, so its cosines would be NaN. It is checked here, before the cast, on the
        host. (Cosines are scale-free: scale such rows down before writing them.)
        """
        arr = np.asarray(emb, dtype=np.float32)
        if arr.shape != (n, self.config.dim):
            raise ArenaError(f"embeddings must be [{n}, {self.config.dim}], got {arr.shape}")
        if not np.isfinite(arr).all():
            raise ArenaError("embeddings contain NaN or infinity")
        if self.on_cuda and arr.size:
            # values of magnitude >= (2 - 2^-(m+1)) * 2^emax round to infinity (m mantissa bits)
            mant, emax = {"float16": (10, 15), "bfloat16": (7, 127)}[self.config.gpu_dtype]
            limit = np.ldexp(2.0 - 2.0 ** -(mant + 1), emax)
            if float(np.abs(arr).max()) >= limit:
                raise ArenaError(
                    f"embeddings hold a value of magnitude >= {limit:.6g}, which becomes "
                    f"infinity in {self.config.gpu_dtype}: scale the vectors down"
                )
        return arr

    def _write(self, target: Any, index: tuple, value: Any, emb_array: bool = False) -> None:
        """Scatter ``value`` into ``target[index]`` on the arena's device."""
        if not self.on_cuda:
            target[index] = value
            return
        torch = self._b.torch
        idx = tuple(torch.as_tensor(np.asarray(i, np.int64), device=target.device) for i in index)
        if isinstance(value, np.ndarray):
            v = torch.from_numpy(np.ascontiguousarray(value)).to(target.device)
            v = v.to(target.dtype)
        else:
            v = torch.tensor(value, dtype=target.dtype, device=target.device)
        target[idx] = v


def _check_live(ids: np.ndarray, live: np.ndarray, what: str) -> None:
    """Every id names a live row of ``live`` (else ArenaError naming the first that does not).
    Called on every kernel call, so the common case is two array operations: one comparison
    catches both ends (a negative id is huge as unsigned), one gather checks liveness."""
    ids = np.asarray(ids)
    if ids.dtype.kind == "i" and ids.dtype.itemsize <= 8:
        inside = ids.view(ids.dtype.str.replace("i", "u")) < live.shape[0]
    else:
        inside = (ids >= 0) & (ids < live.shape[0])
    if inside.all() and live[ids].all():
        return
    bad = ~inside
    if not bad.any():
        bad = live[ids] == 0
    raise ArenaError(f"unknown {what} {int(ids[np.argmax(bad)])}")

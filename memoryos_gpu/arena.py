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
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from memoryos_gpu.arena_lexical import LexicalRows
from memoryos_gpu.errors import ArenaError

KEYWORD_PAD = -1
NO_ID = -1
_INT32_MAX = np.iinfo(np.int32).max
_LAZY_MIN_BYTES = 4 << 20  # below this an ordinary allocation is as good
_GROWTH_STEP = 1 << 16  # users, owners or blocks added at most per growth (grown_capacity)
_RESERVE_FACTOR = 64  # address space a lazy host array reserves, in multiples of its size
_RESERVE_MIN = 4 << 30  # ... and at least this many bytes (nothing is backed until written)
_MOVE_BLOCK_BYTES = 32 << 20  # rows copied (and the old ones released) at a time by a widening


# the [users, slots] arrays of per-segment scalars, and the value of an empty slot
_SEGMENT_SCALARS = (
    ("seg_live", 0),
    ("n_visit", 0),
    ("l_interaction", 0),
    ("last_access", 0.0),
    ("heat", 0.0),
    ("seg_npages", 0),
)


def lazy_zeros(shape: tuple[int, ...], dtype: Any, huge: bool = False) -> np.ndarray:
    """A zeroed host array whose memory the OS provides page by page as rows are first written,
    in an address-space reservation that lets it grow along its first axis without a copy.

    Why: the arena reserves 200 segment rows per user and 100 knowledge rows per owner, and most
    stay empty (a user with 20 pages has ~8 segments). Anonymous memory is lazily backed anyway,
    but NumPy asks Linux for transparent huge pages on large arrays, and then the first write
    into any 2 MB region makes all of it resident: every user's whole segment block. The native
    :class:`LazyBuffer` maps anonymous memory advised ``MADV_NOHUGEPAGE`` (residency at 4 KB
    granularity: a 2,000-user store takes 208 MB instead of 787 MB) and ``MAP_NORESERVE``, so
    address space costs nothing until it is written. Each array therefore reserves
    ``_RESERVE_FACTOR`` times its size (at least ``_RESERVE_MIN``) and :func:`grow_in_place`
    lengthens it inside that reservation: growing copies nothing and never holds the old and
    the new array at once (growth was the peak of resident memory: +60 % at 20,000 users).
    Small arrays get ``np.zeros``.

    ``huge``: transparent huge pages after all, for an array written densely from its first row
    whose rows are read at random: the page pool's embeddings (2 GB at 100,000 users, where a
    4 KB page per candidate row is a TLB miss besides the cache miss; docs/storage.md).
    """
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dt.itemsize
    if nbytes < _LAZY_MIN_BYTES:
        return np.zeros(shape, dtype=dt)
    from memoryos_gpu import _C

    try:
        buf = _C.LazyBuffer(max(nbytes * _RESERVE_FACTOR, _RESERVE_MIN), huge)
    except RuntimeError:  # an address-space limit (ulimit -v): reserve what is needed
        buf = _C.LazyBuffer(nbytes, huge)
    return np.frombuffer(buf, dtype=dt, count=count).reshape(shape)


def _lazy_buffer(array: np.ndarray) -> Any:
    """The :class:`LazyBuffer` under ``array`` (None when it has none)."""
    from memoryos_gpu import _C

    buf: Any = array
    while buf is not None and not isinstance(buf, _C.LazyBuffer):
        buf = buf.obj if isinstance(buf, memoryview) else getattr(buf, "base", None)
    return buf


def grow_in_place(array: np.ndarray, rows: int) -> np.ndarray | None:
    """``array`` lengthened to ``rows`` along axis 0 inside its :func:`lazy_zeros` reservation
    (the same memory: existing rows stay where they are, new rows are zero), or None when the
    array has no reservation or it is too small."""
    buf = _lazy_buffer(array)
    if buf is None or not array.flags.c_contiguous:
        return None
    start = np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data
    per_row = int(np.prod(array.shape[1:], dtype=np.int64))
    count = rows * per_row
    if array.ctypes.data != start or count * array.itemsize > memoryview(buf).nbytes:
        return None
    return np.frombuffer(buf, dtype=array.dtype, count=count).reshape((rows, *array.shape[1:]))


def move_live_rows(out: np.ndarray, array: np.ndarray, live: np.ndarray) -> None:
    """``out[r] = array[r]`` for every index ``r`` of the leading dimensions where ``live`` is
    set, a block of leading rows at a time; each block's memory in ``array`` is given back to
    the OS once copied when ``array`` is a :func:`lazy_zeros` array (its contents are then
    zero: the caller drops it). Why: widening every user's rows (one ring past its width,
    often a shared assistant's) gathered all live rows into a temporary before writing them:
    the old, the gathered and the new rows resident at once (the promotions a reopen resumed
    at 30,000 users: a 690 MB transient); now the new rows and one block."""
    n = array.shape[0]
    per_row = array.nbytes // max(n, 1)
    step = max(1, _MOVE_BLOCK_BYTES // max(per_row, 1))
    buf = _lazy_buffer(array) if array.flags.c_contiguous and array.size else None
    start = 0 if buf is None else array.ctypes.data - np.frombuffer(buf, np.uint8, 1).ctypes.data
    released = start  # bytes below this are given back (or not the array's)
    for a in range(0, n, step):
        b = min(n, a + step)
        rows = np.nonzero(live[a:b])
        out[a:b][rows] = array[a:b][rows]
        if buf is not None:  # every whole page up to the last row copied, a page at a time
            end = start + b * per_row
            buf.release(released, end - released)
            released = max(released, end // mmap.PAGESIZE * mmap.PAGESIZE)


def grown_capacity(capacity: int, needed: int) -> int:
    """The next capacity for ``needed`` rows: doubling up to 65,536, then steps of 65,536.

    Why bounded steps: a GPU arena allocates device memory for every row it reserves (200
    segment rows of d floats per user), so doubling at 100,000 users would reserve another
    100,000 users' worth at once. (On the host, reserving is free and growing copies nothing:
    :func:`lazy_zeros`, :func:`grow_in_place`.)
    """
    step = min(max(capacity, 1), _GROWTH_STEP)
    return max(needed, capacity + step)


def normalize_keyword_rows(rows: np.ndarray) -> np.ndarray:
    """Rows of keyword ids as the kernels require them: sorted, unique, padded at the end.

    Vectorised (no per-row Python): negative entries count as padding, duplicates collapse.
    """
    r = np.sort(np.asarray(rows, dtype=np.int32), axis=1)
    drop = r < 0
    drop[:, 1:] |= r[:, 1:] == r[:, :-1]
    r[drop] = _INT32_MAX
    r.sort(axis=1)
    r[r == _INT32_MAX] = KEYWORD_PAD
    return r


@dataclass(frozen=True)
class ArenaConfig:
    """Shape of the arena. Defaults follow the paper (200 segments, 100 knowledge entries)."""

    dim: int = 384
    segment_slots: int = 200  # segments a user may hold (the paper's MTM capacity)
    # segment slots each user has room for at first; the arena widens by doubling up to
    # segment_slots when a user needs more (rows of [users, slots, ...] cost memory for every
    # user: 200 slots at 100,000 users is 15 GB of fp16 segment rows on a GPU)
    initial_segment_slots: int = 8
    keyword_width: int = 32
    # pages per block; None: 1 on the host (a wide block table costs nothing there, see
    # Arena.__init__, and a one-page segment, the common case without an LLM, wastes no
    # slot), 4 on a GPU (the device block table is dense: U x S x ceil(pages / 4) entries)
    block_size: int | None = None
    knowledge_capacity: int = 100  # live entries a ring holds (the paper's LPM capacity)
    # ring positions each owner has room for at first; the rings widen by doubling up to
    # knowledge_capacity when an owner's ring needs more ([owners, R, d] rows cost memory for
    # every owner: 100 fp16 rows of 384 dimensions are 77 KB an owner on a GPU)
    initial_knowledge_slots: int = 8
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    gpu_dtype: str = "float16"  # "float16" or "bfloat16" (CPU always stores float32)
    initial_users: int = 16
    initial_blocks: int = 256
    initial_owners: int = 16
    # a user with at least this many indexed MTM pages also gets BM25 postings (CPU arena):
    # its queries touch only their own terms' pages instead of scanning every page's row
    # (memoryos_gpu.arena_lexical); 0: never
    postings_min_pages: int = 256

    def __post_init__(self) -> None:
        if self.block_size is None:
            object.__setattr__(self, "block_size", 4 if self.device.startswith("cuda") else 1)
        names = ("dim", "segment_slots", "initial_segment_slots", "keyword_width")
        for name in (*names, "block_size", "knowledge_capacity", "initial_knowledge_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"ArenaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.postings_min_pages < 0:
            raise ValueError(
                f"ArenaConfig.postings_min_pages must be >= 0, got {self.postings_min_pages}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"ArenaConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.gpu_dtype not in ("float16", "bfloat16"):
            raise ValueError(
                f"ArenaConfig.gpu_dtype must be float16 or bfloat16, got {self.gpu_dtype}"
            )


class _Backend:
    """Allocation and scatter writes for one device (NumPy on CPU, torch on CUDA)."""

    def __init__(self, device: str, gpu_dtype: str) -> None:
        self.device = device
        self.on_cuda = device.startswith("cuda")
        if self.on_cuda:
            import torch

            if not torch.cuda.is_available():
                raise ArenaError(f"device {device!r} requested but torch sees no CUDA device")
            self.torch = torch
            self.emb_dtype = getattr(torch, gpu_dtype)
        else:
            self.torch = None
            self.emb_dtype = np.float32
        # what a dead segment's keyword row holds: padding on the device, on the host nothing
        # written (zero), so that empty rows are never made resident
        self.dead_kw = KEYWORD_PAD if self.on_cuda else 0

    def full(self, shape: tuple[int, ...], value: Any, dtype: Any) -> Any:
        if self.on_cuda:
            return self.torch.full(shape, value, dtype=self._tdtype(dtype), device=self.device)
        if value == 0:  # lazily backed and growable in place (lazy_zeros)
            return lazy_zeros(shape, dtype)
        return np.full(shape, value, dtype=dtype)

    def empty_emb(self, shape: tuple[int, ...], dense: bool = False) -> Any:
        """Zeroed embedding rows; ``dense``: written from the first row on (host: huge pages,
        see :func:`lazy_zeros`)."""
        if self.on_cuda:
            return self.torch.zeros(shape, dtype=self.emb_dtype, device=self.device)
        return lazy_zeros(shape, np.float32, huge=dense)

    def to_device(self, array: np.ndarray, emb: bool = False) -> Any:
        if not self.on_cuda:
            return np.ascontiguousarray(array, dtype=np.float32 if emb else array.dtype)
        t = self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=False)
        return t.to(self.emb_dtype) if emb else t

    def to_host(self, array: Any) -> np.ndarray:
        if not self.on_cuda:
            return array
        t = array.detach()
        if t.dtype in (self.torch.float16, self.torch.bfloat16):
            t = t.float()
        return t.cpu().numpy()

    def grow(
        self,
        array: Any,
        new_len: int,
        fill: Any,
        axis: int = 0,
        live: np.ndarray | None = None,
        dense: bool = False,
    ) -> Any:
        """Return ``array`` extended along ``axis`` to ``new_len``, old contents kept.

        ``live`` (the shape of ``array``'s leading dimensions): on the CPU, with a zero fill,
        only those rows are kept, so growing never touches the memory of empty rows (on CUDA
        it is ignored: the device copy is one kernel either way). ``dense``: a new host
        allocation asks for huge pages (:func:`lazy_zeros`).
        """
        shape = list(array.shape)
        extra = new_len - shape[axis]
        if extra <= 0:
            return array
        # One allocation of the new size, old rows copied in: the peak is old + new, not
        # old + padding + new as with a concatenate (at 10,000 users x 200 segments the page
        # pool alone is gigabytes). Zero fills use zeroed allocations the OS maps lazily.
        old = shape[axis]
        shape[axis] = new_len
        head = (slice(None),) * axis + (slice(0, old),)
        tail = (slice(None),) * axis + (slice(old, None),)
        if self.on_cuda:
            out = self.torch.empty(shape, dtype=array.dtype, device=array.device)
            out[tail] = fill
        elif fill == 0 and axis == 0 and (same := grow_in_place(array, new_len)) is not None:
            return same  # the reservation had room: nothing copied
        elif fill == 0:
            out = lazy_zeros(tuple(shape), array.dtype, huge=dense)
            if live is not None:
                move_live_rows(out, array, live)
                return out
        else:
            out = np.empty(shape, dtype=array.dtype)
            out[tail] = fill
        out[head] = array
        return out

    def write_range(self, target: Any, start: int, values: np.ndarray) -> None:
        """``target[start:start + len(values)] = values`` (one copy to the device on CUDA)."""
        if values.size == 0:
            return
        if self.on_cuda:
            values = self.torch.from_numpy(np.ascontiguousarray(values)).to(target.device)
        target[start : start + values.shape[0]] = values

    def scatter(self, target: Any, index: np.ndarray, values: np.ndarray) -> None:
        """``target[index] = values`` for 1-D targets."""
        if not self.on_cuda:
            target[index] = values
            return
        t = self.torch
        idx = t.as_tensor(np.asarray(index, np.int64), device=target.device)
        target[idx] = t.from_numpy(np.ascontiguousarray(values)).to(target.device, target.dtype)

    def gather_to_new(self, source: Any, index: np.ndarray, length: int) -> Any:
        """A new int32 1-D array of ``length`` (zero-padded) with ``source[index]`` in front."""
        out = self.full((length,), 0, np.int32)
        if index.size:
            if self.on_cuda:
                idx = self.torch.as_tensor(index, device=source.device)
                out[: index.size] = source[idx]
            else:
                out[: index.size] = source[index]
        return out

    def _tdtype(self, dtype: Any) -> Any:
        return {
            np.float32: self.torch.float32,
            np.float64: self.torch.float64,
            np.int32: self.torch.int32,
            np.int64: self.torch.int64,
            np.uint8: self.torch.uint8,
        }[np.dtype(dtype).type]


class Arena:
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
        positions = self._h_npages.reshape(-1)[key].astype(np.int64) + _rank_within(key)
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
        ring = ((self._ring_head[owners] + _rank_within(owners)) % cap).astype(np.int32)
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


def _rank_within(key: np.ndarray) -> np.ndarray:
    """Each element's rank among the elements of equal key before it (order kept): the
    position a page takes among the batch's pages of its segment."""
    n = key.size
    rank = np.zeros(n, np.int64)
    if n < 2:
        return rank
    order = np.argsort(key, kind="stable")
    sk = key[order]
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(sk[1:], sk[:-1], out=new[1:])
    if new.all():  # every page in a segment of its own: the common wave
        return rank
    starts = np.flatnonzero(new)
    rank[order] = np.arange(n) - starts[np.cumsum(new) - 1]
    return rank

"""The arena's host memory: arrays the OS backs page by page as rows are first written, in
reservations they grow inside without a copy (:func:`lazy_zeros`, :func:`grow_in_place`), live
rows moved into a wider array a block at a time (:func:`move_live_rows`), and bounded growth
steps (:func:`grown_capacity`).

Why apart from the arena: each of these is a measured fix of the arena's resident memory at
scale (see the functions and docs/storage.md), and they act on plain NumPy arrays over the
native ``LazyBuffer``, knowing nothing of segments, pages or rings.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

_LAZY_MIN_BYTES = 4 << 20  # below this an ordinary allocation is as good
_GROWTH_STEP = 1 << 16  # users, owners or blocks added at most per growth (grown_capacity)
_RESERVE_FACTOR = 64  # address space a lazy host array reserves, in multiples of its size
_RESERVE_MIN = 4 << 30  # ... and at least this many bytes (nothing is backed until written)
_MOVE_BLOCK_BYTES = 32 << 20  # rows copied (and the old ones released) at a time by a widening


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

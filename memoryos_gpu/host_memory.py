"""The process's heap: free C memory given back to the operating system, and long-lived
Python objects taken out of the garbage collector's scans.

Why give memory back: opening a store decodes millions of rows in chunks (SQL rows, blobs,
term arrays, NumPy temporaries) and frees each chunk before the next. glibc's allocator keeps
what is freed inside its heap for reuse, but the arena's rows live in separate mappings
(``arena_memory.lazy_zeros``) that never reuse it, so the freed chunks stayed resident beside the
arena for the life of the process (and a reopened engine's predecessor's heap beside its
successor). ``malloc_trim`` returns every free page of the heap, not only its top.

Why freeze: a full collection of the cyclic garbage collector holds the interpreter lock while
it scans every object the process tracks, and a server's are mostly long-lived: its modules and
the users' state an engine loaded (288,000 objects with 10,000 users of 20 pages loaded: 63 ms
a full collection, a pause every request in flight waits for). ``gc.freeze`` moves them out of
later scans (<1 ms). Their memory is still freed when their last reference goes; only a cycle
among them is never collected, so a process freezes once, after loading what it keeps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from typing import Any

__all__ = ["freeze_long_lived", "return_free_memory"]


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None on a C library without it (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def return_free_memory() -> bool:
    """Return the C heap's free pages to the OS; False when the C library cannot."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def freeze_long_lived() -> int:
    """Collect what is garbage now, then freeze every object left (the module doc); returns how
    many objects the collector's later scans skip."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

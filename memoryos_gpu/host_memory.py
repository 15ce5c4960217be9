"""Giving the C heap's free memory back to the operating system.

Why: opening a store decodes millions of rows in chunks (SQL rows, blobs, term arrays, NumPy
temporaries) and frees each chunk before the next. glibc's allocator keeps what is freed inside
its heap for reuse, but the arena's rows live in separate mappings (``arena.lazy_zeros``) that
never reuse it, so the freed chunks stayed resident beside the arena for the life of the
process (and a reopened engine's predecessor's heap beside its successor). ``malloc_trim``
returns every free page of the heap, not only its top.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

__all__ = ["return_free_memory"]


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

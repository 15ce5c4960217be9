"""return_free_memory gives freed heap pages back that glibc's own trimming keeps."""

from __future__ import annotations

import sys

import pytest

from memoryos_gpu.host_memory import _malloc_trim, return_free_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc only"
)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_freed_heap_below_a_live_block_is_returned() -> None:
    # 200 MB of 2 KB blocks (below the mmap threshold: they come from the heap), then the
    # blocks freed except the last ones, which pin the heap's top: free() alone trims only the
    # top, so the freed pages stay resident until they are returned
    blocks = [bytes(2048) + bytes([i % 251]) for i in range(100_000)]
    pin = blocks[-1000:]
    del blocks
    before = _rss_bytes()
    assert return_free_memory() is True
    after = _rss_bytes()
    assert before - after > 100 << 20, (before, after)
    assert len(pin) == 1000

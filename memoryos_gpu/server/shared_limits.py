"""Rate limits shared by every worker of ``serve --workers``: one set of token buckets.

Why shared memory and not 1/N of the rate per worker: connections are spread over the workers
by the kernel, not by key, so a key whose client holds one connection would get only a
worker's share, and a key spread over all workers would get N bursts. Why not charge the
buckets in the engine process: that adds a round trip to every request, on the process that is
already the busiest.

The buckets live in a file that every worker maps (:class:`SharedBuckets`); a ``flock`` on it
guards each update. ``flock`` is released by the kernel when its holder dies, so a worker
killed mid-update (SIGKILL) cannot leave the others blocked. A bucket is two doubles, tokens
and the time of the last update (``time.monotonic``: one clock for the whole machine).

Slots: each API key of the key ring has its own (they are known when the server starts, every
worker numbers them alike); anything else (the client addresses that send unknown keys) is
hashed into the remaining slots, where two addresses that collide share one budget (stricter,
never looser).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import mmap
import os
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from memoryos_gpu.server.auth import KeyLimits, RateLimiter

__all__ = ["SharedBuckets", "SharedKeyLimits", "SharedRateLimiter", "create_bucket_file"]

SLOT = struct.Struct("dd")  # tokens, last update (0.0: never used = a full bucket)
HASHED_SLOTS = 4096  # per limiter, for keys not known up front
LIMITERS = ("requests", "bytes", "pages", "unknown_keys")


def region_slots(known: int) -> int:
    return known + HASHED_SLOTS


def create_bucket_file(path: str | Path, known_keys: int) -> None:
    """The zeroed file of :class:`SharedKeyLimits` (the supervisor makes it once)."""
    size = SLOT.size * region_slots(known_keys) * len(LIMITERS)
    with open(path, "wb") as f:
        f.truncate(size)


class SharedBuckets:
    """Token buckets in a shared file: ``take(slot, ...)`` under an exclusive ``flock``.

    Each process opens the file itself (a ``flock`` belongs to an open file: descriptors
    inherited from one ``open`` would not exclude each other)."""

    def __init__(self, path: str | Path) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self.fd, os.fstat(self.fd).st_size)

    def take(self, slot: int, rate: float, burst: float, cost: float) -> float:
        """0.0 when ``cost`` tokens were taken, else the seconds until they would be there."""
        off = slot * SLOT.size
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            now = time.monotonic()
            tokens, last = SLOT.unpack_from(self.map, off)
            tokens = burst if last == 0.0 else min(burst, tokens + (now - last) * rate)
            if tokens >= cost:
                SLOT.pack_into(self.map, off, tokens - cost, now)
                return 0.0
            SLOT.pack_into(self.map, off, tokens, now)
            return (cost - tokens) / rate
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class SharedRateLimiter(RateLimiter):
    """:class:`RateLimiter` (same rate, burst, answers) over a region of :class:`SharedBuckets`."""

    def __init__(
        self,
        buckets: SharedBuckets,
        region: int,
        known: dict[str, int],
        rate: float,
        burst: int,
    ) -> None:
        super().__init__(rate, burst)
        self.buckets = buckets
        self.known = known
        self.base = region * region_slots(len(known))

    def slot(self, key_id: str) -> int:
        found = self.known.get(key_id)
        if found is not None:
            return self.base + found
        h = int.from_bytes(hashlib.blake2b(key_id.encode(), digest_size=8).digest(), "little")
        return self.base + len(self.known) + h % HASHED_SLOTS

    def take(self, key_id: str, cost: float = 1.0) -> float:
        if self.rate <= 0:
            return 0.0
        if cost > self.burst:
            return math.inf
        return self.buckets.take(self.slot(key_id), self.rate, self.burst, cost)


class SharedKeyLimits(KeyLimits):
    """:class:`KeyLimits` whose buckets every worker shares: the limits hold for the server as
    a whole, whichever worker a request reaches. ``key_ids``: the key ring's fingerprints."""

    def __init__(self, settings: Any, path: str | Path, key_ids: Iterable[str]) -> None:
        super().__init__(settings)
        s = settings
        self.buckets = SharedBuckets(path)
        known = {k: i for i, k in enumerate(sorted(set(key_ids)))}

        def limiter(name: str, rate: float, burst: int) -> SharedRateLimiter:
            return SharedRateLimiter(self.buckets, LIMITERS.index(name), known, rate, burst)

        self.requests = limiter("requests", s.rate_limit_per_s, s.rate_limit_burst)
        self.bytes = limiter("bytes", s.rate_limit_bytes_per_s, s.rate_limit_bytes_burst)
        self.pages = limiter("pages", s.rate_limit_pages_per_s, s.rate_limit_pages_burst)
        self.unknown_keys = limiter("unknown_keys", s.auth_failures_per_s, s.auth_failures_burst)

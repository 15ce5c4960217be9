"""The order of a derived-work round as array sorts over the queue: the reference that
``memoryos_gpu.store.rounds.PendingQueue`` (per-user deques and tenant heaps, the queue read
once a drain) is checked against, round after round, and that the SQL window query it once
was is checked against in turn (tests/test_store_rounds.py)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from memoryos_gpu.grouping import rank_within
from memoryos_gpu.store.rounds import tenant_of


def round_order(user_ids: Sequence[str], per_user: int, limit: int) -> np.ndarray:
    """Positions (into ``user_ids``, one per pending item in queue order) of one round: the
    oldest ``per_user`` items of each user, at most ``limit``, in *waves* (every user's oldest
    item, then every user's second oldest, ...: a user's items stay in order, and a user with
    a long backlog does not push another user's one page into later rounds), within a wave
    the tenants in turn (the oldest item of every tenant, then the second oldest of each, ...;
    tenants by :func:`tenant_of`: a tenant with a thousand users pending does not push another
    tenant's one page into later rounds), ties in queue order."""
    n = len(user_ids)
    if n == 0 or limit <= 0 or per_user <= 0:
        return np.zeros(0, np.int64)
    first = _first_codes(user_ids, n)  # a code per user
    wave = rank_within(first)
    keep = np.flatnonzero(wave < per_user)
    wave = wave[keep]
    tenant = _tenant_codes(user_ids)[keep]
    # a group per (wave, tenant); within it, queue order
    turn = rank_within(wave * (int(tenant.max()) + 1) + tenant)
    order = np.lexsort((keep, turn, wave))  # wave, then turn, then queue order
    return keep[order[:limit]]


def _first_codes(keys: Iterable[Hashable], n: int) -> np.ndarray:
    """A code per distinct key of ``n``: the position of its first occurrence
    (``dict.setdefault``, mapped at C level)."""
    return np.fromiter(map({}.setdefault, keys, itertools.count()), np.int64, n)


def _tenant_codes(users: Sequence[str]) -> np.ndarray:
    """A code per distinct :func:`tenant_of`."""
    if "/" not in "".join(users):
        return np.zeros(len(users), np.int64)
    return _first_codes(map(tenant_of, users), len(users))

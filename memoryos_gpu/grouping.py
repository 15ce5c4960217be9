"""Positions within groups, for a batch at once: which wave of a round a user's item falls in,
where a page goes among the batch's pages of its segment, which ring slot a user's new
knowledge entry takes. One NumPy sort for the batch, no loop over its items."""

from __future__ import annotations

import numpy as np

__all__ = ["rank_within"]


def rank_within(groups: np.ndarray) -> np.ndarray:
    """Each item's position among the items of its group before it, in input order (0 for the
    first of its group)."""
    n = groups.size
    rank = np.zeros(n, np.int64)
    if n < 2:
        return rank
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(sorted_groups[1:], sorted_groups[:-1], out=new[1:])
    if new.all():  # every item in a group of its own: a common wave
        return rank
    starts = np.flatnonzero(new)
    rank[order] = np.arange(n) - starts[np.cumsum(new) - 1]
    return rank

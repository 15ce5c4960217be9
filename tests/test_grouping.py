"""``rank_within`` against a per-item count: the one helper that places pages in segments,
knowledge entries in rings and pending items in waves."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from memoryos_gpu.grouping import rank_within


def _counted(groups: list[int]) -> list[int]:
    seen: Counter[int] = Counter()
    out = []
    for g in groups:
        out.append(seen[g])
        seen[g] += 1
    return out


@given(st.lists(st.integers(-3, 5), max_size=60), st.sampled_from([np.int32, np.int64]))
def test_rank_within_counts_the_earlier_items_of_each_group(groups: list[int], dtype: type) -> None:
    rank = rank_within(np.asarray(groups, dtype))
    assert rank.dtype == np.int64 and rank.tolist() == _counted(groups)


def test_rank_within_of_distinct_groups_is_zero() -> None:
    assert rank_within(np.array([4, 1, 9])).tolist() == [0, 0, 0]

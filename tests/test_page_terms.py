"""PageTerms, the CSR of pages' BM25 term rows: the blob round trip a reopen relies on, and
``take`` (a derived round reads its pages' rows once and hands each wave its own)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.lexical import page_terms, terms_from_blobs, terms_to_blobs

WORDS = ["marathon", "Boston", "pottery", "the", "dog", "Luna", "2023", "paints", "sunset", "a"]
texts = st.lists(
    st.lists(st.sampled_from(WORDS), max_size=12).map(" ".join), min_size=1, max_size=12
)


def _rows(terms, n: int) -> list[tuple[list[int], list[int], int]]:
    out = []
    for i in range(n):
        ids, tf, length = terms.row(i)
        out.append((ids.tolist(), tf.tolist(), length))
    return out


@settings(max_examples=60, deadline=None)
@given(texts, st.data())
def test_take_gives_the_rows_asked_for_in_their_order(batch: list[str], data) -> None:
    terms = page_terms(batch, None)
    rows = data.draw(st.lists(st.integers(0, len(batch) - 1), max_size=2 * len(batch)))
    taken = terms.take(np.array(rows, np.int64))
    everything = _rows(terms, len(batch))
    assert _rows(taken, len(rows)) == [everything[i] for i in rows]
    assert taken.offsets[0] == 0 and taken.offsets.dtype == np.int64
    assert taken.offsets[-1] == taken.ids.size == taken.tf.size


@settings(max_examples=40, deadline=None)
@given(texts)
def test_blobs_round_trip(batch: list[str]) -> None:
    terms = page_terms(batch, None)
    back = terms_from_blobs(terms_to_blobs(terms))
    assert _rows(back, len(batch)) == _rows(terms, len(batch))

"""The extractive topic-keyword rule: which of a page's candidate words tie it to the user's
other pages on its topic.

Pages on one topic rarely share their most distinctive words, so the segment match
(cos + Jaccard >= theta) could not group them; the rule weighs each candidate's extractor score
(:meth:`~memoryos_gpu.text.keywords.KeywordExtractor.candidates`) by how many of the user's
other pages contain the word and by the user's own inverse document frequency
(:mod:`~memoryos_gpu.text.vocabulary` holds the per-user counts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["topic_keywords", "topic_weights"]


def topic_weights(scores: np.ndarray, df: np.ndarray, n_pages: np.ndarray) -> np.ndarray:
    """How well each candidate word ties its page to the user's other pages on its topic.

    ``weight = score * (df - 1) * ln(n_pages / df)``, where ``score`` is the extractor's
    ``tf * idf * boost`` (rare in general, prominent in the page), ``df`` the number of the
    user's pages that contain the word (this page included) and ``n_pages`` the user's pages.
    ``df - 1`` is how many other pages the word can match: a word said once (most names,
    numbers, typos) links nothing and gets 0, so it never dilutes a Jaccard. ``ln(n / df)`` is
    the user's own inverse document frequency: a word in every page of the user (the other
    speaker's name, a date word) links everything, says nothing about the topic and gets 0.
    There is no tuned constant; non-positive weights mean "not a keyword".
    """
    df = np.asarray(df, np.float64)
    n = np.asarray(n_pages, np.float64)
    ok = (df >= 2) & (df < n)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.asarray(scores, np.float64) * (df - 1.0) * np.log(np.where(ok, n / df, 1.0))
    return np.where(ok, w, 0.0)


def topic_keywords(
    candidates: Sequence[Sequence[str]],
    weights: np.ndarray,
    scores: np.ndarray,
    top_n: int,
) -> list[list[str]]:
    """Up to ``top_n`` words of each page by descending weight, positive weights only.

    ``candidates[i]`` are page i's candidate words in order of first occurrence, ``weights``
    their :func:`topic_weights` and ``scores`` their extractor scores, flat in the same order.
    A page none of whose words has a positive weight shares no word with the user's other
    pages; it keeps its best-scored words instead (as :meth:`KeywordExtractor.extract` ranks
    them): they cannot dilute a Jaccard it could win, and they still route a query that names
    them. Ties keep the first occurrence. One stable sort for the whole batch.
    """
    sizes = np.fromiter(map(len, candidates), np.int64, len(candidates))
    weights = np.asarray(weights, np.float64)
    scores = np.asarray(scores, np.float64)
    if weights.shape != (int(sizes.sum()),) or scores.shape != weights.shape:
        raise ValueError("one weight and one score per candidate word")
    group = np.repeat(np.arange(len(candidates)), sizes)
    shares = np.zeros(len(candidates), bool)
    shares[group[weights > 0]] = True
    rank_by = np.where(shares[group], weights, scores)
    order = np.lexsort((-rank_by, group))  # stable: first occurrence wins ties
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    rank = np.arange(order.size) - starts[group[order]]
    chosen = order[(rank < top_n) & (rank_by[order] > 0)]
    words = [w for page in candidates for w in page]
    out: list[list[str]] = [[] for _ in candidates]
    for j in chosen.tolist():
        out[group[j]].append(words[j])
    return out

"""Per-user keyword index over MTM pages, weighted by inverse document frequency (BM25).

Why: LoCoMo-style questions hinge on names, dates and rare words, where a small dense model is
weak (flat MiniLM 0.59 vs BM25 0.65 evidence recall at 10 pages). O-Mem indexes salient keywords
by IDF; we keep a BM25 inverted index per user (IDF over that user's own pages) and fuse its
scores with the kernels' cosines (:func:`zscore_fusion`: a weighted sum of each list's
standardised scores; :func:`reciprocal_rank_fusion` is the rank-only alternative). A page's text
is indexed with its date written out ("8 May 2023"), so temporal questions can match it lexically.

Why scores and not ranks: with a few hundred pages per user, both rankings hold nearly every
page, and reciprocal rank (k = 60) then favours pages that are mediocre in both lists over a page
one list is sure of; standardised scores keep how far a page stands above the rest of its list.
On LoCoMo (dev split, 760 questions) equal weights recall 0.663 / 0.730 / 0.791 of the evidence
at 5 / 10 / 20 pages against 0.628 / 0.701 / 0.743 for reciprocal rank at weight 5; choosing the
weight on four conversations and scoring the fifth (all five folds) gives 0.658 / 0.730 / 0.790
(benchmarks/README.md).

The index is a cache: built lazily per user from the store on first search, then kept current
as pages enter or leave MTM. ``MemoryConfig.lexical_weight = 0`` switches it off entirely.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime

import numpy as np

from memoryos_gpu.text.keywords import tokenize


def date_words(timestamp: float | None) -> str:
    """``1683561360.0`` -> ``"Monday 8 May 2023"`` (UTC): the words a question would use."""
    if timestamp is None:
        return ""
    try:
        dt = datetime.fromtimestamp(float(timestamp), tz=UTC)
    except (OverflowError, OSError, ValueError):
        return ""
    return f"{dt:%A} {dt.day} {dt:%B %Y}"


class _UserIndex:
    __slots__ = ("doc_len", "postings", "total_len")

    def __init__(self) -> None:
        self.postings: dict[str, dict[int, int]] = defaultdict(dict)
        self.doc_len: dict[int, int] = {}
        self.total_len = 0

    def add(self, page_id: int, tokens: list[str]) -> None:
        if page_id in self.doc_len:
            self.remove(page_id)
        for tok, tf in Counter(tokens).items():
            self.postings[tok][page_id] = tf
        self.doc_len[page_id] = len(tokens)
        self.total_len += len(tokens)

    def remove(self, page_id: int) -> None:
        n = self.doc_len.pop(page_id, None)
        if n is None:
            return
        self.total_len -= n
        for tok in [t for t, docs in self.postings.items() if page_id in docs]:
            del self.postings[tok][page_id]
            if not self.postings[tok]:
                del self.postings[tok]

    def search(self, tokens: list[str], k: int, k1: float, b: float) -> list[tuple[int, float]]:
        n_docs = len(self.doc_len)
        if not n_docs or not tokens:
            return []
        avg = self.total_len / n_docs or 1.0
        scores: dict[int, float] = defaultdict(float)
        for tok in set(tokens):
            docs = self.postings.get(tok)
            if not docs:
                continue
            idf = math.log(1.0 + (n_docs - len(docs) + 0.5) / (len(docs) + 0.5))
            for pid, tf in docs.items():
                norm = tf + k1 * (1 - b + b * self.doc_len[pid] / avg)
                scores[pid] += idf * tf * (k1 + 1) / norm
        ranked = sorted(scores.items(), key=lambda t: (-t[1], t[0]))
        return ranked[:k]


class LexicalIndex:
    """BM25 inverted indexes, one per user, loaded lazily through ``loader(user_id)``.

    ``loader`` returns ``(page_id, text, timestamp)`` rows of the user's MTM pages.
    """

    def __init__(
        self,
        loader: Callable[[str], Iterable[tuple[int, str, float | None]]],
        k1: float = 1.2,
        b: float = 0.75,
    ) -> None:
        self._loader = loader
        self._users: dict[str, _UserIndex] = {}
        self.k1, self.b = k1, b

    @staticmethod
    def tokens(text: str, timestamp: float | None = None) -> list[str]:
        return tokenize(f"{text} {date_words(timestamp)}")

    def _index(self, user_id: str) -> _UserIndex:
        idx = self._users.get(user_id)
        if idx is None:
            idx = _UserIndex()
            for page_id, text, ts in self._loader(user_id):
                idx.add(page_id, self.tokens(text, ts))
            self._users[user_id] = idx
        return idx

    def add(self, user_id: str, page_id: int, text: str, timestamp: float | None) -> None:
        """Index a page entering MTM (a no-op until the user's index is first loaded)."""
        idx = self._users.get(user_id)
        if idx is not None:
            idx.add(page_id, self.tokens(text, timestamp))

    def remove(self, user_id: str, page_ids: Iterable[int]) -> None:
        idx = self._users.get(user_id)
        if idx is not None:
            for pid in page_ids:
                idx.remove(int(pid))

    def drop_user(self, user_id: str) -> None:
        self._users.pop(user_id, None)

    def search(self, user_id: str, query: str, k: int) -> list[tuple[int, float]]:
        """Top-``k`` (page id, BM25 score) of the user's MTM pages for ``query``."""
        return self._index(user_id).search(tokenize(query), k, self.k1, self.b)


def reciprocal_rank_fusion(
    rankings: Iterable[tuple[list[int], float]], k: int = 60
) -> list[tuple[int, float]]:
    """Fuse ranked id lists, each with a weight: ``sum(w / (k + rank))``; ties -> lower id."""
    scores: dict[int, float] = defaultdict(float)
    for ids, weight in rankings:
        if weight <= 0:
            continue
        for rank, pid in enumerate(ids, start=1):
            scores[pid] += weight / (k + rank)
    return sorted(scores.items(), key=lambda t: (-t[1], t[0]))


def zscore_fusion(
    rankings: Iterable[tuple[Sequence[tuple[int, float]], float]],
) -> list[tuple[int, float]]:
    """Fuse scored candidate lists, each with a weight, by a weighted sum of standardised scores.

    Each list is ``(id, score)`` pairs on a scale of its own (a cosine, a BM25 score). Within a
    list a score becomes ``(score - lowest) / std`` over the candidates the list returned
    (a z-score shifted so that the list's last candidate scores 0); a page the list did not
    return also scores 0 there (it ranked at or below the last candidate). The fused score is
    ``sum(weight * that)``; best first, ties -> lower id. Standardising makes the result
    invariant to any positive affine change of one list's scores, and leaves one free choice,
    the relative weight. A list with weight <= 0 or no candidates is left out; a list whose
    scores are all equal (one candidate, say) orders nothing, so its pages score 1, one unit
    above the pages it lacks.
    """
    fused: dict[int, float] = defaultdict(float)
    for pairs, weight in rankings:
        if weight <= 0 or not pairs:
            continue
        ids = [int(p) for p, _ in pairs]
        scores = np.fromiter((s for _, s in pairs), np.float64, len(pairs))
        std = float(scores.std())
        if std > 0 and np.isfinite(std):
            norm = (scores - scores.min()) / std
        else:
            norm = np.ones_like(scores)
        for pid, z in zip(ids, norm.tolist(), strict=True):
            fused[pid] += weight * z
    return sorted(fused.items(), key=lambda t: (-t[1], t[0]))

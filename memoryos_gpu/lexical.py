"""Words of pages and queries as hashed terms, for the BM25 half of retrieval.

Why a lexical signal at all: LoCoMo-style questions hinge on names, dates and rare words, where a
small dense model is weak (flat MiniLM 0.59 vs BM25 0.65 evidence recall at 10 pages). O-Mem
indexes salient keywords by IDF; here every MTM page carries a BM25 term row in the arena
(:mod:`memoryos_gpu.arena_lexical`), each user's document frequencies come from their own pages,
and the fused retrieval kernel (:mod:`memoryos_gpu.ops.retrieval`) scores and fuses it with the
cosines. A page is indexed with its date written out ("monday 8 may 2023"), so temporal
questions can match it lexically.

This module turns texts into terms for whole batches in one native call
(``csrc/host/terms.cpp``): Python normalises the joined batch once (NFKC, case folding), the
native splitter finds the words, drops stopwords and hashes them with the ids of
:func:`memoryos_gpu.text.keywords.hash_keyword`, so a query term, a page term and a segment
keyword that are the same word have the same id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache, lru_cache

import numpy as np

from memoryos_gpu.ops.retrieval import MAX_QUERY_TERMS, QueryTerms
from memoryos_gpu.text.date_names import language_dates
from memoryos_gpu.text.keywords import STOPWORDS
from memoryos_gpu.text.stopword_lists import language_stopwords
from memoryos_gpu.text.words import normalise


def date_words(timestamp: float | None) -> str:
    """``1683561360.0`` -> ``"Monday 8 May 2023"`` (UTC): the words a question would use."""
    if timestamp is None:
        return ""
    frac, whole = math.modf(float(timestamp))
    if not math.isfinite(whole):
        return ""
    us = round(frac * 1e6)  # the instant as datetime reads it: whole microseconds, half-even
    return _day_words((int(whole) + (us >= 1_000_000) - (us < 0)) // 86_400)


@lru_cache(maxsize=4096)
def _day_words(day: int) -> str:
    """The date words of UTC day ``day`` (days since the epoch). Cached by day: a UTC day is
    86,400 POSIX seconds, and the pages of a batch share a few days, so formatting a datetime
    per page was most of this function's cost on the ingestion path."""
    try:
        dt = datetime.fromtimestamp(day * 86_400.0, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return ""
    return f"{dt:%A} {dt.day} {dt:%B %Y}"


@dataclass(frozen=True)
class PageTerms:
    """Term rows of a batch of pages (CSR): page i has the ascending ids
    ``ids[offsets[i]:offsets[i+1]]`` with counts ``tf`` and ``length[i]`` tokens."""

    offsets: np.ndarray  # int64 [n + 1]
    ids: np.ndarray  # int32
    tf: np.ndarray  # int32
    length: np.ndarray  # int32 [n]

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(offsets, ids, tf, length)``, as ``Arena.write_terms`` takes them: the arrays
        themselves (``dataclasses.astuple`` deep-copies each one, on every derived wave)."""
        return self.offsets, self.ids, self.tf, self.length

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.tf[a:b], int(self.length[i])

    def take(self, rows: np.ndarray) -> PageTerms:
        """The term rows of pages ``rows``, in that order (a derived round reads its pages'
        rows once and hands each wave its own)."""
        rows = np.asarray(rows, np.int64)
        starts = self.offsets[rows]
        counts = self.offsets[rows + 1] - starts
        offsets = np.zeros(rows.size + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        at = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1])
        return PageTerms(offsets, self.ids[at], self.tf[at], self.length[rows])


@cache
def _splitter() -> object:
    from memoryos_gpu import _C

    return _C.TermSplitter(
        sorted(STOPWORDS),
        [sorted(words) for words in language_stopwords().values()],
        language_dates(),
    )


def _normalised(texts: Sequence[str]) -> str:
    """The batch joined by U+0000, each text normalised
    (:func:`~memoryos_gpu.text.words.normalise`: one C call for an ASCII batch, where it
    reduces to ``lower``; U+0000 is inert to it).
    Texts must not contain U+0000 (engine-cleaned text never does: control characters are
    dropped on the way in)."""
    joined = "\x00".join(texts)
    if joined.isascii():
        return joined.lower()
    return "\x00".join(map(normalise, texts))  # an ASCII text without a normalisation pass


def page_terms(texts: Sequence[str], timestamps: Sequence[float] | np.ndarray | None) -> PageTerms:
    """BM25 term rows of pages; ``timestamps`` adds each page's UTC date words."""
    ts = None if timestamps is None else np.asarray(timestamps, np.float64)
    offsets, ids, tf, length = _splitter().split(_normalised(texts), len(texts), ts)
    return PageTerms(offsets, ids, tf, length)


def query_terms(texts: Sequence[str]) -> QueryTerms:
    """Each query's distinct terms in order of first occurrence, at most ``MAX_QUERY_TERMS``."""
    offsets, ids, _tf, _len = _splitter().split(
        _normalised(texts), len(texts), None, MAX_QUERY_TERMS, False
    )
    return QueryTerms(offsets, ids)


_EMPTY_ROW = np.zeros(1, "<i4").tobytes()  # length 0, no terms


def terms_to_blobs(terms: PageTerms) -> list[bytes]:
    """One little-endian int32 blob per page, ``[length, ids..., tf...]`` (what the store keeps
    beside the page, so a reopen loads the lexical index instead of re-reading every text)."""
    n = terms.length.size
    counts = np.diff(terms.offsets)
    sizes = 1 + 2 * counts
    starts = (np.cumsum(sizes) - sizes).astype(np.int64)
    flat = np.empty(int(sizes.sum()), "<i4")
    flat[starts] = terms.length
    rank = np.arange(terms.ids.size) - np.repeat(terms.offsets[:-1], counts)
    row_start = np.repeat(starts, counts)
    flat[row_start + 1 + rank] = terms.ids
    flat[row_start + 1 + np.repeat(counts, counts) + rank] = terms.tf
    raw = flat.tobytes()
    bounds = (np.concatenate([starts, [flat.size]]) * 4).tolist()
    return [raw[bounds[i] : bounds[i + 1]] for i in range(n)]


def terms_from_blobs(blobs: Sequence[bytes | None]) -> PageTerms:
    """Inverse of :func:`terms_to_blobs` (vectorised over the whole chunk); None (a page
    stored without a row) reads as an empty row."""
    blobs = [_EMPTY_ROW if b is None else b for b in blobs]
    sizes = np.fromiter(map(len, blobs), np.int64, len(blobs)) // 4
    if (sizes < 1).any() or ((sizes - 1) % 2).any():
        raise ValueError("a term blob is not [length, ids..., tf...]")
    flat = np.frombuffer(b"".join(blobs), "<i4")
    starts = (np.cumsum(sizes) - sizes).astype(np.int64)
    counts = (sizes - 1) // 2
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rank = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], counts)
    row_start = np.repeat(starts, counts)
    ids = flat[row_start + 1 + rank].astype(np.int32)
    tf = flat[row_start + 1 + np.repeat(counts, counts) + rank].astype(np.int32)
    return PageTerms(offsets, ids, tf, flat[starts].astype(np.int32))

"""The keyword extractor's rules in plain Python, one word at a time with ``re`` and ``str``:
the reference the native scanner (``csrc/host/keywords.cpp``) is checked against; and the words
the native term splitter (``csrc/host/terms.cpp``) keeps of a text (:func:`term_words`)."""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter

from memoryos_gpu.text.keywords import (
    _AMBIGUOUS_DATE,
    _MONTHS,
    _WEEKDAYS,
    STOPWORDS,
    _fold_plural,
    _norm_tokens,
    _strip_apostrophes,
    language_of,
    tokenize,
)
from memoryos_gpu.text.stopword_lists import language_stopwords
from memoryos_gpu.text.words import ELIDED, ELISION_NEXT, casefold, word_spans

SENT_END_RE = re.compile(r"[.!?]+[\"')\]]*\s+|\n+")


def term_words(text: str) -> list[str]:
    """The words of ``text`` a BM25 row or a question's terms hold, in order (duplicates kept):
    its words less the English stopwords and, when it is written in another language, that
    language's (``keywords.language_of``, the splitter's rule)."""
    foreign = language_of(_norm_tokens(text))
    return [w for w in tokenize(text) if w not in foreign]


def raw_tokens(text: str) -> list[tuple[str, str, bool]]:
    """(normalised token, surface form, sentence_initial) for every word of ``text``. A U+0000
    in a text is read as a space, as the extractor documents (the native scanner's batches
    join their texts with it): "May...\x00À" starts a sentence at "À"."""
    text = unicodedata.normalize("NFKC", (text or "").replace("\x00", " "))
    out: list[tuple[str, str, bool]] = []
    last_end = 0
    elided_initial = False  # the word before was a sentence-initial elided article
    for start, end in word_spans(text):  # the pairs of an unspaced run overlap: no gap
        gap = text[last_end:start]
        sentence_initial = last_end == 0 or bool(SENT_END_RE.search(gap)) or elided_initial
        surface = text[start:end]
        elided_initial = (
            sentence_initial
            and text[end : end + 1] in ("'", "\u2019")
            and surface.isascii()
            and surface.lower() in ELIDED
            and text[end + 1 : end + 2] in ELISION_NEXT
        )
        last_end = end
        norm = _strip_apostrophes(casefold(text[start:end]))
        if norm:
            out.append((norm, text[start:end], sentence_initial))
    return out


def _is_acronym(surface: str) -> bool:
    letters = [c for c in surface if c.isalpha()]
    return len(letters) >= 2 and all(c.isupper() for c in letters)


def scores(
    text: str,
    df: Counter[str],
    n_docs: int,
    *,
    min_len: int = 2,
    fold_plurals: bool = False,
    proper_noun_boost: float = 2.0,
    number_boost: float = 1.5,
) -> dict[str, float]:
    """``tf * idf * boost`` of every candidate word, in order of first occurrence."""
    tf: Counter[str] = Counter()
    proper: set[str] = set()
    capital_initial: set[str] = set()
    languages = list(language_stopwords().values())
    hits = [0] * len(languages)  # the text's words in each language's list
    own_hits = 0  # ... and in the English list
    lists: dict[str, set[int]] = {}  # the language lists each candidate's words are in
    for norm, surface, initial in raw_tokens(text):
        found = {b for b, words in enumerate(languages) if norm in words}
        for b in found:
            hits[b] += 1
        if norm in STOPWORDS:
            own_hits += 1
            continue
        if len(norm) < min_len and not norm.isdigit():
            continue
        tok = _fold_plural(norm) if fold_plurals else norm
        lists.setdefault(tok, set()).update(found)
        tf[tok] += 1
        if _is_acronym(surface) or (surface[:1].isupper() and not initial):
            proper.add(tok)
        elif surface[:1].isupper():
            capital_initial.add(tok)
    # the text's language: the list with the most of its words (the first of equals), if it
    # holds at least two and more than the English list
    best = max(range(len(hits)), key=lambda b: (hits[b], -b), default=None)
    language = best if best is not None and hits[best] >= 2 and hits[best] > own_hits else None
    out = {}
    for tok, count in tf.items():
        if language in lists[tok]:
            continue
        boost = proper_noun_boost if tok in proper else 1.0
        dated = any(ch.isdigit() for ch in tok) or tok in _WEEKDAYS or tok in _MONTHS
        if dated and (tok not in _AMBIGUOUS_DATE or tok in proper or tok in capital_initial):
            boost *= number_boost
        idf = math.log((1.0 + n_docs) / (1.0 + df.get(tok, 0))) + 1.0
        out[tok] = count * idf * boost
    return out

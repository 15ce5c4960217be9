"""Stopword lists of languages other than English, for the keyword scanner's per-page rule.

A page's keywords leave out its language's function words. English has the extractor's own
list (``keywords.STOPWORDS``); a page written in one of :data:`LANGUAGES` also loses that
language's list, the language being the list that holds the most of the page's words (at
least two, and more than the English list holds: ``csrc/include/memoryos/keywords.h``). Why
per page rather than one list for every language: the lists share many words with English
(``die``, ``come``, ``son``, ``more``), which must stay keywords of an English page. Without
this, German and French function words (``und``, ``der``, ``le``, ``la``) became keywords
and linked unrelated pages (keyword overlap 0.11-0.14 between unrelated topics).

The lists come from the ``stop-words`` package (BSD-3; 30+ languages, kept up to date)
rather than lists of our own. An entry is normalised as every word is (NFKC,
:func:`~memoryos_gpu.text.words.casefold`, apostrophes dropped); one that is not a single
word (a phrase, a hyphenated pair) is left out, since the scanner tests one word at a time.
Chinese and Japanese are not here: their text is indexed as letter pairs, which no list
names.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

#: The languages whose stopwords a page of theirs loses (ISO 639-1, as ``stop-words`` names
#: them), in the order of the scanner's bits: a tie between two lists goes to the earlier.
LANGUAGES: tuple[str, ...] = (
    "es", "fr", "de", "pt", "it", "ru", "nl", "pl", "tr", "id", "sv", "da", "nb", "fi", "cs",
    "sk", "ro", "hu", "uk", "bg", "el", "ca", "ms", "vi", "ko", "ar", "fa", "he", "hi", "gu",
)  # fmt: skip


#: Entries of the package's lists that are not words of their language, left out: Romanian's
#: list holds the Latin alphabet (its words are ``a``, ``i``, ``o``, ``s``), Persian's the
#: alphabet and the digits (its word is ``و``), Gujarati's a Latin ``s``. With them, an English
#: text's single letters voted Romanian (``Vitamin B and C``: ``b``, ``c``, two hits to
#: English's one) and lost ``b`` and ``c`` from its keywords and BM25 terms.
NOT_WORDS: dict[str, frozenset[str]] = {
    "ro": frozenset("bcdfhjklmnprtuv"),
    "fa": frozenset("ابتثجحخدذرزسشصضطظعغفقلمنهپچژکگی۰۱۲۳۴۵۶۷۸۹"),
    "gu": frozenset("s"),
}


def normalised_words(entries: Iterable[str]) -> frozenset[str]:
    """The entries that are one word, normalised as every word is (``keywords._norm_tokens``:
    the tokenizer of the BM25 index and of LLM keyword phrases)."""
    from memoryos_gpu.text.keywords import _norm_tokens  # it imports this module

    return frozenset(w[0] for w in map(_norm_tokens, entries) if len(w) == 1)


@functools.cache
def language_stopwords() -> dict[str, frozenset[str]]:
    """Each of :data:`LANGUAGES`' stopwords, normalised, less :data:`NOT_WORDS` (loaded
    once)."""
    from stop_words import get_stop_words

    return {
        lang: normalised_words(get_stop_words(lang)) - NOT_WORDS.get(lang, frozenset())
        for lang in LANGUAGES
    }

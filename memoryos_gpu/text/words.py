"""Where the words of a text are, and how a word is folded: the one rule of the keyword
extractor, the BM25 index and the hashing embedder (``csrc/host/terms.cpp`` and
``csrc/host/keywords.cpp`` split the same way natively; ``tests/test_keyword_scanner.py`` and
``tests/test_word_splitting.py`` hold them to it).

* A word is a letter or digit, then letters, digits and combining marks, with inner
  apostrophes (``don't``, ``O'Neil``). A mark continues its word: a vowel sign or a virama is
  part of ``हिन्दी``, and ``मैराथन`` stays one word instead of three fragments that match
  unrelated pages.
* Scripts written without spaces between words (Chinese, Japanese kana, Thai, Lao, Khmer,
  Myanmar: ``UNSPACED_RANGES``) have no words to find without a dictionary. A run of their
  letters (each with its marks) gives its overlapping pairs, ``马拉松`` -> ``马拉``, ``拉松``, or
  the letter alone when the run is one letter: the dictionary-free segmentation of Lucene's
  CJK analyzer, under which a query's word matches every page that contains it (a whole
  clause was one token before, so a question never matched a page). A Latin word inside such
  text is a word of its own (``我在Google工作``: ``我在``, ``google``, ``工作``).
* Elision: an article or pronoun of French, Italian or Catalan that drops its vowel before a
  word beginning with a vowel or ``h`` (``l'été``, ``qu'il``, ``dell'anno``) is a word of its
  own, and so is the word after it: ``l'été`` matches ``été``. The elided forms are
  :data:`ELIDED`, the letters they drop before :data:`ELISION_NEXT`; an English word with an
  inner apostrophe (``don't``, ``O'Neil``, ``I'm``, ``c'mon``) stays one word.
* Anything else separates.

Folding (:func:`casefold`) is ``str.casefold`` with two fixes for words that are written two
ways: the Turkish ``İ`` folds to ``i`` and a combining dot above, and the dot is dropped, so
``İstanbul`` is ``istanbul`` as typed on any keyboard; and the optional vowel marks of Arabic
(harakat) and Hebrew (niqqud) are dropped, so ``القَاهِرَة`` is ``القاهرة`` as most text writes it.
"""

from __future__ import annotations

import re
import unicodedata

from memoryos_gpu.text.unicode_ranges import MARK_RANGES, UNSPACED_RANGES, class_body

__all__ = ["ELIDED", "ELISION_NEXT", "casefold", "normalise", "word_spans", "words"]

#: The elided articles and pronouns (French, Italian, Catalan), lower case ASCII: before an
#: apostrophe and a letter of :data:`ELISION_NEXT`, a word of their own.
ELIDED: frozenset[str] = frozenset(
    {
        *("c", "d", "j", "l", "m", "n", "s", "t", "v"),
        *("qu", "jusqu", "lorsqu", "puisqu", "quoiqu", "presqu", "quelqu"),
        *("dell", "all", "nell", "sull", "dall", "coll", "quell", "quest", "un", "bell", "sant"),
    }
)
#: The letters (either case) a word begins with when the article before it is elided.
ELISION_NEXT: frozenset[str] = frozenset(
    "aeiouyhàâäáãåæéèêëíìîïóòôöõœúùûüýÿAEIOUYHÀÂÄÁÃÅÆÉÈÊËÍÌÎÏÓÒÔÖÕŒÚÙÛÜÝŸ"
)


_MARK = class_body(MARK_RANGES)
_UNSPACED = class_body(UNSPACED_RANGES)
_START = rf"[^\W_{_UNSPACED}]"  # a letter or digit of a spaced script
_WORD = rf"{_START}(?:{_START}|[{_MARK}])*"
# An elided article or pronoun, tried first at a word's start: a word of its own when an
# apostrophe and a letter of ELISION_NEXT follow (the word after is then the next match)
_HEAD = "|".join(
    "".join(f"[{c}{c.upper()}]" for c in w) for w in sorted(ELIDED, key=len, reverse=True)
)
_NEXT = "".join(sorted(ELISION_NEXT))
_LONGEST = max(map(len, ELIDED))  # the cheap test first: letters, then an apostrophe
_ELIDED_RE = rf"(?=[a-zA-Z]{{1,{_LONGEST}}}['\u2019])(?:{_HEAD})(?=['\u2019][{_NEXT}])"
_TOKEN_RE = re.compile(
    rf"(?P<run>(?:[{_UNSPACED}][{_MARK}]*)+)|{_ELIDED_RE}|{_WORD}(?:['\u2019]{_WORD})*"
)
_UNIT_RE = re.compile(rf"[{_UNSPACED}][{_MARK}]*")
# ASCII text has no marks and no unspaced letters: the same words, found by a simpler pattern
_ASCII_WORD_RE = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
_ASCII_ELIDED_RE = re.compile(rf"{_ELIDED_RE}|{_ASCII_WORD_RE.pattern}")
_DOTTED_I = re.compile("i\u0307+")
# Arabic harakat and Hebrew niqqud (the marks of these blocks): most text leaves them out
_OPTIONAL_BLOCKS = ((0x591, 0x5C8), (0x610, 0x61B), (0x64B, 0x660), (0x670, 0x671), (0x6D6, 0x6EE))
_OPTIONAL_MARKS = re.compile(
    "["
    + "".join(
        chr(c)
        for lo, hi in _OPTIONAL_BLOCKS
        for c in range(lo, hi)
        if any(a <= c < b for a, b in MARK_RANGES)
    )
    + "]"
)


def _ascii_words(text: str) -> re.Pattern[str]:
    """The pattern of an ASCII text's words: without an apostrophe, nothing is elided."""
    return _ASCII_ELIDED_RE if "'" in text else _ASCII_WORD_RE


def word_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each word of ``text`` in order (a run's pairs overlap)."""
    if text.isascii():
        return [m.span() for m in _ascii_words(text).finditer(text)]
    out: list[tuple[int, int]] = []
    for m in _TOKEN_RE.finditer(text):
        if m.lastgroup != "run":
            out.append(m.span())
            continue
        starts = [u.start() for u in _UNIT_RE.finditer(text, m.start(), m.end())]
        if len(starts) == 1:
            out.append(m.span())
            continue
        starts.append(m.end())
        out.extend(zip(starts, starts[2:], strict=False))
    return out


def words(text: str) -> list[str]:
    """The words of ``text`` in order (:func:`word_spans`, as strings)."""
    if text.isascii():
        return _ascii_words(text).findall(text)
    return [text[a:b] for a, b in word_spans(text)]


def casefold(text: str) -> str:
    """``text.casefold()``, a dotted capital I folded to a plain ``i`` and the optional vowel
    marks of Arabic and Hebrew dropped (see the module doc): how the keyword scanner folds
    each word of an NFKC-normalised text."""
    folded = text.casefold()
    if folded.isascii():
        return folded
    return _DOTTED_I.sub("i", _OPTIONAL_MARKS.sub("", folded))


def normalise(text: str) -> str:
    """A text as the BM25 index, the hashing embedder and keyword ids read it: NFKC, folded
    (:func:`casefold`), and NFKC again. Why again: now that marks stay in words, folding can
    leave a letter and a mark that compose (``ß`` + acute folds to ``s`` ``s`` + acute), and
    a word's id must not depend on whether its text was normalised once or twice."""
    if text.isascii():
        return text.lower()
    return unicodedata.normalize("NFKC", casefold(unicodedata.normalize("NFKC", text)))

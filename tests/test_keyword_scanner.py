"""The native keyword scanner against the plain-Python rules (tests/keyword_reference.py) on
random texts: words, apostrophes, sentence ends, capitals, digits, and the code points whose
case folding or character class is unusual (folds to several code points, changes class)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from keyword_reference import raw_tokens, scores

from memoryos_gpu.text.keywords import KeywordExtractor, _norm_tokens, hash_keyword
from memoryos_gpu.text.unicode_ranges import UNSPACED_RANGES
from memoryos_gpu.text.words import casefold

# pieces that reach every rule: sentence ends with closers, apostrophes (inner, trailing,
# possessive, U+2019), acronyms, capitalised words, ambiguous dates, digits of other scripts,
# code points whose casefold expands (ß, İ, ǰ, ﬁ before NFKC) or changes class (U+0345)
PIECES = [
    "May",
    "may",
    "Sun",
    "MAY",
    "NASA",
    "Caroline's",
    "don't",
    "O\u2019Neil",
    "dogs'",
    "Straße",
    "İstanbul",
    "ǰ",
    "ﬁne",
    "ΣΊΣΥΦΟΣ",
    "\u0345",
    "²",
    "٣٤",
    "7pm",
    "2023",
    "a",
    "I",
    "x",
    "New-York",
    "snake_case",
    "cats",
    "stories",
    "boxes",
    "glasses",
    ". ",
    "! ",
    "?) ",
    '." ',
    "...",
    ".x",
    "\n",
    "\t",
    " ",
    ", ",
    "\u00a0",
    "\u2028",
    "'",
    "\u2019",
    "_",
    "é",
    "e\u0301",
    "Ⅻ",
    "ǅ",
    "ſt",
    "K",
    "K",
    # scripts without spaces (pairs of letters), marks that continue a word, folded marks
    "马拉松",
    "我在Google工作。",
    "日本語のテキスト",
    "ฉันอยู่",
    "मैराथन",
    "हिन्दी",
    "القَاهِرَة",
    "שָׁלוֹם",
    "i\u0307",
    "\u0301x",
    "ｶﾀｶﾅ",
    # stopwords of other languages, some also English words or English stopwords: a text's
    # language is the list holding the most of its words (and more than English's)
    " und ",
    " der ",
    " die ",
    " Die ",
    " le ",
    " la ",
    " je ",
    " l'",
    " de ",
    " que ",
    " y ",
    " in ",
    " was ",
    " come ",
    " son ",
    " the ",
    " and ",
    " я ",
    " и ",
    " не ",
    # elision: an elided article or pronoun before a vowel or h is a word of its own
    "L'",
    "l'",
    "qu'",
    "Qu\u2019",
    "dell'",
    "un'",
    "d'",
    "été",
    "École",
    "hôpital",
    "Italie",
    "amico",
]
text_st = st.lists(st.sampled_from(PIECES) | st.text(max_size=4), max_size=30).map("".join)


def _native_scores(ex: KeywordExtractor, text: str) -> dict[str, float]:
    return ex.scores(text)


@settings(max_examples=400, deadline=None)
@given(st.lists(text_st, min_size=1, max_size=4), st.booleans(), st.integers(0, 3))
@example(["May...\x00À"], False, 0)  # a U+0000 in a text reads as a space (found by hypothesis)
def test_native_candidates_equal_the_python_rules(texts, fold, min_len) -> None:
    df = Counter({"may": 3, "nasa": 1, "caroline": 2})
    ex = KeywordExtractor(fold_plurals=fold, min_len=min_len)
    ex.df, ex.n_docs = Counter(df), 5
    batch = ex.candidates(texts)
    for i, text in enumerate(texts):
        a, b = batch.offsets[i], batch.offsets[i + 1]
        want = scores(text, df, 5, min_len=min_len, fold_plurals=fold)
        assert batch.words[a:b] == list(want)  # same words, same first-occurrence order
        np.testing.assert_allclose(batch.scores[a:b], list(want.values()), rtol=1e-12)
        assert batch.ids[a:b].tolist() == [hash_keyword(w) for w in want]


@settings(max_examples=200, deadline=None)
@given(text_st)
def test_update_counts_each_documents_distinct_candidates(text: str) -> None:
    ex = KeywordExtractor().update([text, text])
    want = scores(text, Counter(), 0)
    assert ex.n_docs == 2 and dict(ex.df) == {w: 2 for w in want}
    ex.remove([text])
    assert ex.n_docs == 1 and dict(ex.df) == {w: 1 for w in want}
    ex.remove([text])
    assert ex.n_docs == 0 and not ex.df


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=80))
def test_arbitrary_unicode_text(text: str) -> None:
    """Any text: the scanner never fails and agrees with the reference."""
    ex = KeywordExtractor()
    assert list(ex.scores(text)) == list(scores(text, Counter(), 0))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 400), st.integers(1, 5), st.randoms(use_true_random=False))
def test_documents_of_many_distinct_words(n_words, repeats, rnd) -> None:
    """Hundreds of distinct words in one document, each said several times, then a short
    one: the per-document word index grows and is reset between documents, counting every
    word (tf) and keeping first-occurrence order, as the reference does."""
    words = [f"w{i}x{rnd.randrange(10**6)}" for i in range(n_words)]
    said = words * repeats
    rnd.shuffle(said)
    texts = [" ".join(said), " ".join(words[:3]), " ".join(said)]
    df = Counter({w: 1 for w in words[::7]})
    ex = KeywordExtractor()
    ex.df, ex.n_docs = Counter(df), 9
    batch = ex.candidates(texts)
    for i, text in enumerate(texts):
        a, b = batch.offsets[i], batch.offsets[i + 1]
        want = scores(text, df, 9)
        assert batch.words[a:b] == list(want)
        np.testing.assert_allclose(batch.scores[a:b], list(want.values()), rtol=1e-12)


def test_tokenize_fast_path_equals_the_reference_on_plain_text() -> None:
    text = "Caroline's dog don't O\u2019Neil Straße. NASA\nmay 7pm"
    assert _norm_tokens(text) == [n for n, _, _ in raw_tokens(text)]


def test_sentence_starts_and_separators() -> None:
    ex = KeywordExtractor()
    sc = ex.scores('Paris is big. "Paris" again!) Paris\nParis, said Paris')
    # capitalised after ", " (not a sentence end) -> proper; the rest start sentences
    assert sc["paris"] == pytest.approx(5 * 2.0)
    assert ex.candidates(["a\x00b", "c"]).offsets.tolist() == [0, 0, 0]  # U+0000 -> a space
    assert ex.candidates([]).offsets.tolist() == [0]


def test_extract_many_is_extract_per_text() -> None:
    ex = KeywordExtractor().update(["the cat sat", "a dog ran", "cats and dogs"])
    texts = ["Max the dog ran to Boston on 7 May", "", "cat cat dog", "Sun sun SUN"]
    assert ex.extract_many(texts, top_n=3) == [ex.extract(t, top_n=3) for t in texts]
    for t in texts:
        sc = scores(t, ex.df, ex.n_docs)
        first = {w: i for i, w in enumerate(sc)}
        assert ex.extract(t, top_n=3) == sorted(sc, key=lambda w: (-sc[w], first[w]))[:3]
    assert ex.extract_many(texts, top_n=0) == [[], [], [], []]


def _table_version() -> str:
    from pathlib import Path

    inc = Path(__file__).resolve().parents[1] / "csrc/include/memoryos/unicode_tables.inc"
    return inc.read_text().split('MOS_UNICODE_VERSION "')[1].split('"')[0]


def _every_char(test) -> list[str]:
    return [chr(c) for c in range(1, 0x110000) if not 0xD800 <= c < 0xE000 and test(chr(c))]


def _mark(c: str) -> bool:
    import unicodedata

    return unicodedata.category(c).startswith("M")


def _unspaced(c: str) -> bool:
    return any(a <= ord(c) < b for a, b in UNSPACED_RANGES)


def test_case_folding_and_classes_are_this_pythons_for_every_code_point() -> None:
    """The generated tables (scripts/gen_unicode_table.py) against this Python's str methods,
    code point by code point: the folded word, the digit test (a date word), the upper-case
    test (capitalised, not at a sentence start: proper) and the whitespace test (a sentence
    end needs it after the full stop)."""
    import unicodedata

    if _table_version() != unicodedata.unidata_version:
        pytest.skip(f"tables are Unicode {_table_version()}, Python {unicodedata.unidata_version}")
    ex = KeywordExtractor(stopwords=())
    stable = _every_char(lambda c: unicodedata.normalize("NFKC", c) == c)
    alnum = [c for c in stable if c.isalnum() and not _unspaced(c)]
    # "q<c>q" is one word: its normalised form is the casefold, a date word iff a digit
    _, _, _, flags, words = ex._scan([f"q{c}q" for c in alnum])
    assert words == [casefold(f"q{c}q") for c in alnum]
    assert ((flags & 4) != 0).tolist() == [any(x.isdigit() for x in w) for w in words]
    # a combining mark continues its word: "q<m>q" is one word
    marks = [m for m in stable if _mark(m) and unicodedata.normalize("NFKC", f"q{m}q") == f"q{m}q"]
    assert ex._scan([f"q{m}q" for m in marks])[4] == [casefold(f"q{m}q") for m in marks]
    # a letter of an unspaced script ends a word, and doubled it is one pair: "<c><c>"
    unspaced = [c for c in stable if _unspaced(c)]
    assert len(unspaced) > 90_000  # Han, kana, Thai, Lao, Khmer, Myanmar
    offsets, _, _, _, words = ex._scan([f"qq{c}{c}qq" for c in unspaced])
    assert np.diff(offsets).tolist() == [2] * len(unspaced)
    assert words[1::2] == [casefold(c + c) for c in unspaced]
    # "zz <c>bc": the second word is proper iff capitalised (its first code point upper case)
    alpha = [c for c in alnum if c.isalpha()]
    offsets, _, _, flags, words = ex._scan([f"zz {c}bc" for c in alpha])
    assert np.diff(offsets).tolist() == [2] * len(alpha)
    assert ((flags[1::2] & 1) != 0).tolist() == [c.isupper() for c in alpha]
    # "zz.<c>Bcd": "Bcd" starts a sentence iff c is whitespace (else it is a proper noun)
    gaps = _every_char(
        lambda c: not c.isalnum() and c not in "'\u2019" and unicodedata.normalize("NFKC", c) == c
    )
    offsets, _, _, flags, _ = ex._scan([f"zz.{c}Bcd" for c in gaps])
    assert np.diff(offsets).tolist() == [2] * len(gaps)
    assert ((flags[1::2] & 2) != 0).tolist() == [c.isspace() for c in gaps]


def _slot(word: str) -> int:
    """The native word cache's slot of an ASCII word: FNV-1a 64, folded, 2**14 slots
    (memoryos/word_set.h word_hash, retrieval_bindings.cpp word_str)."""
    h = 0xCBF29CE484222325
    for b in word.encode():
        h = ((h ^ b) * 0x100000001B3) & (2**64 - 1)
    return (h ^ (h >> 29)) & (2**14 - 1)


def test_words_sharing_a_cache_slot_come_back_as_themselves() -> None:
    """The scan's words are Python strs reused from a direct-mapped cache of recent words:
    two words in one slot, scanned in turn, each come back as the word scanned (a slot
    checked by hash alone, or not replaced, would hand back the other), and a repeat is
    the very object cached before."""
    seen: dict[int, str] = {}
    for i in range(100_000):
        word = f"zq{i}"
        other = seen.setdefault(_slot(word), word)
        if other != word:
            break
    ex = KeywordExtractor()
    for text in (other, word, other, word, f"{other} {word}"):
        assert ex.candidates([text]).words == text.split()
    first, again = ex.candidates([word]).words[0], ex.candidates([word]).words[0]
    assert first is again

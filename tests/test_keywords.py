"""Tests for memoryos_gpu.text.keywords."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.text.keywords import (
    PAD_ID,
    KeywordExtractor,
    extract_yake,
    hash_keyword,
    hash_keywords,
    jaccard,
    jaccard_ids,
    keyword_tokens,
    normalize_word,
    pack_keywords,
    tokenize,
    unpack_keywords,
    yake_available,
)
from memoryos_gpu.text.topics import topic_keywords, topic_weights

WORDS = ["caroline", "melanie", "paris", "2023", "lgbtq", "painting", "über", "東京", "x"]


# ------------------------------------------------------------------ tokenize
def test_tokenize_lowercases_keeps_digits_drops_stopwords_and_possessive():
    toks = tokenize("Caroline's LGBTQ group met on 7 May 2023, and the cats were fine!")
    assert toks == ["caroline", "lgbtq", "group", "met", "7", "may", "2023", "cats", "fine"]


def test_tokenize_options():
    assert "the" in tokenize("the dog", drop_stopwords=False)
    assert tokenize("stories about kittens", fold_plurals=True) == ["story", "kitten"]
    # short words untouched by plural folding, "ss" endings too
    assert tokenize("bus class", fold_plurals=True) == ["bus", "class"]
    assert tokenize("a b cd 7", min_len=2) == ["cd", "7"]
    assert tokenize("") == []
    assert tokenize("snake_case   words") == ["snake", "case", "words"]


def test_normalize_word_matches_tokenize():
    for w in ["Caroline's", "LGBTQ", "ÜBER", "Ｆｕｌｌｗｉｄｔｈ", "don't"]:
        toks = tokenize(w, drop_stopwords=False)
        assert [normalize_word(w)] == toks


def test_keyword_tokens_splits_phrases_in_rank_order():
    assert keyword_tokens(["support group", "Caroline's", "LGBTQ", "group", "the"]) == [
        "support",
        "group",
        "caroline",
        "lgbtq",
    ]
    assert keyword_tokens(["a book cover dog", "egg"], max_tokens=2) == ["book", "cover"]
    # single letters read as Italian stopwords (a, c, d, e: test_language_stopwords.py)
    assert keyword_tokens(["a b c d", "e"]) == ["b"]


# ----------------------------------------------------------------- extractor
def test_proper_nouns_and_numbers_ranked_up():
    ex = KeywordExtractor()
    top = ex.extract("yesterday we visited the museum with Melanie and bought 3 tickets")
    assert top[:2] == ["melanie", "3"]
    assert set(top[2:]) == {"yesterday", "visited", "museum", "bought", "tickets"}
    # a boosted word outranks a plain word even with a lower term frequency
    text = "the garden and the garden again. then Melanie said the show is in 2024"
    sc = ex.scores(text)
    assert sc["melanie"] > sc["show"] and sc["2024"] > sc["show"]
    assert sc["garden"] == pytest.approx(2 * sc["show"])


def test_capitalised_sentence_start_is_not_a_proper_noun():
    ex = KeywordExtractor()
    sc = ex.scores("Painting is fun. I met Painting today.")
    sc2 = ex.scores("Painting is fun.")
    assert sc["painting"] > sc2["painting"] * 2  # boosted only by the mid-sentence use


def test_ambiguous_month_only_boosted_when_capitalised():
    ex = KeywordExtractor()
    assert ex.scores("we may swim")["swim"] == pytest.approx(ex.scores("we may swim")["may"])
    assert ex.scores("see you on 7 May")["may"] > ex.scores("see you on 7 May")["see"]


def test_idf_lowers_common_words():
    corpus = [f"I went to the park with my dog number {i}" for i in range(20)] + [
        "Caroline adopted a dog"
    ]
    ex = KeywordExtractor(proper_noun_boost=1.0, number_boost=1.0)
    before = ex.extract("park trip with Zephyr", top_n=3)
    ex.fit(corpus)
    assert ex.n_docs == 21 and ex.df["park"] == 20
    assert ex.idf("park") < ex.idf("caroline") < ex.idf("zephyr")
    after = ex.extract("park trip with zephyr", top_n=3)
    assert after[-1] == "park" and before[0] == "park"
    # update is incremental: same as fitting on everything at once
    ex2 = KeywordExtractor().fit(corpus[:10]).update(corpus[10:])
    assert ex2.df == KeywordExtractor().fit(corpus).df
    ex2.update("single document string")
    assert ex2.n_docs == 22


def test_extract_deterministic_tiebreak_and_top_n():
    ex = KeywordExtractor()
    assert ex.extract("zebra apple mango", top_n=2) == ["zebra", "apple"]
    assert ex.extract("zebra apple", top_n=0) == []
    assert ex.extract("the and of", top_n=5) == []


def test_extractor_state_round_trip():
    ex = KeywordExtractor(fold_plurals=True).fit(["cats and dogs", "more cats"])
    ex2 = KeywordExtractor.from_dict(json.loads(json.dumps(ex.to_dict())))
    assert ex2.df == ex.df and ex2.n_docs == ex.n_docs and ex2.fold_plurals
    assert ex2.extract("cats on Mars") == ex.extract("cats on Mars")


@pytest.mark.skipif(not yake_available(), reason="yake not installed")
def test_extract_yake():
    out = extract_yake("Caroline went to the LGBTQ support group in Boston with Melanie.", 4)
    assert 0 < len(out) <= 4
    assert all(o == o.lower() for o in out)
    assert {"caroline", "melanie", "boston", "lgbtq"} & set(out)


# ------------------------------------------------------------------- hashing
def test_hash_is_31_bit_nonnegative_and_normalised():
    ids = [hash_keyword(w) for w in WORDS]
    assert all(0 <= i < 2**31 for i in ids)
    assert hash_keyword("Caroline") == hash_keyword("caroline") == hash_keyword(" CAROLINE's ")
    assert hash_keyword("") == PAD_ID and hash_keyword("'") == PAD_ID


def test_hash_stable_across_processes():
    code = (
        "import json; from memoryos_gpu.text.keywords import hash_keyword; "
        f"print(json.dumps([hash_keyword(w) for w in {WORDS!r}]))"
    )
    env_out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=str(Path(__file__).resolve().parents[1]),
    ).stdout
    assert json.loads(env_out) == [hash_keyword(w) for w in WORDS]


def test_hash_known_value():
    # Pinned: changing the hash would silently invalidate every stored keyword id.
    digest = hashlib.blake2b(b"caroline", digest_size=8).digest()
    assert hash_keyword("caroline") == int.from_bytes(digest, "little") & 0x7FFFFFFF


def test_hash_keywords_sorted_unique_int32():
    ids = hash_keywords(["b", "a", "A", "c", "", "b"])
    assert ids.dtype == np.int32
    assert list(ids) == sorted(set(ids.tolist()))
    assert len(ids) == 3
    assert hash_keywords([]).shape == (0,)


def test_pack_pads_sorts_and_truncates_by_rank():
    packed = pack_keywords([["zeta", "alpha", "Alpha"], [], ["a", "b", "c", "d", "e"]], width=3)
    assert packed.shape == (3, 3) and packed.dtype == np.int32
    assert list(packed[0, :2]) == sorted([hash_keyword("zeta"), hash_keyword("alpha")])
    assert packed[0, 2] == PAD_ID
    assert (packed[1] == PAD_ID).all()
    # truncation keeps the first (highest-ranked) 3 words, not the 3 smallest ids
    assert set(packed[2].tolist()) == {hash_keyword(w) for w in "abc"}
    assert list(packed[2]) == sorted(packed[2].tolist())
    assert pack_keywords([], width=4).shape == (0, 4)
    with pytest.raises(TypeError):
        pack_keywords(["abc"], width=2)


def test_jaccard_reference():
    assert jaccard(["a", "b"], ["b", "c"]) == pytest.approx(1 / 3)
    assert jaccard(["Paris"], ["paris"]) == 1.0
    assert jaccard([], []) == 0.0
    a, b = ["x", "y", "z"], ["y", "z", "w", "v"]
    pa, pb = pack_keywords([a, b], width=6)
    assert jaccard_ids(pa, pb) == pytest.approx(jaccard(a, b))


word_st = st.text(alphabet=st.characters(categories=("Ll", "Lu", "Nd")), min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(word_st, max_size=12), max_size=6), st.integers(1, 16))
def test_pack_unpack_round_trip(rows, width):
    packed = pack_keywords(rows, width)
    unpacked = unpack_keywords(packed)
    assert len(unpacked) == len(rows)
    for words, ids in zip(rows, unpacked, strict=True):
        distinct = list(dict.fromkeys(n for n in (normalize_word(w) for w in words) if n))
        expected = set(hash_keywords(distinct[:width]).tolist())
        assert set(ids.tolist()) == expected
        assert list(ids) == sorted(ids.tolist()) and len(ids) == len(set(ids.tolist()))
        if len(distinct) <= width:
            assert expected == set(hash_keywords(words).tolist())


# ------------------------------------------------------------------ topic keywords
def test_topic_weights_zero_for_words_said_once_or_everywhere():
    # df: 1 (only this page), 2, 5, 10 of the user's 10 pages
    w = topic_weights(np.array([3.0, 1.0, 1.0, 9.0]), np.array([1, 2, 5, 10]), np.full(4, 10))
    assert w[0] == 0.0 and w[3] == 0.0
    assert w[1] == pytest.approx(1.0 * 1 * np.log(5.0))
    assert w[2] == pytest.approx(1.0 * 4 * np.log(2.0))


def test_topic_weights_unknown_or_inconsistent_counts_are_not_keywords():
    w = topic_weights(np.array([1.0, 1.0, 1.0]), np.array([0, 3, 2]), np.array([0, 2, 1]))
    assert w.tolist() == [0.0, 0.0, 0.0]


def test_topic_keywords_rank_by_weight_ties_by_first_occurrence():
    cands = [["portland", "km", "run", "knee"], ["kelp"]]
    weights = np.array([0.0, 2.0, 2.0, 5.0, 1.0])
    scores = np.array([9.0, 1.0, 1.0, 1.0, 1.0])
    got = topic_keywords(cands, weights, scores, top_n=2)
    assert got == [["knee", "km"], ["kelp"]]  # portland (said once) never; km before run
    assert topic_keywords(cands, weights, scores, top_n=8)[0] == ["knee", "km", "run"]


def test_topic_keywords_page_sharing_nothing_keeps_its_best_scored_words():
    cands = [["okafor", "physio", "worse"]]
    got = topic_keywords(cands, np.zeros(3), np.array([2.0, 3.0, 2.0]), top_n=2)
    assert got == [["physio", "okafor"]]


def test_topic_keywords_empty_pages_and_batches():
    assert topic_keywords([], np.zeros(0), np.zeros(0), top_n=8) == []
    assert topic_keywords([[], ["a"]], np.array([1.0]), np.array([1.0]), 8) == [[], ["a"]]
    assert topic_keywords([["a"]], np.array([1.0]), np.array([1.0]), 0) == [[]]
    with pytest.raises(ValueError, match="one weight"):
        topic_keywords([["a", "b"]], np.array([1.0]), np.array([1.0]), 8)


def test_topic_keywords_unicode_words_pass_through():
    cands = [["東京", "über", "café"]]
    got = topic_keywords(cands, np.array([1.0, 3.0, 0.0]), np.ones(3), top_n=8)
    assert got == [["über", "東京"]]


_ROW_TOKENS = st.one_of(
    st.sampled_from(
        ["alpha", "Beta", "beta", "gamma's", "", "!!", "Ünïcode", "ß", "run2", "x" * 40]
    ),
    st.text(alphabet="az09AZ'é -", max_size=30),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_ROW_TOKENS), max_size=6), st.integers(1, 8))
def test_keyword_rows_are_each_rows_sorted_distinct_ids(lists, width) -> None:
    """The batched rows equal :func:`hash_keywords` of each row's first ``width`` tokens
    (repeats, case variants, tokens that normalise to nothing, plain words hashed natively
    -- short and longer than the native id cache holds -- and every other token through the
    Python hash included)."""
    from memoryos_gpu.engine.state import keyword_rows

    got = keyword_rows(lists, width)
    assert got.shape == (len(lists), width) and got.dtype == np.int32
    for row, tokens in zip(got, lists, strict=True):
        ids = hash_keywords(tokens[:width])
        assert row[: ids.size].tolist() == ids.tolist() and (row[ids.size :] == -1).all()


@settings(max_examples=500, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\x00"), max_size=12)))
def test_batches_are_normalised_as_if_joined_first(texts) -> None:
    """The scanners' inputs normalise only the non-ASCII texts, one at a time: the same string
    as normalising the joined batch (combining marks at a text's edge included)."""
    import unicodedata

    from memoryos_gpu.lexical import _normalised
    from memoryos_gpu.text.keywords import _nfkc_joined
    from memoryos_gpu.text.words import normalise

    joined = "\x00".join(texts)
    assert _nfkc_joined(texts) == unicodedata.normalize("NFKC", joined)
    assert _normalised(texts) == normalise(joined)

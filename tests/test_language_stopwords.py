"""A page in another language loses that language's stopwords from its keywords and its BM25
terms, and a question from its terms (``text/stopword_lists.py``, the rule in
``csrc/include/memoryos/languages.h`` that the keyword scanner and the term splitter share).

Before, the stopwords were English only: German and French function words (``und``, ``der``,
``le``, ``la``) became keywords and linked unrelated pages. The rule's details (word by word,
on random texts) are checked against the plain-Python reference in
``tests/test_keyword_scanner.py``; here, what it does for pages.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.lexical import page_terms, query_terms
from memoryos_gpu.ops.retrieval import RetrievalParams
from memoryos_gpu.ops.retrieval_reference import bm25_scores
from memoryos_gpu.text.keywords import KeywordExtractor, hash_keyword, jaccard, keyword_tokens
from memoryos_gpu.text.stopword_lists import LANGUAGES, language_stopwords, normalised_words

# three unrelated topics, two pages each, per language
PAGES = {
    "de": [
        [
            "Ich gehe jeden Samstag mit meinem Hund im Wald spazieren und der Hund liebt das.",
            "Der Hund ist schon alt, aber er rennt noch gern durch den Wald.",
        ],
        [
            "Meine Schwester hat eine neue Stelle als Ärztin in einem Krankenhaus in Hamburg.",
            "Sie sagt, die Arbeit im Krankenhaus ist anstrengend, aber die Kollegen sind nett.",
        ],
        [
            "Wir haben für den Sommer eine Reise nach Italien gebucht, mit dem Zug bis Rom.",
            "Die Reise nach Rom dauert mit dem Zug zwölf Stunden, das ist mir egal.",
        ],
    ],
    "fr": [
        [
            "Je vais à la piscine le mardi et le jeudi pour nager avec mon frère.",
            "La piscine est fermée en août, alors nous nageons dans le lac.",
        ],
        [
            "Ma mère fait un gâteau au chocolat pour mon anniversaire, c'est une tradition.",
            "Le gâteau de ma mère est le meilleur, avec beaucoup de chocolat noir.",
        ],
        [
            "J'apprends le piano depuis deux ans avec une professeure très patiente.",
            "Le piano me calme le soir, je joue surtout du Chopin pour la professeure.",
        ],
    ],
}


def _keywords(texts: list[str]) -> list[list[str]]:
    return KeywordExtractor().extract_many(texts, top_n=8)


@pytest.mark.parametrize("lang", sorted(PAGES))
def test_unrelated_pages_share_no_keyword_and_related_ones_do(lang: str) -> None:
    topics = PAGES[lang]
    kws = [_keywords(pages) for pages in topics]
    for a, b in itertools.combinations(range(len(topics)), 2):
        for x, y in itertools.product(kws[a], kws[b]):
            assert jaccard(x, y) == 0.0, (x, y)  # before: "und", "der", "le", "la" shared
    for pair in kws:
        assert jaccard(pair[0], pair[1]) > 0.0, pair  # "hund", "piscine" ... shared


def test_no_stopword_of_the_pages_language_is_a_keyword() -> None:
    for lang, topics in PAGES.items():
        stop = language_stopwords()[lang]
        for words in _keywords([p for pages in topics for p in pages]):
            assert words and not stop.intersection(words), (lang, words)


def test_an_english_page_keeps_words_other_languages_list() -> None:
    """An English page's language is English: words that other languages list as stopwords
    ("die" in German, "come" in Italian, "son" in French) stay its keywords."""
    text = "I will die hard on this hill, come what may, said my son about the rules"
    assert {"die", "come", "son", "hard", "hill"} <= set(_keywords([text])[0])
    for lang in ("de", "it", "fr"):  # the premise: each is a stopword there
        assert {"die", "come", "son"} & language_stopwords()[lang]


def test_a_language_needs_two_of_its_words_and_more_than_english() -> None:
    ex = KeywordExtractor()
    assert set(ex.extract("Berlin und Hamburg")) == {"berlin", "hamburg", "und"}  # one word
    assert set(ex.extract("Berlin und der Hamburg")) == {"berlin", "hamburg"}  # two: German
    # two German stopwords, but as many English ones: English, "die" stays
    assert "die" in ex.extract("the die is cast in Berlin und the rest")


def test_each_text_of_a_batch_has_its_own_language() -> None:
    german, english = "Die Katze und der Hund", "The dog and the cat die"
    got = KeywordExtractor().extract_many([german, english, german], top_n=8)
    assert got[0] == got[2] and set(got[0]) == {"katze", "hund"}
    assert "die" in got[1]


def test_custom_language_lists_and_their_state() -> None:
    ex = KeywordExtractor(language_stopwords={"xx": ["foo", "bar"]})
    assert set(ex.extract("foo bar baz qux")) == {"baz", "qux"}
    assert set(KeywordExtractor().extract("foo bar baz qux")) == {"foo", "bar", "baz", "qux"}
    again = KeywordExtractor.from_dict(ex.to_dict())
    assert again.language_stopwords == {"xx": frozenset({"foo", "bar"})}
    assert set(again.extract("foo bar baz qux")) == {"baz", "qux"}
    assert KeywordExtractor().to_dict()["language_stopwords"] is None  # the bundled lists


def test_the_bundled_lists_are_normalised_single_words() -> None:
    lists = language_stopwords()
    assert list(lists) == list(LANGUAGES)
    assert 0 < len(LANGUAGES) <= 31  # the scanner's bits
    for lang, words in lists.items():
        assert words, lang
        assert normalised_words(words) == words, lang  # as the scanner reads a word
    assert normalised_words(["L'", "par-devant", "Über", "aujourd'hui"]) == {
        "l",
        "über",
        "aujourdhui",
    }


def test_an_llms_keyword_phrases_lose_their_languages_stopwords() -> None:
    """LLM mode: the keyword phrases of a page (``keyword_tokens``) follow the same rule."""
    assert keyword_tokens(["la plage", "cours de piano", "l'été"]) == ["plage", "cours", "piano"]
    assert keyword_tokens(["der Wald", "Spaziergang mit dem Hund"]) == [
        "wald",
        "spaziergang",
        "hund",
    ]
    assert keyword_tokens(["die hard", "support group"]) == ["die", "hard", "support", "group"]


WORDS = ["und", "der", "die", "Hund", "le", "la", "de", "plage", "the", "and", "come", "son"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(WORDS), max_size=4).map(" ".join), max_size=5))
def test_phrases_and_the_scanner_find_the_same_language(phrases: list[str]) -> None:
    """``language_of`` (for phrases) decides as the native scanner does for a text: the
    words each keeps of the same words are the same."""
    kept = set(keyword_tokens(phrases))
    c = KeywordExtractor(min_len=1).candidates(["\n".join(phrases)])
    assert kept == set(c.words)


def _ids(words: list[str]) -> set[int]:
    return {hash_keyword(w) for w in words}


def test_bm25_terms_drop_the_texts_languages_stopwords() -> None:
    """A German question's terms are its content words (``klavier``, ``gespielt``), not
    ``wann``, ``habe``, ``ich``, ``mit``, ``dem``; a page's row and its length lose them too,
    and an English page keeps the words other languages list."""
    question = query_terms(["Wann habe ich mit dem Klavier gespielt?"])
    assert set(question.ids.tolist()) == _ids(["klavier", "gespielt"])
    rows = page_terms(
        [
            "Ich habe mit meiner Schwester Klavier gespielt.",
            "I will die hard on this hill, come what may, said my son",
        ],
        None,
    )
    german, english = (set(rows.row(i)[0].tolist()) for i in range(2))
    assert german == _ids(["schwester", "klavier", "gespielt"]) and rows.length[0] == 3
    assert _ids(["die", "come", "son", "hill"]) <= english


def test_a_german_question_ranks_the_page_it_is_about_first_by_bm25() -> None:
    """The engine's BM25 (``retrieval_reference.bm25_scores``, the kernels' reference) of a
    German question over a user's pages: the page about the piano first. Before, with every
    German function word a term, the short page made of them scored 6.6 and the piano page
    3.6."""
    pages = [
        "Gestern Abend habe ich nach der Arbeit endlich wieder eine Stunde lang Klavier "
        "gespielt, die Sonate von Beethoven klappt langsam.",
        "Wann habe ich dir das gesagt? Mit dem Auto?",
        "Der Hund ist schon alt, aber er rennt noch gern durch den Wald.",
        "Wir haben für den Sommer eine Reise nach Italien gebucht.",
    ]
    rows = page_terms(pages, None)
    terms = query_terms(["Wann habe ich mit dem Klavier gespielt?"]).ids.tolist()
    params = RetrievalParams()
    scores = bm25_scores(
        [rows.row(i) for i in range(len(pages))], terms, params.bm25_k1, params.bm25_b
    )
    assert scores[0] > 0 and scores[0] == max(scores) and scores.count(max(scores)) == 1


def test_single_letters_of_an_english_text_keep_it_english() -> None:
    """The package's Romanian list held the Latin alphabet (and Persian's its own and the
    digits): ``Vitamin B and C`` voted Romanian by ``b`` and ``c`` and lost both from its
    keywords and BM25 terms (``stopword_lists.NOT_WORDS``)."""
    text = "Vitamin B and C daily"
    row = set(page_terms([text], None).row(0)[0].tolist())
    assert _ids(["vitamin", "b", "c", "daily"]) <= row
    assert {"b", "c"} <= set(KeywordExtractor(min_len=1).extract(text, top_n=8))
    assert {"a", "i", "o"} <= language_stopwords()["ro"]  # its words stay

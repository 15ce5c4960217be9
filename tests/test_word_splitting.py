"""Words of languages other than English, as the BM25 index, the keyword extractor and a query
see them (memoryos_gpu/text/words.py): scripts without spaces split into letter pairs, marks
kept inside their words, folded spellings matched. Before, a Chinese clause was one token (a
query word never matched its page), a Hindi word three fragments that matched unrelated
pages, and a vocalised Arabic word or a Turkish capital İ never matched its plain spelling."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from keyword_reference import term_words

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu.lexical import page_terms, query_terms
from memoryos_gpu.text.keywords import KeywordExtractor, hash_keyword, tokenize
from memoryos_gpu.text.words import normalise, word_spans


def _words(text: str) -> list[str]:
    folded = normalise(text)
    return [folded[a:b] for a, b in word_spans(folded)]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("马拉松", ["马拉", "拉松"]),
        ("猫", ["猫"]),
        ("我在Google工作。", ["我在", "google", "工作"]),
        ("日本語のテキスト", ["日本", "本語", "語の", "のテ", "テキ", "キス", "スト"]),
        ("मैराथन हिन्दी", ["मैराथन", "हिन्दी"]),
        ("தமிழ்நாடு", ["தமிழ்நாடு"]),
        ("أَنَا فِي القَاهِرَة", ["أنا", "في", "القاهرة"]),
        ("İstanbul'a", ["istanbul'a"]),
        ("Caroline's don't", ["caroline's", "don't"]),
        # elision: the article or pronoun and the word are two words ...
        ("L'été à l'École", ["l", "été", "à", "l", "école"]),
        ("Qu\u2019il dit jusqu'à l'hôtel", ["qu", "il", "dit", "jusqu", "à", "l", "hôtel"]),
        ("dell'anno un'amica", ["dell", "anno", "un", "amica"]),
        ("l'un'altro aujourd'hui", ["l", "un", "altro", "aujourd'hui"]),
        # ... but not an English word's inner apostrophe, nor one before a consonant
        ("O'Neil I'm c'mon y'all d'Bo", ["o'neil", "i'm", "c'mon", "y'all", "d'bo"]),
    ],
)
def test_words_of_each_script(text: str, words: list[str]) -> None:
    assert _words(text) == words


def _matched(query: str, page: str) -> int:
    """How many of the query's terms the page's BM25 row holds."""
    terms = query_terms([query])
    row = set(page_terms([page], None).row(0)[0].tolist())
    return sum(t in row for t in terms.ids.tolist())


@pytest.mark.parametrize(
    ("query", "page"),
    [
        ("麻糬", "去年春天我领养了一只叫麻糬的猫。"),
        ("Google", "我在Google工作。"),
        ("モチ", "去年、モチという猫を飼い始めました。"),
        ("เชียงใหม่", "ฉันอาศัยอยู่ที่เชียงใหม่"),
        ("القاهرة", "أَنَا أَعِيشُ فِي القَاهِرَة"),
        ("Istanbul", "İstanbul çok güzel"),
        ("abc123", "我的密码是ＡＢＣ１２３。"),
        ("hôpital", "Je suis allé à l'hôpital hier."),
        ("Italia", "Sono tornato dall'Italia ieri."),
    ],
)
def test_a_query_word_matches_the_page_that_holds_it(query: str, page: str) -> None:
    assert _matched(query, page) == len(query_terms([query]).ids) > 0


def test_a_hindi_word_does_not_match_an_unrelated_sentence() -> None:
    # "marathon" against "my colour is red": its fragments shared 2 of 3 terms before
    assert _matched("मैराथन", "मेरा रंग लाल है") == 0
    assert _matched("मैराथन", "मैं मैराथन दौड़ता हूँ") == 1


def test_chinese_pages_on_one_topic_share_keywords() -> None:
    # whole clauses as keywords: no two pages on one topic shared one (Jaccard 0 for 0/136)
    pages = KeywordExtractor().extract_many(
        ["我正在为十月的波特兰马拉松训练。", "马拉松比赛前我每天跑十公里。"], 20
    )
    assert {"马拉", "拉松"} <= set(pages[0]) & set(pages[1]), pages


SENTENCES = [
    "我正在为十月六日的波特兰马拉松训练，现在每周跑四十公里。",
    "私は十月六日のポートランドマラソンに向けて練習しています。",
    "ฉันอาศัยอยู่ที่เชียงใหม่กับแมวชื่อโมจิ",
    "मैं हर सुबह मैराथन के लिए दौड़ता हूँ",
    "أَنَا أَعِيشُ فِي القَاهِرَة مع قطتي",
    "שָׁלוֹם, אני גר בירושלים",
    "İstanbul'da büyük bir kedim var",
    "Die Straße in München ist schön",
    "L'été dernier, j'ai visité l'Italie avec l'équipe d'Hélène.",
    "Quest'anno vado all'università con un'amica dell'ufficio.",
]


@pytest.mark.parametrize("text", SENTENCES)
def test_a_keyword_has_the_id_of_the_same_word_in_the_index(text: str) -> None:
    """Segment keywords and a query's terms are compared by id (the query-time Jaccard): a
    page's keyword ids are among its BM25 term ids."""
    keyword_ids = set(KeywordExtractor().candidates([text]).ids.tolist())
    assert keyword_ids and keyword_ids <= set(page_terms([text], None).row(0)[0].tolist())


def test_the_hashing_embedder_reads_the_same_words() -> None:
    assert tokenize("我在Google工作。") == ["我在", "google", "工作"]


def test_a_chinese_question_finds_its_page_among_many(tmp_path) -> None:
    facts = [
        "我的猫麻糬只吃三文鱼。",
        "我姐姐李娜住在杭州。",
        "我对花生过敏。",
        "我大学学的是化学。",
    ]
    fill = [f"今天我做了第{i}件普通的事情。" for i in range(12)]
    cfg = EngineConfig(store=str(tmp_path / "s"), embedder="hashing")
    with MemoryEngine(cfg) as engine:
        engine.add_many([{"user_id": "u", "user_input": t} for t in [*facts, *fill]])
        engine.flush()
        for question, fact in [("麻糬吃什么？", facts[0]), ("李娜住在哪里？", facts[1])]:
            pages = engine.retrieve("u", question).pages
            assert pages and pages[0].user_input == fact, [p.user_input for p in pages]


ELISION_PIECES = ["L'", "l\u2019", "qu'", "d'", "dell'", "un'", "été", "Hôtel", "amico", "x", "'"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([*ELISION_PIECES, " "]) | st.text(st.characters(exclude_characters="\x00")),
        max_size=20,
    ).map("".join)
)
def test_the_index_splits_words_as_the_python_rule(text: str) -> None:
    """The native term splitter (BM25 rows and query terms) finds the words of
    ``text/words.py`` (elisions included): a query's term ids are its words' ids, less the
    stopwords of its language when it is written in another (``keywords.language_of``)."""
    assert sorted(query_terms([text]).ids.tolist()) == sorted(
        {hash_keyword(w) for w in term_words(text)}
    )

"""A page in another language gets its date in that language's words too
(``text/date_names.py``; the term splitter finds the page's language as the keyword scanner
does). Before, a page's BM25 row held its date in English words only, so a question in
French ("en mai") matched only the numbers of a date."""

from __future__ import annotations

import pytest

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu.lexical import date_words, page_terms, query_terms, terms_from_blobs
from memoryos_gpu.text.date_names import DATE_NAMES, language_dates
from memoryos_gpu.text.keywords import hash_keyword
from memoryos_gpu.text.stopword_lists import LANGUAGES

MONDAY_8_MAY_2023 = 1683561360.0

PAGES = {
    "fr": ("Je suis allé à la plage avec ma sœur et le chien.", "lundi", "mai"),
    "de": ("Ich war mit meiner Schwester und dem Hund am Strand.", "montag", "mai"),
    "es": ("Fui a la playa con mi hermana y el perro.", "lunes", "mayo"),
    "it": ("Sono andato al mare con mia sorella e il cane.", "lunedì", "maggio"),
    "nl": ("Ik ben met mijn zus en de hond naar het strand gegaan.", "maandag", "mei"),
}


def _row(text: str, ts: float = MONDAY_8_MAY_2023) -> set[int]:
    return set(page_terms([text], [ts]).row(0)[0].tolist())


@pytest.mark.parametrize("lang", sorted(PAGES))
def test_a_page_has_its_date_in_its_language_and_in_english(lang: str) -> None:
    text, weekday, month = PAGES[lang]
    row = _row(text)
    for word in (weekday, month, *date_words(MONDAY_8_MAY_2023).lower().split()):
        assert hash_keyword(word) in row, word


def test_an_english_page_has_english_date_words_only() -> None:
    row = _row("I went to the beach with my sister and the dog.")
    assert {hash_keyword(w) for w in ("monday", "may", "8", "2023")} <= row
    others = {hash_keyword(w) for _, weekday, month in PAGES.values() for w in (weekday, month)}
    assert not row & others


def test_a_question_in_the_pages_language_finds_it_by_month() -> None:
    text, _, _ = PAGES["fr"]
    terms = query_terms(["Qu'est-ce que j'ai fait en mai ?"]).ids.tolist()
    assert hash_keyword("mai") in terms and hash_keyword("mai") in _row(text)
    assert hash_keyword("mai") not in _row(text, MONDAY_8_MAY_2023 + 40 * 86400)  # June


# pages of languages that inflect month and day names, and questions that write May or Monday
# in a form other than the nominative (the genitive of a date, the locative of "in May", ...)
INFLECTED = {
    "ru": (
        "Я ходил на пляж с сестрой и собакой.",
        ("Что я делал 8 мая?", "мая"),
        ("Куда я ходил в мае?", "мае"),
    ),
    "uk": (
        "Я ходив на пляж із сестрою, і це було чудово, бо ми там відпочивали.",
        ("Що я робив 8 травня?", "травня"),
        ("Куди я ходив у травні?", "травні"),
    ),
    "pl": (
        "Byłem na plaży z siostrą i psem.",
        ("Co robiłem 8 maja?", "maja"),
        ("Gdzie byłem w maju?", "maju"),
    ),
    "cs": (
        "Byl jsem na pláži se sestrou a psem.",
        ("Co jsem dělal 8. května?", "května"),
        ("Kde jsem byl v květnu?", "květnu"),
    ),
    "sk": (
        "Bol som na pláži so sestrou a psom.",
        ("Čo som robil 8. mája?", "mája"),
        ("Kde som bol v máji?", "máji"),
    ),
    "fi": (
        "Kävin rannalla siskoni ja koiran kanssa.",
        ("Missä kävin toukokuussa?", "toukokuussa"),
        ("Mitä tein maanantaina?", "maanantaina"),
    ),
    "hu": (
        "A húgommal és a kutyával voltam a strandon.",
        ("Hol voltam májusban?", "májusban"),
        ("Mit csináltam hétfőn?", "hétfőn"),
    ),
    "tr": (
        "Bu hafta sonu kız kardeşim ve köpekle birlikte plaja gittim, çok güzel bir gündü.",
        ("Mayıs'ta nereye gittim?", "mayısta"),
    ),
}


@pytest.mark.parametrize("lang", sorted(INFLECTED))
def test_a_question_finds_a_page_by_an_inflected_month_or_day(lang: str) -> None:
    """Before, only the nominative (``maj``, ``май``) was a date word, and a question's
    ``w maju``, ``8 мая`` or ``toukokuussa`` matched a page of May by a number or not at all."""
    text, *questions = INFLECTED[lang]
    a_month_later = MONDAY_8_MAY_2023 + 41 * 86400  # Sunday 18 June
    may_monday = _row(text) - _row(text, a_month_later)  # the page's date words of 8 May
    for question, form in questions:
        assert hash_keyword(form) in set(query_terms([question]).ids.tolist()) & may_monday, (
            lang,
            question,
        )


def test_every_table_names_twelve_months_and_seven_days_of_a_listed_language() -> None:
    assert set(DATE_NAMES) <= set(LANGUAGES)
    for lang, names in DATE_NAMES.items():
        forms = [f for name in names.split() for f in name.split("/")]
        assert len(names.split()) == 19 and len(set(forms)) == len(forms), lang
    table = language_dates()
    assert len(table) == len(LANGUAGES)
    assert table[LANGUAGES.index("de")][2] == "märz"  # as the splitter reads words
    assert table[LANGUAGES.index("pl")][4] == "maj maja maju"  # every form, one word each


def test_the_engine_indexes_a_page_with_its_languages_date_words() -> None:
    """Wiring: a page the engine accepts is indexed by the splitter above (its stored term
    row), in the page's language and in English."""
    text, weekday, month = PAGES["fr"]
    cfg = EngineConfig(store=":memory:", embedder="hashing", device="cpu")
    with MemoryEngine(cfg) as engine:
        r = engine.add("u", text, timestamp=MONDAY_8_MAY_2023)
        blob = engine.store.page_terms([r.page_id])[r.page_id]
    row = set(terms_from_blobs([blob]).row(0)[0].tolist())
    assert {hash_keyword(w) for w in (weekday, month, "monday", "may")} <= row

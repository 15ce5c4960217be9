"""The extractive promotion stage's facts (memoryos_gpu/stages.py, ``_user_facts``): the
sentences of a promoted page in which the user speaks about themself, verbatim."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.stages import ExtractiveStages, PromotionWork
from memoryos_gpu.text.keywords import KeywordExtractor

# The first-person rule as first written (ten words, case-insensitive, whole words): the
# stage's prefix-tree pattern must mark exactly the sentences this one marks.
FIRST_PERSON = re.compile(r"\b(i|i'm|i've|i'd|i'll|my|me|mine|we|our)\b", re.IGNORECASE)
PIECES = [
    *("i", "I", "i'm", "I'VE", "i'd", "I'll", "my", "MY", "Me", "mine", "we", "Our"),
    *("im", "ours", "mines", "mee", "wee", "id", "iv", "ill", "my_", "_me", "m'y"),
    *("ı", "İ", "ſ", "K", "é", "2", "hiking", "the marathon", "Kyoto", "x"),
    *(" ", "  ", ". ", "! ", "? ", "?", ".", "'", "-", "\n", "\u00a0"),
]


def _stages() -> ExtractiveStages:
    return ExtractiveStages(KeywordExtractor(), max_facts=1 << 30)


def _facts(texts: list[str]) -> list[str]:
    work = PromotionWork({}, [{"user_input": t} for t in texts])
    return _stages().promotions([work])[0].user_facts


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.sampled_from(PIECES), max_size=24).map("".join), max_size=4))
def test_first_person_sentences_are_the_ones_the_ten_words_mark(texts: list[str]) -> None:
    want = [
        s.strip()
        for t in texts
        for s in re.split(r"(?<=[.!?])\s+", t)
        if 12 <= len(s.strip()) <= 300 and not s.strip().endswith("?")
        if FIRST_PERSON.search(s.strip())
    ]
    assert _facts(texts) == want


def test_facts_keep_their_page_and_skip_questions_and_sizes() -> None:
    pages = [
        {"user_input": "I moved to Lisbon last spring. Where do you live? Ours is small."},
        {"user_input": "The weather was fine. My sister runs marathons!"},
        {"user_input": "I did."},
    ]
    facts = _stages()._user_facts(pages)
    assert facts == [("I moved to Lisbon last spring.", 0), ("My sister runs marathons!", 1)]


SAID = [f"I {verb} {thing}." for verb in ("keep", "paint", "sell") for thing in ("bees", "boats")]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(SAID), max_size=3).map(" ".join), max_size=8),
    st.integers(1, 7),
)
def test_the_cap_counts_distinct_facts_and_keeps_every_page_of_one(
    texts: list[str], cap: int
) -> None:
    """The newest ``max_facts`` distinct sentences, each with every page that says it: a
    repeated statement is one fact of many sources, not many facts crowding others out."""
    said = [(s, i) for i, t in enumerate(texts) for s in re.split(r"(?<=[.!?])\s+", t) if s]
    newest: list[str] = []
    for s, _ in reversed(said):
        if s not in newest:
            newest.append(s)
    want = [(s, i) for s, i in said if s in newest[:cap]]
    stages = ExtractiveStages(KeywordExtractor(), max_facts=cap)
    assert stages._user_facts([{"user_input": t} for t in texts]) == want

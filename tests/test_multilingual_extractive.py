"""Non-English text in the LLM-free pipeline: first-person facts in other languages and
scripts (memoryos_gpu/stages.py), the first sentence of CJK text and grapheme-safe cuts
(memoryos_gpu/stage_prompts/rendering.py, engine/mtm_rounds.merge_summary), and the stage
prompts' request to keep the conversation's language (stage_prompts/system_prompts.py)."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.engine.mtm_rounds import merge_summary
from memoryos_gpu.stage_prompts.rendering import first_sentence, truncate_text
from memoryos_gpu.stage_prompts.system_prompts import SYSTEM_PROMPTS
from memoryos_gpu.stages import ExtractiveStages, PromotionWork
from memoryos_gpu.text.keywords import KeywordExtractor


def _facts(*texts: str) -> list[str]:
    """The extractive promotion's user facts for pages with these user messages."""
    stages = ExtractiveStages(KeywordExtractor(), max_facts=1 << 30)
    work = PromotionWork({}, [{"user_input": t} for t in texts])
    return stages.promotions([work])[0].user_facts


# (language, page text, the sentences that are first-person statements, in order): each page
# also holds a third-person sentence, and most a question, that must not become a fact.
SAID = [
    (
        "zh",
        "我住在北京。我对花生过敏。你喜欢跑步吗？他很好。我们下个月去上海旅行。",
        ["我住在北京。", "我对花生过敏。", "我们下个月去上海旅行。"],
    ),
    (
        "ja",
        "私は東京に住んでいます。今日は晴れです。僕の趣味は釣りです！元気ですか？",
        ["私は東京に住んでいます。", "僕の趣味は釣りです！"],
    ),
    (
        "ko",
        "저는 서울에 살아요. 저 사람은 의사예요. 제 이름은 민수입니다. 제도가 바뀌었어요. "
        "우리 가족은 다섯 명이에요. 어디 살아요？",
        ["저는 서울에 살아요.", "제 이름은 민수입니다.", "우리 가족은 다섯 명이에요."],
    ),
    (
        "de",
        "Ich wohne in Berlin. Das Wetter ist schön. Meine Schwester ist Ärztin. Und du?",
        ["Ich wohne in Berlin.", "Meine Schwester ist Ärztin."],
    ),
    (
        "fr",
        "J'habite à Lyon depuis trois ans. Il pleut beaucoup. Mon frère habite à Paris.",
        ["J'habite à Lyon depuis trois ans.", "Mon frère habite à Paris."],
    ),
    (
        "es",
        "Yo vivo en Madrid. Hace calor hoy. Mi hermano se llama Pedro. ¿Y tú, dónde vives?",
        ["Yo vivo en Madrid.", "Mi hermano se llama Pedro."],
    ),
    (
        "pt",
        "Eu moro em Lisboa. O tempo está bom. Minha irmã trabalha no hospital.",
        ["Eu moro em Lisboa.", "Minha irmã trabalha no hospital."],
    ),
    (
        "it",
        "Io abito a Roma. Piove molto oggi. Mio fratello lavora a Milano.",
        ["Io abito a Roma.", "Mio fratello lavora a Milano."],
    ),
    (
        "ru",
        "Я живу в Москве. Погода хорошая сегодня. Мой брат работает врачом. А ты где живёшь?",
        ["Я живу в Москве.", "Мой брат работает врачом."],
    ),
    ("ar", "هل تحب القهوة؟ أنا أعيش في القاهرة.", ["أنا أعيش في القاهرة."]),
]


@pytest.mark.parametrize(("text", "want"), [s[1:] for s in SAID], ids=[s[0] for s in SAID])
def test_first_person_statements_are_facts_in_other_languages(text: str, want: list[str]) -> None:
    assert _facts(text) == want


def test_cjk_sentences_end_without_a_space_and_keep_their_closing_quote() -> None:
    assert _facts("他说：「我很好。」我的猫叫麻糬。我喜欢她！！") == [
        "他说：「我很好。」",
        "我的猫叫麻糬。",
        "我喜欢她！！",
    ]


def test_a_cjk_character_weighs_about_three_latin_letters_against_the_length_bounds() -> None:
    # 7 characters say what "I am allergic to peanuts." (25) does; 4 what "I'm fine." (9) does
    assert _facts("我对花生过敏。") == ["我对花生过敏。"]
    assert _facts("我很好。") == []
    assert _facts("我" * 99 + "。") == ["我" * 99 + "。"]  # 100 characters, 298 weighed
    assert _facts("我" * 100 + "。") == []


def test_other_languages_markers_do_not_fire_in_english_sentences() -> None:
    """Words of other languages that are also English words or names count only beside a
    function word of those languages, and never in a sentence with an English one."""
    english = [
        "Mia loves painting.",
        "Notre Dame burned down.",
        "Io orbits Jupiter fast.",
        "Mich and Mir drove 5 mi to see Mon.",
        "Ich bin ein Berliner, said the president.",
    ]
    assert _facts(*english) == []
    assert _facts("Mi casa es grande.", "Ma mère est médecin.") == [
        "Mi casa es grande.",
        "Ma mère est médecin.",
    ]


# English pages whose facts the English-only rule made (computed by running the code before
# other languages were added): an English user's knowledge must not change.
ENGLISH = [
    "I moved to Boston last spring. My sister still lives in Denver!",
    "Ma and Mia went to Notre Dame. Yo, that was wild! Io orbits Jupiter.",
    "The EU sets the rules for us. Mon through Fri we train at 6 am.",
    "Mich and Mir drove 5 mi to see Mon. Do you like jazz? I'd say it's fine.",
    "Je ne sais quoi, as they say. We adopted a cat named Mochi.",
    "Our team won the cup. Is that right? ok. I did.",
    "I'm learning piano 🎹 at the café. Mes amis, the chef said. My café order is a flat white.",
    "Ich weiß not. Yo-yo practice daily. Mine is the red bike!",
    "Mia loves painting. Notre Dame burned. Nous counts most. Eu regulators agreed.",
    "Uns and ours. Mis-typed lines everywhere. We were there.",
]
ENGLISH_FACTS = [
    ("I moved to Boston last spring.", 0),
    ("My sister still lives in Denver!", 0),
    ("Mon through Fri we train at 6 am.", 2),
    ("I'd say it's fine.", 3),
    ("We adopted a cat named Mochi.", 4),
    ("Our team won the cup.", 5),
    ("I'm learning piano 🎹 at the café.", 6),
    ("My café order is a flat white.", 6),
    ("Mine is the red bike!", 7),
    ("We were there.", 9),
]


def test_english_facts_are_what_the_english_rule_made() -> None:
    stages = ExtractiveStages(KeywordExtractor(), max_facts=1 << 30)
    assert stages._user_facts([{"user_input": t} for t in ENGLISH]) == ENGLISH_FACTS


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("我住在北京。我喜欢跑步。我养了一只猫。", "我住在北京。"),
        ("私は東京に住んでいます！毎日走ります。", "私は東京に住んでいます！"),
        ("他说：「我很好。」然后走了。", "他说：「我很好。」"),
        ("真的吗？？我不信。", "真的吗？？"),
        ("Pi is 3.5 e.g. ok. Next one.", "Pi is 3.5 e.g."),  # ASCII: a space ends one
    ],
)
def test_the_first_sentence_of_cjk_text_ends_at_its_terminator(text: str, want: str) -> None:
    assert first_sentence(text) == want


# ------------------------------------------------------------------ grapheme-safe cuts
FAMILY = "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466"
ENGLAND = "\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f"
CLUSTERS = [
    *("a", "b", " ", "é", "e\u0301", "a\u0300\u0301", "我", "の", "한", "\u0645\u064f"),
    *(FAMILY, "\U0001f44d\U0001f3fd", "\u2764\ufe0f", "1\ufe0f\u20e3", ENGLAND),
    *("\U0001f1ef\U0001f1f5", "\U0001f1f0\U0001f1f7", "क्ष", "स्ते", "न", "बु"),
]
texts = st.lists(st.sampled_from(CLUSTERS), max_size=30).map("".join)


def _attaches(ch: str) -> bool:
    """Whether ``ch`` belongs to the character before it (mark, ZWJ, selector, skin tone, tag)."""
    o = ord(ch)
    return (
        unicodedata.category(ch).startswith("M")
        or ch == "\u200d"
        or 0xFE00 <= o <= 0xFE0F
        or 0x1F3FB <= o <= 0x1F3FF
        or 0xE0020 <= o <= 0xE007F
    )


def _regional_run(s: str) -> int:
    """How many regional indicators ``s`` ends with."""
    return len(s) - len(s.rstrip("".join(map(chr, range(0x1F1E6, 0x1F200)))))


def _whole_at(text: str, cut: int) -> bool:
    """Whether cutting ``text`` at ``cut`` leaves every user-perceived character whole."""
    if cut in (0, len(text)):
        return True
    before, at = text[cut - 1], text[cut]
    conjunct = unicodedata.combining(before) == 9 and at.isalpha()
    return (
        not (_attaches(at) or before == "\u200d" or conjunct) and _regional_run(text[:cut]) % 2 == 0
    )


@settings(max_examples=500, deadline=None)
@given(texts, st.integers(1, 40))
def test_truncation_never_breaks_a_grapheme(text: str, limit: int) -> None:
    out = truncate_text(text, limit)
    assert len(out) <= limit
    if len(text) <= limit:
        assert out == text
        return
    kept = out[:-1]
    assert out.endswith("\u2026") and text.startswith(kept)
    assert _whole_at(text, len(kept))
    assert not kept.endswith("\u200d") and _regional_run(kept) % 2 == 0


@settings(max_examples=300, deadline=None)
@given(texts, st.integers(1, 40))
def test_truncation_cuts_where_unicode_segmentation_allows(text: str, limit: int) -> None:
    regex = pytest.importorskip("regex")
    kept = truncate_text(text, limit).removesuffix("\u2026")
    bounds = {0} | {m.end() for m in regex.finditer(r"\X", text)}
    assert len(kept) in bounds


def test_truncation_keeps_families_flags_and_conjuncts_whole() -> None:
    assert truncate_text("ab" + FAMILY + "cd", 9) == "ab\u2026"
    assert truncate_text("ab" + FAMILY + "cd", 10) == "ab" + FAMILY + "\u2026"
    assert truncate_text("x\U0001f1ef\U0001f1f5\U0001f1f0\U0001f1f7y", 5) == (
        "x\U0001f1ef\U0001f1f5\u2026"
    )
    assert truncate_text("नमस्ते दुनिया", 6) == "नम\u2026"


@settings(max_examples=300, deadline=None)
@given(texts, texts.filter(bool), st.integers(5, 40))
def test_a_merged_summary_opens_on_a_grapheme(old: str, new: str, cap: int) -> None:
    old = merge_summary("", old, cap)
    summary = merge_summary(old, new, cap)
    if new in old:  # nothing new to add: the summary stays
        assert summary == old
        return
    merged = f"{old} | {new}" if old else new
    assert len(summary) <= cap and merged.endswith(summary)
    assert _whole_at(merged, len(merged) - len(summary))


# ------------------------------------------------------------------ LLM stage prompts
WRITERS = [
    "chain_meta",
    "topic_summary",
    "profile_update",
    "user_knowledge",
    "assistant_knowledge",
    "fused_page",
    "fused_promotion",
]


@pytest.mark.parametrize("stage", WRITERS)
def test_prompts_that_write_memory_ask_for_the_conversations_language(stage: str) -> None:
    assert "in the language of the conversation" in SYSTEM_PROMPTS[stage]

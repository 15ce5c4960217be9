"""The sentences of a user's message in which the user states something about themself: what
the LLM-free mode keeps as user facts (``ExtractiveStages._user_facts``).

English decides first and alone what it marks ("I", "my", "we"...), so English facts are what
they always were; other languages count through their own first-person words: Chinese and
Japanese (no word boundaries: the characters themselves), Korean, Russian, Ukrainian, Arabic,
Hindi as words, and the Latin-script languages (German, French, Spanish, Portuguese, Italian)
whose markers are ASCII words too, only where the sentence reads as that language. Sentences
end after 。！？ with no space as well, a question in any script is no fact, and a Han, kana or
hangul character weighs three Latin letters against the length bounds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from memoryos_gpu.text.unicode_ranges import HAN_KANA_HANGUL_RANGES, class_body

__all__ = ["user_statements"]


# i, i'm, i've, i'd, i'll, my, me, mine, we, our -- as a prefix tree: each position of a
# sentence tries a few branches instead of ten words (1.5 -> 1.0 us a LoCoMo sentence)
_FIRST_PERSON = re.compile(r"\b(?:i(?:'(?:m|ve|d|ll))?|m(?:y|e|ine)|we|our)\b", re.IGNORECASE)
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def _trie(words: Iterable[str]) -> str:
    """``words`` as one regex alternation shaped as a prefix tree, so that each position of a
    sentence tries the branches of its own first letter instead of every word (the markers
    are searched in every sentence of every promoted page)."""
    tree: dict[str, dict] = {}
    for word in words:
        node = tree
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    return _branches(tree)


def _branches(node: dict[str, dict]) -> str:
    """The alternation below one node of :func:`_trie` (optional where a word ends there)."""
    alts = [re.escape(ch) + _branches(child) for ch, child in sorted(node.items()) if ch]
    if not alts:
        return ""
    return f"(?:{'|'.join(alts)})" + ("?" if "" in node else "")


def _words(words: str, *more: str) -> str:
    """The whitespace-separated ``words`` whole, as written, Capitalised or in capitals.
    Spelled out rather than re.IGNORECASE, whose Unicode folds (``ſ`` as ``s``, the Kelvin sign
    as ``k``) would let text that is in none of these languages match."""
    split = " ".join((words, *more)).split()
    forms = {f for w in split for f in (w, w[:1].upper() + w[1:], w.upper())}
    return rf"(?<!\w){_trie(forms)}(?!\w)"


# First person in other languages. Latin-script markers that are no English word: German,
# French, Spanish, Portuguese, Italian ("j'" and "j’" elide "je" before a vowel) ...
_LATIN_STRONG = (
    "ich mein meine meinen meinem meiner meines wir uns unser unsere unseren unserem unserer "
    "je moi nosotros nosotras nuestro nuestra nuestros nuestras mío mía meu meus minha minhas "
    "nós nosso nossa nossos nossas mio miei noi nostro nostra nostri nostre"
)
_ELISION = r"(?<!\w)[Jj]['’](?=\w)"
# ... and those that are also English words, names or abbreviations ("Ma", "Mia", "Notre
# Dame", "5 mi", "Mon"): they count only beside a function word of those languages, one of
# two letters or more that is no English word or name either ("y", "é", "di" are left out).
_LATIN_WEAK = "mir mich mim mon ma mes nous notre nos yo mi mis io mia mie eu"
_LATIN_STRONG_RE = re.compile(f"{_words(_LATIN_STRONG)}|{_ELISION}")
_LATIN_MARKER = re.compile(f"{_words(_LATIN_STRONG, _LATIN_WEAK)}|{_ELISION}")
_FOREIGN_CUE = re.compile(
    _words(
        "und der das ist bin habe nicht ein eine mit auf für sehr auch wohne heiße",
        "le la les et est suis sommes avons une des du dans pour avec pas ai au aux à ça",
        "très habite aime travaille el los las es soy estoy tengo del en con por para",
        "de que muy se llamo gusta encanta vivo trabajo um uma em com não sou estou tenho",
        "moro gosto chamo muito il lo gli è sono ho che molto abito lavoro chiamo piace",
    )
)
# English function words: a sentence holding one is English, whatever marker it quotes.
_ENGLISH_CUE = re.compile(
    _words(
        "the and of to is are it that this with for you they she were been have what",
        "about just not at be will would there",
    )
)
# Scripts English never uses: Chinese and Japanese (no word boundaries: the characters
# themselves), Korean (a pronoun as a word of its own, with a particle where the bare
# syllable is also another word: 저 "that", 제도 "system"), and whole words in Russian,
# Ukrainian, Arabic and Hindi.
_CJK_FIRST_PERSON = "[我私僕俺咱]|わたし|あたし"
_KOREAN_FIRST_PERSON = (
    "(?<![가-힣])(?:우리|(?:[저나](?:[는도의를만랑]|한테|에게)|나|[제내]가?|저희[는가도의를]?)"
    "(?![가-힣]))"
)
_WORD_FIRST_PERSON = _words(
    "я мой моя моё мое мои моего моей моему моим моих мне меня мной мы наш наша наше наши",
    "нашего нашей нашему нашим наших нас нам нами мій мені мене ми",
    "أنا نحن मैं मैंने मेरा मेरी मेरे हम हमें हमारा हमारी हमारे",
)
_SCRIPT_FIRST_PERSON = re.compile(
    f"{_CJK_FIRST_PERSON}|{_KOREAN_FIRST_PERSON}|{_WORD_FIRST_PERSON}"
)
# A non-ASCII page's sentences end as an ASCII page's do (and after "؟" or a danda before a
# space), and after 。！？｡ with no space, any closing quote or bracket kept before the cut.
_SENTENCE_ANY = re.compile(
    r"(?<=[.!?\u061f\u0964])\s+"
    r"|(?:(?<=[。！？｡])|(?<=[。！？｡][」』”’）)\"']))(?![」』”’）)\"'。！？｡])\s*"
)
_QUESTION_ENDS = ("?", "？", "؟")
# Han, kana and hangul: one of them says about what three Latin letters do, so a sentence's
# length counts them thrice against the bounds (我对花生过敏。 is 7 characters, 19 counted).
# Their letters only, not page_views' one-token set: CJK punctuation and fullwidth forms weigh
# one, or "我很好。" (4 characters, "I'm fine.") would weigh 12 and be a fact.
_WIDE = re.compile(f"[{class_body(HAN_KANA_HANGUL_RANGES)}]")
_WIDE_WEIGHT = 3
_LOW, _HIGH = 12, 300  # a fact's length bounds, in (weighted) characters


def user_statements(text: str) -> list[str]:
    """The sentences of a user message in which the user speaks about themself, verbatim:
    statements (no questions) of a fact's length that say "I" in some language."""
    if text.isascii():  # English's path, as it always was but for the other Latin markers
        sentences = map(str.strip, _SENTENCE.split(text))
        return [
            s
            for s in sentences
            if _LOW <= len(s) <= _HIGH and not s.endswith("?") and _says_i(s, True)
        ]
    sentences = map(str.strip, _SENTENCE_ANY.split(text))
    return [s for s in sentences if _is_statement(s) and _says_i(s, s.isascii())]


def _is_statement(s: str) -> bool:
    """Whether sentence ``s`` has a fact's length, a Han, kana or hangul character weighing
    ``_WIDE_WEIGHT``, and is no question (in any script's question mark)."""
    size = len(s) + (_WIDE_WEIGHT - 1) * _WIDE.subn("", s)[1]
    return _LOW <= size <= _HIGH and not s.endswith(_QUESTION_ENDS)


def _says_i(s: str, plain: bool) -> bool:
    """Whether the user speaks in the first person in sentence ``s`` (``plain``: ASCII). The
    English rule decides first and alone what it marks, so English facts are what they were;
    another language's marker counts only in a sentence with no English function word."""
    if _FIRST_PERSON.search(s) or (not plain and _SCRIPT_FIRST_PERSON.search(s)):
        return True
    if _ENGLISH_CUE.search(s) or _LATIN_MARKER.search(s) is None:  # most English: the first
        return False
    return bool(_LATIN_STRONG_RE.search(s) or _FOREIGN_CUE.search(s))

"""Write csrc/include/memoryos/unicode_tables.inc: the character classes and the case folding of
the Python that builds the project, so the native tokenizers (``csrc/host/terms.cpp`` for BM25
terms, ``csrc/host/keywords.cpp`` for keyword candidates) split, fold and classify words exactly
as :mod:`memoryos_gpu.text.keywords` does, and the native ``token_quarters``
(``csrc/bindings/text_table.cpp``) counts tokens as :mod:`memoryos_gpu.page_views` does; and
memoryos_gpu/text/unicode_ranges.py, the same ranges for the Python side: the classes Python's
``re`` has no name for (marks, unspaced scripts) for the Python splitter, the one-token
characters for ``page_views.approx_tokens``, and the Han, kana and hangul letters that
``text.statements`` weighs. Re-run when that Python's Unicode version changes or a hand-written
set below does: ``python scripts/gen_unicode_table.py``.

Tables (code points >= 128; ASCII is handled inline):

* ``kAlnumRanges`` / ``kAlphaRanges`` / ``kUpperRanges`` / ``kDigitRanges`` / ``kSpaceRanges``:
  half-open ``[start, end)`` ranges where ``str.isalnum`` / ``isalpha`` / ``isupper`` /
  ``isdigit`` / ``isspace`` hold for the one-character string (what the regex class ``[^\\W_]``
  and ``\\s`` match, and what the keyword boosts test);
* ``kMarkRanges``: combining marks (general category M*: vowel signs, viramas, accents, Thai
  tone marks), which continue a word instead of ending it;
* ``kUnspacedRanges``: the letters of scripts written without spaces between words (Han, kana,
  Thai, Lao, Khmer, Myanmar: :data:`UNSPACED_NAMES`), split into overlapping character pairs;
* ``kOneTokenRanges``: the characters a tokenizer gives about one token each
  (:data:`ONE_TOKEN_RANGES`, written by hand: a tokenizer's, not a Unicode property);
* ``kCaseFold``: ``{code point, n, c1, c2, c3}`` for every code point >= 128 whose
  ``str.casefold`` differs from itself (at most three code points out), ascending.
"""

from __future__ import annotations

import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "csrc" / "include" / "memoryos" / "unicode_tables.inc"
OUT_PY = ROOT / "memoryos_gpu" / "text" / "unicode_ranges.py"
#: Character-name prefixes of the letters of scripts written without spaces between words.
UNSPACED_NAMES = (
    "CJK UNIFIED IDEOGRAPH",
    "CJK COMPATIBILITY IDEOGRAPH",
    "IDEOGRAPHIC",
    "VERTICAL IDEOGRAPHIC",
    "HIRAGANA",
    "KATAKANA",
    "HALFWIDTH KATAKANA",
    "VERTICAL KANA",
    "THAI CHARACTER",
    "LAO ",
    "KHMER LETTER",
    "KHMER INDEPENDENT VOWEL",
    "MYANMAR LETTER",
)

#: The characters a tokenizer gives about one token each, where other text is ~4 characters a
#: token (``page_views.approx_tokens``, the native ``token_quarters``): [start, end) blocks,
#: whole, assigned or not, so the set is the same in every Unicode version. Why: a Chinese
#: character is about one token (one for the bundled MiniLM tokenizer, 0.7 to 1.5 for Qwen's
#: and Llama's), and so are these scripts' punctuation and fullwidth forms; counted at 4
#: characters a token, a CJK prompt's budget was a quarter of what it carried.
ONE_TOKEN_RANGES: tuple[tuple[int, int], ...] = (
    (0x1100, 0x1200),  # Hangul Jamo: old hangul and decomposed (NFD) syllables
    # CJK Radicals Supplement .. CJK Unified Ideographs: Kangxi radicals, ideographic
    # description, CJK symbols and punctuation (、。「」), hiragana, katakana, bopomofo, hangul
    # compatibility jamo, kanbun, CJK strokes, enclosed CJK, CJK compatibility, Extension A
    (0x2E80, 0xA000),
    (0xA960, 0xA980),  # Hangul Jamo Extended-A (old hangul initial consonants)
    (0xAC00, 0xD800),  # Hangul Syllables and Hangul Jamo Extended-B
    (0xF900, 0xFB00),  # CJK Compatibility Ideographs
    (0xFE30, 0xFE50),  # CJK Compatibility Forms (vertical punctuation)
    # Halfwidth and Fullwidth Forms: fullwidth ASCII and punctuation (ＡＢＣ，！), halfwidth
    # katakana and hangul, fullwidth symbols
    (0xFF00, 0xFFF0),
    # Kana Extended-B, Kana Supplement, Kana Extended-A, Small Kana Extension (archaic kana)
    (0x1AFF0, 0x1B170),
    # the Supplementary and Tertiary Ideographic Planes: CJK Extensions B.. and the CJK
    # Compatibility Ideographs Supplement
    (0x20000, 0x40000),
)

#: The letters of Han, kana and hangul, each of which says about what three Latin letters do:
#: ``text.statements`` weighs them thrice against a sentence's length bounds. A subset of
#: :data:`ONE_TOKEN_RANGES` and not the same set: a sentence's length is of what it says, so
#: its punctuation (、。「」！, CJK symbols 3000-303F, fullwidth forms FF00-FF65, vertical forms
#: FE30-FE4F), fullwidth Latin, enclosed and compatibility symbols (3200-33FF), bopomofo and
#: the hexagrams weigh one character as in any script. (As one set, "我很好。", 4 characters
#: that say what "I'm fine." does, weighed 12 and became a fact.)
HAN_KANA_HANGUL_RANGES: tuple[tuple[int, int], ...] = (
    (0x1100, 0x1200),  # Hangul Jamo
    (0x2E80, 0x2FE0),  # CJK Radicals Supplement, Kangxi Radicals
    (0x3040, 0x3100),  # Hiragana, Katakana
    (0x3130, 0x3190),  # Hangul Compatibility Jamo
    (0x31F0, 0x3200),  # Katakana Phonetic Extensions
    (0x3400, 0x4DC0),  # CJK Unified Ideographs Extension A
    (0x4E00, 0xA000),  # CJK Unified Ideographs
    (0xAC00, 0xD7B0),  # Hangul Syllables
    (0xF900, 0xFB00),  # CJK Compatibility Ideographs
    (0xFF66, 0xFFA0),  # Halfwidth Katakana
    (0x20000, 0x31350),  # CJK Unified Ideographs Extensions B to G and their compatibility forms
)


def is_mark(c: str) -> bool:
    return unicodedata.category(c).startswith("M")


def is_unspaced(c: str) -> bool:
    """A letter (alphanumeric, not a digit) of a script in :data:`UNSPACED_NAMES`."""
    return c.isalnum() and not c.isdigit() and unicodedata.name(c, "").startswith(UNSPACED_NAMES)


CLASSES: dict[str, Callable[[str], bool]] = {
    "kAlnumRanges": str.isalnum,
    "kAlphaRanges": str.isalpha,
    "kUpperRanges": str.isupper,
    "kDigitRanges": str.isdigit,
    "kSpaceRanges": str.isspace,
    "kMarkRanges": is_mark,
    "kUnspacedRanges": is_unspaced,
}


def ranges(test: Callable[[str], bool]) -> list[tuple[int, int]]:
    """Half-open [start, end) ranges of code points >= 128 for which ``test`` holds."""
    out, start = [], None
    for c in range(128, sys.maxunicode + 2):
        ok = c <= sys.maxunicode and test(chr(c))
        if ok and start is None:
            start = c
        elif not ok and start is not None:
            out.append((start, c))
            start = None
    return out


def casefold_rows() -> list[tuple[int, ...]]:
    """(code point, n, up to three code points) where casefold changes a code point >= 128."""
    rows = []
    for c in range(128, sys.maxunicode + 1):
        folded = chr(c).casefold()
        if folded != chr(c):
            cps = [ord(x) for x in folded]
            if len(cps) > 3:
                raise SystemExit(f"U+{c:04X} folds to {len(cps)} code points (table holds 3)")
            rows.append((c, len(cps), *cps, *([0] * (3 - len(cps)))))
    return rows


def _table(name: str, rows: list[tuple[int, ...]], per_line: int) -> str:
    cells = ["{" + ", ".join(f"0x{v:X}" for v in r) + "}" for r in rows]
    body = ",\n".join(
        "  " + ", ".join(cells[i : i + per_line]) for i in range(0, len(cells), per_line)
    )
    width = len(rows[0])
    return f"static constexpr uint32_t {name}[][{width}] = {{\n{body}\n}};\n"


#: A regex character class's inside from ranges, for the generated module's users.
_CLASS_BODY = '''

def class_body(ranges: tuple[tuple[int, int], ...]) -> str:
    """``ranges`` (half-open, all >= U+0080, none a regex metacharacter) as the inside of a
    regex character class."""
    return "".join(f"{chr(a)}-{chr(b - 1)}" for a, b in ranges)
'''


def _python_ranges(version: str) -> str:
    """memoryos_gpu/text/unicode_ranges.py: the mark, unspaced-letter, one-token and
    Han/kana/hangul ranges as tuples."""
    lines = [
        f'"""Generated by scripts/gen_unicode_table.py; do not edit (Unicode {version}).',
        "",
        "Half-open [start, end) code point ranges, the same as csrc's kMarkRanges,",
        "kUnspacedRanges and kOneTokenRanges, so the Python and native splitters and token",
        "counts agree on every code point; and HAN_KANA_HANGUL_RANGES, the letters",
        'memoryos_gpu.text.statements weighs (Python only)."""',
        "",
        f'UNICODE_VERSION = "{version}"',
    ]
    tables = (
        ("MARK_RANGES", ranges(is_mark)),
        ("UNSPACED_RANGES", ranges(is_unspaced)),
        ("ONE_TOKEN_RANGES", ONE_TOKEN_RANGES),
        ("HAN_KANA_HANGUL_RANGES", HAN_KANA_HANGUL_RANGES),
    )
    for name, rows in tables:
        lines.append(f"{name}: tuple[tuple[int, int], ...] = (")
        lines += [f"    (0x{a:X}, 0x{b:X})," for a, b in rows]
        lines.append(")")
    return "\n".join(lines) + "\n" + _CLASS_BODY


def main() -> int:
    version = unicodedata.unidata_version
    parts = [
        "// Generated by scripts/gen_unicode_table.py; do not edit.\n"
        f"// Character classes and case folding of Python's str (Unicode {version}).\n"
        f'#define MOS_UNICODE_VERSION "{version}"\n'
    ]
    for name, test in CLASSES.items():
        parts.append(_table(name, ranges(test), 6))
    parts.append("// The characters a tokenizer gives about one token each (ONE_TOKEN_RANGES).\n")
    parts.append(_table("kOneTokenRanges", list(ONE_TOKEN_RANGES), 6))
    parts.append(_table("kCaseFold", casefold_rows(), 3))
    OUT.write_text("".join(parts))
    OUT_PY.write_text(_python_ranges(version))
    print(f"{OUT}, {OUT_PY} (Unicode {version})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

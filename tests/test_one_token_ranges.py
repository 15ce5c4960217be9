"""The characters counted as one token (page_views.approx_tokens) and those a statement's length
weighs thrice (text.statements) have one definition each, in scripts/gen_unicode_table.py:
the generated Python and C++ tables are that definition, and the native token count agrees with
the Python one on every code point."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from memoryos_gpu import _C
from memoryos_gpu.page_views import token_quarters
from memoryos_gpu.text import unicode_ranges

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts/gen_unicode_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inc_table(name: str) -> tuple[tuple[int, int], ...]:
    inc = (ROOT / "csrc/include/memoryos/unicode_tables.inc").read_text()
    body = inc.split(f"{name}[][2] = {{")[1].split("};")[0]
    return tuple((int(a, 16), int(b, 16)) for a, b in re.findall(r"\{(\w+), (\w+)\}", body))


def test_the_generated_tables_are_the_generators_definitions() -> None:
    gen = _generator()
    assert unicode_ranges.ONE_TOKEN_RANGES == gen.ONE_TOKEN_RANGES
    assert _inc_table("kOneTokenRanges") == gen.ONE_TOKEN_RANGES
    assert unicode_ranges.HAN_KANA_HANGUL_RANGES == gen.HAN_KANA_HANGUL_RANGES


def test_han_kana_and_hangul_letters_are_one_token_each() -> None:
    """The letters a statement weighs thrice are a subset of the one-token characters."""
    one = unicode_ranges.ONE_TOKEN_RANGES
    for a, b in unicode_ranges.HAN_KANA_HANGUL_RANGES:
        assert any(lo <= a and b <= hi for lo, hi in one), hex(a)


def test_the_native_count_is_page_views_for_every_code_point() -> None:
    table = _C.TextTable()
    differ = []
    for c in range(0x80, 0x110000):
        if 0xD800 <= c < 0xE000:
            continue
        table.put(1, chr(c), None, 0.0, None)
        if table.get(1)[5] != token_quarters(chr(c)):
            differ.append(hex(c))
    assert differ == []

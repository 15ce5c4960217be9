"""The "~N tokens of context" a retrieval reports for CJK text (testing report, F14): a Chinese,
Japanese or Korean character is about one token, where 4 characters a token said a quarter of
that. ASCII text keeps its count exactly, and the native tables count a page as
``page_views.approx_tokens`` does."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runs import run_cli
from hypothesis import given
from hypothesis import strategies as st

from memoryos_gpu.page_views import KnowledgeTexts, PageTable, approx_tokens, token_quarters


@given(st.lists(st.one_of(st.none(), st.text(st.characters(max_codepoint=127))), max_size=4))
def test_ascii_text_counts_four_characters_a_token_as_before(texts: list[str | None]) -> None:
    assert approx_tokens(*texts) == (sum(len(t) for t in texts if t) + 3) // 4


def test_a_cjk_kana_or_hangul_character_is_one_token() -> None:
    assert approx_tokens("我喜欢跑步。") == 6  # five ideographs and a full stop: six tokens
    assert approx_tokens("カタカナ", "ひらがな") == 8
    assert approx_tokens("안녕하세요") == 5
    assert approx_tokens("𠀀𠀁") == 2  # ideographs beyond the BMP
    assert approx_tokens("我在Google工作") == 4 + 2  # the Latin word at 4 characters a token
    assert approx_tokens("é" * 8, "Ωμέγα") == 4  # other scripts as before


def test_the_native_tables_count_a_page_and_an_entry_as_approx_tokens() -> None:
    pages, knowledge = PageTable(), KnowledgeTexts()
    pages.chains.put(7, "跑步的链", None, 0.0, None)
    pages.put(1, "我每天跑五公里。", "Great, 太好了!", 0.0, {}, 7)
    assert pages[1].tokens == approx_tokens("我每天跑五公里。", "Great, 太好了!", "跑步的链")
    knowledge[5] = "用户喜欢跑步"
    assert knowledge.table.get(5)[5] == token_quarters("用户喜欢跑步") == 6 * 4


def test_a_chinese_retrieval_reports_about_a_token_a_character(tmp_path: Path) -> None:
    said = "我喜欢每天早上在公园里跑五公里，然后吃一个面包。"
    chats = tmp_path / "zh.jsonl"
    record = {"user_id": "王小明", "user_input": said, "agent_response": "太好了。"}
    chats.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    assert run_cli("ingest", chats, "--store", tmp_path / "st").exit_code == 0
    res = run_cli("retrieve", "--store", tmp_path / "st", "--user", "王小明", "跑步", "--json")
    got = json.loads(res.stdout)
    shown = sum(len(p["user_input"]) + len(p["agent_response"]) for p in got["pages"])
    assert shown == len(said) + 4 and got["retrieval_tokens"] >= shown

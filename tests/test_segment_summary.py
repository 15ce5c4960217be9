"""A segment's summary keeps its newest page summaries within ``summary_chars``, dropping the
oldest words whole: cut from the front mid-word, it opened on a fragment (" user discussed ...",
its "The" cut to nothing but a space, or "he user ...")."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from memoryos_gpu.engine.mtm_rounds import merge_summary

words = st.lists(st.text("abcdefgh", min_size=1, max_size=12), min_size=1, max_size=8).map(" ".join)


@given(words, words, st.integers(20, 80))
def test_the_summary_keeps_the_newest_whole_words_within_the_cap(
    old: str, new: str, cap: int
) -> None:
    old = merge_summary("", old, cap)  # a summary as stored: within the cap
    summary = merge_summary(old, new, cap)
    if new in old:
        assert summary == old
        return
    merged = f"{old} | {new}" if old else new
    assert len(summary) <= cap and merged.endswith(summary)
    assert not summary.startswith((" ", "|"))
    start = len(merged) - len(summary)
    assert start == 0 or merged[start - 1] in " |"  # where a word starts
    assert new in summary or len(new) > cap  # the newest page's summary, whole


def test_a_word_cut_by_the_cap_is_dropped_whole() -> None:
    old = "The user discussed marathon training"
    assert merge_summary(old, "puppy training dog", 40) == "marathon training | puppy training dog"
    assert merge_summary("x" * 50, "y", 10) == "y"  # a word longer than the cap goes whole

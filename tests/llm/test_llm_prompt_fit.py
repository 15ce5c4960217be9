"""The in-process backends' shortening rule, with a one-token-per-word tokenizer."""

from __future__ import annotations

import pytest

from memoryos_gpu.llm.prompt_fit import fit_messages

VOCAB: list[str] = []


def tokens(text: str) -> list[int]:
    out = []
    for w in text.split():
        if w not in VOCAB:
            VOCAB.append(w)
        out.append(VOCAB.index(w))
    return out


def text(ids: list[int]) -> str:
    return " ".join(VOCAB[i] for i in ids)


def encode(messages: list[dict[str, str]]) -> list[int]:
    return tokens(" ".join(f"<{m['role']}> {m['content']}" for m in messages))


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def test_fits_untouched():
    msgs = [msg("system", "be brief"), msg("user", "hello there")]
    assert fit_messages(msgs, 10, encode, tokens, text) == (msgs, encode(msgs))


def test_start_of_last_user_message_goes_first():
    context = " ".join(f"c{i}" for i in range(50))
    msgs = [msg("system", "be brief"), msg("user", f"{context} the question")]
    out, ids = fit_messages(msgs, 20, encode, tokens, text)
    assert len(ids) <= 20 and out[0] == msgs[0]
    assert out[1]["content"].endswith("c49 the question") and "c0 " not in out[1]["content"]
    assert msgs[1]["content"].startswith("c0")  # the caller's messages are not changed


def test_oldest_messages_dropped_then_failure_alone():
    history = [msg("user", "old " * 30), msg("assistant", "older reply " * 10)]
    msgs = [msg("system", "be brief"), *history, msg("user", "now?")]
    out, ids = fit_messages(msgs, 12, encode, tokens, text)
    assert [m["role"] for m in out] == ["system", "user"] and out[-1]["content"] == "now?"
    assert len(ids) <= 12
    with pytest.raises(ValueError, match="even after truncation"):
        fit_messages([msg("system", "rule " * 40), msg("user", "x")], 12, encode, tokens, text)

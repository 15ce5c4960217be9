"""The LoCoMo QA metrics (token F1, BLEU-1) and batched answering through the LLM interface."""

from __future__ import annotations

import math

import pytest

from memoryos_gpu.eval import qa
from memoryos_gpu.llm.base import ChatRequest
from memoryos_gpu.llm.scripted import ScriptedBackend


def test_normalisation_drops_case_punctuation_and_articles() -> None:
    assert qa.normalize_answer("The  Cat, sat on A mat!") == ["cat", "sat", "on", "mat"]


@pytest.mark.parametrize(
    ("pred", "gold", "f1"),
    [
        ("cat sat", "a cat sat down", 2 * 1.0 * (2 / 3) / (1.0 + 2 / 3)),  # P=1, R=2/3
        ("7 May 2023", "7 May 2023", 1.0),
        ("dogs", "cats", 0.0),
        ("", "", 1.0),
        ("", "cats", 0.0),
        ("cat cat cat", "cat", 2 * (1 / 3) * 1.0 / (1 / 3 + 1.0)),  # counts are clipped
    ],
)
def test_token_f1(pred: str, gold: str, f1: float) -> None:
    assert qa.token_f1(pred, gold) == pytest.approx(f1)


def test_bleu1_clips_counts_and_penalises_short_answers() -> None:
    assert qa.bleu1("cat cat cat", "cat") == pytest.approx(1 / 3)  # clipped precision, no BP
    # 2 of 2 tokens right, reference of 4: brevity penalty exp(1 - 4/2)
    assert qa.bleu1("cat sat", "cat sat on mat") == pytest.approx(math.exp(-1))
    assert qa.bleu1("the answer", "answer") == pytest.approx(1.0)


def test_score_answers_per_category() -> None:
    rep = qa.score_answers([1, 1, 2], ["paris", "rome", "blue"], ["paris", "milan", "blue sky"])
    assert rep.n == 3
    assert rep.per_category[1]["f1"] == pytest.approx(0.5)
    assert rep.per_category[2]["f1"] == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert rep.f1 == pytest.approx((1 + 0 + 2 / 3) / 3)
    assert rep.as_dict()["per_category"]["1"]["f1"] == 0.5
    with pytest.raises(ValueError):
        qa.score_answers([1], ["a", "b"], ["a"])


def test_answer_questions_batches_prompts_with_the_pages_and_counts_failures() -> None:
    pages = [
        {"user_input": "I moved to Lisbon", "agent_response": "Nice!", "timestamp": 0.0},
        {"user_input": "My dog is Rex", "agent_response": "Cute", "timestamp": 60.0},
    ]

    def responder(req: ChatRequest) -> Exception | str:
        text = req.messages[-1]["content"]
        assert "I moved to Lisbon" in text and "Answer the user's question" in text
        if "fail" in text:
            return RuntimeError("model error")  # the request gets ChatResult.error
        return "Answer: Lisbon\nbecause the page says so"

    backend = ScriptedBackend(responder)
    items = [(f"where do I live {i}", pages) for i in range(5)] + [("fail please", pages)]
    answers, failed = qa.answer_questions(backend, items, batch_size=4)
    assert answers[:5] == ["Lisbon"] * 5 and answers[5] == ""  # first line, label dropped
    assert failed == 1
    assert backend.batch_sizes() == [4, 2]
    assert all(r.max_tokens == 32 and r.json_schema is None for r in backend.requests)

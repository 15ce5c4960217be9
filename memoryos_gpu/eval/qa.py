"""Question answering on LoCoMo: the paper's token F1 and BLEU-1, answers from retrieved pages.

Why here and not only recall: MemoryOS reports answer quality (F1, BLEU-1 per category); a run
with a real answering model (vLLM on a GPU, any OpenAI-compatible server) can be set beside the
paper's table. Every method answers from the same prompt built from its own top-B pages, so the
comparison isolates retrieval.

Metrics follow the LoCoMo evaluation's conventions: answers are lower-cased, punctuation and
the articles a / an / the removed, whitespace collapsed; token F1 is the harmonic mean of
token precision and recall over the bag of tokens; BLEU-1 is the clipped unigram precision
times the brevity penalty (one reference). LoCoMo's own script also stems tokens (Porter);
this one does not, so its numbers are slightly lower for inflected answers.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memoryos_gpu import prompts
from memoryos_gpu.llm.base import ChatRequest, LLMBackend

ANSWER_INSTRUCTIONS = (
    "Answer the user's question from the recalled pages in a short phrase (a few words, no "
    "full sentence). If the pages give a date, answer with the date."
)

_ARTICLES = re.compile(r"\b(a|an|the)\b")
# small chat models often echo a transcript label before the answer
_LABEL = re.compile(r"^\s*(user|assistant|answer)\s*:\s*", re.IGNORECASE)
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> list[str]:
    """Tokens of an answer after LoCoMo/SQuAD normalisation."""
    text = str(text).lower().translate(_PUNCT)
    return _ARTICLES.sub(" ", text).split()


def token_f1(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall (bags of normalised tokens)."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def bleu1(prediction: str, gold: str) -> float:
    """Clipped unigram precision times the brevity penalty, against one reference."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if not pred or not ref:
        return float(pred == ref)
    clipped = sum((Counter(pred) & Counter(ref)).values())
    precision = clipped / len(pred)
    brevity = 1.0 if len(pred) > len(ref) else math.exp(1 - len(ref) / len(pred))
    return precision * brevity


def answer_messages(question: str, pages: Sequence[Any]) -> list[dict[str, str]]:
    """The answering prompt: the engine's response prompt over ``pages`` (best first), with
    instructions for a short answer. Pages need ``user_input``, ``agent_response`` and
    ``timestamp`` (attributes or keys)."""
    return prompts.response(
        question, [], list(pages), None, [], [], extra_instructions=ANSWER_INSTRUCTIONS
    )


@dataclass
class QAReport:
    """Mean F1 / BLEU-1 overall and per LoCoMo category, with the answers for inspection."""

    f1: float
    bleu1: float
    n: int
    per_category: dict[int, dict[str, float]]
    failed: int = 0  # generations that returned an error (scored as empty answers)
    answers: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "f1": round(self.f1, 4),
            "bleu1": round(self.bleu1, 4),
            "questions": self.n,
            "failed": self.failed,
            "per_category": {
                str(c): {k: round(v, 4) for k, v in m.items()}
                for c, m in sorted(self.per_category.items())
            },
        }


def score_answers(
    categories: Sequence[int], predictions: Sequence[str], golds: Sequence[str]
) -> QAReport:
    """Mean token F1 and BLEU-1, overall and per category."""
    if not (len(categories) == len(predictions) == len(golds)):
        raise ValueError("categories, predictions and golds must have the same length")
    by_cat: dict[int, list[tuple[float, float]]] = {}
    scores = []
    for c, p, g in zip(categories, predictions, golds, strict=True):
        s = (token_f1(p, g), bleu1(p, g))
        scores.append(s)
        by_cat.setdefault(int(c), []).append(s)

    def mean(xs: list[tuple[float, float]], i: int) -> float:
        return sum(x[i] for x in xs) / len(xs) if xs else 0.0

    return QAReport(
        f1=mean(scores, 0),
        bleu1=mean(scores, 1),
        n=len(scores),
        per_category={c: {"f1": mean(v, 0), "bleu1": mean(v, 1)} for c, v in by_cat.items()},
    )


def answer_questions(
    backend: LLMBackend,
    items: Sequence[tuple[str, Sequence[Any]]],
    *,
    max_tokens: int = 32,
    batch_size: int = 16,
) -> tuple[list[str], int]:
    """Generate one short answer per ``(question, pages)`` item, batched; returns the answers
    (``""`` where generation failed) and the number of failures."""
    answers: list[str] = []
    failed = 0
    for i in range(0, len(items), batch_size):
        requests = [
            ChatRequest(answer_messages(q, pages), max_tokens=max_tokens, stage="qa")
            for q, pages in items[i : i + batch_size]
        ]
        for r in backend.generate(requests):
            if r.error:
                failed += 1
                answers.append("")
            else:
                text = r.text.strip()
                answers.append(_LABEL.sub("", text.splitlines()[0]) if text else "")
    return answers, failed

"""Retrieval-quality evaluation: LoCoMo loading, evidence recall, and retrieval baselines."""

from .locomo import (
    SCORED_CATEGORIES,
    Conversation,
    Page,
    Question,
    QuestionResult,
    RecallReport,
    aggregate_recall,
    all_evidence_hit,
    evaluate_rankings,
    evidence_recall,
    load_locomo,
    normalise_dia_id,
    normalise_evidence,
    retrieved_dia_ids,
)

_BASELINES = ("bm25", "flat_dense", "fuse", "rrf", "run_baselines", "tokenize")


def __getattr__(name: str) -> object:
    # baselines are imported lazily so ``python -m memoryos_gpu.eval.baselines`` runs cleanly
    if name in _BASELINES:
        from . import baselines

        return getattr(baselines, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SCORED_CATEGORIES",
    "Conversation",
    "Page",
    "Question",
    "QuestionResult",
    "RecallReport",
    "aggregate_recall",
    "all_evidence_hit",
    "bm25",
    "evaluate_rankings",
    "evidence_recall",
    "flat_dense",
    "fuse",
    "load_locomo",
    "normalise_dia_id",
    "normalise_evidence",
    "retrieved_dia_ids",
    "rrf",
    "run_baselines",
    "tokenize",
]

"""LLM-free fallbacks: a well-formed result for each stage, computed without a model.

``fallback_<stage>(...)`` is used when the LLM call fails or its answer does not parse, so a page
is never lost; it is also the whole of the extractive (LLM-free) mode's chain meta and summary.
Nothing here does I/O or counts anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memoryos_gpu.text.keywords import KeywordExtractor

from .parsing import FusedPageResult, PromotionResult, TopicSummary
from .rendering import _get, first_sentence
from .schemas import DEFAULT_MAX_KEYWORDS

__all__ = [
    "fallback_assistant_knowledge",
    "fallback_chain_meta",
    "fallback_continuity",
    "fallback_fused_page",
    "fallback_fused_promotion",
    "fallback_profile_update",
    "fallback_topic_summary",
    "fallback_user_knowledge",
]


def _page_first_sentence(page: Any, max_chars: int) -> str:
    s = first_sentence(_get(page, "user_input", "") or "", max_chars)
    return s or first_sentence(_get(page, "agent_response", "") or "", max_chars)


def _page_text(page: Any) -> str:
    return f"{_get(page, 'user_input', '') or ''}\n{_get(page, 'agent_response', '') or ''}"


def fallback_continuity(prev_page: Any = None, page: Any = None) -> bool:
    """No LLM: never link pages (each evicted page starts its own chain)."""
    return False


def fallback_chain_meta(prev_meta: str | None, page: Any, *, max_chars: int = 200) -> str:
    """No LLM: the first sentence of the page's user input (of the response when the
    input is empty), truncated to ``max_chars``; ``prev_meta`` is ignored."""
    return _page_first_sentence(page, max_chars)


def fallback_topic_summary(
    pages: Sequence[Any],
    *,
    extractor: KeywordExtractor | None = None,
    max_keywords: int = DEFAULT_MAX_KEYWORDS,
    max_chars: int = 200,
) -> TopicSummary:
    """No LLM: extractive summary and statistical keywords.

    summary = first sentence of the first page's user input (falling back to the
    response, then to later pages), truncated to ``max_chars``; keywords = the
    ``extractor``'s top ``max_keywords`` over all page text (pass a fitted
    per-user extractor for IDF; an unfitted default one is used otherwise).
    """
    summary = ""
    for p in pages:
        summary = _page_first_sentence(p, max_chars)
        if summary:
            break
    if max_keywords <= 0:  # the summary alone (the extractive stage ranks keywords itself)
        return TopicSummary(summary, [])
    ex = extractor if extractor is not None else KeywordExtractor()
    text = "\n".join(_page_text(p) for p in pages)
    return TopicSummary(summary, ex.extract(text, top_n=max_keywords))


def fallback_profile_update(existing_profile: Any = None, pages: Any = None) -> dict[str, str]:
    """No LLM: no profile updates."""
    return {}


def fallback_user_knowledge(pages: Any = None) -> list[str]:
    """No LLM: no facts."""
    return []


def fallback_assistant_knowledge(pages: Any = None) -> list[str]:
    """No LLM: no facts."""
    return []


def fallback_fused_page(
    prev_page: Any,
    prev_meta: str | None,
    page: Any,
    *,
    extractor: KeywordExtractor | None = None,
    max_keywords: int = DEFAULT_MAX_KEYWORDS,
    max_chars: int = 200,
) -> FusedPageResult:
    """No LLM: not continuous; meta and summary from the first sentence; keywords
    from the extractor (see :func:`fallback_topic_summary`)."""
    ts = fallback_topic_summary(
        [page], extractor=extractor, max_keywords=max_keywords, max_chars=max_chars
    )
    return FusedPageResult(
        continuous=False,
        meta=fallback_chain_meta(prev_meta, page, max_chars=max_chars),
        summary=ts.summary,
        keywords=ts.keywords,
    )


def fallback_fused_promotion(existing_profile: Any = None, pages: Any = None) -> PromotionResult:
    """No LLM: no profile updates and no facts."""
    return PromotionResult()

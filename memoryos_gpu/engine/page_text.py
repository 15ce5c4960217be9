"""The text that stands for a page: what it is embedded from, and what its BM25 row indexes.

One definition for every writer (acceptance, the rebuild, ``update_page``), so a page's
embedding and its term row in the lexical index always describe the same words.
"""

from __future__ import annotations

from typing import Any

from memoryos_gpu.lexical import PageTerms, date_words, page_terms
from memoryos_gpu.types import PageInput


def speakers(meta: dict[str, Any] | None) -> tuple[str, str]:
    """Names of the two sides when the log has them (``user_name``/``assistant_name``, or a
    LoCoMo reader's ``speaker_a``/``speaker_b``): questions often name people."""
    meta = meta or {}
    return (
        str(meta.get("user_name") or meta.get("speaker_a") or "User"),
        str(meta.get("assistant_name") or meta.get("speaker_b") or "Assistant"),
    )


def page_text(page: Any, embed_dates: bool) -> str:
    """The text a page is embedded and keyword-indexed from: its date written out (when
    ``embed_dates``), then each side's words after its speaker's name. ``page``: a
    :class:`PageInput` or a store row (a dict)."""
    get = (lambda k: getattr(page, k)) if hasattr(page, "user_input") else page.get
    # a PageInput carries .meta; a store row carries "extra" ("meta" is its chain summary)
    meta = page.meta if isinstance(page, PageInput) else page.get("extra")
    user, assistant = speakers(meta)
    text = f"{user}: {get('user_input')} {assistant}: {get('agent_response')}"
    if embed_dates and get("timestamp") is not None:
        text = f"[{date_words(float(get('timestamp')))}] {text}"
    return text


def lexical_text(user_input: str, agent_response: str, meta: dict[str, Any]) -> str:
    """The words of a page's BM25 row (:func:`page_terms_of` adds its date words)."""
    user, assistant = speakers(meta)
    return f"{user} {user_input} {assistant} {agent_response}"


def page_terms_of(pages: list[tuple[str, str, float, dict[str, Any]]]) -> PageTerms:
    """BM25 term rows of pages given as ``(user_input, agent_response, timestamp, meta)``:
    their lexical text plus their date words, for the whole batch in one native call."""
    return page_terms(
        [lexical_text(ui, ar, meta) for ui, ar, _ts, meta in pages], [p[2] for p in pages]
    )

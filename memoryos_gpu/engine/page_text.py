"""The text that stands for a page: what it is embedded from, and what its BM25 row indexes.

One definition for every writer (acceptance, the rebuild, ``update_page``) and the lexical
index's loader, so a page's embedding and keyword row always describe the same words.
"""

from __future__ import annotations

import json
from typing import Any

from memoryos_gpu.lexical import date_words
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
    """A page's row in the user's BM25 index (the index adds the date words itself)."""
    user, assistant = speakers(meta)
    return f"{user} {user_input} {assistant} {agent_response}"


def lexical_rows(store: Any, user_id: str) -> list[tuple[int, str, float]]:
    """The loader of a user's BM25 index: ``(page id, text, timestamp)`` of the MTM pages."""
    rows = store.query(
        "SELECT page_id, user_input, agent_response, timestamp, extra FROM pages "
        "WHERE user_id = ? AND tier = 'mtm'",
        (user_id,),
    )
    return [(r[0], lexical_text(r[1], r[2], json.loads(r[4] or "{}")), r[3]) for r in rows]

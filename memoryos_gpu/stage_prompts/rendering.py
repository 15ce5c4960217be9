"""How a page, and any text, is shown inside a prompt: truncation, timestamps, numbered pages.

A *page* is any object or mapping with ``user_input``, ``agent_response`` and ``timestamp`` (a
string, or a float of seconds since the epoch, rendered as ISO-8601 UTC); retrieved pages may also
carry ``meta`` (chain summary). Page text is truncated to ``max_page_chars`` characters per field
**only inside the prompt**; nothing here modifies the page.

The builders render pages with these; the parsers clean and cap the model's text with the same
whitespace and truncation rules (``_clean``, :func:`truncate_text`); the fallbacks take a page's
:func:`first_sentence`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "DEFAULT_META_CHARS",
    "DEFAULT_PAGE_CHARS",
    "first_sentence",
    "format_timestamp",
    "render_page",
    "render_pages",
    "truncate_text",
]

#: Characters kept per page field (user input / agent response) in a prompt.
DEFAULT_PAGE_CHARS = 1200
#: Characters kept of a chain meta summary shown in a prompt.
DEFAULT_META_CHARS = 600

_ELLIPSIS = "\u2026"


def truncate_text(text: str | None, max_chars: int | None) -> str:
    """``text`` cut to at most ``max_chars`` characters (ending in an ellipsis).

    ``None`` or ``max_chars <= 0`` means no limit. Only ever used on prompt copies.
    """
    text = "" if text is None else str(text)
    if not max_chars or max_chars <= 0 or len(text) <= max_chars:
        return text
    if max_chars == 1:
        return _ELLIPSIS
    return text[: max_chars - 1].rstrip() + _ELLIPSIS


def format_timestamp(ts: Any) -> str:
    """Render a timestamp: numbers (epoch seconds) as ISO-8601 UTC, strings as-is."""
    if ts is None:
        return ""
    if isinstance(ts, bool):
        return str(ts)
    if isinstance(ts, int | float):
        try:
            dt = datetime.fromtimestamp(float(ts), tz=UTC)
        except (OverflowError, OSError, ValueError):
            return str(ts)
        return dt.isoformat(timespec="seconds").replace("+00:00", "Z")
    if isinstance(ts, datetime):
        if ts.tzinfo is not None:
            ts = ts.astimezone(UTC)
            return ts.isoformat(timespec="seconds").replace("+00:00", "Z")
        return ts.isoformat(timespec="seconds")
    return str(ts).strip()


def _get(page: Any, name: str, default: Any = None) -> Any:
    if page is None:
        return default
    if isinstance(page, Mapping):
        return page.get(name, default)
    return getattr(page, name, default)


def _clean(text: Any) -> str:
    """Collapse whitespace; non-strings become ``""``."""
    if not isinstance(text, str):
        return ""
    return " ".join(text.split())


def render_page(
    page: Any,
    *,
    max_page_chars: int | None = DEFAULT_PAGE_CHARS,
    with_meta: bool = False,
    max_meta_chars: int | None = DEFAULT_META_CHARS,
) -> str:
    """One page as prompt text (timestamp, user, assistant, optional chain meta)."""
    ts = format_timestamp(_get(page, "timestamp"))
    user = truncate_text(_get(page, "user_input", "") or "", max_page_chars)
    agent = truncate_text(_get(page, "agent_response", "") or "", max_page_chars)
    lines = [f"Time: {ts or 'unknown'}"]
    if with_meta:
        meta = truncate_text(_get(page, "meta", "") or "", max_meta_chars)
        if meta:
            lines.append(f"Conversation thread: {meta}")
    lines.append(f"User: {user}")
    lines.append(f"Assistant: {agent}")
    return "\n".join(lines)


def render_pages(
    pages: Iterable[Any],
    *,
    max_page_chars: int | None = DEFAULT_PAGE_CHARS,
    with_meta: bool = False,
    max_meta_chars: int | None = DEFAULT_META_CHARS,
    empty_text: str = "(none)",
) -> str:
    """Numbered pages (``[1]``, ``[2]``, ...) separated by blank lines."""
    blocks = [
        f"[{i}] "
        + render_page(
            p, max_page_chars=max_page_chars, with_meta=with_meta, max_meta_chars=max_meta_chars
        )
        for i, p in enumerate(pages, 1)
    ]
    return "\n\n".join(blocks) if blocks else empty_text


_SENTENCE_RE = re.compile(r"(.+?[.!?\u3002\uff01\uff1f])(?=\s|$)", re.DOTALL)


def first_sentence(text: str | None, max_chars: int = 200) -> str:
    """First sentence of ``text`` (whitespace collapsed), truncated to ``max_chars``."""
    t = _clean(text or "")
    if not t:
        return ""
    m = _SENTENCE_RE.match(t)
    sent = m.group(1) if m else t
    return truncate_text(sent.strip(), max_chars)

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
import unicodedata
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "DEFAULT_META_CHARS",
    "DEFAULT_PAGE_CHARS",
    "first_sentence",
    "format_timestamp",
    "grapheme_ceil",
    "grapheme_floor",
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
    """``text`` cut to at most ``max_chars`` characters (ending in an ellipsis), at a grapheme
    boundary (:func:`grapheme_floor`): the cut may shorten a text further, never change what
    its last character shows (a family emoji into a man, a flag into a letter).

    ``None`` or ``max_chars <= 0`` means no limit. Used on prompt copies, and on the
    extractive summaries and chain metas that are stored.
    """
    text = "" if text is None else str(text)
    if not max_chars or max_chars <= 0 or len(text) <= max_chars:
        return text
    if max_chars == 1:
        return _ELLIPSIS
    return text[: grapheme_floor(text, max_chars - 1)].rstrip() + _ELLIPSIS


_ZWJ = "\u200d"


def _extends(ch: str) -> bool:
    """Whether ``ch`` belongs to the grapheme of the character before it: a combining mark,
    a zero-width joiner, a variation selector, an emoji skin tone or a tag character."""
    o = ord(ch)
    if o < 0x300:  # ASCII and Latin-1: never (the common case, without a table look-up)
        return False
    return (
        ch == _ZWJ
        or 0xFE00 <= o <= 0xFE0F
        or 0x1F3FB <= o <= 0x1F3FF
        or 0xE0020 <= o <= 0xE007F
        or 0xE0100 <= o <= 0xE01EF
        or unicodedata.category(ch)[0] == "M"
    )


def _regional(ch: str) -> bool:
    """Whether ``ch`` is a regional indicator: two of them make one flag."""
    return "\U0001f1e6" <= ch <= "\U0001f1ff"


def _is_boundary(text: str, i: int) -> bool:
    """Whether a cut before ``text[i]`` splits no grapheme cluster. Kept together: a character
    and the marks, joiners, selectors, modifiers and tags after it; whatever follows a ZWJ (a
    ZWJ emoji sequence is one picture); a consonant after a virama (an Indic conjunct); and
    regional indicators in pairs (a flag)."""
    if i <= 0 or i >= len(text):
        return True
    before, at = text[i - 1], text[i]
    if _extends(at) or before == _ZWJ:
        return False
    if ord(before) >= 0x900 and unicodedata.combining(before) == 9 and at.isalpha():
        return False
    if _regional(before) and _regional(at):  # a boundary after each pair of the run
        j = i - 1
        while j > 0 and _regional(text[j - 1]):
            j -= 1
        return (i - j) % 2 == 0
    return True


def grapheme_floor(text: str, i: int) -> int:
    """The largest grapheme boundary of ``text`` at or before index ``i``: where a text cut to
    ``i`` characters may end without breaking a user-perceived character."""
    i = max(0, min(i, len(text)))
    while not _is_boundary(text, i):
        i -= 1
    return i


def grapheme_ceil(text: str, i: int) -> int:
    """The smallest grapheme boundary of ``text`` at or after index ``i``: where a tail of
    ``text`` may start (:func:`grapheme_floor` from the other side)."""
    i = max(0, min(i, len(text)))
    while not _is_boundary(text, i):
        i += 1
    return i


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


# A sentence ends at ".", "!" or "?" before whitespace or the end (so "3.5" and "e.g." do not
# end one), or at a run of 。！？｡ with any closing quotes or brackets: CJK puts no space
# after them (the extractive facts split sentences alike: memoryos_gpu.stages).
_SENTENCE_RE = re.compile(
    r"(.+?(?:[.!?](?=\s|$)|[\u3002\uff01\uff1f\uff61]+[\u300d\u300f\u201d\u2019\uff09)\"']*))",
    re.DOTALL,
)


def first_sentence(text: str | None, max_chars: int = 200) -> str:
    """First sentence of ``text`` (whitespace collapsed), truncated to ``max_chars``."""
    t = _clean(text or "")
    if not t:
        return ""
    m = _SENTENCE_RE.match(t)
    sent = m.group(1) if m else t
    return truncate_text(sent.strip(), max_chars)

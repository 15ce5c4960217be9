"""What the engine accepts: text, ids, timestamps and page metadata, checked and normalised.

Every public entry point runs its input through these before taking the engine lock, so a bad
record is refused with a message naming the field (:class:`InvalidInputError`) and nothing
half-applied is left behind. ``validate_page`` is public so a bulk reader can reject one record
without failing its batch.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
from collections.abc import Iterable
from typing import Any

from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.types import PageInput

MAX_TEXT_CHARS = 1_000_000
MAX_ID_CHARS = 256
MAX_META_BYTES = 65_536
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # category Cc, but \t and \n


class InvalidInputError(MemoryOSError, ValueError):
    """A page or query was rejected; the message says which field and why."""


def _clean_text(value: Any, what: str) -> str:
    """Normalise text: NFC, lone surrogates -> U+FFFD, control chars other than \\n \\t dropped."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be a string, got {type(value).__name__}")
    if value.isascii():  # no surrogates, already NFC: only control characters to drop
        text = _CONTROL.sub("", value)
    else:
        text = unicodedata.normalize("NFC", _CONTROL.sub("", _SURROGATE.sub("\ufffd", value)))
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidInputError(f"{what} is {len(text)} characters; the limit is {MAX_TEXT_CHARS}")
    return text


def _clean_id(value: Any, what: str) -> str:
    """An id as given, if it is a non-blank string of at most ``MAX_ID_CHARS`` printable
    characters (ids are keys: they are checked, never rewritten)."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(f"{what} must be a non-empty string")
    if len(value) > MAX_ID_CHARS or not (
        (value.isascii() and value.isprintable())
        or not any(unicodedata.category(c) in ("Cc", "Cs") for c in value)
    ):
        raise InvalidInputError(f"{what} must be at most {MAX_ID_CHARS} printable characters")
    return value


def _timestamp(value: Any) -> float:
    """Epoch seconds from a number or an ISO-8601 string; ``None`` is now (the wall clock)."""
    if value is None:
        return time.time()
    if isinstance(value, bool):
        raise InvalidInputError("timestamp must be epoch seconds or an ISO-8601 string")
    if isinstance(value, int | float | str):
        from memoryos_gpu.formats import parse_timestamp

        try:
            return parse_timestamp(value)
        except ValueError as exc:
            raise InvalidInputError(f"timestamp {value!r} does not parse: {exc}") from exc
    raise InvalidInputError(f"timestamp must be a number or string, got {type(value).__name__}")


def validate_page(p: PageInput | dict[str, Any]) -> PageInput:
    """The normalised page ``add_many`` would store, or InvalidInputError saying why not
    (lets a bulk reader reject one record without failing its batch)."""
    if isinstance(p, dict):
        unknown = set(p) - set(PageInput.__dataclass_fields__)
        if unknown:
            raise InvalidInputError(f"unknown page field(s): {sorted(unknown)}")
        try:
            p = PageInput(**p)
        except TypeError as exc:
            raise InvalidInputError(str(exc)) from exc
    if not isinstance(p, PageInput):
        raise InvalidInputError(f"a page must be a PageInput or dict, got {type(p).__name__}")
    if not isinstance(p.meta, dict):
        raise InvalidInputError("meta must be a dict")
    try:  # most pages carry no meta: nothing to encode
        encoded = json.dumps(p.meta, allow_nan=False) if p.meta else "{}"
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"meta must be JSON-serialisable: {exc}") from exc
    if len(encoded) > MAX_META_BYTES:
        raise InvalidInputError(
            f"meta is {len(encoded)} bytes as JSON; the limit is {MAX_META_BYTES}"
        )
    return PageInput(
        user_id=_clean_id(p.user_id, "user_id"),
        user_input=_clean_text(p.user_input, "user_input"),
        agent_response=_clean_text(
            p.agent_response if p.agent_response is not None else "", "agent_response"
        ),
        timestamp=_timestamp(p.timestamp),
        assistant_id=_clean_id(p.assistant_id, "assistant_id") if p.assistant_id else None,
        source=_clean_id(p.source, "source") if p.source else None,
        meta=p.meta,
    )


def clean_queries(queries: Iterable[tuple[Any, Any]]) -> list[tuple[str, str]]:
    """``(user_id, query)`` pairs with the id checked and the query text normalised.

    The common pair (a printable ASCII id, an ASCII query without control characters, both
    within their limits) is taken as is after a few C-level string tests; any other pair goes
    through :func:`_clean_id` and :func:`_clean_text`, which give the same result for the
    common pair and a clear error for a bad one."""
    search = _CONTROL.search
    return [
        (u, q)
        if type(u) is str
        and type(q) is str
        and u.isascii()
        and u.isprintable()
        and 0 < len(u) <= MAX_ID_CHARS
        and not u.isspace()
        and q.isascii()
        and len(q) <= MAX_TEXT_CHARS
        and search(q) is None
        else (_clean_id(u, "user_id"), _clean_text(q, "query"))
        for u, q in queries
    ]

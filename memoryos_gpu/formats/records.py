"""Record / Reject types shared by every reader, plus text normalisation and idempotency keys."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .timestamps import parse_timestamp

__all__ = [
    "MAX_SOURCE_CHARS",
    "RAW_LIMIT",
    "FormatError",
    "Record",
    "Reject",
    "content_hash",
    "fit_name",
    "make_source",
    "normalise_text",
]

#: ``Reject.raw`` is truncated to this many characters.
RAW_LIMIT = 2000
#: The engine's limit of an id (``memoryos_gpu.engine.validation.MAX_ID_CHARS``; not imported:
#: the engine package is heavy), which a page's ``source`` key must respect.
MAX_SOURCE_CHARS = 256

# C0 controls except \t (0x09) and \n (0x0a), DEL, C1 controls; lone UTF-16 surrogates
# (``json`` turns an unpaired ``"\ud800"`` escape into one; it cannot be encoded to UTF-8 later).
_CONTROL_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


class FormatError(ValueError):
    """The input's format could not be detected, or an unknown format was requested."""


def normalise_text(text: str) -> str:
    """The one normalisation applied to every text field and id read from an input.

    * control characters other than ``\\n`` and ``\\t`` are removed (C0, DEL, C1; a ``\\r\\n``
      line ending therefore becomes ``\\n``);
    * lone UTF-16 surrogates (from unpaired ``\\uD800``-style JSON escapes) become U+FFFD.

    Nothing else changes: no whitespace stripping, no Unicode normal form.
    """
    text = _CONTROL_RE.sub("", text)
    if _SURROGATE_RE.search(text):
        text = _SURROGATE_RE.sub("\ufffd", text)
    return text


def content_hash(
    user_id: str,
    assistant_id: str | None,
    user_input: str,
    agent_response: str,
    timestamp: str | float | None,
) -> str:
    """12 hex digits of SHA-256 over the page's content fields (stable across runs and hosts)."""
    payload = json.dumps(
        [user_id, assistant_id, user_input, agent_response, timestamp],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def make_source(
    basename: str,
    position: int | str,
    sub_index: int,
    user_id: str,
    assistant_id: str | None,
    user_input: str,
    agent_response: str,
    timestamp: str | float | None,
) -> str:
    """``f"{basename}:{position}:{sub_index}:{content_hash}"``: the page's idempotency key.

    A key longer than the engine's id limit (:data:`MAX_SOURCE_CHARS`; a file name of ~235+
    characters) would get every record of the file refused, so only then the basename part is
    shortened by :func:`fit_name` (deterministic: a re-run finds the same keys). Every key that
    fits is unchanged, so stores ingested before keep skipping their pages on a re-run.
    """
    digest = content_hash(user_id, assistant_id, user_input, agent_response, timestamp)
    tail = f":{position}:{sub_index}:{digest}"
    return fit_name(basename, MAX_SOURCE_CHARS - len(tail)) + tail


def fit_name(name: str, limit: int) -> str:
    """``name`` if it has at most ``limit`` characters, else a prefix of it plus ``~`` and 12 hex
    digits of SHA-256 of the whole name (two long names sharing a prefix stay distinct)."""
    if len(name) <= limit:
        return name
    tag = "~" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return name[: max(0, limit - len(tag))] + tag


@dataclass(frozen=True)
class Record:
    """One page: a user input and the agent's response to it.

    ``timestamp`` keeps the input's value (strings as written, numbers as ``float``); it has been
    validated with :func:`parse_timestamp`, and :attr:`epoch` gives it as UTC epoch seconds.
    ``source`` is a stable idempotency key (see :func:`make_source`): reading the same input twice
    gives the same keys; a change of content changes the key.
    """

    user_id: str
    user_input: str
    agent_response: str
    assistant_id: str | None
    timestamp: str | float | None
    source: str
    meta: dict = field(default_factory=dict, hash=False)

    @property
    def epoch(self) -> float | None:
        """The timestamp as epoch seconds (UTC), or ``None`` when the page has none."""
        return None if self.timestamp is None else parse_timestamp(self.timestamp)

    def to_page(self) -> dict[str, Any]:
        """The page dict the engine ingests (``timestamp`` as epoch seconds or ``None``)."""
        return {
            "user_id": self.user_id,
            "assistant_id": self.assistant_id,
            "user_input": self.user_input,
            "agent_response": self.agent_response,
            "timestamp": self.epoch,
            "source": self.source,
        }


@dataclass(frozen=True)
class Reject:
    """An input item that could not be turned into pages.

    ``line`` is the 1-based line number for line-oriented inputs (JSONL); for JSON documents
    (a top-level array or object) it is the 1-based index of the array item.
    """

    path: str
    line: int
    reason: str
    raw: str

    def __post_init__(self) -> None:
        if len(self.raw) > RAW_LIMIT:
            object.__setattr__(self, "raw", self.raw[:RAW_LIMIT])

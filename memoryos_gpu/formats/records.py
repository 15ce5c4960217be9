"""Record / Reject types shared by every reader, plus text normalisation and idempotency keys."""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from dataclasses import dataclass, field
from datetime import UTC, tzinfo
from typing import Any

from .timestamps import parse_timestamp

__all__ = [
    "MAX_SOURCE_CHARS",
    "RAW_LIMIT",
    "FormatError",
    "PageCounter",
    "Record",
    "Reject",
    "content_hash",
    "fit_name",
    "legacy_source",
    "normalise_text",
    "page_digest",
    "page_source",
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
    """12 hex digits of SHA-256 over the page's content fields: the tail of
    :func:`legacy_source` (the timestamp as written, unlike :func:`page_digest`)."""
    payload = json.dumps(
        [user_id, assistant_id, user_input, agent_response, timestamp],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def legacy_source(
    basename: str,
    position: int | str,
    sub_index: int,
    user_id: str,
    assistant_id: str | None,
    user_input: str,
    agent_response: str,
    timestamp: str | float | None,
) -> str:
    """``f"{basename}:{position}:{sub_index}:{content_hash}"``: the key that earlier versions
    gave a page (:attr:`Record.legacy_source`).

    Kept only so that a re-run recognises the pages a store took under it: it names the page's
    place in the file, so a line removed or added before a page changed the key and the page was
    stored again. A key longer than the engine's id limit (:data:`MAX_SOURCE_CHARS`) has its
    basename part shortened by :func:`fit_name`, as those versions did.
    """
    digest = content_hash(user_id, assistant_id, user_input, agent_response, timestamp)
    tail = f":{position}:{sub_index}:{digest}"
    return fit_name(basename, MAX_SOURCE_CHARS - len(tail)) + tail


def page_digest(
    user_id: str,
    assistant_id: str | None,
    user_input: str,
    agent_response: str,
    timestamp: str | float | None,
) -> bytes:
    """SHA-256 over what identifies a page: its user, assistant, both texts and its timestamp.

    The timestamp is taken as :class:`Record` keeps it (as written), not as epoch seconds: the
    epoch of a time without a zone depends on the zone it is read in, and a key must not change
    with a setting. The file, its name and the page's place in it are left out, so moving,
    renaming, compressing or piping an input, or editing other lines of it, keeps its keys.
    """
    payload = json.dumps(
        ["page/2", user_id, assistant_id, user_input, agent_response, timestamp],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).digest()


def page_source(digest: bytes, occurrence: int) -> str:
    """``"pg-{24 hex of the digest}-{occurrence}"``: a page's idempotency key.

    ``occurrence`` (from 1) numbers identical pages (same :func:`page_digest`) within one
    input, so an exchange that really happened twice ("ok" / "sure", no timestamp) is stored
    twice, while the same input read again gives the same keys and adds nothing.
    """
    return f"pg-{digest[:12].hex()}-{occurrence}"


class PageCounter:
    """How often each page digest has occurred so far in one input (:func:`page_source`).

    Every page of an input must be remembered to number a later identical one, so this holds
    8 bytes per page (a 64-bit prefix of the digest, in an open-addressing table kept at most
    half full: 16-32 bytes a page) rather than a Python dict's ~100: an input of 10 million
    pages costs ~300 MB, not 1 GB. Only digests seen twice get a dict entry.
    """

    def __init__(self) -> None:
        self._slots = array("Q", bytes(8 * 1024))
        self._used = 0
        self._repeats: dict[int, int] = {}

    def occurrence(self, digest: bytes) -> int:
        """Count one more page of ``digest``; its occurrence number (1 for the first)."""
        key = int.from_bytes(digest[:8], "big") or 1  # 0 marks an empty slot
        if self._insert(key):
            return 1
        n = self._repeats.get(key, 1) + 1
        self._repeats[key] = n
        return n

    def _insert(self, key: int) -> bool:
        """Put ``key`` in the table; False when it was there already."""
        slots = self._slots
        mask = len(slots) - 1
        i = key & mask
        while slots[i]:
            if slots[i] == key:
                return False
            i = (i + 1) & mask
        slots[i] = key
        self._used += 1
        if 2 * self._used > len(slots):
            self._grow()
        return True

    def _grow(self) -> None:
        old = self._slots
        self._slots = array("Q", bytes(16 * len(old)))
        mask = len(self._slots) - 1
        for key in old:
            if key:
                i = key & mask
                while self._slots[i]:
                    i = (i + 1) & mask
                self._slots[i] = key


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
    ``source`` is a stable idempotency key (see :func:`page_source`): reading the same input
    twice, from wherever and however (renamed, moved, gzipped, piped), gives the same keys; a
    change of content changes the key. ``legacy_source`` is the key earlier versions gave it
    (:func:`legacy_source`), which a re-run also looks for so a store they filled is not filled
    twice. ``line`` is the 1-based line (or item index) it came from, for reports only.
    ``generated_user``: the input named no user, so ``user_id`` was derived from the
    conversation's content (``conv-...``).
    """

    user_id: str
    user_input: str
    agent_response: str
    assistant_id: str | None
    timestamp: str | float | None
    source: str
    meta: dict = field(default_factory=dict, hash=False)
    line: int = 0
    legacy_source: str | None = None
    generated_user: bool = False

    @property
    def epoch(self) -> float | None:
        """The timestamp as epoch seconds (UTC), or ``None`` when the page has none."""
        return None if self.timestamp is None else parse_timestamp(self.timestamp)

    def to_page(self, zone: tzinfo | None = UTC) -> dict[str, Any]:
        """The page dict the engine ingests (``timestamp`` as epoch seconds or ``None``; one
        written without a zone read in ``zone``: ``ingest --timezone``). ``ValueError`` when
        the zone moves it out of the years 1-9999."""
        return {
            "user_id": self.user_id,
            "assistant_id": self.assistant_id,
            "user_input": self.user_input,
            "agent_response": self.agent_response,
            "timestamp": None if self.timestamp is None else parse_timestamp(self.timestamp, zone),
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

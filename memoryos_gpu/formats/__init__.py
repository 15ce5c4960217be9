"""Chat-log readers: JSONL pages, LoCoMo, ShareGPT and OpenAI chat messages, and the files
``memoryos-gpu export`` writes -> pages.

``read_records(path, format="auto")`` streams :class:`Record` (one page) and :class:`Reject`
(one unusable input item, with file, line and reason) objects. See ``docs/formats.md``.

Modules: ``readers`` (container and format detection, reading lines and JSON documents),
``opening`` (gzip and pipes), ``converters`` (one item -> pages, per format), ``locomo`` (raw
LoCoMo conversations for the evaluation), ``exports`` (an export's pages, to bring a user into
another store), ``records`` (``Record`` / ``Reject``, page keys), ``timestamps``.
"""

from pathlib import Path

from .exports import EXPORT_FORMAT, EXPORT_VERSION, is_export
from .locomo import iter_locomo_conversations, locomo_conversation_records
from .opening import open_binary
from .readers import FORMATS, HAVE_IJSON, detect_format, read_records
from .records import (
    RAW_LIMIT,
    FormatError,
    PageCounter,
    Record,
    Reject,
    content_hash,
    legacy_source,
    normalise_text,
    page_digest,
    page_source,
)
from .timestamps import parse_timestamp


def sample_chats_path() -> Path:
    """The bundled quick-start sample (JSONL pages: 3 users x 25 exchanges)."""
    return Path(__file__).resolve().parent.parent / "data" / "sample_chats.jsonl"


__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "FORMATS",
    "HAVE_IJSON",
    "RAW_LIMIT",
    "FormatError",
    "PageCounter",
    "Record",
    "Reject",
    "content_hash",
    "detect_format",
    "is_export",
    "iter_locomo_conversations",
    "legacy_source",
    "locomo_conversation_records",
    "normalise_text",
    "open_binary",
    "page_digest",
    "page_source",
    "parse_timestamp",
    "read_records",
    "sample_chats_path",
]

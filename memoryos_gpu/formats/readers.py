"""Streaming readers: chat logs in several formats -> :class:`Record` pages or :class:`Reject` s.

Containers (found from the first non-blank bytes, after transparent gunzip by magic bytes):

* **lines** (JSONL): one JSON object per line, read line by line;
* **array**: a top-level JSON array, streamed item by item with ``ijson`` (falls back to
  ``json.load`` of the whole document when ``ijson`` is not installed);
* **document**: one pretty-printed top-level object (first non-blank line is exactly ``{``),
  e.g. a single LoCoMo conversation; parsed as a whole (one item).

Formats (what an item holds): ``jsonl`` (one page per item), ``locomo``, ``sharegpt``, ``openai``,
``export`` (what ``memoryos-gpu export`` wrote: one user's pages; :mod:`.exports`).
See ``docs/formats.md`` for the field-by-field rules.

This module finds the container and the format (:func:`detect_format`) and reads the items
(lines capped in length, :func:`iter_capped_lines`; JSON documents streamed); opening the input
(gzip, pipes) is :mod:`.opening`, turning an item into pages is :mod:`.converters`, and the raw
LoCoMo conversations the evaluation reads are :mod:`.locomo`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from .converters import _CONVERTERS, _convert, _Ctx, _dump
from .exports import _convert_export, is_export
from .opening import (
    _HEAD_BYTES,
    _Opened,
    check_integrity,
    foreign_encoding,
    is_stream,
    open_head,
)
from .records import RAW_LIMIT, FormatError, PageCounter, Record, Reject

try:  # optional: streaming of JSON documents
    import ijson  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - exercised only without ijson
    ijson = None

__all__ = [
    "FORMATS",
    "HAVE_IJSON",
    "MAX_DEPTH",
    "MAX_LINE_BYTES",
    "LongLine",
    "detect_format",
    "iter_capped_lines",
    "read_records",
]

FORMATS = ("jsonl", "locomo", "sharegpt", "openai", "export")
#: The converter of each format: the chat-log formats' (:mod:`.converters`) and exports'.
_FORMAT_CONVERTERS = {**_CONVERTERS, "export": _convert_export}
HAVE_IJSON = ijson is not None
# errors that a malformed JSON document raises while streaming (ijson's are not ValueErrors)
_DOC_ERRORS: tuple[type[BaseException], ...] = (ValueError, RecursionError, UnicodeDecodeError)
if ijson is not None:
    _DOC_ERRORS += (ijson.JSONError,)

_UTF8_BOM = b"\xef\xbb\xbf"
_SNIFF_LINES = 100  # auto-detection looks at up to this many non-blank lines

# The engine's limit of a page's text field (memoryos_gpu.engine.validation.MAX_TEXT_CHARS; not
# imported: the engine package is heavy).
_PAGE_TEXT_CHARS = 1_000_000
#: The longest input line read. A JSONL page at the engine's limits is at most two text fields of
#: ``_PAGE_TEXT_CHARS`` characters, each up to 12 bytes as JSON (an astral character written with
#: ``ensure_ascii``: two ``\\uXXXX`` escapes), plus its other fields (1 MiB). A longer line cannot
#: be a valid page, so it is rejected and read past without being held: one huge or unterminated
#: line must not take the memory that reading it whole would (bytes, text and parse: ~4x its size).
MAX_LINE_BYTES = 2 * _PAGE_TEXT_CHARS * 12 + (1 << 20)
_SKIP_CHUNK = 1 << 20  # bytes per read while skipping the rest of a line too long
#: The deepest nesting of JSON arrays and objects an input item may have (a ShareGPT, OpenAI or
#: LoCoMo item is 3 to 6 levels deep; tool-call arguments add a few). A deeper item is rejected:
#: Python's ``json`` recurses once per level (about 1,000 crash it), and a streamed item is cut
#: off at this depth before it is built, so a small file nested 100,000 deep takes no memory.
MAX_DEPTH = 100
_TOO_DEEP = f"item nested deeper than {MAX_DEPTH} levels of JSON arrays and objects"
_OPENS = ("start_map", "start_array")
_CLOSES = ("end_map", "end_array")


# --------------------------------------------------------------------------------------------
# lines, and sniffing the container


@dataclass(frozen=True)
class LongLine:
    """A line longer than the cap of :func:`iter_capped_lines`: its first bytes and its size
    (newline included), not its content."""

    prefix: bytes
    size: int


def iter_capped_lines(f: IO[bytes], cap: int | None = None) -> Iterator[bytes | LongLine]:
    """The lines of ``f`` (newline included), each at most ``cap`` bytes before its newline
    (default :data:`MAX_LINE_BYTES`); a longer one is read past in chunks and yields a
    :class:`LongLine`, so memory stays bounded by ``cap`` whatever the input."""
    limit = MAX_LINE_BYTES if cap is None else cap
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        prefix, size = line[: 4 * RAW_LIMIT], len(line)
        del line
        yield LongLine(prefix, _skip_line(f, size))


def _skip_line(f: IO[bytes], size: int) -> int:
    """Read ``f`` past the end of the current line; the line's total size."""
    while True:
        chunk = f.readline(_SKIP_CHUNK)
        size += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return size


def _line_bytes(item: bytes | LongLine, first: bool) -> bytes:
    """A line's bytes (a long line's prefix), without the BOM of the input's first line."""
    line = item.prefix if isinstance(item, LongLine) else item
    return line[len(_UTF8_BOM) :] if first and line.startswith(_UTF8_BOM) else line


def _first_nonblank_line(f: IO[bytes]) -> bytes | None:
    """The first non-blank line, stripped (only its start when it is very long)."""
    for i, item in enumerate(iter_capped_lines(f, _SKIP_CHUNK)):
        stripped = _line_bytes(item, i == 0).strip()
        if stripped:
            return stripped
    return None


def _container(path: str | os.PathLike[str]) -> str:
    """``"lines"``, ``"array"``, ``"document"`` or ``"empty"``."""
    with _Opened(path, sniff=True) as f:
        first = _first_nonblank_line(f)
    if first is None:
        return "empty"
    if first.startswith(b"["):
        return "array"
    if first == b"{":
        return "document"
    return "lines"


def _skip_bom(f: IO[bytes]) -> IO[bytes]:
    """``f`` past a leading UTF-8 BOM; by peeking where it can (a pipe cannot seek back)."""
    peek = getattr(f, "peek", None)
    if peek is not None:
        if peek(3)[:3] == _UTF8_BOM:
            f.read(3)
    elif f.read(3) != _UTF8_BOM:
        f.seek(0)
    return f


# --------------------------------------------------------------------------------------------
# format classification


def _classify(obj: object) -> str | None:
    if not isinstance(obj, dict):
        return None
    if is_export(obj):
        return "export"
    conv = obj.get("conversation")
    if isinstance(conv, dict) and "speaker_a" in conv:
        return "locomo"
    if isinstance(obj.get("conversations"), list):
        return "sharegpt"
    if isinstance(obj.get("messages"), list):
        return "openai"
    if "user_input" in obj or "agent_response" in obj:
        return "jsonl"
    if "qa" in obj and "conversation" in obj:
        return "locomo"
    return None


_DETECT_HINT = (
    "expected JSON objects with user_input/agent_response (jsonl), conversations (sharegpt), "
    "messages (openai), conversation.speaker_a (locomo) or user and pages (export: a file "
    "that memoryos-gpu export wrote); name the format to override "
    "(--format on the command line, format= in Python)"
)


def detect_format(path: str | os.PathLike[str]) -> str:
    """Detect ``path``'s format from its first records; :class:`FormatError` when unsure."""
    container = _container(path)
    if container == "empty":
        raise FormatError(f"cannot detect the format of {os.fspath(path)!r}: the input is empty")
    if container == "lines":
        return _detect_lines(path)
    try:
        first = _first_document_item(path, container)
    except _DOC_ERRORS as exc:
        ahead = (
            f"; a pipe is sniffed from its first {_HEAD_BYTES} bytes: give the format"
            if is_stream(path)
            else ""
        )
        raise FormatError(
            f"cannot detect the format of {os.fspath(path)!r}: invalid JSON ({exc}){ahead}"
        ) from None
    fmt = _classify(first[1]) if first is not None else None
    if fmt is None:
        what = "is empty" if first is None else "is not a recognisable record"
        if first is not None and isinstance(first[1], _TooDeep):
            what = f"is nested deeper than {MAX_DEPTH} levels"
        raise FormatError(
            f"cannot detect the format of {os.fspath(path)!r}: the first JSON {container} "
            f"item {what}; {_DETECT_HINT}"
        )
    return fmt


def _detect_lines(path: str | os.PathLike[str]) -> str:
    """The format of a JSONL input: the first of its first :data:`_SNIFF_LINES` non-blank lines
    that is a recognisable record decides; :class:`FormatError` when none is."""
    f, complete = open_head(path)
    seen = 0
    cut = False  # the last line looked at ends where a pipe's read-ahead ends
    undecodable = None  # the first line looked at that is not UTF-8 text, and why
    with f:
        for i, item in enumerate(iter_capped_lines(f)):
            line = _line_bytes(item, i == 0)
            if i == 0 and (foreign := foreign_encoding(line)) is not None:
                raise FormatError(
                    f"cannot detect the format of {os.fspath(path)!r}: it is {foreign}"
                )
            if not line.strip():
                continue
            seen += 1
            if seen > _SNIFF_LINES:
                break
            cut = not complete and not (isinstance(item, bytes) and item.endswith(b"\n"))
            if isinstance(item, LongLine):
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                where = f"invalid UTF-8 at line {i + 1} byte {exc.start}: {exc.reason}"
                undecodable = undecodable or where
                continue
            if "\x00" in text and undecodable is None:  # UTF-16/32 without a byte-order mark
                undecodable = f"NUL bytes at line {i + 1}: UTF-16 or UTF-32 text?"
            try:
                fmt = _classify(json.loads(text))
            except (ValueError, RecursionError):
                continue
            if fmt is not None:
                return fmt
    if cut and seen == 1:
        raise FormatError(
            f"cannot detect the format of {os.fspath(path)!r}: its first line is longer than "
            "what a pipe is read ahead to detect the format from (a gzip pipe: what its first "
            f"{_HEAD_BYTES} bytes decompress to; a plain pipe: a first line up to "
            f"{MAX_LINE_BYTES} bytes); name the format (--format on the command line, "
            "format= in Python)"
        )
    if undecodable is not None:  # a Latin-1 or UTF-16 file: say so, not "no record"
        raise FormatError(
            f"cannot detect the format of {os.fspath(path)!r}: it is not UTF-8 ({undecodable}); "
            f"none of the first {min(seen, _SNIFF_LINES)} non-blank lines is a recognisable "
            "record. Convert it to UTF-8 first (iconv -f ITS-ENCODING -t UTF-8)"
        )
    raise FormatError(
        f"cannot detect the format of {os.fspath(path)!r}: none of the first "
        f"{min(seen, _SNIFF_LINES)} non-blank lines is a recognisable record; {_DETECT_HINT}"
    )


def _first_document_item(path: str | os.PathLike[str], container: str) -> tuple[int, object] | None:
    """The first item of a JSON array or document that is not nested too deeply (such an
    item is rejected on its own when read, so it must not decide the format), looking at up
    to :data:`_SNIFF_LINES` items; the first item when all are too deep, ``None`` when there
    is none."""
    first = None
    for got in _iter_document_items(path, container, sniff=True):
        if not isinstance(got[1], _TooDeep):
            return got
        first = first or got
        if got[0] >= _SNIFF_LINES:
            break
    return first


# --------------------------------------------------------------------------------------------
# containers


def _iter_lines(path: str | os.PathLike[str], fmt: str) -> Iterator[Record | Reject]:
    convert = _FORMAT_CONVERTERS[fmt]
    spath = os.fspath(path)
    basename = os.path.basename(spath)
    seen = PageCounter()
    with _Opened(path) as f:
        for lineno, item in enumerate(iter_capped_lines(f), 1):
            stripped = _line_bytes(item, lineno == 1).strip()
            if not stripped:
                continue
            if isinstance(item, LongLine):
                yield _long_line_reject(spath, lineno, item)
                continue
            try:
                text = stripped.decode("utf-8")
            except UnicodeDecodeError as exc:
                reason = f"invalid UTF-8 at byte {exc.start}: {exc.reason}"
                yield Reject(spath, lineno, reason, stripped.decode("utf-8", "replace"))
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                yield Reject(spath, lineno, f"invalid JSON: {exc.msg} (column {exc.colno})", text)
                continue
            except RecursionError:
                yield Reject(spath, lineno, _TOO_DEEP, text)
                continue
            except ValueError as exc:
                yield Reject(spath, lineno, f"invalid JSON: {exc}", text)
                continue
            if _too_deep_line(text, obj):
                yield Reject(spath, lineno, _TOO_DEEP, text)
                continue
            ctx = _Ctx(basename, lineno, seen)
            yield from _convert(convert, obj, ctx, spath, lambda t=text: t)


def _too_deep_line(text: str, obj: object) -> bool:
    """Whether the item ``obj`` parsed from ``text`` is nested deeper than :data:`MAX_DEPTH`.
    Walked only when ``text`` has more brackets than that (counted in C: most lines do not)."""
    return text.count("[") + text.count("{") > MAX_DEPTH and _depth_exceeds(obj, MAX_DEPTH)


def _depth_exceeds(obj: object, limit: int) -> bool:
    """Whether ``obj`` nests arrays and objects (lists, dicts) more than ``limit`` deep; without
    recursion, so any depth the parser built is walked safely."""
    stack = [(obj, 1)] if isinstance(obj, dict | list) else []
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _long_line_reject(path: str, lineno: int, item: LongLine) -> Reject:
    """The reject of a line too long to be read (:func:`iter_capped_lines`)."""
    reason = f"line longer than {MAX_LINE_BYTES} bytes ({item.size} bytes); skipped"
    return Reject(path, lineno, reason, item.prefix.decode("utf-8", "replace"))


def _iter_document_items(
    path: str | os.PathLike[str], container: str, sniff: bool = False
) -> Iterator[tuple[int, object]]:
    """(1-based index, item) of a JSON array, or (1, object) of a single-object document.

    Streams with ``ijson`` when available (memory: one item at a time); otherwise loads the
    whole document with ``json.load`` (memory: the whole document). Raises ``ValueError``
    (or ``ijson``'s errors, which subclass it) on malformed JSON.
    """
    with _Opened(path, sniff) as f:
        stream = _skip_bom(f)
        if ijson is not None:
            yield from enumerate(_stream_items(stream, container), 1)
            return
        doc = json.loads(stream.read().decode("utf-8"))
        if container == "array":
            if not isinstance(doc, list):
                raise ValueError("top-level JSON value is not an array")
            items = doc
        else:
            items = [doc]
        for i, item in enumerate(items, 1):
            yield i, (_TooDeep() if _depth_exceeds(item, MAX_DEPTH) else item)


class _TooDeep:
    """Stands for an item nested deeper than :data:`MAX_DEPTH`, which was not built."""


def _stream_items(stream: IO[bytes], container: str) -> Iterator[object]:
    """The items of a JSON array (``container == "array"``) or the one value of a document,
    built from ``ijson``'s events; an item nested deeper than :data:`MAX_DEPTH` is a
    :class:`_TooDeep`.

    Why not ``ijson.items``: it builds an item of any depth, and the path it gives each event
    grows with the depth (a 200 KB item nested 100,000 deep took 22 GB). Here the building
    stops at the limit and the rest of the item is only parsed past. One loop, without a
    builder object: as fast as ``ijson.items``, which spends its time on those paths."""
    events = ijson.basic_parse(stream, use_float=True)
    if container == "array":
        first = next(events, None)
        if first is None or first[0] != "start_array":
            raise ValueError("top-level JSON value is not an array")
    stack: list[Any] = []  # the containers open in the current item, innermost last
    key = None  # the key of the next value in the innermost object
    skip = 0  # containers open in an item too deep, which is parsed past, not built
    for event, value in events:
        if skip:
            skip += event in _OPENS
            skip -= event in _CLOSES
            if not skip:
                yield _TooDeep()
            continue
        if event == "map_key":
            key = value
            continue
        if event in _CLOSES:
            if not stack:  # the top-level array ends
                break
            value = stack.pop()
            if not stack:
                yield value
            continue
        opens = event in _OPENS
        if opens:
            if len(stack) == MAX_DEPTH:
                skip = len(stack) + 1
                stack.clear()
                continue
            value = {} if event == "start_map" else []
        if not stack:
            if opens:
                stack.append(value)
            else:
                yield value  # a scalar item
            continue
        top = stack[-1]
        if type(top) is list:
            top.append(value)
        else:
            top[key] = value
        if opens:
            stack.append(value)
    for _ in events:  # let ijson report anything after the array
        pass


def _iter_document(
    path: str | os.PathLike[str], fmt: str, container: str
) -> Iterator[Record | Reject]:
    convert = _FORMAT_CONVERTERS[fmt]
    spath = os.fspath(path)
    basename = os.path.basename(spath)
    seen = PageCounter()
    index = 0
    items = _iter_document_items(path, container)
    while True:
        try:
            got = next(items, None)
        except _DOC_ERRORS as exc:
            # a syntax error in a JSON document cannot be resynchronised: report and stop
            reason = f"invalid JSON document after item {index}: {exc}; reading stopped"
            yield Reject(spath, index + 1, reason, "")
            return
        if got is None:
            return
        index, obj = got
        if isinstance(obj, _TooDeep):
            yield Reject(spath, index, _TOO_DEEP, "")
            continue
        ctx = _Ctx(basename, index, seen)
        yield from _convert(convert, obj, ctx, spath, lambda o=obj: _dump(o))


def read_records(path: str | os.PathLike[str], format: str = "auto") -> Iterator[Record | Reject]:
    """Stream the pages of ``path`` as :class:`Record` s, with a :class:`Reject` per bad item.

    ``format``: ``"auto"`` (default; detected from the first records, :class:`FormatError` if
    that fails), or one of :data:`FORMATS` to override. Gzip input is recognised by its magic
    bytes. An empty input yields nothing. Detection happens when this function is called; the
    file is then read lazily as the iterator is consumed. A gzip file is first decompressed
    once to its end, every member's CRC and length checked: a corrupt one raises
    :class:`~.opening.CorruptInputError` (an ``OSError``) before any record is read. A gzip
    pipe cannot be read twice: its corruption raises where the read reaches it.
    """
    if format != "auto" and format not in FORMATS:
        raise FormatError(f"unknown format {format!r}; expected 'auto' or one of {FORMATS}")
    check_integrity(path)  # a corrupt gzip file is refused whole, before any record is read
    container = _container(path)
    if container == "empty":
        return iter(())
    fmt = detect_format(path) if format == "auto" else format
    if container == "lines":
        return _iter_lines(path, fmt)
    return _iter_document(path, fmt, container)

"""Streaming readers: chat logs in several formats -> :class:`Record` pages or :class:`Reject` s.

Containers (found from the first non-blank bytes, after transparent gunzip by magic bytes):

* **lines** (JSONL): one JSON object per line, read line by line;
* **array**: a top-level JSON array, streamed item by item with ``ijson`` (falls back to
  ``json.load`` of the whole document when ``ijson`` is not installed);
* **document**: one pretty-printed top-level object (first non-blank line is exactly ``{``),
  e.g. a single LoCoMo conversation; parsed as a whole (one item).

Formats (what an item holds): ``jsonl`` (one page per item), ``locomo``, ``sharegpt``, ``openai``.
See ``docs/formats.md`` for the field-by-field rules.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import stat
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from .records import (
    MAX_SOURCE_CHARS,
    RAW_LIMIT,
    FormatError,
    PageCounter,
    Record,
    Reject,
    fit_name,
    legacy_source,
    normalise_text,
    page_digest,
    page_source,
)
from .timestamps import parse_timestamp

try:  # optional: streaming of JSON documents
    import ijson  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - exercised only without ijson
    ijson = None

__all__ = [
    "FORMATS",
    "HAVE_IJSON",
    "MAX_LINE_BYTES",
    "LongLine",
    "detect_format",
    "generated_user",
    "is_stream",
    "iter_capped_lines",
    "iter_locomo_conversations",
    "locomo_conversation_records",
    "open_binary",
    "open_head",
    "read_records",
]

FORMATS = ("jsonl", "locomo", "sharegpt", "openai")
HAVE_IJSON = ijson is not None
# errors that a malformed JSON document raises while streaming (ijson's are not ValueErrors)
_DOC_ERRORS: tuple[type[BaseException], ...] = (ValueError, RecursionError, UnicodeDecodeError)
if ijson is not None:
    _DOC_ERRORS += (ijson.JSONError,)

_GZIP_MAGIC = b"\x1f\x8b"
_UTF8_BOM = b"\xef\xbb\xbf"
_SNIFF_LINES = 100  # auto-detection looks at up to this many non-blank lines
_SESSION_RE = re.compile(r"session_(\d+)")

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
# Read ahead from a pipe to detect its format (it cannot be read twice), and the most that the
# read-ahead of a gzip pipe may decompress to.
_HEAD_BYTES = 4 << 20
_HEAD_PLAIN_BYTES = 16 << 20

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": None,
    # tool traffic is not part of the user/assistant dialogue
    "function_call": None,
    "observation": None,
    "tool": None,
}
_OPENAI_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": None,
    "developer": None,
    "tool": None,
    "function": None,
}
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


# --------------------------------------------------------------------------------------------
# opening and sniffing


def is_stream(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a pipe, socket or terminal (``/dev/stdin`` fed by a pipe, a process
    substitution ``<(...)``): readable once, not seekable. Such an input is sniffed from a
    read-ahead kept in memory (:func:`open_head`) and read in full only once (:func:`open_binary`).
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISBLK(mode) or stat.S_ISDIR(mode))


class _Chain(io.RawIOBase):
    """The bytes already read ahead from a pipe, then the rest of the pipe."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head = memoryview(head)
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self._head:
            n = min(len(buf), len(self._head))
            buf[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._rest.readinto(buf)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._head = memoryview(b"")
        self._rest.close()
        super().close()


@dataclass
class _Pipe:
    """A stream input: its read-ahead (raw and, for gzip, decompressed), the open stream."""

    head: bytes
    plain: bytes  # ``head`` decompressed when gzip (a prefix of the content), else ``head``
    eof: bool  # the read-ahead holds the whole input
    rest: IO[bytes] | None  # None once handed to the full read


_PIPES: dict[tuple[int, int], _Pipe] = {}
_PIPES_LOCK = threading.Lock()


def _pipe(path: str | os.PathLike[str]) -> _Pipe:
    """The one :class:`_Pipe` of a stream input (keyed by device and inode, so ``/dev/stdin``
    and ``/dev/fd/0`` are the same), opened and read ahead on first use."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino)
    with _PIPES_LOCK:
        got = _PIPES.get(key)
        if got is None:
            f = open(path, "rb")  # noqa: SIM115 - kept until the full read takes it
            head = f.read(_HEAD_BYTES)
            plain = head
            if head[:2] == _GZIP_MAGIC:
                try:
                    plain = zlib.decompressobj(31).decompress(head, _HEAD_PLAIN_BYTES)
                except zlib.error:
                    plain = b""  # corrupt: the full read reports where it breaks
            got = _PIPES[key] = _Pipe(head, plain, len(head) < _HEAD_BYTES, f)
        return got


def open_head(path: str | os.PathLike[str]) -> tuple[IO[bytes], bool]:
    """``(stream, complete)`` to sniff ``path`` from: the file itself (``complete``), or for a
    stream input (:func:`is_stream`) its read-ahead, decompressed (``complete`` when it holds
    the whole input). Reading it does not consume the input."""
    if not is_stream(path):
        return open_binary(path), True
    p = _pipe(path)
    return io.BytesIO(p.plain), p.eof


def open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open ``path`` for binary reading, gunzipping transparently when it starts with gzip magic.

    Detection is by content (the two magic bytes), not by file extension. A stream input
    (:func:`is_stream`) can be opened so only once: ``OSError`` the second time.
    """
    if is_stream(path):
        return _open_stream(path)
    f = open(path, "rb")  # noqa: SIM115 - returned to the caller
    try:
        magic = f.read(2)
    except BaseException:
        f.close()
        raise
    if magic == _GZIP_MAGIC:
        f.close()
        return gzip.open(path, "rb")  # type: ignore[return-value]
    f.seek(0)
    return f


def _open_stream(path: str | os.PathLike[str]) -> IO[bytes]:
    """The whole of a stream input: its read-ahead, then the rest (gunzipped when gzip)."""
    p = _pipe(path)
    with _PIPES_LOCK:
        rest, p.rest = p.rest, None
    if rest is None:
        raise OSError(f"{os.fspath(path)} is a pipe and was read already: it can be read once")
    gz = p.head[:2] == _GZIP_MAGIC
    raw = io.BufferedReader(_Chain(p.head, rest), 1 << 16)
    p.head = b""  # the chain holds it now; ``plain`` stays for later sniffing
    return gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw  # type: ignore[return-value]


class _Opened:
    """``with _Opened(path) as f``: :func:`open_binary` (``sniff``: :func:`open_head`) as a
    context manager."""

    def __init__(self, path: str | os.PathLike[str], sniff: bool = False) -> None:
        self.f = open_head(path)[0] if sniff else open_binary(path)

    def __enter__(self) -> IO[bytes]:
        return self.f

    def __exit__(self, *exc: object) -> None:
        self.f.close()


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
    "messages (openai) or conversation.speaker_a (locomo); pass format= explicitly to override"
)


def detect_format(path: str | os.PathLike[str]) -> str:
    """Detect ``path``'s format from its first records; :class:`FormatError` when unsure."""
    container = _container(path)
    if container == "empty":
        raise FormatError(f"cannot detect the format of {os.fspath(path)!r}: the input is empty")
    if container == "lines":
        with _Opened(path, sniff=True) as f:
            seen = 0
            for i, item in enumerate(iter_capped_lines(f)):
                line = _line_bytes(item, i == 0)
                if not line.strip():
                    continue
                seen += 1
                if seen > _SNIFF_LINES:
                    break
                if isinstance(item, LongLine):
                    continue
                try:
                    fmt = _classify(json.loads(line.decode("utf-8")))
                except (ValueError, RecursionError):
                    continue
                if fmt is not None:
                    return fmt
        raise FormatError(
            f"cannot detect the format of {os.fspath(path)!r}: none of the first "
            f"{min(seen, _SNIFF_LINES)} non-blank lines is a recognisable record; {_DETECT_HINT}"
        )
    try:
        first = next(iter(_iter_document_items(path, container, sniff=True)), None)
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
        raise FormatError(
            f"cannot detect the format of {os.fspath(path)!r}: the first JSON {container} "
            f"item {what}; {_DETECT_HINT}"
        )
    return fmt


# --------------------------------------------------------------------------------------------
# item -> pages conversion


class _Invalid(Exception):
    """The whole item is unusable (reason in args[0])."""


@dataclass
class _Bad:
    """Part of an item is unusable; ``raw`` is the offending part (``None``: the whole item)."""

    reason: str
    raw: Any = None


@dataclass
class _Ctx:
    basename: str
    position: int  # 1-based line (lines) or item index (documents)
    seen: PageCounter  # the input's pages so far: one counter per input (page_source)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{what} must be a string, got {type(value).__name__}")
    return normalise_text(value)


def _opt_str(obj: dict, key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    return _text(value, key)


def _timestamp(value: object, what: str = "timestamp") -> str | float | None:
    """Validate a timestamp; keep strings as written (normalised), numbers as float."""
    if value is None:
        return None
    try:
        parse_timestamp(value)
    except ValueError as exc:
        raise _Invalid(f"{what}: {exc}") from None
    return normalise_text(value) if isinstance(value, str) else float(value)  # type: ignore[arg-type]


def _record(
    ctx: _Ctx,
    sub: int,
    user_id: str,
    assistant_id: str | None,
    user_input: str,
    agent_response: str,
    timestamp: str | float | None,
    meta: dict,
    generated: bool = False,
) -> Record:
    """The page, keyed by its content and its occurrence among identical pages of the input
    (:func:`page_source`); ``generated``: ``user_id`` was derived, the input named none."""
    content = (user_id, assistant_id, user_input, agent_response, timestamp)
    digest = page_digest(*content)
    old_user = _legacy_user(ctx) if generated else user_id
    return Record(
        user_id=user_id,
        user_input=user_input,
        agent_response=agent_response,
        assistant_id=assistant_id,
        timestamp=timestamp,
        source=page_source(digest, ctx.seen.occurrence(digest)),
        meta=meta,
        line=ctx.position,
        legacy_source=legacy_source(ctx.basename, ctx.position, sub, old_user, *content[1:]),
        generated_user=generated,
    )


def _pair(turns: list[tuple[str, Any]]) -> list[tuple[Any, Any]]:
    """Pair ``(role, turn)`` items: a user turn with the following assistant turn.

    A user turn not followed by an assistant turn pairs with ``None``; an assistant turn not
    preceded by an unpaired user turn pairs with ``None`` on the user side. Nothing is dropped.
    """
    out: list[tuple[Any, Any]] = []
    pending: Any = None
    for role, turn in turns:
        if role == "user":
            if pending is not None:
                out.append((pending, None))
            pending = turn
        else:
            out.append((pending, turn))
            pending = None
    if pending is not None:
        out.append((pending, None))
    return out


def _convert_page(obj: dict, ctx: _Ctx) -> list[Record | _Bad]:
    for key in ("user_id", "user_input", "agent_response"):
        if key not in obj:
            raise _Invalid(f"missing field {key!r}")
    user_id = _text(obj["user_id"], "user_id")
    if not user_id:
        raise _Invalid("user_id is empty")
    meta = obj.get("meta")
    return [
        _record(
            ctx,
            0,
            user_id,
            _opt_str(obj, "assistant_id"),
            _text(obj["user_input"], "user_input"),
            _text(obj["agent_response"], "agent_response"),
            _timestamp(obj.get("timestamp")),
            dict(meta) if isinstance(meta, dict) else {},
        )
    ]


def _legacy_user(ctx: _Ctx) -> str:
    """``"{basename}:{position}"``: the user earlier versions gave a conversation that names
    none; needed only to rebuild the :func:`legacy_source` of its pages."""
    tail = f":{ctx.position}"
    return fit_name(ctx.basename, MAX_SOURCE_CHARS - len(tail)) + tail


def generated_user(content: object) -> str:
    """``"conv-{16 hex}"``: the user of a conversation that names none, from its content.

    A hash of the conversation itself (not of the file, its name or the line) so the same
    conversation gets the same user wherever and however it is read (renamed, moved, gzipped,
    piped), and two different conversations never share one (64 bits: a collision is unlikely
    below billions of conversations). ``conv-`` marks it as generated.
    """
    payload = json.dumps(content, ensure_ascii=False, sort_keys=True, default=str)
    digest = hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()
    return f"conv-{digest[:16]}"


def _conversation_user(obj: dict, turns: list[tuple[str, int, str, object]]) -> tuple[str, bool]:
    """``(user_id, generated)``: ``user_id``, else ``id``, else :func:`generated_user` of the
    dialogue (roles, texts, timestamps, assistant)."""
    if obj.get("user_id") is not None:
        user_id = _text(obj["user_id"], "user_id")
    elif isinstance(obj.get("id"), (str, int)) and not isinstance(obj.get("id"), bool):
        user_id = normalise_text(str(obj["id"]))
    else:
        dialogue = [[t[0], t[2], t[3]] for t in turns]
        return generated_user([obj.get("assistant_id"), obj.get("timestamp"), dialogue]), True
    if not user_id:
        raise _Invalid("user id is empty")
    return user_id, False


def _convert_turns(
    obj: dict,
    ctx: _Ctx,
    turns: list[tuple[str, int, str, object]],
) -> list[Record | _Bad]:
    """Shared tail of sharegpt/openai: ``turns`` = (role, index, text, turn timestamp)."""
    user_id, generated = _conversation_user(obj, turns)
    assistant_id = _opt_str(obj, "assistant_id")
    conv_ts = _timestamp(obj.get("timestamp"))
    conv_id = obj.get("id")
    out: list[Record | _Bad] = []
    for sub, (u, a) in enumerate(_pair([(t[0], t) for t in turns])):
        ts = conv_ts
        for t in (u, a):
            if t is not None and t[3] is not None:
                ts = _timestamp(t[3], f"turn {t[1]} timestamp")
                break
        meta: dict[str, Any] = {"turns": [t[1] for t in (u, a) if t is not None]}
        if isinstance(conv_id, (str, int)) and not isinstance(conv_id, bool):
            meta["conversation_id"] = conv_id
        out.append(
            _record(
                ctx,
                sub,
                user_id,
                assistant_id,
                u[2] if u is not None else "",
                a[2] if a is not None else "",
                ts,
                meta,
                generated,
            )
        )
    return out


def _convert_sharegpt(obj: dict, ctx: _Ctx) -> list[Record | _Bad]:
    conv = obj.get("conversations")
    if not isinstance(conv, list):
        raise _Invalid("missing or non-list field 'conversations'")
    turns = []
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict):
            raise _Invalid(f"conversations[{i}] is not an object")
        who = turn.get("from", turn.get("role"))
        if not isinstance(who, str):
            raise _Invalid(f"conversations[{i}] has no string 'from'")
        if who.lower() not in _SHAREGPT_ROLES:
            raise _Invalid(f"conversations[{i}] has unknown role {who!r}")
        role = _SHAREGPT_ROLES[who.lower()]
        if role is None:
            continue
        if "value" not in turn:
            raise _Invalid(f"conversations[{i}] has no 'value'")
        text = _text(turn["value"], f"conversations[{i}].value")
        turns.append((role, i, text, turn.get("timestamp")))
    return _convert_turns(obj, ctx, turns)


def _openai_content(content: object, i: int) -> str | None:
    if content is None:
        return None
    if isinstance(content, str):
        return normalise_text(content)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                if part.get("type") in _TEXT_PART_TYPES:
                    parts.append(_text(part.get("text"), f"messages[{i}].content[{j}].text"))
                # non-text parts (images, audio, files) carry no text: ignored
            else:
                raise _Invalid(f"messages[{i}].content[{j}] is not a text part")
        return normalise_text("\n".join(parts))
    raise _Invalid(f"messages[{i}].content must be a string or a list of parts")


def _convert_openai(obj: dict, ctx: _Ctx) -> list[Record | _Bad]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list):
        raise _Invalid("missing or non-list field 'messages'")
    turns = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise _Invalid(f"messages[{i}] is not an object")
        who = msg.get("role")
        if not isinstance(who, str):
            raise _Invalid(f"messages[{i}] has no string 'role'")
        if who not in _OPENAI_ROLES:
            raise _Invalid(f"messages[{i}] has unknown role {who!r}")
        role = _OPENAI_ROLES[who]
        if role is None:
            continue
        text = _openai_content(msg.get("content"), i)
        if text is None:  # e.g. an assistant message holding only tool calls
            continue
        turns.append((role, i, text, msg.get("timestamp")))
    return _convert_turns(obj, ctx, turns)


def _locomo_turn_text(turn: dict) -> str:
    text = turn.get("text", "")
    if not isinstance(text, str):
        raise _Invalid(f"text must be a string, got {type(text).__name__}")
    caption = turn.get("blip_caption")
    if isinstance(caption, str) and caption.strip():
        text = f"{text} [image: {caption.strip()}]" if text else f"[image: {caption.strip()}]"
    return normalise_text(text)


def _convert_locomo(obj: dict, ctx: _Ctx) -> list[Record | _Bad]:
    conv = obj.get("conversation")
    if not isinstance(conv, dict):
        raise _Invalid("missing or non-object field 'conversation'")
    speaker_a = conv.get("speaker_a")
    if not isinstance(speaker_a, str):
        raise _Invalid("conversation.speaker_a must be a string")
    speaker_b = conv.get("speaker_b")
    speaker_b = speaker_b if isinstance(speaker_b, str) else None
    sample_id = obj.get("sample_id")
    generated = not isinstance(sample_id, (str, int)) or isinstance(sample_id, bool)
    user_id = generated_user(conv) if generated else normalise_text(str(sample_id))
    assistant_id = f"{user_id}:{normalise_text(speaker_b)}" if speaker_b else None
    sessions = sorted(
        (int(m.group(1)), key)
        for key in conv
        if (m := _SESSION_RE.fullmatch(key)) and isinstance(conv[key], list)
    )
    out: list[Record | _Bad] = []
    sub = 0
    for number, key in sessions:
        date = conv.get(f"{key}_date_time")
        date_error = None
        try:
            ts = _timestamp(date, f"{key}_date_time")
        except _Invalid as exc:
            ts, date_error = None, exc.args[0]
        turns: list[tuple[str, tuple[str, str | None]]] = []
        for j, turn in enumerate(conv[key]):
            try:
                if not isinstance(turn, dict):
                    raise _Invalid("turn is not an object")
                speaker = turn.get("speaker")
                if not isinstance(speaker, str):
                    raise _Invalid("turn has no string 'speaker'")
                dia_id = turn.get("dia_id")
                dia_id = normalise_text(dia_id) if isinstance(dia_id, str) else None
                text = _locomo_turn_text(turn)
            except _Invalid as exc:
                out.append(_Bad(f"{key}[{j}]: {exc.args[0]}", turn))
                continue
            turns.append(("user" if speaker == speaker_a else "assistant", (text, dia_id)))
        for u, a in _pair(turns):
            dia_ids = [t[1] for t in (u, a) if t is not None and t[1] is not None]
            if date_error is not None:
                out.append(_Bad(date_error, {"session": number, "dia_ids": dia_ids}))
                continue
            meta = {
                "dia_ids": dia_ids,
                "session": number,
                "speaker_a": speaker_a,
                "speaker_b": speaker_b,
            }
            out.append(
                _record(
                    ctx,
                    sub,
                    user_id,
                    assistant_id,
                    u[0] if u is not None else "",
                    a[0] if a is not None else "",
                    ts,
                    meta,
                    generated,
                )
            )
            sub += 1
    return out


_CONVERTERS: dict[str, Callable[[dict, _Ctx], list[Record | _Bad]]] = {
    "jsonl": _convert_page,
    "locomo": _convert_locomo,
    "sharegpt": _convert_sharegpt,
    "openai": _convert_openai,
}


# --------------------------------------------------------------------------------------------
# containers


def _dump(obj: object) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, default=str)[:4000]
    except (ValueError, TypeError, RecursionError):
        return repr(obj)[:4000]


def _convert(
    convert: Callable[[dict, _Ctx], list[Record | _Bad]],
    obj: object,
    ctx: _Ctx,
    path: str,
    raw: Callable[[], str],
) -> Iterator[Record | Reject]:
    if not isinstance(obj, dict):
        yield Reject(path, ctx.position, f"expected a JSON object, got {_json_type(obj)}", raw())
        return
    try:
        items = convert(obj, ctx)
    except _Invalid as exc:
        yield Reject(path, ctx.position, exc.args[0], raw())
        return
    for item in items:
        if isinstance(item, _Bad):
            text = raw() if item.raw is None else _dump(item.raw)
            yield Reject(path, ctx.position, item.reason, text)
        else:
            yield item


def _json_type(obj: object) -> str:
    return {
        list: "array",
        str: "string",
        int: "number",
        float: "number",
        bool: "boolean",
        type(None): "null",
    }.get(type(obj), type(obj).__name__)


def _iter_lines(path: str | os.PathLike[str], fmt: str) -> Iterator[Record | Reject]:
    convert = _CONVERTERS[fmt]
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
            except (ValueError, RecursionError) as exc:
                yield Reject(spath, lineno, f"invalid JSON: {exc}", text)
                continue
            ctx = _Ctx(basename, lineno, seen)
            yield from _convert(convert, obj, ctx, spath, lambda t=text: t)


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
            prefix = "item" if container == "array" else ""
            yield from enumerate(ijson.items(stream, prefix, use_float=True), 1)
            return
        doc = json.loads(stream.read().decode("utf-8"))
        if container == "array":
            if not isinstance(doc, list):
                raise ValueError("top-level JSON value is not an array")
            yield from enumerate(doc, 1)
        else:
            yield 1, doc


def _iter_document(
    path: str | os.PathLike[str], fmt: str, container: str
) -> Iterator[Record | Reject]:
    convert = _CONVERTERS[fmt]
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
        ctx = _Ctx(basename, index, seen)
        yield from _convert(convert, obj, ctx, spath, lambda o=obj: _dump(o))


def read_records(path: str | os.PathLike[str], format: str = "auto") -> Iterator[Record | Reject]:
    """Stream the pages of ``path`` as :class:`Record` s, with a :class:`Reject` per bad item.

    ``format``: ``"auto"`` (default; detected from the first records, :class:`FormatError` if
    that fails), or one of :data:`FORMATS` to override. Gzip input is recognised by its magic
    bytes. An empty input yields nothing. Detection happens when this function is called; the
    file is then read lazily as the iterator is consumed.
    """
    if format != "auto" and format not in FORMATS:
        raise FormatError(f"unknown format {format!r}; expected 'auto' or one of {FORMATS}")
    container = _container(path)
    if container == "empty":
        return iter(())
    fmt = detect_format(path) if format == "auto" else format
    if container == "lines":
        return _iter_lines(path, fmt)
    return _iter_document(path, fmt, container)


# --------------------------------------------------------------------------------------------
# LoCoMo access for the evaluation code (same pairing rule as the reader)


def iter_locomo_conversations(
    path: str | os.PathLike[str],
) -> Iterator[tuple[int, dict | Reject]]:
    """Yield ``(1-based index, raw conversation dict)`` from a LoCoMo file (any container).

    A malformed item or document yields ``(index, Reject)`` instead.
    """
    spath = os.fspath(path)
    container = _container(path)
    if container == "empty":
        return
    if container == "lines":
        yield from _iter_raw_lines(path)
        return
    items = _iter_document_items(path, container)
    index = 0
    while True:
        try:
            got = next(items, None)
        except _DOC_ERRORS as exc:
            reason = f"invalid JSON document after item {index}: {exc}; reading stopped"
            yield index + 1, Reject(spath, index + 1, reason, "")
            return
        if got is None:
            return
        index, obj = got
        if isinstance(obj, dict):
            yield index, obj
        else:
            yield (
                index,
                Reject(spath, index, f"expected a JSON object, got {_json_type(obj)}", _dump(obj)),
            )


def _iter_raw_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict | Reject]]:
    spath = os.fspath(path)
    with _Opened(path) as f:
        for lineno, item in enumerate(iter_capped_lines(f), 1):
            stripped = _line_bytes(item, lineno == 1).strip()
            if not stripped:
                continue
            if isinstance(item, LongLine):
                yield lineno, _long_line_reject(spath, lineno, item)
                continue
            try:
                obj = json.loads(stripped.decode("utf-8"))
            except (ValueError, RecursionError) as exc:
                yield (
                    lineno,
                    Reject(
                        spath, lineno, f"invalid line: {exc}", stripped.decode("utf-8", "replace")
                    ),
                )
                continue
            if isinstance(obj, dict):
                yield lineno, obj
            else:
                yield (
                    lineno,
                    Reject(
                        spath,
                        lineno,
                        f"expected a JSON object, got {_json_type(obj)}",
                        stripped.decode("utf-8", "replace"),
                    ),
                )


def locomo_conversation_records(
    conversation: dict, index: int, path: str | os.PathLike[str]
) -> list[Record | Reject]:
    """The pages of one raw LoCoMo conversation, as :func:`read_records` produces them (a page
    repeated in an earlier conversation of the same user in the file is numbered from 1 here)."""
    spath = os.fspath(path)
    ctx = _Ctx(os.path.basename(spath), index, PageCounter())
    return list(_convert(_convert_locomo, conversation, ctx, spath, lambda: _dump(conversation)))

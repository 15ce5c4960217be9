"""What the engine accepts: text, ids, timestamps and page metadata, checked and normalised.

Every public entry point runs its input through these before taking the engine lock, so a bad
record is refused with a message naming the field (:class:`InvalidInputError`) and nothing
half-applied is left behind. ``validate_page`` is public so a bulk reader can reject one record
without failing its batch.
"""

from __future__ import annotations

import json
import numbers
import operator
import re
import time
import unicodedata
from collections.abc import Iterable
from datetime import UTC, date, datetime
from typing import Any

# re-exported: the limit is defined in config, which bounds the configured counts with it
from memoryos_gpu.config import MAX_COUNT as MAX_COUNT
from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.formats.timestamps import MAX_EPOCH_S, MIN_EPOCH_S
from memoryos_gpu.json_codec import dumps
from memoryos_gpu.types import PageInput

try:  # the server and test extras' encoder: refuses a non-string key as it measures a meta
    import orjson as _orjson
except ImportError:  # pragma: no cover - then _refuse_non_str_keys walks the keys
    _orjson = None

#: Most characters of a text field, counted as stored: after Unicode NFC normalisation.
MAX_TEXT_CHARS = 1_000_000
MAX_ID_CHARS = 256
#: Most bytes of a page's ``meta``, counted as stored: UTF-8 JSON (``json_codec.dumps``).
MAX_META_BYTES = 65_536
#: Most levels of dicts and lists (tuples) within one another in a page's ``meta``, the meta
#: itself level 1 (``{"a": {"b": [1]}}`` is 3). Why a limit, and why 64: the bytes limit
#: leaves room for ~20,000 levels, and every path that serves a page back recurses once or
#: more per level -- pickling between the processes of ``serve --workers`` (failed from ~490
#: levels, and took the requests sent beside it down too), the standard library's JSON
#: (orjson stops at 255, counted from the answer's top, where a meta sits ~5 levels deep),
#: ``Scope.strip_ids``, the answers' models -- so a meta the store kept could no longer be
#: listed, exported or retrieved with its sources. 64 is 4x what orjson takes even inside an
#: answer and ~8x under the shallowest recursion limit, and far more than metadata needs.
MAX_META_DEPTH = 64
MAX_ITEM_ID = 2**63 - 1  # the largest SQLite INTEGER (and PostgreSQL BIGINT)
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # category Cc, but \t and \n


class InvalidInputError(MemoryOSError, ValueError):
    """A page or query was rejected; the message says which field and why."""


class PageRefusedError(InvalidInputError):
    """One page refused the whole ``add_many`` batch it came in (nothing of it stored).
    ``reason``: that page's own refusal, apart from what it did to the batch, for a caller
    that retries the rest without it (ingestion reports it as the page's reject)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"{reason} (the batch was not stored)")


def _clean_text(value: Any, what: str) -> str:
    """Normalise text: NFC, lone surrogates -> U+FFFD, control chars other than \\n \\t dropped."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be a string, got {type(value).__name__}")
    if value.isascii():  # no surrogates, already NFC: only control characters to drop
        text = _CONTROL.sub("", value)
    else:
        text = unicodedata.normalize("NFC", _CONTROL.sub("", _SURROGATE.sub("\ufffd", value)))
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidInputError(_too_long(what, len(text), len(value)))
    return text


def _too_long(what: str, stored: int, sent: int) -> str:
    """Why a text is refused. The limit counts the text as stored (in Unicode NFC, control
    characters dropped), which may be longer or shorter than what was sent (U+FB2C is 3 code
    points in NFC, e + U+0301 is 1): measuring what was sent would let a text stored 3 times
    the limit through. When the two differ the message says so, or it would quote a length
    the caller never sent."""
    if stored == sent:
        return f"{what} is {stored} characters; the limit is {MAX_TEXT_CHARS}"
    return (
        f"{what} is {stored} characters after Unicode NFC normalisation and dropping control "
        f"characters ({sent} as sent); the limit is {MAX_TEXT_CHARS}, counted as stored"
    )


def clean_user_id(value: Any) -> str:
    """A ``user_id`` given to a method that looks a user up (history, export, delete, ...):
    checked as every id is (:func:`_clean_id`), so a wrong type raises
    :class:`InvalidInputError` rather than a driver's or a dict's error from deeper down."""
    return _clean_id(value, "user_id")


def _clean_id(value: Any, what: str) -> str:
    """An id to look up, as given, if it is a non-blank string of at most ``MAX_ID_CHARS``
    characters without control characters (ids are keys: they are checked, never rewritten).

    Lenient on purpose: a store made before :func:`_new_identity` existed may hold a user id
    that rule refuses, and its reads must keep finding it."""
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"{what} must be a non-empty string")
    if value.isspace():
        raise InvalidInputError(f"{what} is blank (only whitespace): give a visible id")
    if len(value) > MAX_ID_CHARS:
        raise InvalidInputError(f"{what} is {len(value)} characters; the limit is {MAX_ID_CHARS}")
    if not (value.isascii() and value.isprintable()):
        bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cs")), None)
        if bad is not None:
            kind = "a control character" if unicodedata.category(bad) == "Cc" else "a surrogate"
            raise InvalidInputError(
                f"{what} must be printable characters: it contains U+{ord(bad):04X}, {kind}"
            )
    return value


#: Characters an identity may not contain: control, format (invisible: U+200B zero width
#: space, U+202E right-to-left override, ...), surrogate, line and paragraph separators.
_UNSEEN = ("Cc", "Cf", "Cs", "Zl", "Zp")


def _new_identity(value: Any, what: str) -> str:
    """A user or assistant id a page is written under: :func:`_clean_id`, and visible and in
    Unicode NFC, else :class:`InvalidInputError`.

    Why: ids are compared as code points, so "Zoë" precomposed and decomposed, or "alice" and
    "ali\u200bce", would be distinct users that print the same. Refused, not rewritten: a
    rewritten id would no longer find a user an older store holds under the id as given."""
    value = _clean_id(value, what)
    if value.isascii():  # printable ASCII (checked above) is NFC and visible
        return value
    unseen = next((c for c in value if unicodedata.category(c) in _UNSEEN), None)
    if unseen is not None:
        raise InvalidInputError(
            f"{what} must be printable characters: it contains U+{ord(unseen):04X}, an "
            "invisible (format) or line-separator character"
        )
    if not unicodedata.is_normalized("NFC", value):
        raise InvalidInputError(
            f"{what} must be in Unicode NFC form (composed characters, as most keyboards "
            "type them), so that one id is written one way (a composed and a decomposed 'é' "
            "would be two users); ids that only look alike (fullwidth letters, another "
            "script) stay distinct ids"
        )
    return value


def clean_int(value: Any, what: str, low: int, high: int) -> int:
    """``value`` as a plain ``int`` in ``[low, high]``: Python and NumPy integers (anything
    ``operator.index`` takes) pass, bools, floats, strings and out-of-range values are refused.

    Why: an id goes straight into SQL, and sqlite3 binds a NumPy integer as a blob and a float
    as a REAL, so the statement matches no row and the call reports a change it never made."""
    if isinstance(value, bool):
        raise InvalidInputError(f"{what} must be an integer, got bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidInputError(f"{what} must be an integer, got {type(value).__name__}") from None
    if not low <= n <= high:
        raise InvalidInputError(f"{what} must be between {low} and {high}, got {n}")
    return int(n)


def clean_item_id(value: Any, what: str) -> int:
    """A page id, knowledge entry id or other store row id (>= 1) as a plain ``int``, or
    :class:`InvalidInputError` naming ``what`` (see :func:`clean_int`)."""
    return clean_int(value, what, 1, MAX_ITEM_ID)


def _timestamp(value: Any) -> float:
    """Epoch seconds from a number, an ISO-8601 string or a ``datetime``; ``None`` is now (the
    wall clock).

    A number is any real number but a bool: NumPy and pandas give epoch seconds as
    ``np.int64`` / ``np.float32`` scalars, which are taken as the equal Python number. A
    ``datetime`` with a zone is that instant; a naive one (and a ``date``, its midnight) is
    read as UTC, as a naive ISO string is (docs/formats.md, Timestamps)."""
    if value is None:
        return time.time()
    if isinstance(value, bool):
        raise InvalidInputError("timestamp must be epoch seconds or an ISO-8601 string")
    if not isinstance(value, int | float | str):
        value = _plain_timestamp(value)
    from memoryos_gpu.formats import parse_timestamp

    try:
        return parse_timestamp(value)
    except ValueError as exc:
        raise InvalidInputError(f"timestamp {value!r} does not parse: {exc}") from exc


def _plain_timestamp(value: Any) -> int | float:
    """A timestamp of another type than ``int``, ``float`` or ``str`` as the ``int`` or
    ``float`` :func:`parse_timestamp` takes, or :class:`InvalidInputError` naming what is
    accepted."""
    if isinstance(value, numbers.Integral):
        return int(value)  # exact: an np.int64 beyond 2**53 is not rounded twice
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, date):
        try:
            return _date_epoch(value)
        except (ValueError, OverflowError, OSError) as exc:  # pandas' NaT, a bad tzinfo
            raise InvalidInputError(f"timestamp {value!r} has no epoch seconds: {exc}") from None
    raise InvalidInputError(
        "timestamp must be epoch seconds (a number), an ISO-8601 string or a datetime, got "
        f"{type(value).__name__}"
    )


def _date_epoch(value: date) -> float:
    """A ``datetime``'s epoch seconds, a naive one read as UTC; a ``date``'s midnight UTC."""
    if not isinstance(value, datetime):
        return datetime(value.year, value.month, value.day, tzinfo=UTC).timestamp()
    aware = value if value.utcoffset() is not None else value.replace(tzinfo=UTC)
    return aware.timestamp()


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
    meta = p.meta
    if meta:  # most pages carry no meta: nothing to encode
        meta = _check_meta(meta)
    return PageInput(
        user_id=_new_identity(p.user_id, "user_id"),
        user_input=_clean_text(p.user_input, "user_input"),
        agent_response=_clean_text(
            p.agent_response if p.agent_response is not None else "", "agent_response"
        ),
        timestamp=_timestamp(p.timestamp),
        # "is not None": an empty id is refused as an empty user_id is; read as "none" it
        # silently turned two pages of source "" into two pages without an idempotency key
        assistant_id=None
        if p.assistant_id is None
        else _new_identity(p.assistant_id, "assistant_id"),
        source=None if p.source is None else _clean_id(p.source, "source"),
        meta=meta,
        default_assistant=None
        if p.default_assistant is None
        else _new_identity(p.default_assistant, "default_assistant"),
    )


def _check_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``meta`` to store: ``meta`` itself, or a copy with each lone surrogate in its keys
    and strings (at any depth) replaced by U+FFFD, as in the text fields. Refuses a ``meta``
    that is not JSON (NaN, sets, ... : the standard library's strict encoder decides) or that
    is over :data:`MAX_META_BYTES` as stored.

    Why measured with ``json_codec.dumps``: that is the encoding the store keeps (UTF-8,
    compact), so the limit is what a meta costs. The ASCII-escaped ``json.dumps`` counted a
    CJK character as 6 bytes and an emoji as 12, giving non-Latin text a sixth of the room.

    Why surrogates are replaced: no UTF-8 encodes a lone surrogate (a ``"\\ud800"`` escape
    in JSON input, a ShareGPT ``id`` copied into ``conversation_id``), so a meta holding one
    was stored and then broke every answer showing the page (``export``, ``retrieve
    --json``). The check costs one C-level scan of the encoding the strict check makes
    anyway (none for an ASCII meta); only a meta holding a surrogate is copied."""
    check_meta_depth(meta)  # first: the encoders below recurse once or more per level
    try:
        text = json.dumps(meta, allow_nan=False, ensure_ascii=False)
        if not text.isascii() and _SURROGATE.search(text):
            meta = _without_surrogates(meta)
        size = _stored_size(meta)
    except InvalidInputError:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"meta must be JSON-serialisable: {exc}") from exc
    except RecursionError:  # nested deeper than the interpreter's stack allows
        raise InvalidInputError("meta is nested too deeply to encode as JSON: flatten it") from None
    if size > MAX_META_BYTES:
        raise InvalidInputError(
            f"meta is {size} bytes as stored (UTF-8 JSON); the limit is {MAX_META_BYTES}"
        )
    return meta


def check_meta_depth(meta: Any, what: str = "meta") -> None:
    """:class:`InvalidInputError` naming :data:`MAX_META_DEPTH` when ``meta`` holds dicts,
    lists or tuples more than that many levels within one another (``meta`` itself is level
    1); nothing for any other value. Iterative, so it cannot itself overflow the stack, and it
    stops at the first container past the limit: a meta that holds itself is refused here as
    too deep (the JSON encoder would call it circular). Public so a way in that reads a meta
    before the engine does (the HTTP models, which pickle it to the engine process under
    ``serve --workers``) refuses it with the same words."""
    if not isinstance(meta, dict | list | tuple):
        return
    todo: list[tuple[Any, int]] = [(meta, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_META_DEPTH:
            raise InvalidInputError(
                f"{what} is nested too deeply: more than {MAX_META_DEPTH} levels of objects "
                f"and arrays within one another; the limit is {MAX_META_DEPTH}: flatten it"
            )
        for value in node.values() if isinstance(node, dict) else node:
            if isinstance(value, dict | list | tuple):
                todo.append((value, depth + 1))


def _without_surrogates(value: Any) -> Any:
    """``value`` (a meta, or a value in one) with each lone surrogate of its strings and dict
    keys replaced by U+FFFD; lists, tuples and dicts copied, anything else as it is.
    :class:`InvalidInputError` when two keys of one dict become the same (one would be lost)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        out = {
            (_SURROGATE.sub("\ufffd", k) if isinstance(k, str) else k): _without_surrogates(v)
            for k, v in value.items()
        }
        if len(out) < len(value):
            raise InvalidInputError(
                "meta keys that differ only in lone surrogates become the same key once each "
                "surrogate is replaced by U+FFFD: rename them"
            )
        return out
    if isinstance(value, list | tuple):
        return type(value)(_without_surrogates(v) for v in value)
    return value


def _stored_size(meta: dict[str, Any]) -> int:
    """Bytes of ``meta`` as stored, or :class:`InvalidInputError` for a key that is not a
    string, at any depth.

    Why refused: JSON keys are strings, so the store keeps ``{1: "a"}`` as ``{"1": "a"}``, and
    the live retrievals (which show the dict given) and the reads from the store (``get_page``,
    any retrieval after a reopen) disagreed. The check costs nothing on the common path:
    orjson without ``OPT_NON_STR_KEYS`` refuses such a key in the encoding that measures the
    size anyway (the bytes ``json_codec.dumps`` stores for string keys). Only what orjson
    refuses (such a key, an integer past 64 bits, a lone surrogate) and a process without
    orjson walk the keys in Python."""
    if _orjson is not None:
        try:
            return len(_orjson.dumps(meta))
        except TypeError:  # orjson.JSONEncodeError: decided by the walk below
            pass
    _refuse_non_str_keys(meta)
    return len(dumps(meta))


def _refuse_non_str_keys(meta: dict[str, Any]) -> None:
    """:class:`InvalidInputError` naming the first key of ``meta``'s dicts (nested in dicts,
    lists and tuples) that is not a ``str``. Iterative: the depth is the encoder's concern."""
    todo: list[Any] = [meta]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise InvalidInputError(
                        f"meta keys must be strings (JSON object keys are), got {key!r} "
                        f"({type(key).__name__}): the store would keep it as a string"
                    )
                todo.append(value)
        elif isinstance(node, list | tuple):
            todo.extend(node)


def validate_pages(pages: Iterable[PageInput | dict[str, Any]]) -> list[PageInput]:
    """:func:`validate_page` for a batch (what ``add_many`` runs).

    A page already in normal form -- what :func:`validate_page` returns for the common page:
    printable ASCII ids, ASCII texts without control characters, a float timestamp in range,
    a meta of string keys and values -- is taken as it is after a few C-level tests (a third
    to a quarter of :func:`validate_page`'s time, benchmarks/README.md): most pages of a bulk
    load are such, and the bulk reader of ``memoryos-gpu ingest`` has validated each one
    already. Any other page goes through :func:`validate_page`, which gives the same page for
    one in normal form and a clear error for a bad one."""
    if isinstance(pages, str | bytes | dict | PageInput) or not isinstance(pages, Iterable):
        raise InvalidInputError(
            f"pages must be a list of pages (dicts or PageInput), got {type(pages).__name__}"
        )
    return [p if _normal(p) else validate_page(p) for p in pages]


def _normal(p: Any) -> bool:
    """Whether ``p`` is a :class:`PageInput` that :func:`validate_page` would return unchanged."""
    if type(p) is not PageInput:
        return False
    ts, meta = p.timestamp, p.meta
    return (
        _plain_text(p.user_input)
        and _plain_text(p.agent_response)
        and type(ts) is float
        and MIN_EPOCH_S <= ts <= MAX_EPOCH_S  # False for NaN
        and _plain_id(p.user_id)
        and (p.assistant_id is None or _plain_id(p.assistant_id))
        and (p.default_assistant is None or _plain_id(p.default_assistant))
        and (p.source is None or _plain_id(p.source))
        and type(meta) is dict
        and (not meta or _plain_meta(meta))
    )


def _plain_id(v: Any) -> bool:
    """A printable ASCII id within the limit, not blank (what :func:`_clean_id` accepts as is)."""
    return (
        type(v) is str
        and 0 < len(v) <= MAX_ID_CHARS
        and v.isascii()
        and v.isprintable()
        and not v.isspace()
    )


def _plain_text(v: Any) -> bool:
    """An ASCII text within the limit without control characters (what :func:`_clean_text`
    returns as is). An ASCII text that ``isprintable`` holds no control character at all, so
    the regex runs only on texts with a tab or a newline (it scanned both texts of every page).
    """
    return (
        type(v) is str
        and v.isascii()
        and len(v) <= MAX_TEXT_CHARS
        and (v.isprintable() or not _CONTROL.search(v))
    )


def _plain_meta(meta: dict[str, Any]) -> bool:
    """A meta of string keys and values without lone surrogates that is certainly within
    ``MAX_META_BYTES`` as stored (a character takes at most 6 bytes: 4 in UTF-8, 6 escaped;
    a pair 6 of quotes and separators)."""
    size = 2
    for k, v in meta.items():
        if type(k) is not str or type(v) is not str:
            return False
        if not (k.isascii() and v.isascii()) and _SURROGATE.search(k + v):
            return False  # validate_page replaces it
        size += 6 * (len(k) + len(v)) + 6
    return size <= MAX_META_BYTES


def clean_queries(queries: Iterable[tuple[Any, Any]]) -> list[tuple[str, str]]:
    """``(user_id, query)`` pairs with the id checked and the query text normalised.

    The common pair (a printable ASCII id, an ASCII query without control characters, both
    within their limits) is taken as is after a few C-level string tests (:func:`_plain_id`,
    :func:`_plain_text`, as for pages); any other pair goes through :func:`_clean_id` and
    :func:`_clean_text`, which give the same result for the common pair and a clear error for
    a bad one."""
    try:
        return [
            (u, q)
            if _plain_id(u) and _plain_text(q)
            else (_clean_id(u, "user_id"), _clean_text(q, "query"))
            for u, q in queries
        ]
    except InvalidInputError:
        raise
    except (TypeError, ValueError):  # not pairs: a bare string, a 1-tuple, None
        raise InvalidInputError("queries must be (user_id, query) pairs") from None


def clean_count(value: Any, what: str) -> int:
    """A result count (``top_pages``, ``top_segments``): an integer from 1 to
    :data:`MAX_COUNT`."""
    return clean_int(value, what, 1, MAX_COUNT)


def clean_time(value: Any, what: str) -> float | None:
    """A point in time as epoch seconds (a number or an ISO-8601 string, as page timestamps);
    None stays None (now)."""
    if value is None:
        return None
    try:
        return _timestamp(value)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{what}: {exc}") from None

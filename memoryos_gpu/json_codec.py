"""Fast JSON for the hot paths: orjson when installed (the server extra), the standard library
otherwise. Dataclasses (the engine's result types) serialise as objects of their fields in
either case."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = ["dumps", "dumps_text", "loads"]


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _dumps_stdlib(data: Any) -> bytes:
    """The standard library's JSON as UTF-8. A lone surrogate (a str no UTF-8 encodes, which
    reached a store before the server refused them) is written as its JSON escape
    (``\\ud800``): an answer must not fail to encode, least of all after its write.

    A value nested deeper than the interpreter's stack allows (~1,000 levels: orjson, which
    stops at 255, hands such a value here) is ``ValueError`` saying so, as for any other value
    JSON cannot carry: a ``RecursionError`` escaped every caller's ``(TypeError, ValueError)``
    (a request's meta checked with it was a plain-text 500 and a traceback of ~3,000 lines)."""
    try:
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=_default)
    except RecursionError:
        raise ValueError(
            "the value is nested too deeply to encode as JSON (objects and arrays within one "
            "another past the interpreter's recursion limit): flatten it"
        ) from None
    return text.encode("utf-8", "backslashreplace")


try:
    import orjson

    def dumps(data: Any) -> bytes:
        """orjson, or the standard library for what it refuses and JSON allows (an integer
        beyond 64 bits, a lone surrogate: what a store may hold from before the server refused
        them in requests, and every retrieval showing that page serialises it)."""
        try:
            return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:  # orjson.JSONEncodeError
            return _dumps_stdlib(data)

    loads = orjson.loads  # its JSONDecodeError subclasses json.JSONDecodeError
except ImportError:  # pragma: no cover - orjson is in the server and test extras
    loads = json.loads
    dumps = _dumps_stdlib


def dumps_text(data: Any) -> str:
    """:func:`dumps` as ``str``, for a TEXT column (the engine's own JSON: keyword lists and
    counts, written for every page that reaches MTM)."""
    return dumps(data).decode()

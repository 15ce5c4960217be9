"""Fast JSON for the hot paths: orjson when installed (the server extra), the standard library
otherwise. Dataclasses (the engine's result types) serialise as objects of their fields in
either case."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = ["dumps", "dumps_text", "loads"]

try:
    import orjson

    def dumps(data: Any) -> bytes:
        return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)

    loads = orjson.loads  # its JSONDecodeError subclasses json.JSONDecodeError
except ImportError:  # pragma: no cover - orjson is in the server and test extras
    loads = json.loads

    def _default(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        raise TypeError(f"{type(obj).__name__} is not JSON serialisable")

    def dumps(data: Any) -> bytes:
        return json.dumps(data, ensure_ascii=False, default=_default).encode()


def dumps_text(data: Any) -> str:
    """:func:`dumps` as ``str``, for a TEXT column (the engine's own JSON: keyword lists and
    counts, written for every page that reaches MTM)."""
    return dumps(data).decode()

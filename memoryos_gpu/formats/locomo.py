"""LoCoMo files read conversation by conversation, for the evaluation code.

The evaluation (:mod:`memoryos_gpu.eval.locomo`) needs each raw conversation (its QA and
evidence) beside the pages ingestion would make of it: :func:`iter_locomo_conversations` yields
the raw items of any container, and :func:`locomo_conversation_records` converts one with the
same converter and pairing rule as :func:`~memoryos_gpu.formats.readers.read_records`
(``_convert_locomo`` in :mod:`.converters`), so the two cannot drift apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from .converters import _convert, _convert_locomo, _Ctx, _dump, _json_type
from .opening import _Opened
from .readers import (
    _DOC_ERRORS,
    LongLine,
    _container,
    _iter_document_items,
    _line_bytes,
    _long_line_reject,
    iter_capped_lines,
)
from .records import PageCounter, Record, Reject

__all__ = ["iter_locomo_conversations", "locomo_conversation_records"]


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

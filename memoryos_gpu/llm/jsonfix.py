"""Turn an LLM's JSON-ish output into a value that fits a JSON schema, or None.

Small models (and big ones without constrained decoding) wrap JSON in code fences, prose or
``<think>`` reasoning, leave trailing commas, use single quotes or Python literals, put
unescaped quotes inside strings, or stop mid-object when ``max_tokens`` runs out. Every backend
runs its structured outputs through :func:`parse_json_output` so ``ChatResult.parsed`` means
the same thing everywhere: a value valid against the request's schema, or ``None``.

The syntax repair and most type coercions are the ``json-repair`` package's (maintained,
and it keeps text a hand-written repairer lost, e.g. ``"She said "no" to it"``); what is
specific to LLM output here is around it:

1. reasoning is dropped: ``<think>...</think>`` blocks, an unclosed ``<think>`` tail, and
   everything before a lone ``</think>`` (templates that open the block in the prompt), but
   never a tag inside a JSON string value (the scan keeps track of strings);
2. candidates: the whole text, the inside of code fences, and each ``{`` / ``[`` start, the
   schema's top-level type first;
3. per candidate, a strict decode of the value at its start, else ``json_repair.loads``
   (which gathers several top-level values into a list: each object of it is then tried),
   except for a candidate nested deeper than ``_MAX_REPAIR_DEPTH``: json-repair's work grows
   with depth times length (a degenerate run of 20,000 ``{`` took 22 s), and no schema the
   engine asks for nests that deep;
4. schema fitting: our own normalisation of what the model names or nests loosely (property
   names that differ in case or spaces, a one-element list around an expected object, null
   or empty optional values), then ``json-repair``'s schema mode (a scalar where an array is
   expected, ``"7"`` → ``7``, ``"yes"`` → ``True``, ``5`` → ``"5"``, keys that
   ``additionalProperties: false`` forbids dropped, defaults filled), then ``jsonschema``
   validation; the first candidate that validates wins.

``repaired`` is True when step 3's repair or step 4 changed anything; cutting the JSON out of
fences, prose or reasoning, filling schema defaults and ``7.0`` → ``7`` do not count.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
from collections.abc import Iterator
from typing import Any

import json_repair
import jsonschema

__all__ = ["extract_json_candidates", "parse_json_output", "strip_reasoning"]

_FENCE_RE = re.compile(r"```[ \t]*(?:json5?|JSON|javascript|js)?[ \t]*\r?\n?(.*?)(?:```|\Z)", re.S)
_TAG_RE = re.compile(r"<(/?)think>", re.I)
_END_RE = re.compile(r"</think>", re.I)
_STRING_START, _STRING_END = frozenset("{[,:"), frozenset(["", ",", "}", "]", ":"])
_MAX_STARTS = 16  # how many '{' / '[' positions to try in prose-heavy output
_MAX_REPAIR_DEPTH = 32  # deeper candidates get the strict decode only (see step 3 above)
_STRUCTURE_RE = re.compile(r'\\.|["{}\[\]]', re.S)  # an escape, a quote or a bracket
_DECODER = json.JSONDecoder()


# ----------------------------------------------------------------------------- public entry


def parse_json_output(text: str | None, schema: dict | None = None) -> tuple[Any, bool]:
    """Return ``(value, repaired)``; ``value`` is None when nothing fitting the schema is found.

    With ``schema=None`` any JSON object or array is accepted. Raises ``ValueError`` only when
    ``schema`` itself is not a valid JSON schema (a programming error, not a bad output).
    """
    validator = _validator(schema) if schema is not None else None
    text = strip_reasoning(text or "")
    if not text.strip():
        return None, False
    for candidate in extract_json_candidates(text, prefer=_top_type(schema)):
        for value, repaired in _decoded(candidate):
            if validator is None:
                if isinstance(value, (dict, list)):
                    return value, repaired
                continue
            fitted, coerced = _fit(value, schema, validator)
            if fitted is not _NO_FIT:
                return fitted, repaired or coerced
    return None, False


def strip_reasoning(text: str) -> str:
    """``text`` without reasoning: ``<think>`` blocks (an unclosed one runs to the end) and,
    at a ``</think>`` with no opening tag (the chat template opened it), all before it.

    A tag inside a JSON string value is content, not reasoning (``{"summary": "user typed
    <think> in chat"}`` keeps its text), so the text is scanned with the JSON string state:
    a string (``"..."``, or json-repair's ``'...'``) opens where a JSON string can, inside an
    object or array after ``{ [ , :``, and ends at its quote only where a JSON string can end
    (before ``, } ] :`` or the text's end), as json-repair reads an unescaped inner quote
    (``"She said "no" to it"``). Quotes in prose around the JSON, an apostrophe in
    ``[the user's facts]``, or anything inside a block open nothing."""
    if not _TAG_RE.search(text):
        return text
    kept: list[str] = []
    start = i = depth = 0
    quote, prev = "", ""  # prev: the last non-space character outside strings
    while i < len(text):
        c = text[i]
        if quote:  # inside a string: only its end (or an escape) matters
            if c == quote and _after_space(text, i + 1) in _STRING_END:
                quote, prev = "", c
            i += 2 if c == "\\" else 1
            continue
        tag = _TAG_RE.match(text, i) if c == "<" else None
        if tag and not tag.group(1):  # a block: dropped up to its end (or the text's)
            kept.append(text[start:i])
            end = _END_RE.search(text, tag.end())
            i = start = end.end() if end else len(text)
            continue
        if tag:  # a lone closing tag: all before it was reasoning
            kept, depth, prev = [], 0, ""
            i = start = tag.end()
            continue
        if c in "\"'" and depth and prev in _STRING_START:
            quote = c
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth = max(0, depth - 1)
        prev = c if not c.isspace() else prev
        i += 1
    kept.append(text[start:])
    return "".join(kept)


def _after_space(text: str, i: int) -> str:
    """The first non-space character at or after ``i`` ("" at the end of the text)."""
    while i < len(text) and text[i].isspace():
        i += 1
    return text[i : i + 1]


def extract_json_candidates(text: str, prefer: str | None = None) -> list[str]:
    """Substrings that may hold the JSON value, most likely first (deduplicated)."""
    out: list[str] = []
    seen: set[str] = set()

    def add(s: str) -> None:
        s = s.strip()
        if s and s not in seen:
            seen.add(s)
            out.append(s)

    stripped = text.strip()
    if stripped[:1] in "{[":
        add(stripped)
    for m in _FENCE_RE.finditer(text):
        inner = m.group(1).strip()
        if inner:
            starts = _start_positions(inner, prefer)
            add(inner[starts[0] :] if starts else inner)
    for pos in _start_positions(text, prefer)[:_MAX_STARTS]:
        add(text[pos:])
    return out


# ----------------------------------------------------------------------------- decoding


def _start_positions(text: str, prefer: str | None) -> list[int]:
    opens = "{" if prefer == "object" else "[" if prefer == "array" else "{["
    pos = [i for i, c in enumerate(text) if c in opens]
    if prefer in ("object", "array"):
        other = "[" if prefer == "object" else "{"
        pos += [i for i, c in enumerate(text) if c == other]
    return pos


def _decoded(candidate: str) -> Iterator[tuple[Any, bool]]:
    """Yield ``(value, repaired)`` for a candidate: the strict value at its start, then what
    ``json-repair`` makes of it."""
    with contextlib.suppress(ValueError, RecursionError):
        yield _DECODER.raw_decode(candidate)[0], False
    if _too_deep(candidate):
        return
    try:
        value = json_repair.loads(candidate)
    except (ValueError, RecursionError):
        return
    if isinstance(value, list) and candidate.startswith("{"):
        # an object followed by more values: json-repair returns all of them in a list
        for v in value:
            if isinstance(v, dict):
                yield v, True
    elif value != "":
        yield value, True


def _too_deep(candidate: str) -> bool:
    """True when brackets outside strings nest deeper than ``_MAX_REPAIR_DEPTH`` somewhere in
    ``candidate``; stops at the first such level, so degenerate output is refused at once."""
    depth, in_string = 0, False
    for m in _STRUCTURE_RE.finditer(candidate):
        c = m.group()
        if len(c) == 2:  # an escaped character
            continue
        if c == '"':
            in_string = not in_string
        elif in_string:
            continue
        elif c in "{[":
            depth += 1
            if depth > _MAX_REPAIR_DEPTH:
                return True
        else:
            depth = max(depth - 1, 0)
    return False


# ----------------------------------------------------------------------------- schema fitting


class _NoFit:
    pass


_NO_FIT: Any = _NoFit()


@functools.lru_cache(maxsize=256)
def _validator_for_text(schema_text: str) -> jsonschema.protocols.Validator:
    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"invalid JSON schema: {e.message}") from e
    return cls(schema)


def _validator(schema: dict) -> jsonschema.protocols.Validator:
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema must be a dict, got {type(schema).__name__}")
    return _validator_for_text(json.dumps(schema, sort_keys=True))


def _types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if "properties" in schema or "required" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return set()


def _top_type(schema: dict | None) -> str | None:
    t = _types(schema)
    if "object" in t and "array" not in t:
        return "object"
    if "array" in t and "object" not in t:
        return "array"
    return None


def _fit(value: Any, schema: dict, validator: Any) -> tuple[Any, bool]:
    """``(fitted, coerced)``, or ``(_NO_FIT, False)`` when ``value`` cannot be made valid."""
    if validator.is_valid(value):
        filled = _fill_defaults(copy.deepcopy(value), schema)
        return (filled, False) if validator.is_valid(filled) else (value, False)
    normalized = _normalize(copy.deepcopy(value), schema)
    try:
        coerced = json_repair.loads(json.dumps(normalized), schema=schema)
    except (ValueError, TypeError, RecursionError):  # json-repair: cannot satisfy the schema
        return _NO_FIT, False
    coerced = _fill_defaults(coerced, schema)
    return (coerced, True) if validator.is_valid(coerced) else (_NO_FIT, False)


def _normalize(value: Any, schema: Any, depth: int = 0) -> Any:
    """What json-repair's schema mode leaves alone: ``"Keywords"`` for property ``keywords``,
    ``"User"`` for enum value ``"user"``, ``[{...}]`` where one object is expected, null where
    a list is expected (no items), optional keys that are null (or an empty string that cannot
    be their type, as a dangling ``"score":`` repairs to)."""
    if depth > 32 or not isinstance(schema, dict):
        return value
    if isinstance(value, str) and isinstance(schema.get("enum"), list):
        folded = {_fold(o): o for o in schema["enum"] if isinstance(o, str)}
        return folded.get(_fold(value), value)
    types = _types(schema)
    if value is None and "array" in types and "null" not in types:
        return []
    if "object" in types and isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict) and "object" in types:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        by_folded = {_fold(p): p for p in props}
        for k in list(value):
            p = by_folded.get(_fold(k))
            if k not in props and p is not None and p not in value:
                value[p] = value.pop(k)
        for k in list(value):
            sub = props.get(k)
            sub_t = _types(sub)
            if k not in required and sub_t and _is_blank(value[k], sub_t):
                del value[k]
            elif sub is not None:
                value[k] = _normalize(value[k], sub, depth + 1)
    elif isinstance(value, list) and "array" in types and isinstance(schema.get("items"), dict):
        value = [_normalize(v, schema["items"], depth + 1) for v in value]
    return value


def _fold(key: str) -> str:
    return key.strip().lower().replace(" ", "_")


def _is_blank(v: Any, types: set[str]) -> bool:
    return (v is None and "null" not in types) or (v == "" and "string" not in types)


def _fill_defaults(value: Any, schema: Any, depth: int = 0) -> Any:
    """Fill missing object keys from schema ``default``s and turn integral floats where an
    integer is expected into ints (neither counts as a repair)."""
    if depth > 32 or not isinstance(schema, dict):
        return value
    if isinstance(value, float) and value.is_integer() and "integer" in _types(schema):
        return int(value)  # 7.0 is a valid "integer" for jsonschema; hand out an int
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for k, sub in props.items():
            if k in value:
                value[k] = _fill_defaults(value[k], sub, depth + 1)
            elif isinstance(sub, dict) and "default" in sub:
                value[k] = copy.deepcopy(sub["default"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [_fill_defaults(v, schema["items"], depth + 1) for v in value]
    return value

"""Turn an LLM's JSON-ish output into a value that fits a JSON schema, or None.

Small models (and big ones without constrained decoding) wrap JSON in code fences or prose,
leave trailing commas, use single quotes or Python literals, forget to quote keys, forget
commas between members, or stop mid-object when ``max_tokens`` runs out. Every backend runs its
structured outputs through :func:`parse_json_output` so ``ChatResult.parsed`` means the same
thing everywhere: a value valid against the request's schema, or ``None``.

Steps:

1. locate candidates: the whole text, the inside of code fences, and each ``{`` / ``[`` start;
2. per candidate, a strict ``json.loads`` of the first balanced value, else a repair pass
   (a small state machine that re-emits the text as JSON: quotes keys and bare words,
   converts single quotes and Python literals, drops trailing commas and comments, inserts
   missing commas, and closes a truncated string/array/object);
3. safe coercions toward the schema (scalar → one-element list where an array is expected,
   ``"30"`` → ``30`` for integers, ``"yes"`` → ``True``, a one-element list around an object
   that is expected bare, case-insensitive enum matches, schema defaults for missing keys,
   dropping keys that ``additionalProperties: false`` forbids or optional keys that are null
   against a non-null type);
4. ``jsonschema`` validation; the first candidate that validates wins.

``repaired`` is True when step 2's repair pass or step 3 changed anything; merely cutting the
JSON out of fences or prose does not count as a repair.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
from typing import Any

import jsonschema

__all__ = ["extract_json_candidates", "parse_json_output", "repair_json_text"]

_FENCE_RE = re.compile(r"```[ \t]*(?:json5?|JSON|javascript|js)?[ \t]*\r?\n?(.*?)(?:```|\Z)", re.S)
_MAX_STARTS = 16  # how many '{' / '[' positions to try in prose-heavy output
_BARE_WORD_RE = re.compile(r"[A-Za-z_$][A-Za-z0-9_$\-]*")
_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_LITERALS = {
    "true": "true",
    "false": "false",
    "null": "null",
    "True": "true",
    "False": "false",
    "None": "null",
    "NaN": "null",
    "Infinity": "null",
    "undefined": "null",
}


# ----------------------------------------------------------------------------- public entry


def parse_json_output(text: str | None, schema: dict | None = None) -> tuple[Any, bool]:
    """Return ``(value, repaired)``; ``value`` is None when nothing fitting the schema is found.

    With ``schema=None`` any JSON object or array is accepted. Raises ``ValueError`` only when
    ``schema`` itself is not a valid JSON schema (a programming error, not a bad output).
    """
    validator = _validator(schema) if schema is not None else None
    if not text or not text.strip():
        return None, False
    want = _top_type(schema)
    for candidate in extract_json_candidates(text, prefer=want):
        for value, repaired in _parse_candidate(candidate):
            if validator is None:
                if isinstance(value, (dict, list)):
                    return value, repaired
                continue
            fitted, coerced = _fit(value, schema, validator)
            if fitted is not _NO_FIT:
                return fitted, repaired or coerced
    return None, False


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


def repair_json_text(text: str) -> str:
    """Re-emit the first JSON-ish value in ``text`` as strict JSON text (best effort)."""
    return _Repairer(text).run()


# ----------------------------------------------------------------------------- parsing


def _start_positions(text: str, prefer: str | None) -> list[int]:
    opens = "{" if prefer == "object" else "[" if prefer == "array" else "{["
    pos = [i for i, c in enumerate(text) if c in opens]
    if prefer in ("object", "array"):
        other = "[" if prefer == "object" else "{"
        pos += [i for i, c in enumerate(text) if c == other]
    return pos


def _parse_candidate(candidate: str):
    """Yield (value, repaired) for a candidate: strict first, then repaired."""
    strict = _first_balanced(candidate)
    if strict is not None:
        with contextlib.suppress(ValueError, RecursionError):
            yield json.loads(strict), False
    try:
        fixed = repair_json_text(candidate)
    except RecursionError:
        return
    if fixed and fixed != strict:
        with contextlib.suppress(ValueError, RecursionError):
            yield json.loads(fixed), True


def _first_balanced(text: str) -> str | None:
    """The first balanced {...} or [...] at the start of ``text`` (string-aware), or None."""
    if not text or text[0] not in "{[":
        return None
    depth = 0
    in_str = False
    esc = False
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
    return None


class _Repairer:
    """One pass over JSON-ish text, emitting strict JSON; stops when the top value closes."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.out: list[str] = []
        # stack of containers: ["{" or "[", state]; object states: key, colon, value, comma;
        # array states: value, comma
        self.stack: list[list[str]] = []
        self.done = False

    # -- helpers
    def _top(self) -> list[str] | None:
        return self.stack[-1] if self.stack else None

    def _before_value(self) -> bool:
        """Prepare for a value (or key) start; False if it cannot go here."""
        top = self._top()
        if top is None:
            return not "".join(self.out).strip()  # only one top-level value
        kind, state = top
        if state == "comma":  # missing comma between members
            self._strip_ws()
            self.out.append(",")
            top[1] = "key" if kind == "{" else "value"
        elif kind == "{" and state == "colon":  # "key" "value" with no colon
            self.out.append(":")
            top[1] = "value"
        return True

    def _after_value(self) -> None:
        top = self._top()
        if top is None:
            self.done = True
        else:
            top[1] = "comma"

    def _emit_string(self, content: str) -> None:
        top = self._top()
        is_key = top is not None and top[0] == "{" and top[1] in ("key", "comma")
        self._before_value()
        self.out.append(json.dumps(content, ensure_ascii=False))
        if is_key:
            top[1] = "colon"  # type: ignore[index]
        else:
            self._after_value()

    def _strip_ws(self) -> None:
        while self.out and self.out[-1].isspace():
            self.out.pop()

    def _strip_trailing_comma(self) -> None:
        self._strip_ws()
        if self.out and self.out[-1] == ",":
            self.out.pop()

    # -- scanners
    def _read_string(self, quote: str) -> tuple[str, bool]:
        """Read a quoted string starting after its quote; returns (content, closed)."""
        s = self.s
        buf: list[str] = []
        while self.i < len(s):
            c = s[self.i]
            self.i += 1
            if c == "\\":
                if self.i >= len(s):
                    break
                n = s[self.i]
                self.i += 1
                simple = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/"}
                if n in simple:
                    buf.append(simple[n])
                elif n == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", s[self.i : self.i + 4]):
                    buf.append(chr(int(s[self.i : self.i + 4], 16)))
                    self.i += 4
                else:  # \" \' \\ and unknown escapes: keep the character
                    buf.append(n)
            elif c == quote:
                return "".join(buf), True
            else:
                buf.append(c)
        return "".join(buf), False

    def run(self) -> str:
        s = self.s
        n = len(s)
        while self.i < n and not self.done:
            c = s[self.i]
            top = self._top()
            if c in " \t\r\n":
                self.out.append(c)
                self.i += 1
            elif c in "\"'\u201c\u201d":
                close = {"\u201c": "\u201d"}.get(c, c)
                self.i += 1
                content, _closed = self._read_string(close)
                self._emit_string(content)
            elif c in "{[":
                if not self._before_value():
                    break
                self.out.append(c)
                self.stack.append([c, "key" if c == "{" else "value"])
                self.i += 1
            elif c in "}]":
                self.i += 1
                if top is None:
                    break
                want = "{" if c == "}" else "["
                if want not in (k for k, _ in self.stack):
                    continue  # stray closer: skip it
                while self.stack:
                    self._close_top()
                    if self.stack == [] or self._popped == want:
                        break
                self._after_value()
            elif c == ",":
                self.i += 1
                if top is not None and top[1] == "comma":
                    self._strip_ws()
                    self.out.append(",")
                    top[1] = "key" if top[0] == "{" else "value"
                # else: leading/duplicate comma: drop
            elif c == ":":
                self.i += 1
                if top is not None and top[0] == "{" and top[1] == "colon":
                    self.out.append(":")
                    top[1] = "value"
            elif c == "/" and s.startswith("//", self.i):
                end = s.find("\n", self.i)
                self.i = n if end < 0 else end
            elif c == "/" and s.startswith("/*", self.i):
                end = s.find("*/", self.i + 2)
                self.i = n if end < 0 else end + 2
            elif c == "#" and top is not None:
                end = s.find("\n", self.i)
                self.i = n if end < 0 else end
            elif c in "+-.0123456789":
                m = _NUMBER_RE.match(s, self.i)
                if m is None:
                    self.i += 1
                    continue
                tok = m.group(0)
                self.i = m.end()
                num = _normalize_number(tok)
                if top is not None and top[0] == "{" and top[1] in ("key", "comma"):
                    self._emit_string(tok)  # numeric key
                else:
                    self._before_value()
                    self.out.append(num)
                    self._after_value()
            elif _BARE_WORD_RE.match(s, self.i):
                m = _BARE_WORD_RE.match(s, self.i)
                assert m is not None
                word = m.group(0)
                self.i = m.end()
                if top is not None and top[0] == "{" and top[1] in ("key", "comma"):
                    self._emit_string(word)
                elif word in _LITERALS:
                    self._before_value()
                    self.out.append(_LITERALS[word])
                    self._after_value()
                else:  # an unquoted string value: take the rest up to a delimiter
                    end = self.i
                    while end < n and s[end] not in ",}]\n":
                        end += 1
                    self.i = end
                    self._emit_string((word + s[m.end() : end]).strip())
            else:
                self.i += 1  # junk character outside strings: drop
        self._finish()
        return "".join(self.out).strip()

    _popped = ""

    def _close_top(self) -> None:
        kind, state = self.stack.pop()
        self._strip_trailing_comma()
        if kind == "{":
            if state == "colon":  # dangling key
                self.out.append(":null")
            elif state == "value":  # dangling colon
                self._strip_ws()
                if self.out and self.out[-1] == ":":
                    self.out.append("null")
        self.out.append("}" if kind == "{" else "]")
        self._popped = kind

    def _finish(self) -> None:
        while self.stack:
            self._close_top()
            if self.stack:
                self.stack[-1][1] = "comma"


def _normalize_number(tok: str) -> str:
    t = tok.lstrip("+")
    neg = t.startswith("-")
    body = t[1:] if neg else t
    if body.startswith("."):
        body = "0" + body
    if body.endswith("."):
        body = body[:-1]
    if "e" in body.lower():
        mant, _, exp = body.lower().partition("e")
        if mant.endswith("."):
            mant = mant[:-1]
        body = f"{mant}e{exp}"
    if len(body) > 1 and body[0] == "0" and body[1].isdigit():
        body = body.lstrip("0") or "0"
    return ("-" if neg else "") + body


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


def _top_type(schema: dict | None) -> str | None:
    if not schema:
        return None
    t = _types(schema)
    if "object" in t and "array" not in t:
        return "object"
    if "array" in t and "object" not in t:
        return "array"
    return None


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
    if "enum" in schema:
        return {_json_type(v) for v in schema["enum"]}
    return set()


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _fit(value: Any, schema: dict, validator: Any) -> tuple[Any, bool]:
    if validator.is_valid(value):
        filled = _fill_defaults(copy.deepcopy(value), schema)
        return (filled, False) if validator.is_valid(filled) else (value, False)
    coerced = _coerce(copy.deepcopy(value), schema)
    if validator.is_valid(coerced):
        return coerced, True
    return _NO_FIT, False


def _matches(value: Any, types: set[str]) -> bool:
    jt = _json_type(value)
    return jt in types or (jt == "integer" and "number" in types)


def _coerce(value: Any, schema: Any, depth: int = 0) -> Any:
    """Best-effort, value-preserving conversions toward ``schema``."""
    if depth > 32 or not isinstance(schema, dict):
        return value
    types = _types(schema)
    if not types:
        for key in ("anyOf", "oneOf"):
            for sub in schema.get(key, []) or []:
                sub_t = _types(sub)
                if sub_t and _matches(value, sub_t):
                    return _coerce(value, sub, depth + 1)
        return value
    if "enum" in schema and isinstance(value, str):
        for opt in schema["enum"]:
            if isinstance(opt, str) and opt.lower() == value.strip().lower():
                return opt
    if not _matches(value, types):
        value = _coerce_type(value, types, schema)
    if isinstance(value, dict) and "object" in types:
        value = _coerce_object(value, schema, depth)
    elif isinstance(value, list) and "array" in types:
        items = schema.get("items")
        if isinstance(items, dict):
            value = [_coerce(v, items, depth + 1) for v in value]
    return value


def _coerce_type(value: Any, types: set[str], schema: dict) -> Any:
    if "array" in types:
        if isinstance(value, (str, int, float, bool, dict)):
            items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
            return [_coerce(value, items, 1)] if items else [value]
        if value is None and "null" not in types:
            return []
    if (
        "object" in types
        and isinstance(value, list)
        and len(value) == 1
        and isinstance(value[0], dict)
    ):
        return value[0]
    if "integer" in types or "number" in types:
        if isinstance(value, str):
            t = value.strip().replace(",", "")
            try:
                f = float(t)
            except ValueError:
                f = None
            if f is not None:
                if "integer" in types and f.is_integer():
                    return int(f)
                if "number" in types:
                    return f
        if isinstance(value, float) and "integer" in types and value.is_integer():
            return int(value)
        if isinstance(value, bool):
            return value
    if "boolean" in types and isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "yes", "y", "1"):
            return True
        if low in ("false", "no", "n", "0"):
            return False
    if "boolean" in types and isinstance(value, int) and value in (0, 1):
        return bool(value)
    if "string" in types:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return str(value)
        if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
            return ", ".join(str(v) for v in value)
    return value


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


def _coerce_object(value: dict, schema: dict, depth: int) -> dict:
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    extra = schema.get("additionalProperties")
    # keys with case/space differences ("Keywords" for "keywords")
    lower_props = {p.lower().replace(" ", "_"): p for p in props}
    for k in list(value):
        if k not in props:
            p = lower_props.get(k.lower().strip().replace(" ", "_"))
            if p is not None and p not in value:
                value[p] = value.pop(k)
    for k in list(value):
        sub = props.get(k)
        if sub is None:
            if extra is False:
                del value[k]
            elif isinstance(extra, dict):
                value[k] = _coerce(value[k], extra, depth + 1)
            continue
        if value[k] is None and k not in required and _types(sub) and "null" not in _types(sub):
            del value[k]
            continue
        value[k] = _coerce(value[k], sub, depth + 1)
    for k, sub in props.items():
        if k not in value and isinstance(sub, dict) and "default" in sub:
            value[k] = copy.deepcopy(sub["default"])
    return value

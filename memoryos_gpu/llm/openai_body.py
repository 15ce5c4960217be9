"""What goes into an OpenAI-compatible request body, and what a server's 4xx says to change.

Servers that speak the OpenAI chat API disagree on details, and some say so only with a 400:

* OpenAI's reasoning models (o-series, GPT-5) reject ``max_tokens`` and want
  ``max_completion_tokens``; they also reject any ``temperature`` but the default;
* OpenAI's strict structured outputs accept only a subset of JSON Schema (every object
  closed with ``additionalProperties: false`` and listing all its properties as
  ``required``), so ``strict: true`` is sent only for schemas inside it
  (:func:`strict_schema_ok`);
* llama.cpp's servers take ``{"type": "json_object", "schema": ...}`` instead of
  ``json_schema``.

The backend learns the first two per model and the format per stage from the error bodies
parsed here (:func:`parse_error`), so one rejection never changes more than it must.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from memoryos_gpu.llm.base import ChatRequest

__all__ = [
    "STYLES",
    "ServerError",
    "build_response_format",
    "is_format_rejection",
    "parse_error",
    "rejects_max_tokens",
    "rejects_temperature",
    "strict_schema_ok",
]

STYLES = ("auto", "json_schema", "json_object", "none")
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_-]+")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


@dataclass(frozen=True)
class ServerError:
    """An error answer: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` and the
    looser shapes other servers use (only ``message`` is then known)."""

    message: str
    param: str | None = None
    code: str | None = None


def parse_error(content: bytes) -> ServerError:
    """The error in a non-200 body (never raises: an unreadable body becomes its text)."""
    text = content.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return ServerError(text.strip()[:500] or "(empty body)")
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return ServerError(
                str(err["message"])[:500],
                _str_or_none(err.get("param")),
                _str_or_none(err.get("code")),
            )
        if isinstance(err, str):
            return ServerError(err[:500])
        for key in ("message", "detail"):
            if data.get(key):
                v = data[key]
                return ServerError((v if isinstance(v, str) else json.dumps(v))[:500])
    return ServerError(text.strip()[:500])


def _str_or_none(v: Any) -> str | None:
    return None if v is None else str(v)


def rejects_max_tokens(err: ServerError) -> bool:
    """``'max_tokens' is not supported with this model. Use 'max_completion_tokens'``."""
    low = err.message.lower()
    return err.param == "max_tokens" or ("max_tokens" in low and "max_completion_tokens" in low)


def rejects_temperature(err: ServerError) -> bool:
    """``'temperature' does not support 0 with this model. Only the default (1) value``."""
    return err.param == "temperature" and err.code in ("unsupported_value", "unsupported_parameter")


def is_format_rejection(status: int, err: ServerError, style: str) -> bool:
    """Did the server reject our ``response_format``? 400/422 normally; llama-cpp-python's
    server answers its request-validation errors with 500, so a 500 counts when it names the
    field."""
    if style == "none":
        return False
    low = err.message.lower()
    names_field = (
        err.param == "response_format" or "response_format" in low or "response format" in low
    )
    if status in (400, 422):
        return names_field or style in low
    return status == 500 and names_field


def build_response_format(request: ChatRequest, style: str, strict: bool = True) -> dict | None:
    """The ``response_format`` body field for ``request`` under ``style`` (None: omit it).

    ``strict=True`` asks for OpenAI's strict mode, sent only when the schema is inside its
    subset (:func:`strict_schema_ok`); an open map such as the profile updates goes without.
    """
    schema = request.json_schema
    if schema is None or style == "none":
        return None
    if style == "json_schema":
        raw = str(schema.get("title") or request.stage or "response")
        name = _NAME_BAD.sub("_", raw).strip("_")[:64] or "response"
        return {
            "type": "json_schema",
            "json_schema": {
                "name": name,
                "schema": schema,
                "strict": bool(strict and strict_schema_ok(schema)),
            },
        }
    if style == "json_object":
        return {"type": "json_object", "schema": schema}
    raise ValueError(f"unknown response_format style {style!r}; expected one of {STYLES}")


def strict_schema_ok(schema: Any, depth: int = 0) -> bool:
    """Whether OpenAI accepts ``schema`` with ``strict: true``: every object node closes with
    ``additionalProperties: false`` and requires all of its properties (the two rules its
    400 "Invalid schema for response_format" names; other keywords are left to the server)."""
    if depth > 64:
        return False
    if isinstance(schema, list):
        return all(strict_schema_ok(s, depth + 1) for s in schema)
    if not isinstance(schema, dict):
        return True
    t = schema.get("type")
    is_object = t == "object" or (isinstance(t, list) and "object" in t) or "properties" in schema
    if is_object:
        props = schema.get("properties") or {}
        if schema.get("additionalProperties") is not False:
            return False
        if set(schema.get("required") or []) != set(props):
            return False
    subs: list[Any] = [schema.get("items")] if "items" in schema else []
    for key in _SUBSCHEMA_LISTS:
        subs += list(schema.get(key) or [])
    for key in _SUBSCHEMA_MAPS:
        subs += list((schema.get(key) or {}).values())
    return all(strict_schema_ok(s, depth + 1) for s in subs if s is not None)

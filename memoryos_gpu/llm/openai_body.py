"""What goes into an OpenAI-compatible request body, what a server's 4xx says to change, and
what its 200 answer holds.

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

A 200 answer is read by :func:`answer_text` and :func:`usage_counts`, which accept only
OpenAI's shapes and never raise: one server's odd answer (a list body, ``content`` as a number,
``usage`` as a string) must cost only its own request, not the batch it came in.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from memoryos_gpu.llm.base import ChatRequest

__all__ = [
    "STYLES",
    "ServerError",
    "answer_text",
    "build_response_format",
    "is_format_rejection",
    "parse_error",
    "rejects_max_tokens",
    "rejects_temperature",
    "strict_schema_ok",
    "usage_counts",
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
    except (ValueError, RecursionError):  # RecursionError: a body nested too deep to decode
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


def answer_text(data: Any) -> str | None:
    """The assistant's text in a decoded 200 answer: ``choices[0].message.content`` as a
    string, or the text parts of OpenAI's content-parts list joined (other parts, such as a
    ``refusal``, carry no answer); ``null`` content is ``""``. ``None`` when the answer has
    any other shape, so the caller reports it instead of crashing on it."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = [part.get("text") for part in content if part.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return None


def usage_counts(data: Any) -> tuple[int, int]:
    """``(prompt_tokens, completion_tokens)`` of a decoded 200 answer; a count that is not a
    finite non-negative integer (a string, NaN, ``1e999``, a negative number) is taken as 0:
    token accounting is informational and must not fail the request."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def _count(value: Any) -> int:
    """A token count, or 0; an integral float (``12.0``, as some servers send) counts."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(value, 0)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return max(int(value), 0)
    return 0


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

"""One reading of every request body, for the FastAPI routes (:class:`JsonBodyRoute`) and the
edge's direct routes (:meth:`~memoryos_gpu.server.edge.DirectRoute.parse`) alike, so that no
route stores what another refuses:

* a body is JSON, sent as ``Content-Type: application/json`` (or ``application/*+json``);
  anything else is 415, whatever the bytes;
* a string holding a lone UTF-16 surrogate escape (``"\\ud800"``) is 422 ``json_invalid``: it
  has no UTF-8 form, so no store keeps it and no answer could echo it;
* an integer outside the signed 64-bit range is 422 naming its field: orjson reads a larger
  one as an imprecise float (or not at all), the standard library exactly; refusing it is the
  one rule every route, store and engine process can keep.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from memoryos_gpu.json_codec import loads
from memoryos_gpu.server.scope import ApiError

__all__ = ["INT_MAX", "INT_MIN", "JsonBodyRoute", "is_json", "parse_body"]

INT_MIN, INT_MAX = -(2**63), 2**63 - 1
#: 19 digits in a row: the only bodies that may hold an integer outside 64 bits (every one
#: below 10**18 fits), so the only ones read twice.
_LONG_DIGITS = re.compile(rb"\d{19}")
NOT_JSON = "the body must be JSON, sent with 'Content-Type: application/json'"


def is_json(content_type: str) -> bool:
    """Whether a Content-Type names JSON (``application/json`` or ``application/*+json``)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def parse_body(body: bytes, content_type: str | None) -> Any:
    """The JSON value of a non-empty request body, or the error every route answers for it:
    415 for a body not declared JSON, 422 (:class:`RequestValidationError`) for one that is
    not JSON, holds a lone surrogate or an integer outside 64 bits."""
    if content_type is None or not is_json(content_type):
        raise ApiError(415, "unsupported_media_type", NOT_JSON)
    if _LONG_DIGITS.search(body) is not None:
        _refuse_wide_ints(body)
    try:
        return loads(body)  # orjson: refuses lone surrogates, NaN, Infinity
    except json.JSONDecodeError as exc:
        why = f"JSON decode error: {exc.msg}"
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", exc.pos), "msg": why}]
        ) from None


def _refuse_wide_ints(body: bytes) -> None:
    """422 naming the first integer of ``body`` outside 64 bits. The standard library reads
    integers exactly; a body it cannot read is left to the caller's parser to refuse."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return
    stack: list[tuple[tuple[Any, ...], Any]] = [(("body",), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(((*loc, k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend(((*loc, i), v) for i, v in enumerate(value))
        elif isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
            msg = f"integers must lie in the signed 64-bit range [{INT_MIN}, {INT_MAX}]"
            raise RequestValidationError([{"type": "int_out_of_range", "loc": loc, "msg": msg}])


class _ParsedRequest(Request):
    """A request whose body has been read and parsed already: FastAPI's handler gets them."""

    def __init__(self, request: Request, body: bytes, data: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._read, self._parsed = body, data

    async def body(self) -> bytes:
        return self._read

    async def json(self) -> Any:
        return self._parsed


class JsonBodyRoute(APIRoute):
    """The route class of the app: a route that takes a body reads it with :func:`parse_body`
    before FastAPI's handler (which would parse it with the standard library, or not at all
    for a body not declared JSON) sees it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def parsed_first(request: Request) -> Response:
            body = await request.body()
            if not body:  # FastAPI answers the missing body
                return await handler(request)
            data = parse_body(body, request.headers.get("content-type"))
            return await handler(_ParsedRequest(request, body, data))

        return parsed_first

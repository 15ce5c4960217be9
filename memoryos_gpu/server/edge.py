"""The edge in front of the routes: one ASGI middleware for body limits (size, read time), API-key
authentication and rate limits, latency metrics and the direct (hot) routes, and the one
mapping from exceptions to error responses that both FastAPI's handlers and the direct routes
use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import unquote_to_bytes

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match

from memoryos_gpu.embed.base import EmbeddingError
from memoryos_gpu.errors import MemoryOSError, UnknownItemError, UnknownUserError
from memoryos_gpu.log_setup import LogThrottle
from memoryos_gpu.server.auth import KeyLimits, KeyRing, Principal, RateLimiter, Refusal
from memoryos_gpu.server.batching import Overloaded, Unavailable
from memoryos_gpu.server.bodies import parse_body
from memoryos_gpu.server.metrics import ServerMetrics
from memoryos_gpu.server.paths import path_segments
from memoryos_gpu.server.scope import TENANCY, ApiError, Scope, error_response
from memoryos_gpu.server.service import LLMUnavailableError, PartialWriteError
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.store.errors import StoreFullError, StoreUnavailableError

log = logging.getLogger("memoryos_gpu.server")


class _BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, "too_large", f"the request body exceeds {limit} bytes")


class _BodyTimeout(ApiError):
    """408: the body did not arrive within ``body_timeout_s``. ``Connection: close`` (as RFC
    9110 asks of a 408): the HTTP server closes the connection once the answer is out, so the
    rest of the body is never read and a shutdown does not wait for it."""

    def __init__(self, timeout: float, seen: int, length: int | None) -> None:
        of = f" of {length}" if length is not None else ""
        super().__init__(
            408,
            "body_timeout",
            f"the request body did not arrive within {timeout:g} s ({seen}{of} bytes received); "
            "nothing of the request was stored",
            {"Connection": "close"},
        )


# ====================================================================== errors
class ErrorMapper:
    """Exceptions -> error responses ``{"error": code, "detail": message}``: one mapping for
    the FastAPI exception handlers and the direct routes of :class:`Edge`."""

    CLASSES = (
        ClientDisconnect,
        StarletteHTTPException,
        RequestValidationError,
        Overloaded,
        Unavailable,
        MemoryOSError,  # LLMUnavailableError, UnknownUserError, UnknownItemError: subclasses
    )
    _HTTP_CODES: ClassVar[dict[int, str]] = {
        404: "not_found",
        405: "method_not_allowed",
        413: "too_large",
    }
    #: The refusals a route raises (an admin key on a tenant's route, a text or batch over its
    #: limit, a key past its page or byte rate) as ``memoryos_rejected_total`` counts them:
    #: counted here, once, wherever they are raised.
    _REJECTED: ClassVar[dict[int, str]] = {
        403: "forbidden",
        408: "body_timeout",
        413: "too_large",
        429: "rate_limited",
    }
    #: Seconds a client is told to wait when the store's server cannot be reached.
    STORE_RETRY_AFTER: ClassVar[int] = 5
    #: Seconds a client is told to wait when the embedding server fails (the embedder has
    #: already retried with backoff before giving up).
    EMBEDDER_RETRY_AFTER: ClassVar[int] = 5

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        # a failure that persists (a full disk, the store or the embedder down) fails every
        # request the same way: one line a minute says so, the counters keep the numbers
        self._log = LogThrottle()

    def __call__(self, exc: Exception, tenancy: Scope | None) -> Response | None:
        """The response for ``exc``, or None for an exception no handler maps (a bug: the
        server answers 500)."""
        if isinstance(exc, ClientDisconnect) or isinstance(exc.__cause__, ClientDisconnect):
            # nobody is left to read an answer: a line in the log, not a traceback
            log.info("client disconnected before its request was read")
            self.metrics.rejected.labels("client_disconnect").inc()
            return error_response(400, "client_disconnected", "the client closed the connection")
        if isinstance(exc, StarletteHTTPException):
            reason = self._REJECTED.get(exc.status_code)
            if reason is not None:
                self.metrics.rejected.labels(reason).inc()
            code = getattr(exc, "code", None) or self._HTTP_CODES.get(exc.status_code, "http_error")
            return error_response(exc.status_code, code, exc.detail, exc.headers)
        if isinstance(exc, RequestValidationError):
            keep = ("loc", "msg", "type")
            return error_response(
                422, "validation_error", [{k: e[k] for k in keep} for e in exc.errors()]
            )
        if isinstance(exc, Overloaded | Unavailable):
            reason = "overloaded" if isinstance(exc, Overloaded) else "unavailable"
            status = getattr(exc, "status", 503)  # 429: the caller's own share is full
            self.metrics.rejected.labels(reason).inc()
            detail = str(exc) if operator_may_read(tenancy) else getattr(exc, "public", str(exc))
            return error_response(status, reason, detail, {"Retry-After": str(exc.retry_after)})
        if isinstance(exc, StoreUnavailableError):  # PostgreSQL down, restarting, cut off
            # the operator's: names the store, password masked
            self._log.log(log, "store_unavailable", logging.WARNING, "%s", exc)
            self.metrics.rejected.labels("unavailable").inc()
            return error_response(
                503,
                "unavailable",
                "the server's store cannot be reached or dropped the connection: the failed "
                f"call was not committed; retry after {self.STORE_RETRY_AFTER} s",
                {"Retry-After": str(self.STORE_RETRY_AFTER)},
            )
        if isinstance(exc, EmbeddingError):  # the embedding server down or answering badly
            # URL shown password-masked
            self._log.log(log, "embedder", logging.WARNING, "the embedder cannot be used: %s", exc)
            self.metrics.rejected.labels("unavailable").inc()
            return error_response(
                503,
                "unavailable",
                f"the embedding server cannot be used now; nothing of this request was stored: "
                f"{exc}; retry after {self.EMBEDDER_RETRY_AFTER} s",
                {"Retry-After": str(self.EMBEDDER_RETRY_AFTER)},
            )
        if isinstance(exc, PartialWriteError):
            log.error("write failed part way: %s", exc)
            return error_response(500, "partially_committed", _said(exc, tenancy))
        if isinstance(exc, StoreFullError):  # the operator's problem: the log says where
            self._log.log(log, "store_full", logging.ERROR, "%s", exc)
            self.metrics.rejected.labels("store_full").inc()
            return error_response(
                507,
                "insufficient_storage",
                "the server's store is out of disk space: nothing of this request was stored; "
                "retry later",
            )
        if isinstance(exc, LLMUnavailableError):
            return error_response(501, "llm_unavailable", _said(exc, tenancy))
        if isinstance(exc, UnknownUserError):
            return error_response(404, "unknown_user", _said(exc, tenancy))
        if isinstance(exc, UnknownItemError):  # e.g. deleted between a route's check and edit
            return error_response(404, "not_found", _said(exc, tenancy))
        if isinstance(exc, MemoryOSError):
            if isinstance(exc, ValueError):  # the engine's InvalidInputError and friends
                return error_response(422, "invalid_input", _said(exc, tenancy))
            log.exception("engine error", exc_info=exc)
            return error_response(500, "engine_error", _said(exc, tenancy))
        return None


def operator_may_read(tenancy: Scope | None) -> bool:
    """Whether the caller may read internal details (a store's path, a failed load's error,
    the LLM server's own error text): an open server's (one tenant, its operator) or the admin
    key's, not another tenant's."""
    return tenancy is None or tenancy.tenant is None or tenancy.principal.admin


def _said(exc: Exception, tenancy: Scope | None) -> str:
    """An engine error's message as the client may read it: the engine names stored ids
    (``'acme/alice'``), the client sent and sees them without the tenant prefix."""
    return tenancy.unprefixed(str(exc)) if tenancy is not None else str(exc)


# ====================================================================== direct routes
@dataclasses.dataclass(frozen=True)
class DirectRoute:
    """A hot route that :class:`Edge` serves itself, skipping FastAPI's routing, dependency
    solving and middleware layers (~12 % of the batched server's CPU under load, spent on the
    two routes that carry it). Same body model, same handler, same error bodies as its FastAPI
    declaration, which still documents it in OpenAPI (``ServerSettings.direct_routes = False``
    serves it through FastAPI instead; the tests check both answer alike)."""

    path: str  # the route template, the metrics label
    model: type[Any]
    handler: Callable[[Scope, str, Any], Awaitable[Response]]

    def parse(self, body: bytes, content_type: str | None) -> Any:
        """The validated body model, or :class:`RequestValidationError` as FastAPI raises it."""
        if not body:
            raise RequestValidationError(
                [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
            )
        data = parse_body(body, content_type)  # as every FastAPI route: bodies.JsonBodyRoute
        try:
            return self.model.model_validate(data, from_attributes=True)  # as FastAPI does
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            ) from None


def _direct_match(
    routes: dict[str, DirectRoute], scope: dict[str, Any]
) -> tuple[DirectRoute, str] | None:
    """``/v1/users/{user_id}/{name}`` -> (route, user_id) for a direct route ``name``; the
    path split as the app's routes split it (:func:`~memoryos_gpu.server.paths.path_segments`:
    ``%2F`` in a user id is part of it)."""
    parts = path_segments(scope)
    if len(parts) != 5 or parts[1] != "v1" or parts[2] != "users" or not parts[3]:
        return None
    route = routes.get(parts[4])
    return (route, parts[3]) if route is not None else None


# ====================================================================== middleware
def _content_length(headers: Any) -> int | None:
    for k, v in headers:
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


_REFUSAL_REASONS = {
    401: "unauthorized",
    403: "forbidden",
    413: "too_large",
    422: "invalid_input",
    429: "rate_limited",
    431: "too_large",
}


def _malformed(scope: dict, headers: Any, max_header_bytes: int) -> Refusal | None:
    """Why a request cannot be served whatever its route, or None: headers over the limit
    (431), a URL whose percent-encoded bytes are not UTF-8 (422: ``%FE`` and ``%FF`` must not
    both decode to U+FFFD and name one user)."""
    size = sum(len(k) + len(v) + 4 for k, v in headers)
    if size > max_header_bytes:
        detail = f"the request headers are {size} bytes; the limit is {max_header_bytes}"
        return 431, "headers_too_large", detail, {}
    for part in (scope.get("raw_path") or b"", scope.get("query_string") or b""):
        if b"%" in part:
            try:
                unquote_to_bytes(part).decode("utf-8")
            except UnicodeDecodeError:
                return 422, "invalid_input", "the URL is not valid UTF-8 once percent-decoded", {}
    return None


class Edge:
    """Pure ASGI middleware in front of the routes (cheaper than per-route dependencies):
    body size limit (413) and read timeout (408), API-key authentication and rate limit of
    ``/v1`` (401 / 429), request latency metrics, and the :class:`DirectRoute` s (``direct``,
    by last path part).
    ``routes``: the app's routes, to label the metrics of what the edge refuses itself."""

    def __init__(
        self,
        app: Any,
        settings: ServerSettings,
        metrics: ServerMetrics,
        keyring: KeyRing | None,
        limits: KeyLimits,
        errors: ErrorMapper,
        direct: dict[str, DirectRoute] | None = None,
        routes: Sequence[BaseRoute] = (),
    ) -> None:
        self.app = app
        self.routes = routes
        self.errors = errors
        self.direct = direct
        self.settings = settings
        self.limit = settings.max_body_bytes
        self.metrics = metrics
        self.keyring = keyring
        self.limits = limits
        self.open_scope = Scope(Principal(None, "open"), settings)

    async def _refuse(
        self,
        scope: dict,
        receive: Any,
        send: Any,
        status: int,
        code: str,
        detail: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        reason = _REFUSAL_REASONS[status]
        self.metrics.rejected.labels(reason).inc()
        self._name_route(scope)
        await error_response(status, code, detail, headers)(scope, receive, send)

    def _name_route(self, scope: dict) -> None:
        """Put the route a refused request was for in its scope, as the router would have: its
        metrics label is that route, not ``unmatched``. Only refusals pay for the lookup."""
        for route in self.routes:
            if route.matches(scope)[0] is Match.FULL:
                scope["route"] = route
                return

    def _authenticate(self, scope: dict, headers: Any, length: int | None) -> Scope | Refusal:
        """The caller's scope, or why not: no or unknown key (401; 429 once an address has
        sent too many unknown keys), an admin key off ``/v1/stats`` (403), over its request
        or byte rate (429; a body of known ``length`` is charged here, a chunked one as it is
        read)."""
        if self.keyring is None:
            return self.open_scope
        token = None
        for k, v in headers:
            if k == b"authorization":
                scheme, _, cred = v.decode("latin-1").strip().partition(" ")
                if scheme.lower() == "bearer" and cred.strip():
                    token = cred.strip()
                break
        challenge = {"WWW-Authenticate": "Bearer"}
        if token is None:
            detail = "missing API key: send 'Authorization: Bearer KEY'"
            return 401, "unauthorized", detail, challenge
        principal = self.keyring.lookup(token)
        if principal is None:
            return self._unknown_key(scope, challenge)
        if principal.admin and scope["path"] != "/v1/stats":
            return 403, "forbidden", "an admin key reads /v1/stats only", {}
        refused = self.limits.request(principal.key_id)
        if refused is None and length:
            refused = self.limits.body(principal.key_id, length)
        return refused or Scope(principal, self.settings)

    def _unknown_key(self, scope: dict, challenge: dict[str, str]) -> Refusal:
        """401, or 429 for an address past its budget of unknown keys: guessing keys from one
        address runs at ``auth_failures_per_s`` at most."""
        client = scope.get("client") or ("unknown", 0)
        wait = self.limits.unknown_keys.take(str(client[0]))
        if wait > 0:
            retry = RateLimiter.retry_after(wait)
            detail = f"too many unknown API keys from this address; retry in {retry} s"
            return 429, "rate_limited", detail, {"Retry-After": str(retry)}
        return 401, "unauthorized", "unknown API key", challenge

    #: Probes that answer HEAD as GET, without the body: load balancers' health checks often
    #: send HEAD. Served here, not as routes: the API description and the app's routes keep
    #: one GET operation each (HEAD is GET's by HTTP's rules).
    HEAD_AS_GET: ClassVar[frozenset[str]] = frozenset({"/health", "/ready"})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "HEAD" and scope["path"] in self.HEAD_AS_GET:
            # a copy: the HTTP server's own scope still says HEAD (it sends no body for it)
            scope = {**scope, "method": "GET"}
            send = _without_body(send)
        send = _ObservedSend(self.metrics, scope, send)
        try:
            await self._serve(scope, receive, send)
        finally:
            send.finish()  # an answer that never went out (an exception, a disconnect)

    async def _serve(self, scope: dict, receive: Any, send: _ObservedSend) -> None:
        headers = scope.get("headers", ())
        bad = _malformed(scope, headers, self.settings.max_header_bytes)
        if bad is not None:
            await self._refuse(scope, receive, send, *bad)
            return
        length = _content_length(headers)
        if length is not None and length > self.limit:
            detail = f"the request body exceeds {self.limit} bytes"
            await self._refuse(scope, receive, send, 413, "too_large", detail)
            return
        charge = None
        if scope["path"].startswith("/v1/"):
            auth = self._authenticate(scope, headers, length)
            if isinstance(auth, tuple):
                await self._refuse(scope, receive, send, *auth)
                return
            scope.setdefault("state", {})[TENANCY] = auth
            if length is None and self.keyring is not None:
                charge = auth.principal.key_id  # a chunked body: charged once it is read
            if self.direct is not None and scope["method"] == "POST":
                hit = _direct_match(self.direct, scope)
                if hit is not None:
                    await self._serve_direct(*hit, auth, scope, receive, send, length, charge)
                    return
        await self.app(scope, self._limited(scope, receive, length, charge), send)

    async def _serve_direct(
        self,
        route: DirectRoute,
        user_id: str,
        tenancy: Scope,
        scope: dict,
        receive: Any,
        send: Any,
        length: int | None = None,
        charge: str | None = None,
    ) -> None:
        scope["route"] = route  # as FastAPI sets it: the metrics label is route.path
        try:
            body = await self._read_body(self._limited(scope, receive, length, charge))
            content_type = next(
                (v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"),
                None,
            )
            response = await route.handler(tenancy, user_id, route.parse(body, content_type))
        except Exception as exc:
            mapped = self.errors(exc, tenancy)
            if mapped is None:
                raise  # on to Starlette's 500 answer (observed as 500 by _ObservedSend)
            response = mapped
        await response(scope, receive, send)

    def _limited(
        self, scope: dict, receive: Any, length: int | None, charge: str | None = None
    ) -> Callable[[], Awaitable[dict]]:
        """The one ``receive`` every route reads its body through (the direct routes'
        :meth:`_read_body`, FastAPI's ``request.body()``), which:

        * raises :class:`_BodyTooLarge` once the body passes the limit (a body without
          Content-Length is counted as it is read);
        * with ``charge`` (a key id), charges the body's bytes to that key's byte rate once it
          is read (429 past it);
        * raises :class:`_BodyTimeout` (408) when the whole body has not arrived
          ``body_timeout_s`` after the request reached the edge. The whole body, not each gap
          between chunks: a client trickling a byte a second would pass any gap timeout. Once
          the body is complete (or the client gone), ``receive`` is passed through untimed: a
          wait for the client's disconnect is no body read."""
        seen = 0
        done = False
        timeout = self.settings.body_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout

        async def limited_receive() -> dict:
            nonlocal seen, done
            if done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    msg = await receive()
            except TimeoutError:
                done = True
                client = scope.get("client") or ("unknown", 0)
                log.info(
                    "%s %s from %s: the request body did not arrive within %g s (%d of %s "
                    "bytes); answered 408 and closed the connection",
                    scope.get("method"),
                    scope.get("path"),
                    client[0],
                    timeout,
                    seen,
                    length if length is not None else "?",
                )
                raise _BodyTimeout(timeout, seen, length) from None
            if msg["type"] != "http.request":  # http.disconnect: nothing more will come
                done = True
                return msg
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge(self.limit)
            if not msg.get("more_body", False):
                done = True
                if charge is not None:
                    refused = self.limits.body(charge, seen)
                    if refused is not None:
                        raise ApiError(*refused)
            return msg

        return limited_receive

    @staticmethod
    async def _read_body(receive: Callable[[], Awaitable[dict]]) -> bytes:
        chunks: list[bytes] = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                return b"".join(chunks)


def _without_body(send: Any) -> Callable[[dict], Awaitable[None]]:
    """``send`` that sends every body message empty: a HEAD answer's headers are its GET's
    (Content-Length included), its body is none."""

    async def bodiless(msg: dict) -> None:
        if msg["type"] == "http.response.body":
            msg = {**msg, "body": b""}
        await send(msg)

    return bodiless


class _ObservedSend:
    """A request's ``send`` that records it in the HTTP metrics (method, route template,
    status, latency) as its answer's last body message goes out, before handing that message
    on: a client that reads an answer and then scrapes ``/metrics`` finds the request there.
    (Observed after the send, a scrape could overtake it: the label lists of two identical
    request scripts then differed at random.)"""

    __slots__ = ("_done", "_metrics", "_scope", "_send", "_status", "_t0")

    def __init__(self, metrics: ServerMetrics, scope: dict, send: Any) -> None:
        self._metrics, self._scope, self._send = metrics, scope, send
        self._t0 = time.perf_counter()
        self._status = 500  # no answer sent: Starlette's 500 goes out past this middleware
        self._done = False

    async def __call__(self, msg: dict) -> None:
        if msg["type"] == "http.response.start":
            self._status = msg["status"]
        elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
            self.finish()
        await self._send(msg)

    def finish(self) -> None:
        """Record the request (once): at its last body message, or when it ends without one."""
        if self._done:
            return
        self._done = True
        route = self._scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        self._metrics.http.labels(self._scope.get("method", ""), path, str(self._status)).observe(
            time.perf_counter() - self._t0
        )

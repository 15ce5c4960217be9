"""What every route shares: the request's tenancy (:class:`Scope`), the error type and
response helpers, fast JSON, and the input limits.

A route module imports these rather than reaching into :mod:`memoryos_gpu.server.app`, so the
native routes, the mem0-shaped routes and the edge middleware answer alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import HTTPException, Request
from fastapi import Path as PathParam
from fastapi.responses import Response

from memoryos_gpu.engine.assembly import retrieval_fields as engine_fields
from memoryos_gpu.engine.assembly import retrieval_json

# the engine's own id and text rules (private names, no public alias): the server refuses
# what they refuse before the engine sees it, so a bad id is always `invalid_user_id`, never
# the engine's `invalid_input`, and text is blank as the engine will store it (one rule, not
# a copy that drifts)
from memoryos_gpu.engine.validation import MAX_ID_CHARS as ENGINE_ID_CHARS
from memoryos_gpu.engine.validation import (
    InvalidInputError,
    _clean_text,
    _new_identity,
    clean_user_id,
)
from memoryos_gpu.json_codec import dumps
from memoryos_gpu.server.auth import Principal
from memoryos_gpu.server.settings import ServerSettings


def retrieval_fields(r: Any, known: bool) -> dict[str, Any]:
    """A retrieval's JSON fields but ``user_id`` (which a route writes in the caller's tenant
    form), ``known_user`` last."""
    return {**engine_fields(r), "known_user": known}


def with_known(body: bytes, known: bool) -> bytes:
    """A retrieval's JSON object (``retrieval_json``, or the engine's ``as_json`` bytes) with
    ``known_user`` last."""
    return body[:-1] + (b',"known_user":true}' if known else b',"known_user":false}')


def retrieval_body(r: Any, known: bool) -> bytes:
    """A retrieval as the JSON object its HTTP route answers, less ``user_id`` (the route puts
    it first: :func:`with_user_id`), for a Retrieval object. The engine writes the same bytes
    natively for its own batches (``retrieve_many(..., as_json=True)``: no Python object per
    page, nothing pickled between processes)."""
    return with_known(retrieval_json(r), known)


class RetrievalBodies:
    """``retrieve_body`` for a service whose retrievals come as objects (the Ray Serve
    router): its ``retrieve``, then the JSON. The engine's own service has the engine write
    the JSON for its batches (``MemoryService.retrieve_body``)."""

    async def retrieve_body(
        self: Any,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
    ) -> bytes:
        r = await self.retrieve(user_id, query, top_pages=top_pages, top_segments=top_segments)
        return retrieval_body(r, self.is_known(user_id))


def with_user_id(user_id: str, body: bytes) -> bytes:
    """``body`` (a JSON object's bytes, :func:`retrieval_body`) with ``user_id`` first."""
    return b'{"user_id":' + dumps(user_id) + b"," + body[1:]


class ApiError(HTTPException):
    """An error answered as ``{"error": code, "detail": message}``."""

    def __init__(
        self, status: int, code: str, detail: Any, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(status, detail, dict(headers) if headers else None)
        self.code = code


def json_response(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """``data`` as JSON (:func:`~memoryos_gpu.json_codec.dumps`: it encodes whatever a store
    holds, so an answer never fails after its write)."""
    return Response(dumps(data), status, dict(headers or {}), media_type="application/json")


def error_response(
    status: int, code: str, detail: Any, headers: Mapping[str, str] | None = None
) -> Response:
    """The documented error shape, ``{"error": code, "detail": detail}``."""
    return json_response({"error": code, "detail": detail}, status, headers)


TENANCY = "memoryos_tenancy"
MAX_ID_CHARS = 256  # the engine's limit of stored ids (tenant prefix included)
UserId = Annotated[
    str,
    PathParam(description="The user's id (within the caller's tenant); a '/' in it as %2F."),
]


def done_writing(in_flight: Counter[str], users: Counter[str]) -> None:
    """Take a finished write's ``users`` (pages per user) out of ``in_flight``, the writes a
    service has queued per user (a user with one in flight is known before its pages land),
    dropping users left with none: one rule for every service that counts them."""
    in_flight.subtract(users)
    for u in users:
        if in_flight[u] <= 0:
            del in_flight[u]


# ====================================================================== tenancy
def user_id_problem(user_id: str, *, written: bool = True) -> str | None:
    """Why a client's ``user_id`` is refused, or None if it is acceptable.

    Every id: not blank, no control characters, and whatever else the engine's id check
    refuses (``clean_user_id``: C1 controls, surrogates), so that the answer is always the
    server's ``invalid_user_id``. An id pages are written under (``written``: the HTTP routes
    that add pages, and every tool of the MCP server, which follows this rule so that its
    users are the HTTP API's) also:

    * holds no '/': an open server stores ids as given, and a stored ``team/alice`` would
      read as tenant ``team``'s user ``alice`` once the server has keys;
    * is not ``.`` or ``..``: clients and proxies remove such path segments (RFC 3986 dot
      segments), so ``/v1/users/../pages`` reaches ``/v1/pages``: the user could never be
      addressed;
    * passes the engine's identity check (``_new_identity``: visible, NFC).

    An id a request reads, edits or deletes (``written=False``) may hold '/': the library
    and ``ingest`` store such ids, and the routes address them (``%2F`` in a path,
    :mod:`memoryos_gpu.server.paths`)."""
    if not user_id or not user_id.strip():
        return "user_id must not be blank"
    if any(ord(c) < 32 or ord(c) == 127 for c in user_id):
        return "user_id must not contain control characters"
    if written and "/" in user_id:
        return "user_id must not contain '/'"
    if written and user_id in (".", ".."):
        return (
            f"user_id must not be {user_id!r}: HTTP clients and proxies drop '.' and '..' "
            "path segments, so the user could not be addressed"
        )
    if len(user_id) > ENGINE_ID_CHARS:  # refused by its length: each caller names its limit
        return None
    try:
        if written:
            _new_identity(user_id, "user_id")
        else:
            clean_user_id(user_id)
    except InvalidInputError as exc:
        return str(exc)
    return None


class Scope:
    """A request's tenant: maps client ids to stored ids and back."""

    def __init__(self, principal: Principal, settings: ServerSettings) -> None:
        self.principal = principal
        self.tenant = principal.tenant
        self.settings = settings
        self.prefix = f"{self.tenant}/" if self.tenant else ""

    def user(self, user_id: str) -> str:
        """The stored id (tenant prefix added) of a client's ``user_id`` that pages are
        written under, or a 422 saying why it is refused (:func:`user_id_problem`, then the
        length limit)."""
        return self._stored(user_id, user_id_problem(user_id))

    def named_user(self, user_id: str) -> str:
        """The stored id of a client's ``user_id`` that a request reads, edits or deletes: as
        :meth:`user`, but a '/' is allowed (a user the library stored so is addressable)."""
        return self._stored(user_id, user_id_problem(user_id, written=False))

    def _stored(self, user_id: str, problem: str | None) -> str:
        if problem:
            raise ApiError(422, "invalid_user_id", problem)
        limit = min(self.settings.max_user_id_chars, MAX_ID_CHARS - len(self.prefix))
        if len(user_id) > limit:
            raise ApiError(
                422,
                "invalid_user_id",
                f"user_id is {len(user_id)} characters; the limit is {limit}",
            )
        return self.prefix + user_id

    def name(self, value: str | None) -> str | None:
        """Namespace an assistant id or source (None stays None, except the default assistant
        of a tenant, which is the tenant's own)."""
        if value is None:
            return None
        return self.prefix + value

    def default_assistant(self) -> str | None:
        """The assistant of a new user whose page names none: the tenant's own ``default``
        (tenants never share an assistant's knowledge); None in open mode (the engine's
        ``default``). A page naming none joins a known user's own assistant, whichever it
        is (``PageInput.default_assistant``): naming this one for it refused the page."""
        return self.prefix + "default" if self.tenant else None

    def unprefixed(self, message: str) -> str:
        """``message`` (an engine error's) with this tenant's prefix taken off every quoted id
        (``'acme/alice'`` -> ``'alice'``): the client never sent, and never sees, the prefix."""
        if not self.prefix:
            return message
        for quote in ("'", '"'):
            message = message.replace(quote + self.prefix, quote)
        return message

    def owns(self, stored_id: str) -> bool:
        return not self.prefix or stored_id.startswith(self.prefix)

    def strip(self, stored_id: Any) -> Any:
        if self.prefix and isinstance(stored_id, str) and stored_id.startswith(self.prefix):
            return stored_id[len(self.prefix) :]
        return stored_id

    def strip_ids(self, data: Any) -> Any:
        """Remove the tenant prefix from id fields anywhere in a JSON-like structure (a copy:
        its dicts and lists new, the rest shared).

        Iterative: a page's meta is part of what is stripped, and the recursive walk of one
        call per level raised RecursionError (a 500 on every read of that user, under
        ``serve --workers`` from ~480 levels); the engine now refuses a meta deeper than
        ``MAX_META_DEPTH``, but a store may hold one written before."""
        if not self.prefix or not isinstance(data, dict | list):
            return data
        out: Any = {} if isinstance(data, dict) else []
        todo: list[tuple[Any, Any]] = [(data, out)]
        while todo:
            src, dst = todo.pop()
            items = src.items() if isinstance(src, dict) else enumerate(src)
            for k, v in items:
                if isinstance(src, dict) and k in _ID_FIELDS:
                    v = self.strip(v)
                elif isinstance(v, dict | list):
                    child: Any = {} if isinstance(v, dict) else []
                    todo.append((v, child))
                    v = child
                if isinstance(dst, dict):
                    dst[k] = v
                else:
                    dst.append(v)
        return out


#: The fields :meth:`Scope.strip_ids` takes the tenant prefix off, at any depth.
_ID_FIELDS = frozenset(("user_id", "owner_id", "assistant_id", "agent_id", "source", "source_user"))


def check_text(settings: ServerSettings, **texts: str | None) -> None:
    limit = settings.max_text_chars
    for name, text in texts.items():
        if text is not None and len(text) > limit:
            raise ApiError(
                413, "too_large", f"{name} is {len(text)} characters; the limit is {limit}"
            )


def is_blank(text: str | None) -> bool:
    """Whether ``text`` is empty or only whitespace once the engine has normalised it
    (control characters dropped: ``"\\u0000"`` is stored as ``""``). The engine keeps such
    text (it never drops a page it is given); the HTTP routes refuse a page or memory of no
    words, which fills a short-term slot with nothing to retrieve."""
    if text is None:
        return True
    return not _clean_text(text, "text").strip()


def check_count(settings: ServerSettings, n: int, what: str) -> None:
    if n > settings.max_batch_items:
        raise ApiError(
            413, "too_large", f"{n} {what} in one request; the limit is {settings.max_batch_items}"
        )


def tenancy(request: Request) -> Scope:
    """The caller's tenancy, put in the ASGI scope by the edge middleware after authentication."""
    return request.scope["state"][TENANCY]

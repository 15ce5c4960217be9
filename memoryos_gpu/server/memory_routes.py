"""The memory routes: add pages (one, or a batch of many users'), retrieve (one user's query,
or many users' in one request) and respond (chat with memory). Writes join the fair write
queue, retrievals the retrieval micro-batch (:class:`~memoryos_gpu.server.service.MemoryService`);
the two hottest routes also have a direct path that skips FastAPI's routing
(:class:`~memoryos_gpu.server.edge.DirectRoute`, ``settings.direct_routes``)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from memoryos_gpu.engine.validation import MAX_META_BYTES, InvalidInputError, check_meta_depth
from memoryos_gpu.llm.base import LLMBackendError
from memoryos_gpu.llm.breaker import DEFAULT_COOLDOWN_S
from memoryos_gpu.log_setup import LogThrottle
from memoryos_gpu.server import models as m
from memoryos_gpu.server.batching import Unavailable
from memoryos_gpu.server.bodies import parse_body
from memoryos_gpu.server.edge import DirectRoute, operator_may_read
from memoryos_gpu.server.scope import (
    ApiError,
    Scope,
    UserId,
    check_count,
    check_text,
    dumps,
    is_blank,
    json_response,
    retrieval_fields,
    tenancy,
    with_user_id,
)
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import PageInput

__all__ = ["BLANK_PAGE", "add_memory_routes", "check_meta"]

log = logging.getLogger("memoryos_gpu.server")
#: The LLM's failures as respond meets them, one line per request otherwise (LogThrottle).
LLM_LOG = LogThrottle()
#: Seconds a client is told to wait when the LLM server cannot be used and the error does not
#: say for how long: an HTTP LLM backend's circuit breaker (by default) fails every call at
#: once for this long after it opened.
LLM_RETRY_AFTER = int(DEFAULT_COOLDOWN_S)


#: Why a page of no words is refused (an add, or an edit that would leave one): mem0's add and
#: a knowledge entry's edit refuse text of no words too; the engine and ``ingest`` keep such a
#: page (they never drop a page they are given), the HTTP API does not take one.
BLANK_PAGE = (
    "user_input and agent_response are both blank (empty or only whitespace once control "
    "characters are dropped): a page of no words cannot be retrieved; send some text"
)


def check_meta(meta: Mapping[str, Any], limit: int) -> None:
    """Refuse a page's ``meta`` as every way in refuses it, with :class:`ApiError`: 422
    ``invalid_input`` unless it reads as the HTTP API reads a request body
    (:func:`~memoryos_gpu.server.bodies.parse_body`: no integer outside 64 bits, no lone
    surrogate, no NaN), 413 ``too_large`` past ``limit`` bytes of JSON as stored (UTF-8) or
    the engine's :data:`~memoryos_gpu.engine.validation.MAX_META_BYTES`, whichever is lower.
    The HTTP routes read their bodies so already; the MCP server's tools get arguments the SDK
    read, which keeps all three, so one rule here keeps MCP from storing what HTTP refuses.

    Why the engine's limit here too: it applies after this check, with a 422, so a meta
    between the two limits got a 422 where every other size limit answers 413."""
    if not meta:
        return
    try:  # first: the encoders below recurse once or more per level
        check_meta_depth(meta)
    except InvalidInputError as exc:
        raise ApiError(422, "invalid_input", str(exc)) from None
    try:
        size = len(dumps(meta))  # what the store keeps, measured as the engine measures it
        exact = json.dumps(meta).encode()  # exact integers, NaN as NaN, surrogates escaped
    except (TypeError, ValueError) as exc:
        raise ApiError(422, "invalid_input", f"meta is not JSON: {exc}") from None
    limit = min(limit, MAX_META_BYTES)
    if size > limit:
        raise ApiError(
            413, "too_large", f"meta is {size} bytes as stored (UTF-8 JSON); the limit is {limit}"
        )
    try:
        parse_body(exact, "application/json")
    except RequestValidationError as exc:
        (first, *_) = exc.errors()
        # an int_out_of_range error's loc names the key; a json_invalid one's is a position
        wide = first["type"] == "int_out_of_range"
        where = "".join(f"[{k!r}]" for k in first["loc"][1:]) if wide else ""
        raise ApiError(
            422, "invalid_input", f"meta{where}: {first['msg']} ({first['type']})"
        ) from None


def _llm_outage(exc: LLMBackendError) -> Unavailable:
    """What a respond answers when its LLM cannot be used at all (unreachable, failing every
    request, its circuit breaker open, or refusing the key or model: the message says which):
    503 ``unavailable`` with Retry-After, as for any part of the server that cannot serve now,
    since the same call may succeed once it is back; one log line for the operator and no
    traceback (nothing in this server failed)."""
    # once per request while the LLM is down: throttled (the 503s are counted in /metrics)
    LLM_LOG.log(
        log, "respond-llm-down", logging.WARNING, "respond: the LLM cannot be used: %s", exc
    )
    wait = _llm_retry_after(exc)
    return Unavailable(  # the error names the LLM's URL (and user): a tenant reads it without
        f"the LLM cannot be used now; nothing was remembered: {exc}",
        wait,
        public=f"the LLM cannot be used now; nothing was remembered; retry in {wait} s",
    )


def _llm_failure(error: str, scope: Scope) -> str:
    """A 502's detail: the LLM's error for the operator; a tenant's reads only that the call
    failed, since the LLM server's own text (an upstream error page, a proxy's message, a
    body excerpt) may name hosts, models and other tenants' traffic (the log has it all)."""
    said = "no usable answer from the LLM (nothing remembered)"
    if operator_may_read(scope):
        return f"{said}: {error}"
    return f"{said}; the server's log says why"


def _llm_retry_after(exc: LLMBackendError) -> int:
    """Retry-After for ``exc``: the open breaker's remaining cool-down (whole seconds, rounded
    up: a client back sooner is refused again), which the body's "not trying again for N s"
    states too; :data:`LLM_RETRY_AFTER` when the error gives none (never below 1)."""
    wait = getattr(exc, "retry_after", None)
    if wait is None:
        return LLM_RETRY_AFTER
    return max(1, math.ceil(float(wait)))


def add_memory_routes(
    app: FastAPI,
    service: Any,
    settings: ServerSettings,
    charge_pages: Callable[[Scope, int], None],
) -> dict[str, DirectRoute]:
    """Declare the write, retrieval and respond routes on ``app``; returns the direct paths of
    the one-page write and the one-user retrieval (the edge serves them when
    ``settings.direct_routes``)."""

    def _page_input(scope: Scope, user_id: str, p: m.PageIn) -> PageInput:
        check_text(settings, user_input=p.user_input, agent_response=p.agent_response)
        if is_blank(p.user_input) and is_blank(p.agent_response):
            raise ApiError(422, "invalid_input", BLANK_PAGE)
        check_meta(p.meta, settings.max_text_chars)
        return PageInput(
            user_id=scope.user(user_id),
            user_input=p.user_input,
            agent_response=p.agent_response,
            timestamp=p.timestamp,
            assistant_id=scope.name(p.assistant_id),
            source=scope.name(p.source),
            meta=p.meta,
            default_assistant=scope.default_assistant(),
        )

    def _add_out(scope: Scope, results: list[Any]) -> list[dict[str, Any]]:
        return [
            {"page_id": r.page_id, "user_id": scope.strip(r.user_id), "duplicate": r.duplicate}
            for r in results
        ]

    def _retrieval_out(scope: Scope, r: Any) -> dict[str, Any]:
        return {
            "user_id": scope.strip(r.user_id),
            **retrieval_fields(r, service.is_known(r.user_id)),
        }

    async def _add_sources(results: list[Any]) -> None:
        """Name the source pages of every knowledge entry the results return: one store query
        per engine (shard), outside the retrieval batch, so only requests that ask pay."""
        groups: dict[int, tuple[Any, list[Any]]] = {}
        for r in results:
            eng = service.engine_for(r.user_id)
            entries = [*r.user_knowledge, *r.assistant_knowledge]
            groups.setdefault(id(eng), (eng, []))[1].extend(entries)
        for eng, entries in groups.values():
            found = await service.call(eng.knowledge_sources, [e.entry_id for e in entries])
            for e in entries:
                e.sources = found.get(e.entry_id, [])

    async def _add_page(scope: Scope, user_id: str, page: m.PageIn) -> Response:
        item = _page_input(scope, user_id, page)
        charge_pages(scope, 1)
        results = await service.add_pages([item])
        return json_response(_add_out(scope, results)[0], 201)

    async def _retrieve(scope: Scope, user_id: str, body: m.RetrieveIn) -> Response:
        check_text(settings, query=body.query)
        uid = scope.named_user(user_id)
        if not body.sources:  # the JSON comes made (under --workers, by the engine process)
            raw = await service.retrieve_body(
                uid, body.query, top_pages=body.top_pages, top_segments=body.top_segments
            )
            return Response(with_user_id(scope.strip(uid), raw), media_type="application/json")
        r = await service.retrieve(
            uid, body.query, top_pages=body.top_pages, top_segments=body.top_segments
        )
        await _add_sources([r])
        return json_response(_retrieval_out(scope, r))

    @app.post(
        "/v1/users/{user_id}/pages",
        tags=["memory"],
        summary="Add a page",
        description="Remember one exchange of the user (`user_input` and `agent_response` not "
        "both blank: 422). Answers after the page is committed "
        "(batched with concurrent writes into one engine call; the user's pages keep their "
        "order). Derived work (chain, mid-term placement, promotion) follows in the background; "
        "`POST /v1/users/{user_id}/wait` waits for it.",
        status_code=201,
        response_model=m.AddResult,
    )
    async def add_page(page: m.PageIn, user_id: UserId, request: Request) -> Any:
        return await _add_page(tenancy(request), user_id, page)

    @app.post(
        "/v1/pages",
        tags=["memory"],
        summary="Add pages (batch)",
        description="Remember many exchanges, of one or many users, in one request. Pages are "
        "applied in request order per user and committed before the answer.",
        status_code=201,
        response_model=m.AddResults,
    )
    async def add_pages(body: m.PagesIn, request: Request) -> Any:
        scope = tenancy(request)
        check_count(settings, len(body.pages), "pages")
        items = [_page_input(scope, p.user_id, p) for p in body.pages]
        charge_pages(scope, len(items))
        results = await service.add_pages(items)
        return json_response({"results": _add_out(scope, results)}, 201)

    # ------------------------------------------------------------------ reads
    @app.post(
        "/v1/users/{user_id}/retrieve",
        tags=["memory"],
        summary="Retrieve memory for a query",
        description="All of short-term memory, the top mid-term pages (segments by cosine + "
        "keyword Jaccard, then pages by cosine), the profile and the top user / assistant "
        "knowledge. Concurrent retrievals of all users share one engine call. A user with no "
        "memory yet gets empty lists (`known_user: false`).",
        response_model=m.RetrievalOut,
    )
    async def retrieve(body: m.RetrieveIn, user_id: UserId, request: Request) -> Any:
        return await _retrieve(tenancy(request), user_id, body)

    @app.post(
        "/v1/retrieve",
        tags=["memory"],
        summary="Retrieve memory for many users (batch)",
        description="Several users' queries in one request; answers in request order.",
        response_model=m.RetrievalsOut,
    )
    async def retrieve_many(body: m.RetrieveManyIn, request: Request) -> Any:
        scope = tenancy(request)
        check_count(settings, len(body.queries), "queries")
        for q in body.queries:
            check_text(settings, query=q.query)
        uids = [scope.named_user(q.user_id) for q in body.queries]
        res = await asyncio.gather(
            *(
                service.retrieve(u, q.query, top_pages=q.top_pages, top_segments=q.top_segments)
                for u, q in zip(uids, body.queries, strict=True)
            )
        )
        await _add_sources([r for r, q in zip(res, body.queries, strict=True) if q.sources])
        return json_response({"results": [_retrieval_out(scope, r) for r in res]})

    @app.post(
        "/v1/users/{user_id}/respond",
        tags=["memory"],
        summary="Chat with memory",
        description="Retrieve, prompt the LLM with the memory, answer, and remember the exchange. "
        "Needs an engine in LLM mode: 501 `llm_unavailable` otherwise. 404 for a user with no "
        "memory yet. 502 `llm_error` when the LLM's call failed (or its answer was longer than "
        "`max_tokens` allows), 503 `unavailable` with Retry-After when the LLM server cannot "
        "be used now (unreachable, or failing every request); either way nothing is remembered.",
        response_model=m.RespondOut,
        responses={
            501: {"model": m.ErrorOut, "description": "The server runs without an LLM."},
            502: {"model": m.ErrorOut, "description": "The LLM's call failed."},
            503: {"model": m.ErrorOut, "description": "The LLM server cannot be used now."},
        },
    )
    async def respond(body: m.RespondIn, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        check_text(settings, query=body.query)
        uid = scope.user(user_id)
        try:
            r = await service.respond(uid, body.query, timestamp=body.timestamp)
        except LLMBackendError as exc:
            raise _llm_outage(exc) from None
        if r.error is not None:  # a gateway's answer: the upstream (the LLM) failed
            LLM_LOG.log(
                log,
                "respond-llm-error",
                logging.WARNING,
                "respond: no usable answer from the LLM: %s",
                r.error,
            )
            raise ApiError(502, "llm_error", _llm_failure(r.error, scope))
        return json_response(
            {
                "user_id": user_id,
                "query": r.query,
                "text": r.text,
                "page_id": r.page_id,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "error": None,
                "retrieval": _retrieval_out(scope, r.retrieval),
            }
        )

    return {
        "pages": DirectRoute("/v1/users/{user_id}/pages", m.PageIn, _add_page),
        "retrieve": DirectRoute("/v1/users/{user_id}/retrieve", m.RetrieveIn, _retrieve),
    }

"""The HTTP server: FastAPI routes over a :class:`~memoryos_gpu.server.service.MemoryService`.

``create_app(config_or_engine, api_keys=..., settings=...)`` builds the app;
``run(store=..., host=..., port=..., api_keys=...)`` serves it with uvicorn (the CLI's
``memoryos-gpu serve``). See docs/server.md for the API, tenancy and tuning.

Tenancy: with API keys configured every ``/v1`` route needs ``Authorization: Bearer KEY``; the
key names a tenant and the tenant's users are stored as ``"{tenant}/{user}"`` (assistants as
``"{tenant}/{assistant}"``, idempotency sources as ``"{tenant}/{source}"``), so two tenants never
share a user, an assistant's knowledge or a source. Without keys the server runs open: one
tenant, user ids stored as given.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.errors import UnknownUserError
from memoryos_gpu.server import models as m
from memoryos_gpu.server.auth import KeyLimits, KeyRing, load_api_keys
from memoryos_gpu.server.edge import DirectRoute, Edge, ErrorMapper
from memoryos_gpu.server.mem0_routes import add_mem0_routes
from memoryos_gpu.server.metrics import ServerMetrics
from memoryos_gpu.server.scope import (
    TENANCY,
    ApiError,
    Scope,
    UserId,
    check_count,
    check_text,
    dumps,
    json_response,
    storable_id,
    tenancy,
)
from memoryos_gpu.server.service import MemoryService
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import PageInput

__all__ = ["ApiError", "create_app", "run"]

log = logging.getLogger("memoryos_gpu.server")
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": m.ErrorOut, "description": "Missing or unknown API key."},
    403: {"model": m.ErrorOut, "description": "The resource belongs to another tenant."},
    413: {"model": m.ErrorOut, "description": "Body, text or batch over the limit."},
    422: {"model": m.ErrorOut, "description": "Malformed request."},
    429: {
        "model": m.ErrorOut,
        "description": "Rate limit of the key (requests, body bytes or pages per second), or "
        "the tenant's share of the write queue is full (see Retry-After).",
    },
    503: {"model": m.ErrorOut, "description": "Overloaded, loading or shutting down."},
}


# ====================================================================== app
def create_app(
    engine_config_or_engine: EngineConfig | Any | None = None,
    *,
    api_keys: Mapping[str, str] | str | Path | None = None,
    settings: ServerSettings | None = None,
    use_env_keys: bool = True,
    service: Any = None,
    limits: KeyLimits | None = None,
) -> FastAPI:
    """Build the HTTP app.

    ``engine_config_or_engine``: an :class:`EngineConfig` (the server builds the engine, with
    ``auto_process=False``, at startup, and closes it at shutdown) or a ready engine (used as
    is; construct it with ``auto_process=False`` so derived work stays off the request path).
    ``api_keys``: ``{key: tenant}`` or the path of a ``KEY TENANT`` file; keys from the
    ``MEMORYOS_GPU_API_KEYS`` variable are added unless ``use_env_keys=False``. No keys at all:
    the server runs open (single tenant) and says so in its startup log.
    ``service``: serve this object instead of a :class:`MemoryService` over the engine (it
    must offer the same methods; the sharded router of ``memoryos-gpu serve --ray`` does, and
    so does each worker of ``serve --workers``). ``limits``: the rate-limit buckets (the
    workers of ``serve --workers`` share one set: :mod:`memoryos_gpu.server.shared_limits`).
    """
    settings = settings or ServerSettings()
    keys = load_api_keys(api_keys, use_env=use_env_keys)
    keyring = KeyRing(keys) if keys else None
    limits = limits or KeyLimits(settings)
    metrics = ServerMetrics()
    if service is None:
        service = MemoryService(
            engine_config_or_engine if engine_config_or_engine is not None else EngineConfig(),
            settings,
            metrics=metrics,
        )
    else:  # a ready-made service (the Ray Serve router: memoryos_gpu.distributed.ray_serve)
        service.metrics = metrics
    metrics.bind(service)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if keyring is None:
            log.warning(
                "memoryos-gpu server: OPEN mode, no API keys configured: every client is one "
                "tenant and /v1 needs no key"
            )
        else:
            log.info(
                "memoryos-gpu server: %d API key(s) for %d tenant(s)",
                len(keyring),
                len(keyring.tenants),
            )
        await service.start(wait=False)
        try:
            yield
        finally:
            await service.close()
            metrics.close()
            # a worker process only stops its HTTP side: its service says what its close did
            done = getattr(
                service, "closed_message", "queues drained, derived work done, engine closed"
            )
            log.info("memoryos-gpu server: %s", done)

    app = _fastapi(
        settings,
        title="memoryos-gpu",
        version="0.1.0",
        summary="MemoryOS (short-, mid- and long-term agent memory) for many users, batched.",
        description=(
            "Add dialogue pages, retrieve memory for a query, chat with memory, read profiles "
            "and knowledge. Concurrent requests are micro-batched into single engine calls. "
            "Every `/v1` route needs `Authorization: Bearer KEY` when the server has API keys."
        ),
        lifespan=lifespan,
        responses=_ERROR_RESPONSES,
        # operationIds are the handlers' names (add_page, retrieve, mem0_search, ...): stable
        # for generated clients, not derived from paths and methods
        generate_unique_id_function=lambda route: route.name,
    )
    app.state.service = service
    app.state.metrics = metrics
    app.state.settings = settings
    _document_security(app, keyring is not None)

    # ------------------------------------------------------------------ errors
    errors = ErrorMapper(metrics)

    async def _handle(request: Request, exc: Exception) -> Response:
        response = errors(exc, request.scope.get("state", {}).get(TENANCY))
        if response is None:  # not one of the classes it is registered for: Starlette's 500
            raise exc
        return response

    for exc_class in ErrorMapper.CLASSES:
        app.add_exception_handler(exc_class, _handle)

    def _page_input(scope: Scope, user_id: str, p: m.PageIn) -> PageInput:
        check_text(settings, user_input=p.user_input, agent_response=p.agent_response)
        try:
            meta_size = len(dumps(p.meta))
        except TypeError as exc:
            raise ApiError(422, "invalid_input", f"meta is not JSON: {exc}") from None
        if meta_size > settings.max_text_chars:
            raise ApiError(
                413,
                "too_large",
                f"meta is {meta_size} bytes of JSON; the limit is {settings.max_text_chars}",
            )
        return PageInput(
            user_id=scope.user(user_id),
            user_input=p.user_input,
            agent_response=p.agent_response,
            timestamp=p.timestamp,
            assistant_id=scope.assistant(p.assistant_id),
            source=scope.name(p.source),
            meta=p.meta,
        )

    def _add_out(scope: Scope, results: list[Any]) -> list[dict[str, Any]]:
        return [
            {"page_id": r.page_id, "user_id": scope.strip(r.user_id), "duplicate": r.duplicate}
            for r in results
        ]

    def _retrieval_out(scope: Scope, r: Any) -> dict[str, Any]:
        # pages and knowledge entries stay dataclasses: _dumps serialises them natively
        return {
            "user_id": scope.strip(r.user_id),
            "query": r.query,
            "stm": r.stm,
            "pages": r.pages,
            "profile": r.profile,
            "user_knowledge": r.user_knowledge,
            "assistant_knowledge": r.assistant_knowledge,
            "retrieval_tokens": r.retrieval_tokens,
            "known_user": service.is_known(r.user_id),
        }

    async def _owned_page(scope: Scope, user_id: str, page_id: int) -> dict[str, Any]:
        uid = scope.user(user_id)
        if not storable_id(page_id):
            raise ApiError(404, "not_found", f"no page {page_id}")
        row = await service.call(service.engine_for(uid).get_page, page_id)
        if row is None:
            raise ApiError(404, "not_found", f"no page {page_id}")
        if not scope.owns(row["user_id"]):
            metrics.rejected.labels("forbidden").inc()
            raise ApiError(403, "forbidden", f"page {page_id} belongs to another tenant")
        if row["user_id"] != uid:
            raise ApiError(404, "not_found", f"user {user_id!r} has no page {page_id}")
        return row

    async def _owned_entry(scope: Scope, user_id: str, entry_id: int) -> dict[str, Any]:
        uid = scope.user(user_id)
        if not storable_id(entry_id):
            raise ApiError(404, "not_found", f"no knowledge entry {entry_id}")
        rows = await service.call(service.engine_for(uid).store.knowledge_rows, [entry_id])
        row = rows.get(entry_id)
        if row is None:
            raise ApiError(404, "not_found", f"no knowledge entry {entry_id}")
        if not scope.owns(row["owner_id"]):
            metrics.rejected.labels("forbidden").inc()
            raise ApiError(403, "forbidden", f"entry {entry_id} belongs to another tenant")
        if row["owner_kind"] != "user" or row["owner_id"] != uid:
            raise ApiError(404, "not_found", f"user {user_id!r} has no knowledge entry {entry_id}")
        return row

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

    async def _readable_entry(scope: Scope, user_id: str, entry_id: int) -> dict[str, Any]:
        """A user's own entry, or one of the user's assistant's (what the user is served)."""
        uid = scope.user(user_id)
        engine = service.engine_for(uid)
        row = await service.call(engine.get_knowledge, entry_id) if storable_id(entry_id) else None
        if row is not None and row["owner_kind"] == "assistant":
            user = await service.call(engine.store.user_row, uid)
            if user is not None and user["assistant_id"] == row["owner_id"]:
                return row
        if row is None or row["owner_kind"] != "user" or row["owner_id"] != uid:
            raise ApiError(404, "not_found", f"user {user_id!r} has no knowledge entry {entry_id}")
        return row

    # ------------------------------------------------------------------ probes
    @app.get(
        "/health",
        tags=["operations"],
        summary="Liveness",
        description="200 while the process serves HTTP (no key needed).",
        response_model=m.HealthOut,
    )
    async def health() -> Any:
        return {"status": "ok"}

    @app.get(
        "/ready",
        tags=["operations"],
        summary="Readiness",
        description="200 once the engine is loaded and the queues run; 503 while loading, "
        "after a failed load, or while shutting down (no key needed).",
        response_model=m.ReadyOut,
        responses={503: {"model": m.ReadyOut}},
    )
    async def ready() -> Any:
        body = {"ready": service.ready, "status": service.state}
        if service.state == "failed":
            body["status"] = f"failed: {service.error}"
        if service.ready:
            return JSONResponse(body)
        return JSONResponse(body, 503, headers={"Retry-After": str(settings.retry_after_s)})

    @app.get(
        "/metrics",
        tags=["operations"],
        summary="Prometheus metrics",
        description="Request latency histograms, batch sizes, queue depths, pending derived "
        "work, LLM calls and tokens, engine and kernel time (Prometheus text format).",
        response_class=Response,
    )
    def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ writes
    def _charge_pages(scope: Scope, n: int) -> None:
        """Count written pages against the key's page rate (429, or 413 past its bucket)."""
        if keyring is not None:
            refused = limits.written(scope.principal.key_id, n)
            if refused is not None:
                metrics.rejected.labels("rate_limited" if refused[0] == 429 else "too_large").inc()
                raise ApiError(*refused)

    async def _add_page(scope: Scope, user_id: str, page: m.PageIn) -> Response:
        item = _page_input(scope, user_id, page)
        _charge_pages(scope, 1)
        results = await service.add_pages([item])
        return json_response(_add_out(scope, results)[0], 201)

    async def _retrieve(scope: Scope, user_id: str, body: m.RetrieveIn) -> Response:
        check_text(settings, query=body.query)
        uid = scope.user(user_id)
        r = await service.retrieve(
            uid, body.query, top_pages=body.top_pages, top_segments=body.top_segments
        )
        if body.sources:
            await _add_sources([r])
        return json_response(_retrieval_out(scope, r))

    @app.post(
        "/v1/users/{user_id}/pages",
        tags=["memory"],
        summary="Add a page",
        description="Remember one exchange of the user. Answers after the page is committed "
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
        _charge_pages(scope, len(items))
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
        import asyncio

        check_count(settings, len(body.queries), "queries")
        for q in body.queries:
            check_text(settings, query=q.query)
        uids = [scope.user(q.user_id) for q in body.queries]
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
        "memory yet.",
        response_model=m.RespondOut,
        responses={501: {"model": m.ErrorOut, "description": "The server runs without an LLM."}},
    )
    async def respond(body: m.RespondIn, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        check_text(settings, query=body.query)
        uid = scope.user(user_id)
        r = await service.respond(uid, body.query, timestamp=body.timestamp)
        return json_response(
            {
                "user_id": user_id,
                "query": r.query,
                "text": r.text,
                "page_id": r.page_id,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "error": r.error,
                "retrieval": _retrieval_out(scope, r.retrieval),
            }
        )

    @app.get(
        "/v1/users",
        tags=["users"],
        summary="List users",
        description="The caller's tenant's users.",
        response_model=m.UsersOut,
    )
    async def list_users(request: Request) -> Any:
        scope = tenancy(request)
        service.check_ready()
        return {"users": [scope.strip(u) for u in await service.users() if scope.owns(u)]}

    @app.get(
        "/v1/users/{user_id}/profile",
        tags=["users"],
        summary="User profile",
        description="The user's long-term profile (trait -> value).",
        response_model=m.ProfileOut,
    )
    async def profile(user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        uid = scope.user(user_id)
        prof = await service.call(service.engine_for(uid).profile, uid)
        return {"user_id": user_id, "profile": prof}

    @app.get(
        "/v1/users/{user_id}/knowledge",
        tags=["users"],
        summary="User and assistant knowledge",
        description="Live user-knowledge entries and the user's assistant's knowledge, oldest "
        "first, each with the pages it was derived from (`sources`), its validity and strength; "
        "`history=true` adds the superseded and dropped entries.",
        response_model=m.KnowledgeOut,
    )
    async def knowledge(
        user_id: UserId,
        request: Request,
        history: Annotated[bool, Query(description="Superseded and dropped entries too.")] = False,
    ) -> Any:
        scope = tenancy(request)
        uid = scope.user(user_id)
        kn = await service.call(service.engine_for(uid).knowledge, uid, history=history)
        return json_response(scope.strip_ids({"user_id": user_id, **kn}))

    @app.get(
        "/v1/users/{user_id}/knowledge/{entry_id}",
        tags=["users"],
        summary="One knowledge entry",
        description="One of the user's knowledge entries, or of the user's assistant's, live or "
        "not: its text, the pages it was derived from (`sources`), validity "
        "(`valid_from`, `valid_to`, `superseded_by`) and `strength`.",
        response_model=m.KnowledgeEntryOut,
    )
    async def get_knowledge(entry_id: int, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        row = await _readable_entry(scope, user_id, entry_id)
        return json_response(scope.strip_ids(row))

    @app.patch(
        "/v1/users/{user_id}/knowledge/{entry_id}",
        tags=["users"],
        summary="Edit a knowledge entry",
        description="Replace the text (and embedding) of one of the user's knowledge entries.",
    )
    async def update_knowledge(
        body: m.KnowledgeUpdateIn, entry_id: int, user_id: UserId, request: Request
    ) -> Any:
        scope = tenancy(request)
        check_text(settings, text=body.text)
        await _owned_entry(scope, user_id, entry_id)
        uid = scope.user(user_id)
        row = await service.call(service.engine_for(uid).update_knowledge, entry_id, body.text)
        return json_response(scope.strip_ids(row))

    @app.delete(
        "/v1/users/{user_id}/knowledge/{entry_id}",
        tags=["users"],
        summary="Delete a knowledge entry",
        description="Remove one of the user's knowledge entries.",
        response_model=m.DeletedOut,
    )
    async def delete_knowledge(entry_id: int, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        await _owned_entry(scope, user_id, entry_id)
        engine = service.engine_for(scope.user(user_id))
        return {"deleted": await service.call(engine.delete_knowledge, entry_id)}

    @app.get(
        "/v1/users/{user_id}/history",
        tags=["users"],
        summary="Audit history",
        description="Append-only log of changes to the user's memory.",
    )
    async def history(user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        uid = scope.user(user_id)
        if not await service.known(uid):
            raise UnknownUserError(f"unknown user {uid!r}")
        return json_response(
            scope.strip_ids(await service.call(service.engine_for(uid).history, uid))
        )

    @app.get(
        "/v1/users/{user_id}/export",
        tags=["users"],
        summary="Export a user",
        description="Everything held about the user: pages, segments, profile, knowledge, "
        "pending work and history (JSON).",
    )
    async def export_user(user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        uid = scope.user(user_id)
        data = await service.call(service.engine_for(uid).export_user, uid)
        return json_response(scope.strip_ids(data))

    @app.delete(
        "/v1/users/{user_id}",
        tags=["users"],
        summary="Delete a user",
        description="Remove every row and arena slot held about the user (after the user's "
        "queued writes). 404 if the user is unknown.",
        response_model=m.DeletedOut,
    )
    async def delete_user(user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        uid = scope.user(user_id)
        service.check_ready()
        if not service._user_writes.get(uid) and not await service.known(uid):
            raise UnknownUserError(f"unknown user {uid!r}")
        return {"deleted": await service.delete_user(uid)}

    @app.post(
        "/v1/users/{user_id}/wait",
        tags=["users"],
        summary="Read-your-writes barrier",
        description="Wait until the user's queued writes are committed and their derived work "
        "(chain, mid-term placement, promotion) is done, or the timeout passes (`done: false`).",
        response_model=m.WaitOut,
    )
    async def wait_user(
        user_id: UserId,
        request: Request,
        timeout: Annotated[float, Query(gt=0, description="Seconds to wait at most.")] = 10.0,
    ) -> Any:
        scope = tenancy(request)
        uid = scope.user(user_id)
        res = await service.wait_for_user(uid, min(timeout, settings.max_wait_timeout_s))
        res["user_id"] = user_id
        return res

    # ------------------------------------------------------------------ item-level pages
    @app.get(
        "/v1/users/{user_id}/pages",
        tags=["pages"],
        summary="List pages",
        description="The user's pages (every tier), oldest first, `limit` from `offset`; "
        "`total` says how many there are. 404 for an unknown user.",
        response_model=m.PageListOut,
    )
    async def list_pages(
        user_id: UserId,
        request: Request,
        offset: Annotated[int, Query(ge=0, description="Pages to skip.")] = 0,
        limit: Annotated[int, Query(ge=1, le=1000, description="Pages at most.")] = 100,
    ) -> Any:
        scope = tenancy(request)
        uid = scope.user(user_id)
        if not await service.known(uid):
            raise UnknownUserError(f"unknown user {uid!r}")
        engine = service.engine_for(uid)
        pages, total = await service.call(engine.list_pages, uid, offset, limit)
        body = {"user_id": user_id, "pages": pages, "total": total, "offset": offset}
        return json_response(scope.strip_ids({**body, "limit": limit}))

    @app.get(
        "/v1/users/{user_id}/pages/{page_id}",
        tags=["pages"],
        summary="Get a page",
        description="One stored page of the user (any tier).",
    )
    async def get_page(page_id: int, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        return json_response(scope.strip_ids(await _owned_page(scope, user_id, page_id)))

    @app.patch(
        "/v1/users/{user_id}/pages/{page_id}",
        tags=["pages"],
        summary="Edit a page",
        description="Replace a page's user input and/or agent response; its embedding follows.",
    )
    async def update_page(
        body: m.PageUpdateIn, page_id: int, user_id: UserId, request: Request
    ) -> Any:
        scope = tenancy(request)
        if body.user_input is None and body.agent_response is None:
            raise ApiError(422, "invalid_input", "give user_input and/or agent_response")
        check_text(settings, user_input=body.user_input, agent_response=body.agent_response)
        await _owned_page(scope, user_id, page_id)
        row = await service.call(
            service.engine_for(scope.user(user_id)).update_page,
            page_id,
            user_input=body.user_input,
            agent_response=body.agent_response,
        )
        return json_response(scope.strip_ids(row))

    @app.delete(
        "/v1/users/{user_id}/pages/{page_id}",
        tags=["pages"],
        summary="Delete a page",
        description="Remove one page of the user (from whichever tier holds it).",
        response_model=m.DeletedOut,
    )
    async def delete_page(page_id: int, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        await _owned_page(scope, user_id, page_id)
        engine = service.engine_for(scope.user(user_id))
        return {"deleted": await service.call(engine.delete_page, page_id)}

    # ------------------------------------------------------------------ stats
    @app.get(
        "/v1/stats",
        tags=["operations"],
        summary="Statistics",
        description="A tenant's key: the tenant's user count. "
        "An admin key (tenant `*` in the key file), or any caller of an open server: the "
        "server's queues and batching and the engine's aggregate statistics (no user ids).",
    )
    async def stats(request: Request) -> Any:
        scope = tenancy(request)
        if keyring is not None and not scope.principal.admin:
            return json_response(
                {
                    "tenant": scope.tenant,
                    "users": sum(1 for u in await service.users() if scope.owns(u)),
                }
            )
        eng = await service.call(service.engine.stats)
        return json_response(
            {
                "tenant": None,
                "users": len(await service.users()),
                "server": {
                    "state": service.state,
                    "batching": service.batch_stats(),
                    "derived_runs": service._derived_runs,
                },
                "engine": eng,
            }
        )

    add_mem0_routes(app, service, settings, _charge_pages)

    direct = None
    if settings.direct_routes:
        direct = {
            "pages": DirectRoute("/v1/users/{user_id}/pages", m.PageIn, _add_page),
            "retrieve": DirectRoute("/v1/users/{user_id}/retrieve", m.RetrieveIn, _retrieve),
        }
    app.add_middleware(
        Edge,
        settings=settings,
        metrics=metrics,
        keyring=keyring,
        limits=limits,
        errors=errors,
        direct=direct,
    )
    return app


def _fastapi(settings: ServerSettings, **kw: Any) -> FastAPI:
    """The app, with /docs and /redoc served from the package's own Swagger UI and ReDoc files
    (fastapi-offline: they work offline, the default pages load them from a CDN), or none."""
    if not settings.docs:
        return FastAPI(docs_url=None, redoc_url=None, **kw)
    from fastapi_offline import FastAPIOffline

    return FastAPIOffline(static_url="/docs-static", **kw)


def _document_security(app: FastAPI, keyed: bool) -> None:
    """Declare the bearer scheme on every /v1 operation of the OpenAPI schema (authentication
    itself happens in :class:`Edge`, before routing)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
        )
        comps = schema.setdefault("components", {})
        comps.setdefault("securitySchemes", {})["ApiKey"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key from the server's key file"
            + ("" if keyed else " (this server runs open: no key needed)"),
        }
        for path, ops in schema.get("paths", {}).items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"ApiKey": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# ====================================================================== run
def _engine_config(
    store: str | None,
    config: EngineConfig | str | Path | None,
    overrides: dict[str, Any],
) -> EngineConfig:
    if isinstance(config, EngineConfig):
        cfg = config
    elif config is not None:
        cfg = EngineConfig.from_toml(config)
    else:
        cfg = EngineConfig()
    update = {k: v for k, v in overrides.items() if v is not None}
    if store is not None:
        update["store"] = str(store)
    update["auto_process"] = False
    return EngineConfig.model_validate({**cfg.model_dump(), **update})


def run(
    store: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_keys_file: str | Path | None = None,
    *,
    api_keys: Mapping[str, str] | str | Path | None = None,
    config: EngineConfig | str | Path | None = None,
    embedder: str | None = None,
    device: str | None = None,
    log_level: str = "info",
    graceful_timeout_s: float | None = 30.0,
    workers: int = 0,
    **options: Any,
) -> None:
    """Serve the HTTP API with uvicorn until SIGINT/SIGTERM (then drain and commit).

    ``workers``: 0 serves from this one process; N >= 1 runs N HTTP worker processes in front
    of one engine process (:mod:`memoryos_gpu.server.workers`).

    ``api_keys`` / ``api_keys_file``: ``{key: tenant}`` or a ``KEY TENANT`` file (either name).
    ``config``: an :class:`EngineConfig` or a TOML path; ``store``, ``embedder``, ``device``
    override it. Remaining keyword options are :class:`ServerSettings` fields.
    """
    import uvicorn

    # The CPU kernels' OpenMP regions spin-wait by default; on a small, busy box that costs a
    # scheduler quantum per call. Passive waiting must be set before the runtime loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if api_keys is not None and api_keys_file is not None:
        raise ValueError("give api_keys or api_keys_file, not both")
    keys = api_keys if api_keys is not None else api_keys_file
    cfg = _engine_config(
        str(store) if store is not None else None,
        config,
        {"embedder": embedder, "device": device},
    )
    settings = ServerSettings(**options)
    if workers:
        from memoryos_gpu.server.workers import run_workers

        run_workers(
            cfg,
            settings,
            workers=workers,
            host=host,
            port=int(port),
            api_keys=load_api_keys(keys, use_env=True),
            log_level=log_level,
            graceful_timeout_s=graceful_timeout_s,
        )
        return
    app = create_app(cfg, api_keys=keys, settings=settings)
    uvicorn.run(
        app,
        host=host,
        port=int(port),
        log_level=log_level.lower(),
        timeout_graceful_shutdown=graceful_timeout_s,
        h11_max_incomplete_event_size=settings.max_header_bytes,  # h11 refuses larger headers
    )

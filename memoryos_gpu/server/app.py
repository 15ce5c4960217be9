"""The HTTP server: FastAPI routes over a :class:`~memoryos_gpu.server.service.MemoryService`.

``create_app(config_or_engine, api_keys=..., settings=...)`` builds the app;
``run(store=..., host=..., port=..., api_keys=...)`` serves it with uvicorn (the CLI's
``memoryos-gpu serve``). See docs/server.md for the API, tenancy and tuning. The routes live in
modules by what they serve: :mod:`.memory_routes` (add, retrieve, respond), :mod:`.user_routes`
(users, their knowledge), :mod:`.page_routes` (item-level pages), :mod:`.ops_routes` (probes,
metrics, stats), :mod:`.mem0_routes` (mem0's REST API); this module builds the app around them
(lifespan, error mapping, the edge middleware, the OpenAPI security scheme) and runs it.

Tenancy: with API keys configured every ``/v1`` route needs ``Authorization: Bearer KEY``; the
key names a tenant and the tenant's users are stored as ``"{tenant}/{user}"`` (assistants as
``"{tenant}/{assistant}"``, idempotency sources as ``"{tenant}/{source}"``), so two tenants never
share a user, an assistant's knowledge or a source. Without keys the server runs open: one
tenant, user ids stored as given.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
import tomllib
from collections.abc import Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from memoryos_gpu.config import EngineConfig, server_table
from memoryos_gpu.log_setup import announce_loaded, setup_logging, uvicorn_logging
from memoryos_gpu.server import models as m
from memoryos_gpu.server.auth import KeyLimits, KeyRing, load_api_keys
from memoryos_gpu.server.edge import Edge, ErrorMapper
from memoryos_gpu.server.header_timeout import header_timeout_protocol
from memoryos_gpu.server.mem0_routes import add_mem0_routes
from memoryos_gpu.server.memory_routes import add_memory_routes
from memoryos_gpu.server.metrics import ServerMetrics
from memoryos_gpu.server.ops_routes import PROBE_ANSWERS, add_probe_routes, add_stats_route
from memoryos_gpu.server.page_routes import add_page_routes
from memoryos_gpu.server.paths import ApiRoute
from memoryos_gpu.server.scope import TENANCY, ApiError, Scope
from memoryos_gpu.server.service import MemoryService
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.server.user_routes import add_user_routes

__all__ = ["ApiError", "create_app", "run", "shutdown_failed"]

log = logging.getLogger("memoryos_gpu.server")
#: Whether this FastAPI has its own OpenTelemetry instrumentation (``FastAPI(telemetry=...)``,
#: which checks for configured providers on every request); older ones have nothing to turn off.
_FASTAPI_TELEMETRY = "telemetry" in inspect.signature(FastAPI.__init__).parameters

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": m.ErrorOut, "description": "Missing or unknown API key."},
    403: {"model": m.ErrorOut, "description": "An admin key on a route other than /v1/stats."},
    405: {
        "model": m.ErrorOut,
        "description": "The path is served, but not with this method (`method_not_allowed`).",
    },
    408: {
        "model": m.ErrorOut,
        "description": "The body did not arrive within `body_timeout_s` (`body_timeout`): "
        "nothing of the request was stored; the connection is closed.",
    },
    413: {"model": m.ErrorOut, "description": "Body, text or batch over the limit."},
    415: {"model": m.ErrorOut, "description": "A body not sent as application/json."},
    422: {"model": m.ErrorOut, "description": "Malformed request."},
    429: {
        "model": m.ErrorOut,
        "description": "Rate limit of the key (requests, body bytes or pages per second), or "
        "the tenant's share of the write queue is full (see Retry-After).",
    },
    431: {
        "model": m.ErrorOut,
        "description": "Request headers over `max_header_bytes` (`headers_too_large`).",
    },
    503: {"model": m.ErrorOut, "description": "Overloaded, loading or shutting down."},
}
#: Statuses only some operations can answer, added per operation (:func:`_route_statuses`).
_NOT_FOUND = {
    "model": m.ErrorOut,
    "description": "Unknown user (`unknown_user`), or no such page, knowledge entry or memory "
    "of the user (`not_found`).",
}
_NO_SPACE = {
    "model": m.ErrorOut,
    "description": "The store is out of disk space (`insufficient_storage`): nothing of the "
    "request was stored.",
}
_PARTIAL = {
    "model": m.ErrorOut,
    "description": "A write of several chunks failed part way (`partially_committed`): the "
    "message names the pages committed; send the others again. Other 500s are bugs.",
}
#: Operations with a user in their path that answer an unknown user without a 404: an add
#: creates the user, a retrieval answers `known_user: false`, the barrier `done: true`.
_NO_404 = frozenset({"add_page", "retrieve", "wait_user"})
#: Operations that add pages: the ones a write split into chunks can leave half-committed.
_ADDS = frozenset({"add_page", "add_pages", "mem0_add"})


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
    ``MEMORYOS_GPU_API_KEYS`` variable are added unless ``use_env_keys=False``. No key source
    at all: the server runs open (single tenant) and says so in its startup log; a source that
    holds no key (an empty file or mapping, the variable set but empty) raises
    :class:`~memoryos_gpu.server.auth.KeyFileError` instead of running open.
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
        started = time.monotonic()
        await service.start(wait=False)
        # the one startup line saying what was loaded, once the background load is done
        announcing = asyncio.get_running_loop().create_task(announce_loaded(service, log, started))
        try:
            yield
        finally:
            announcing.cancel()
            try:
                await service.close()
                metrics.close()
            except BaseException:
                # uvicorn logs it and ends the run as a served one: the exit status must not
                app.state.shutdown_failed = True
                raise
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
    # one reading of every body (.bodies) and of every path (.paths: "%2F" is part of an id)
    app.router.route_class = ApiRoute
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

    # ------------------------------------------------------------------ routes
    def charge_pages(scope: Scope, n: int) -> None:
        """Count written pages against the key's page rate (429, or 413 past its bucket)."""
        if keyring is not None:
            refused = limits.written(scope.principal.key_id, n)
            if refused is not None:  # counted in memoryos_rejected_total by the ErrorMapper
                raise ApiError(*refused)

    # declared in this order: it is the order of the API description
    add_probe_routes(app, service, settings, metrics, keyring=keyring, limits=limits)
    direct = add_memory_routes(app, service, settings, charge_pages)
    add_user_routes(app, service, settings)
    add_page_routes(app, service, settings)
    add_stats_route(app, service, keyring is not None)
    add_mem0_routes(app, service, settings, charge_pages)
    app.add_middleware(
        Edge,
        settings=settings,
        metrics=metrics,
        keyring=keyring,
        limits=limits,
        errors=errors,
        direct=direct if settings.direct_routes else None,
        routes=app.router.routes,
    )
    return app


def shutdown_failed(app: Any) -> bool:
    """Whether ``app``'s shutdown (its lifespan's close: draining, committing, closing the
    store) raised. uvicorn logs "Application shutdown failed" and returns as from any served
    run, so whoever runs it reads this to exit non-zero (:func:`run`, the ``--workers``
    workers, the MCP server)."""
    return bool(getattr(app.state, "shutdown_failed", False))


def _fastapi(settings: ServerSettings, **kw: Any) -> FastAPI:
    """The app, with /docs and /redoc served from the package's own Swagger UI and ReDoc files
    (fastapi-offline: they work offline, the default pages load them from a CDN), or none;
    FastAPI's OpenTelemetry instrumentation only with ``settings.http_telemetry``."""
    if not settings.http_telemetry and _FASTAPI_TELEMETRY:
        kw["telemetry"] = {"tracing": False, "metrics": False, "logs": False}
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
            for method, op in ops.items():
                if path.startswith("/v1/"):
                    op["security"] = [{"ApiKey": []}]
                    _route_statuses(path, method, op)
                elif path in PROBE_ANSWERS:  # no key, no body: none of the app-wide refusals
                    keep = PROBE_ANSWERS[path]
                    op["responses"] = {c: r for c, r in op["responses"].items() if c in keep}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _route_statuses(path: str, method: str, op: dict[str, Any]) -> None:
    """Fit the app-wide error statuses to one ``/v1`` operation, so that a generated client
    knows every status it can get and none it cannot: 404 where a user, page, entry or memory
    in the path may not exist (:data:`_NO_404` aside), 507 on the operations that write (any
    but GET), the 500 ``partially_committed`` on those that add pages, and no 408 / 413 / 415
    on one without a body (nothing to be late, too large or of the wrong type)."""
    responses = op["responses"]
    if "{" in path and op.get("operationId") not in _NO_404:
        responses.setdefault("404", _schema_response(_NOT_FOUND))
    if method != "get":
        responses.setdefault("507", _schema_response(_NO_SPACE))
    if op.get("operationId") in _ADDS:
        responses.setdefault("500", _schema_response(_PARTIAL))
    if "requestBody" not in op:
        responses.pop("408", None)
        responses.pop("413", None)
        responses.pop("415", None)
    op["responses"] = dict(sorted(responses.items()))


def _schema_response(spec: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI response object of the error shape (what FastAPI writes for ``responses=``
    entries of ``{"model": m.ErrorOut}``)."""
    return {
        "description": spec["description"],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}},
    }


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
    engines: int = 1,
    **options: Any,
) -> None:
    """Serve the HTTP API with uvicorn until SIGINT/SIGTERM (then drain and commit).

    ``workers``: 0 serves from this one process; N >= 1 runs N HTTP worker processes in front
    of ``engines`` engine processes (:mod:`memoryos_gpu.server.workers`; more than one shards
    the users over them, which needs a store directory or a PostgreSQL URL).

    ``api_keys`` / ``api_keys_file``: ``{key: tenant}`` or a ``KEY TENANT`` file (either name).
    ``config``: an :class:`EngineConfig` or a TOML path; ``store``, ``embedder``, ``device``
    override it. Remaining keyword options are :class:`ServerSettings` fields, over the TOML's
    ``[server]`` table.
    """
    import uvicorn

    # The CPU kernels' OpenMP regions spin-wait by default; on a small, busy box that costs a
    # scheduler quantum per call. Passive waiting must be set before the runtime loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    setup_logging(log_level)
    if api_keys is not None and api_keys_file is not None:
        raise ValueError("give api_keys or api_keys_file, not both")
    # first, before any engine work: a configured source without keys refuses to start (never
    # open mode); the environment's keys are merged here, once
    keys = load_api_keys(api_keys if api_keys is not None else api_keys_file, use_env=True)
    cfg = _engine_config(
        str(store) if store is not None else None,
        config,
        {"embedder": embedder, "device": device},
    )
    if isinstance(config, str | Path):
        options = {**server_table(tomllib.loads(Path(config).read_text())), **options}
    settings = ServerSettings(**{"gc_freeze": True, **options})  # this process serves only
    if engines != 1 and not workers:
        raise ValueError(f"engines={engines} needs workers >= 1 (the workers route by shard)")
    if workers:
        from memoryos_gpu.server.workers import run_workers

        run_workers(
            cfg,
            settings,
            workers=workers,
            host=host,
            port=int(port),
            api_keys=keys,
            log_level=log_level,
            graceful_timeout_s=graceful_timeout_s,
            engines=engines,
        )
        return
    from memoryos_gpu.server.workers import (
        FORCED_QUIT,
        ShutdownError,
        StartupError,
        check_listen_address,
        served_signals,
    )

    # uvicorn binds only after the app's startup, which begins loading the engine: a taken
    # port must be said before the model loads
    check_listen_address(host, int(port))
    app = create_app(cfg, api_keys=keys, settings=settings, use_env_keys=False)
    try:
        # a SIGTERM or SIGHUP stop ends the run as Ctrl-C does (status 0); whether a second
        # Ctrl-C forced uvicorn to quit is read from the signals (served_signals says why)
        with served_signals() as signals:
            uvicorn.run(
                app,
                host=host,
                port=int(port),
                **uvicorn_logging(log_level),
                timeout_graceful_shutdown=graceful_timeout_s,
                h11_max_incomplete_event_size=settings.max_header_bytes,  # h11's header cap
                http=header_timeout_protocol(settings.header_timeout_s),
                **settings.proxy_headers(),
            )
    except SystemExit as exc:  # uvicorn's "did not start" (exit 3, the CLI's ingest rejects)
        if exc.code != uvicorn.config.STARTUP_FAILURE:
            raise
        raise StartupError(
            f"the HTTP server did not start on {host}:{port} (uvicorn's log above says why)"
        ) from None
    if signals.forced:  # as under --workers: the same line, the same exit status
        raise ShutdownError(
            f"the HTTP server's shutdown failed: {FORCED_QUIT}; pending writes may not be "
            "committed nor the store closed: start it again on the store to recover"
        )
    if shutdown_failed(app):
        raise ShutdownError(
            "the HTTP server's shutdown failed: pending writes may not be committed nor the "
            "store closed (the log above says why); start it again on the store to recover"
        )

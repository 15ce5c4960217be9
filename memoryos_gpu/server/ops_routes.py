"""The operations routes: liveness, readiness, Prometheus metrics (no key needed) and
``/v1/stats`` (a tenant's user count, or, for an admin key or an open server, the server's
queues and the engine's aggregate statistics)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from memoryos_gpu.server import models as m
from memoryos_gpu.server.metrics import ServerMetrics
from memoryos_gpu.server.scope import json_response, tenancy
from memoryos_gpu.server.settings import ServerSettings

__all__ = ["add_probe_routes", "add_stats_route"]


#: What each probe answers (it needs no key and takes no body, so the API description lists
#: none of the app-wide refusals for it: 401, 403, 413, 415, 422, 429).
PROBE_ANSWERS: dict[str, tuple[str, ...]] = {
    "/health": ("200",),
    "/ready": ("200", "503"),
    "/metrics": ("200",),
}


def add_probe_routes(
    app: FastAPI, service: Any, settings: ServerSettings, metrics: ServerMetrics
) -> None:
    """Declare ``/health``, ``/ready`` and ``/metrics`` on ``app`` (first: probes are the
    first operations of the API description)."""

    @app.get(
        "/health",
        tags=["operations"],
        summary="Liveness",
        description="200 while the process serves HTTP (no key needed; HEAD answers alike, "
        "without a body).",
        response_model=m.HealthOut,
    )
    async def health() -> Any:
        return {"status": "ok"}

    @app.get(
        "/ready",
        tags=["operations"],
        summary="Readiness",
        description="200 once the engine is loaded and the queues run, `degraded` naming what "
        "does not work meanwhile (`store_full`: writes fail for a full disk; "
        "`llm_unavailable`: the LLM cannot be used), empty when serving fully; 503 while "
        "loading, after a failed load, or while shutting down (no key needed; HEAD answers "
        "alike, without a body).",
        response_model=m.ReadyOut,
        responses={503: {"model": m.ReadyOut}},
    )
    async def ready() -> Any:
        body = {"ready": service.ready, "status": service.state}
        if service.state in ("failed", "starting") and service.error:  # why, when known
            body["status"] = f"{service.state}: {service.error}"
        if service.ready:
            # still 200 when degraded: retrievals work, and a probe that failed would take
            # them away too; the body says what does not (left out by a service that cannot
            # tell, rather than an empty list that would say all is well)
            health = getattr(service, "health", None)
            if health is not None:
                body["degraded"] = health()["degraded"]
            return JSONResponse(body)
        return JSONResponse(body, 503, headers={"Retry-After": str(settings.retry_after_s)})

    @app.get(
        "/metrics",
        tags=["operations"],
        summary="Prometheus metrics",
        description="Request latency histograms, batch sizes, queue depths, pending derived "
        "work, LLM calls and tokens, the LLM backend's counters and breaker state, degraded "
        "states, engine and kernel time (Prometheus text format).",
        response_class=Response,
    )
    def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def add_stats_route(app: FastAPI, service: Any, keyed: bool) -> None:
    """Declare ``/v1/stats``; ``keyed``: the server has API keys (else every caller is the one
    tenant, and sees the server-wide view)."""

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
        # the users first: they are refused (503) until the engine is loaded, so
        # service.engine (None until then) is never read before it is
        users = await service.users()
        if keyed and not scope.principal.admin:
            return json_response(
                {"tenant": scope.tenant, "users": sum(1 for u in users if scope.owns(u))}
            )
        eng = await service.call(service.engine.stats)
        server: dict[str, Any] = {
            "state": service.state,
            "batching": service.batch_stats(),
            "derived_runs": service._derived_runs,
        }
        health = getattr(service, "health", None)
        if health is not None:  # degraded states and the LLM backend's counts (None: no LLM)
            h = health()
            server.update(degraded=h["degraded"], llm_backend=h["llm"])
        return json_response({"tenant": None, "users": len(users), "server": server, "engine": eng})

"""The operations routes: liveness and readiness (no key needed), Prometheus metrics (with API
keys: the admin key, unless ``metrics_public``) and ``/v1/stats`` (a tenant's user count, or,
for an admin key or an open server, the server's queues and the engine's aggregate
statistics, in one shape whether one engine or K shards serve them)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from memoryos_gpu.server import models as m
from memoryos_gpu.server.batching import failed_publicly
from memoryos_gpu.server.metrics import ServerMetrics
from memoryos_gpu.server.scope import error_response, json_response, tenancy
from memoryos_gpu.server.settings import ServerSettings

__all__ = ["add_probe_routes", "add_stats_route", "client_status", "merge_shard_stats"]


#: What each probe answers (it needs no key and takes no body, so the API description lists
#: none of the app-wide refusals for it: 401, 403, 413, 415, 422, 429).
PROBE_ANSWERS: dict[str, tuple[str, ...]] = {
    "/health": ("200",),
    "/ready": ("200", "503"),
    "/metrics": ("200", "401", "403", "429"),
}


def client_status(state: str, error: str | None) -> str:
    """``/ready``'s ``status`` for a client of a server with API keys: the state and a generic
    reason. The load error names the store's file or database (an absolute path, a host) and
    the load's exception: internal details that an unauthenticated probe must not show. The
    server's log and the admin key's ``/v1/stats`` (``server.error``) keep the whole error."""
    if not error:
        return state
    if state == "failed":
        return f"failed: {failed_publicly()}"
    if state == "starting":
        return "starting: the engine is still loading"
    return state


def _metrics_refusal(
    request: Request, metrics: ServerMetrics, keyring: Any, limits: Any
) -> Response | None:
    """Why ``/metrics`` is refused to this caller, or None. With API keys it shows server-wide
    load (every tenant's requests, queues, engine counters), which docs/server.md keeps to the
    admin key: ``Authorization: Bearer ADMIN_KEY`` (401 without a key or with an unknown one,
    throttled per address as on ``/v1``; 403 for a tenant's key)."""
    from memoryos_gpu.server.auth import RateLimiter

    if keyring is None:  # open mode: every caller is the one tenant
        return None
    challenge = {"WWW-Authenticate": "Bearer"}
    scheme, _, cred = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not cred.strip():
        metrics.rejected.labels("unauthorized").inc()
        detail = "missing API key: /metrics needs the admin key ('Authorization: Bearer KEY')"
        return error_response(401, "unauthorized", detail, challenge)
    principal = keyring.lookup(cred.strip())
    if principal is None:
        client = request.client.host if request.client else "unknown"
        wait = limits.unknown_keys.take(client) if limits is not None else 0.0
        if wait > 0:
            metrics.rejected.labels("rate_limited").inc()
            retry = RateLimiter.retry_after(wait)
            detail = f"too many unknown API keys from this address; retry in {retry} s"
            return error_response(429, "rate_limited", detail, {"Retry-After": str(retry)})
        metrics.rejected.labels("unauthorized").inc()
        return error_response(401, "unauthorized", "unknown API key", challenge)
    if not principal.admin:
        metrics.rejected.labels("forbidden").inc()
        detail = "/metrics shows every tenant's load: it needs the admin key"
        return error_response(403, "forbidden", detail)
    return None


def add_probe_routes(
    app: FastAPI,
    service: Any,
    settings: ServerSettings,
    metrics: ServerMetrics,
    *,
    keyring: Any = None,
    limits: Any = None,
) -> None:
    """Declare ``/health``, ``/ready`` and ``/metrics`` on ``app`` (first: probes are the
    first operations of the API description). ``keyring`` and ``limits``: the API keys and
    the unknown-key throttle the edge authenticates ``/v1`` with (None: an open server),
    which ``/metrics`` checks too."""

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
    async def ready(request: Request) -> Any:
        body = {"ready": service.ready, "status": service.state}
        if service.state in ("failed", "starting") and service.error:  # why, when known
            keyed = keyring is not None
            # with keys, a generic reason: the load error names the store's path or host
            body["status"] = (
                client_status(service.state, service.error)
                if keyed
                else f"{service.state}: {service.error}"
            )
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
        "states, engine and kernel time (Prometheus text format). Server-wide load: with API "
        "keys it needs the admin key (`Authorization: Bearer KEY`; 401 without, 403 for a "
        "tenant's key) unless the `[server]` setting `metrics_public` opens it.",
        response_class=Response,
    )
    def prometheus_metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if not settings.metrics_public:
            refused = _metrics_refusal(request, metrics, keyring, limits)
            if refused is not None:
                return refused
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
        admin = not keyed or scope.principal.admin
        if admin and service.state in ("failed", "starting") and service.error:
            # the load error in full for the operator (clients get a generic reason)
            return _not_loaded(service)
        # the users first: they are refused (503) until the engine is loaded, so
        # service.engine (None until then) is never read before it is
        users = await service.users()
        if not admin:
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
        server, eng = merge_shard_stats(server, eng, getattr(service, "parts", None))
        return json_response({"tenant": None, "users": len(users), "server": server, "engine": eng})


def _not_loaded(service: Any) -> Response:
    """503 for the admin's ``/v1/stats`` while the engine is not loaded, with the whole load
    error (``detail`` and ``server.error``): the operator's view of what ``/ready`` and the
    clients' 503s only name generically."""
    state, error = service.state, service.error
    if state == "failed":
        detail, retry = f"the engine failed to load: {error}", 30
    else:
        detail, retry = f"the engine is still loading ({error})", service.settings.retry_after_s
    body = {"error": "unavailable", "detail": detail, "server": {"state": state, "error": error}}
    return json_response(body, 503, {"Retry-After": str(retry)})


#: Engine statistics taken from the first shard, not summed: the build and the settings.
_FIRST_ONLY = frozenset({"native", "device", "mode", "preset"})
_NOT_MERGED = frozenset({"shard", "shards", "shard_count"})


def _merge(values: list[Any], key: str = "") -> Any:
    """Per-shard values as one: numbers summed (``max_batch``, a per-call bound, the largest),
    dicts merged key by key, anything else (and :data:`_FIRST_ONLY`) the first shard's;
    ``mean_batch`` recomputed from the merged items (or calls) and batches."""
    if not values:
        return None
    if key in _FIRST_ONLY:
        return values[0]
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v if k not in _NOT_MERGED))
        out = {k: _merge([v[k] for v in values if k in v], k) for k in keys}
        if "mean_batch" in out and "batches" in out:
            n = out.get("items", out.get("calls", 0))
            out["mean_batch"] = round(n / out["batches"], 2) if out["batches"] else 0.0
        return out
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return max(values) if key == "max_batch" else sum(values)
    return values[0]


def merge_shard_stats(
    server: dict[str, Any], engine: Any, parts: Any = None
) -> tuple[dict[str, Any], Any]:
    """``/v1/stats``'s ``server`` and ``engine`` in the single engine's shape when shards
    serve them (``serve --engines K``, ``serve --ray``, a ``ShardedEngine``).

    Why: a sharded service reports its batching per shard (``{"shard-0": {"retrieve": ...}}``)
    and its engine statistics merged only in part (no ``store``, ``views``, ``retrieval``,
    ``llm``, ``embedder``, ``native``, ``preset``), so a dashboard that reads
    ``server.batching.retrieve.admitted`` or ``engine.store.pages_mtm`` broke on the same
    server once it was sharded. Here every documented field is at the top level, summed over
    the shards where a sum means something (:func:`_merge`), and each shard's own figures stay
    in ``server.shards`` (batching, and the state, degraded states and LLM backend of each
    engine process where known) and ``engine.shards``. A single engine's stats pass as they
    are."""
    batching = server.get("batching")
    if isinstance(batching, dict) and batching and all(k.startswith("shard-") for k in batching):
        per = sorted(batching.items(), key=lambda kv: int(kv[0].split("-", 1)[1] or 0))
        server = {**server, "batching": _merge([b for _, b in per])}
        shards = [{"shard": int(k.split("-", 1)[1] or 0), "batching": b} for k, b in per]
        if isinstance(parts, list | tuple) and len(parts) == len(shards):
            for entry, part in zip(shards, parts, strict=True):
                entry["state"] = part.state
                health = getattr(part, "health", None)
                if health is not None:
                    h = health()
                    entry.update(
                        derived_runs=h.get("derived_runs", 0),
                        degraded=h.get("degraded", []),
                        llm_backend=h.get("llm"),
                    )
        server["shards"] = shards
    if isinstance(engine, dict) and isinstance(engine.get("shards"), list) and engine["shards"]:
        per_shard = [s for s in engine["shards"] if isinstance(s, dict)]
        merged = _merge(per_shard) or {}
        # what the sharded stats summed themselves (users, counters, ...) stays as they gave it
        engine = {**merged, **engine}
    return server, engine

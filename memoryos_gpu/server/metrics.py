"""Prometheus metrics of the server (one registry per app, so several apps can coexist).

Under ``serve --workers`` every process records into Prometheus's multiprocess files and any
worker's ``/metrics`` sums them all (latency of every worker, batch sizes and kernel time of
the engine process); the sampled gauges (queue depth, pending work, engine counters) are the
engine process's, read at scrape time.

* ``memoryos_http_request_duration_seconds{method,route,status}``: request latency.
* ``memoryos_batch_size{queue}``: items per engine call of each queue (retrieve, write,
  respond, derived).
* ``memoryos_engine_call_seconds{op}``: wall time of engine calls (retrieve_many, add_many,
  respond_many, process_pending).
* ``memoryos_kernel_seconds{kernel}``: time inside the native kernel entry points the engine
  calls while serving (:data:`KERNELS`: retrieve, the fused retrieval pass, once a retrieval
  batch; knowledge_topk; match_segments; recompute_heat).
* ``memoryos_queue_depth{queue,shard}``: admitted, unanswered items per queue (sampled at
  scrape; ``shard`` is the engine process's index under ``--engines K``, empty otherwise).
* ``memoryos_pending_derived``: derived items (chain, MTM placement, promotion) still owed.
* ``memoryos_llm_calls_total``, ``memoryos_llm_tokens_total{kind}``,
  ``memoryos_llm_fallbacks_total``: LLM work of the engine's stages (answered batches); under
  ``--engines K`` one series per engine process (label ``shard``).
* ``memoryos_llm_backend_events_total{event}``: the LLM backend's own counts (requests,
  batches, retries, errors, invalid_json, repaired_json), failed batches included.
* ``memoryos_llm_breaker_state{state}``: 1 for the HTTP LLM backend's circuit breaker state
  (closed, open, half_open), 0 for the others.
* ``memoryos_degraded{state,shard}``: 1 while the server serves degraded (store_full,
  llm_unavailable; :meth:`MemoryService.health`), else 0.
* ``memoryos_engine_events_total{event}``: the engine's counters (pages added, retrievals,
  derived_failures, ...); under ``--engines K`` ``{event,shard}``, one series per engine
  process, so one engine's restart resets only its own series (:func:`_engine_counters`).
* ``memoryos_rejected_total{reason}``: requests refused (auth, rate_limit, overload, too_large,
  body_timeout, client_disconnect, store_full).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: The native entry points timed, as (module, function): the ones the engine calls while it
#: serves, looked up on their module at call time, so wrapping the module's attribute times
#: every call. The label is the function's name; ``retrieve`` is the fused retrieval pass (one
#: call a retrieval batch). Entry points only the ``measure`` command calls (score_segments,
#: select_pages, apply_hits) are left out: their series would never appear.
KERNELS: tuple[tuple[str, str], ...] = (
    ("memoryos_gpu.ops.retrieval", "retrieve"),
    ("memoryos_gpu.ops", "knowledge_topk"),
    ("memoryos_gpu.ops", "match_segments"),
    ("memoryos_gpu.ops", "recompute_heat"),
)
#: The states of ``memoryos_degraded``, each exported 0 or 1 (an alert needs the 0 too).
DEGRADED_STATES = ("store_full", "llm_unavailable")
#: The LLM backend's counters exported, as (BackendStats field, event label).
LLM_BACKEND_EVENTS = (
    ("calls", "requests"),
    ("batches", "batches"),
    ("retries", "retries"),
    ("errors", "errors"),
    ("invalid_json", "invalid_json"),
    ("repaired_json", "repaired_json"),
)
BREAKER_STATES = ("closed", "open", "half_open")

# ---------------------------------------------------------------- kernel timing hook
_kernel_observers: list[Callable[[str, float], None]] = []
_kernel_lock = threading.Lock()
_kernels_wrapped = False


def _wrap_kernels() -> None:
    """Wrap the :data:`KERNELS` entry points once per process with a timer that feeds every
    registered observer (the engine looks them up on their module at call time)."""
    global _kernels_wrapped
    with _kernel_lock:
        if _kernels_wrapped:
            return
        import importlib

        for module_name, name in KERNELS:
            ops = importlib.import_module(module_name)
            fn = getattr(ops, name, None)
            if fn is None or getattr(fn, "_memoryos_timed", False):
                continue

            def make(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
                @functools.wraps(fn)
                def timed(*args: Any, **kw: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return fn(*args, **kw)
                    finally:
                        dt = time.perf_counter() - t0
                        for obs in tuple(_kernel_observers):
                            obs(name, dt)

                timed._memoryos_timed = True  # type: ignore[attr-defined]
                return timed

            setattr(ops, name, make(fn, name))
        _kernels_wrapped = True


class ServerMetrics:
    """The metrics of one server instance."""

    def __init__(self, service: Any = None) -> None:
        r = CollectorRegistry(auto_describe=True)
        #: what /metrics exposes: this instance's metrics, or, in Prometheus multiprocess mode
        #: ($PROMETHEUS_MULTIPROC_DIR, set by ``serve --workers``), every process's
        self.registry = r
        mp_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if mp_dir:
            from prometheus_client import multiprocess

            self.registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.registry, path=mp_dir)
        self.http = Histogram(
            "memoryos_http_request_duration_seconds",
            "HTTP request latency by route template and status.",
            ("method", "route", "status"),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "memoryos_batch_size",
            "Items per engine call, by queue (retrieve, write, respond, derived).",
            ("queue",),
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.engine_seconds = Histogram(
            "memoryos_engine_call_seconds",
            "Wall time of engine calls, by operation.",
            ("op",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kernel_seconds = Histogram(
            "memoryos_kernel_seconds",
            "Time inside the native kernel entry points, by kernel.",
            ("kernel",),
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.rejected = Counter(
            "memoryos_rejected_total",
            "Requests refused, by reason (unauthorized, forbidden, rate_limited, overloaded, "
            "too_large, unavailable, body_timeout, client_disconnect, store_full).",
            ("reason",),
            registry=r,
        )
        self._service = service
        self.registry.register(_ServiceCollector(self))
        self._observer = self._observe_kernel
        _wrap_kernels()
        with _kernel_lock:
            _kernel_observers.append(self._observer)

    def bind(self, service: Any) -> None:
        self._service = service

    def _observe_kernel(self, name: str, seconds: float) -> None:
        self.kernel_seconds.labels(name).observe(seconds)

    def observe_batch(self, queue: str, op: str, size: int, seconds: float) -> None:
        self.batch_size.labels(queue).observe(size)
        self.engine_seconds.labels(op).observe(seconds)

    def close(self) -> None:
        with _kernel_lock:
            if self._observer in _kernel_observers:
                _kernel_observers.remove(self._observer)


class _ServiceCollector(Collector):
    """Values sampled at scrape time from the service and its engine."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        svc = self._metrics._service
        parts = _parts(svc)
        depth = GaugeMetricFamily(
            "memoryos_queue_depth",
            "Admitted, unanswered items per queue (shard: the engine process under --engines).",
            labels=["queue", "shard"],
        )
        for shard, part in parts:
            for name, value in part.queue_depths().items():
                depth.add_metric([name, shard], value)
        yield depth
        yield from _health_metrics(parts)
        engine = getattr(svc, "engine", None) if svc is not None else None
        if engine is None:
            return
        pending = GaugeMetricFamily(
            "memoryos_pending_derived", "Derived items (chain, MTM, promotion) still owed."
        )
        try:
            pending.add_metric([], float(engine.pending_count()))
        except Exception:  # the store may be closed during shutdown
            return
        yield pending
        yield from _engine_counters(_engines(parts, engine))


def _engines(parts: list[tuple[str, Any]], engine: Any) -> list[tuple[str, Any]]:
    """The engines whose counters are exported, with their ``shard`` label: each engine
    process's own under ``--engines K`` (a part's ``engine``: its status snapshot), else the
    one engine with an empty label (no ``shard`` label at all, as before)."""
    if parts and all(shard for shard, _ in parts):
        return [(shard, getattr(part, "engine", None)) for shard, part in parts]
    return [("", engine)]


def _engine_counters(engines: list[tuple[str, Any]]) -> Iterator[Any]:
    """The engine's counters (``memoryos_engine_events``, ``memoryos_llm_*``), one series per
    engine process under ``--engines K`` (label ``shard``), as ``memoryos_queue_depth``.

    Why per shard: each engine process counts from 0 when it (re)starts, so a sum over the
    shards fell part way when one engine restarted and the others did not, and Prometheus's
    ``rate()``/``increase()`` read the drop as a reset to 0 and counted a false increase of
    the survivors' whole total. Each shard's own series resets only with its own engine (a
    true counter reset); ``sum by (event)`` adds them up. A single engine keeps its series
    without a ``shard`` label (unchanged)."""
    sharded = any(shard for shard, _ in engines)
    extra = ["shard"] if sharded else []
    calls = CounterMetricFamily(
        "memoryos_llm_calls", "LLM requests made by the engine.", labels=extra
    )
    tokens = CounterMetricFamily(
        "memoryos_llm_tokens", "LLM tokens, by kind (prompt, completion).", labels=["kind", *extra]
    )
    fb = CounterMetricFamily(
        "memoryos_llm_fallbacks", "LLM outputs replaced by the extractive fallback.", labels=extra
    )
    ev = CounterMetricFamily(
        "memoryos_engine_events", "The engine's own counters.", labels=["event", *extra]
    )
    any_llm = any_counters = False
    for shard, engine in engines:
        if engine is None:
            continue
        label = [shard] if sharded else []
        stats = getattr(getattr(engine, "stages", None), "stats", None)
        if stats is not None:
            any_llm = True
            s = stats.as_dict()
            calls.add_metric(label, s.get("llm_calls", 0))
            tokens.add_metric(["prompt", *label], s.get("prompt_tokens", 0))
            tokens.add_metric(["completion", *label], s.get("completion_tokens", 0))
            fb.add_metric(label, s.get("fallbacks", 0))
        counters = getattr(engine, "counters", None)
        if isinstance(counters, dict):
            any_counters = True
            for k, v in list(counters.items()):
                if isinstance(v, int | float):
                    ev.add_metric([k, *label], v)
    if any_llm:
        yield calls
        yield tokens
        yield fb
    if any_counters:
        yield ev


def _parts(svc: Any) -> list[tuple[str, Any]]:
    """The services whose queues and health are sampled, with their ``shard`` label: each
    engine process's under ``--engines K`` (a shard router's ``parts``), else the one service
    with an empty label (PromQL reads an empty label as none, so ``queue="retrieve"`` selects
    the single engine's series and ``sum by (queue)`` the shards')."""
    if svc is None:
        return []
    parts = getattr(svc, "parts", None)
    if isinstance(parts, list | tuple):
        return [(str(i), p) for i, p in enumerate(parts)]
    return [("", svc)]


def _health_metrics(parts: list[tuple[str, Any]]) -> Iterator[Any]:
    """``memoryos_degraded``, and the LLM backend's counters and breaker state, from each
    part's :meth:`~memoryos_gpu.server.service.MemoryService.health` (a service without one,
    such as a worker's proxy of an engine process that does not send it, exports none)."""
    healths = []
    for shard, part in parts:
        health = getattr(part, "health", None)
        if health is None:
            continue
        try:
            healths.append((shard, health()))
        except Exception:  # the engine may be loading or closing: sampled at the next scrape
            continue
    if not healths:
        return
    degraded = GaugeMetricFamily(
        "memoryos_degraded",
        "1 while the server serves degraded, by state (store_full: writes fail for a full "
        "disk; llm_unavailable: the LLM cannot be used), else 0.",
        labels=["state", "shard"],
    )
    events = CounterMetricFamily(
        "memoryos_llm_backend_events",
        "The LLM backend's own counts (requests, batches, retries, errors, invalid_json, "
        "repaired_json), batches that failed as a whole included.",
        labels=["event", "shard"],
    )
    breaker = GaugeMetricFamily(
        "memoryos_llm_breaker_state",
        "1 for the LLM backend's circuit breaker state (closed, open, half_open), 0 else.",
        labels=["state", "shard"],
    )
    for shard, h in healths:
        for state in DEGRADED_STATES:
            degraded.add_metric([state, shard], 1.0 if state in h.get("degraded", ()) else 0.0)
        llm = h.get("llm") or {}
        for field, event in LLM_BACKEND_EVENTS:
            if field in llm:
                events.add_metric([event, shard], llm[field])
        if llm.get("breaker") is not None:
            for state in BREAKER_STATES:
                breaker.add_metric([state, shard], 1.0 if llm["breaker"] == state else 0.0)
    yield degraded
    yield events
    yield breaker

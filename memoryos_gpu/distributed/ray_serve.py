"""The HTTP API on Ray Serve (``memoryos-gpu serve --ray``): one replica per shard, one router.

* **Shard deployments** ``shard-0`` .. ``shard-{N-1}`` (:class:`ShardReplica`, one replica
  each, a GPU each when the cluster has one per shard): each holds the single-box serving core,
  a :class:`~memoryos_gpu.server.service.MemoryService` over its
  :class:`~memoryos_gpu.distributed.sharding.ShardEngine` - the same micro-batching queues
  (concurrent requests of the shard's users become one ``retrieve_many`` / ``add_many``), the
  same derived-work thread, the same acknowledgement rule (an add answers after its commit).
* **Ingress** (:class:`Router`): the single-box FastAPI app itself
  (:func:`~memoryos_gpu.server.app.create_app`: same routes, API keys, tenancy, limits, error
  bodies, OpenAPI), built over :class:`RouterService`, which sends each request to its user's
  shard (a batch of pages is split by shard and answered in request order).
* **Sync loop** in the router (every ``sync_interval_s``): exchanges the shards' keyword
  statistics and routes assistant facts to their owner shard and its replicas (the rule in
  :mod:`memoryos_gpu.distributed.replicas`), refreshes the user list and queue statistics.
  Its first sync (or first deletion across shards) first has the shards catch up on the
  keyword statistics of the pages no exchange gave them (an ``ingest --ray`` stopped before
  its exchange), as a ``ShardedEngine`` does on open (:meth:`RouterService._catch_up`).

A replica that dies is restarted by Serve and reopens its shard from the store: acknowledged
pages are there, queued derived work resumes. Requests to its users fail (503) meanwhile.

**Shutdown** (:func:`finish_app`, before the application is deleted): the router refuses new
requests, the shards drain and finish derived work, one last exchange, then each shard saves
its keyword statistics and closes its store. Then :func:`stop_app` takes the application down
with Serve's HTTP proxy (never a 404 for a route that is gone). A replica stopped without it
(``serve delete``) closes itself in Serve's shutdown hook, without the last exchange.

Run it: ``memoryos-gpu serve --ray --shards N --store DIR`` (local Ray, or $RAY_ADDRESS), or
``serve run deploy/ray-serve.yaml`` (see that file), whose import path is :func:`app_builder`.

This module builds, runs and stops the application and holds the ingress deployment
(:class:`Router`); the shard deployment is in :mod:`~memoryos_gpu.distributed.ray_shard`, the
router's service in :mod:`~memoryos_gpu.distributed.ray_router` and the engine stand-ins the
routes call in :mod:`~memoryos_gpu.distributed.ray_routing`. The names in ``__all__`` are
imported from here.
"""

from __future__ import annotations

import difflib
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.layout import check_layout, prepare_layout, shard_store
from memoryos_gpu.distributed.ray_common import ensure_ray, require_ray, shard_resources
from memoryos_gpu.distributed.ray_router import DEFAULT_SYNC_S, RouterService
from memoryos_gpu.distributed.ray_routing import add_by_shard
from memoryos_gpu.distributed.ray_shard import ShardReplica
from memoryos_gpu.distributed.shard_writers import check_shard_writers
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.stop_signals import StopSignals

__all__ = [
    "Router",
    "RouterService",
    "ShardReplica",
    "add_by_shard",
    "app_builder",
    "build_app",
    "finish_app",
    "run",
    "stop_app",
]

log = logging.getLogger("memoryos_gpu.server")
APP_NAME = "memoryos"
REPLICA_CONCURRENCY = 1024  # requests a replica takes at once: micro-batches form inside it
SHUTDOWN_S = 120.0  # how long Serve lets a shard replica close before it kills it


# ============================================================================ ingress
class Router:
    """The ingress deployment: the single-box FastAPI app over a :class:`RouterService`."""

    def __init__(
        self,
        *shards: Any,
        config: dict[str, Any],
        api_keys: dict[str, str] | None,
        settings: dict[str, Any],
        sync_interval_s: float = DEFAULT_SYNC_S,
    ) -> None:
        self.shards = list(shards)
        self.config = EngineConfig.model_validate(config)
        self.api_keys = api_keys
        self.settings = ServerSettings(**settings)
        self.sync_interval_s = sync_interval_s
        self.service: RouterService | None = None

    async def finish(self) -> dict[str, int]:
        """The shards' orderly end (:meth:`RouterService.finish_shards`), asked by
        :func:`finish_app` through a handle before the application is deleted."""
        if self.service is None:
            return {}
        return await self.service.finish_shards()

    def __serve_build_asgi_app__(self) -> Any:
        from memoryos_gpu.server.app import create_app

        service = self.service = RouterService(
            self.shards, self.config, self.settings, sync_interval_s=self.sync_interval_s
        )
        return create_app(
            service=service, api_keys=self.api_keys, settings=self.settings, use_env_keys=False
        )


# ============================================================================ building
def build_app(
    config: EngineConfig,
    shards: int,
    *,
    api_keys: Mapping[str, str] | str | Path | None = None,
    settings: ServerSettings | None = None,
    shard_cpus: float | None = None,
    shard_gpus: float | None = None,
    sync_interval_s: float = DEFAULT_SYNC_S,
) -> Any:
    """The Serve application: ``shards`` shard deployments behind one router.

    ``config.store``: a directory (one SQLite store per shard, ``STORE/shard-I``) or a
    PostgreSQL URL. ``api_keys``: ``{key: tenant}`` or a ``KEY TENANT`` file, read here (plus
    $MEMORYOS_GPU_API_KEYS) and handed to the router. Call with Ray connected (resources are
    read from the cluster)."""
    serve = _serve()
    from memoryos_gpu.server.auth import load_api_keys

    prepare_layout(config.store, shards)
    settings = settings or ServerSettings()
    res = shard_resources(shards, cpus=shard_cpus, gpus=shard_gpus)
    replica = serve.deployment(
        ShardReplica,
        max_ongoing_requests=REPLICA_CONCURRENCY,
        ray_actor_options=res.options(),
        health_check_period_s=5,
        # a replica stopped on its own (serve delete) drains and finishes derived work first
        graceful_shutdown_timeout_s=SHUTDOWN_S,
    )
    parts = [
        replica.options(name=f"shard-{i}").bind(
            config.model_copy(update={"store": shard_store(config.store, i, shards)}).model_dump(),
            i,
            shards,
            settings.model_dump(),
        )
        for i in range(shards)
    ]
    ingress = serve.deployment(
        serve.ingress()(Router),
        name="router",
        max_ongoing_requests=REPLICA_CONCURRENCY,
        ray_actor_options={"num_cpus": 0},
    )
    keys = load_api_keys(api_keys, use_env=True) or None
    return ingress.bind(
        *parts,
        config=config.model_dump(),
        api_keys=dict(keys) if keys else None,
        settings=settings.model_dump(),
        sync_interval_s=sync_interval_s,
    )


def _serve() -> Any:
    require_ray("serve")
    from ray import serve

    return serve


#: The ``args`` of :func:`app_builder` besides the :class:`ServerSettings` fields.
APP_ARGS = (
    "store",
    "shards",
    "embedder",
    "device",
    "config",
    "api_keys",
    "sync_interval_s",
    "shard_cpus",
    "shard_gpus",
)


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run memoryos_gpu.distributed.ray_serve:app_builder store=DIR shards=2`` (or the
    ``args`` of deploy/ray-serve.yaml): ``store``, ``shards`` (default: the count the store
    was sharded with, else 2, as ``serve --ray``), ``embedder``, ``device``, ``config`` (a
    TOML file), ``api_keys`` (a key file), ``sync_interval_s``, ``shard_cpus``,
    ``shard_gpus``, and any :class:`ServerSettings` field.

    Any other name is refused (:func:`check_app_args`) before anything starts: these args come
    from a hand-edited YAML file, and an ignored typo is silent damage, ``api_key:`` for
    ``api_keys:`` serving ``/v1`` with no authentication at all."""
    args = dict(args)
    check_app_args(args)
    config_file = args.pop("config", None)
    base = EngineConfig.from_toml(config_file) if config_file else EngineConfig()
    update = {k: v for k in ("store", "embedder", "device") if (v := args.pop(k, None))}
    config = EngineConfig.model_validate({**base.model_dump(), **update})
    num = {k: float(args.pop(k)) for k in ("shard_cpus", "shard_gpus") if k in args}
    shards = _app_shards(config.store, args.pop("shards", None))
    api_keys = args.pop("api_keys", None)
    sync = args.pop("sync_interval_s", None)
    sync_s = DEFAULT_SYNC_S if sync is None else float(sync)
    settings = ServerSettings(**args)  # what is left: ServerSettings fields only
    return build_app(
        config, shards, api_keys=api_keys, settings=settings, sync_interval_s=sync_s, **num
    )


def check_app_args(args: Mapping[str, Any]) -> None:
    """Refuse (ValueError) the names :func:`app_builder` does not take, each with the closest
    known name, so ``serve run`` stops with one line that says what to fix."""
    known = sorted({*APP_ARGS, *ServerSettings.model_fields})
    unknown = [str(k) for k in args if k not in known]
    if not unknown:
        return
    parts = []
    for name in unknown:
        near = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    raise ValueError(
        f"app_builder: unknown arg{'s' if len(parts) > 1 else ''} {', '.join(parts)}; it takes "
        f"{', '.join(APP_ARGS)} and the ServerSettings fields: "
        f"{', '.join(sorted(ServerSettings.model_fields))}"
    )


def _app_shards(store: str, given: Any) -> int:
    """``shards``, else the store's own count, else 2: the rule of ``serve --ray --shards``
    (:func:`memoryos_gpu.cli.stores.ray_shards`), so the YAML file and the command line serve
    a store the same way by default."""
    from memoryos_gpu.cli.stores import ray_shards

    if given is None or given == "":
        return ray_shards(store, None)
    text = str(given).strip()
    if isinstance(given, bool) or not text.isdigit() or int(text) < 1:
        raise ValueError(f"app_builder: shards must be a whole number >= 1, got {given!r}")
    return int(text)


def run(
    config: EngineConfig,
    shards: int,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_keys: Mapping[str, str] | str | Path | None = None,
    settings: ServerSettings | None = None,
    address: str | None = None,
    blocking: bool = True,
    **kw: Any,
) -> None:
    """Start the application on Ray Serve (local Ray, or ``address`` / $RAY_ADDRESS) and, with
    ``blocking``, serve until SIGINT, SIGTERM or SIGHUP, then shut the application down and
    return: the shards drain their queues, finish derived work, exchange keyword statistics and
    facts a last time, save and close their stores (:func:`finish_app`), then the application
    is deleted, with Serve itself when this run started it (:func:`stop_app`: no 404s while
    it stops). The signals follow :mod:`memoryos_gpu.stop_signals` (the first stops
    gracefully, a second Ctrl-C stops waiting for the shards); a stop that comes while the
    application starts shuts it down as soon as it has started. A store laid out for another
    shard count, or a shard another process holds for writing, is refused before Ray starts
    (``ValueError``, ``StoreLockedError``: seconds, not Ray's start-up and a replica's log)."""
    check_layout(config.store, shards)
    check_shard_writers(config.store, shards)
    stopping = threading.Event()
    # sets the event and nothing else: it runs in the main thread wherever that is, inside
    # Ray's calls too, so it must not raise there
    stop = StopSignals(lambda _signum: stopping.set())
    if blocking:
        stop.install()
    try:
        ensure_ray(address)
        if blocking:
            # Again: ray.init sets Ray's SIGTERM handlers over ours. Its C++ core chains
            # abseil's failure handler in front of Python's, and that handler arms a 3-second
            # SIGALRM abort before it calls Ray's own (sys.exit(15)): a shutdown that took
            # longer than 3 s (finish_app, the deletion, Ray's own shutdown at exit) was cut
            # short by SIGABRT (exit -6). Set through signal.signal, ours replaces both.
            stop.install()
        serve = _serve()
        own_serve = not _serve_running(serve)
        serve.start(http_options={"host": host, "port": int(port)})
        app = build_app(config, shards, api_keys=api_keys, settings=settings, **kw)
        serve.run(app, name=APP_NAME, route_prefix="/")
        if not blocking:
            return
        log.warning(
            "memoryos-gpu on Ray Serve: http://%s:%d, %d shards; Ctrl-C stops", host, port, shards
        )
        stopping.wait()
        try:
            finish_app(serve)
        finally:  # a second Ctrl-C in finish_app's wait, or its failure, is logged there
            stop_app(serve, own_serve)
    finally:
        stop.restore()


def _serve_running(serve: Any) -> bool:
    """Whether Serve already runs on the cluster (proxies or applications), before
    :func:`run` starts it: one that runs is someone else's to stop (:func:`stop_app`)."""
    status = serve.status()
    return bool(status.proxies or status.applications)


def stop_app(serve: Any, own_serve: bool) -> None:
    """Take the application down once :func:`finish_app` is done: all of Serve when this run
    started it (``own_serve``) and the application is its only one, else the application only.

    Why not always ``serve.delete``: Serve's HTTP proxy outlives the deletion (until Ray
    stops) and answers ``404 Path '...' not found`` (text/plain) for every path the deleted
    application routed: seconds of 404s for ``/v1/users/{user}/...`` after the router's 503s,
    an answer clients take for "no such route" and do not retry. ``serve.shutdown`` stops the
    proxies in the same controller step that starts deleting the applications, before their
    routes go: clients get the router's 503 + ``Retry-After``, then connection refused.
    Serve that runs someone else's applications (or that was running before) keeps its
    proxies; only this application is deleted there, and its paths then answer Serve's 404.
    ``serve.shutdown`` waits for the replicas 30 s at most (Ray's limit; ``serve.delete`` has
    none): after :func:`finish_app` they are closed already, but after a second Ctrl-C a
    replica's own close that takes longer is cut short when Ray stops."""
    if own_serve and set(serve.status().applications) <= {APP_NAME}:
        serve.shutdown()
    else:
        serve.delete(APP_NAME)


def finish_app(serve: Any) -> None:
    """Before the application is deleted: the router drains the shards, exchanges keyword
    statistics and facts a last time, and has every shard save and close its engine
    (:meth:`RouterService.finish_shards`). A second Ctrl-C stops waiting (each replica then
    closes on its own as Serve stops it, without the last exchange)."""
    log.warning("stopping: the shards finish their queues and derived work, then save")
    try:
        done = serve.get_app_handle(APP_NAME).finish.remote().result()
    except KeyboardInterrupt:
        log.warning("second Ctrl-C: the shards close without a last exchange")
    except Exception:
        log.exception("the shards' orderly end failed; each closes on its own as it stops")
    else:
        log.warning("shards closed (last exchange: %s)", done)

"""``memoryos-gpu serve`` (HTTP: one process, workers, shard engines, or Ray Serve) and
``memoryos-gpu mcp``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import click
from click.core import ParameterSource

from memoryos_gpu.log_setup import LOG_LEVELS

from .options import (
    EXIT_USAGE,
    CLIError,
    EngineOptions,
    UsageFailure,
    build_config,
    check_engine_settings,
    engine_options,
    handle_errors,
    listen_host_problem,
    option_flag,
    options_of,
    quiet_model_loading,
    resolve_store,
    server_settings,
)
from .stores import (
    is_url,
    ray_shards,
    shard_dirs,
    shown,
    store_file,
    store_shards,
)


@click.command()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    callback=lambda ctx, param, value: _checked_host(value),
    help="The address to listen on (0.0.0.0 or :: for every interface; never empty).",
)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--api-keys",
    metavar="FILE",
    type=click.Path(exists=True, dir_okay=False),
    help="Key file: one `KEY TENANT` per line (`KEY *`: an admin key, server-wide /v1/stats "
    "only). Keys in $MEMORYOS_GPU_API_KEYS (`KEY:TENANT,KEY:TENANT`) are added to them.",
)
@click.option(
    "--ray",
    "use_ray",
    is_flag=True,
    help="Serve on Ray Serve: one replica per shard (a GPU each when the cluster has them) "
    "behind a router with the same API and keys; local Ray unless $RAY_ADDRESS is set.",
)
@click.option(
    "--shards",
    type=click.IntRange(1),
    help="Shards for --ray [default: the store's shard count, else 2]; only with --ray "
    "(without Ray: --engines N).",
)
@click.option(
    "--workers",
    type=click.IntRange(0),
    help="HTTP worker processes in front of the engine process(es) (0: one process serves "
    "everything) [default: the cores available minus one per engine; at least 1 with "
    "--engines > 1].",
)
@click.option(
    "--engines",
    type=click.IntRange(1),
    help="Engine processes behind the workers; more than one shards the users over them "
    "(one store each, STORE/shard-I as `ingest --workers` writes, or one PostgreSQL "
    "database) [default: the store's shard count, else 1].",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="INFO",
    show_default=True,
    help="Logging level on stderr, for every process of the server (workers, engine "
    "processes); HTTP-client request lines (httpx) show at DEBUG only, passwords masked.",
)
@engine_options
@click.pass_context
@handle_errors
def serve(
    ctx: click.Context,
    host: str,
    port: int,
    api_keys: str | None,
    use_ray: bool,
    shards: int | None,
    workers: int | None,
    engines: int | None,
    log_level: str,
    **kwargs: Any,
) -> None:
    """Serve the HTTP API (memoryos_gpu.server) over the store until Ctrl-C or SIGTERM
    (then drain, commit, close the store and exit 0).

    With --workers N (the default on a multi-core box), N HTTP processes parse, authenticate
    and validate requests and the engine process batches them all; --engines K runs K engine
    processes, each owning a shard of the users, for boxes where one is the cap
    (docs/server.md)."""
    import inspect

    o = options_of(ctx, kwargs)
    if shards is not None and not use_ray:  # it would be ignored: one engine, unsharded
        raise UsageFailure(
            f"--shards is for --ray: give --ray --shards {shards}, or, without Ray, "
            f"--engines {shards} (local engine processes, one shard each)"
        )
    if use_ray:
        if workers or engines:
            raise UsageFailure(
                "--workers and --engines are for the single-box server; --ray has its own router"
            )
        _serve_ray(o, host, port, api_keys, shards, log_level)
        return
    try:
        from memoryos_gpu.server.app import run
        from memoryos_gpu.server.workers import ShutdownError, StartupError
    except ImportError as exc:
        raise _no_server("the HTTP server", "memoryos_gpu.server.app", exc) from None
    store = resolve_store(o)
    cfg = build_config(o, store=store)
    check_engine_settings(cfg)  # found at the engine's open, after the store was made
    settings = server_settings(o)
    _warn_if_new(store)
    shards = _layout_shards(store, engines)
    if engines and shards > 1 and engines != shards:  # users are placed by hash mod count
        raise UsageFailure(
            f"{shown(store)} holds {shards} shards: serve it with --engines {shards}"
        )
    engines_given = engines is not None
    engines = engines or shards
    if workers is None:
        from memoryos_gpu.server.workers import default_workers

        # several engines are reached through workers: at least one, even on a small box
        workers = max(default_workers(engines), 1 if engines > 1 else 0)
    if engines > 1 and not workers:
        # name what the user gave: without --engines, the count is the store's layout
        raise UsageFailure(
            f"--engines {engines} needs --workers >= 1 (the HTTP workers route by shard)"
            if engines_given
            else f"--workers 0 (one process) cannot serve {shown(store)}: it holds {shards} "
            f"shards, served by {shards} engine processes behind HTTP workers that route "
            "by shard; give --workers N (N >= 1), or leave --workers out"
        )
    candidates = {
        "store": store,
        "host": host,
        "port": port,
        "api_keys": api_keys,
        "config": cfg,
        "workers": workers,
        "log_level": log_level,
        **({"engines": engines} if engines > 1 else {}),
        **settings,
    }
    params = inspect.signature(run).parameters
    takes_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    call = {k: v for k, v in candidates.items() if k in params or takes_kw}
    quiet_model_loading()
    try:
        run(**call)
    except ValueError as exc:  # a store laid out for another shard count, ...
        raise UsageFailure(str(exc)) from None
    except StartupError as exc:  # the port is taken, the host is no address: a runtime failure
        raise CLIError(str(exc)) from None
    except ShutdownError as exc:  # stopped, but not cleanly: never the exit 0 of a clean stop
        raise CLIError(str(exc)) from None


def _checked_host(host: str) -> str:
    """``--host``, refused as a usage error when empty or blank
    (:func:`~memoryos_gpu.cli.options.listen_host_problem`)."""
    problem = listen_host_problem(host)
    if problem:
        raise click.BadParameter(problem, param_hint="'--host'")
    return host


def _warn_if_new(store: str) -> None:
    """Say, in one line, that the server creates the store: serving a fresh store is
    legitimate, but a mistyped ``--store`` was served from an empty memory without a word
    (``retrieve`` and ``chat`` refuse a missing store for that reason)."""
    if is_url(store) or store == ":memory:":
        return
    if store_file(store).exists() or shard_dirs(store):
        return
    # said before the start, which may still fail (the port taken): "will", not "creating"
    click.echo(
        f"warning: no store at {store} yet: the server will create a new, empty one", err=True
    )


def _layout_shards(store: str, engines: int | None) -> int:
    """The store's shard count; for a PostgreSQL store whose server is not up yet, the
    ``--engines`` asked for (else 1), said in a warning: the server starts and waits for the
    database (``/ready`` 503 meanwhile, its load retried), as a server started from Python does,
    instead of exiting when it and the database start in either order."""
    from memoryos_gpu.store import StoreUnavailableError

    try:
        return store_shards(store)
    except StoreUnavailableError as exc:
        click.echo(
            f"warning: {exc}; serving {engines or 1} engine(s) once it answers (/ready says "
            "503 until then); a store of N shards needs --engines N",
            err=True,
        )
        return engines or 1


def _serve_ray(
    o: EngineOptions,
    host: str,
    port: int,
    api_keys: str | None,
    shards: int | None,
    log_level: str,
) -> None:
    """``serve --ray``: memoryos_gpu.distributed.ray_serve on Ray Serve until Ctrl-C. The
    driver's log gets the servers' setup; the replicas log as Ray configures them."""
    from memoryos_gpu.distributed.ray_common import RayUnavailableError
    from memoryos_gpu.log_setup import setup_logging

    setup_logging(log_level)

    store = resolve_store(o)
    cfg = build_config(o, store=store)
    check_engine_settings(cfg, device=False)  # the replicas' machines may have the GPUs
    settings = server_settings(o)
    quiet_model_loading()
    try:
        from memoryos_gpu.distributed.ray_serve import run as run_ray
        from memoryos_gpu.server.settings import ServerSettings

        run_ray(
            cfg,
            ray_shards(store, shards),
            host=host,
            port=port,
            api_keys=api_keys,
            settings=ServerSettings(**settings),
        )
    except RayUnavailableError as exc:
        raise CLIError(str(exc)) from None
    except ValueError as exc:
        raise UsageFailure(str(exc)) from None


# ============================================================================ mcp
@click.command(
    name="mcp",
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def mcp_command(ctx: click.Context, args: tuple[str, ...]) -> None:
    """Serve MCP (python -m memoryos_gpu.server.mcp_server); its own flags follow `mcp`:
    --config config.json (the reference's) or engine.toml, --store, --user-id, --transport
    stdio|streamable-http|http, --stateless, --json-response, --log-level, ...
    (`memoryos-gpu mcp --help`). A bad configuration exits 2, as for every command."""
    try:
        from memoryos_gpu.server.mcp_server import ConfigExit
        from memoryos_gpu.server.mcp_server import main as mcp_main
    except ImportError as exc:
        raise _no_server("the MCP server", "memoryos_gpu.server.mcp_server", exc) from None
    ignored = _flags_given(ctx.parent)
    if ignored:
        raise UsageFailure(
            f"engine options before `mcp` do not apply to the MCP server: {', '.join(ignored)}. "
            "Give the server's own flags after `mcp` (`memoryos-gpu mcp --help`: --config, "
            "--store, --embedder, --device; an LLM: --config FILE.toml with an [llm] table)"
        )
    try:
        mcp_main(list(args), prog="memoryos-gpu mcp")
    except ConfigExit as exc:  # a bad configuration: its line, and exit 2 as every command
        click.echo(str(exc.code), err=True)
        raise _UsageExit(str(exc.code)) from None


class _UsageExit(SystemExit):
    """Exit 2 (a usage error) after the message was printed; ``str()`` is the message, for a
    caller in Python that reads it (``pytest.raises(SystemExit, match=...)``)."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_USAGE)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _no_server(what: str, module: str, exc: ImportError) -> CLIError:
    """A server whose module cannot be imported: the server extra is missing (a traceback
    ending in "No module named 'fastapi'" named no extra)."""
    return CLIError(
        f"{what} is not available: {module} could not be imported ({exc}): "
        "pip install 'memoryos-gpu[server]' (FastAPI, uvicorn, mcp)."
    )


def _flags_given(group: click.Context | None) -> list[str]:
    """The engine options given on the command line before a subcommand (``memoryos-gpu
    --llm-mode llm mcp``), as flags; values from the environment (``$MEMORYOS_GPU_LLM_API_KEY``)
    do not count, the user did not type them for this command."""
    if group is None:
        return []
    return [
        option_flag(f.name)
        for f in fields(EngineOptions)
        if group.get_parameter_source(f.name) is ParameterSource.COMMANDLINE
    ]

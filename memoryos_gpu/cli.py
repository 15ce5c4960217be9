"""The ``memoryos-gpu`` command line (also ``python -m memoryos_gpu``). See ``docs/cli.md``.

Settings are resolved per run with the precedence *command-line flag > environment variable >
config file (``--config FILE.toml``) > built-in default*. Engine options may be given before or
after the subcommand (``memoryos-gpu --store s ingest f.jsonl`` = ``memoryos-gpu ingest f.jsonl
--store s``); after the subcommand wins.

Environment variables read here:

* ``MEMORYOS_GPU_EMBEDDER`` = ``transformers`` (default: the bundled MiniLM) | ``hashing`` (a fast,
  deterministic, model-free test double; a store built with it can only be opened with it);
* ``MEMORYOS_GPU_STORE``: the default ``--store``;
* ``MEMORYOS_GPU_KEY``: the key of an encrypted store (every command); ``MEMORYOS_GPU_NEW_KEY``:
  the new key of ``rekey`` (docs/storage.md, "Encryption at rest").

Exit codes: 0 ok; 1 runtime error (unknown user, store problems, missing optional parts);
2 usage error (bad flag, missing file, undetectable format, bad config); 3 ``ingest``
finished but rejected some records; 130 interrupted (SIGINT), after a clean stop.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

ENV_EMBEDDER = "MEMORYOS_GPU_EMBEDDER"
ENV_EMBEDDING_API_KEY = "MEMORYOS_GPU_EMBEDDING_API_KEY"
ENV_STORE = "MEMORYOS_GPU_STORE"
ENV_LLM_API_KEY = "MEMORYOS_GPU_LLM_API_KEY"
DEFAULT_STORE = "./memoryos-store"
STORE_FILE = "memory.sqlite3"
SHARDS_FILE = "shards.json"
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REJECTED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
FORMAT_CHOICES = ("auto", "jsonl", "locomo", "sharegpt", "openai")
LLM_BACKENDS = ("transformers", "vllm", "openai")
EMBEDDER_KINDS = ("transformers", "onnx", "openai", "hashing")  # = memoryos_gpu.embed's

_LLM_HELP = (
    "chat needs an LLM backend, and the configured LLM mode is 'extractive' (no LLM: the "
    "default, made for fast bulk ingestion).\nEnable one with --llm-mode llm and a backend:\n"
    "  --llm-backend transformers                 the bundled SmolLM2-135M (CPU is fine; "
    "needs `pip install gguf accelerate`)\n"
    "  --llm-backend openai --llm-base-url URL --llm-model NAME   any OpenAI-compatible "
    "server (vLLM serve, llama.cpp, ...)\n"
    "  --llm-backend vllm --llm-model NAME        in-process vLLM on a GPU\n"
    'or set them in a config file: [llm] mode = "llm", backend = ..., model = ... '
    "(--config FILE.toml).\n"
    "Example: memoryos-gpu chat --store STORE --user USER --llm-mode llm --llm-backend "
    "transformers"
)


class CLIError(click.ClickException):
    """A runtime failure reported as ``error: ...`` with exit code 1."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class UsageFailure(click.UsageError):
    """A usage problem found after parsing (bad config, undetectable format): exit code 2."""


# ============================================================================ options
@dataclass
class EngineOptions:
    """The engine options every subcommand accepts (None: not given on the command line)."""

    store: str | None = None
    config: str | None = None
    device: str | None = None
    preset: str | None = None
    llm_mode: str | None = None
    llm_backend: str | None = None
    llm_model: str | None = None
    llm_base_url: str | None = None
    llm_api_key: str | None = None
    embedder: str | None = None
    embedding_model: str | None = None
    embedding_base_url: str | None = None
    embedding_dtype: str | None = None

    def merged(self, later: EngineOptions) -> EngineOptions:
        """These options overridden by ``later``'s given ones."""
        return EngineOptions(
            **{
                f.name: getattr(later, f.name)
                if getattr(later, f.name) is not None
                else getattr(self, f.name)
                for f in fields(self)
            }
        )

    def argv(self) -> list[str]:
        """Back to command-line flags (to start worker processes with the same settings); the
        API key is left out, since a command line is visible to every user of the machine
        (workers get it as $MEMORYOS_GPU_LLM_API_KEY)."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and f.name not in ("store", "llm_api_key"):
                out += [f"--{f.name.replace('_', '-')}", str(value)]
        return out


_ENGINE_OPTIONS: list[Callable[[Callable], Callable]] = [
    click.option(
        "--store",
        metavar="DIR|URL",
        help=f"Store directory (SQLite file {STORE_FILE} inside; created by ingest), or a "
        "PostgreSQL URL (postgresql://user@host:5432/db) shared by several engines. "
        f"Default: ${ENV_STORE}, the config file's `store`, else {DEFAULT_STORE}.",
    ),
    click.option(
        "--config",
        metavar="FILE.toml",
        type=click.Path(exists=True, dir_okay=False),
        help="TOML engine config ([memory], [llm] tables, top-level keys). Flags override it.",
    ),
    click.option(
        "--device",
        type=click.Choice(["auto", "cpu", "cuda"]),
        help="Where the memory arena and kernels run (auto: CUDA when usable).",
    ),
    click.option(
        "--preset",
        type=click.Choice(["paper", "reference"]),
        help="MemoryOS hyperparameters: the paper's table or the reference code's defaults.",
    ),
    click.option(
        "--llm-mode",
        type=click.Choice(["llm", "extractive"]),
        help="'extractive' (default): no LLM calls; 'llm': chain/summary/profile stages and "
        "chat answers by an LLM backend.",
    ),
    click.option(
        "--llm-backend",
        type=click.Choice(LLM_BACKENDS),
        help="LLM backend for --llm-mode llm (default transformers: bundled SmolLM2).",
    ),
    click.option("--llm-model", metavar="NAME", help="LLM model name or path."),
    click.option(
        "--llm-base-url", metavar="URL", help="OpenAI-compatible server URL (--llm-backend openai)."
    ),
    click.option(
        "--llm-api-key",
        metavar="KEY",
        envvar=ENV_LLM_API_KEY,
        help=f"API key of that server (also ${ENV_LLM_API_KEY}; default: the config file's "
        "[llm] api_key, else $OPENAI_API_KEY).",
    ),
    click.option(
        "--embedder",
        type=click.Choice(EMBEDDER_KINDS),
        help="Embedding backend (also $MEMORYOS_GPU_EMBEDDER; docs/embeddings.md): transformers "
        "(default: a local model folder on torch), onnx (the same folder as int8 ONNX, CPU-"
        "fast; the embed-fast extra), openai (an OpenAI-compatible /v1/embeddings server; "
        "key in $MEMORYOS_GPU_EMBEDDING_API_KEY), hashing (a test double).",
    ),
    click.option(
        "--embedding-model",
        metavar="DIR|NAME",
        help="Embedding model folder, plain transformers or sentence-transformers (default: "
        "the bundled all-MiniLM-L6-v2); with --embedder openai the served model's name.",
    ),
    click.option(
        "--embedding-base-url",
        metavar="URL",
        help="OpenAI-compatible embeddings server up to /v1 (--embedder openai).",
    ),
    click.option(
        "--embedding-dtype",
        type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
        help="Embedding model precision (auto: fp16 on CUDA, fp32 on CPU; bfloat16 is ~1.6x "
        "faster on CPUs with AVX-512 BF16, cosine to fp32 > 0.999).",
    ),
]


def engine_options(fn: Callable) -> Callable:
    for option in reversed(_ENGINE_OPTIONS):
        fn = option(fn)
    return fn


def _pop_options(kwargs: dict[str, Any]) -> EngineOptions:
    return EngineOptions(**{f.name: kwargs.pop(f.name, None) for f in fields(EngineOptions)})


def _options(ctx: click.Context, kwargs: dict[str, Any]) -> EngineOptions:
    """Group-level options overridden by the subcommand's."""
    base = ctx.obj if isinstance(ctx.obj, EngineOptions) else EngineOptions()
    return base.merged(_pop_options(kwargs))


# ============================================================================ configuration
def _read_toml(path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageFailure(f"cannot read config file {path}: {exc}") from None


def resolve_store(o: EngineOptions) -> str:
    """``--store`` > $MEMORYOS_GPU_STORE > config file ``store`` > ./memoryos-store."""
    if o.store:
        return o.store
    if os.environ.get(ENV_STORE):
        return os.environ[ENV_STORE]
    if o.config:
        store = _read_toml(o.config).get("store")
        if isinstance(store, str) and store != ":memory:":
            return store
    return DEFAULT_STORE


def build_config(o: EngineOptions, *, store: str | None = None) -> Any:
    """The :class:`~memoryos_gpu.config.EngineConfig` of these options (flag > env > file >
    default). ``store`` overrides the resolved store path (e.g. ``":memory:"``)."""
    from pydantic import ValidationError

    from memoryos_gpu.config import EngineConfig, preset

    data: dict[str, Any] = _read_toml(o.config) if o.config else {}
    try:
        memory = dict(data.get("memory") or {})
        name = o.preset or memory.pop("preset", None)
        memory.pop("preset", None)
        if name or memory:
            data["memory"] = preset(name or "paper", **memory).model_dump()
        llm = dict(data.get("llm") or {})
        for key, value in (
            ("mode", o.llm_mode),
            ("backend", o.llm_backend),
            ("model", o.llm_model),
            ("base_url", o.llm_base_url),
            ("api_key", o.llm_api_key),
        ):
            if value is not None:
                llm[key] = value
        if llm:
            data["llm"] = llm
        if o.device is not None:
            data["device"] = o.device
        embedder = o.embedder or os.environ.get(ENV_EMBEDDER) or None
        for key, value in (
            ("embedder", embedder),
            ("embedding_model", o.embedding_model),
            ("embedding_base_url", o.embedding_base_url),
            ("embedding_dtype", o.embedding_dtype),
            ("embedding_api_key", os.environ.get(ENV_EMBEDDING_API_KEY)),
        ):
            if value:
                data[key] = value
        data["store"] = store if store is not None else resolve_store(o)
        return EngineConfig.model_validate(data)
    except (ValidationError, ValueError, TypeError) as exc:
        raise UsageFailure(f"invalid engine configuration: {exc}") from None


def _quiet_model_loading() -> None:
    """No model-loading progress bars or info logs (read by transformers when it loads)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_engine(cfg: Any) -> Any:
    """Open an engine (quietly: no model-loading progress bars)."""
    from memoryos_gpu.engine import MemoryEngine

    _quiet_model_loading()
    return MemoryEngine(cfg)


# ============================================================================ stores and shards
def is_url(store: str | os.PathLike[str]) -> bool:
    """A PostgreSQL store (``postgresql://...``): no file, no shard directories."""
    from memoryos_gpu.store import is_url as _is_url

    return _is_url(os.fspath(store))


def store_file(store: str | os.PathLike[str]) -> Path:
    p = Path(store)
    return p if p.suffix in (".sqlite", ".sqlite3", ".db") else p / STORE_FILE


def shard_dirs(store: str | os.PathLike[str]) -> list[Path] | None:
    """The shard stores of a sharded store directory (``--workers``), in shard order."""
    if is_url(store):
        return None
    base = Path(store)
    manifest = base / SHARDS_FILE
    if manifest.is_file():
        try:
            count = int(json.loads(manifest.read_text())["count"])
        except (ValueError, KeyError, TypeError, OSError):
            return None
        return [base / f"shard-{i}" for i in range(count)]
    found = sorted(base.glob("shard-*"), key=lambda p: p.name)
    idx = sorted(int(p.name[6:]) for p in found if p.name[6:].isdigit())
    if idx and idx == list(range(len(idx))) and not store_file(base).exists():
        return [base / f"shard-{i}" for i in idx]
    return None


def user_store(store: str, user_id: str) -> str:
    """The store holding ``user_id``: ``store`` itself, or its shard for a sharded store."""
    from memoryos_gpu.ingest import shard_of

    if is_url(store):
        return store
    dirs = shard_dirs(store) if not store_file(store).exists() else None
    if dirs:
        return str(dirs[shard_of(user_id, len(dirs))])
    return store


def _require_store(store: str) -> None:
    if is_url(store):  # opening it says whether the server and database are there
        return
    if not store_file(store).exists():
        raise CLIError(
            f"no store at {store} (create one with: memoryos-gpu ingest FILE --store {store})"
        )


def _open_store(store: str, *, writer: bool) -> Any:
    """The store itself, no engine. ``writer=False`` for the commands that only read: they do
    not claim the store, so they work beside a running engine (``serve``, ``ingest``)."""
    from memoryos_gpu.store import open_store

    _require_store(store)
    return open_store(store, writer=writer)


# ============================================================================ error handling
def handle_errors(fn: Callable) -> Callable:
    """Turn the package's exceptions into ``error: ...`` messages and exit codes."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from memoryos_gpu.errors import MemoryOSError, UnknownUserError

        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except UnknownUserError as exc:
            raise CLIError(str(exc)) from None
        except MemoryOSError as exc:
            raise CLIError(str(exc)) from None
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            raise CLIError(str(exc)) from None

    return wrapper


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, ensure_ascii=False, default=_json_default))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    return str(obj)


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    try:
        return datetime.fromtimestamp(float(ts), UTC).isoformat().replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return None


# ============================================================================ the group
HELP = """\
MemoryOS for many users: short-term, mid-term and long-term personal memory for LLM agents,
batched across users on CPU or GPU.

\b
Typical session:
  memoryos-gpu ingest chats.jsonl --store mem            # load chat logs (JSONL, LoCoMo,
                                                         #   ShareGPT, OpenAI; .gz ok)
  memoryos-gpu retrieve --store mem --user alice "where does she live?"
  memoryos-gpu profile  --store mem --user alice
  memoryos-gpu chat     --store mem --user alice --llm-mode llm   # needs an LLM backend
  memoryos-gpu stats    --store mem
  memoryos-gpu serve    --store mem --port 8000 --api-keys keys.txt
  memoryos-gpu mcp      --config config.json              # MCP server (BAI-LAB config.json)

\b
Engine options (--store, --config, --device, --preset, --llm-*, --embedding-*) are accepted
before or after the subcommand; precedence: flag > environment > --config file > default.
Set MEMORYOS_GPU_EMBEDDER=hashing for a model-free test embedder. See docs/cli.md and
docs/embeddings.md (--embedder onnx: CPU-fast; openai: an embeddings server).
"""


@click.group(help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memoryos-gpu", prog_name="memoryos-gpu")
@engine_options
@click.pass_context
def cli(ctx: click.Context, **kwargs: Any) -> None:
    ctx.obj = _pop_options(kwargs)


# ============================================================================ ingest
@cli.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMAT_CHOICES),
    default="auto",
    show_default=True,
    help="Input format (auto: detected per file from its first records).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the report as one JSON object "
    "(the last line of stdout); the summary table goes to stderr.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1),
    default=512,
    show_default=True,
    help="Pages per engine batch (across users).",
)
@click.option(
    "--rejects",
    "rejects_path",
    metavar="FILE",
    help="Where rejected records go, one JSON per line [default: STORE/rejects.jsonl].",
)
@click.option(
    "--shard",
    metavar="I/N",
    help="Only ingest the users of shard I of N (stable blake2b hash of the user id; "
    "I from 0). Give every shard its own --store.",
)
@click.option(
    "--workers",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Run N processes on this machine, shard i into STORE/shard-i; reports merged.",
)
@click.option(
    "--process",
    type=click.Choice(["auto", "batch", "defer"]),
    default="auto",
    show_default=True,
    help="When derived work (chain, segments, promotion) runs: auto/batch: with each "
    "batch; defer: later (pending in the store, run when the store is next opened).",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Live progress on stderr [default: when stderr is a terminal].",
)
@click.option(
    "--prefetch/--no-prefetch",
    default=None,
    hidden=True,
    help="Embed the next batch while the current one is processed.",
)
@click.option(
    "--ray",
    "use_ray",
    is_flag=True,
    help="Run on Ray: Ray Data reads and partitions the logs by user hash onto one shard actor "
    "per shard (a GPU each when the cluster has them); local Ray unless $RAY_ADDRESS is set. "
    "Needs `pip install 'memoryos-gpu[ray]'`.",
)
@click.option(
    "--shards",
    type=click.IntRange(1),
    help="Shards for --ray (STORE/shard-I each, or one PostgreSQL URL) [default: the store's "
    "shard count, else 2].",
)
@click.option("--summary/--no-summary", default=True, hidden=True)
@engine_options
@click.pass_context
@handle_errors
def ingest(
    ctx: click.Context,
    files: tuple[str, ...],
    fmt: str,
    as_json: bool,
    batch_size: int,
    rejects_path: str | None,
    shard: str | None,
    workers: int,
    process: str,
    progress: bool | None,
    prefetch: bool | None,
    use_ray: bool,
    shards: int | None,
    summary: bool,
    **kwargs: Any,
) -> None:
    """Load chat logs into the store: streamed, batched across users, resumable.

    Re-running the same input skips what was already accepted (each record has a stable
    source key), so an interrupted run (Ctrl-C: finishes the batch in flight, exit 130) is
    resumed by running it again. Malformed records are reported (file:line: reason) and
    written to the rejects file; the run continues and exits with 3.

    One process writes a store at a time: ingesting into a store that a running engine
    holds (e.g. `serve`) is refused, naming that process (exit 1); send the pages to its
    server instead (POST /v1/pages) or stop it first.

    \b
    Exit codes: 0 all accepted or already present, 3 some records rejected,
    130 interrupted, 2 usage error, 1 runtime error.
    """
    from memoryos_gpu.formats import FormatError
    from memoryos_gpu.ingest import Shard, resolve_formats, store_dir
    from memoryos_gpu.ingest import ingest as run_ingest

    o = _options(ctx, kwargs)
    cfg = build_config(o)
    try:
        formats = resolve_formats(files, fmt)
    except FormatError as exc:
        raise UsageFailure(f"{exc} (use --format to choose one)") from None
    try:
        shard_obj = Shard.parse(shard) if shard else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shard") from None
    if shard_obj is not None and workers > 1:
        raise UsageFailure("give --shard or --workers, not both")
    if progress is None:
        progress = sys.stderr.isatty()
    if use_ray:
        if shard_obj is not None or workers > 1:
            raise UsageFailure("--ray shards by itself: give --shards N, not --shard/--workers")
        report = _ingest_ray(
            list(formats), cfg, shards, fmt=fmt, batch_size=batch_size, rejects_path=rejects_path
        )
    elif workers > 1:
        report = _ingest_workers(
            list(files),
            o,
            cfg.store,
            workers,
            fmt=fmt,
            batch_size=batch_size,
            rejects_path=rejects_path,
            process=process,
            progress=progress,
        )
    else:
        rejects = rejects_path or (
            None
            if cfg.store == ":memory:" or is_url(cfg.store)
            else str(store_dir(cfg.store) / "rejects.jsonl")
        )
        engine = make_engine(cfg)
        try:
            rep = run_ingest(
                list(formats),
                engine,
                fmt=fmt,
                batch_size=batch_size,
                rejects_path=rejects,
                shard=shard_obj,
                progress=progress,
                process=process,
                prefetch=prefetch,
                handle_sigint=True,
            )
        finally:
            engine.close()
        report = rep.to_dict()
    if summary:
        _print_ingest_summary(report, err=as_json)
    if as_json:
        click.echo(json.dumps(report, ensure_ascii=False, default=_json_default))
    ctx.exit(int(report["exit_code"]))


def _ray_shards(store: str, shards: int | None) -> int:
    """--shards, else the count the store was sharded with, else 2."""
    if shards:
        return shards
    dirs = shard_dirs(store) if "://" not in store else None
    return len(dirs) if dirs else 2


def _ingest_ray(
    files: list[str],
    cfg: Any,
    shards: int | None,
    *,
    fmt: str,
    batch_size: int,
    rejects_path: str | None,
) -> dict[str, Any]:
    """``ingest --ray``: memoryos_gpu.distributed.ray_ingest (Ray Data + shard actors)."""
    from memoryos_gpu.distributed.ray_common import RayUnavailableError

    try:
        from memoryos_gpu.distributed.ray_ingest import default_rejects_path, ingest_ray

        _quiet_model_loading()
        return ingest_ray(
            files,
            cfg,
            _ray_shards(cfg.store, shards),
            fmt=fmt,
            batch_size=batch_size,
            rejects_path=rejects_path or default_rejects_path(cfg.store),
        )
    except RayUnavailableError as exc:
        raise CLIError(str(exc)) from None
    except ValueError as exc:  # store layout problems
        raise UsageFailure(str(exc)) from None


def _print_ingest_summary(r: dict[str, Any], *, err: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ingest summary", show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    status = (
        "interrupted (resume by running the same command again)" if r["interrupted"] else "done"
    )
    rows = [
        ("status", status),
        ("accepted pages", f"{r['accepted']:,}"),
        ("already present (skipped)", f"{r['skipped']:,}"),
        ("rejected", f"{r['rejected']:,}"),
        ("users", f"{r['users']:,}"),
        ("elapsed", f"{r['elapsed_s']:.1f} s"),
        ("throughput", f"{r['pages_per_s']:,.1f} pages/s"),
        ("LLM calls", f"{r['llm_calls']:,}"),
        ("derived work pending", f"{r['pending']:,}"),
        ("store", str(r.get("store"))),
    ]
    if r.get("shard"):
        rows.append(("shard", r["shard"]))
    if r.get("other_shards"):
        rows.append(("records of other shards", f"{r['other_shards']:,}"))
    if r["rejected"]:
        rows.append(("rejects file", str(r.get("rejects_path"))))
        for reason, n in list(r.get("reject_reasons", {}).items())[:5]:
            rows.append((f"  {n} x", reason))
    for name, value in rows:
        table.add_row(name, value)
    for s in r.get("shards", []):
        table.add_row(
            f"  shard {s.get('shard')}",
            f"{s.get('accepted', 0):,} accepted, {s.get('skipped', 0):,} present, "
            f"{s.get('rejected', 0):,} rejected, {s.get('users', 0):,} users, "
            f"{s.get('pages_per_s', 0):,.1f} pages/s, exit {s.get('exit_code')}",
        )
    Console(stderr=err, soft_wrap=True).print(table)


def _ingest_workers(
    files: list[str],
    o: EngineOptions,
    store: str,
    workers: int,
    *,
    fmt: str,
    batch_size: int,
    rejects_path: str | None,
    process: str,
    progress: bool,
) -> dict[str, Any]:
    """N processes, process i ingesting shard i/N into STORE/shard-i; their reports merged."""
    from memoryos_gpu import ops

    if is_url(store):
        raise UsageFailure(
            "--workers writes one SQLite store per worker; it does not take a PostgreSQL --store"
        )
    base = Path(store)
    if store == ":memory:" or base.suffix in (".sqlite", ".sqlite3", ".db"):
        raise UsageFailure("--workers needs --store DIR (a directory: one store per shard)")
    if store_file(base).exists():
        raise UsageFailure(f"{base} holds an unsharded store; use a new --store DIR for --workers")
    manifest = base / SHARDS_FILE
    if manifest.exists():
        try:
            count = int(json.loads(manifest.read_text())["count"])
        except (ValueError, KeyError, TypeError):
            count = -1
        if count != workers:
            raise UsageFailure(
                f"{base} was ingested with --workers {count}; users are sharded by count, so "
                f"re-run with --workers {count} (or use a new --store)"
            )
    base.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"count": workers, "hash": "blake2b-64(user_id) mod count"}))

    env = dict(os.environ)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, (cpus or 1) // workers))
    env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("MKL_NUM_THREADS", threads)
    try:
        gpus = int(ops.build_info().get("cuda_device_count", 0))
    except Exception:
        gpus = 0
    procs: list[subprocess.Popen] = []
    t0 = time.perf_counter()
    for i in range(workers):
        cmd = [
            sys.executable,
            "-m",
            "memoryos_gpu",
            "ingest",
            *files,
            "--store",
            str(base / f"shard-{i}"),
            "--shard",
            f"{i}/{workers}",
            "--format",
            fmt,
            "--batch-size",
            str(batch_size),
            "--process",
            process,
            "--json",
            "--no-progress",
            "--no-summary",
            *o.argv(),
        ]
        child_env = dict(env)
        if o.llm_api_key:
            child_env[ENV_LLM_API_KEY] = o.llm_api_key
        if gpus > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
            child_env["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
        # own session: a terminal Ctrl-C reaches only this process, which forwards one SIGINT
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, env=child_env, start_new_session=True)
        )

    interrupted = threading.Event()

    def forward(signum: int, frame: Any) -> None:
        if interrupted.is_set():
            for p in procs:
                if p.poll() is None:
                    p.kill()
            raise KeyboardInterrupt
        interrupted.set()
        click.echo(
            "interrupted: asking the shard processes to finish their batch "
            "(Ctrl-C again to kill them)",
            err=True,
        )
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)

    old = signal.signal(signal.SIGINT, forward)
    outputs: list[bytes] = [b""] * workers
    try:
        readers = []
        for i, p in enumerate(procs):

            def read(i: int = i, p: subprocess.Popen = p) -> None:
                outputs[i] = p.stdout.read() if p.stdout else b""

            t = threading.Thread(target=read, daemon=True)
            t.start()
            readers.append(t)
        status = None
        if progress:
            from rich.console import Console

            status = Console(stderr=True).status(f"ingesting with {workers} shard processes")
            status.start()
        try:
            while any(p.poll() is None for p in procs):
                if status is not None:
                    done = sum(p.poll() is not None for p in procs)
                    status.update(
                        f"ingesting with {workers} shard processes: {done} done, "
                        f"{time.perf_counter() - t0:.0f} s"
                    )
                time.sleep(0.2)
        finally:
            if status is not None:
                status.stop()
        for t in readers:
            t.join()
    finally:
        signal.signal(signal.SIGINT, old)

    shards: list[dict[str, Any]] = []
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        lines = [ln for ln in out.decode("utf-8", "replace").splitlines() if ln.strip()]
        try:
            rep = json.loads(lines[-1])
        except (IndexError, ValueError):
            raise CLIError(
                f"shard {i}/{workers} failed (exit {p.returncode}) without a report; "
                "see its messages above"
            ) from None
        shards.append(rep)
    elapsed = time.perf_counter() - t0

    merged_rejects = Path(rejects_path) if rejects_path else base / "rejects.jsonl"
    merged_rejects.parent.mkdir(parents=True, exist_ok=True)
    with open(merged_rejects, "w", encoding="utf-8") as out_f:
        for rep in shards:
            path = rep.get("rejects_path")
            if path and Path(path).is_file():
                out_f.write(Path(path).read_text(encoding="utf-8"))
    keys = (
        "accepted",
        "rejected",
        "skipped",
        "users",
        "records",
        "llm_calls",
        "pending",
        "batches",
    )
    merged: dict[str, Any] = {k: sum(int(r.get(k, 0)) for r in shards) for k in keys}
    reasons: dict[str, int] = {}
    for r in shards:
        for k, v in r.get("reject_reasons", {}).items():
            reasons[k] = reasons.get(k, 0) + v
    interrupted_any = interrupted.is_set() or any(r.get("interrupted") for r in shards)
    merged.update(
        pages_per_s=merged["accepted"] / elapsed if elapsed else 0.0,
        elapsed_s=elapsed,
        interrupted=interrupted_any,
        workers=workers,
        store=str(base),
        rejects_path=str(merged_rejects),
        reject_reasons=dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        files=files,
        formats=shards[0].get("formats", {}) if shards else {},
        peak_rss_mb=max((r.get("peak_rss_mb", 0.0) for r in shards), default=0.0),
        shards=shards,
    )
    if interrupted_any:
        merged["exit_code"] = EXIT_INTERRUPTED
    elif any(r.get("exit_code") not in (EXIT_OK, EXIT_REJECTED) for r in shards):
        merged["exit_code"] = EXIT_ERROR
    else:
        merged["exit_code"] = EXIT_REJECTED if merged["rejected"] else EXIT_OK
    return merged


# ============================================================================ retrieve
def _page_json(p: Any) -> dict[str, Any]:
    return {
        "page_id": p.page_id,
        "text": f"User: {p.user_input}\nAssistant: {p.agent_response}",
        "user_input": p.user_input,
        "agent_response": p.agent_response,
        "timestamp": p.timestamp,
        "time": _iso(p.timestamp),
        "score": p.score,
        "tier": p.tier,
        "meta": p.meta,
        "extra": p.extra,
    }


def retrieval_json(r: Any) -> dict[str, Any]:
    """A :class:`~memoryos_gpu.types.Retrieval` as the ``retrieve --json`` object."""
    return {
        "user_id": r.user_id,
        "query": r.query,
        "pages": [_page_json(p) for p in r.all_pages()],
        "profile": r.profile,
        "knowledge": {
            "user": [
                {"entry_id": e.entry_id, "text": e.text, "score": e.score} for e in r.user_knowledge
            ],
            "assistant": [
                {"entry_id": e.entry_id, "text": e.text, "score": e.score}
                for e in r.assistant_knowledge
            ],
        },
        "retrieval_tokens": r.retrieval_tokens,
    }


def _print_retrieval(r: Any) -> None:
    from rich.console import Console
    from rich.markup import escape

    c = Console(soft_wrap=True)
    c.print(
        f"[bold]user[/] {escape(r.user_id)}  [bold]query[/] {escape(r.query)}  "
        f"(~{r.retrieval_tokens} tokens of context)"
    )
    if r.profile:
        c.print("[bold]profile[/]")
        for k, v in r.profile.items():
            c.print(f"  {escape(str(k))}: {escape(str(v))}")
    for title, pages in (
        ("mid-term pages (best first; score: cosine and BM25 standardised, summed)", r.pages),
        ("short-term memory (oldest first)", r.stm),
    ):
        c.print(f"[bold]{title}[/] ({len(pages)})")
        for p in pages:
            score = f"{p.score:.3f} " if p.score is not None else ""
            c.print(f"  [dim]{score}{_iso(p.timestamp) or ''}[/]")
            c.print(f"    User: {escape(p.user_input)}")
            if p.agent_response:
                c.print(f"    Assistant: {escape(p.agent_response)}")
            if p.meta:
                c.print(f"    [dim]chain: {escape(p.meta)}[/]")
    for title, entries in (
        ("user knowledge", r.user_knowledge),
        ("assistant knowledge", r.assistant_knowledge),
    ):
        if entries:
            c.print(f"[bold]{title}[/]")
            for e in entries:
                c.print(f"  - {escape(e.text)}")


@cli.command()
@click.argument("query")
@click.option("--user", "user_id", required=True, help="The user whose memory is searched.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: pages, profile, knowledge.")
@click.option("--top-pages", type=click.IntRange(1), help="Mid-term pages to return (k).")
@click.option("--top-segments", type=click.IntRange(1), help="Segments searched (m).")
@click.option(
    "--no-heat",
    is_flag=True,
    help="Do not count this retrieval in segment heat "
    "(by default a retrieval visits its segments, as in the paper).",
)
@engine_options
@click.pass_context
@handle_errors
def retrieve(
    ctx: click.Context,
    query: str,
    user_id: str,
    as_json: bool,
    top_pages: int | None,
    top_segments: int | None,
    no_heat: bool,
    **kwargs: Any,
) -> None:
    """Show what memory retrieves for QUERY: short-term pages, the best mid-term pages,
    the user's profile and knowledge."""
    o = _options(ctx, kwargs)
    store = user_store(resolve_store(o), user_id)
    _require_store(store)
    engine = make_engine(build_config(o, store=store))
    try:
        r = engine.retrieve_many(
            [(user_id, query)],
            top_pages=top_pages,
            top_segments=top_segments,
            update_heat=not no_heat,
        )[0]
    finally:
        engine.close()
    if as_json:
        _echo_json(retrieval_json(r))
    else:
        _print_retrieval(r)


# ============================================================================ chat
@cli.command()
@click.option("--user", "user_id", required=True, help="Who is chatting (their memory is used).")
@click.option(
    "--message",
    "-m",
    "messages",
    multiple=True,
    help="Send this message and print the answer instead of an interactive session (repeatable).",
)
@click.option("--show-memory", is_flag=True, help="Print the retrieved context before answers.")
@engine_options
@click.pass_context
@handle_errors
def chat(
    ctx: click.Context, user_id: str, messages: tuple[str, ...], show_memory: bool, **kwargs: Any
) -> None:
    """Chat with memory: each answer uses the user's retrieved memory, and each exchange is
    remembered. Needs an LLM backend (--llm-mode llm). Type /quit or Ctrl-D to leave."""
    o = _options(ctx, kwargs)
    store = user_store(resolve_store(o), user_id)
    cfg = build_config(o, store=store)
    if cfg.llm.mode != "llm":
        click.echo(_LLM_HELP, err=True)
        ctx.exit(EXIT_USAGE)
    engine = make_engine(cfg)
    try:

        def answer(text: str) -> None:
            text_out, error, retrieval = _respond(engine, user_id, text)
            if show_memory:
                n = len(retrieval.all_pages()) if retrieval is not None else 0
                tokens = retrieval.retrieval_tokens if retrieval is not None else 0
                click.echo(click.style(f"[memory: {n} pages, ~{tokens} tokens]", dim=True))
            if error:
                click.echo(f"error: the LLM failed: {error}", err=True)
            click.echo(f"assistant> {text_out}")

        if messages:
            for m in messages:
                answer(m)
            return
        click.echo(f"chatting as {user_id} ({cfg.llm.backend}); /quit or Ctrl-D to leave", err=True)
        while True:
            try:
                text = input("you> ")
            except (EOFError, KeyboardInterrupt):
                click.echo("", err=True)
                break
            if text.strip() in ("/quit", "/exit"):
                break
            if text.strip():
                answer(text)
    finally:
        engine.close()


def _respond(engine: Any, user_id: str, text: str) -> tuple[str, str | None, Any]:
    """``engine.respond``; a user with no memory yet (which ``respond`` refuses) gets an answer
    from the same response prompt with empty memory, and the exchange is remembered."""
    if user_id in engine.users():
        r = engine.respond(user_id, text)
        return r.text, r.error, r.retrieval
    from memoryos_gpu import prompts
    from memoryos_gpu.types import PageInput

    res = engine.stages.respond([prompts.response(text, [], [], {}, [], [], None)])[0]
    engine.add_many([PageInput(user_id, text, res.text or "")])
    return res.text or "", res.error, None


# ============================================================================ profile / stats
@cli.command()
@click.option("--user", "user_id", required=True)
@click.option("--json", "as_json", is_flag=True)
@engine_options
@click.pass_context
@handle_errors
def profile(ctx: click.Context, user_id: str, as_json: bool, **kwargs: Any) -> None:
    """The user's long-term memory: profile traits, user knowledge, assistant knowledge."""
    o = _options(ctx, kwargs)
    st = _open_store(user_store(resolve_store(o), user_id), writer=False)
    try:
        row = st.user_row(user_id)
        if row is None:
            raise CLIError(f"unknown user {user_id!r}")
        data = {
            "user_id": user_id,
            "assistant_id": row["assistant_id"],
            "profile": row["profile"],
            "knowledge": {
                "user": st.owner_knowledge("user", user_id),
                "assistant": st.owner_knowledge("assistant", row["assistant_id"]),
            },
        }
    finally:
        st.close()
    if as_json:
        _echo_json(data)
        return
    click.echo(f"user {user_id} (assistant {data['assistant_id']})")
    click.echo("profile:" + ("" if data["profile"] else " (empty)"))
    for k, v in data["profile"].items():
        click.echo(f"  {k}: {v}")
    for kind in ("user", "assistant"):
        entries = data["knowledge"][kind]
        click.echo(f"{kind} knowledge ({len(entries)}):")
        for e in entries:
            click.echo(f"  - {e.get('text', e)}")


def _store_stats(store: str) -> dict[str, Any]:
    st = _open_store(store, writer=False)
    try:
        return {
            "store": st.path if is_url(store) else str(store_file(store)),
            "bytes": st.size_bytes() if is_url(store) else store_file(store).stat().st_size,
            "embedding_model": st.get_meta("embedding_model"),
            "schema_version": st.get_meta("schema_version"),
            "counts": st.counts(),
        }
    finally:
        st.close()


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@engine_options
@click.pass_context
@handle_errors
def stats(ctx: click.Context, as_json: bool, **kwargs: Any) -> None:
    """What the store holds: users, pages per tier, segments, knowledge, pending work."""
    o = _options(ctx, kwargs)
    store = resolve_store(o)
    dirs = shard_dirs(store) if not store_file(store).exists() else None
    if dirs:
        shards = [_store_stats(str(d)) for d in dirs if store_file(d).exists()]
        totals: dict[str, int] = {}
        for s in shards:
            for k, v in s["counts"].items():
                totals[k] = totals.get(k, 0) + v
        data = {
            "store": store,
            "shards": shards,
            "counts": totals,
            "bytes": sum(s["bytes"] for s in shards),
        }
    else:
        data = _store_stats(store)
    c = data["counts"]
    data["pages"] = sum(v for k, v in c.items() if k.startswith("pages_"))
    data["users"] = c.get("users", 0)
    if as_json:
        _echo_json(data)
        return
    click.echo(
        f"store        {data['store']} ({data['bytes'] / 2**20:.1f} MiB"
        + (f", {len(data['shards'])} shards)" if "shards" in data else ")")
    )
    if "embedding_model" in data:
        click.echo(f"embeddings   {data['embedding_model']}")
    click.echo(f"users        {data['users']:,}")
    click.echo(
        f"pages        {data['pages']:,} ("
        + ", ".join(f"{k[6:]} {v:,}" for k, v in sorted(c.items()) if k.startswith("pages_"))
        + ")"
    )
    for key in ("segments", "knowledge_live", "assistants", "pending"):
        click.echo(f"{key:<12} {c.get(key, 0):,}")


# ============================================================================ export / delete
@cli.command()
@click.option("--user", "user_id", required=True)
@click.option("--out", "out_path", metavar="FILE", help="Write here instead of stdout.")
@engine_options
@click.pass_context
@handle_errors
def export(ctx: click.Context, user_id: str, out_path: str | None, **kwargs: Any) -> None:
    """Everything held about a user (pages, segments, profile, knowledge, audit) as JSON."""
    o = _options(ctx, kwargs)
    st = _open_store(user_store(resolve_store(o), user_id), writer=False)
    try:
        data = st.export_user(user_id)
        if data is None:
            raise CLIError(f"unknown user {user_id!r}")
        data["assistant_knowledge"] = st.owner_knowledge("assistant", data["user"]["assistant_id"])
    finally:
        st.close()
    text = json.dumps(data, ensure_ascii=False, indent=2, default=_json_default)
    if out_path:
        Path(out_path).write_text(text + "\n", encoding="utf-8")
        click.echo(f"exported {user_id}: {len(data['pages'])} pages -> {out_path}", err=True)
    else:
        click.echo(text)


def _forget_on_other_shards(store: str, user_id: str, texts: list[str]) -> None:
    """A sharded store directory: the assistant facts the user's pages taught, held by the
    assistants' owner shards and copied to every shard, go from every shard's store too, and
    the other shards' saved keyword statistics un-count the user's ``texts``
    (``distributed/sharded_forget.py``)."""
    from memoryos_gpu.distributed.sharded_forget import forget_in_stores
    from memoryos_gpu.distributed.sharding import ShardMap

    dirs = None if is_url(store) or store_file(store).exists() else shard_dirs(store)
    if not dirs:
        return
    stores = []
    try:
        for d in dirs:
            stores.append(_open_store(str(d), writer=True))
        forget_in_stores(stores, ShardMap(len(dirs)), user_id, texts)
    finally:
        for st in stores:
            st.close()


@cli.command()
@click.option("--user", "user_id", required=True)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@engine_options
@click.pass_context
@handle_errors
def delete(ctx: click.Context, user_id: str, yes: bool, **kwargs: Any) -> None:
    """Delete every row held about a user (pages, segments, knowledge, pending work, audit) and
    what was derived from the user's pages (the assistant's facts learned from them, the saved
    keyword statistics; on a sharded store directory, on every shard); the audit keeps the
    deletion, without content. Refused while another process writes the store (a server:
    delete through its HTTP API)."""
    o = _options(ctx, kwargs)
    store = resolve_store(o)
    st = _open_store(user_store(store, user_id), writer=True)
    try:
        rows = st.rows_about(user_id)
        if st.user_row(user_id) is None and not rows:
            raise CLIError(f"unknown user {user_id!r}")
        if not yes:
            click.confirm(f"delete user {user_id!r} ({rows:,} rows)?", abort=True, err=True)
        texts = [
            t
            for (t,) in st.query(
                "SELECT user_input || ' ' || agent_response FROM pages WHERE user_id = ?",
                (user_id,),
            )
        ]
        st.delete_user(user_id)
        left = st.rows_about(user_id)
    finally:
        st.close()
    _forget_on_other_shards(store, user_id, texts)
    click.echo(
        f"deleted user {user_id}: {rows:,} rows removed" + (f" ({left} left!)" if left else "")
    )
    if left:
        ctx.exit(EXIT_ERROR)


@cli.command()
@click.option(
    "--encrypt",
    is_flag=True,
    help="Encrypt a store that is not encrypted yet, under $MEMORYOS_GPU_KEY (else prompted). "
    "One way: there is no decrypt.",
)
@engine_options
@click.pass_context
@handle_errors
def rekey(ctx: click.Context, encrypt: bool, **kwargs: Any) -> None:
    """Change an encrypted store's key: the current key from $MEMORYOS_GPU_KEY, the new one from
    $MEMORYOS_GPU_NEW_KEY (each prompted for, hidden, when unset). Every shard of a sharded
    store is rewritten; refused while another process writes it. See docs/storage.md."""
    from pydantic import SecretStr

    from memoryos_gpu.store.encryption import ENV_NEW_KEY, env_key, rekey_all

    store = resolve_store(_options(ctx, kwargs))
    if is_url(store):
        raise CLIError("rekey applies to SQLite stores (a PostgreSQL server encrypts by itself)")
    files = [store_file(d) for d in shard_dirs(store) or [store]]
    for f in files:
        _require_store(str(f))

    def ask(what: str, confirm: bool = False) -> SecretStr:
        return SecretStr(click.prompt(what, hide_input=True, confirmation_prompt=confirm, err=True))

    old = None if encrypt else env_key() or ask("current key")
    if encrypt:
        new = env_key()
    else:
        given = os.environ.get(ENV_NEW_KEY)
        new = SecretStr(given) if given else None
    done = rekey_all(list(files), old, new or ask("new key", confirm=True))
    verb = "encrypted" if encrypt else "re-keyed"
    click.echo(f"{verb} {done} of {len(files)} store file(s) under {store}")
    if not encrypt:
        click.echo(f"from now on open it with the new key (${ENV_NEW_KEY} -> $MEMORYOS_GPU_KEY)")


# ============================================================================ serve
@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--api-keys",
    metavar="FILE",
    type=click.Path(exists=True, dir_okay=False),
    help="Key file: one `KEY TENANT` per line (`KEY *`: an admin key, server-wide /v1/stats only).",
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
    help="Shards for --ray [default: the store's shard count, else 2].",
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
    **kwargs: Any,
) -> None:
    """Serve the HTTP API (memoryos_gpu.server) over the store until Ctrl-C.

    With --workers N (the default on a multi-core box), N HTTP processes parse, authenticate
    and validate requests and the engine process batches them all; --engines K runs K engine
    processes, each owning a shard of the users, for boxes where one is the cap
    (docs/server.md)."""
    import inspect

    o = _options(ctx, kwargs)
    if use_ray:
        if workers or engines:
            raise UsageFailure(
                "--workers and --engines are for the single-box server; --ray has its own router"
            )
        _serve_ray(o, host, port, api_keys, shards)
        return
    try:
        from memoryos_gpu.server.app import run
    except ImportError as exc:
        raise CLIError(
            "the HTTP server is not available: memoryos_gpu.server.app could not be imported "
            f"({exc}): pip install 'memoryos-gpu[server]' (FastAPI, uvicorn, mcp)."
        ) from None
    store = resolve_store(o)
    cfg = build_config(o, store=store)
    shards = _store_shards(store)
    if engines and shards > 1 and engines != shards:  # users are placed by hash mod count
        raise UsageFailure(f"{store} holds {shards} shards: serve it with --engines {shards}")
    engines = engines or shards
    if workers is None:
        from memoryos_gpu.server.workers import default_workers

        # several engines are reached through workers: at least one, even on a small box
        workers = max(default_workers(engines), 1 if engines > 1 else 0)
    if engines > 1 and not workers:
        raise UsageFailure(
            f"--engines {engines} needs --workers >= 1 (the HTTP workers route by shard)"
        )
    candidates = {
        "store": store,
        "host": host,
        "port": port,
        "api_keys": api_keys,
        "config": cfg,
        "workers": workers,
        **({"engines": engines} if engines > 1 else {}),
    }
    params = inspect.signature(run).parameters
    takes_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    call = {k: v for k, v in candidates.items() if k in params or takes_kw}
    _quiet_model_loading()
    try:
        run(**call)
    except ValueError as exc:  # a store laid out for another shard count, ...
        raise UsageFailure(str(exc)) from None


def _store_shards(store: str) -> int:
    """The shard count a store directory was written with (``ingest --workers``), else 1."""
    dirs = shard_dirs(store)
    return len(dirs) if dirs else 1


def _serve_ray(
    o: EngineOptions, host: str, port: int, api_keys: str | None, shards: int | None
) -> None:
    """``serve --ray``: memoryos_gpu.distributed.ray_serve on Ray Serve until Ctrl-C."""
    from memoryos_gpu.distributed.ray_common import RayUnavailableError

    store = resolve_store(o)
    cfg = build_config(o, store=store)
    _quiet_model_loading()
    try:
        from memoryos_gpu.distributed.ray_serve import run as run_ray

        run_ray(cfg, _ray_shards(store, shards), host=host, port=port, api_keys=api_keys)
    except RayUnavailableError as exc:
        raise CLIError(str(exc)) from None
    except ValueError as exc:
        raise UsageFailure(str(exc)) from None


# ============================================================================ mcp
@cli.command(
    name="mcp",
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def mcp_command(args: tuple[str, ...]) -> None:
    """Serve MCP (python -m memoryos_gpu.server.mcp_server); its own flags follow `mcp`:
    --config config.json (the reference's) or engine.toml, --store, --user-id, --transport
    stdio|streamable-http, --stateless, --json-response, ... (`memoryos-gpu mcp --help`)."""
    from memoryos_gpu.server.mcp_server import main as mcp_main

    mcp_main(list(args), prog="memoryos-gpu mcp")


# ============================================================================ bench
@cli.command()
@click.option("--users", type=click.IntRange(1), default=1000, show_default=True)
@click.option(
    "--slots", type=click.IntRange(1), default=64, show_default=True, help="Live segments per user."
)
@click.option("--pages-per-segment", type=click.IntRange(0), default=2, show_default=True)
@click.option(
    "--batch",
    type=click.IntRange(1),
    default=256,
    show_default=True,
    help="Queries per kernel call (distinct users).",
)
@click.option("--repeat", type=click.IntRange(1), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@engine_options
@click.pass_context
@handle_errors
def bench(
    ctx: click.Context,
    users: int,
    slots: int,
    pages_per_segment: int,
    batch: int,
    repeat: int,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Quick retrieval-kernel benchmark (segment scoring + page top-k) on a synthetic arena.

    The full benchmarks live in the source tree: benchmarks/kernel_speed.py (kernels vs a
    reference-style loop vs torch) and benchmarks/ingest.py (end-to-end ingestion)."""
    import numpy as np

    from memoryos_gpu import ops
    from memoryos_gpu.arena import Arena, ArenaConfig

    o = _options(ctx, kwargs)
    device = o.device or "auto"
    if device == "auto":
        device = "cuda" if ops.build_info()["cuda_usable"] else "cpu"
    rng = np.random.default_rng(0)
    dim, kw_width = 384, 16
    t0 = time.perf_counter()
    arena = Arena(
        ArenaConfig(
            dim=dim,
            segment_slots=slots,
            keyword_width=kw_width,
            device=device,
            initial_users=users,
            initial_blocks=max(1, users * slots * -(-pages_per_segment // 16)),
        )
    )
    arena.add_users(users)
    chunk = max(1, 1_000_000 // slots)
    for start in range(0, users, chunk):
        us = np.arange(start, min(users, start + chunk), dtype=np.int32)
        u, s = np.repeat(us, slots), np.tile(np.arange(slots, dtype=np.int32), us.size)
        emb = rng.standard_normal((u.size, dim), dtype=np.float32)
        kw = np.sort(rng.integers(0, 5000, size=(u.size, kw_width), dtype=np.int32), axis=1)
        kw[:, kw_width // 2 :] = -1
        arena.write_segments(u, s, emb, kw, l_interaction=np.full(u.size, pages_per_segment))
        if pages_per_segment:
            pu, ps = np.repeat(u, pages_per_segment), np.repeat(s, pages_per_segment)
            arena.append_pages(pu, ps, rng.standard_normal((pu.size, dim), dtype=np.float32))
    build_s = time.perf_counter() - t0
    q = rng.standard_normal((batch, dim), dtype=np.float32)
    qu = rng.choice(users, size=batch, replace=batch > users).astype(np.int32)
    qkw = np.sort(rng.integers(0, 5000, size=(batch, 8), dtype=np.int32), axis=1)

    def once() -> None:
        _, chosen = ops.score_segments(arena, q, qu, qkw, 5)
        ops.select_pages(arena, q, qu, chosen, 10)
        if arena.on_cuda:
            import torch

            torch.cuda.synchronize()

    once()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    med = sorted(times)[len(times) // 2]
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    result = {
        "device": device,
        "users": users,
        "segments_per_user": slots,
        "pages_per_segment": pages_per_segment,
        "batch": batch,
        "build_s": round(build_s, 3),
        "median_batch_ms": round(med * 1e3, 3),
        "queries_per_s": round(batch / med, 1),
        "native": ops.build_info(),
        "benchmarks": str(root) if root.is_dir() else None,
    }
    if as_json:
        _echo_json(result)
        return
    click.echo(
        f"{device}: {users:,} users x {slots} segments x {pages_per_segment} pages, "
        f"batch {batch}: {med * 1e3:.2f} ms per batch = {batch / med:,.0f} queries/s "
        "(score segments + top-10 pages)"
    )
    where = root if root.is_dir() else "benchmarks/ in the memoryos-gpu source tree"
    click.echo(f"full benchmarks: {where} (kernel_speed.py, ingest.py)")


# ============================================================================ eval
@cli.command(name="eval")
@click.argument("locomo_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--quick", is_flag=True, help="First conversation, first 40 questions.")
@click.option(
    "--k",
    "ks",
    type=click.IntRange(1),
    multiple=True,
    help="Page budgets (repeatable) [default: 5 10 20].",
)
@click.option("--json", "as_json", is_flag=True)
@engine_options
@click.pass_context
@handle_errors
def evaluate(
    ctx: click.Context,
    locomo_file: str,
    quick: bool,
    ks: tuple[int, ...],
    as_json: bool,
    **kwargs: Any,
) -> None:
    """LoCoMo evidence recall of the engine's retrieval vs BM25 (no LLM needed).

    Each conversation is ingested as one user into an in-memory store (--store is not
    touched); each question is retrieved with heat updates off. Recall@k = fraction of a
    question's evidence turns among the first k pages (mid-term pages by score, then
    short-term pages newest first). Categories 1-4."""
    from memoryos_gpu.eval import evaluate_rankings, load_locomo, run_baselines
    from memoryos_gpu.types import PageInput

    o = _options(ctx, kwargs)
    k_list = sorted(set(ks)) or [5, 10, 20]
    try:
        convs = load_locomo(locomo_file)
    except ValueError as exc:
        raise UsageFailure(f"not a LoCoMo file: {exc}") from None
    if quick:
        convs = convs[:1]
        for c in convs:
            c.questions = c.questions[:40]
    t0 = time.perf_counter()
    engine = make_engine(build_config(o, store=":memory:"))
    try:
        pages = [
            PageInput(
                c.sample_id,
                p.user_input,
                p.agent_response,
                p.timestamp,
                None,
                p.source,
                {"page_index": p.index},
            )
            for c in convs
            for p in c.pages
        ]
        for i in range(0, len(pages), 512):
            engine.add_many(pages[i : i + 512])
        engine.flush()
        ingest_s = time.perf_counter() - t0

        def rank(conv: Any, questions: list[Any]) -> list[list[int]]:
            rets = engine.retrieve_many(
                [(conv.sample_id, q.question) for q in questions],
                top_pages=max(k_list),
                update_heat=False,
            )
            out = []
            for r in rets:
                order = [p.extra.get("page_index") for p in r.pages]
                order += [p.extra.get("page_index") for p in reversed(r.stm)]
                seen: list[int] = []
                for i in order:
                    if isinstance(i, int) and i not in seen:
                        seen.append(i)
                out.append(seen)
            return out

        t1 = time.perf_counter()
        engine_rep = evaluate_rankings(convs, rank, k_list)
        retrieve_s = time.perf_counter() - t1
    finally:
        engine.close()
    bm25_rep = run_baselines(convs, None, k_list)["bm25"]
    any_rep = engine_rep[k_list[0]]
    result = {
        "file": locomo_file,
        "conversations": len(convs),
        "pages": len(pages),
        "questions": any_rep.n,
        "ks": k_list,
        "ingest_s": round(ingest_s, 2),
        "retrieve_s": round(retrieve_s, 2),
        "recall": {
            name: {
                str(k): {
                    "overall": rep[k].overall,
                    "all_hit": rep[k].all_hit,
                    "per_category": {str(c): v for c, v in rep[k].per_category.items()},
                }
                for k in k_list
            }
            for name, rep in (("memoryos", engine_rep), ("bm25", bm25_rep))
        },
    }
    if as_json:
        _echo_json(result)
        return
    click.echo(
        f"{len(convs)} conversations, {len(pages)} pages, {any_rep.n} questions "
        f"(categories 1-4); ingest {ingest_s:.1f} s, retrieval {retrieve_s:.1f} s"
    )
    click.echo("| retrieval | " + " | ".join(f"recall@{k}" for k in k_list) + " |")
    click.echo("| --- |" + " --- |" * len(k_list))
    for name, rep in (("memoryos (engine)", engine_rep), ("bm25", bm25_rep)):
        click.echo(f"| {name} | " + " | ".join(f"{rep[k].overall:.3f}" for k in k_list) + " |")


# ============================================================================ entry point
def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    # The native kernels run OpenMP regions even on tiny inputs; with the default spinning
    # wait policy each costs a scheduler quantum (~10 ms) whenever the CPUs are shared. Must
    # be set before the OpenMP runtime loads (memoryos_gpu._C and torch are imported lazily).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        rv = cli.main(
            args=list(argv) if argv is not None else None,
            prog_name="memoryos-gpu",
            standalone_mode=False,
        )
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return EXIT_ERROR
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_ERROR
    return int(rv) if isinstance(rv, int) else EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The engine options every subcommand takes, the engine configuration they resolve to
(flag > environment > config file > default), and the errors and exit codes the commands
share."""

from __future__ import annotations

import codecs
import functools
import os
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import click

if TYPE_CHECKING:
    from pydantic import SecretStr

ENV_EMBEDDER = "MEMORYOS_GPU_EMBEDDER"
ENV_EMBEDDING_API_KEY = "MEMORYOS_GPU_EMBEDDING_API_KEY"
ENV_STORE = "MEMORYOS_GPU_STORE"
ENV_LLM_API_KEY = "MEMORYOS_GPU_LLM_API_KEY"
DEFAULT_STORE = "./memoryos-store"
STORE_FILE = "memory.sqlite3"
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REJECTED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
FORMAT_CHOICES = ("auto", "jsonl", "locomo", "sharegpt", "openai", "export")
LLM_BACKENDS = ("transformers", "vllm", "openai")
EMBEDDER_KINDS = ("transformers", "onnx", "openai", "hashing")  # = memoryos_gpu.embed's


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
                out += [option_flag(f.name), str(value)]
        return out


def option_flag(name: str) -> str:
    """An :class:`EngineOptions` field's command-line flag (``llm_mode`` -> ``--llm-mode``)."""
    return f"--{name.replace('_', '-')}"


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


def pop_options(kwargs: dict[str, Any]) -> EngineOptions:
    return EngineOptions(**{f.name: kwargs.pop(f.name, None) for f in fields(EngineOptions)})


def options_of(ctx: click.Context, kwargs: dict[str, Any]) -> EngineOptions:
    """Group-level options overridden by the subcommand's."""
    base = ctx.obj if isinstance(ctx.obj, EngineOptions) else EngineOptions()
    return base.merged(pop_options(kwargs))


# ============================================================================ configuration
def read_toml(path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageFailure(f"cannot read config file {path}: {exc}") from None


def resolve_store(o: EngineOptions) -> str:
    """``--store`` > $MEMORYOS_GPU_STORE > config file ``store`` > ./memoryos-store. One that
    is given is taken as given (``:memory:`` from the file too), and a blank one refused: an
    unset variable expanded into it (``--store "$DIR"``) wrote ./memoryos-store, silently, and
    a file's ``store = 5`` was skipped the same way."""
    given = flag_or_env_store(o.store)
    if given is not None:
        return given
    if o.config:
        store = read_toml(o.config).get("store")
        if store is not None:
            if not isinstance(store, str):
                raise UsageFailure(
                    f"{o.config}: store must be a string (a directory, a file path ending "
                    f".sqlite3 or .db, a PostgreSQL URL or :memory:), got {type(store).__name__}"
                )
            return _given_store(store, f"{o.config}: store")
    return DEFAULT_STORE


def flag_or_env_store(flag: str | None) -> str | None:
    """The store named by ``--store``, else by $MEMORYOS_GPU_STORE, checked
    (:func:`_given_store`); None when neither is set. Its own function so that ``mcp``, which
    reads a config.json as well, applies the very rule every other command does: an empty
    ``--store ""`` there fell through to the variable and then to ./memoryos-store."""
    if flag is not None:
        return _given_store(flag, "--store")
    if ENV_STORE in os.environ:
        return _given_store(os.environ[ENV_STORE], f"${ENV_STORE}")
    return None


def _given_store(value: str, where: str) -> str:
    if not value.strip():
        raise UsageFailure(
            f"{where} is empty: give a store directory, a file path ending .sqlite3 or .db, a "
            f"PostgreSQL URL or :memory: (or leave it out for {DEFAULT_STORE})"
        )
    refuse_undecodable(value, where)
    return value


def refuse_undecodable(path: str, where: str) -> None:
    """Refuse a path holding bytes that are not UTF-8 (they reach Python as lone surrogates,
    ``\\udcff``), before anything touches the disk. Why: the store writes its path into its
    lock file and its SQL, which cannot carry them, and the traceback came after the store's
    directory and an empty lock were made."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageFailure(
            f"{where}: the path holds bytes that are not UTF-8 text "
            f"({ascii(path)[1:-1]}); rename it, or give another"
        ) from None


def check_user_id(user_id: str) -> str:
    """``--user``, checked by the rule the engine looks users up by
    (``engine.validation.clean_user_id``: not blank, at most 256 characters, no control
    character or lone surrogate), as a usage error (exit 2) naming the option. Why here: each
    command once met a bad id its own way (retrieve's engine error, exit 1; profile, export
    and delete "unknown user", or a traceback from SQL for a non-UTF-8 byte)."""
    from memoryos_gpu.engine.validation import InvalidInputError, clean_user_id

    try:
        return clean_user_id(user_id)
    except InvalidInputError as exc:
        raise click.BadParameter(_printable(str(exc)), param_hint="'--user'") from None


def _printable(text: str) -> str:
    """``text`` with lone surrogates escaped: a message quoting a non-UTF-8 argument must not
    fail to print."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def embedder_choice(flag: str | None) -> str | None:
    """The embedder a command was asked for: its flag, else ``$MEMORYOS_GPU_EMBEDDER`` (one of
    :data:`EMBEDDER_KINDS`, else a ``ValueError`` naming the variable, which the commands
    and the MCP server report as a bad configuration); None leaves it to the config file or
    the default (every command, and the MCP server)."""
    if flag:
        return flag
    value = os.environ.get(ENV_EMBEDDER)
    if not value:
        return None
    if value not in EMBEDDER_KINDS:
        raise ValueError(
            f"${ENV_EMBEDDER}: {value.strip()[:40]!r} is not an embedder; choose "
            f"{', '.join(EMBEDDER_KINDS)}"
        )
    return value


def build_config(o: EngineOptions, *, store: str | None = None) -> Any:
    """The :class:`~memoryos_gpu.config.EngineConfig` of these options (flag > env > file >
    default; the store key: env > file, :func:`~memoryos_gpu.config.config_key`). ``store``
    overrides the resolved store path (e.g. ``":memory:"``)."""
    from pydantic import ValidationError

    from memoryos_gpu.config import (
        EngineConfig,
        engine_data,
        explain_settings_error,
        merge_settings,
        validate_file_config,
    )
    from memoryos_gpu.embed.factory import check_embedder_settings
    from memoryos_gpu.store.errors import StoreError

    try:
        # the file's tables (its [server] table is serve's: server_settings), the preset
        data = engine_data(read_toml(o.config) if o.config else {}, o.preset)
        data = merge_settings(data, _given_settings(o))
        data["store"] = store if store is not None else resolve_store(o)
        config = validate_file_config(data)  # strictly typed, as config.json
        check_embedder_settings(config)  # a missing --embedding-* is a usage error too
        _warn_of_unused_settings(o, config)
        return config
    except ValidationError as exc:
        problems = explain_settings_error(exc, EngineConfig)  # never a value: keys are secrets
        raise UsageFailure(f"invalid engine configuration{_from_file(o)}: {problems}") from None
    except (ValueError, TypeError) as exc:
        raise UsageFailure(f"invalid engine configuration{_from_file(o)}: {exc}") from None
    except StoreError as exc:  # $MEMORYOS_GPU_KEY set but empty: bad configuration, as a file's
        raise UsageFailure(f"invalid engine configuration: {exc}") from None


def _given_settings(o: EngineOptions) -> dict[str, Any]:
    """The engine settings the flags and environment variables give, as config keys (a
    ``[llm]`` table among them). A flag given empty is kept, for the setting's own check to
    refuse (``--embedding-model ""`` was dropped as "not given", ``--llm-model ""`` refused);
    an empty ``$MEMORYOS_GPU_EMBEDDING_API_KEY`` is an unset variable."""
    llm = {
        key: value
        for key, value in (
            ("mode", o.llm_mode),
            ("backend", o.llm_backend),
            ("model", o.llm_model),
            ("base_url", o.llm_base_url),
            ("api_key", o.llm_api_key),
        )
        if value is not None
    }
    given: dict[str, Any] = {"llm": llm} if llm else {}
    for key, value in (
        ("device", o.device),
        ("embedder", embedder_choice(o.embedder)),
        ("embedding_model", o.embedding_model),
        ("embedding_base_url", o.embedding_base_url),
        ("embedding_dtype", o.embedding_dtype),
        ("embedding_api_key", os.environ.get(ENV_EMBEDDING_API_KEY) or None),
    ):
        if value is not None:
            given[key] = value
    return given


#: The flags that configure an LLM backend, which nothing builds without ``--llm-mode llm``.
_LLM_FLAGS = ("llm_backend", "llm_model", "llm_base_url")
#: The embedding flags each embedder reads (hashing: none; the API key is a variable).
_EMBEDDER_FLAGS = {
    "transformers": ("embedding_model", "embedding_dtype"),
    "onnx": ("embedding_model",),
    "openai": ("embedding_model", "embedding_base_url"),
    "hashing": (),
}


def _warn_of_unused_settings(o: EngineOptions, cfg: Any) -> None:
    """One line on stderr for each group of flags given that the configuration makes no use
    of: LLM flags without ``--llm-mode llm`` (``ingest --llm-backend openai ...`` ran without
    an LLM, exit 0 and 0 LLM calls, saying nothing), and embedding flags the chosen embedder
    does not read (``--embedder hashing --embedding-model foo``). A warning, not an error: a
    script may pass the same flags to every command. The API key is left out (the variable
    ``$MEMORYOS_GPU_LLM_API_KEY`` sets it for every command alike)."""
    llm_flags = [option_flag(n) for n in _LLM_FLAGS if getattr(o, n) is not None]
    if llm_flags and cfg.llm.mode != "llm":
        _warn(f"{', '.join(llm_flags)} have no effect without --llm-mode llm (no LLM is used)")
    read = _EMBEDDER_FLAGS.get(cfg.embedder, ())
    unread = [
        option_flag(n)
        for n in ("embedding_model", "embedding_base_url", "embedding_dtype")
        if getattr(o, n) is not None and n not in read
    ]
    if unread:
        _warn(f"{', '.join(unread)} have no effect with the {cfg.embedder} embedder")
    _warn_of_secrets_in_flags(o)


def _warn_of_secrets_in_flags(o: EngineOptions) -> None:
    """One line when a secret came as a command-line flag (``--llm-api-key``, a password in
    ``--llm-base-url``): the process's command line is readable by every local user (``ps``),
    for as long as it runs -- the server's above all. The variable and the config file are not
    shown there."""
    flags = []
    if o.llm_api_key is not None and _on_command_line("llm_api_key"):
        flags.append("--llm-api-key")
    if o.llm_base_url and urlsplit(o.llm_base_url).password:
        flags.append("a password in --llm-base-url")
    if flags:
        _warn(
            f"{' and '.join(flags)}: the command line is visible to every user of this machine "
            f"(ps); give the key in ${ENV_LLM_API_KEY} or the config file's [llm] api_key"
        )


def _on_command_line(param: str) -> bool:
    """Whether click took ``param`` from the command line (not its environment variable)."""
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if param in ctx.params:
            return ctx.get_parameter_source(param) == click.core.ParameterSource.COMMANDLINE
        ctx = ctx.parent
    return False


_warned: set[str] = set()  # each warning once per process (a command may build twice)


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        click.echo(f"warning: {message}", err=True)


def check_engine_settings(cfg: Any, *, llm: bool = True, device: bool = True) -> None:
    """Refuse, as usage errors (exit 2), the settings an engine would refuse only once its
    store is open: an LLM backend missing its URL or model (``llm``: for a command that
    builds it) and a CUDA device torch does not see here (``device``: False where the
    engines run on other machines, Ray's). Why before: found at the engine's open, they were
    exit 1 and left a new, empty store behind."""
    from memoryos_gpu.config import llm_settings_problem

    problem = llm_settings_problem(cfg.llm) if llm and cfg.llm.mode == "llm" else None
    if problem:
        raise UsageFailure(f"invalid engine configuration: {problem}")
    if device:
        check_device(str(cfg.device))


def check_device(device: str) -> None:
    """Refuse, as a usage error (exit 2), a CUDA device torch does not see here: the rule of
    every command that runs the arena, ``bench`` among them (it exited 1)."""
    problem = device_problem(device)
    if problem:
        raise UsageFailure(f"--device {device}: {problem}; use --device auto or cpu")


def device_problem(device: str) -> str | None:
    """Why the arena cannot run on ``device`` here (a CUDA device torch does not see), else
    None: the one rule of the CLI's ``--device`` and the MCP server's settings."""
    if device.startswith("cuda") and not _cuda_seen():
        return "torch sees no CUDA device here"
    return None


def listen_host_problem(host: str) -> str | None:
    """Why ``host`` cannot be a server's ``--host``, else None. An empty or blank one (say
    ``--host "$HOST"`` with the variable unset) made uvicorn listen on every interface, open to
    the network, where the default listens on this machine only; every interface must be
    asked for by name."""
    if not host.strip():
        return (
            "an empty --host would listen on every interface; give --host 0.0.0.0 (or ::) to "
            "mean that, or leave --host out for 127.0.0.1"
        )
    return None


def _cuda_seen() -> bool:
    """Whether torch sees a CUDA device (the arena's own test, ``arena_backend``)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _from_file(o: EngineOptions) -> str:
    """`` (config file F)`` when a config file was read: an error then says which (a group's and
    a command's ``--config`` may both be given)."""
    return f" (config file {o.config})" if o.config else ""


def server_settings(o: EngineOptions) -> dict[str, Any]:
    """The ``[server]`` table of ``--config`` (``ServerSettings`` fields), checked: a bad one
    is a usage error naming the key, before anything starts."""
    from pydantic import ValidationError

    from memoryos_gpu.config import explain_settings_error, server_table
    from memoryos_gpu.server.settings import ServerSettings

    if not o.config:
        return {}
    try:
        table = server_table(read_toml(o.config))
        ServerSettings(**table)
    except ValidationError as exc:
        problems = explain_settings_error(exc, ServerSettings)
        raise UsageFailure(f"invalid [server] settings in {o.config}: {problems}") from None
    except ValueError as exc:
        raise UsageFailure(f"{o.config}: {exc}") from None
    return table


def store_key(o: EngineOptions) -> SecretStr | None:
    """The key of the store these options name, for the commands that open it without an
    engine (stats, export, profile, delete, rekey): the very key :func:`build_config` gives
    an engine (``config.config_key``: $MEMORYOS_GPU_KEY, else the config file's
    ``encryption_key``), so that no command resolves it in an order of its own."""
    key: SecretStr | None = build_config(o).encryption_key
    return key


def checked_store(o: EngineOptions) -> str:
    """The store of these options, once the whole configuration has been checked: the commands
    that open no engine refuse a bad ``--config`` (exit 2) as the others do."""
    return str(build_config(o).store)


def quiet_model_loading() -> None:
    """No model-loading progress bars or info logs (read by transformers when it loads)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers' GGUF loader draws its own tqdm bar (one step a tensor), which the
    # variables above do not reach; tqdm >= 4.66 reads this one at each bar's creation
    os.environ.setdefault("TQDM_DISABLE", "1")


def make_engine(cfg: Any, *, hold_pending: bool = False, llm: bool | None = None) -> Any:
    """Open an engine (quietly: no model-loading progress bars), its settings checked first
    (:func:`check_engine_settings`). ``hold_pending``: it runs none of the store's pending
    derived work (see ``MemoryEngine``). ``llm`` (default: ``not hold_pending``): whether it
    builds the configured LLM backend. An engine that runs no derived work (``retrieve``'s
    look at memory) never calls one, so it opens in extractive mode: building it took 20 s
    with the bundled model, and failed on LLM settings the command does not use."""
    from memoryos_gpu.engine import MemoryEngine

    from .stores import refuse_non_store

    if llm is None:
        llm = not hold_pending
    check_engine_settings(cfg, llm=llm)
    refuse_non_store(str(cfg.store), cfg.encryption_key)  # before the writer's lock file
    if not llm and cfg.llm.mode != "extractive":
        cfg = cfg.model_copy(update={"llm": cfg.llm.model_copy(update={"mode": "extractive"})})
    quiet_model_loading()
    return MemoryEngine(cfg, hold_pending=hold_pending)


def _setting_errors() -> tuple[type[Exception], ...]:
    """The error types that mean "a setting is wrong" wherever they are raised: the engine's
    refusal of a setting only the store shows wrong (``config.ConfigError``: an
    ``mtm_capacity`` below the store's segment slots), an LLM backend that cannot be built
    from its options (``LLMConfigError``: ``[llm] options = {temprature = 0.5}``) and an
    embedder missing a setting (``EmbedderConfigError``). Why mapped to exit 2: docs/cli.md
    lists a bad config as a usage error; they are raised before the store is created or
    changed. Imported only when an error is being reported (``bench`` imports no model
    code)."""
    from memoryos_gpu.config import ConfigError
    from memoryos_gpu.embed.base import EmbedderConfigError
    from memoryos_gpu.llm.base import LLMConfigError

    return (ConfigError, LLMConfigError, EmbedderConfigError)


def handle_errors(fn: Callable) -> Callable:
    """Turn the package's exceptions into ``error: ...`` messages and exit codes."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from memoryos_gpu.errors import MemoryOSError, UnknownUserError
        from memoryos_gpu.extras import MissingExtra

        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except MissingExtra as exc:  # names the extra to install: one line, not a traceback
            raise CLIError(str(exc)) from None
        except UnknownUserError as exc:
            raise CLIError(str(exc)) from None
        except MemoryOSError as exc:
            if isinstance(exc, _setting_errors()):  # a setting the engine refused: exit 2
                message = f"invalid engine configuration: {_printable(str(exc))}"
                raise UsageFailure(message) from None
            raise CLIError(str(exc)) from None
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            raise CLIError(str(exc)) from None
        except UnicodeEncodeError as exc:  # an argument, or an output's encoding: one line
            raise CLIError(_encode_error_line(exc)) from None
        except BrokenPipeError:  # stdout's reader gone, or another pipe: app.py tells which
            raise
        except OSError as exc:  # a full or read-only disk under a file the command writes
            raise CLIError(_printable(str(exc))) from None
        except Exception as exc:
            line = _sqlite_line(exc)
            if line is None:
                raise
            raise CLIError(line) from None

    return wrapper


def _encode_error_line(exc: UnicodeEncodeError) -> str:
    """One line for a ``UnicodeEncodeError`` no check caught. UTF-8 refuses only a lone
    surrogate, which is what a byte of an argument that is not UTF-8 becomes: that argument's
    line. Any other encoding is an output's: a stdout in GBK or Latin-1 that cannot show a
    character (``main`` makes the console script's stdout lenient; a caller's own stream may
    still be strict). Why not one line for both: an export under ``PYTHONIOENCODING=gbk``
    blamed its arguments, which were fine, and said nothing of the fix."""
    if is_utf(exc.encoding):
        return f"an argument holds bytes that are not UTF-8 text ({_printable(str(exc))})"
    stdout = _same_codec(getattr(sys.stdout, "encoding", None), exc.encoding)
    what = ascii(exc.object[exc.start : min(exc.end, exc.start + 8)])
    return (
        f"{'stdout' if stdout else 'the output'}'s encoding ({exc.encoding}) cannot show "
        f"{what}: set PYTHONIOENCODING=utf-8, or write to a file with --out where the command "
        "has it"
    )


def is_utf(encoding: str) -> bool:
    """Whether ``encoding`` is a UTF codec: one that encodes every character but a lone
    surrogate (an unknown name is not)."""
    try:
        return codecs.lookup(encoding).name.startswith("utf")
    except LookupError:
        return False


def _same_codec(a: str | None, b: str) -> bool:
    """Whether encodings ``a`` and ``b`` name one codec (``GBK``, ``gbk``, ``cp936``...)."""
    try:
        return a is not None and codecs.lookup(a).name == codecs.lookup(b).name
    except LookupError:
        return False


def _sqlite_line(exc: BaseException) -> str | None:
    """One line for an SQLite error that reached a command outside the store's ``query`` (which
    says a damaged file itself: ``store.errors.damaged_error``), else None: SQLite's and
    SQLCipher's errors both carry ``sqlite_errorname``."""
    from memoryos_gpu.store.errors import damaged_error

    name = getattr(exc, "sqlite_errorname", None)
    if name is None:
        return None
    said = damaged_error(exc)
    return str(said) if said is not None else f"store error: {exc} ({name})"

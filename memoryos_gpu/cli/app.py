"""The ``memoryos-gpu`` command group, its subcommands, and the console-script entry point."""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Sequence
from typing import Any

import click

from .admin import delete, export, rekey, stats, users
from .ingest import ingest
from .measure import bench, evaluate
from .memory import chat, profile, retrieve
from .options import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    CLIError,
    engine_options,
    is_utf,
    pop_options,
)
from .serve import mcp_command, serve

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
  memoryos-gpu users    --store mem                       # user ids, for export --user
  memoryos-gpu serve    --store mem --port 8000 --api-keys keys.txt
  memoryos-gpu mcp      --config config.json              # MCP server (BAI-LAB config.json)

\b
Engine options (--store, --config, --device, --preset, --llm-*, --embedding-*) are accepted
before or after the subcommand (bench, which builds no engine, takes only --device);
precedence: flag > environment > --config file > default.
Set MEMORYOS_GPU_EMBEDDER=hashing for a model-free test embedder. See docs/cli.md and
docs/embeddings.md (--embedder onnx: CPU-fast; openai: an embeddings server).
"""


class _Group(click.Group):
    """The command group; a command whose stdout reader went away ends as :func:`_pipe_closed`
    says. Caught here because click itself turns that error into a silent exit 1 (standalone
    mode or not) before :func:`main` could see it."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError as exc:
            if not _stdout_gone():  # another pipe (a worker's, a server's): a real failure
                raise CLIError(str(exc)) from None
            raise click.exceptions.Exit(_pipe_closed()) from None


@click.group(cls=_Group, help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memoryos-gpu", prog_name="memoryos-gpu")
@engine_options
@click.pass_context
def cli(ctx: click.Context, **kwargs: Any) -> None:
    ctx.obj = pop_options(kwargs)


for _command in (
    ingest,
    retrieve,
    chat,
    profile,
    stats,
    users,
    export,
    delete,
    rekey,
    serve,
    mcp_command,
    bench,
    evaluate,
):
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    # The native kernels run OpenMP regions even on tiny inputs; with the default spinning
    # wait policy each costs a scheduler quantum (~10 ms) whenever the CPUs are shared. Must
    # be set before the OpenMP runtime loads (memoryos_gpu._C and torch are imported lazily).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _lenient_stdout()
    try:
        rv = cli.main(
            args=list(argv) if argv is not None else None,
            prog_name="memoryos-gpu",
            standalone_mode=False,
        )
    except click.exceptions.Abort as exc:
        # outside standalone mode click turns Ctrl-C (and EOF at a prompt) into Abort
        if isinstance(exc.__context__, KeyboardInterrupt):
            click.echo("interrupted", err=True)
            return EXIT_INTERRUPTED
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
    except BrokenPipeError as exc:
        if not _stdout_gone():
            click.echo(f"error: {exc}", err=True)
            return EXIT_ERROR
        return _pipe_closed()
    except SystemExit as exc:  # rich's Console exits 1 on a broken pipe (on_broken_pipe)
        if isinstance(exc.__context__, BrokenPipeError):
            return _pipe_closed()
        raise
    return int(rv) if isinstance(rv, int) else EXIT_OK


def _lenient_stdout() -> None:
    """Let text output show a character stdout's encoding lacks as its escape (``\\U0001f3c3``)
    instead of failing the command. Why: on a terminal in GBK or Latin-1 (a legacy console,
    ``PYTHONIOENCODING``) one emoji in a page ended ``retrieve`` half printed, and a Chinese
    user id ended ``users`` under Latin-1, with an error blaming the arguments; the person
    still wants the rest. Only a stdout in a strict non-UTF encoding is changed: UTF-8 shows
    every character (what it refuses, a lone surrogate, is an argument's fault, which
    ``handle_errors`` says), and JSON does not pass through it (``output.echo_utf8`` writes
    UTF-8 bytes). Here, not in the command group: the console script owns the process's
    stdout, an in-process caller of :data:`cli` keeps its own."""
    stream = sys.stdout
    encoding = str(getattr(stream, "encoding", None) or "utf-8")
    if getattr(stream, "errors", None) != "strict" or is_utf(encoding):
        return
    with contextlib.suppress(AttributeError, ValueError):  # no reconfigure, or closed
        stream.reconfigure(errors="backslashreplace")


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader went away (poll says POLLERR): only
    then is a broken pipe the reader's choice, not a failure of another pipe the command
    writes (a worker process's, a server's connection)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real stdout (a test runner's), no poll
        return False


def _pipe_closed() -> int:
    """Exit 0, quietly, when the reader of stdout went away (``| head -1``): it had what it
    wanted, and a silent exit 1 read as a failure under ``set -o pipefail``. Stdout is pointed
    at /dev/null so that the interpreter's flush at exit does not fail again (and print)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return EXIT_OK

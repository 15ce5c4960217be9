"""The ``memoryos-gpu`` command group, its subcommands, and the console-script entry point."""

from __future__ import annotations

import os
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
    engine_options,
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


@click.group(help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
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
    except BrokenPipeError:
        return EXIT_ERROR
    return int(rv) if isinstance(rv, int) else EXIT_OK

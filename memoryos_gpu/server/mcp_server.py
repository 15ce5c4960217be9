"""MCP server (official ``mcp`` SDK, v2 ``MCPServer``) over the batched memory service.

A drop-in for BAI-LAB/MemoryOS's MCP server (``server_new.py --config config.json``): it reads
the same ``config.json`` (:func:`memoryos_gpu.reference.load_config_json`; a TOML file of this
project's :class:`~memoryos_gpu.config.EngineConfig` works too), stores a data path's memory in
the same file as the :mod:`~memoryos_gpu.compat` facade, and has the reference's tools, named,
shaped and behaving like its own:

* ``add_memory(user_input, agent_response, timestamp=None, meta_data=None)``: returns once the
  page is committed and what it evicted from STM is in MTM (the reference's read-your-writes);
* ``retrieve_memory(query, relationship_with_user="friend", style_hint="", max_results=10)``:
  the retrieval queue (``retrieval_queue_capacity`` pages) cut to ``max_results``;
* ``get_user_profile(include_knowledge=True, include_assistant_knowledge=False)``.

Unlike the reference (one user per process), every tool also takes an optional ``user_id``;
it defaults to ``--user-id`` (else the config's ``user_id``). Results are the reference's
``{"status": "success", ...}`` objects, as structured content (typed ``outputSchema``) and as
JSON text. Failures are tool errors (``isError: true``) whose text is the reference's
``{"status": "error", "message": ...}`` JSON, so clients that parse it keep working. Timestamps
print as given (:mod:`memoryos_gpu.reference`).

Run::

    python -m memoryos_gpu.server.mcp_server --config config.json          # stdio
    python -m memoryos_gpu.server.mcp_server --store DIR --transport streamable-http \\
        --host 127.0.0.1 --port 8765 [--stateless] [--json-response]        # http://.../mcp

The streamable HTTP transport has no authentication of its own: bind it to loopback or put it
behind a proxy that authenticates (the HTTP API in :mod:`memoryos_gpu.server.app` has keys).
"""

# no ``from __future__ import annotations``: the SDK reads the tools' annotations, which name
# types local to build_mcp, so they are evaluated where the tools are defined

import argparse
import asyncio
import json
import logging
import os
import sys
import tomllib
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, ValidationError

from memoryos_gpu import __version__
from memoryos_gpu.cli.options import (
    DEFAULT_STORE,
    ENV_EMBEDDER,
    EXIT_USAGE,
    UsageFailure,
    device_problem,
    embedder_choice,
    flag_or_env_store,
    listen_host_problem,
    quiet_model_loading,
)
from memoryos_gpu.config import EngineConfig, explain_settings_error, llm_settings_problem
from memoryos_gpu.embed.factory import EMBEDDER_KINDS
from memoryos_gpu.errors import MemoryOSError, UnknownUserError
from memoryos_gpu.log_setup import LOG_LEVELS, setup_logging, uvicorn_logging
from memoryos_gpu.reference import (
    ConfigError,
    ReferenceSettings,
    engine_config,
    load_config_json,
    page_stamp,
    read_timestamp,
    stamp,
    user_meta,
)
from memoryos_gpu.server.header_timeout import header_timeout_protocol
from memoryos_gpu.server.memory_routes import check_meta
from memoryos_gpu.server.scope import ApiError, is_blank, user_id_problem
from memoryos_gpu.server.service import MemoryService, Overloaded, Unavailable
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.server.workers import (
    ShutdownError,
    StartupError,
    check_listen_address,
    run_server,
)
from memoryos_gpu.types import PageInput

__all__ = ["build_mcp", "main"]

log = logging.getLogger("memoryos_gpu.server.mcp")

INSTRUCTIONS = (
    "Long-term memory for conversations (MemoryOS: short-term pages, mid-term topic segments, "
    "long-term profile and knowledge). After each exchange call add_memory; before answering, "
    "call retrieve_memory with the user's message; get_user_profile returns what is known about "
    "the user."
)
NO_PROFILE = "No detailed user profile"
#: longest ``user_id`` and ``relationship_with_user`` (a name, not a text)
MAX_ID_CHARS = 200
#: longest ``timestamp``: the longest format it reads (ISO-8601 with fraction and zone) is
#: about 35 characters; a longer one is a mistake, and its error quotes it
MAX_TIMESTAMP_CHARS = 100
# failures a caller can act on (bad input, busy or starting server, failing LLM): tool errors
# with their message; anything else is a crash the SDK reports without details and logs
_HANDLED = (MemoryOSError, ValueError, Overloaded, Unavailable)


# ====================================================================== result shapes
class Details(BaseModel):
    user_input_length: int
    agent_response_length: int
    has_meta_data: bool


class AddMemoryResult(BaseModel):
    """What ``add_memory`` returns (the reference's fields first)."""

    status: Literal["success"]
    message: str
    timestamp: str = Field(description="The page's timestamp, as given (default: now, local).")
    details: Details
    page_id: int = Field(description="Id of the stored page.")
    user_id: str
    processed: bool = Field(
        description="Whether the page's derived work (MTM placement of what it evicted from "
        "STM, promotions) finished before the answer."
    )


class ShortTermItem(BaseModel):
    user_input: str
    agent_response: str
    timestamp: str
    page_id: int


class PageItem(ShortTermItem):
    meta_info: str = Field(description="The dialogue chain's summary.")
    score: float | None = Field(None, description="Relevance to the query (higher is better).")


class KnowledgeItem(BaseModel):
    knowledge: str
    timestamp: str = Field(description="When it was learnt (local time).")
    score: float | None = Field(None, description="Relevance to the query.")


class RetrieveMemoryResult(BaseModel):
    """What ``retrieve_memory`` returns (the reference's fields first)."""

    status: Literal["success"]
    query: str
    timestamp: str
    user_profile: str
    short_term_memory: list[ShortTermItem] = Field(description="Every STM page, oldest first.")
    short_term_count: int
    retrieved_pages: list[PageItem] = Field(description="Relevant mid-term pages, best first.")
    retrieved_user_knowledge: list[KnowledgeItem]
    retrieved_assistant_knowledge: list[KnowledgeItem]
    total_pages_found: int = Field(description="Pages retrieved before the max_results cut.")
    total_user_knowledge_found: int
    total_assistant_knowledge_found: int
    user_id: str
    relationship_with_user: str
    style_hint: str


class UserProfileResult(BaseModel):
    """What ``get_user_profile`` returns (the reference's fields first)."""

    status: Literal["success"]
    timestamp: str
    user_id: str
    assistant_id: str
    user_profile: str = Field(description="The profile as text.")
    user_knowledge: list[KnowledgeItem] | None = Field(None, description="If include_knowledge.")
    user_knowledge_count: int | None = None
    assistant_knowledge: list[KnowledgeItem] | None = Field(
        None, description="If include_assistant_knowledge."
    )
    assistant_knowledge_count: int | None = None
    profile: dict[str, str] = Field(description="The profile as dimension: value.")


def _profile_text(profile: dict[str, str]) -> str:
    if not profile:
        return NO_PROFILE
    return "\n".join(f"{k}: {v}" for k, v in profile.items())


def _ok(result: BaseModel) -> Any:
    """A success: structured content (absent optional fields left out, as the reference does)
    and the same object as JSON text, which the reference's clients parse."""
    from mcp.types import CallToolResult, TextContent

    data = result.model_dump(mode="json", exclude_none=True)
    text = json.dumps(data, ensure_ascii=False, indent=2)
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=data)


def _fail(message: str) -> Any:
    """A tool error (``isError``) whose text is the reference's error object."""
    from mcp.types import CallToolResult, TextContent

    text = json.dumps({"status": "error", "message": message}, ensure_ascii=False)
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def _annotations(title: str, *, read_only: bool, idempotent: bool) -> Any:
    from mcp.types import ToolAnnotations

    return ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=False,
        idempotent_hint=idempotent,
        open_world_hint=False,
    )


def _stm_item(p: Any) -> ShortTermItem:
    return ShortTermItem(
        user_input=p.user_input,
        agent_response=p.agent_response,
        timestamp=page_stamp(p),
        page_id=p.page_id,
    )


def _page_item(p: Any) -> PageItem:
    return PageItem(
        user_input=p.user_input,
        agent_response=p.agent_response,
        timestamp=page_stamp(p),
        page_id=p.page_id,
        meta_info=p.meta or "",
        score=p.score,
    )


def _knowledge_items(entries: Any, created: dict[int, float]) -> list[KnowledgeItem]:
    return [
        KnowledgeItem(
            knowledge=e.text,
            timestamp=stamp(created[e.entry_id]) if e.entry_id in created else "",
            score=e.score,
        )
        for e in entries
    ]


def _stored_knowledge(rows: list[dict[str, Any]]) -> list[KnowledgeItem]:
    return [KnowledgeItem(knowledge=e["text"], timestamp=stamp(e.get("created"))) for e in rows]


def _checked_user(user_id: str) -> str:
    """``user_id`` if the HTTP API accepts it too (the rule of both:
    :func:`~memoryos_gpu.server.scope.user_id_problem`), else ValueError saying why, which a
    tool answers as its error: a user made here must stay addressable over HTTP."""
    problem = user_id_problem(user_id)
    if problem:
        raise ValueError(problem)
    return user_id


def _not_blank(text: str) -> str:
    """``text`` unless it is blank as the engine stores it (empty or only whitespace once
    control characters are dropped: ``"\\u0007"`` was taken and stored as ``""``, a page the
    HTTP API refuses); an argument's validator: the SDK's schema error names the argument."""
    if is_blank(text):
        raise ValueError("must not be blank")
    return text


def _checked_meta(meta: dict[str, Any] | None, limit: int) -> dict[str, Any] | None:
    """``meta`` if the HTTP API's write routes accept it too (their rule:
    :func:`~memoryos_gpu.server.memory_routes.check_meta`), else ValueError saying why: the
    SDK reads arguments more loosely than the HTTP API reads bodies (an integer past 64 bits,
    NaN), and what one way in stores the other must be able to serve."""
    try:
        check_meta(meta or {}, limit)
    except ApiError as exc:
        raise ValueError(exc.detail) from None
    return meta


def _strict_tool(fn: Callable[..., Any], annotations: Any) -> Any:
    """The SDK's tool for ``fn``, refusing arguments ``fn`` does not declare. The SDK's
    argument models ignore unknown names, so a misspelt optional argument (``userid``) would
    silently fall back to its default (another user's memory); refused, the caller's SDK
    error names it. The schema says so too (``additionalProperties: false``).

    Strict types too, as the HTTP API's bodies (:mod:`memoryos_gpu.server.models`): the
    SDK's lax models read ``"yes"`` and ``1`` as booleans and ``"2"`` and ``true`` as
    integers, so a client's typing mistake was served (another profile, another cut) rather
    than reported as the schema error naming the argument that it is."""
    from mcp.server.mcpserver.tools import Tool
    from pydantic import ConfigDict

    tool = Tool.from_function(fn, annotations=annotations)
    loose = tool.fn_metadata.arg_model
    strict = type(
        loose.__name__, (loose,), {"model_config": ConfigDict(extra="forbid", strict=True)}
    )
    tool.fn_metadata.arg_model = strict
    tool.parameters = strict.model_json_schema(by_alias=True)
    return tool


def build_mcp(
    service: MemoryService | Callable[[], MemoryService],
    *,
    default_user: str = "default_user",
    assistant_id: str | None = None,
    max_text_chars: int = 100_000,
    add_wait_s: float = 10.0,
) -> Any:
    """An ``MCPServer`` whose tools run on ``service`` (or on what the callable returns at call
    time). The service must be started on the loop that runs the tools. ``add_wait_s`` bounds
    how long ``add_memory`` waits for the page's derived work (0: answer at commit); while the
    LLM's circuit breaker is open that work cannot progress, and it answers at once
    (``processed: false``) instead of holding the agent for the whole wait."""
    from mcp.server.mcpserver import MCPServer
    from mcp.types import CallToolResult

    get = service if callable(service) and not isinstance(service, MemoryService) else None

    def svc() -> MemoryService:
        return get() if get is not None else service  # type: ignore[return-value]

    text = Field(min_length=1, max_length=max_text_chars)
    # not blank either: an agent sending "   " has a bug, as one sending "" (minLength 1); the
    # HTTP API takes both (a chat log's assistant turn without a user turn is such a page)
    not_blank = Field(json_schema_extra={"pattern": r"\S"})
    UserId = Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=MAX_ID_CHARS,
            description=f"Whose memory (default: the server's user, {default_user!r}).",
        ),
    ]

    def user_of(user_id: str | None) -> str:
        """The tool's user: its argument, else the server's; refused as the HTTP API would."""
        return _checked_user(user_id or default_user)

    async def add_memory(
        user_input: Annotated[
            str,
            text,
            not_blank,
            AfterValidator(_not_blank),
            Field(description="The user's input or question."),
        ],
        agent_response: Annotated[
            str, Field(max_length=max_text_chars, description="The assistant's response.")
        ],
        timestamp: Annotated[
            str | None,
            Field(
                max_length=MAX_TIMESTAMP_CHARS,
                description="When it was said: 'YYYY-MM-DD HH:MM:SS' (local time, as the "
                "reference), ISO-8601 with or without a zone, or epoch seconds; default now. "
                "Printed back as given.",
            ),
        ] = None,
        meta_data: Annotated[
            dict[str, Any] | None, Field(description="Optional metadata (a JSON object).")
        ] = None,
        user_id: UserId = None,
    ) -> Annotated[CallToolResult, AddMemoryResult]:
        """Add a new memory (a user input and assistant response pair) to MemoryOS."""
        try:
            uid = user_of(user_id)
            epoch, kept = read_timestamp(timestamp or None)  # "" is now, as in the reference
            meta = user_meta(_checked_meta(meta_data, max_text_chars), kept)
            page = PageInput(uid, user_input, agent_response, epoch, assistant_id, None, meta)
            s = svc()
            (res,) = await s.add_pages([page])
            if add_wait_s > 0:
                # not while the LLM's breaker is open: the work cannot be done meanwhile
                done = (await s.wait_for_user(uid, add_wait_s, while_progressing=True))["done"]
            else:
                done = await s.call(s.engine.pending_count, uid) == 0
        except _HANDLED as exc:
            return _fail(f"Error adding memory: {exc}")
        return _ok(
            AddMemoryResult(
                status="success",
                message="Memory has been successfully added to MemoryOS",
                timestamp=timestamp or stamp(),
                details=Details(
                    user_input_length=len(user_input),
                    agent_response_length=len(agent_response),
                    has_meta_data=meta_data is not None,
                ),
                page_id=res.page_id,
                user_id=uid,
                processed=bool(done),
            )
        )

    async def retrieve_memory(
        query: Annotated[str, text, Field(description="What to find (e.g. the user's message).")],
        relationship_with_user: Annotated[
            str,
            Field(
                max_length=MAX_ID_CHARS,
                description="Relationship to the user (friend, assistant, ...); echoed.",
            ),
        ] = "friend",
        style_hint: Annotated[
            str, Field(max_length=max_text_chars, description="Response style hint; echoed.")
        ] = "",
        max_results: Annotated[
            int,
            Field(
                ge=0,
                le=1000,
                description="At most this many pages and knowledge entries of each kind (cut "
                "from the retrieval queue, whose size is the server's retrieval_queue_capacity).",
            ),
        ] = 10,
        user_id: UserId = None,
    ) -> Annotated[CallToolResult, RetrieveMemoryResult]:
        """Retrieve relevant memories and context from MemoryOS for a query: short-term memory,
        relevant mid-term pages, the user profile and user / assistant knowledge. Read-only
        for the caller; like any MemoryOS retrieval it counts as a visit of what it found."""
        try:
            uid = user_of(user_id)
            s = svc()
            r = await s.retrieve(uid, query)
            created: dict[int, float] = {}
            if r.user_knowledge or r.assistant_knowledge:
                kn = await s.call(s.engine.knowledge, uid)
                created = {e["entry_id"]: e["created"] for e in (*kn["user"], *kn["assistant"])}
        except _HANDLED as exc:
            return _fail(f"Error retrieving memory: {exc}")
        k = max_results
        return _ok(
            RetrieveMemoryResult(
                status="success",
                query=query,
                timestamp=stamp(),
                user_profile=_profile_text(r.profile),
                short_term_memory=[_stm_item(p) for p in r.stm],
                short_term_count=len(r.stm),
                retrieved_pages=[_page_item(p) for p in r.pages[:k]],
                retrieved_user_knowledge=_knowledge_items(r.user_knowledge[:k], created),
                retrieved_assistant_knowledge=_knowledge_items(r.assistant_knowledge[:k], created),
                total_pages_found=len(r.pages),
                total_user_knowledge_found=len(r.user_knowledge),
                total_assistant_knowledge_found=len(r.assistant_knowledge),
                user_id=uid,
                relationship_with_user=relationship_with_user,
                style_hint=style_hint,
            )
        )

    async def get_user_profile(
        include_knowledge: Annotated[
            bool, Field(description="Include the knowledge held about the user.")
        ] = True,
        include_assistant_knowledge: Annotated[
            bool, Field(description="Include the assistant's knowledge.")
        ] = False,
        user_id: UserId = None,
    ) -> Annotated[CallToolResult, UserProfileResult]:
        """Get the user's profile (traits, preferences) and, optionally, the knowledge held
        about the user and the assistant's knowledge."""
        try:
            uid = user_of(user_id)
            s = svc()
            try:
                profile = await s.call(s.engine.profile, uid)
                kn = await s.call(s.engine.knowledge, uid)
                aid = (await s.call(s.engine.store.user_row, uid) or {}).get("assistant_id")
            except UnknownUserError:
                profile, kn, aid = {}, {"user": [], "assistant": []}, assistant_id
        except _HANDLED as exc:
            return _fail(f"Error getting user profile: {exc}")
        out = UserProfileResult(
            status="success",
            timestamp=stamp(),
            user_id=uid,
            assistant_id=aid or assistant_id or "default",
            user_profile=_profile_text(profile),
            profile=profile,
        )
        if include_knowledge:
            out.user_knowledge = _stored_knowledge(kn["user"])
            out.user_knowledge_count = len(kn["user"])
        if include_assistant_knowledge:
            out.assistant_knowledge = _stored_knowledge(kn["assistant"])
            out.assistant_knowledge_count = len(kn["assistant"])
        return _ok(out)

    tools = [
        _strict_tool(add_memory, _annotations("Add memory", read_only=False, idempotent=False)),
        _strict_tool(
            retrieve_memory, _annotations("Retrieve memory", read_only=True, idempotent=False)
        ),
        _strict_tool(
            get_user_profile, _annotations("Get user profile", read_only=True, idempotent=True)
        ),
    ]
    return MCPServer("MemoryOS", instructions=INSTRUCTIONS, version=__version__, tools=tools)


# ====================================================================== CLI
def _host(text: str) -> str:
    """``--host``, refused when empty or blank
    (:func:`~memoryos_gpu.cli.options.listen_host_problem`)."""
    problem = listen_host_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _port(text: str) -> int:
    """A TCP port, 1 to 65535 (``memoryos-gpu serve --port``'s range): the OS would take
    99999 as 99999 mod 65536, so the server would listen where the URL it prints is not."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not in the range 1 to 65535")
    return port


#: longest ``--add-wait-s``: an hour (an MCP client's request times out long before)
MAX_ADD_WAIT_S = 3600.0


def _wait_s(text: str) -> float:
    """``--add-wait-s``: seconds, a finite number from 0 to :data:`MAX_ADD_WAIT_S`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= MAX_ADD_WAIT_S:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"{text} is not in the range 0 to {MAX_ADD_WAIT_S:g}")
    return value


def _parser(prog: str = "python -m memoryos_gpu.server.mcp_server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="memoryos-gpu MCP server")
    p.add_argument(
        "--config",
        default=None,
        help="The reference's config.json (its keys: user_id, data_storage_path, "
        "short_term_capacity, ...) or an engine TOML file; flags given override it.",
    )
    p.add_argument(
        "--store",
        default=None,
        help="Store directory, SQLite file, or PostgreSQL URL (postgresql://user@host/db) "
        "[default: $MEMORYOS_GPU_STORE, else the config's store (config.json: data_storage_path), "
        f"else {DEFAULT_STORE}, as every memoryos-gpu command].",
    )
    p.add_argument("--user-id", default=None, help="User of tools called without one.")
    p.add_argument("--assistant-id", default=None, help="Assistant id of new users.")
    p.add_argument(
        "--transport",
        default="stdio",
        choices=["stdio", "streamable-http", "http"],
        help="stdio (default) or streamable HTTP.",
    )
    p.add_argument("--host", type=_host, default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8765, help="1 to 65535 [default: 8765].")
    p.add_argument("--path", default="/mcp", help="Streamable HTTP endpoint path.")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=None,
        metavar="HOST[:PORT]",
        help="A Host header the HTTP transport answers (repeat for several; 'name:*' for any "
        "port): turns the SDK's DNS-rebinding checks on for a non-loopback --host, which "
        "otherwise runs without them (a warning says so).",
    )
    p.add_argument(
        "--allowed-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="An Origin header the HTTP transport accepts (e.g. https://app.example.com; "
        "repeat for several), with --allowed-host.",
    )
    p.add_argument(
        "--stateless",
        action="store_true",
        help="Streamable HTTP without sessions (each request stands alone; for load balancers "
        "and serverless hosts).",
    )
    p.add_argument(
        "--json-response",
        action="store_true",
        help="Streamable HTTP answers plain JSON instead of an SSE stream.",
    )
    p.add_argument(
        "--add-wait-s",
        type=_wait_s,
        default=10.0,
        help="How long add_memory waits for the page's derived work (MTM placement, "
        "promotions) before answering; 0 = answer at commit; not while the LLM is known "
        "unreachable or failing (its circuit breaker open) [default: 10].",
    )
    p.add_argument(
        "--embedder",
        default=None,
        choices=EMBEDDER_KINDS,
        help=f"Embedding backend [default: ${ENV_EMBEDDER}, else the config's].",
    )
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="Logging level on stderr [default: WARNING].",
    )
    return p


def _is_json(path: str) -> bool:
    """config.json or TOML: by suffix, else by the first non-blank character."""
    suffix = Path(path).suffix.lower()
    if suffix in (".json", ".toml"):
        return suffix == ".json"
    try:
        return Path(path).read_text(encoding="utf-8").lstrip()[:1] == "{"
    except (OSError, UnicodeDecodeError):
        return False


def _config(args: argparse.Namespace) -> tuple[EngineConfig, ReferenceSettings | None]:
    """The engine config from ``--config``, ``$MEMORYOS_GPU_EMBEDDER`` and the flags (flag >
    variable > file > default, as every ``memoryos-gpu`` command reads them), and the
    reference settings when the config was a config.json."""
    update: dict[str, Any] = {"auto_process": False}
    embedder = embedder_choice(args.embedder)
    try:  # every command's rule: a blank --store or $MEMORYOS_GPU_STORE is refused
        store = flag_or_env_store(args.store)
    except UsageFailure as exc:
        raise ConfigError(exc.format_message()) from None
    for key, value in (("store", store), ("embedder", embedder), ("device", args.device)):
        if value:
            update[key] = value
    if args.config and _is_json(args.config):
        ref = load_config_json(args.config)
        return _checked(engine_config(ref, **update)), ref
    try:
        cfg = EngineConfig.from_toml(args.config) if args.config else EngineConfig()
        if "store" not in cfg.model_fields_set:
            update.setdefault("store", _default_store())
        return _checked(EngineConfig.model_validate({**cfg.model_dump(), **update})), None
    except ValidationError as exc:  # one line naming the keys, never a value (API keys)
        where = args.config or "settings"
        raise ConfigError(f"{where}: {explain_settings_error(exc, EngineConfig)}") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        # the parser's "Invalid value (at line 1, column 5)" does not say in which file
        raise ConfigError(f"cannot read config file {args.config}: {exc}") from None


def _checked(cfg: EngineConfig) -> EngineConfig:
    """``cfg``, its LLM settings checked as the CLI checks them: a backend missing its URL or
    model is a configuration error before the store is opened, not a failed start after."""
    problem = llm_settings_problem(cfg.llm) if cfg.llm.mode == "llm" else None
    if problem:
        raise ConfigError(problem)
    problem = device_problem(cfg.device)
    if problem:
        raise ConfigError(f"device {cfg.device!r}: {problem}; use auto or cpu")
    return cfg


def _default_user(args: argparse.Namespace, ref: ReferenceSettings | None) -> str:
    """The user of tools called without one: ``--user-id``, else config.json's ``user_id``,
    else ``default_user``; refused as the HTTP API would (:func:`_checked_user`), saying
    where the id came from (the flag or the file's key), which the rule's text does not."""
    if args.user_id is not None:
        problem = user_id_problem(args.user_id)
        if problem:
            raise ConfigError(f"{problem} (from --user-id)")
        return args.user_id
    if ref is not None and ref.user_id:
        problem = user_id_problem(ref.user_id)
        if problem:
            raise ConfigError(f"{args.config}: user_id: {problem.removeprefix('user_id ')}")
        return ref.user_id
    return "default_user"


def _default_store() -> str:
    """The store of a server given none: every command's default, so ``memoryos-gpu ingest``
    then ``memoryos-gpu mcp`` share one; a ``./memoryos_store`` this server made before it
    used that default is kept (and named in a warning) while no new one exists."""
    old = "./memoryos_store"
    if not Path(DEFAULT_STORE).exists() and Path(old).exists():
        log.warning("using %s (this server's old default store); rename it %s", old, DEFAULT_STORE)
        return old
    return DEFAULT_STORE


class ConfigExit(SystemExit):
    """The server was refused its configuration. ``code`` is the one-line message, as
    ``sys.exit(message)`` gives it to a caller in Python; run as a program
    (:func:`run_program`, ``memoryos-gpu mcp``) it prints that line and exits 2, as a bad
    configuration does for every command (``sys.exit(message)`` alone exited 1)."""


def run_program(argv: list[str] | None = None, prog: str | None = None) -> None:
    """:func:`main` as a process: a :class:`ConfigExit` is its message on stderr and exit 2."""
    try:
        main(argv, prog)
    except ConfigExit as exc:
        print(exc.code, file=sys.stderr)
        sys.exit(EXIT_USAGE)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Run the server until the client (stdio) or Ctrl-C / SIGTERM (HTTP) ends it; a bad
    configuration exits with a one-line message."""
    args = (_parser(prog) if prog else _parser()).parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before the OpenMP runtime loads
    quiet_model_loading()  # no progress bar in the client's log of this server's stderr
    setup_logging(args.log_level)  # stderr only: stdout carries the stdio protocol
    try:
        config, ref = _config(args)
        user = _default_user(args, ref)
    except (MemoryOSError, ValueError, OSError) as exc:  # a bad configuration: exit 2 as a program
        raise ConfigExit(f"memoryos-gpu MCP server: {exc}") from None
    service = MemoryService(config, ServerSettings(gc_freeze=True))  # this process serves only
    mcp = build_mcp(
        service,
        default_user=user,
        assistant_id=args.assistant_id or (ref.assistant_id if ref else None),
        add_wait_s=args.add_wait_s,
    )
    try:
        if args.transport == "stdio":
            _serve_stdio(service, mcp)
        else:
            _serve_http(service, mcp, args)
    except (Unavailable, StartupError, ShutdownError) as exc:  # the cause on stderr, one line
        sys.exit(f"memoryos-gpu MCP server: {exc}")


async def start_serving(service: MemoryService) -> None:
    """Start ``service`` and wait for its engine; raise :class:`Unavailable` naming the cause
    when it cannot open (another embedder than the store's, say), before any client is told
    the server is up: each tool call would fail alike, and ``initialize`` would pretend.

    A store it cannot open *yet* (another writer holds it, its database is down) fails it
    too, where the HTTP server waits: an MCP client starts this process and shows what it
    says, but a stdio server that waits shows the client nothing. So the service does not
    wait for it either (:attr:`MemoryService.wait_for_store`): its one log line and the
    message raised say the server stops, not when it tries again."""
    service.wait_for_store = False
    await service.start(wait=False)
    while service.state == "starting":
        if service.error:  # waiting for the store: say why, do not wait
            await service.close()
            raise Unavailable(f"the store cannot be opened now: {service.error}", 1)
        await asyncio.sleep(0.01)
    service.check_ready()


def _serve_stdio(service: MemoryService, mcp: Any) -> None:
    """Serve over stdio (:mod:`memoryos_gpu.server.mcp_stdio`) until stdin closes, the
    client goes away (stdout closed) or SIGINT / SIGTERM / SIGHUP comes; each ends the same
    way: the calls in flight are cancelled, the service drains and closes (what is committed
    stays), exit status 0. A repeated signal during the drain changes nothing (SIGKILL does)."""
    import signal

    import anyio

    from memoryos_gpu.server.mcp_stdio import stdio_transport
    from memoryos_gpu.stop_signals import STOP_SIGNALS

    async def serve() -> None:
        low = mcp._lowlevel_server  # what MCPServer.run_stdio_async runs, on our transport
        stop = anyio.CancelScope()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:  # on the loop (asyncio's signal handling)
            if not stop.cancel_called:
                log.warning("%s: stopping (closing the store)", signal.Signals(signum).name)
                stop.cancel()

        taken = []
        for sig in STOP_SIGNALS:
            try:
                loop.add_signal_handler(sig, on_signal, sig)
                taken.append(sig)
            except (RuntimeError, ValueError, NotImplementedError):  # not the main thread
                pass
        try:
            with stop:
                await start_serving(service)
                async with stdio_transport(on_gone=stop.cancel) as (read, write):
                    await low.run(read, write, low.create_initialization_options())
        finally:
            with anyio.CancelScope(shield=True):
                await service.close()
            for sig in taken:
                loop.remove_signal_handler(sig)

    anyio.run(serve)


class _BodyFirst:
    """ASGI middleware: reads a POST's body before the SDK does, so that a client hanging up
    before its body arrived is one INFO line, as on the HTTP API, and not an ERROR with a
    ``ClientDisconnect`` traceback per request (the SDK's handler reads the body whole all
    the same, then gets it replayed from here)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":  # nobody is left to answer
                log.info("client disconnected before its request was read")
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body: list[bytes] = [b"".join(chunks)]

        async def replay() -> Any:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            return await receive()  # then the connection's own messages (a disconnect)

        await self.app(scope, replay, send)


def http_app(
    service: MemoryService,
    mcp: Any,
    *,
    path: str = "/mcp",
    host: str = "127.0.0.1",
    stateless: bool = False,
    json_response: bool = False,
    allowed_hosts: list[str] | None = None,
    allowed_origins: list[str] | None = None,
) -> Any:
    """The streamable HTTP app; its lifespan starts and drains the service. The SDK checks
    Host and Origin (DNS rebinding) by itself only on a loopback ``host``; ``allowed_hosts``
    turns the checks on for any host, with those names (and ``allowed_origins``)."""
    security = None
    if allowed_hosts:
        from mcp.server.transport_security import TransportSecuritySettings

        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=list(allowed_hosts),
            allowed_origins=list(allowed_origins or []),
        )
    app = mcp.streamable_http_app(
        streamable_http_path=path,
        host=host,
        stateless_http=stateless,
        json_response=json_response,
        transport_security=security,
    )
    app.add_middleware(_BodyFirst)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any):
        try:
            await start_serving(service)  # failing, uvicorn exits (status 3) with the cause
            async with inner(a):
                yield
        finally:
            try:
                await service.close()
            except BaseException:  # uvicorn logs it and returns: the exit status must not
                a.state.shutdown_failed = True
                raise

    app.router.lifespan_context = lifespan
    return app


def warn_if_unchecked(host: str, allowed_hosts: list[str] | None) -> None:
    """One warning when the HTTP transport listens beyond loopback with no Host/Origin checks:
    the SDK makes them only for a loopback host, and the transport has no authentication, so a
    web page a user opens could reach it by DNS rebinding and nothing would say so."""
    if not allowed_hosts and not _loopback(host):
        log.warning(
            "MCP server on %s without Host/Origin checks (DNS rebinding protection) and "
            "without authentication: give --allowed-host with the names clients use (and "
            "--allowed-origin), and keep it behind a proxy that authenticates",
            host,
        )


def _loopback(host: str) -> bool:
    """Whether ``host`` (a --host value) is a loopback name or address: where the SDK checks
    Host and Origin by itself."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _serve_http(service: MemoryService, mcp: Any, args: argparse.Namespace) -> None:
    """Serve until SIGTERM / Ctrl-C. A taken port is :class:`StartupError` before the engine
    loads (uvicorn binds after the app's startup, and says so as its own ERROR and exit code
    3); the URL is announced once uvicorn listens, so that a log reader or a supervisor never
    sees an address announced that nothing serves. SIGTERM and Ctrl-C exit 0 once the shutdown
    has drained and closed the service; a shutdown that failed is :class:`ShutdownError`."""
    import uvicorn

    from memoryos_gpu.server.app import shutdown_failed

    check_listen_address(args.host, args.port)
    warn_if_unchecked(args.host, args.allowed_host)
    app = http_app(
        service,
        mcp,
        path=args.path,
        host=args.host,
        stateless=args.stateless,
        json_response=args.json_response,
        allowed_hosts=args.allowed_host,
        allowed_origins=args.allowed_origin,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        **uvicorn_logging(args.log_level),
        http=header_timeout_protocol(ServerSettings().header_timeout_s),
    )
    server = _announcing(
        config, f"memoryos-gpu MCP server on http://{args.host}:{args.port}{args.path}"
    )
    run_server(server)  # a SIGTERM stop exits 0 as Ctrl-C does, after the same shutdown
    if not server.started:  # what uvicorn.run does: a server that never served failed
        sys.exit(uvicorn.config.STARTUP_FAILURE)
    if shutdown_failed(app):
        raise ShutdownError(
            "the shutdown failed: writes may be uncommitted (the log above says why); start "
            "the server again on the store to recover"
        )


def _announcing(config: Any, line: str) -> Any:
    """A uvicorn server that prints ``line`` to stderr once it listens (its startup done: the
    engine loaded, the sockets bound)."""
    import uvicorn

    class Announcing(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(line, file=sys.stderr, flush=True)

    return Announcing(config)


if __name__ == "__main__":
    run_program()

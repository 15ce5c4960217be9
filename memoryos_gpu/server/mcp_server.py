"""MCP server (official ``mcp`` SDK, v2 ``MCPServer``) over the batched memory service.

Tools, named and shaped like BAI-LAB/MemoryOS's MCP server so agent frameworks configured for it
work unchanged:

* ``add_memory(user_input, agent_response, timestamp=None, meta_data=None)``
* ``retrieve_memory(query, relationship_with_user="friend", style_hint="", max_results=10)``
* ``get_user_profile(include_knowledge=True, include_assistant_knowledge=False)``

Unlike the reference (one user per process), every tool also takes an optional ``user_id``;
it defaults to ``--user-id``. Results are ``{"status": "success", ...}`` or
``{"status": "error", "message": ...}``.

Run::

    python -m memoryos_gpu.server.mcp_server --store DIR                      # stdio
    python -m memoryos_gpu.server.mcp_server --store DIR --transport streamable-http \\
        --host 127.0.0.1 --port 8765                                          # http://.../mcp

The streamable HTTP transport has no authentication of its own: bind it to loopback or put it
behind a proxy that authenticates (the HTTP API in :mod:`memoryos_gpu.server.app` has keys).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.errors import UnknownUserError
from memoryos_gpu.server.service import MemoryService
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import PageInput

__all__ = ["build_mcp", "main"]

log = logging.getLogger("memoryos_gpu.server.mcp")

INSTRUCTIONS = (
    "Long-term memory for conversations (MemoryOS: short-term pages, mid-term topic segments, "
    "long-term profile and knowledge). After each exchange call add_memory; before answering, "
    "call retrieve_memory with the user's message; get_user_profile returns what is known about "
    "the user."
)


def _stamp(ts: float | None = None) -> str:
    """The reference's timestamp format (local time, ``YYYY-MM-DD HH:MM:SS``)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts if ts is not None else time.time()))


def _profile_text(profile: dict[str, str]) -> str:
    if not profile:
        return "No detailed user profile"
    return "\n".join(f"{k}: {v}" for k, v in profile.items())


def _error(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}


def build_mcp(
    service: MemoryService | Callable[[], MemoryService],
    *,
    default_user: str = "default_user",
    assistant_id: str | None = None,
    max_text_chars: int = 100_000,
) -> Any:
    """An ``MCPServer`` whose tools run on ``service`` (or on what the callable returns at call
    time). The service must be started on the loop that runs the tools."""
    from mcp.server.mcpserver import MCPServer

    get = service if callable(service) and not isinstance(service, MemoryService) else None

    def svc() -> MemoryService:
        return get() if get is not None else service  # type: ignore[return-value]

    mcp = MCPServer("MemoryOS", instructions=INSTRUCTIONS, version="0.1.0")

    def user_of(user_id: str | None) -> str:
        uid = user_id or default_user
        if not uid.strip() or len(uid) > 200:
            raise ValueError("user_id must be 1-200 characters")
        return uid

    @mcp.tool()
    async def add_memory(
        user_input: str,
        agent_response: str,
        timestamp: str | None = None,
        meta_data: dict[str, Any] | None = None,
        user_id: str | None = None,
    ) -> dict[str, Any]:
        """Add a new memory (a user input and assistant response pair) to MemoryOS.

        Args:
            user_input: The user's input or question.
            agent_response: The assistant's response.
            timestamp: Optional timestamp (YYYY-MM-DD HH:MM:SS or ISO-8601; default now).
            meta_data: Optional metadata (JSON object).
            user_id: Optional user (default: the server's --user-id).
        """
        try:
            if not user_input:
                return _error("user_input is required")
            if len(user_input) > max_text_chars or len(agent_response or "") > max_text_chars:
                return _error(f"texts are limited to {max_text_chars} characters")
            uid = user_of(user_id)
            res = await svc().add_pages(
                [
                    PageInput(
                        uid,
                        user_input,
                        agent_response or "",
                        timestamp,
                        assistant_id,
                        None,
                        dict(meta_data or {}),
                    )
                ]
            )
            return {
                "status": "success",
                "message": "Memory has been successfully added to MemoryOS",
                "timestamp": timestamp or _stamp(),
                "page_id": res[0].page_id,
                "user_id": uid,
                "details": {
                    "user_input_length": len(user_input),
                    "agent_response_length": len(agent_response or ""),
                    "has_meta_data": meta_data is not None,
                },
            }
        except Exception as exc:
            return _error(f"Error adding memory: {exc}")

    @mcp.tool()
    async def retrieve_memory(
        query: str,
        relationship_with_user: str = "friend",
        style_hint: str = "",
        max_results: int = 10,
        user_id: str | None = None,
    ) -> dict[str, Any]:
        """Retrieve relevant memories and context from MemoryOS for a query: short-term memory,
        relevant mid-term pages, the user profile and user / assistant knowledge.

        Args:
            query: The retrieval query describing what to find.
            relationship_with_user: Relationship to the user (e.g. friend, assistant); echoed.
            style_hint: Optional response style hint; echoed.
            max_results: Maximum number of pages / knowledge entries to return (1-100).
            user_id: Optional user (default: the server's --user-id).
        """
        try:
            if not query:
                return _error("query parameter is required")
            if len(query) > max_text_chars:
                return _error(f"query is limited to {max_text_chars} characters")
            k = max(1, min(100, int(max_results)))
            uid = user_of(user_id)
            r = await svc().retrieve(uid, query, top_pages=k)
            return {
                "status": "success",
                "query": query,
                "timestamp": _stamp(),
                "user_id": uid,
                "relationship_with_user": relationship_with_user,
                "style_hint": style_hint,
                "user_profile": _profile_text(r.profile),
                "short_term_memory": [
                    {
                        "user_input": p.user_input,
                        "agent_response": p.agent_response,
                        "timestamp": _stamp(p.timestamp),
                    }
                    for p in r.stm
                ],
                "short_term_count": len(r.stm),
                "retrieved_pages": [
                    {
                        "user_input": p.user_input,
                        "agent_response": p.agent_response,
                        "timestamp": _stamp(p.timestamp),
                        "meta_info": p.meta or "",
                        "score": p.score,
                    }
                    for p in r.pages[:k]
                ],
                "retrieved_user_knowledge": [
                    {"knowledge": e.text, "score": e.score} for e in r.user_knowledge[:k]
                ],
                "retrieved_assistant_knowledge": [
                    {"knowledge": e.text, "score": e.score} for e in r.assistant_knowledge[:k]
                ],
                "total_pages_found": len(r.pages),
                "total_user_knowledge_found": len(r.user_knowledge),
                "total_assistant_knowledge_found": len(r.assistant_knowledge),
            }
        except Exception as exc:
            return _error(f"Error retrieving memory: {exc}")

    @mcp.tool()
    async def get_user_profile(
        include_knowledge: bool = True,
        include_assistant_knowledge: bool = False,
        user_id: str | None = None,
    ) -> dict[str, Any]:
        """Get the user's profile (traits, preferences) and, optionally, the knowledge held
        about the user and the assistant's knowledge.

        Args:
            include_knowledge: Whether to include user knowledge entries.
            include_assistant_knowledge: Whether to include assistant knowledge entries.
            user_id: Optional user (default: the server's --user-id).
        """
        try:
            s = svc()
            uid = user_of(user_id)
            try:
                profile = await s.call(s.engine.profile, uid)
                kn = await s.call(s.engine.knowledge, uid)
                aid = (await s.call(s.engine.store.user_row, uid) or {}).get("assistant_id")
            except UnknownUserError:
                profile, kn, aid = {}, {"user": [], "assistant": []}, assistant_id
            out: dict[str, Any] = {
                "status": "success",
                "timestamp": _stamp(),
                "user_id": uid,
                "assistant_id": aid or assistant_id or "default",
                "user_profile": _profile_text(profile),
                "profile": profile,
            }
            if include_knowledge:
                out["user_knowledge"] = [
                    {"knowledge": e["text"], "timestamp": _stamp(e.get("created"))}
                    for e in kn["user"]
                ]
                out["user_knowledge_count"] = len(kn["user"])
            if include_assistant_knowledge:
                out["assistant_knowledge"] = [
                    {"knowledge": e["text"], "timestamp": _stamp(e.get("created"))}
                    for e in kn["assistant"]
                ]
                out["assistant_knowledge_count"] = len(kn["assistant"])
            return out
        except Exception as exc:
            return _error(f"Error getting user profile: {exc}")

    return mcp


# ====================================================================== CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m memoryos_gpu.server.mcp_server", description="memoryos-gpu MCP server"
    )
    p.add_argument(
        "--store",
        default="./memoryos_store",
        help="Store directory, SQLite file, or PostgreSQL URL (postgresql://user@host/db).",
    )
    p.add_argument("--config", default=None, help="Engine TOML config (store/embedder override).")
    p.add_argument("--user-id", default="default_user", help="User of tools called without one.")
    p.add_argument("--assistant-id", default=None, help="Assistant id of new users.")
    p.add_argument(
        "--transport",
        default="stdio",
        choices=["stdio", "streamable-http", "http"],
        help="stdio (default) or streamable HTTP.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--path", default="/mcp", help="Streamable HTTP endpoint path.")
    p.add_argument("--embedder", default=None, choices=["transformers", "hashing"])
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    p.add_argument("--log-level", default="WARNING")
    return p


def _config(args: argparse.Namespace) -> EngineConfig:
    cfg = EngineConfig.from_toml(args.config) if args.config else EngineConfig()
    update: dict[str, Any] = {"store": args.store, "auto_process": False}
    if args.embedder:
        update["embedder"] = args.embedder
    if args.device:
        update["device"] = args.device
    return EngineConfig.model_validate({**cfg.model_dump(), **update})


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before the OpenMP runtime loads
    logging.basicConfig(  # stderr only: stdout carries the stdio protocol
        stream=sys.stderr,
        level=getattr(logging, args.log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    service = MemoryService(_config(args), ServerSettings())
    mcp = build_mcp(service, default_user=args.user_id, assistant_id=args.assistant_id)

    if args.transport == "stdio":
        import anyio

        async def serve_stdio() -> None:
            await service.start()
            try:
                await mcp.run_stdio_async()
            finally:
                await service.close()

        anyio.run(serve_stdio)
        return

    import uvicorn

    app = mcp.streamable_http_app(streamable_http_path=args.path, host=args.host)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any):
        await service.start()
        try:
            async with inner(a):
                yield
        finally:
            await service.close()

    app.router.lifespan_context = lifespan
    print(f"memoryos-gpu MCP server on http://{args.host}:{args.port}{args.path}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())


if __name__ == "__main__":
    main()

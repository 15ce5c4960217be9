"""Serving memoryos-gpu: an HTTP API (FastAPI + uvicorn) and an MCP server over one batched core.

* :func:`create_app` / :func:`run` (``memoryos-gpu serve``): the HTTP server, see
  :mod:`memoryos_gpu.server.app`.
* :class:`MemoryService`: the engine behind micro-batched queues and a derived-work thread,
  shared by both servers.
* :mod:`memoryos_gpu.server.mcp_server`: the MCP server (stdio or streamable HTTP).

Imports are lazy so ``import memoryos_gpu.server`` needs none of the optional server packages.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MemoryService", "ServerSettings", "create_app", "run", "wait_until_processed"]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "run"):
        from memoryos_gpu.server import app

        return getattr(app, name)
    if name in ("MemoryService", "wait_until_processed"):
        from memoryos_gpu.server import service

        return getattr(service, name)
    if name == "ServerSettings":
        from memoryos_gpu.server.settings import ServerSettings

        return ServerSettings
    raise AttributeError(name)

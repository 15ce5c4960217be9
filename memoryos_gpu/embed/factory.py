"""The embedder an :class:`~memoryos_gpu.config.EngineConfig` names (``embedder=``)."""

from __future__ import annotations

from typing import Any

from memoryos_gpu.embed.base import EmbedderConfigError

__all__ = ["EMBEDDER_KINDS", "check_embedder_settings", "make_embedder"]

#: ``transformers``: a local model folder on torch (default: the bundled MiniLM);
#: ``onnx``: the same folder exported to int8 ONNX (CPU-fast); ``openai``: an
#: OpenAI-compatible ``/v1/embeddings`` server; ``hashing``: a model-free test double.
EMBEDDER_KINDS = ("transformers", "onnx", "openai", "hashing")  # EngineConfig.embedder

#: The settings an embedder cannot be built without: (setting, its CLI flag, what it holds).
_REQUIRED: dict[str, tuple[tuple[str, str, str], ...]] = {
    "openai": (
        ("embedding_model", "--embedding-model", "the served model's name"),
        ("embedding_base_url", "--embedding-base-url", "e.g. http://127.0.0.1:8001/v1"),
    ),
}


def check_embedder_settings(config: Any) -> None:
    """Raise :class:`~memoryos_gpu.embed.base.EmbedderConfigError` naming each setting (and
    its CLI flag) that the embedder of ``config`` needs and lacks.

    Why apart from :func:`make_embedder`: the CLI calls it as it builds a configuration, so a
    missing setting is a usage error there (exit 2), like any other bad setting, and not a
    failure of the engine's open; every other caller gets the same check when the embedder
    is built."""
    missing = [
        f"{name} ({flag}: {what})"
        for name, flag, what in _REQUIRED.get(config.embedder, ())
        if not getattr(config, name)
    ]
    if missing:
        raise EmbedderConfigError(f"embedder={config.embedder!r} needs " + " and ".join(missing))


def make_embedder(config: Any) -> Any:
    """Build the embedder of ``config`` (an :class:`~memoryos_gpu.config.EngineConfig`)."""
    check_embedder_settings(config)
    kind = config.embedder
    size = config.embedding_batch_size  # None: the backend's own default
    batch = {"cache_size": config.embedding_cache_size}
    if size is not None:
        batch["batch_size"] = size
    if kind == "hashing":
        from memoryos_gpu.embed.hashing import HashingEmbedder

        return HashingEmbedder()
    if kind == "openai":
        from memoryos_gpu.embed.openai import OpenAIEmbedder

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

"""``make_backend(kind, **options)``: build an :class:`LLMBackend` by name.

Heavy backends are imported only when asked for, so ``make_backend("openai", ...)`` never
imports torch and ``make_backend("scripted", ...)`` imports nothing beyond this package.
"""

from __future__ import annotations

from typing import Any

from memoryos_gpu.llm.base import LLMBackend

__all__ = ["BACKEND_KINDS", "backend_kind", "make_backend"]

BACKEND_KINDS: tuple[str, ...] = ("vllm", "openai", "transformers", "scripted")
_ALIASES = {
    "openai_compat": "openai",
    "openai-compat": "openai",
    "http": "openai",
    "hf": "transformers",
    "vllm_inproc": "vllm",
}


def backend_kind(kind: str) -> str:
    """The canonical backend name for ``kind`` (case, spaces and aliases such as ``"hf"``
    resolved); one of :data:`BACKEND_KINDS` when the name is known."""
    key = str(kind).strip().lower()
    return _ALIASES.get(key, key)


def make_backend(kind: str, **options: Any) -> LLMBackend:
    """Build a backend. ``kind``: one of :data:`BACKEND_KINDS`; ``options``: its constructor's.

    * ``"vllm"``: :class:`~memoryos_gpu.llm.vllm_backend.VLLMBackend` (``model=`` required)
    * ``"openai"``: :class:`~memoryos_gpu.llm.openai_compat.OpenAICompatBackend`
      (``base_url=``, ``model=`` required)
    * ``"transformers"``: :class:`~memoryos_gpu.llm.transformers_backend.TransformersBackend`
      (no option required: defaults to the bundled SmolLM2 GGUF)
    * ``"scripted"``: :class:`~memoryos_gpu.llm.scripted.ScriptedBackend` (``responder=``)
    """
    key = backend_kind(kind)
    if key == "vllm":
        from memoryos_gpu.llm.vllm_backend import VLLMBackend

        return VLLMBackend(**options)
    if key == "openai":
        from memoryos_gpu.llm.openai_compat import OpenAICompatBackend

        return OpenAICompatBackend(**options)
    if key == "transformers":
        from memoryos_gpu.llm.transformers_backend import TransformersBackend

        return TransformersBackend(**options)
    if key == "scripted":
        from memoryos_gpu.llm.scripted import ScriptedBackend

        return ScriptedBackend(**options)
    raise ValueError(
        f"unknown LLM backend kind {kind!r}; expected one of: {', '.join(BACKEND_KINDS)}"
    )

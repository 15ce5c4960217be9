"""The LLM layer: one batched interface (:class:`LLMBackend`) and its backends.

``OpenAICompatBackend``, ``VLLMBackend`` and ``TransformersBackend`` are imported lazily on
first access, so importing this package pulls in neither torch nor vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memoryos_gpu.llm.base import (
    BackendStats,
    ChatRequest,
    ChatResult,
    LLMBackend,
    LLMBackendError,
    LLMConfigError,
)
from memoryos_gpu.llm.factory import BACKEND_KINDS, make_backend
from memoryos_gpu.llm.jsonfix import parse_json_output
from memoryos_gpu.llm.scripted import ScriptedBackend

if TYPE_CHECKING:
    from memoryos_gpu.llm.openai_compat import OpenAICompatBackend
    from memoryos_gpu.llm.transformers_backend import TransformersBackend, bundled_smollm2_path
    from memoryos_gpu.llm.vllm_backend import VLLMBackend

__all__ = [
    "BACKEND_KINDS",
    "BackendStats",
    "ChatRequest",
    "ChatResult",
    "LLMBackend",
    "LLMBackendError",
    "LLMConfigError",
    "OpenAICompatBackend",
    "ScriptedBackend",
    "TransformersBackend",
    "VLLMBackend",
    "bundled_smollm2_path",
    "make_backend",
    "parse_json_output",
]

_LAZY = {
    "OpenAICompatBackend": "memoryos_gpu.llm.openai_compat",
    "TransformersBackend": "memoryos_gpu.llm.transformers_backend",
    "bundled_smollm2_path": "memoryos_gpu.llm.transformers_backend",
    "VLLMBackend": "memoryos_gpu.llm.vllm_backend",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value

"""``make_backend(kind, **options)``: build an :class:`LLMBackend` by name.

Heavy backends are imported only when asked for, so ``make_backend("openai", ...)`` never
imports torch and ``make_backend("scripted", ...)`` imports nothing beyond this package.

Every way a backend cannot be built from its settings (an unknown kind, an option its
constructor does not take, a required one missing, a value the constructor refuses) is one
:class:`~memoryos_gpu.llm.base.LLMConfigError` naming the backend and the option, so callers
(the CLI among them) report a misconfiguration instead of a ``TypeError`` traceback.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from memoryos_gpu.llm.base import LLMBackend, LLMConfigError

__all__ = ["BACKEND_KINDS", "backend_kind", "make_backend"]

BACKEND_KINDS: tuple[str, ...] = ("vllm", "openai", "transformers", "scripted")
_ALIASES = {
    "openai_compat": "openai",
    "openai-compat": "openai",
    "http": "openai",
    "hf": "transformers",
    "vllm_inproc": "vllm",
}
#: kind -> (module, class), imported on first use
_CLASSES = {
    "vllm": ("memoryos_gpu.llm.vllm_backend", "VLLMBackend"),
    "openai": ("memoryos_gpu.llm.openai_compat", "OpenAICompatBackend"),
    "transformers": ("memoryos_gpu.llm.transformers_backend", "TransformersBackend"),
    "scripted": ("memoryos_gpu.llm.scripted", "ScriptedBackend"),
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

    Raises :class:`LLMConfigError` when the backend cannot be built from ``options``, and
    :class:`~memoryos_gpu.llm.base.LLMBackendError` when its package or model is missing.
    """
    key = backend_kind(kind)
    if key not in _CLASSES:
        raise LLMConfigError(
            f"unknown LLM backend kind {kind!r}; expected one of: {', '.join(BACKEND_KINDS)}"
        )
    module, name = _CLASSES[key]
    cls = getattr(importlib.import_module(module), name)
    _check_options(key, cls, options)
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:  # a value the constructor refuses
        if isinstance(e, LLMConfigError):
            raise
        raise LLMConfigError(f"the {key} backend refused its options: {e}") from e


def _check_options(key: str, cls: type, options: dict[str, Any]) -> None:
    """Refuse options ``cls`` does not take and required ones that are missing, by name
    (Python's own ``TypeError`` would name ``__init__``, not the setting)."""
    params = inspect.signature(cls).parameters
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = sorted(set(options) - set(named))
    if unknown and not takes_any:
        raise LLMConfigError(
            f"the {key} backend has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(named)}"
        )
    missing = [n for n in named if params[n].default is inspect.Parameter.empty]
    missing = [n for n in missing if n not in options]
    if missing:
        raise LLMConfigError(f"the {key} backend needs the option {', '.join(map(repr, missing))}")

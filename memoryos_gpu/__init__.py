"""memoryos-gpu: the MemoryOS agent-memory design as a multi-user batch engine with native kernels.

Front door: :class:`MemoryEngine` (configured by :class:`EngineConfig`); kernels in
:mod:`memoryos_gpu.ops`; drop-in facade for BAI-LAB/MemoryOS users in :mod:`memoryos_gpu.compat`.

Names are imported lazily, so ``import memoryos_gpu.ops`` needs only NumPy and the extension
(a bare GPU image can run the kernels and their tests without the engine's dependencies).
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "EngineConfig": "memoryos_gpu.config",
    "LLMConfig": "memoryos_gpu.config",
    "MemoryConfig": "memoryos_gpu.config",
    "preset": "memoryos_gpu.config",
    "EngineClosedError": "memoryos_gpu.errors",
    "EngineForkedError": "memoryos_gpu.errors",
    "InvalidInputError": "memoryos_gpu.engine",
    "MemoryEngine": "memoryos_gpu.engine",
    "MemoryOSError": "memoryos_gpu.errors",
    "UnknownItemError": "memoryos_gpu.errors",
    "UnknownUserError": "memoryos_gpu.errors",
    # what a service catches (a second worker's StoreLockedError, a full disk's 507, an LLM
    # server down), from the modules that define them: each loaded on first use only
    "LLMBackendError": "memoryos_gpu.llm.base",
    "LLMConfigError": "memoryos_gpu.llm.base",
    "StoreError": "memoryos_gpu.store.errors",
    "StoreFullError": "memoryos_gpu.store.errors",
    "StoreLockedError": "memoryos_gpu.store.writer",
    "StoreUnavailableError": "memoryos_gpu.store.errors",
    "AddResult": "memoryos_gpu.types",
    "PageInput": "memoryos_gpu.types",
    "Response": "memoryos_gpu.types",
    "Retrieval": "memoryos_gpu.types",
    "RetrievedPage": "memoryos_gpu.types",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'memoryos_gpu' has no attribute {name!r}")

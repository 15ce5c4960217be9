"""memoryos-gpu: the MemoryOS agent-memory design as a multi-user batch engine with native kernels.

Front door: :class:`MemoryEngine` (configured by :class:`EngineConfig`); kernels in
:mod:`memoryos_gpu.ops`; drop-in facade for BAI-LAB/MemoryOS users in :mod:`memoryos_gpu.compat`.
"""

from memoryos_gpu.config import EngineConfig, LLMConfig, MemoryConfig, preset
from memoryos_gpu.engine import InvalidInputError, MemoryEngine
from memoryos_gpu.errors import MemoryOSError, UnknownUserError
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval, RetrievedPage

__all__ = [
    "AddResult",
    "EngineConfig",
    "InvalidInputError",
    "LLMConfig",
    "MemoryConfig",
    "MemoryEngine",
    "MemoryOSError",
    "PageInput",
    "Response",
    "Retrieval",
    "RetrievedPage",
    "UnknownUserError",
    "preset",
]
__version__ = "0.1.0"

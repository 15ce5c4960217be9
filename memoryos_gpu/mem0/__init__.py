"""mem0's API over the MemoryOS engine: :class:`Memory` in Python, the ``/v1/mem0`` routes of
the HTTP server (:mod:`memoryos_gpu.server.mem0_routes`). See docs/migrating-from-mem0.md."""

from .memory import Memory

__all__ = ["Memory"]

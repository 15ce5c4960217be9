"""Exceptions raised by memoryos-gpu. Each derives from a built-in so callers can catch broadly."""


class MemoryOSError(Exception):
    """Base class of every memoryos-gpu error."""


class ArenaError(MemoryOSError, ValueError):
    """Invalid arena operation: unknown slot, wrong shape, NaN embedding, ..."""


class NativeUnavailableError(MemoryOSError, ImportError):
    """The compiled extension is missing or lacks the requested backend (e.g. CUDA)."""


class UnknownUserError(MemoryOSError, KeyError):
    """An operation named a user the engine does not hold."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown user"


class EngineClosedError(MemoryOSError, RuntimeError):
    """An operation reached an engine (or its store) after ``close()``: a clear error instead
    of whatever the closed database connection would have raised, or a stale answer from
    memory that the store no longer backs."""


class UnknownItemError(MemoryOSError, KeyError):
    """An operation named a page or knowledge entry the store does not hold (never written, or
    deleted, possibly by a concurrent request between a caller's check and its edit). A
    ``KeyError`` as the engine raised before; the server answers 404."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown item"

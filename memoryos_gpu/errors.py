"""Exceptions raised by memoryos-gpu. Each derives from a built-in so callers can catch broadly."""

from __future__ import annotations

import os


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


class EngineForkedError(EngineClosedError):
    """An operation reached, in a forked child process, an engine its parent opened.

    Why refused: the child shares the parent's store connection, its writer lock and its locks
    (some maybe held by a thread that does not exist in the child), so its writes collided
    with the parent's and its calls could hang. An ``EngineClosedError``: to the child the
    engine is closed (a server maps it to 503, ``_process_owed`` keeps its work pending)."""

    @classmethod
    def of(cls, opened_in: int) -> EngineForkedError:
        """The refusal of an engine opened in process ``opened_in``, said with what to do."""
        return cls(
            f"this MemoryEngine was opened in process {opened_in}, and process {os.getpid()} "
            "is a fork of it: a forked child cannot use its parent's engine (they would share "
            "one store connection and writer lock). Open the engine after the fork, in the one "
            "process that writes the store: in gunicorn's post_fork hook (or without "
            "--preload), in Celery's worker_process_init signal, or with multiprocessing's "
            "'spawn' start method; or send the calls to that process (memoryos-gpu serve)"
        )

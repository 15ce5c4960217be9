"""The one interface through which every LLM call of the engine goes.

The engine collects the prompts of one pipeline stage (dialogue-chain continuity, chain meta
summary, topic summary + keywords, profile, knowledge extraction, response) across many users
into a batch of :class:`ChatRequest` and hands it to :meth:`LLMBackend.generate` in one call.
A backend answers with one :class:`ChatResult` per request, in the same order, and never raises
because one output was bad: that request's ``error`` (or ``parsed=None``) says so instead.
Only failures that affect every request (bad configuration, unreachable server, missing
package) raise :class:`LLMBackendError`.
"""

from __future__ import annotations

import abc
import asyncio
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memoryos_gpu.errors import MemoryOSError

__all__ = [
    "BackendStats",
    "ChatRequest",
    "ChatResult",
    "LLMBackend",
    "LLMBackendError",
    "LLMConfigError",
]

_ROLES = frozenset({"system", "user", "assistant"})


class LLMBackendError(MemoryOSError, RuntimeError):
    """A failure that affects every request: configuration, connection, missing package.

    ``retry_after``: seconds until the backend tries the server again, when it refuses for a
    known time (an HTTP backend's open circuit breaker), else None; the server's 503 tells
    its clients that wait (Retry-After) instead of a guess. An instance attribute (set by
    :meth:`refusing`) so that it travels with the error between processes."""

    retry_after: float | None = None

    @classmethod
    def refusing(cls, message: str, retry_after: float) -> LLMBackendError:
        """The error of a backend that refuses every call for ``retry_after`` more seconds
        (none when it is 0: the next call tries the server)."""
        exc = cls(message)
        if retry_after > 0:
            exc.retry_after = float(retry_after)
        return exc


class LLMConfigError(MemoryOSError, ValueError):
    """A backend cannot be built from its settings (unknown backend, an option it does not
    take or a bad value): raised before any work, naming the backend and the setting, so a
    misconfiguration reads as one and not as a traceback from inside a constructor."""


@dataclass(frozen=True)
class ChatRequest:
    """One chat completion to run.

    ``messages`` are OpenAI-style ``{"role": ..., "content": ...}`` dicts; a list is accepted and
    stored as a tuple. ``json_schema`` asks for structured output: backends constrain decoding
    where they can and always parse + repair the text into ``ChatResult.parsed``.
    """

    messages: tuple[dict[str, str], ...]
    json_schema: dict | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    stage: str = ""

    def __post_init__(self) -> None:
        msgs = self.messages
        if isinstance(msgs, (Mapping, str)):
            raise TypeError("ChatRequest.messages must be a sequence of {'role', 'content'} dicts")
        if not isinstance(msgs, tuple):
            object.__setattr__(self, "messages", tuple(msgs))
        if not self.messages:
            raise ValueError("ChatRequest.messages must not be empty")
        for m in self.messages:
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"bad chat message {m!r}: needs 'role' and 'content'")
            if m["role"] not in _ROLES:
                raise ValueError(f"bad chat role {m['role']!r}; expected one of {sorted(_ROLES)}")
            if not isinstance(m["content"], str):
                raise TypeError(f"chat message content must be str, got {type(m['content'])}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def __hash__(self) -> int:  # dict fields are unhashable: hash a canonical JSON form
        return hash(
            (
                json.dumps(self.messages, sort_keys=True),
                json.dumps(self.json_schema, sort_keys=True, default=str),
                self.max_tokens,
                self.temperature,
                self.stage,
            )
        )


@dataclass
class ChatResult:
    """The answer to one :class:`ChatRequest`."""

    text: str
    parsed: dict | list | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failed(cls, error: str, prompt_tokens: int = 0) -> ChatResult:
        return cls(
            text="", parsed=None, prompt_tokens=prompt_tokens, completion_tokens=0, error=error
        )


_STAT_FIELDS = (
    "calls",
    "batches",
    "prompt_tokens",
    "completion_tokens",
    "retries",
    "repaired_json",
    "invalid_json",
    "errors",
)


@dataclass
class BackendStats:
    """Thread-safe counters. ``calls`` counts requests, ``batches`` counts generate() calls."""

    calls: int = 0
    batches: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: int = 0
    repaired_json: int = 0
    invalid_json: int = 0
    errors: int = 0
    by_stage: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                if k not in _STAT_FIELDS:
                    raise KeyError(f"unknown stat {k!r}")
                setattr(self, k, getattr(self, k) + int(v))

    def record_batch(self, requests: Sequence[ChatRequest], results: Sequence[ChatResult]) -> None:
        """Account one finished batch: request count, tokens, per-stage requests, errors."""
        with self._lock:
            self.batches += 1
            self.calls += len(requests)
            for req, res in zip(requests, results, strict=True):
                self.prompt_tokens += res.prompt_tokens
                self.completion_tokens += res.completion_tokens
                if res.error is not None:
                    self.errors += 1
                stage = req.stage or ""
                self.by_stage[stage] = self.by_stage.get(stage, 0) + 1

    def record_failed_batch(self, requests: Sequence[ChatRequest]) -> None:
        """Account a batch that failed as a whole (``generate`` raised: the server
        unreachable, failing every request, the breaker open): its requests count as calls and
        errors. Why: a backend whose every batch failed otherwise reported no calls and no
        errors at all, so its outage showed nowhere but the log."""
        with self._lock:
            self.batches += 1
            self.calls += len(requests)
            self.errors += len(requests)
            for req in requests:
                stage = req.stage or ""
                self.by_stage[stage] = self.by_stage.get(stage, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            d: dict[str, Any] = {k: getattr(self, k) for k in _STAT_FIELDS}
            d["by_stage"] = dict(self.by_stage)
            return d

    def reset(self) -> None:
        with self._lock:
            for k in _STAT_FIELDS:
                setattr(self, k, 0)
            self.by_stage.clear()


class LLMBackend(abc.ABC):
    """Batched chat completion. Subclasses implement :meth:`_generate_batch`.

    ``generate`` validates input, calls ``_generate_batch`` and does the accounting, so every
    backend counts the same way. The result list always has one entry per request.
    """

    name: str = "llm"

    def __init__(self) -> None:
        self.stats = BackendStats()

    def generate(self, requests: Sequence[ChatRequest]) -> list[ChatResult]:
        reqs = _check_requests(requests)
        if not reqs:
            return []
        try:
            results = self._generate_batch(reqs)
        except Exception:
            self.stats.record_failed_batch(reqs)
            raise
        if len(results) != len(reqs):  # a backend bug, not a bad output
            raise LLMBackendError(
                f"{self.name}: backend returned {len(results)} results for {len(reqs)} requests"
            )
        self.stats.record_batch(reqs, results)
        return results

    @abc.abstractmethod
    def _generate_batch(self, requests: list[ChatRequest]) -> list[ChatResult]:
        """Run a non-empty batch; one result per request, same order."""

    async def agenerate(self, requests: Sequence[ChatRequest]) -> list[ChatResult]:
        """Async variant; by default runs :meth:`generate` in a worker thread."""
        return await asyncio.to_thread(self.generate, list(requests))

    def close(self) -> None:  # noqa: B027 - optional hook: backends without resources skip it
        """Release models, sockets and threads. Idempotent."""

    def __enter__(self) -> LLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r}>"


def _check_requests(requests: Sequence[ChatRequest]) -> list[ChatRequest]:
    reqs = list(requests)
    for i, r in enumerate(reqs):
        if not isinstance(r, ChatRequest):
            raise TypeError(f"requests[{i}] is {type(r).__name__}, expected ChatRequest")
    return reqs


#: Sampling temperature of the one retry given to a structured output that did not parse.
JSON_RETRY_TEMPERATURE = 0.7


def retry_unparsed(
    requests: Sequence[ChatRequest],
    results: list[ChatResult],
    run: Callable[[list[ChatRequest], float], list[ChatResult]],
    stats: BackendStats,
) -> list[ChatResult]:
    """Give every structured request whose output did not parse one more try at a higher
    temperature (one batched call), keeping the token counts of both attempts."""
    redo = [
        i
        for i, (q, r) in enumerate(zip(requests, results, strict=True))
        if q.json_schema is not None and r.error is None and r.parsed is None
    ]
    if not redo:
        return results
    stats.add(retries=len(redo))
    again = run([requests[i] for i in redo], JSON_RETRY_TEMPERATURE)
    for i, r in zip(redo, again, strict=True):
        if r.error is None:
            results[i] = ChatResult(
                r.text,
                r.parsed,
                results[i].prompt_tokens + r.prompt_tokens,
                results[i].completion_tokens + r.completion_tokens,
            )
    return results

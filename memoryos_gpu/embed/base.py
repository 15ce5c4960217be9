"""What every embedder shares: the protocol the engine depends on, statistics, and a cache.

:class:`CachedEmbedder` does the work that does not depend on the backend -- input checks,
a thread-safe LRU cache keyed by the text's sha1, and embedding duplicates inside one call
once -- and hands the remaining unique texts to the backend's ``_embed`` in one call, which
batches them (one forward pass or one HTTP request per batch, never one per text).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from memoryos_gpu.errors import MemoryOSError

__all__ = [
    "CachedEmbedder",
    "EmbedderConfigError",
    "EmbedderProtocol",
    "EmbedderStats",
    "EmbeddingError",
    "check_texts",
    "encode_checked",
]


class EmbeddingError(MemoryOSError, RuntimeError):
    """An embedding backend failed in a way retrying did not fix (a server unreachable or
    refusing requests, a bad reply). A :class:`~memoryos_gpu.errors.MemoryOSError`, as the
    LLM's ``LLMBackendError`` is, so that the CLI prints it as one ``error: ...`` line and the
    servers report it as the engine's own error; a ``RuntimeError`` as it always was."""


class EmbedderConfigError(MemoryOSError, ValueError):
    """The configuration names an embedder without a setting it needs (``openai`` without
    ``embedding_model`` or ``embedding_base_url``): the LLM's ``LLMConfigError`` for
    embedders, a ``ValueError`` as before."""


@runtime_checkable
class EmbedderProtocol(Protocol):
    """What the engine needs from an embedder."""

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """float32 ``[len(texts), dim]``, rows in input order."""
        ...

    @property
    def dim(self) -> int: ...

    @property
    def model_id(self) -> str:
        """Identifies the vector space: vectors with different ids do not mix."""
        ...


@dataclass
class EmbedderStats:
    hits: int = 0  # texts served from the cache (or duplicates within one call)
    misses: int = 0  # texts that had to be embedded
    batches: int = 0  # forward passes (or HTTP requests)
    tokens: int = 0  # real (non-padding) tokens embedded (local models)
    padded_tokens: int = 0  # tokens including padding (tokens / padded_tokens = efficiency)
    retries: int = 0  # requests repeated after a transient failure (remote backends)
    cached: int = 0  # vectors in the cache now (at most the embedder's cache_size)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def check_texts(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list, refusing a bare string (a classic mistake) and non-strings."""
    if isinstance(texts, str):
        raise TypeError("encode expects a sequence of strings, not a single str")
    out = list(texts)
    for t in out:
        if not isinstance(t, str):
            raise TypeError(f"encode expects strings, got {type(t).__name__}")
    return out


def encode_checked(embedder: EmbedderProtocol, texts: Sequence[str]) -> np.ndarray:
    """``embedder.encode(texts)`` as float32 ``[len(texts), dim]`` of finite values, else
    :class:`EmbeddingError` naming the embedder. The engine encodes through this: it stores
    the vectors, and a custom embedder's rows of the wrong width, too few rows or a NaN were
    committed as they came, after which every derived-work round that read them failed, for
    every user in it (rounds mix users), until the page was found and deleted."""
    n, dim = len(texts), embedder.dim
    out = np.asarray(embedder.encode(texts), dtype=np.float32)
    if out.shape != (n, dim):
        raise EmbeddingError(
            f"embedder {embedder.model_id!r} returned an array of shape {out.shape} for {n} "
            f"texts; the engine needs ({n}, {dim}): one row of its dim per text"
        )
    if not np.isfinite(out).all():
        raise EmbeddingError(f"embedder {embedder.model_id!r} returned NaN or infinite values")
    return out


class CachedEmbedder:
    """Base of the real embedders: subclasses set ``_dim`` and ``_model_id`` and implement
    :meth:`_embed` (unique, uncached texts -> float32 rows in the same order).

    ``encode`` is thread-safe: one backend call at a time per instance, so the cache and the
    statistics stay consistent and a model is never run from two threads at once.
    """

    _dim: int
    _model_id: str

    def __init__(self, cache_size: int = 100_000) -> None:
        if cache_size < 0:
            raise ValueError("cache_size >= 0 required")
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = EmbedderStats()

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def model_id(self) -> str:
        return self._model_id

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self.stats.cached = 0

    def _embed(self, texts: list[str]) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` -> float32 ``[n, dim]`` in input order.

        Cached texts are not embedded again; duplicates inside one call are embedded once
        (counted as hits). The returned array is a fresh copy.
        """
        texts = check_texts(texts)
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        if not texts:
            return out
        keys = [hashlib.sha1(t.encode("utf-8", "surrogatepass")).digest() for t in texts]
        with self._lock:
            todo: dict[bytes, list[int]] = {}
            todo_text: list[str] = []
            for i, k in enumerate(keys):
                vec = self._cache.get(k) if self.cache_size else None
                if vec is not None:
                    self._cache.move_to_end(k)
                    out[i] = vec
                    self.stats.hits += 1
                elif k in todo:
                    todo[k].append(i)
                    self.stats.hits += 1
                else:
                    todo[k] = [i]
                    todo_text.append(texts[i])
                    self.stats.misses += 1
            if todo_text:
                self._store(out, todo, self._embed(todo_text))
        return out

    def _store(self, out: np.ndarray, todo: dict[bytes, list[int]], vecs: np.ndarray) -> None:
        """Scatter fresh vectors into ``out`` and the cache (caller holds the lock)."""
        for vec, (k, rows) in zip(vecs, todo.items(), strict=True):
            out[rows] = vec
            if self.cache_size:
                v = vec.copy()
                v.flags.writeable = False
                self._cache[k] = v
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        self.stats.cached = len(self._cache)

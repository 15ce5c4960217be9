"""A deterministic, model-free embedder for tests (feature hashing)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from memoryos_gpu.embed.base import EmbedderStats, check_texts
from memoryos_gpu.text.keywords import tokenize

__all__ = ["HashingEmbedder"]


@lru_cache(maxsize=200_000)
def _feature_slot(seed: int, dim: int, feature: str) -> tuple[int, float]:
    h = hashlib.blake2b(feature.encode("utf-8"), digest_size=8, key=seed.to_bytes(8, "little"))
    v = int.from_bytes(h.digest(), "little")
    return v % dim, (1.0 if (v >> 63) & 1 else -1.0)


class HashingEmbedder:
    """Deterministic, model-free embedder for tests (feature hashing).

    Features of a text: its word tokens (:func:`memoryos_gpu.text.keywords.tokenize`,
    stopwords removed; weight 1) and the character trigrams of each token
    (weight ``trigram_weight``), hashed with keyed blake2b into ``dim`` signed
    slots, then L2-normalised. Texts sharing words therefore get high cosine,
    unrelated texts near 0; the same text always gives the same vector in every
    process. A text with no tokens (e.g. ``""``) gets the fixed vector of a
    sentinel feature, so every row has unit norm.
    """

    def __init__(self, dim: int = 384, seed: int = 0, trigram_weight: float = 0.5) -> None:
        if dim < 1:
            raise ValueError("dim must be >= 1")
        self._dim = int(dim)
        self.seed = int(seed)
        self.trigram_weight = float(trigram_weight)
        self.stats = EmbedderStats()

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def model_id(self) -> str:
        return f"hashing-{self._dim}-s{self.seed}-t{self.trigram_weight:g}"

    def _vector(self, text: str) -> np.ndarray:
        v = np.zeros(self._dim, dtype=np.float64)
        toks = tokenize(text)
        if not toks:
            toks = ["\x00empty"]
        for tok in toks:
            i, s = _feature_slot(self.seed, self._dim, "w:" + tok)
            v[i] += s
            if self.trigram_weight and len(tok) > 2:
                padded = f"<{tok}>"
                for j in range(len(padded) - 2):
                    i, s = _feature_slot(self.seed, self._dim, "c:" + padded[j : j + 3])
                    v[i] += s * self.trigram_weight
        norm = np.linalg.norm(v)
        if norm == 0.0:  # pathological cancellation: fall back to one slot
            i, s = _feature_slot(self.seed, self._dim, "\x00empty")
            v[i] = s
            norm = 1.0
        return (v / norm).astype(np.float32)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = check_texts(texts)
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        for r, t in enumerate(texts):
            out[r] = self._vector(t)
        self.stats.misses += len(texts)
        return out

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


@lru_cache(maxsize=100_000)
def _token_features(
    seed: int, dim: int, trigram_weight: float, tok: str
) -> tuple[np.ndarray, np.ndarray]:
    """A token's signed slots and weights, in the order they are added: the word, then its
    padded trigrams (cached per token: a text repeats the words of earlier texts)."""
    i, s = _feature_slot(seed, dim, "w:" + tok)
    slots, weights = [i], [s]
    if trigram_weight and len(tok) > 2:
        padded = f"<{tok}>"
        for j in range(len(padded) - 2):
            i, s = _feature_slot(seed, dim, "c:" + padded[j : j + 3])
            slots.append(i)
            weights.append(s * trigram_weight)
    return np.array(slots, np.intp), np.array(weights, np.float64)


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

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """One ``np.bincount`` for the batch over every text's features (row * dim + slot).

        Bit-identical to adding the features one by one into each row in text order (the
        loop of earlier versions, kept in ``tests/test_embedding.py``): bincount adds each
        slot's values in array order, which is that order."""
        texts = check_texts(texts)
        n, d = len(texts), self._dim
        if not n:
            return np.empty((0, d), dtype=np.float32)
        seed, tw = self.seed, self.trigram_weight
        slots: list[np.ndarray] = []
        weights: list[np.ndarray] = []
        rows: list[int] = []
        for r, text in enumerate(texts):
            for tok in tokenize(text) or ["\x00empty"]:
                sl, w = _token_features(seed, d, tw, tok)
                slots.append(sl)
                weights.append(w)
                rows.append(r)
        sizes = np.fromiter(map(len, slots), np.intp, len(slots))
        flat = np.concatenate(slots) + np.repeat(np.asarray(rows, np.intp) * d, sizes)
        v = np.bincount(flat, np.concatenate(weights), n * d).reshape(n, d)
        out = np.empty((n, d), dtype=np.float32)
        for r in range(n):
            norm = np.linalg.norm(v[r])
            if norm == 0.0:  # pathological cancellation: fall back to one slot
                i, s = _feature_slot(self.seed, d, "\x00empty")
                v[r] = 0.0
                v[r, i] = s
                norm = 1.0
            out[r] = (v[r] / norm).astype(np.float32)
        self.stats.misses += len(texts)
        return out

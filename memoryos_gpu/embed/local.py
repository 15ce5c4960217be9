"""Local transformers encoders: :class:`Embedder` (torch) and the pooling both local backends use.

The folder's own pooling and normalisation are honoured (:mod:`.folder`); texts longer than
the folder's ``max_seq_length`` (256 for MiniLM) are **truncated by the tokenizer** (the tail
is ignored). Texts are tokenized once, sorted by length and cut into batches, so each batch
pads to its own longest text; a batch costs one tokenizer call and one forward pass.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from memoryos_gpu.embed.base import CachedEmbedder
from memoryos_gpu.embed.folder import FolderSpec, bundled_minilm_path, read_folder
from memoryos_gpu.extras import require

__all__ = ["Embedder", "pool"]


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


def pool(hidden: Any, mask: Any, modes: tuple[str, ...], normalize: bool) -> Any:
    """sentence-transformers' pooling of ``hidden [B, L, H]`` (fp32 torch) under ``mask
    [B, L]``: the modes' vectors concatenated, then optionally L2-normalised."""
    import torch

    m = mask.unsqueeze(-1).to(hidden.dtype)
    counts = m.sum(dim=1).clamp(min=1e-9)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(hidden[rows, mask.argmax(dim=1)])  # first real token (left padding too)
        elif mode == "max":
            parts.append(hidden.masked_fill(m == 0, -1e9).max(dim=1).values)
        elif mode == "mean":
            parts.append((hidden * m).sum(dim=1) / counts)
        elif mode == "mean_sqrt_len":
            parts.append((hidden * m).sum(dim=1) / counts.sqrt())
        else:  # lasttoken: the last real token
            width = mask.shape[1]
            last = width - 1 - mask.flip(dims=[1]).argmax(dim=1)
            parts.append(hidden[rows, last])
    pooled = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1, eps=1e-12)
    return pooled


class Embedder(CachedEmbedder):
    """Batched, cached sentence embedder over a local transformers encoder (torch).

    Args:
        model_path: local model folder (plain transformers or sentence-transformers);
            ``None`` = the bundled all-MiniLM-L6-v2. Nothing is ever downloaded.
        device: ``"auto"`` (CUDA when available, else CPU), or any torch device.
        dtype: ``"auto"`` (fp16 on CUDA, fp32 on CPU), ``"float32"``,
            ``"float16"``, ``"bfloat16"`` or a ``torch.dtype``. Pooling and
            normalisation always run in fp32; outputs are float32.
        pooling, normalize, max_length: override what the folder says (see
            :func:`~memoryos_gpu.embed.folder.read_folder`); ``None`` = the folder's.
        batch_size: texts per forward pass.
        cache_size: LRU entries (keyed by sha1 of the text); 0 disables caching.
        num_threads: torch CPU threads (see :func:`_configure_threads`).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        device: str = "auto",
        dtype: Any = "auto",
        pooling: str | None = None,
        normalize: bool | None = None,
        batch_size: int = 64,
        max_length: int | None = None,
        cache_size: int = 100_000,
        num_threads: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size >= 1 required")
        super().__init__(cache_size)
        path = Path(model_path) if model_path is not None else bundled_minilm_path()
        self.spec: FolderSpec = read_folder(path.resolve(), pooling, normalize, max_length)
        self.model_path = self.spec.path
        self.batch_size = int(batch_size)
        self.max_length = self.spec.max_length
        self.pooling = "+".join(self.spec.pooling)
        self.normalize = self.spec.normalize
        self._model_id = self.spec.model_id()
        AutoTokenizer = require("transformers", "embed", "the local embedder").AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            str(self.spec.transformer), local_files_only=True
        )
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer of {self.spec.transformer} has no pad token")
        self._load_model(device, dtype, num_threads)

    # ------------------------------------------------------------ the model (overridable)
    def _load_model(self, device: str, dtype: Any, num_threads: int | None) -> None:
        torch = require("torch", "embed", "the local embedder")
        from transformers import AutoModel

        self._torch = torch
        _configure_threads(torch, num_threads)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = self._resolve_dtype(dtype)
        model = AutoModel.from_pretrained(str(self.spec.transformer), local_files_only=True)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self._dim = int(self.model.config.hidden_size) * len(self.spec.pooling)

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

    def _forward(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """Pooled float32 rows of one padded batch (``input_ids``, ``attention_mask``, ...)."""
        torch = self._torch
        inputs = {k: torch.from_numpy(v).to(self.device) for k, v in batch.items()}
        with torch.inference_mode():
            hidden = self.model(**inputs).last_hidden_state.float()
            out = pool(hidden, inputs["attention_mask"], self.spec.pooling, self.normalize)
        return out.cpu().numpy()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._model_id}, pooling={self.pooling}, "
            f"normalize={self.normalize}, dim={self._dim})"
        )

    # --------------------------------------------------------------------------- encode
    def _embed(self, texts: list[str]) -> np.ndarray:
        """Embed unique texts (no cache): length-sorted batches, rows in input order."""
        if self.spec.lowercase:
            texts = [t.lower() for t in texts]
        lengths = self.tokenizer(
            texts,
            truncation=True,
            max_length=self.max_length,
            return_attention_mask=False,
            return_token_type_ids=False,
            return_length=True,
        )["length"]
        order = np.argsort(np.asarray(lengths), kind="stable")
        result = np.empty((len(texts), self._dim), dtype=np.float32)
        for s in range(0, len(order), self.batch_size):
            chunk = order[s : s + self.batch_size]
            enc = self.tokenizer(
                [texts[i] for i in chunk],
                truncation=True,
                max_length=self.max_length,
                padding="longest",
                return_tensors="np",
            )
            batch = {k: np.asarray(v, dtype=np.int64) for k, v in enc.items()}
            self.stats.tokens += int(batch["attention_mask"].sum())
            self.stats.padded_tokens += int(batch["input_ids"].size)
            self.stats.batches += 1
            result[chunk] = self._forward(batch)
        return result

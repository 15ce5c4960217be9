"""The CPU-fast backend: the same model folder, exported to ONNX and quantized to int8.

:func:`export_int8` exports a local model folder with ``torch.onnx.export`` (nothing is
downloaded), checks the fp32 export against torch, quantizes its weight matrices to int8
(``onnxruntime.quantization.quantize_dynamic``: per-channel int8 weights, activations
quantized on the fly per batch) and keeps the result in a cache directory, keyed by the
model's files and the library versions, so the export runs once per machine.
:class:`OnnxEmbedder` is :class:`~memoryos_gpu.embed.local.Embedder` with the forward pass
on onnxruntime: the same tokenization, batching, pooling and normalisation, and the same
model id (int8 is a precision of the model, like fp16 on CUDA, not another vector space).

Needs ``pip install 'memoryos-gpu[embed-fast]'`` (onnxruntime and onnx).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from memoryos_gpu.embed.base import EmbeddingError
from memoryos_gpu.embed.folder import FolderSpec
from memoryos_gpu.embed.local import Embedder, _available_cpus, pool

__all__ = ["OnnxEmbedder", "default_cache_dir", "export_int8"]

ENV_CACHE = "MEMORYOS_GPU_CACHE"
_RECIPE = "int8-dynamic-matmul-per-channel-v1"  # part of the cache key: change on any change
_PROBE = ["a short probe", "a somewhat longer probe sentence to check the exported graph"]


def default_cache_dir() -> Path:
    """``$MEMORYOS_GPU_CACHE``, else ``$XDG_CACHE_HOME/memoryos-gpu``, else ~/.cache/..."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "memoryos-gpu"


def _require_onnx() -> Any:
    try:
        import onnxruntime
        import onnxruntime.quantization
    except ImportError as exc:
        raise ImportError(
            f"embedder='onnx' needs onnxruntime and onnx ({exc}): "
            "pip install 'memoryos-gpu[embed-fast]'"
        ) from None
    return onnxruntime


def _cache_key(spec: FolderSpec) -> str:
    """Changes when the model's files, the export recipe or the libraries change."""
    h = hashlib.sha1(_RECIPE.encode())
    for f in sorted(spec.transformer.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}|".encode())
    for lib in ("torch", "transformers", "onnxruntime", "onnx"):
        h.update(f"{lib}={importlib.metadata.version(lib)}|".encode())
    return h.hexdigest()[:16]


def export_int8(spec: FolderSpec, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the int8 ONNX model of ``spec``'s transformer, exporting it on first use."""
    _require_onnx()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.model_id())
    target = root / "onnx" / f"{name}-{_cache_key(spec)}" / "model_int8.onnx"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        fp32, int8 = Path(tmp) / "model.onnx", Path(tmp) / "model_int8.onnx"
        _export_fp32(spec, fp32)
        _quantize(fp32, int8)
        os.replace(int8, target)  # atomic: a concurrent exporter wins or loses whole
    return target


def _quantize(fp32: Path, int8: Path) -> None:
    """Per-channel int8 weights of every MatMul; embeddings and LayerNorms stay fp32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()  # the quantizer logs an irrelevant advice on the root logger
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_dynamic(
            fp32,
            int8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=["MatMul"],
        )
    finally:
        root.setLevel(level)


def _export_fp32(spec: FolderSpec, out: Path) -> None:
    """torch -> ONNX (dynamic batch and length), refused unless it reproduces torch."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(spec.transformer), local_files_only=True)
    model = AutoModel.from_pretrained(str(spec.transformer), local_files_only=True).eval()
    probe = {
        k: torch.from_numpy(np.asarray(v, np.int64))
        for k, v in tok(_PROBE, padding="longest", return_tensors="np").items()
    }
    names = list(probe)
    with torch.no_grad():  # before exporting: after tracing, its outputs differed (seen)
        want = model(**probe).last_hidden_state.numpy()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            return self.model(**dict(zip(names, args, strict=True))).last_hidden_state

    axes = {n: {0: "batch", 1: "tokens"} for n in [*names, "last_hidden_state"]}
    with warnings.catch_warnings():  # the tracer's warnings are about shapes it fixes
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Hidden(),
            tuple(probe[n] for n in names),
            str(out),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    import onnxruntime

    got = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(
        None, {k: v.numpy() for k, v in probe.items()}
    )[0]
    real = probe["attention_mask"].numpy().astype(bool)  # padding positions hold anything
    err = float(np.abs(got - want)[real].max())
    if err > 1e-3:
        raise EmbeddingError(f"ONNX export of {spec.transformer} differs from torch by {err:.3g}")


class OnnxEmbedder(Embedder):
    """:class:`Embedder` on onnxruntime with int8 weights (CPU).

    Args: those of :class:`Embedder` (``device`` and ``dtype`` must stay ``"auto"``/``"cpu"``;
    the model is int8 on the CPU), plus ``cache_dir`` for the exported model (default
    :func:`default_cache_dir`). ``num_threads``: onnxruntime's intra-op threads (default: the
    CPUs this process may use).
    """

    def __init__(self, *args: Any, cache_dir: str | os.PathLike[str] | None = None, **kw: Any):
        self._cache_dir = cache_dir
        super().__init__(*args, **kw)

    def _load_model(self, device: str, dtype: Any, num_threads: int | None) -> None:
        if device not in ("auto", "cpu") or dtype not in ("auto", None, "float32"):
            raise ValueError("embedder='onnx' runs int8 on the CPU: leave device and dtype auto")
        ort = _require_onnx()
        self.onnx_path = export_int8(self.spec, self._cache_dir)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(num_threads or _available_cpus())
        opts.inter_op_num_threads = 1
        # threads sleep between batches instead of spinning (the CPUs are often shared)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            str(self.onnx_path), opts, providers=["CPUExecutionProvider"]
        )
        self._inputs = [i.name for i in self.session.get_inputs()]
        hidden = self.session.get_outputs()[0].shape[-1]
        if not isinstance(hidden, int):
            raise EmbeddingError(f"{self.onnx_path}: hidden size is not fixed ({hidden})")
        self._dim = hidden * len(self.spec.pooling)

    def _forward(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        import torch

        feed = {k: batch[k] for k in self._inputs}
        hidden = torch.from_numpy(self.session.run(None, feed)[0]).float()
        mask = torch.from_numpy(batch["attention_mask"])
        return pool(hidden, mask, self.spec.pooling, self.normalize).numpy()

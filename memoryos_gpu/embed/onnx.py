"""The CPU-fast backend: the same model folder, exported to ONNX and quantized to int8.

:func:`export_int8` exports a local model folder with ``torch.onnx.export`` (nothing is
downloaded), fuses the graph with onnxruntime's transformer optimizer (one op per attention
block, embedding + LayerNorm, bias + GELU, residual + LayerNorm), checks the fp32 export and
the fused graph against torch, quantizes the weights of the matrix products, the attention
blocks and the embedding tables to int8 (``onnxruntime.quantization.quantize_dynamic``:
per-channel weights, activations quantized on the fly per batch), checks the result's
sentence vectors against torch's and keeps it in a cache directory, keyed by the model's
files, the recipe and the library versions, so the export runs once per machine.
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

__all__ = ["DEFAULT_BATCH_SIZE", "OnnxEmbedder", "default_cache_dir", "export_int8"]

ENV_CACHE = "MEMORYOS_GPU_CACHE"
_RECIPE = "bert-fused-int8-dynamic-matmul-attention-embed-per-channel-v2"  # in the cache key
_PROBE = ["a short probe", "a somewhat longer probe sentence to check the exported graph"]
#: quantized op types: after fusion, QKV projections live in ``Attention`` and the embedding
#: tables in ``EmbedLayerNormalization`` (quantizing both: ~10% less CPU, 23 MB, not 66)
_QUANTIZED_OPS = ["MatMul", "Attention", "EmbedLayerNormalization"]
_FP32_TOLERANCE = 1e-3  # max |hidden state| difference of an fp32 graph from torch
_INT8_MIN_COS = 0.95  # least cosine of an int8 sentence vector to torch's (the tests' bound)
#: texts per onnxruntime call: on a 2-core Zen 3 (1 MiB L2 per core), 16 used ~10% less CPU
#: per text than 64 (activations stay in cache) and 8 no less than 16
DEFAULT_BATCH_SIZE = 16


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
        fp32, fused, int8 = (Path(tmp) / f"model{s}.onnx" for s in ("", "_fused", "_int8"))
        inputs = _probe_inputs(spec)
        probe = _Probe(spec, inputs, _export_fp32(spec, fp32, inputs))
        probe.check(fp32, "the ONNX export")
        probe.check(_fuse(spec, fp32, fused), "the fused ONNX graph")
        _quantize(fused, int8)
        probe.check_int8(int8)
        os.replace(int8, target)  # atomic: a concurrent exporter wins or loses whole
    return target


def _probe_inputs(spec: FolderSpec) -> dict[str, Any]:
    """The tokenized :data:`_PROBE` sentences (torch int64 tensors, padded)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(spec.transformer), local_files_only=True)
    return {
        k: torch.from_numpy(np.asarray(v, np.int64))
        for k, v in tok(_PROBE, padding="longest", return_tensors="np").items()
    }


class _Probe:
    """The probe inputs and torch's fp32 hidden states for them: the reference every graph
    is checked against before it is cached (a wrong graph would be kept for good)."""

    def __init__(self, spec: FolderSpec, inputs: dict[str, Any], want: np.ndarray) -> None:
        self.spec, self.inputs, self.want = spec, inputs, want
        self.mask = inputs["attention_mask"]

    def run(self, path: Path) -> np.ndarray:
        import onnxruntime

        sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        return sess.run(None, {k: v.numpy() for k, v in self.inputs.items() if k in names})[0]

    def check(self, path: Path, what: str) -> Path:
        """Refuse ``path`` unless its hidden states match torch's at the real tokens."""
        real = self.mask.numpy().astype(bool)  # padding positions hold anything
        err = float(np.abs(self.run(path) - self.want)[real].max())
        if err > _FP32_TOLERANCE:
            raise EmbeddingError(
                f"{what} of {self.spec.transformer} differs from torch by {err:.3g}"
            )
        return path

    def check_int8(self, path: Path) -> None:
        """Refuse an int8 graph whose sentence vectors stray from torch's (cosine)."""
        import torch

        def vectors(hidden: np.ndarray) -> np.ndarray:
            h = torch.from_numpy(np.asarray(hidden, np.float32))
            return pool(h, self.mask, self.spec.pooling, True).numpy()

        cos = float((vectors(self.run(path)) * vectors(self.want)).sum(axis=1).min())
        if cos < _INT8_MIN_COS:
            raise EmbeddingError(
                f"int8 model of {self.spec.transformer}: cosine {cos:.3f} to torch's vectors "
                f"(< {_INT8_MIN_COS})"
            )


def _fuse(spec: FolderSpec, fp32: Path, out: Path) -> Path:
    """onnxruntime's BERT fusions (attention, embedding + LayerNorm, GELU, skip LayerNorm).

    ``opt_level=1`` keeps the graph free of CPU-specific layouts, as quantization wants; a
    model the fuser does not recognise comes out unfused and is still checked and used.
    """
    import json

    from onnxruntime.transformers.optimizer import optimize_model

    config = json.loads((spec.transformer / "config.json").read_text())
    heads, hidden = (int(config.get(k, 0)) for k in ("num_attention_heads", "hidden_size"))
    level = logging.getLogger("onnxruntime.transformers")  # logs each fusion it tries
    old = level.level
    level.setLevel(logging.ERROR)
    try:
        model = optimize_model(str(fp32), "bert", heads, hidden, opt_level=1)
    finally:
        level.setLevel(old)
    model.save_model_to_file(str(out))
    return out


def _quantize(fp32: Path, int8: Path) -> None:
    """Per-channel int8 weights of :data:`_QUANTIZED_OPS`; LayerNorms and GELU stay fp32."""
    import onnx
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
            op_types_to_quantize=_QUANTIZED_OPS,
            # shape inference does not type the fused (com.microsoft) ops' outputs
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    finally:
        root.setLevel(level)


def _export_fp32(spec: FolderSpec, out: Path, probe: dict[str, Any]) -> np.ndarray:
    """torch -> ONNX (dynamic batch and length); returns torch's hidden states of ``probe``.

    Eager attention: its graph is the pattern onnxruntime's fuser recognises (the SDPA
    export fused no attention block); both implementations give the same outputs.
    """
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(
        str(spec.transformer), local_files_only=True, attn_implementation="eager"
    ).eval()
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
    return want


class OnnxEmbedder(Embedder):
    """:class:`Embedder` on onnxruntime with int8 weights (CPU).

    Args: those of :class:`Embedder` (``device`` and ``dtype`` must stay ``"auto"``/``"cpu"``;
    the model is int8 on the CPU), plus ``cache_dir`` for the exported model (default
    :func:`default_cache_dir`). ``batch_size`` defaults to :data:`DEFAULT_BATCH_SIZE` (tuned
    for CPU caches). ``num_threads``: onnxruntime's intra-op threads (default: the CPUs this
    process may use).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        cache_dir: str | os.PathLike[str] | None = None,
        **kw: Any,
    ) -> None:
        self._cache_dir = cache_dir
        super().__init__(model_path, batch_size=batch_size, **kw)

    def _load_model(self, device: str, dtype: Any, num_threads: int | None) -> None:
        if device not in ("auto", "cpu") or dtype not in ("auto", None, "float32"):
            raise ValueError("embedder='onnx' runs int8 on the CPU: leave device and dtype auto")
        ort = _require_onnx()
        self.onnx_path = export_int8(self.spec, self._cache_dir)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # one op at a time, all threads
        opts.intra_op_num_threads = int(num_threads or _available_cpus())
        opts.inter_op_num_threads = 1
        # threads sleep between ops instead of spinning: on the shared 2-core CI machine
        # spinning cost 35-50% more CPU per text and more wall time, not less
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

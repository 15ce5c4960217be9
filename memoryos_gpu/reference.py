"""The reference implementation's conventions (BAI-LAB/MemoryOS), shared by the
:mod:`~memoryos_gpu.compat` facade and the MCP server, so both read the same settings the same
way and a data path means the same store to both.

* :class:`ReferenceSettings`: the reference ``Memoryos(...)`` arguments, which are also the keys
  of its MCP server's ``config.json`` (:func:`load_config_json`), with its defaults; unknown keys
  and wrong types are refused with the key's name.
* :func:`engine_config`: those settings as an :class:`~memoryos_gpu.config.EngineConfig` (the
  ``reference`` preset plus the given capacities, the LLM backend, the store of the data path).
* Timestamps: the reference keeps them as the strings it was given and stamps "now" in local
  time. Here pages hold epoch seconds (heat, recency and ordering need instants), so a naive
  timestamp is read as *local* time (:func:`read_timestamp`) and printed back in local time
  (:func:`page_stamp`); one the local clock cannot print back as given (a zone offset, ISO
  ``T``, fractions, other formats) is also kept verbatim in the page's metadata under
  :data:`GIVEN_KEY` and printed from there.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memoryos_gpu.config import (
    LLM_DEDICATED,
    ConfigError,
    EngineConfig,
    LLMConfig,
    MemoryConfig,
    explain_settings_error,
    preset,
)

__all__ = [
    "GIVEN_KEY",
    "LLM_ERROR_TEXT",
    "ConfigError",
    "ReferenceSettings",
    "engine_config",
    "load_config_json",
    "page_stamp",
    "read_timestamp",
    "stamp",
    "user_meta",
]

STAMP_FORMAT = "%Y-%m-%d %H:%M:%S"
#: Page-metadata key holding a timestamp the local clock cannot print back as given.
GIVEN_KEY = "_timestamp"
#: What the reference's ``get_response`` returns when its LLM call fails.
LLM_ERROR_TEXT = "Error: Could not get response from LLM."
DEFAULT_ASSISTANT_ID = "default_assistant_profile"
OPENAI_BASE_URL = "https://api.openai.com/v1"
OPENAI_DEFAULT_MODEL = "gpt-4o-mini"
_MINILM_NAMES = {"", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"}
_NO_LLM = {"none", "extractive"}
# embedding_model_kwargs the reference passes to sentence-transformers, and what they mean here
_EMBEDDING_KWARGS = {"use_fp16", "device", "batch_size"}


class ReferenceSettings(BaseModel):
    """The reference ``Memoryos`` arguments (= its ``config.json`` keys) with its defaults, plus
    this project's few extras (``llm_backend``, ``llm_options``, ``device``, ``preset``,
    ``memory``)."""

    # strict: a config file's "10" or true is refused, not read as 10 or 1; openai_api_key is
    # a secret: errors name it, never show the value given (explain_settings_error)
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, hide_input_in_errors=True)

    user_id: str | None = Field(None, min_length=1, description="Whose memory (MCP: default).")
    openai_api_key: str | None = Field(None, description="Key of the OpenAI-compatible server.")
    openai_base_url: str | None = Field(None, description="OpenAI-compatible server URL.")
    data_storage_path: str = Field("./memoryos_data", description="Folder of the store.")
    assistant_id: str = Field(DEFAULT_ASSISTANT_ID, min_length=1)
    short_term_capacity: int = Field(10, ge=1)
    mid_term_capacity: int = Field(2000, ge=1)
    long_term_knowledge_capacity: int = Field(100, ge=1)
    retrieval_queue_capacity: int = Field(7, ge=1, description="MTM pages per retrieval.")
    # ge=0 here, not only on MemoryConfig.tau: the error must name this key, not the field
    mid_term_heat_threshold: float = Field(5.0, ge=0, description="Heat that promotes a segment.")
    mid_term_similarity_threshold: float = Field(
        0.6, ge=-1.0, le=2.0, description="Segment merge threshold (cos + Jaccard: -1 to 2)."
    )
    llm_model: str | None = Field(None, description="Model name (openai: gpt-4o-mini).")
    embedding_model_name: str | None = Field("all-MiniLM-L6-v2")
    embedding_model_kwargs: dict[str, Any] | None = None
    llm_backend: str | None = Field(
        None,
        description="openai | vllm | transformers | scripted | none (default: openai "
        "when a key or base URL is given, else none: LLM-free).",
    )
    llm_options: dict[str, Any] = Field(default_factory=dict, description="Backend options.")
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$")
    preset: str = Field("reference", description="Memory preset the capacities apply to.")
    memory: dict[str, Any] = Field(default_factory=dict, description="MemoryConfig overrides.")


def _explain(exc: ValidationError, where: str, model: type[BaseModel]) -> ConfigError:
    """A pydantic error as one clause per offending key (what a config file's author needs;
    never a value, since openai_api_key is a secret)."""
    return ConfigError(f"{where}: {explain_settings_error(exc, model)}")


def settings(values: Mapping[str, Any], where: str = "settings") -> ReferenceSettings:
    """Validate reference-style settings; empty strings (the reference's ``config.json`` ships
    ``"openai_api_key": ""``) count as not given, ``data_storage_path`` included: it then
    takes its default, ``./memoryos_data`` (it was read as the current directory, a store
    made wherever the server happened to start)."""
    cleaned = {k: (None if v == "" else v) for k, v in values.items()}
    cleaned = {k: v for k, v in cleaned.items() if v is not None}
    try:
        return ReferenceSettings.model_validate(cleaned)
    except ValidationError as exc:
        raise _explain(exc, where, ReferenceSettings) from None


def load_config_json(path: str | Path) -> ReferenceSettings:
    """The reference MCP server's ``config.json`` (same keys, same meaning)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object of settings, got {type(data).__name__}")
    return settings(data, str(p))


# ============================================================================ engine config
def engine_config(s: ReferenceSettings, **overrides: Any) -> EngineConfig:
    """The engine the reference settings describe; ``overrides`` are EngineConfig fields."""
    try:
        memory = preset(
            s.preset,
            **{
                "stm_capacity": s.short_term_capacity,
                "mtm_capacity": s.mid_term_capacity,
                "knowledge_capacity": s.long_term_knowledge_capacity,
                "top_pages": s.retrieval_queue_capacity,
                "tau": s.mid_term_heat_threshold,
                "theta": s.mid_term_similarity_threshold,
                **s.memory,
            },
        )
    except ValidationError as exc:
        raise _explain(exc, "memory settings", MemoryConfig) from None
    values: dict[str, Any] = {
        "memory": memory,
        "llm": llm_config(s),
        "store": s.data_storage_path,
        "device": s.device,
        **_embedding(s),
        **overrides,
    }
    if values.get("embedder", "transformers") in ("transformers", "onnx"):
        values["embedding_model"] = resolve_embedding_model(values.get("embedding_model"))
    try:
        return EngineConfig(**values)
    except ValidationError as exc:  # e.g. embedding_model_kwargs' device
        raise _explain(exc, "settings", EngineConfig) from None


def llm_config(s: ReferenceSettings) -> LLMConfig:
    """The LLM backend: ``llm_backend`` when given, else OpenAI-compatible when a key or base
    URL is, else none (LLM-free memory)."""
    kind = (s.llm_backend or "").strip().lower()
    if not kind:
        kind = "openai" if (s.openai_api_key or s.openai_base_url) else "none"
    if kind in _NO_LLM:
        return LLMConfig(mode="extractive")
    from memoryos_gpu.llm.factory import BACKEND_KINDS, backend_kind

    kind = backend_kind(kind)
    if kind not in BACKEND_KINDS:
        raise ConfigError(
            f"llm_backend {s.llm_backend!r} is not one of {', '.join((*BACKEND_KINDS, 'none'))}"
        )
    given = {"model": s.llm_model, "base_url": s.openai_base_url, "api_key": s.openai_api_key}
    keys = {"model": "llm_model", "base_url": "openai_base_url", "api_key": "openai_api_key"}
    twice = [k for k in LLM_DEDICATED if k in s.llm_options and given[k] is not None]
    if twice:  # which one the backend got was an accident of the code
        raise ConfigError(
            "; ".join(f"{keys[k]} and llm_options.{k} both give the {k}" for k in twice)
            + ": give it once"
        )
    if kind == "openai":
        options = dict(s.llm_options)  # an option in place of its key stands for it
        return LLMConfig(
            mode="llm",
            backend="openai",
            model=s.llm_model or options.pop("model", None) or OPENAI_DEFAULT_MODEL,
            base_url=s.openai_base_url or options.pop("base_url", None) or OPENAI_BASE_URL,
            api_key=s.openai_api_key or options.pop("api_key", None),
            options=options,
        )
    return LLMConfig(mode="llm", backend=kind, model=s.llm_model, options=s.llm_options)


def _embedding(s: ReferenceSettings) -> dict[str, Any]:
    """EngineConfig fields of the embedding settings; kwargs that have no meaning here are
    refused rather than dropped."""
    name = (s.embedding_model_name or "").strip()
    out: dict[str, Any] = {"embedding_model": None if name.lower() in _MINILM_NAMES else name}
    kw = dict(s.embedding_model_kwargs or {})
    unknown = sorted(set(kw) - _EMBEDDING_KWARGS)
    if unknown:
        raise ConfigError(
            f"embedding_model_kwargs {unknown} are not supported (supported: "
            f"{sorted(_EMBEDDING_KWARGS)}; the encoder is not sentence-transformers)"
        )
    if "batch_size" in kw:
        out["embedding_batch_size"] = kw["batch_size"]
    if "device" in kw:
        out["device"] = kw["device"]
    if kw.get("use_fp16"):
        out["gpu_dtype"] = "float16"
    return out


def resolve_embedding_model(name: str | None) -> str | None:
    """A local model folder for ``name``: the folder itself, or a Hugging Face id (``BAAI/bge-m3``)
    found in the local Hugging Face cache. Nothing is downloaded: an id that is not cached is
    refused with the command that fetches it."""
    if name is None or Path(name).expanduser().is_dir():
        return None if name is None else str(Path(name).expanduser())
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:
        raise ConfigError(
            f"embedding_model_name {name!r} is neither a local model folder nor in the local "
            f"Hugging Face cache (nothing is downloaded automatically): run "
            f"`huggingface-cli download {name}` or pass the model's folder"
        ) from None


# ============================================================================ timestamps
def stamp(ts: float | None = None) -> str:
    """Epoch seconds (default now) in the reference's format, local time."""
    if ts is None:
        ts = time.time()
    try:
        return time.strftime(STAMP_FORMAT, time.localtime(float(ts)))
    except (OverflowError, OSError, ValueError):
        return str(ts)


#: longest part of a bad timestamp that its error message quotes
MAX_QUOTED_CHARS = 80


def read_timestamp(value: str | float | None) -> tuple[float | None, str | None]:
    """``(epoch seconds for the engine, text to keep under GIVEN_KEY or None)``.

    A naive string is local time (as the reference's clock is); a string the local clock does
    not print back identically is kept verbatim. ``None`` stays ``None`` (the engine's now).
    Raises ``ValueError`` naming the value when it does not parse (cut to
    :data:`MAX_QUOTED_CHARS`: a tool's error must not echo megabytes back)."""
    if value is None or not isinstance(value, str):
        return value, None
    from memoryos_gpu.formats import parse_timestamp

    try:
        epoch = parse_timestamp(value, None)  # a wall time without a zone: local time
    except ValueError as exc:  # quoting a long value whole would echo megabytes to a client
        if len(value) <= MAX_QUOTED_CHARS:
            raise
        message = str(exc).replace(repr(value), repr(value[:MAX_QUOTED_CHARS] + "…"))
        if len(message) > 4 * MAX_QUOTED_CHARS:  # the value quoted otherwise (stripped, say)
            message = message[: 4 * MAX_QUOTED_CHARS] + "…"
        raise ValueError(message) from None
    keep = None if math.isfinite(epoch) and stamp(epoch) == value else value
    return epoch, keep


def page_stamp(page: Any) -> str:
    """A retrieved page's timestamp as given (the kept text, else local time)."""
    given = (getattr(page, "extra", None) or {}).get(GIVEN_KEY)
    return given if isinstance(given, str) else stamp(page.timestamp)


def user_meta(meta: Mapping[str, Any] | None, kept: str | None) -> dict[str, Any]:
    """The metadata to store: the caller's, plus the kept timestamp text. Refuses the caller's
    own ``GIVEN_KEY`` (it would be printed as the page's timestamp)."""
    out = dict(meta or {})
    if GIVEN_KEY in out:
        raise ValueError(f"metadata key {GIVEN_KEY!r} is reserved (the timestamp as given)")
    if kept is not None:
        out[GIVEN_KEY] = kept
    return out

"""Configuration: every MemoryOS hyperparameter is a setting, with the paper's defaults.

Two presets are selectable by name (:func:`preset`, or ``preset=`` of :class:`MemoryConfig`):
``paper`` (the hyperparameter table of the MemoryOS paper, "Memory OS of AI Agent", EMNLP
2025, arXiv 2506.06326; README, "Deviations from the paper") and ``reference``
(BAI-LAB/MemoryOS's code defaults), so results can be compared with either. Configuration is
typed (pydantic) and validated on construction; it can be read from a TOML file
(:meth:`EngineConfig.from_toml`, strictly typed: :func:`validate_file_config`) and overridden
by keyword, per key within a table (:func:`merge_settings`).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.ops.params import HeatParams
from memoryos_gpu.store import is_url
from memoryos_gpu.store.encryption import as_secret, env_key
from memoryos_gpu.store.errors import StoreError

log = logging.getLogger(__name__)


class ConfigError(MemoryOSError, ValueError):
    """A setting was refused; the message names the setting, why, and how to give it.

    Why a type of its own: the CLI reports it as a usage error (exit 2), as it does a bad
    flag, where another :class:`MemoryOSError` is a runtime error (exit 1); the engine raises
    it for a setting that only the store can show wrong (an ``mtm_capacity`` below the
    segment slots a store holds), and the config.json reader for its keys."""


#: Every ``MEMORYOS_GPU_*`` environment variable something of this project reads: the package
#: (store key, CLI defaults, model cache, API keys, the CUDA extension's ``CUDA_SYNC``), its
#: scripts, tests and benchmarks. Any other is a typo, warned about by :func:`warn_unknown_env`.
KNOWN_ENV = frozenset(
    "MEMORYOS_GPU_" + name
    for name in (
        "API_KEYS",
        "CACHE",
        "CUDA_SYNC",
        "EMBEDDER",
        "EMBEDDING_API_KEY",
        "EXTRAS",
        "INGEST_PARENT",
        "KERNEL_GRID",
        "KEY",
        "LLAMA_SERVER",
        "LLM_API_KEY",
        "LOCOMO",
        "NEW_KEY",
        "PG_DIR",
        "REQUIRE_CUDA",
        "REQUIRE_PG",
        "STORE",
        "TEST_PG_URL",
    )
)
#: Likely names of a known variable that spelling distance would not lead to (the closest
#: spelling of ``ENCRYPTION_KEY`` is ``API_KEYS``, the wrong secret).
_ENV_ALIASES = {
    **dict.fromkeys(
        ("ENCRYPTION_KEY", "STORE_KEY", "DB_KEY", "SQLCIPHER_KEY", "SECRET_KEY", "PASSPHRASE"),
        "KEY",
    ),
    **dict.fromkeys(("STORE_PATH", "DB", "DB_PATH", "DATA_DIR", "STORAGE"), "STORE"),
}
_warned_env: set[str] = set()  # each unknown variable is warned about once per process


def warn_unknown_env(environ: Any = None) -> list[str]:
    """Log a warning, once per process for each, about every ``MEMORYOS_GPU_*`` variable in
    ``environ`` (default ``os.environ``) that nothing reads, naming the closest known one; the
    names warned about now are returned.

    Why: a mistyped variable is otherwise silently ignored, and for one, a store key set as
    ``MEMORYOS_GPU_ENCRYPTION_KEY`` instead of ``MEMORYOS_GPU_KEY``, the engine writes a plain
    store the operator meant to be encrypted. A warning, not an error: the variable may be
    meant for another version. Values are never logged (some are secrets)."""
    env = os.environ if environ is None else environ
    fresh = sorted(
        n for n in env if n.startswith("MEMORYOS_GPU_") and n not in KNOWN_ENV | _warned_env
    )
    for name in fresh:
        _warned_env.add(name)
        suffix = name.removeprefix("MEMORYOS_GPU_")
        known = sorted(n.removeprefix("MEMORYOS_GPU_") for n in KNOWN_ENV)
        close = [_ENV_ALIASES[suffix]] if suffix in _ENV_ALIASES else []
        close = close or difflib.get_close_matches(suffix, known, n=1, cutoff=0.6)
        hint = f"; did you mean $MEMORYOS_GPU_{close[0]}?" if close else ""
        log.warning("$%s is set but no setting of memoryos-gpu reads it%s", name, hint)
    return fresh


#: A libpq keyword/value connection string (``host=db port=5432 dbname=m``): every word a
#: ``key=value`` pair, one of them a libpq connection keyword.
_KEY_VALUE = re.compile(r"\s*(?:[A-Za-z_]+\s*=\s*(?:'(?:[^'\\]|\\.)*'|\S+)\s*)+")
_LIBPQ_KEYS = frozenset(
    {"host", "hostaddr", "port", "dbname", "user", "password", "passfile", "sslmode", "service"}
)


def _is_libpq_keywords(value: str) -> bool:
    """Whether a store spec is a libpq keyword/value connection string, not a path."""
    if "=" not in value or _KEY_VALUE.fullmatch(value) is None:
        return False
    keys = re.findall(r"([A-Za-z_]+)\s*=", value)
    return any(k.lower() in _LIBPQ_KEYS for k in keys)


def _env_store_key() -> SecretStr | None:
    """``$MEMORYOS_GPU_KEY`` (:func:`env_key`), after warning about mistyped variables."""
    warn_unknown_env()
    return env_key()


def server_table(data: dict[str, Any]) -> dict[str, Any]:
    """Take a config file's ``[server]`` table out of its ``data`` and return it: the HTTP
    server's settings (:class:`~memoryos_gpu.server.settings.ServerSettings` fields, which
    ``memoryos-gpu serve`` and ``server.app.run`` read), beside the engine's in one file. Not
    a table: ValueError."""
    table = data.pop("server", None)
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ValueError(f"[server] must be a table of settings, not a {type(table).__name__}")
    return table


def engine_data(data: dict[str, Any], preset_name: str | None = None) -> dict[str, Any]:
    """A config file's ``data`` as :class:`EngineConfig`'s input, the one reading of a file
    for the CLI and :meth:`EngineConfig.from_toml`: the ``[server]`` table taken out (checked:
    :func:`server_table`), the store key resolved (:func:`config_key`), ``[memory]`` and
    ``[llm]`` checked to be tables (``memory = 5`` crashed the MCP server with a TypeError),
    and the preset (``preset_name``, else ``[memory]``'s ``preset``) named in ``[memory]``,
    where :class:`MemoryConfig` expands it under the file's values, validated with the rest:
    an error names ``memory.<key>``, as for any other setting. ValueError for a table that is
    not one."""
    server_table(data)
    data["encryption_key"] = config_key(data.get("encryption_key"))
    for table in ("memory", "llm"):
        if not isinstance(data.get(table) or {}, dict):
            kind = type(data[table]).__name__  # not the value: it may be a key
            raise ValueError(f"[{table}] must be a table of settings, not a {kind}")
    if preset_name:  # the --preset flag: over the file's, under its explicit fields
        data["memory"] = {**(data.get("memory") or {}), "preset": preset_name}
    return data


#: LLM settings that have a key of their own and that a backend also takes as an option:
#: given in both places they are ambiguous (:class:`LLMConfig`), and an override of the key
#: (a flag) replaces the file's option (:func:`merge_settings`).
LLM_DEDICATED = ("model", "base_url", "api_key")


def merge_settings(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` over a config file's ``data``, per key within the ``[memory]`` and
    ``[llm]`` tables (a table given whole as a model replaces the file's).

    Why per key: ``from_toml(path, memory={"stm_capacity": 4})`` replaced the file's whole
    table, silently dropping its preset and its other fields. A dedicated LLM setting
    (:data:`LLM_DEDICATED`) given by an override takes the place of the same key in the
    file's ``[llm] options``: the documented precedence, flag > file, whichever of the two
    places the file used."""
    out = dict(data)
    for key, value in overrides.items():
        old = out.get(key)
        out[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
    given, llm = overrides.get("llm"), out.get("llm")
    if isinstance(given, dict) and isinstance(llm, dict) and isinstance(llm.get("options"), dict):
        replaced = {k for k in LLM_DEDICATED if given.get(k) is not None}
        if "options" not in given and replaced & set(llm["options"]):
            options = {k: v for k, v in llm["options"].items() if k not in replaced}
            out["llm"] = {**llm, "options": options}
    return out


def validate_file_config(data: dict[str, Any]) -> EngineConfig:
    """A config file's settings (with the flags or overrides merged in) as an
    :class:`EngineConfig`, strictly typed: ``stm_capacity = "7"`` or ``embed_dates = "yes"``
    is refused naming the key, as config.json's keys are (``reference.ReferenceSettings``),
    rather than coerced. Why: a quoted value is a slip in the file, and ``"no"`` read as a
    boolean is not what its author meant. The one place both readers of a TOML file (the CLI
    and :meth:`EngineConfig.from_toml`) validate it; Python callers building models keep
    pydantic's usual coercion."""
    key = data.get("encryption_key")
    if isinstance(key, str):  # a key given in Python, at the flag's level (config_key)
        data = {**data, "encryption_key": SecretStr(key)}
    return EngineConfig.model_validate(data, strict=True)


def explain_settings_error(exc: ValidationError, model: type[BaseModel]) -> str:
    """``exc``, raised validating ``model``, as one clause per offending setting: its dotted
    name and what is wrong (a wrong type: the type given), an unknown one with the closest
    known name and the known ones.

    Why not ``str(exc)``: pydantic's text is several lines per error with a link, and it
    shows each value given, while a setting may be a secret (an API key, the store key). A
    value is never shown here, whichever the setting: one rule, so no secret setting can be
    forgotten (the models holding secrets also hide values in ``str(exc)``, with
    ``hide_input_in_errors``, for callers that print it)."""
    clauses = []
    for err in exc.errors(include_url=False):
        path = [str(p) for p in err["loc"]]
        key = ".".join(path) or "(top level)"
        if err["type"] == "extra_forbidden":
            known = _known_settings(model, path[:-1])
            near = difflib.get_close_matches(path[-1], known, 1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            table = _table_of(model, path)
            hint = f"it belongs in the [{table}] table; " if table else hint
            clauses.append(f"unknown key {key!r} ({hint}known keys: {', '.join(known)})")
        else:
            got = f" (got {type(err['input']).__name__})" if err["type"].endswith("_type") else ""
            clauses.append(f"{key}: {err['msg'].removeprefix('Value error, ')}{got}")
    return "; ".join(clauses)


def _table_of(model: type[BaseModel], path: list[str]) -> str | None:
    """The table (``memory``, ``llm``) of ``model`` whose setting an unknown top-level key
    is, else None: ``stm_capacity = 3`` above ``[memory]`` reads as a misplaced line, and
    "unknown key" alone did not say where it goes."""
    if len(path) != 1:
        return None
    for name, field in model.model_fields.items():
        inner = field.annotation
        if (
            isinstance(inner, type)
            and issubclass(inner, BaseModel)
            and path[0] in inner.model_fields
        ):
            return name
    return None


def _known_settings(model: type[BaseModel], path: list[str]) -> list[str]:
    """The setting names of the (nested) model at ``path`` inside ``model``."""
    for name in path:
        field = model.model_fields.get(name)
        inner = field.annotation if field is not None else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return []
        model = inner
    return sorted(model.model_fields)


#: The BM25 weight ``locomo.py --cv`` chose in most held-out folds (see ``MemoryConfig``).
LEXICAL_WEIGHT = 0.67
#: Most results one retrieval may ask for (pages, segments or knowledge entries): the limit of
#: the per-call arguments (``engine.validation.clean_count``) and of the configured defaults
#: (``top_pages``, ``top_segments``, ``knowledge_top_k``). Each query allocates in proportion to
#: it, so a larger configured value built fine and then failed every retrieval (MemoryError, or
#: an abort in the native kernels). Defined here, not in the engine, so that reading a
#: configuration does not import the engine.
MAX_COUNT = 10_000
#: Widest segment keyword row (``keyword_width``): the arena reserves ``keyword_width`` int32 ids
#: for every segment slot of every user up front (a GPU arena holds them dense), so 10,000,000
#: asked 5 GB of address space for 16 users at once. 1,024 ids is 32 times the default and more
#: keywords than a segment's pages give (``page_keywords`` each, ranked by frequency).
MAX_KEYWORD_WIDTH = 1_024
#: Largest ``knowledge_capacity``: the engine keeps a dense ``[owners, knowledge_capacity]``
#: int64 map of ring positions to entry ids (``EngineState.entry_of_ring``, allocated in full
#: when the engine opens and again for every owner it grows by), so 10**12 failed at open
#: with a MemoryError asking for 116 TiB and 10**7 took 1.3 GB for the first 16 owners. 65,536
#: is 512 KiB an owner, 655 times the default of 100.
MAX_KNOWLEDGE_CAPACITY = 65_536
#: Most OpenMP threads ``cpu_threads`` may ask for: each is a thread with its own stack, and the
#: native call takes a C ``int`` (a value past it failed with a TypeError naming no setting when
#: the engine opened). More than any one machine's cores.
MAX_CPU_THREADS = 4_096
#: Most tokens ``llm.max_tokens`` may ask an answer to have: 128 Ki, the longest context of the
#: models this project runs (a larger value fails every request at the server, or makes a local
#: backend reserve that many positions).
MAX_LLM_TOKENS = 131_072


def http_url_problem(value: str | None, name: str) -> str | None:
    """Why ``value`` cannot be the URL of an HTTP server setting ``name``, else None: it must
    start with ``http://`` or ``https://`` (``127.0.0.1:8000`` without its scheme was taken,
    then failed every request, after retries, as an unsupported protocol). The value is never
    put in the message: a URL may carry credentials (``user:password@host``)."""
    if value is not None and not value.strip().startswith(("http://", "https://")):
        return f"{name} must start with http:// or https://"
    return None


def blank_model_problem(value: str | None, name: str) -> str | None:
    """Why ``value`` cannot be model setting ``name``, else None: an empty or blank one was
    taken as "the default" by one setting and refused by another; leaving it out is the one
    way to ask for the default."""
    if value is not None and not value.strip():
        return f"{name} is empty: name a model, or leave the setting out for the default"
    return None


class MemoryConfig(BaseModel):
    """The paper's mechanics. Field docs give the paper's value and meaning.

    ``preset`` names the preset the values come from: the fields not given explicitly take
    that preset's values (``MemoryConfig(preset="reference", top_pages=3)`` is the reference
    code's defaults with 3 pages), so the name and the values always agree (``stats`` reports
    the name). Thresholds are bounded by what they are compared with (a cosine in [-1, 1],
    ``theta`` with cosine + Jaccard in [-1, 2]) and weights are at least 0: a value outside
    either switched its mechanic off for good or on for everything, silently."""

    # NaN or infinity in a threshold or weight would silently disable the mechanic it drives
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        """The named preset's values under the fields given (the one place presets expand:
        :func:`preset`, a config file's ``[memory] preset`` and ``--preset`` all come here);
        an unknown name is left for the field's own check, which names ``preset``."""
        name = data.get("preset") if isinstance(data, dict) else None
        if isinstance(name, str) and name in _PRESETS:
            return {**_PRESETS[name], **data}
        return data

    preset: Literal["paper", "reference"] = Field(
        "paper", description="The preset whose values the fields not given take."
    )
    stm_capacity: int = Field(7, ge=1, description="STM FIFO length in pages (paper: 7).")
    mtm_capacity: int = Field(200, ge=1, description="Segments per user (paper: 200).")
    theta: float = Field(
        0.6,
        ge=-1.0,
        le=2.0,
        description="Insert into the best segment when cos + Jaccard >= theta (-1 to 2, the "
        "range of that sum: -1 joins every page to its best segment, 2 only identical ones).",
    )
    tau: float = Field(
        5.0, ge=0, description="Heat at which a segment's unanalysed pages are promoted."
    )
    alpha: float = Field(1.0, ge=0, description="Heat weight of N_visit.")
    beta: float = Field(1.0, ge=0, description="Heat weight of L_interaction.")
    gamma: float = Field(1.0, ge=0, description="Heat weight of R_recency.")
    mu_seconds: float = Field(1e7, gt=0, description="Recency time constant (paper: 1e7 s).")
    eviction: Literal["heat", "lfu"] = Field(
        "heat", description="Evict the lowest-heat segment (paper) or least visited (reference)."
    )
    reset_visits_on_promotion: bool = Field(
        False, description="Also reset N_visit after promotion (the reference code does)."
    )
    top_segments: int = Field(
        5, ge=1, le=MAX_COUNT, description="Segments retrieved per query (m; 1 to 10,000)."
    )
    top_pages: int = Field(
        10, ge=1, le=MAX_COUNT, description="Pages retrieved per query (k; 1 to 10,000)."
    )
    relevance_floor: float = Field(
        0.1,
        ge=-1.0,
        le=1.0,
        description="A page of a chosen segment is a retrieval candidate when its cosine with "
        "the query is at least this (a page in the BM25 list always is); only "
        "candidates are returned and heat their segments. The reference code's 0.1: an "
        "unrelated question then returns no MTM page and heats nothing. A cosine: -1 to 1 "
        "(-1: every page of a chosen segment is a candidate).",
    )
    query_keyword_weight: float = Field(
        1.0,
        ge=0.0,
        description="Weight of the Jaccard keyword term at query time (reference: 0; at "
        "least 0: a negative weight ranks segments sharing the query's keywords last).",
    )
    lexical_weight: float = Field(
        LEXICAL_WEIGHT,
        ge=0,
        description="Weight of the per-user BM25 signal against the cosine's 1 in the fused "
        "page ranking (both standardised over the union of their candidates); 0 = the "
        "paper's dense-only pipeline (no BM25). The default is the weight leave-one-"
        "conversation-out chose on LoCoMo dev (benchmarks/README.md).",
    )
    # bounded as the other counts (MAX_COUNT): the native retrieval pass takes it as a C int,
    # so 2**31 and more were accepted here and then failed every retrieval with a TypeError
    lexical_candidates: int = Field(
        100,
        ge=0,
        le=MAX_COUNT,
        description="Length of the BM25 list: besides the top segments' pages that reach "
        "relevance_floor, a page is a candidate when its BM25 is among the user's this-many "
        "best (ties kept); 0 = every page that holds a query term. Bounds a query's cosines "
        "over a long history, where a name matches most pages; 100 is ten times the default "
        "top_pages (0 to 10,000).",
    )
    embed_dates: bool = Field(
        True, description="Embed a page with its date written out (helps temporal questions)."
    )
    knowledge_capacity: int = Field(
        100,
        ge=1,
        le=MAX_KNOWLEDGE_CAPACITY,
        description="User / assistant knowledge FIFO size (1 to 65,536: the engine maps every "
        "ring position of every owner up front).",
    )
    knowledge_top_k: int = Field(
        10, ge=1, le=MAX_COUNT, description="Knowledge entries retrieved per query (1 to 10,000)."
    )
    fact_duplicate_cos: float = Field(
        0.9,
        ge=0.0,
        le=1.0,
        description="A new fact this similar (cosine) to a live entry of the same owner, and "
        "stating no other value of the same attribute, strengthens that entry instead of "
        "adding a copy (engine/conflicts.py); 1.0 merges only identical embeddings.",
    )
    provenance: bool = Field(
        True,
        description="Record which pages each knowledge entry and profile value came from "
        "(needed for deleting what a page implied). Off only to measure its cost: deleting a "
        "page or a user then cannot reach the facts derived from it.",
    )
    keyword_width: int = Field(
        32,
        ge=1,
        le=MAX_KEYWORD_WIDTH,
        description="Hashed keyword ids kept per segment (1 to 1,024: the arena reserves this "
        "many ids for every segment slot).",
    )
    page_keywords: int = Field(
        8,
        ge=1,
        le=MAX_COUNT,  # a query's jaccard_terms, a C int of the native retrieval: 2**31 failed
        description="Keywords extracted per page (1 to 10,000).",
    )
    clock: Literal["logical", "wall"] = Field(
        "logical",
        description="Heat and recency run on the pages' own timestamps (logical, for replayed "
        "logs) or on the wall clock (live serving).",
    )
    continuity_threshold: float = Field(
        0.55,
        ge=-1.0,
        le=1.0,
        description="LLM-free mode: pages with cosine >= this continue the chain (a cosine: "
        "-1 to 1).",
    )
    summary_chars: int = Field(600, ge=50, description="Cap of a segment's summary text.")

    def heat_params(self) -> HeatParams:
        return HeatParams(
            alpha=self.alpha,
            beta=self.beta,
            gamma=self.gamma,
            mu=self.mu_seconds,
            tau=self.tau,
            evict_by_visits=self.eviction == "lfu",
        )


_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {},
    "reference": {
        "stm_capacity": 10,
        "mtm_capacity": 2000,
        "top_pages": 7,  # retrieval_queue_capacity
        "knowledge_top_k": 20,  # Retriever.retrieve_context(top_k_knowledge=20)
        "eviction": "lfu",
        "mu_seconds": 24 * 3600.0,
        "query_keyword_weight": 0.0,
        "reset_visits_on_promotion": True,
        "lexical_weight": 0.0,
        "embed_dates": False,
    },
}


def preset(name: str, /, **overrides: Any) -> MemoryConfig:
    """A named preset (``paper`` or ``reference``) with optional field overrides: the same
    as ``MemoryConfig(preset=name, **overrides)``, which expands it.

    ``paper`` is the paper's table of hyperparameters, with this project's documented
    retrieval additions left on (README, "Deviations from the paper"): BM25 fused with the
    dense path (``lexical_weight``), the reference code's ``relevance_floor`` and dated page
    embeddings (``embed_dates``). The paper's dense-only pipeline: ``preset("paper",
    lexical_weight=0.0, relevance_floor=-1.0, embed_dates=False)``."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}")
    if "preset" in overrides:  # two names: which one's values the rest takes is a guess
        raise ValueError(
            f"preset({name!r}, preset={overrides['preset']!r}) names two presets; name one"
        )
    return MemoryConfig(preset=name, **overrides)


def config_key(file_value: object = None) -> SecretStr | None:
    """The store key of a configuration read from a file: ``$MEMORYOS_GPU_KEY``, else the
    file's ``encryption_key`` (``file_value``), else None (not encrypted).

    Why one function: every command that takes a config file (the CLI's, ``memoryos-gpu
    mcp``, the HTTP server's and Ray Serve's) resolves the key in the documented order, flag >
    environment variable > config file, here and nowhere else. No flag carries a key (a
    command line is visible to every user in ``ps``), so the environment wins over the file;
    a key given in Python (``EngineConfig(encryption_key=...)``, ``from_toml(path,
    encryption_key=...)``) is at the flag's level and never comes here. The value is never
    put in a message."""
    env = _env_store_key()
    if env is not None:
        return env
    if file_value is None or isinstance(file_value, SecretStr):
        return file_value
    if not isinstance(file_value, str):
        raise ValueError(f"encryption_key must be a string, got {type(file_value).__name__}")
    try:  # checked here, as the file's setting (an empty one is not "no key")
        return as_secret(file_value)
    except StoreError as exc:
        hint = "; remove the line for a store that is not encrypted" if not file_value else ""
        raise ValueError(f"encryption_key: {exc}{hint}") from None


class LLMConfig(BaseModel):
    """Which backend does the LLM work, and how calls are grouped."""

    # api_key is a secret: errors name it, never show the value given (explain_settings_error)
    model_config = ConfigDict(
        frozen=True, extra="forbid", hide_input_in_errors=True, allow_inf_nan=False
    )

    mode: Literal["llm", "extractive"] = Field(
        "extractive",
        description="'llm': every stage asks the backend; 'extractive': no LLM calls "
        "(embedding continuity, keyword extraction, extractive summaries).",
    )
    backend: str = Field("transformers", description="vllm | openai | transformers | scripted")
    model: str | None = Field(None, description="Model path / name (backend default if unset).")
    base_url: str | None = Field(None, description="OpenAI-compatible server URL.")
    api_key: str | None = Field(None, description="API key of the OpenAI-compatible server.")
    fused: bool = Field(True, description="One structured call per page / promotion.")
    max_tokens: int = Field(256, ge=1, le=MAX_LLM_TOKENS, description="1 to 131,072.")
    temperature: float = Field(0.0, ge=0, le=2, description="0 to 2, as OpenAI's API takes.")
    batch_size: int = Field(64, ge=1, description="Requests per backend call.")
    options: dict[str, Any] = Field(default_factory=dict, description="Backend keyword options.")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        """The canonical name (aliases such as ``hf`` resolved, so code comparing names sees
        one spelling); an unknown name is refused here rather than when the engine opens."""
        from memoryos_gpu.llm.factory import BACKEND_KINDS, backend_kind

        kind = backend_kind(value)
        if kind not in BACKEND_KINDS:
            raise ValueError(
                f"unknown LLM backend {value!r}; expected one of: {', '.join(BACKEND_KINDS)}"
            )
        return kind

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        """A URL without its scheme (``127.0.0.1:8000``) is refused here, as a setting, rather
        than by the backend's constructor when the engine opens (the same rule as
        ``openai_compat.normalize_base_url``)."""
        problem = http_url_problem(value, "base_url")
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("model")
    @classmethod
    def _named_model(cls, value: str | None) -> str | None:
        problem = blank_model_problem(value, "model")
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="before")
    @classmethod
    def _given_once(cls, data: Any) -> Any:
        """Refuse a dedicated setting (:data:`LLM_DEDICATED`) given also in ``options``: which
        of the two the backend got was an accident of the code (the option won, against the
        flag's precedence), so the file must say it once. A flag over a file's option is not
        ambiguous: :func:`merge_settings` puts the flag in the option's place."""
        options = data.get("options") if isinstance(data, dict) else None
        if isinstance(options, dict):
            twice = [k for k in LLM_DEDICATED if k in options and data.get(k) is not None]
            if twice:
                raise ValueError(
                    " and ".join(f"{k} is given twice, as {k} and as options.{k}" for k in twice)
                    + "; give it once (as the setting, not the option)"
                )
        return data


def llm_settings_problem(c: LLMConfig) -> str | None:
    """Why the backend ``c`` names cannot be built from these settings (a missing URL or
    model, named as the user sets it: flag / config key), else None. One rule for the engine,
    which raises it when it builds the backend, and the CLI, which checks it before opening a
    store (an engine's open found it after the store was made)."""
    if c.backend == "openai" and not (c.options.get("base_url") or c.base_url):
        return "--llm-base-url / [llm] base_url is required for the openai backend"
    if c.backend in ("openai", "vllm") and not (c.model or c.options.get("model")):
        return f"--llm-model / [llm] model is required for the {c.backend} backend"
    return None


class EngineConfig(BaseModel):
    """Everything an engine needs: memory mechanics, devices, models, store."""

    # it holds secrets (encryption_key, embedding_api_key, llm.api_key): errors name the
    # setting, never show the value given (explain_settings_error)
    model_config = ConfigDict(
        frozen=True, extra="forbid", hide_input_in_errors=True, allow_inf_nan=False
    )

    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    store: str = Field(
        ":memory:",
        description="SQLite file path, ':memory:', or a PostgreSQL URL "
        "(postgresql://user@host:5432/db) for a store several engines share.",
    )

    @field_validator("store", mode="before")
    @classmethod
    def _store_spec(cls, value: Any) -> Any:
        """A path object is taken as its path; an empty (or blank) string and a URL of another
        kind than PostgreSQL are refused: "" would be read as the current directory (an unset
        environment variable read with ``os.environ.get(NAME, "")`` made a persistent store
        wherever the process ran), and a URL as a relative directory name."""
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, str) and not value.strip():
            raise ValueError(
                "store is empty: give a directory (memory.sqlite3 is made in it), a file path "
                "ending in .sqlite3 or .db, a postgresql:// URL, or ':memory:' for a store that "
                "is not kept"
            )
        if isinstance(value, str) and "://" in value and not is_url(value):
            raise ValueError(
                f"store {value.split('://', 1)[0]}:// is not a store kind: give a SQLite file "
                "or directory path, ':memory:', or a postgresql:// URL"
            )
        if isinstance(value, str) and _is_libpq_keywords(value):
            # it would become a SQLite directory of that name (a password in its name), the
            # operator believing the pages went to PostgreSQL; the value is not echoed
            raise ValueError(
                "store is a libpq connection string (key=value ...), which is not read: give "
                "it as a postgresql:// URL, e.g. postgresql://user@host:5432/dbname (the "
                "password from ~/.pgpass or $PGPASSWORD, or URL-encoded in it)"
            )
        return value

    encryption_key: SecretStr | None = Field(
        default_factory=_env_store_key,
        description="Encrypt the SQLite store at rest under this key (SQLCipher; needs the "
        "'encryption' extra). Default: $MEMORYOS_GPU_KEY, else not encrypted. A secret: shown "
        "as '**********' in every dump and message. docs/storage.md.",
    )
    store_cache_mb: int = Field(
        64,
        ge=0,
        description="A SQLite file store's page cache in MiB (PRAGMA cache_size; 0 = SQLite's "
        "2 MiB): derived work rewrites rows spread over the store, and at 10,000 users SQLite "
        "re-read 39 pages from the OS per page of it with 2 MiB, 14 with 64 (12 % less time). "
        "Taken as pages are read. docs/storage.md.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the arena lives.")
    gpu_dtype: Literal["float16", "bfloat16"] = "float16"
    cpu_threads: int | None = Field(
        None,
        ge=1,
        le=MAX_CPU_THREADS,
        description="Threads of the CPU kernels' OpenMP teams, process-wide (ops.set_cpu_threads)"
        "; None = OpenMP's default (every core, or OMP_NUM_THREADS); at most 4,096. Set it when "
        "other busy processes share the cores: `serve --workers N` gives the engine what the "
        "workers leave.",
    )
    embedder: Literal["transformers", "onnx", "openai", "hashing"] = Field(
        "transformers",
        description="Embedding backend (docs/embeddings.md): 'transformers' = a local model "
        "folder on torch; 'onnx' = the same folder as int8 ONNX on the CPU (needs the "
        "embed-fast extra); 'openai' = an OpenAI-compatible /v1/embeddings server; "
        "'hashing' = a fast deterministic test double.",
    )
    embedding_model: str | None = Field(
        None,
        description="transformers / onnx: the model folder (plain transformers or "
        "sentence-transformers; default: the bundled MiniLM). openai: the served model name.",
    )
    embedding_base_url: str | None = Field(
        None, description="openai: the server's URL up to /v1 (http://127.0.0.1:8001/v1)."
    )

    @field_validator("embedding_base_url")
    @classmethod
    def _embedding_url(cls, value: str | None) -> str | None:
        """The rule of ``llm.base_url`` (:func:`http_url_problem`), checked as a setting."""
        problem = http_url_problem(value, "embedding_base_url")
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("embedding_model")
    @classmethod
    def _embedding_model_named(cls, value: str | None) -> str | None:
        """``--embedding-model ""`` meant the default to one reader and nothing to another."""
        problem = blank_model_problem(value, "embedding_model")
        if problem:
            raise ValueError(problem)
        return value

    embedding_api_key: str | None = Field(None, description="openai: the server's API key.")
    embedding_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="transformers: precision (auto = fp16 on CUDA, fp32 on CPU)."
    )
    embedding_batch_size: int | None = Field(
        None,
        ge=1,
        description="Texts per forward pass / request; None = the backend's default (64; "
        "onnx: 16, which suits CPU caches).",
    )
    embedding_cache_size: int = Field(
        100_000,
        ge=0,
        description="Texts whose vectors the embedder keeps (LRU, by the text's hash; 0 = none): "
        "~1.6 KB each at 384 dimensions, ~160 MB at the default, in every engine process; the "
        "cache's size now is stats()['embedder']['cached'].",
    )
    auto_process: bool = Field(
        True, description="Run derived work (chain, MTM, promotion) inside add/add_many."
    )
    derived_max_batch: int = Field(
        256,
        ge=1,
        description="Pages per derived-work round (in waves: the oldest pending page of each "
        "user, then the next, so each user's order holds); 1 = one page at a time, as the "
        "reference does.",
    )
    shutdown_drain_s: float = Field(
        20.0,
        ge=0,
        le=3600,
        description="How long a server's shutdown (SIGTERM; MemoryService.close) goes on "
        "running derived work; then what is left stays pending in the store (the next start "
        "resumes it) and LLM requests in flight are cancelled, so a hung LLM server cannot "
        "keep the process alive until an orchestrator kills it (Kubernetes after 30 s). "
        "0 = leave every pending round for the next start.",
    )

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """Read a TOML file ([memory], [llm] tables and top-level keys) plus overrides, merged
        per key within a table (:func:`merge_settings`) and strictly typed
        (:func:`validate_file_config`). The store key: ``overrides``' ``encryption_key``,
        else as :func:`config_key` resolves it (``$MEMORYOS_GPU_KEY`` before the file's)."""
        data = engine_data(tomllib.loads(Path(path).read_text()))
        return validate_file_config(merge_settings(data, overrides))

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        from memoryos_gpu.ops import build_info

        return "cuda" if build_info()["cuda_usable"] else "cpu"

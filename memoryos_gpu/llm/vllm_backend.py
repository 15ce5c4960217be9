"""vLLM in process: one ``LLM.chat`` call per batch, JSON-schema guided decoding.

The adapter is kept thin: :func:`build_sampling_kwargs` turns a :class:`ChatRequest` into
``SamplingParams`` keyword arguments and :func:`map_outputs` turns vLLM ``RequestOutput``
objects into :class:`ChatResult`; both are pure and unit-tested with fakes, since vLLM needs a
CUDA machine.

Sampling matches ``vllm serve`` for the same request: the server fills what a request leaves
unset (``top_p``, ``top_k``, ``min_p``, the penalties, a ``max_tokens`` cap) from the model's
``generation_config``, while ``LLM.chat`` with explicit ``SamplingParams`` would not;
:func:`serve_sampling_defaults` reads the same values from ``LLM.get_default_sampling_params()``
and every request starts from them (its own ``temperature`` and ``max_tokens`` win, as they do
over HTTP). ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``) go to every
``LLM.chat`` call and to the prompt measurement.

Prompt length: vLLM raises for the whole ``LLM.chat`` call when one prompt is over
``max_model_len``. Each prompt is therefore measured with the engine's tokenizer before the
batch; one over ``max_model_len - max_tokens`` (the room ``vllm serve`` demands) is shortened by
:func:`~memoryos_gpu.llm.prompt_fit.fit_messages`' rule, or fails alone when that cannot bring
it under. Should a batch still raise, it is split in halves until the failing requests are
alone (``log2(n)`` extra calls per bad request, not ``n``).

Structured outputs changed API across vLLM versions; both are found by feature detection:

* current vLLM (the old names were removed in v0.12):
  ``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``
* older vLLM: ``SamplingParams(guided_decoding=GuidedDecodingParams(json=schema))``

If neither exists, requests run unconstrained and the output is parsed and repaired.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from memoryos_gpu.llm.base import (
    JSON_RETRY_TEMPERATURE,
    BackendStats,
    ChatRequest,
    ChatResult,
    LLMBackend,
    LLMBackendError,
    retry_unparsed,
)
from memoryos_gpu.llm.jsonfix import parse_json_output
from memoryos_gpu.llm.prompt_fit import fit_messages

__all__ = [
    "JSON_RETRY_TEMPERATURE",
    "VLLMBackend",
    "build_sampling_kwargs",
    "detect_structured_api",
    "map_outputs",
    "serve_sampling_defaults",
]

log = logging.getLogger(__name__)


VLLM_MISSING = (
    "vLLM is not installed (import vllm failed: {err}). The in-process 'vllm' backend needs "
    "`pip install vllm` on a Linux machine with a CUDA GPU. Alternatives: run "
    "`vllm serve MODEL` elsewhere and use the 'openai' backend "
    "(make_backend('openai', base_url='http://HOST:8000/v1', model='MODEL')), or use the "
    "'transformers' backend (CPU or GPU, slower)."
)

StructuredAPI = tuple[str, Any]  # (SamplingParams field name, params class)
#: the SamplingParams fields ``vllm serve`` fills from generation_config when a request leaves
#: them unset (``temperature`` too, but every ChatRequest sets its own)
SERVE_DEFAULT_FIELDS = (
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
)


def _has_field(cls: Any, name: str) -> bool:
    fields = getattr(cls, "__struct_fields__", None)  # msgspec.Struct (vLLM's SamplingParams)
    if fields is not None:
        return name in fields
    if name in getattr(cls, "__dataclass_fields__", {}):
        return True
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def detect_structured_api(
    sampling_params_module: Any, sampling_params_cls: Any
) -> StructuredAPI | None:
    """Which structured-output API this vLLM offers: new, old, or None."""
    for field, cls_name in (
        ("structured_outputs", "StructuredOutputsParams"),
        ("guided_decoding", "GuidedDecodingParams"),
    ):
        cls = getattr(sampling_params_module, cls_name, None)
        if cls is not None and _has_field(sampling_params_cls, field):
            return field, cls
    return None


def serve_sampling_defaults(llm: Any, sampling_params_cls: Any) -> dict[str, Any]:
    """What ``vllm serve`` takes from the model's ``generation_config``: the
    :data:`SERVE_DEFAULT_FIELDS` of ``llm.get_default_sampling_params()`` that differ from a
    plain ``SamplingParams()``'s (empty when this vLLM has no such method)."""
    get = getattr(llm, "get_default_sampling_params", None)
    if get is None:
        return {}
    params, plain = get(), sampling_params_cls()
    out: dict[str, Any] = {}
    for name in SERVE_DEFAULT_FIELDS:
        value = getattr(params, name, None)
        if value is not None and value != getattr(plain, name, None):
            out[name] = value
    return out


def build_sampling_kwargs(
    request: ChatRequest,
    structured: StructuredAPI | None = ("structured_outputs", dict),
    *,
    temperature: float | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``SamplingParams(**kwargs)`` arguments for ``request``.

    ``structured`` is the result of :func:`detect_structured_api`: the field name and the class
    whose ``json=`` takes the schema (default: the current API with a plain dict, handy in
    tests). ``temperature`` overrides the request's (used for the JSON retry). ``defaults``
    (:func:`serve_sampling_defaults`) fill the rest; a ``max_tokens`` among them caps the
    request's, as ``vllm serve`` does.
    """
    kwargs = dict(defaults or {})
    cap = kwargs.pop("max_tokens", None)
    kwargs["max_tokens"] = int(min(request.max_tokens, cap) if cap else request.max_tokens)
    kwargs["temperature"] = float(request.temperature if temperature is None else temperature)
    if request.json_schema is not None and structured is not None:
        field, cls = structured
        kwargs[field] = cls(json=request.json_schema)
    return kwargs


def map_outputs(
    request_outputs: Sequence[Any],
    requests: Sequence[ChatRequest] | None = None,
    stats: BackendStats | None = None,
) -> list[ChatResult]:
    """vLLM ``RequestOutput``s → ``ChatResult``s (same order).

    Uses ``prompt_token_ids``, ``outputs[0].text`` and ``outputs[0].token_ids``. When
    ``requests`` is given, outputs of requests with a ``json_schema`` are parsed into ``parsed``
    (and ``stats`` counts repaired / invalid JSON).
    """
    if requests is not None and len(requests) != len(request_outputs):
        raise ValueError(f"{len(request_outputs)} outputs for {len(requests)} requests")
    results: list[ChatResult] = []
    for i, ro in enumerate(request_outputs):
        prompt_ids = getattr(ro, "prompt_token_ids", None) or []
        pt = len(prompt_ids)
        outs = getattr(ro, "outputs", None) or []
        if not outs:
            results.append(ChatResult.failed("vLLM returned no completion", pt))
            continue
        out = outs[0]
        text = getattr(out, "text", "") or ""
        ct = len(getattr(out, "token_ids", None) or [])
        parsed = None
        schema = requests[i].json_schema if requests is not None else None
        if schema is not None:
            parsed, repaired = parse_json_output(text, schema)
            if stats is not None:
                if parsed is None:
                    stats.add(invalid_json=1)
                elif repaired:
                    stats.add(repaired_json=1)
        results.append(ChatResult(text, parsed, pt, ct))
    return results


class VLLMBackend(LLMBackend):
    name = "vllm"

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.85,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        json_retry: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        try:
            import vllm
            import vllm.sampling_params as sp_mod
        except ImportError as e:
            raise LLMBackendError(VLLM_MISSING.format(err=e)) from e
        self.model = model
        self.json_retry = json_retry
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._SamplingParams = vllm.SamplingParams
        self._structured = detect_structured_api(sp_mod, vllm.SamplingParams)
        if self._structured is None:
            log.warning("this vLLM has no JSON-schema guided decoding; outputs are repaired only")
        kwargs: dict[str, Any] = dict(
            model=model,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(engine_kwargs)
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as e:
            raise LLMBackendError(f"vLLM could not load {model!r}: {type(e).__name__}: {e}") from e
        self.sampling_defaults = serve_sampling_defaults(self.llm, vllm.SamplingParams)
        self.max_model_len = _engine_max_model_len(self.llm) or max_model_len
        try:
            self._tokenizer: Any = self.llm.get_tokenizer()
        except Exception as e:  # e.g. skip_tokenizer_init=True
            log.warning("no tokenizer from vLLM (%s); prompts are not measured", e)
            self._tokenizer = None

    # ------------------------------------------------------------------ prompts

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids as ``LLM.chat`` makes them: the chat template rendered to text, then
        tokenized without special tokens (the template has them)."""
        tok = self._tokenizer
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
        )
        return list(tok.encode(text, add_special_tokens=False))

    def _fit_prompt(self, req: ChatRequest, max_tokens: int) -> list[dict[str, str]]:
        """The conversation to send: shortened when prompt + ``max_tokens`` would exceed
        ``max_model_len``; ``ValueError`` when it cannot be."""
        msgs = [dict(m) for m in req.messages]
        if self._tokenizer is None or not self.max_model_len:
            return msgs
        tok = self._tokenizer
        msgs, _ = fit_messages(
            msgs,
            self.max_model_len - max_tokens,
            self._encode,
            lambda text: list(tok.encode(text, add_special_tokens=False)),
            lambda ids: tok.decode(ids, skip_special_tokens=True),
        )
        return msgs

    # ------------------------------------------------------------------ generation

    def _chat(self, reqs: list[ChatRequest], temperature: float | None = None) -> list[ChatResult]:
        results: list[ChatResult | None] = [None] * len(reqs)
        todo: list[int] = []
        convs: list[list[dict[str, str]]] = []
        sps: list[Any] = []
        for i, r in enumerate(reqs):
            kw = build_sampling_kwargs(
                r, self._structured, temperature=temperature, defaults=self.sampling_defaults
            )
            try:
                conv = self._fit_prompt(r, kw["max_tokens"])
            except ValueError as e:  # too long even after truncation
                results[i] = ChatResult.failed(f"vLLM: {e} (max_model_len={self.max_model_len})")
                continue
            except Exception as e:  # the chat template cannot render it: LLM.chat could not
                results[i] = ChatResult.failed(f"vLLM: prompt not renderable: {e}")
                continue
            todo.append(i)
            convs.append(conv)
            sps.append(self._SamplingParams(**kw))
        for i, res in zip(todo, self._run([reqs[i] for i in todo], convs, sps), strict=True):
            results[i] = res
        return [r for r in results if r is not None]

    def _run(self, reqs: list[ChatRequest], convs: list, sps: list) -> list[ChatResult]:
        """One ``LLM.chat`` for the lot; when it raises, halves until the failures are alone."""
        if not reqs:
            return []
        extra = (
            {"chat_template_kwargs": self.chat_template_kwargs} if self.chat_template_kwargs else {}
        )
        try:
            outs = self.llm.chat(convs, sampling_params=sps, use_tqdm=False, **extra)
        except Exception as e:
            if len(reqs) == 1:
                return [ChatResult.failed(f"vLLM: {type(e).__name__}: {e}")]
            log.warning("vLLM batch of %d failed (%s); splitting it", len(reqs), e)
            h = len(reqs) // 2
            return self._run(reqs[:h], convs[:h], sps[:h]) + self._run(reqs[h:], convs[h:], sps[h:])
        return map_outputs(outs, reqs, self.stats)

    def _generate_batch(self, requests: list[ChatRequest]) -> list[ChatResult]:
        results = self._chat(requests)
        if self.json_retry:
            results = retry_unparsed(requests, results, self._chat, self.stats)
        return results

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        del llm
        try:
            import gc

            import torch

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass


def _engine_max_model_len(llm: Any) -> int | None:
    """The engine's ``max_model_len`` (the model's own when none was given)."""
    for holder in (getattr(llm, "llm_engine", None), llm):
        value = getattr(getattr(holder, "model_config", None), "max_model_len", None)
        if isinstance(value, int) and value > 0:
            return value
    return None

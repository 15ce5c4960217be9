"""vLLM in process: one ``LLM.chat`` call per batch, JSON-schema guided decoding.

The adapter is kept thin: :func:`build_sampling_kwargs` turns a :class:`ChatRequest` into
``SamplingParams`` keyword arguments and :func:`map_outputs` turns vLLM ``RequestOutput``
objects into :class:`ChatResult`; both are pure and unit-tested with fakes, since vLLM needs a
CUDA machine.

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

__all__ = [
    "JSON_RETRY_TEMPERATURE",
    "VLLMBackend",
    "build_sampling_kwargs",
    "detect_structured_api",
    "map_outputs",
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


def build_sampling_kwargs(
    request: ChatRequest,
    structured: StructuredAPI | None = ("structured_outputs", dict),
    *,
    temperature: float | None = None,
) -> dict[str, Any]:
    """``SamplingParams(**kwargs)`` arguments for ``request``.

    ``structured`` is the result of :func:`detect_structured_api`: the field name and the class
    whose ``json=`` takes the schema (default: the current API with a plain dict, handy in
    tests). ``temperature`` overrides the request's (used for the JSON retry).
    """
    kwargs: dict[str, Any] = {
        "max_tokens": int(request.max_tokens),
        "temperature": float(request.temperature if temperature is None else temperature),
    }
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

    def _sampling_params(self, req: ChatRequest, temperature: float | None = None) -> Any:
        return self._SamplingParams(
            **build_sampling_kwargs(req, self._structured, temperature=temperature)
        )

    def _chat(self, reqs: list[ChatRequest], temperature: float | None = None) -> list[ChatResult]:
        convs = [[dict(m) for m in r.messages] for r in reqs]
        sps = [self._sampling_params(r, temperature) for r in reqs]
        try:
            outs = self.llm.chat(convs, sampling_params=sps, use_tqdm=False)
        except Exception as e:
            if len(reqs) == 1:
                return [ChatResult.failed(f"vLLM: {type(e).__name__}: {e}")]
            log.warning("vLLM batch of %d failed (%s); retrying one by one", len(reqs), e)
            return [self._chat([r], temperature)[0] for r in reqs]
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

"""A scripted LLM test double: canned outputs per stage, and a record of every batch.

Two ways to script it:

* a callable ``responder(request) -> str | dict | list`` called once per request;
* a mapping from stage name to outputs. A ``list`` value is a queue consumed one output per
  request of that stage (the last entry repeats once the queue runs dry); a ``str`` / ``dict``
  value is returned for every request of that stage. The key ``"*"`` is the fallback for
  stages not listed. A dict/list output is ``json.dumps``-ed.

An output may also be an ``Exception`` instance: that request then gets ``ChatResult.error``
(useful to test the engine's error paths). A stage with no script gets an error result too,
never an exception, matching the contract of real backends.

Token counts are whitespace word counts of the prompt messages and of the output text. When
the request carries a ``json_schema`` the output goes through :func:`parse_json_output`, so
``parsed`` behaves exactly as with a real backend.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from memoryos_gpu.llm.base import ChatRequest, ChatResult, LLMBackend
from memoryos_gpu.llm.jsonfix import parse_json_output

__all__ = ["ScriptedBackend"]

Responder = Callable[[ChatRequest], Any]


def _word_count(text: str) -> int:
    return len(text.split())


class ScriptedBackend(LLMBackend):
    name = "scripted"

    def __init__(self, responder: Responder | Mapping[str, Any]) -> None:
        super().__init__()
        if callable(responder):
            self._fn: Responder | None = responder
            self._script: dict[str, Any] = {}
        elif isinstance(responder, Mapping):
            self._fn = None
            self._script = {
                k: (list(v) if isinstance(v, list) else v) for k, v in responder.items()
            }
        else:
            raise TypeError("ScriptedBackend needs a callable or a mapping stage -> outputs")
        self.batches: list[list[ChatRequest]] = []
        self._lock = threading.Lock()
        self.closed = False

    @property
    def requests(self) -> list[ChatRequest]:
        """Every request received, flattened in arrival order."""
        return [r for b in self.batches for r in b]

    def batch_sizes(self, stage: str | None = None) -> list[int]:
        """Sizes of the recorded batches (counting only ``stage``'s requests if given)."""
        if stage is None:
            return [len(b) for b in self.batches]
        sizes = [sum(1 for r in b if r.stage == stage) for b in self.batches]
        return [n for n in sizes if n]

    def _next_output(self, req: ChatRequest) -> Any:
        if self._fn is not None:
            return self._fn(req)
        key = req.stage if req.stage in self._script else "*"
        if key not in self._script:
            raise LookupError(f"ScriptedBackend has no script for stage {req.stage!r}")
        entry = self._script[key]
        if isinstance(entry, list):
            if not entry:
                raise LookupError(f"ScriptedBackend script for stage {req.stage!r} is empty")
            return entry.pop(0) if len(entry) > 1 else entry[0]
        return entry

    def _generate_batch(self, requests: list[ChatRequest]) -> list[ChatResult]:
        with self._lock:
            self.batches.append(list(requests))
            out: list[ChatResult] = []
            for req in requests:
                prompt_tokens = sum(_word_count(m["content"]) for m in req.messages)
                try:
                    value = self._next_output(req)
                except Exception as e:
                    out.append(ChatResult.failed(f"{type(e).__name__}: {e}", prompt_tokens))
                    continue
                if isinstance(value, BaseException):
                    out.append(ChatResult.failed(f"{type(value).__name__}: {value}", prompt_tokens))
                    continue
                text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                parsed = None
                if req.json_schema is not None:
                    parsed, repaired = parse_json_output(text, req.json_schema)
                    if parsed is None:
                        self.stats.add(invalid_json=1)
                    elif repaired:
                        self.stats.add(repaired_json=1)
                out.append(ChatResult(text, parsed, prompt_tokens, _word_count(text)))
            return out

    def close(self) -> None:
        self.closed = True

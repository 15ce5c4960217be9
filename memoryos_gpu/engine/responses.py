"""Answering with memory: one retrieval pass, one LLM batch, one ``add_many`` for many users.

The prompt is built by :func:`memoryos_gpu.prompts.response` from what the retrieval returned
(STM, MTM pages with their chain meta, profile, user and assistant knowledge). The exchange is
then remembered like any other page; a failed generation is returned with its error and not
stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memoryos_gpu import prompts
from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.stages import LLMStages
from memoryos_gpu.types import PageInput, Response, Retrieval, RetrievedPage

from .state import DEFAULT_ASSISTANT, EngineHooks, EngineState
from .validation import MAX_TEXT_CHARS, clean_queries


class Responder:
    """``respond_many`` over the engine's own ``retrieve_many`` and ``add_many`` (hooks)."""

    def __init__(self, state: EngineState, hooks: EngineHooks) -> None:
        self._s = state
        self._hooks = hooks

    def respond_many(
        self,
        queries: Sequence[tuple[str, str]],
        *,
        timestamp: float | str | None = None,
        assistant_id: str | None = None,
    ) -> list[Response]:
        """Answer many users at once: one retrieval pass, one LLM batch, one add_many.

        A user with no memory yet is answered from empty memory (and created by the add).
        A failed generation is returned with its error and not stored as a page; so is an
        answer longer than a page may be (its text is returned whole).
        """
        s = self._s
        if not isinstance(s.stages, LLMStages):
            raise MemoryOSError("respond needs an LLM backend: set config.llm.mode = 'llm'")
        queries = clean_queries(queries)
        found = iter(self._hooks.retrieve_many([q for q in queries if q[0] in s.users]))
        retrievals = [
            next(found) if u in s.users else Retrieval(u, q, [], [], {}, [], []) for u, q in queries
        ]
        assistants = [
            s.users[r.user_id].assistant_id
            if r.user_id in s.users
            else (assistant_id or DEFAULT_ASSISTANT)
            for r in retrievals
        ]
        messages = [
            prompts.response(
                r.query,
                _page_dicts(r.stm),
                _page_dicts(r.pages),
                r.profile,
                [e.text for e in r.user_knowledge],
                [e.text for e in r.assistant_knowledge],
                a,
            )
            for r, a in zip(retrievals, assistants, strict=True)
        ]
        results = s.stages.respond(messages)
        refused = {  # a page holds at most MAX_TEXT_CHARS: shown, but not remembered
            i: f"the answer ({len(res.text):,} characters) is over a page's limit of "
            f"{MAX_TEXT_CHARS:,}: returned, not remembered"
            for i, res in enumerate(results)
            if not res.error and len(res.text or "") > MAX_TEXT_CHARS
        }
        ok = [i for i, res in enumerate(results) if not res.error and i not in refused]
        added = self._hooks.add_many(
            [
                PageInput(
                    retrievals[i].user_id,
                    retrievals[i].query,
                    results[i].text or "",
                    timestamp,
                    assistants[i],
                )
                for i in ok
            ]
        )
        page_of = {i: a.page_id for i, a in zip(ok, added, strict=True)}
        s.counters["responses"] += len(ok)
        return [
            Response(
                r.user_id,
                r.query,
                res.text,
                r,
                page_of.get(i),
                res.prompt_tokens,
                res.completion_tokens,
                res.error or refused.get(i),
            )
            for i, (r, res) in enumerate(zip(retrievals, results, strict=True))
        ]


def _page_dicts(pages: Sequence[RetrievedPage]) -> list[dict[str, Any]]:
    return [
        {
            "user_input": p.user_input,
            "agent_response": p.agent_response,
            "timestamp": p.timestamp,
            "meta": p.meta,
        }
        for p in pages
    ]

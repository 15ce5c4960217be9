"""Answering with memory: one retrieval pass, one LLM batch, one ``add_many`` for many users.

The prompt is built by :func:`memoryos_gpu.prompts.response` from what the retrieval returned
(STM, MTM pages with their chain meta, profile, user and assistant knowledge). The exchange is
then remembered like any other page; a failed generation is returned with its error and not
stored, and so is an answer longer than ``llm.max_tokens`` could have made
(:func:`answer_limit`): the LLM server ignored the bound, and a page must not outgrow what the
write routes accept (it is embedded and shown in every later prompt).
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

#: Characters an answer may hold per token of ``llm.max_tokens``. Tokens average about four
#: characters of English and rarely more than ten of code or whitespace runs; only a server
#: that ignored ``max_tokens`` (or a model stuck repeating a token longer than 32 characters)
#: goes past it. 32 x the default 256 tokens = 8,192 characters.
MAX_CHARS_PER_TOKEN = 32


def answer_limit(max_tokens: int) -> int:
    """The longest answer remembered as a page: what ``max_tokens`` tokens can hold
    (:data:`MAX_CHARS_PER_TOKEN` each), never more than a page may hold. A longer one comes
    from a server that ignored ``max_tokens``; storing it would bypass the write routes' text
    limits (the server's ``max_text_chars``, 100,000 by default)."""
    return min(MAX_TEXT_CHARS, MAX_CHARS_PER_TOKEN * max_tokens)


def too_long(text: str | None, max_tokens: int) -> str | None:
    """Why an answer is returned but not remembered (:func:`answer_limit`), or None."""
    n, limit = len(text or ""), answer_limit(max_tokens)
    if n <= limit:
        return None
    return (
        f"the answer ({n:,} characters) is over a page's limit of {limit:,} characters for an "
        f"answer ({MAX_CHARS_PER_TOKEN} per token of max_tokens={max_tokens}, at most "
        f"{MAX_TEXT_CHARS:,}; did the LLM server ignore max_tokens?): returned, not remembered"
    )


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
        answer longer than ``max_tokens`` allows (:func:`answer_limit`; its text is returned
        whole, with the error saying why it was not remembered).
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
        refused = {
            i: why
            for i, res in enumerate(results)
            if not res.error and (why := too_long(res.text, s.stages.max_tokens))
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

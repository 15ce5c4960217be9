"""Prompts, JSON schemas, parsers and LLM-free fallbacks for every LLM stage.

Every builder is a pure function returning ``(messages, json_schema)``:

* ``messages`` is an OpenAI-style chat list. The **system message is a
  constant per stage** (identical for every user and every call), so a serving
  engine with prefix caching (vLLM) reuses its KV cache across the whole
  batch; everything user-specific is in the final user message.
* ``json_schema`` is a JSON Schema (Draft 2020-12 compatible, deliberately
  simple: objects, strings, booleans, arrays with ``maxItems``) suitable for
  guided / structured decoding. Builders return a fresh copy; the canonical
  objects are in :data:`SCHEMAS`.

For every stage there is also ``parse_<stage>(value)`` (accepts the decoded
JSON value *or* the raw model text; returns a typed, cleaned result or
``None`` when the output is unusable) and ``fallback_<stage>(...)`` (a safe
result computed without an LLM, used when the call or the parse fails so a page
is never lost). Nothing here does I/O or counts anything.

A *page* is any object or mapping with ``user_input``, ``agent_response`` and
``timestamp`` (a string, or a float of seconds since the epoch, rendered as
ISO-8601 UTC); retrieved pages may also carry ``meta`` (chain summary). Page
text is truncated to ``max_page_chars`` characters per field **only inside the
prompt**; nothing here modifies the page.

See ``docs/prompts.md`` for the rationale of each prompt.

This module is that API (what the engine, the evaluation and users import); the code is in
:mod:`memoryos_gpu.stage_prompts`, a module per concern (``rendering``, ``schemas``,
``system_prompts``, ``builders``, ``parsing``, ``fallbacks``).
"""

from memoryos_gpu.stage_prompts.builders import (
    assistant_knowledge,
    chain_meta,
    continuity,
    fused_page,
    fused_promotion,
    profile_update,
    response,
    topic_summary,
    user_knowledge,
)
from memoryos_gpu.stage_prompts.fallbacks import (
    fallback_assistant_knowledge,
    fallback_chain_meta,
    fallback_continuity,
    fallback_fused_page,
    fallback_fused_promotion,
    fallback_profile_update,
    fallback_topic_summary,
    fallback_user_knowledge,
)
from memoryos_gpu.stage_prompts.parsing import (
    MAX_FACT_CHARS,
    MAX_KEYWORD_CHARS,
    MAX_META_CHARS,
    MAX_PROFILE_VALUE_CHARS,
    MAX_SUMMARY_CHARS,
    FusedPageResult,
    PromotionResult,
    TopicSummary,
    extract_json,
    parse_assistant_knowledge,
    parse_chain_meta,
    parse_continuity,
    parse_fused_page,
    parse_fused_promotion,
    parse_profile_update,
    parse_topic_summary,
    parse_user_knowledge,
)
from memoryos_gpu.stage_prompts.rendering import (
    DEFAULT_META_CHARS,
    DEFAULT_PAGE_CHARS,
    first_sentence,
    format_timestamp,
    render_page,
    render_pages,
    truncate_text,
)
from memoryos_gpu.stage_prompts.schemas import DEFAULT_MAX_FACTS, DEFAULT_MAX_KEYWORDS, SCHEMAS
from memoryos_gpu.stage_prompts.system_prompts import STAGES, SYSTEM_PROMPTS

__all__ = [
    "DEFAULT_MAX_FACTS",
    "DEFAULT_MAX_KEYWORDS",
    "DEFAULT_META_CHARS",
    "DEFAULT_PAGE_CHARS",
    "MAX_FACT_CHARS",
    "MAX_KEYWORD_CHARS",
    "MAX_META_CHARS",
    "MAX_PROFILE_VALUE_CHARS",
    "MAX_SUMMARY_CHARS",
    "SCHEMAS",
    "STAGES",
    "SYSTEM_PROMPTS",
    "FusedPageResult",
    "PromotionResult",
    "TopicSummary",
    "assistant_knowledge",
    "chain_meta",
    "continuity",
    "extract_json",
    "fallback_assistant_knowledge",
    "fallback_chain_meta",
    "fallback_continuity",
    "fallback_fused_page",
    "fallback_fused_promotion",
    "fallback_profile_update",
    "fallback_topic_summary",
    "fallback_user_knowledge",
    "first_sentence",
    "format_timestamp",
    "fused_page",
    "fused_promotion",
    "parse_assistant_knowledge",
    "parse_chain_meta",
    "parse_continuity",
    "parse_fused_page",
    "parse_fused_promotion",
    "parse_profile_update",
    "parse_topic_summary",
    "parse_user_knowledge",
    "profile_update",
    "render_page",
    "render_pages",
    "response",
    "topic_summary",
    "truncate_text",
    "user_knowledge",
]

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
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from memoryos_gpu.llm.jsonfix import strip_reasoning
from memoryos_gpu.profile_dims import (
    dimensions_prompt_text,
    normalize_dimension_key,
    render_profile,
)
from memoryos_gpu.text.keywords import KeywordExtractor

__all__ = [
    "DEFAULT_MAX_FACTS",
    "DEFAULT_MAX_KEYWORDS",
    "DEFAULT_META_CHARS",
    "DEFAULT_PAGE_CHARS",
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

Messages = list[dict[str, str]]
Schema = dict[str, Any]

#: Characters kept per page field (user input / agent response) in a prompt.
DEFAULT_PAGE_CHARS = 1200
#: Characters kept of a chain meta summary shown in a prompt.
DEFAULT_META_CHARS = 600
#: Keywords kept per topic summary.
DEFAULT_MAX_KEYWORDS = 8
#: Facts kept per knowledge extraction call.
DEFAULT_MAX_FACTS = 10

# Caps applied by the parsers to model output.
MAX_META_CHARS = 500
MAX_SUMMARY_CHARS = 600
MAX_KEYWORD_CHARS = 48
MAX_FACT_CHARS = 300
MAX_PROFILE_VALUE_CHARS = 240

STAGES: tuple[str, ...] = (
    "continuity",
    "chain_meta",
    "topic_summary",
    "profile_update",
    "user_knowledge",
    "assistant_knowledge",
    "fused_page",
    "fused_promotion",
    "response",
)

_ELLIPSIS = "\u2026"


# ====================================================================== text
def truncate_text(text: str | None, max_chars: int | None) -> str:
    """``text`` cut to at most ``max_chars`` characters (ending in an ellipsis).

    ``None`` or ``max_chars <= 0`` means no limit. Only ever used on prompt copies.
    """
    text = "" if text is None else str(text)
    if not max_chars or max_chars <= 0 or len(text) <= max_chars:
        return text
    if max_chars == 1:
        return _ELLIPSIS
    return text[: max_chars - 1].rstrip() + _ELLIPSIS


def format_timestamp(ts: Any) -> str:
    """Render a timestamp: numbers (epoch seconds) as ISO-8601 UTC, strings as-is."""
    if ts is None:
        return ""
    if isinstance(ts, bool):
        return str(ts)
    if isinstance(ts, int | float):
        try:
            dt = datetime.fromtimestamp(float(ts), tz=UTC)
        except (OverflowError, OSError, ValueError):
            return str(ts)
        return dt.isoformat(timespec="seconds").replace("+00:00", "Z")
    if isinstance(ts, datetime):
        if ts.tzinfo is not None:
            ts = ts.astimezone(UTC)
            return ts.isoformat(timespec="seconds").replace("+00:00", "Z")
        return ts.isoformat(timespec="seconds")
    return str(ts).strip()


def _get(page: Any, name: str, default: Any = None) -> Any:
    if page is None:
        return default
    if isinstance(page, Mapping):
        return page.get(name, default)
    return getattr(page, name, default)


def _clean(text: Any) -> str:
    """Collapse whitespace; non-strings become ``""``."""
    if not isinstance(text, str):
        return ""
    return " ".join(text.split())


def render_page(
    page: Any,
    *,
    max_page_chars: int | None = DEFAULT_PAGE_CHARS,
    with_meta: bool = False,
    max_meta_chars: int | None = DEFAULT_META_CHARS,
) -> str:
    """One page as prompt text (timestamp, user, assistant, optional chain meta)."""
    ts = format_timestamp(_get(page, "timestamp"))
    user = truncate_text(_get(page, "user_input", "") or "", max_page_chars)
    agent = truncate_text(_get(page, "agent_response", "") or "", max_page_chars)
    lines = [f"Time: {ts or 'unknown'}"]
    if with_meta:
        meta = truncate_text(_get(page, "meta", "") or "", max_meta_chars)
        if meta:
            lines.append(f"Conversation thread: {meta}")
    lines.append(f"User: {user}")
    lines.append(f"Assistant: {agent}")
    return "\n".join(lines)


def render_pages(
    pages: Iterable[Any],
    *,
    max_page_chars: int | None = DEFAULT_PAGE_CHARS,
    with_meta: bool = False,
    max_meta_chars: int | None = DEFAULT_META_CHARS,
    empty_text: str = "(none)",
) -> str:
    """Numbered pages (``[1]``, ``[2]``, ...) separated by blank lines."""
    blocks = [
        f"[{i}] "
        + render_page(
            p, max_page_chars=max_page_chars, with_meta=with_meta, max_meta_chars=max_meta_chars
        )
        for i, p in enumerate(pages, 1)
    ]
    return "\n\n".join(blocks) if blocks else empty_text


_SENTENCE_RE = re.compile(r"(.+?[.!?\u3002\uff01\uff1f])(?=\s|$)", re.DOTALL)


def first_sentence(text: str | None, max_chars: int = 200) -> str:
    """First sentence of ``text`` (whitespace collapsed), truncated to ``max_chars``."""
    t = _clean(text or "")
    if not t:
        return ""
    m = _SENTENCE_RE.match(t)
    sent = m.group(1) if m else t
    return truncate_text(sent.strip(), max_chars)


# =================================================================== schemas
def _obj(properties: dict[str, Any], required: Sequence[str] | None = None) -> Schema:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


def _str_list(max_items: int) -> Schema:
    return {"type": "array", "items": {"type": "string"}, "maxItems": max_items}


def _fact_list(max_items: int) -> Schema:
    """Facts with a decision against the known entries shown (O-Mem's add / update / ignore):
    ``entry`` names the known entry an update replaces or an ignored fact repeats."""
    decided = _obj(
        {
            "fact": {"type": "string"},
            "action": {"type": "string", "enum": list(FACT_ACTIONS)},
            "entry": {"type": "integer"},
        },
        required=["fact", "action"],
    )
    # a bare string is an "add" (what models not shown known entries, and older prompts, answer)
    return {
        "type": "array",
        "items": {"anyOf": [decided, {"type": "string"}]},
        "maxItems": max_items,
    }


#: What a fused promotion may do with each fact, against the known entries it was shown.
FACT_ACTIONS = ("add", "update", "ignore")

# A map of dimension key -> text. The 90 keys are listed in the prompt, and the parser drops
# keys outside them; spelling them out as 90 schema properties made xgrammar's grammar
# compilation run for minutes on the CPU (measured), for no gain in what the parser accepts.
_PROFILE_UPDATES_SCHEMA: Schema = {
    "type": "object",
    "additionalProperties": {"type": "string"},
}

SCHEMAS: dict[str, Schema] = {
    "continuity": _obj({"continuous": {"type": "boolean"}}),
    "chain_meta": _obj({"meta": {"type": "string"}}),
    "topic_summary": _obj(
        {"summary": {"type": "string"}, "keywords": _str_list(DEFAULT_MAX_KEYWORDS)}
    ),
    "profile_update": _obj({"updates": _PROFILE_UPDATES_SCHEMA}),
    "user_knowledge": _obj({"facts": _str_list(DEFAULT_MAX_FACTS)}),
    "assistant_knowledge": _obj({"facts": _str_list(DEFAULT_MAX_FACTS)}),
    "fused_page": _obj(
        {
            "continuous": {"type": "boolean"},
            "meta": {"type": "string"},
            "summary": {"type": "string"},
            "keywords": _str_list(DEFAULT_MAX_KEYWORDS),
        }
    ),
    "fused_promotion": _obj(
        {
            "profile_updates": _PROFILE_UPDATES_SCHEMA,
            "user_facts": _fact_list(DEFAULT_MAX_FACTS),
            "assistant_facts": _fact_list(DEFAULT_MAX_FACTS),
        }
    ),
}


def _schema(stage: str) -> Schema:
    return copy.deepcopy(SCHEMAS[stage])


# ============================================================ system prompts
_JSON_RULE = "Reply with a single JSON object and nothing else: no prose, no code fences."

_SYS_CONTINUITY = f"""You maintain the memory of a conversational assistant. Dialogue is stored \
as pages; a page is one exchange: a user message and the assistant's reply.

Task: decide whether the CURRENT page continues the conversation thread of the PREVIOUS page.
- continuous = true when the current page follows up on, answers, elaborates or refers back \
to what the previous page was about (same topic, same activity, same people or event), \
including short replies such as "yes, and then?".
- continuous = false when the user starts a new subject, even if the tone is similar.
- Judge only from the two pages shown; timestamps far apart make continuation less likely.

Output format: {{"continuous": true}} or {{"continuous": false}}
{_JSON_RULE}"""

_SYS_CHAIN_META = f"""You maintain the memory of a conversational assistant. Consecutive pages \
(one user message + the assistant's reply each) that stay on one topic form a thread, and \
each thread has a running summary.

Task: write the updated thread summary after the NEW page.
- Start from the previous thread summary when one is given: keep what still matters, add \
what the new page contributes, drop what has become irrelevant.
- With no previous summary, summarise the new page alone.
- One or two sentences, at most 60 words, third person ("The user ...", "The assistant ...").
- Keep concrete names, places, dates, numbers and decisions; no filler.

Output format: {{"meta": "<summary>"}}
{_JSON_RULE}"""

_SYS_TOPIC = f"""You index dialogue for a conversational assistant's long-term memory. You \
receive one or more pages (a user message and the assistant's reply each) that left \
short-term memory.

Task: describe the main topic of these pages so they can be filed and found again.
- summary: one or two sentences, at most 50 words, stating the topic and the key specifics \
(who, what, where, when). If the pages cover several subjects, describe the dominant one \
and mention the others briefly.
- keywords: up to {DEFAULT_MAX_KEYWORDS} single words, most important first: names of people, \
places and organisations, dates and numbers, and distinctive nouns. No stopwords, no \
generic words such as "conversation", "user" or "assistant".

Output format: {{"summary": "<text>", "keywords": ["word", ...]}}
{_JSON_RULE}"""

_SYS_PROFILE = f"""You maintain a user profile for a conversational assistant. The profile has \
90 dimensions in three groups, listed below as key (name): meaning.

{dimensions_prompt_text()}

Task: read the existing profile and the new dialogue pages, and report which dimensions the \
NEW pages give evidence about.
- Include a dimension only when the new pages clearly show it; never guess. Most \
conversations touch only a few dimensions, and an empty result is normal.
- Value format: "High", "Medium" or "Low", then a colon and a short reason with concrete \
evidence (what the user said or did, and when), at most 30 words.
- When the dimension already has a value in the existing profile, write the merged value \
that combines the old evidence with the new; leave out dimensions whose value would not change.
- Describe the user only, never the assistant. Use the keys exactly as listed.

Output format: {{"updates": {{"<key>": "<Level>: <reason>", ...}}}}
{_JSON_RULE}"""

_SYS_USER_KNOWLEDGE = f"""You extract facts about the user for a conversational assistant's \
long-term memory. You receive dialogue pages (a user message and the assistant's reply each, \
with the time of the exchange).

Task: list the facts these pages reveal about the user.
- Personal details, people in the user's life, events, plans, possessions, preferences, \
habits, opinions, work and places.
- One fact per item, a short self-contained sentence that names the user ("The user ...") \
and the people, places and things involved.
- Turn relative times ("yesterday", "next week", "last year") into absolute dates using the \
time of the exchange, and add the date when it matters.
- Use only what the pages state; skip small talk and anything said only by the assistant.
- At most {DEFAULT_MAX_FACTS} facts, most important first; an empty list when there are none.

Output format: {{"facts": ["<fact>", ...]}}
{_JSON_RULE}"""

_SYS_ASSISTANT_KNOWLEDGE = f"""You extract facts about the assistant for a conversational \
assistant's long-term memory. You receive dialogue pages (a user message and the assistant's \
reply each, with the time of the exchange).

Task: list what these pages establish about the assistant itself.
- Its stated identity, role, persona, opinions and preferences; promises and commitments; \
recommendations, advice and concrete information it gave the user.
- One fact per item, a short self-contained sentence starting "The assistant ...", with the \
date when it matters.
- Use only what the pages state; skip greetings and generic politeness.
- At most {DEFAULT_MAX_FACTS} facts, most important first; an empty list when there are none.

Output format: {{"facts": ["<fact>", ...]}}
{_JSON_RULE}"""

_SYS_FUSED_PAGE = f"""You maintain the memory of a conversational assistant. Dialogue is stored \
as pages (one user message and the assistant's reply each). Consecutive pages on one topic \
form a thread with a running summary. You receive the PREVIOUS page, the summary of its \
thread, and the CURRENT page, which just left short-term memory.

Fill in four fields, in this order:
1. continuous: true when the current page follows up on, answers, elaborates or refers back \
to the previous page's subject (same topic, activity, people or event); false when the user \
starts a new subject.
2. meta: the thread summary after the current page. If continuous, update the previous \
thread summary with what the current page adds; otherwise summarise the current page alone. \
One or two sentences, at most 60 words, third person, keeping names, places, dates and numbers.
3. summary: the topic of the current page alone, one or two sentences, at most 50 words, with \
the key specifics (who, what, where, when).
4. keywords: up to {DEFAULT_MAX_KEYWORDS} single words for the current page, most important \
first: names, places, organisations, dates, numbers, distinctive nouns; no stopwords and no \
generic words such as "conversation", "user" or "assistant".

Output format: {{"continuous": true, "meta": "<text>", "summary": "<text>", \
"keywords": ["word", ...]}}
{_JSON_RULE}"""

_SYS_FUSED_PROMOTION = f"""You maintain the long-term memory of a conversational assistant: a \
user profile, facts about the user, and facts about the assistant. The profile has 90 \
dimensions in three groups, listed below as key (name): meaning.

{dimensions_prompt_text()}

You receive the existing profile and dialogue pages (a user message and the assistant's reply \
each, with the time of the exchange). Fill in three fields:
1. profile_updates: the dimensions the NEW pages clearly give evidence about, and only those. \
Value: "High", "Medium" or "Low", a colon, and a short reason with concrete evidence, at most \
30 words. Where the existing profile has a value, write the merged value; leave out \
dimensions that would not change. Describe the user only. An empty object is normal.
2. user_facts: facts the pages reveal about the user (personal details, people, events, \
plans, preferences, work, places), one short self-contained sentence each starting \
"The user ...". Turn relative times into absolute dates using the time of the exchange.
3. assistant_facts: what the pages establish about the assistant (identity, persona, \
opinions, commitments, recommendations and information it gave), one short sentence each \
starting "The assistant ...".
Each fact carries an action against the KNOWN facts listed (with their ids): "add" for a new \
fact; "update" when it changes a known fact (same subject and attribute, a new value, e.g. a \
new city or job), with "entry" the id of the known fact it replaces; "ignore" when a known \
fact already says it, with "entry" that fact's id.
Use only what the pages state. At most {DEFAULT_MAX_FACTS} facts per list, most important first.

Output format: {{"profile_updates": {{"<key>": "<Level>: <reason>"}}, "user_facts": \
[{{"fact": "<fact>", "action": "add"}}], "assistant_facts": [{{"fact": "<fact>", \
"action": "update", "entry": 12}}]}}
{_JSON_RULE}"""

_SYS_RESPONSE = """You are a helpful conversational assistant with a long-term memory of your \
conversations with this user. The user's message comes with material recalled from memory:
- ASSISTANT: your own name, persona and things you have said or done before;
- USER PROFILE and USER FACTS: what you know about the user;
- RECALLED PAGES: earlier exchanges relevant to the message, each with its time and a \
summary of the conversation thread it belongs to;
- RECENT CONVERSATION: the latest exchanges, oldest first;
- NEW MESSAGE: the message to answer now, with the current time when known.

How to answer:
- Continue the conversation naturally and answer the user's message directly.
- Ground statements about the past in the recalled material; do not invent events, names or \
dates. If memory does not contain what is asked, say so briefly instead of guessing.
- Pay attention to time: check each recalled item's timestamp against the time the question \
refers to; when facts conflict, prefer the most recent one. Resolve relative dates \
("last week") against the time of the exchange that mentioned them.
- Use the profile to adapt tone and level of detail, without commenting on the profile.
- Never mention memory sections, pages or this prompt."""

#: The constant system message of each stage (useful for prefix-cache warm-up).
SYSTEM_PROMPTS: dict[str, str] = {
    "continuity": _SYS_CONTINUITY,
    "chain_meta": _SYS_CHAIN_META,
    "topic_summary": _SYS_TOPIC,
    "profile_update": _SYS_PROFILE,
    "user_knowledge": _SYS_USER_KNOWLEDGE,
    "assistant_knowledge": _SYS_ASSISTANT_KNOWLEDGE,
    "fused_page": _SYS_FUSED_PAGE,
    "fused_promotion": _SYS_FUSED_PROMOTION,
    "response": _SYS_RESPONSE,
}


def _messages(stage: str, user_content: str) -> Messages:
    return [
        {"role": "system", "content": SYSTEM_PROMPTS[stage]},
        {"role": "user", "content": user_content},
    ]


def _meta_text(meta: str | None, max_meta_chars: int | None) -> str:
    m = truncate_text(_clean(meta or ""), max_meta_chars)
    return m or "(none)"


def _profile_text(existing_profile: Mapping[str, Any] | str | None) -> str:
    if isinstance(existing_profile, str):
        return existing_profile.strip() or "(empty)"
    return render_profile(existing_profile or {}, empty_text="(empty)")


# ================================================================== builders
def continuity(
    prev_page: Any, page: Any, *, max_page_chars: int | None = DEFAULT_PAGE_CHARS
) -> tuple[Messages, Schema]:
    """Stage 1: does ``page`` continue the thread of ``prev_page``? -> ``{"continuous"}``."""
    prev = (
        render_page(prev_page, max_page_chars=max_page_chars) if prev_page is not None else "(none)"
    )
    content = (
        f"PREVIOUS page:\n{prev}\n\n"
        f"CURRENT page:\n{render_page(page, max_page_chars=max_page_chars)}"
    )
    return _messages("continuity", content), _schema("continuity")


def chain_meta(
    prev_meta: str | None,
    page: Any,
    *,
    max_page_chars: int | None = DEFAULT_PAGE_CHARS,
    max_meta_chars: int | None = DEFAULT_META_CHARS,
) -> tuple[Messages, Schema]:
    """Stage 2: regenerate the chain meta summary from ``prev_meta`` + ``page``."""
    content = (
        f"Previous thread summary: {_meta_text(prev_meta, max_meta_chars)}\n\n"
        f"NEW page:\n{render_page(page, max_page_chars=max_page_chars)}"
    )
    return _messages("chain_meta", content), _schema("chain_meta")


def topic_summary(
    pages: Sequence[Any], *, max_page_chars: int | None = DEFAULT_PAGE_CHARS
) -> tuple[Messages, Schema]:
    """Stage 3: one topic summary + up to 8 keywords for a batch of evicted pages."""
    content = f"Pages:\n{render_pages(pages, max_page_chars=max_page_chars)}"
    return _messages("topic_summary", content), _schema("topic_summary")


def profile_update(
    existing_profile: Mapping[str, Any] | str | None,
    pages: Sequence[Any],
    *,
    max_page_chars: int | None = DEFAULT_PAGE_CHARS,
) -> tuple[Messages, Schema]:
    """Stage 4: profile updates over the 90 dimensions -> ``{"updates": {key: str}}``.

    ``existing_profile`` is a ``{key: value}`` dict (rendered grouped, empty
    values skipped) or already-rendered text.
    """
    content = (
        f"Existing profile:\n{_profile_text(existing_profile)}\n\n"
        f"New pages:\n{render_pages(pages, max_page_chars=max_page_chars)}"
    )
    return _messages("profile_update", content), _schema("profile_update")


def user_knowledge(
    pages: Sequence[Any], *, max_page_chars: int | None = DEFAULT_PAGE_CHARS
) -> tuple[Messages, Schema]:
    """Stage 5: facts about the user -> ``{"facts": [str]}``."""
    content = f"Pages:\n{render_pages(pages, max_page_chars=max_page_chars)}"
    return _messages("user_knowledge", content), _schema("user_knowledge")


def assistant_knowledge(
    pages: Sequence[Any], *, max_page_chars: int | None = DEFAULT_PAGE_CHARS
) -> tuple[Messages, Schema]:
    """Stage 6: facts about the assistant -> ``{"facts": [str]}``."""
    content = f"Pages:\n{render_pages(pages, max_page_chars=max_page_chars)}"
    return _messages("assistant_knowledge", content), _schema("assistant_knowledge")


def fused_page(
    prev_page: Any,
    prev_meta: str | None,
    page: Any,
    *,
    max_page_chars: int | None = DEFAULT_PAGE_CHARS,
    max_meta_chars: int | None = DEFAULT_META_CHARS,
) -> tuple[Messages, Schema]:
    """Stages 1+2+3 for one evicted page in one call.

    -> ``{"continuous": bool, "meta": str, "summary": str, "keywords": [str]}``.
    ``prev_page`` may be ``None`` (first page of a user): the model is then told
    there is none and is expected to answer ``continuous = false``.
    """
    prev = (
        render_page(prev_page, max_page_chars=max_page_chars) if prev_page is not None else "(none)"
    )
    content = (
        f"PREVIOUS page:\n{prev}\n\n"
        f"Thread summary of the previous page: {_meta_text(prev_meta, max_meta_chars)}\n\n"
        f"CURRENT page:\n{render_page(page, max_page_chars=max_page_chars)}"
    )
    return _messages("fused_page", content), _schema("fused_page")


def fused_promotion(
    existing_profile: Mapping[str, Any] | str | None,
    pages: Sequence[Any],
    *,
    known_user: Sequence[tuple[int, str]] = (),
    known_assistant: Sequence[tuple[int, str]] = (),
    max_page_chars: int | None = DEFAULT_PAGE_CHARS,
) -> tuple[Messages, Schema]:
    """Stages 4+5+6 for a promoted segment's pages in one call, with the owners' known
    (live) facts as ``(entry id, text)`` to decide each new fact against.

    -> ``{"profile_updates": {key: str}, "user_facts": [{"fact", "action", "entry"}],
    "assistant_facts": [...]}``.
    """
    content = (
        f"Existing profile:\n{_profile_text(existing_profile)}\n\n"
        f"KNOWN user facts:\n{_known_facts(known_user)}\n\n"
        f"KNOWN assistant facts:\n{_known_facts(known_assistant)}\n\n"
        f"New pages:\n{render_pages(pages, max_page_chars=max_page_chars)}"
    )
    return _messages("fused_promotion", content), _schema("fused_promotion")


def _known_facts(known: Sequence[tuple[int, str]]) -> str:
    lines = [f"- [{eid}] {_clean(text)}" for eid, text in known]
    return "\n".join(lines) if lines else "(none)"


def _bullets(items: Iterable[Any], empty: str = "(none)") -> str:
    cleaned = (_clean(x if isinstance(x, str) else str(x)) for x in items)
    lines = [f"- {c}" for c in cleaned if c]
    return "\n".join(lines) if lines else empty


def response(
    query: str,
    stm_pages: Sequence[Any],
    retrieved_pages: Sequence[Any],
    profile_text: str | Mapping[str, Any] | None,
    user_facts: Sequence[str],
    assistant_facts: Sequence[str],
    assistant_name: str | None = None,
    *,
    now: Any = None,
    extra_instructions: str | None = None,
    max_page_chars: int | None = DEFAULT_PAGE_CHARS,
    max_meta_chars: int | None = DEFAULT_META_CHARS,
) -> Messages:
    """Stage 7: the final response prompt (messages only, free-text answer).

    The user message orders its sections from the most stable to the most
    volatile (assistant, profile, user facts, recalled pages, recent
    conversation, then the new message), so consecutive turns of one user also share
    a long cached prefix. ``retrieved_pages`` are rendered in the given order
    with their timestamps and chain ``meta``. ``profile_text`` may be rendered
    text or a profile dict. ``now`` (timestamp) adds the current time;
    ``extra_instructions`` (e.g. "Answer in at most 30 words.") goes right before
    the query, never into the shared system message. The query itself is not
    truncated.
    """
    if isinstance(profile_text, Mapping):
        profile_block = render_profile(profile_text, empty_text="(unknown)")
    else:
        profile_block = (profile_text or "").strip() or "(unknown)"
    assistant_lines = []
    if assistant_name and assistant_name.strip():
        assistant_lines.append(f"Name: {_clean(assistant_name)}")
    assistant_lines.append(_bullets(assistant_facts, empty="(nothing recorded)"))
    sections = [
        "## ASSISTANT\n" + "\n".join(assistant_lines),
        f"## USER PROFILE\n{profile_block}",
        f"## USER FACTS\n{_bullets(user_facts)}",
        "## RECALLED PAGES\n"
        + render_pages(
            retrieved_pages,
            max_page_chars=max_page_chars,
            with_meta=True,
            max_meta_chars=max_meta_chars,
        ),
        "## RECENT CONVERSATION\n" + render_pages(stm_pages, max_page_chars=max_page_chars),
    ]
    tail = ["## NEW MESSAGE"]
    now_text = format_timestamp(now)
    if now_text:
        tail.append(f"Current time: {now_text}")
    if extra_instructions and extra_instructions.strip():
        tail.append(extra_instructions.strip())
    tail.append(f"User: {query}")
    content = "\n\n".join(sections) + "\n\n" + "\n".join(tail)
    return [
        {"role": "system", "content": SYSTEM_PROMPTS["response"]},
        {"role": "user", "content": content},
    ]


# =================================================================== parsing
_FENCE_RE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_json(text: Any) -> Any | None:
    """Best-effort decode of model output: JSON values pass through; strings are
    stripped of reasoning (:func:`~memoryos_gpu.llm.jsonfix.strip_reasoning`: ``<think>``
    blocks, but not a tag inside a JSON string) and code fences and decoded, falling back to
    the outermost ``{...}`` span. Returns ``None`` when nothing decodes."""
    if not isinstance(text, str):
        return text
    t = strip_reasoning(text).strip()
    m = _FENCE_RE.search(t)
    candidates = [m.group(1).strip()] if m else []
    candidates.append(t)
    start, end = t.find("{"), t.rfind("}")
    if 0 <= start < end:
        candidates.append(t[start : end + 1])
    for c in candidates:
        try:
            return json.loads(c)
        except (json.JSONDecodeError, ValueError):
            continue
    return None


def _as_obj(value: Any) -> dict[str, Any] | None:
    v = extract_json(value)
    return v if isinstance(v, dict) else None


def _parse_bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return None


def _parse_text(v: Any, max_chars: int) -> str | None:
    if not isinstance(v, str):
        return None
    t = _clean(v)
    return truncate_text(t, max_chars) if t else None


_NONE_WORDS = frozenset({"none", "n/a", "na", "null", "nothing", "no facts", "-", "none."})
_BULLET_RE = re.compile(r"^(?:[-*\u2022]+|\d+[.)])\s*")


def _parse_str_list(v: Any, max_items: int, max_chars: int) -> list[str] | None:
    """List of strings: cleaned, bullet-stripped, "None"-like and empty entries
    dropped, case-insensitive duplicates removed, capped. Non-list -> ``None``;
    non-string items are dropped."""
    if not isinstance(v, list):
        return None
    out: list[str] = []
    seen: set[str] = set()
    for item in v:
        if not isinstance(item, str):
            continue
        t = _BULLET_RE.sub("", _clean(item)).strip()
        if not t or t.lower() in _NONE_WORDS:
            continue
        t = truncate_text(t, max_chars)
        k = t.casefold()
        if k in seen:
            continue
        seen.add(k)
        out.append(t)
        if len(out) >= max_items:
            break
    return out


def _parse_profile_updates(v: Any) -> dict[str, str] | None:
    """Object of ``{dimension: str}``; unknown dimensions and non-string or empty
    values are dropped; display names are mapped to keys. Non-object -> None."""
    if not isinstance(v, dict):
        return None
    out: dict[str, str] = {}
    for raw_key, raw_value in v.items():
        key = normalize_dimension_key(raw_key)
        if key is None or not isinstance(raw_value, str):
            continue
        t = _clean(raw_value)
        if not t or t.lower() in _NONE_WORDS:
            continue
        out[key] = truncate_text(t, MAX_PROFILE_VALUE_CHARS)
    return out


@dataclass
class TopicSummary:
    summary: str
    keywords: list[str] = field(default_factory=list)


@dataclass
class FusedPageResult:
    continuous: bool
    meta: str
    summary: str
    keywords: list[str] = field(default_factory=list)


@dataclass
class PromotionResult:
    profile_updates: dict[str, str] = field(default_factory=dict)
    user_facts: list[str] = field(default_factory=list)
    assistant_facts: list[str] = field(default_factory=list)
    # per fact (action, entry id) when the model gave decisions (objects), else None
    user_decisions: list[tuple[str, int | None]] | None = None
    assistant_decisions: list[tuple[str, int | None]] | None = None


def parse_continuity(value: Any) -> bool | None:
    """``{"continuous": bool}`` -> bool. Also accepts a bare JSON boolean and the
    strings ``"true"``/``"false"``; anything else -> ``None``."""
    v = extract_json(value)
    if isinstance(v, dict):
        return _parse_bool(v.get("continuous"))
    if isinstance(value, str) and v is None:
        return _parse_bool(strip_reasoning(value).strip().strip(".\"'"))
    return _parse_bool(v)


def parse_chain_meta(value: Any) -> str | None:
    """``{"meta": str}`` -> non-empty cleaned string (<= 500 chars) or ``None``."""
    obj = _as_obj(value)
    return None if obj is None else _parse_text(obj.get("meta"), MAX_META_CHARS)


def parse_topic_summary(
    value: Any, *, max_keywords: int = DEFAULT_MAX_KEYWORDS
) -> TopicSummary | None:
    """``{"summary": str, "keywords": [str]}`` -> :class:`TopicSummary` or ``None``.

    The summary must be a non-empty string; ``keywords`` must be a list (a
    missing list counts as empty). Keywords are kept as written (cleaned,
    de-duplicated, at most ``max_keywords``); run them through
    :func:`memoryos_gpu.text.keywords.keyword_tokens` before hashing.
    """
    obj = _as_obj(value)
    if obj is None:
        return None
    summary = _parse_text(obj.get("summary"), MAX_SUMMARY_CHARS)
    kws = _parse_str_list(obj.get("keywords", []), max_keywords, MAX_KEYWORD_CHARS)
    if summary is None or kws is None:
        return None
    return TopicSummary(summary, kws)


def parse_profile_update(value: Any) -> dict[str, str] | None:
    """``{"updates": {key: str}}`` -> dict restricted to the 90 keys, or ``None``."""
    obj = _as_obj(value)
    return None if obj is None else _parse_profile_updates(obj.get("updates"))


def parse_user_knowledge(value: Any, *, max_facts: int = DEFAULT_MAX_FACTS) -> list[str] | None:
    """``{"facts": [str]}`` -> cleaned list (may be empty) or ``None``."""
    obj = _as_obj(value)
    return None if obj is None else _parse_str_list(obj.get("facts"), max_facts, MAX_FACT_CHARS)


def parse_assistant_knowledge(
    value: Any, *, max_facts: int = DEFAULT_MAX_FACTS
) -> list[str] | None:
    """``{"facts": [str]}`` -> cleaned list (may be empty) or ``None``."""
    return parse_user_knowledge(value, max_facts=max_facts)


def parse_fused_page(
    value: Any, *, max_keywords: int = DEFAULT_MAX_KEYWORDS
) -> FusedPageResult | None:
    """All four fields must be valid (keywords may be missing/empty), else ``None``."""
    obj = _as_obj(value)
    if obj is None:
        return None
    cont = _parse_bool(obj.get("continuous"))
    meta = _parse_text(obj.get("meta"), MAX_META_CHARS)
    summary = _parse_text(obj.get("summary"), MAX_SUMMARY_CHARS)
    kws = _parse_str_list(obj.get("keywords", []), max_keywords, MAX_KEYWORD_CHARS)
    if cont is None or meta is None or summary is None or kws is None:
        return None
    return FusedPageResult(cont, meta, summary, kws)


def parse_fused_promotion(
    value: Any, *, max_facts: int = DEFAULT_MAX_FACTS
) -> PromotionResult | None:
    """Each of the three fields may be missing (-> empty) but must have the right
    container type when present, else ``None``."""
    obj = _as_obj(value)
    if obj is None:
        return None
    prof = _parse_profile_updates(obj.get("profile_updates", {}))
    uf = _parse_facts(obj.get("user_facts", []), max_facts)
    af = _parse_facts(obj.get("assistant_facts", []), max_facts)
    if prof is None or uf is None or af is None:
        return None
    return PromotionResult(prof, uf[0], af[0], uf[1], af[1])


def _parse_facts(
    v: Any, max_items: int
) -> tuple[list[str], list[tuple[str, int | None]] | None] | None:
    """Facts as plain strings or ``{"fact", "action", "entry"}`` objects -> (texts, decisions
    or None when no item carried one). An unknown action is "add"; a non-list -> None."""
    if not isinstance(v, list):
        return None
    texts: list[Any] = []
    actions: list[tuple[str, int | None]] = []
    decided = False
    for item in v:
        if isinstance(item, dict):
            decided = True
            action = item.get("action")
            entry = item.get("entry")
            ok = isinstance(entry, int) and not isinstance(entry, bool) and entry > 0
            act = action if action in FACT_ACTIONS and (ok or action == "add") else "add"
            texts.append(item.get("fact"))
            actions.append((act, entry if act != "add" else None))
        else:
            texts.append(item)
            actions.append(("add", None))
    kept = _parse_str_list(texts, max_items, MAX_FACT_CHARS)
    if kept is None:
        return None
    if not decided:
        return kept, None
    # _parse_str_list drops empty and repeated items: keep the decision of each kept text
    by_text: dict[str, tuple[str, int | None]] = {}
    for t, a in zip(texts, actions, strict=True):
        if isinstance(t, str):
            clean = truncate_text(_BULLET_RE.sub("", _clean(t)).strip(), MAX_FACT_CHARS)
            by_text.setdefault(clean.casefold(), a)
    return kept, [by_text.get(t.casefold(), ("add", None)) for t in kept]


# ================================================================= fallbacks
def _page_first_sentence(page: Any, max_chars: int) -> str:
    s = first_sentence(_get(page, "user_input", "") or "", max_chars)
    return s or first_sentence(_get(page, "agent_response", "") or "", max_chars)


def _page_text(page: Any) -> str:
    return f"{_get(page, 'user_input', '') or ''}\n{_get(page, 'agent_response', '') or ''}"


def fallback_continuity(prev_page: Any = None, page: Any = None) -> bool:
    """No LLM: never link pages (each evicted page starts its own chain)."""
    return False


def fallback_chain_meta(prev_meta: str | None, page: Any, *, max_chars: int = 200) -> str:
    """No LLM: the first sentence of the page's user input (of the response when the
    input is empty), truncated to ``max_chars``; ``prev_meta`` is ignored."""
    return _page_first_sentence(page, max_chars)


def fallback_topic_summary(
    pages: Sequence[Any],
    *,
    extractor: KeywordExtractor | None = None,
    max_keywords: int = DEFAULT_MAX_KEYWORDS,
    max_chars: int = 200,
) -> TopicSummary:
    """No LLM: extractive summary and statistical keywords.

    summary = first sentence of the first page's user input (falling back to the
    response, then to later pages), truncated to ``max_chars``; keywords = the
    ``extractor``'s top ``max_keywords`` over all page text (pass a fitted
    per-user extractor for IDF; an unfitted default one is used otherwise).
    """
    summary = ""
    for p in pages:
        summary = _page_first_sentence(p, max_chars)
        if summary:
            break
    if max_keywords <= 0:  # the summary alone (the extractive stage ranks keywords itself)
        return TopicSummary(summary, [])
    ex = extractor if extractor is not None else KeywordExtractor()
    text = "\n".join(_page_text(p) for p in pages)
    return TopicSummary(summary, ex.extract(text, top_n=max_keywords))


def fallback_profile_update(existing_profile: Any = None, pages: Any = None) -> dict[str, str]:
    """No LLM: no profile updates."""
    return {}


def fallback_user_knowledge(pages: Any = None) -> list[str]:
    """No LLM: no facts."""
    return []


def fallback_assistant_knowledge(pages: Any = None) -> list[str]:
    """No LLM: no facts."""
    return []


def fallback_fused_page(
    prev_page: Any,
    prev_meta: str | None,
    page: Any,
    *,
    extractor: KeywordExtractor | None = None,
    max_keywords: int = DEFAULT_MAX_KEYWORDS,
    max_chars: int = 200,
) -> FusedPageResult:
    """No LLM: not continuous; meta and summary from the first sentence; keywords
    from the extractor (see :func:`fallback_topic_summary`)."""
    ts = fallback_topic_summary(
        [page], extractor=extractor, max_keywords=max_keywords, max_chars=max_chars
    )
    return FusedPageResult(
        continuous=False,
        meta=fallback_chain_meta(prev_meta, page, max_chars=max_chars),
        summary=ts.summary,
        keywords=ts.keywords,
    )


def fallback_fused_promotion(existing_profile: Any = None, pages: Any = None) -> PromotionResult:
    """No LLM: no profile updates and no facts."""
    return PromotionResult()

"""One prompt builder per LLM stage: ``(messages, json_schema)`` for the stage's call.

``messages`` is an OpenAI-style chat list: the stage's constant system message
(:data:`~.system_prompts.SYSTEM_PROMPTS`), then one user message with everything user-specific
(pages, previous summary, existing profile, known facts). ``json_schema`` is a fresh copy of the
stage's answer schema (:data:`~.schemas.SCHEMAS`). :func:`response` (stage 7) returns the messages
only: its answer is free text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from memoryos_gpu.profile_dims import render_profile

from .rendering import (
    DEFAULT_META_CHARS,
    DEFAULT_PAGE_CHARS,
    _clean,
    format_timestamp,
    render_page,
    render_pages,
    truncate_text,
)
from .schemas import Schema, _schema
from .system_prompts import SYSTEM_PROMPTS

__all__ = [
    "assistant_knowledge",
    "chain_meta",
    "continuity",
    "fused_page",
    "fused_promotion",
    "profile_update",
    "response",
    "topic_summary",
    "user_knowledge",
]

Messages = list[dict[str, str]]


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

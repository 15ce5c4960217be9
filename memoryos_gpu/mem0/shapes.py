"""The mapping between mem0's vocabulary and MemoryOS's: memory ids, message lists, items.

A mem0 "memory" is one of two things here, told apart by its id:

* ``page-<n>``: a dialogue page (one exchange: the user's message and the assistant's answer),
  in short- or mid-term memory (``tier`` ``"stm"`` / ``"mtm"``). Its ``memory`` text is
  ``"User: ...\\nAssistant: ..."``, its ``metadata`` the page's metadata.
* ``knowledge-<n>``: a long-term knowledge entry (a fact about the user, with ``user_id`` and
  the user's assistant as ``agent_id``, or the assistant's knowledge, with ``agent_id`` only),
  ``tier`` ``"lpm"``.

Both carry mem0's fields (``id``, ``memory``, ``hash``, ``metadata``, ``created_at``,
``updated_at``, ``user_id``, ``agent_id``, ``run_id``, and ``score`` in search results) plus
``kind`` and ``tier``. Times are ISO-8601 in UTC.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from memoryos_gpu.types import PageInput

from .filters import RESERVED_METADATA_KEYS

__all__ = [
    "MemoryId",
    "history_events",
    "knowledge_item",
    "messages_to_pages",
    "page_item",
    "parse_memory_id",
    "public",
]

_KINDS = ("page", "knowledge")


@dataclass(frozen=True)
class MemoryId:
    kind: str  # "page" or "knowledge"
    number: int

    def __str__(self) -> str:
        return f"{self.kind}-{self.number}"


def parse_memory_id(memory_id: Any) -> MemoryId | None:
    """``"page-12"`` -> MemoryId("page", 12); None for anything that names no memory here
    (so a get answers "not found" rather than an error, as mem0 does for an unknown id)."""
    if not isinstance(memory_id, str):
        return None
    kind, _, number = memory_id.strip().partition("-")
    if kind not in _KINDS or not number.isdigit() or not number.isascii():
        return None
    n = int(number)
    return MemoryId(kind, n) if n < 2**63 else None


# ---------------------------------------------------------------------- messages -> pages
def messages_to_pages(
    messages: Any,
    *,
    user_id: str,
    assistant_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    timestamp: float | str | None = None,
    default_assistant: str | None = None,
) -> list[PageInput]:
    """mem0's ``messages`` (a string, one message dict or an OpenAI-style list) as pages.

    A user message and the assistant message after it make one page; a user message with no
    answer (or an answer with no question) is a page with that side empty. ``system`` and
    ``tool`` messages are context for an LLM, not memory: they are skipped. ``run_id`` is kept
    in the page's metadata (so filters can select it). ``default_assistant``: as
    :class:`~memoryos_gpu.types.PageInput`'s (a tenant's server passes its own default)."""
    meta = _checked_metadata(metadata, run_id)
    pairs = _pairs(_message_list(messages))
    return [
        PageInput(
            user_id=user_id,
            user_input=u,
            agent_response=a,
            timestamp=timestamp,
            assistant_id=assistant_id,
            meta=dict(meta),
            default_assistant=default_assistant,
        )
        for u, a in pairs
    ]


def _checked_metadata(metadata: Mapping[str, Any] | None, run_id: str | None) -> dict[str, Any]:
    """The page's metadata with ``run_id`` in it. Keys named like an item field are refused:
    a filter on such a key tests the item's field, so the metadata value could never be
    selected (mem0 filters are metadata filters; a silent miss is worse than an error)."""
    if metadata is not None and not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    meta = dict(metadata or {})
    shadowed = sorted(k for k in meta if k in RESERVED_METADATA_KEYS)
    if shadowed:
        raise ValueError(
            f"metadata keys {shadowed} name item fields, which filters test instead; rename "
            f"them (reserved: {', '.join(RESERVED_METADATA_KEYS)})"
        )
    if run_id is not None:
        if meta.get("run_id", run_id) != run_id:
            raise ValueError(f"run_id={run_id!r} and metadata['run_id'] disagree")
        meta["run_id"] = run_id
    return meta


def _message_list(messages: Any) -> list[tuple[str, str]]:
    """(role, text) of each message that carries text."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    elif isinstance(messages, Mapping):
        messages = [messages]
    if not isinstance(messages, Sequence) or isinstance(messages, bytes):
        raise ValueError("messages must be a string, a message dict or a list of message dicts")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        role = msg["role"]
        if role in ("system", "tool", "developer"):
            continue
        if role not in ("user", "assistant"):
            raise ValueError(f"messages[{i}] has role {role!r}; use 'user' or 'assistant'")
        text = _content_text(msg["content"], i)
        if text.strip():
            out.append((role, text))
    if not out:
        raise ValueError("messages hold no user or assistant text to remember")
    return out


def _content_text(content: Any, i: int) -> str:
    """A message's text: a string, or the text parts of an OpenAI content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError(f"messages[{i}]: only text content parts can be remembered")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


def _pairs(messages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    question: str | None = None
    for role, text in messages:
        if role == "user":
            if question is not None:
                pairs.append((question, ""))
            question = text
        else:
            pairs.append((question or "", text))
            question = None
    if question is not None:
        pairs.append((question, ""))
    return pairs


# ---------------------------------------------------------------------- items
def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(float(ts), UTC).isoformat()


def page_text(user_input: str, agent_response: str) -> str:
    """A page as one mem0 memory: each side that has words, labelled; a blank side (empty or
    only whitespace: the engine keeps such pages, as MemoryOS does) is left out alike."""
    parts = [f"User: {user_input}"] if user_input.strip() else []
    if agent_response.strip():
        parts.append(f"Assistant: {agent_response}")
    return "\n".join(parts)


def _item(
    memory_id: MemoryId, text: str, created: float | None, updated: float | None, **fields: Any
) -> dict[str, Any]:
    return {
        "id": str(memory_id),
        "memory": text,
        "hash": hashlib.md5(text.encode()).hexdigest(),
        "created_at": iso(created),
        "updated_at": iso(updated),
        "_created_at_ts": created,  # for time filters; removed by public()
        "_updated_at_ts": updated,
        **fields,
    }


def page_item(
    page: Mapping[str, Any],
    *,
    user_id: str,
    assistant_id: str | None,
    updated: float | None = None,
) -> dict[str, Any]:
    """A page (a store row, or a retrieved page's fields) as a mem0 item."""
    meta = dict(page.get("extra") or {})
    return _item(
        MemoryId("page", int(page["page_id"])),
        page_text(page["user_input"], page["agent_response"]),
        float(page["timestamp"]),
        updated,
        metadata=meta or None,
        user_id=user_id,
        agent_id=assistant_id,
        run_id=meta.get("run_id"),
        kind="page",
        tier=page["tier"],
        user_input=page["user_input"],
        agent_response=page["agent_response"],
    )


def knowledge_item(
    entry_id: int,
    text: str,
    *,
    created: float | None,
    user_id: str | None,
    assistant_id: str | None,
    updated: float | None = None,
) -> dict[str, Any]:
    """A knowledge entry as a mem0 item: the user's (``user_id`` and ``agent_id``, the user's
    assistant) or the assistant's (``agent_id`` only)."""
    return _item(
        MemoryId("knowledge", int(entry_id)),
        text,
        created,
        updated,
        metadata=None,
        user_id=user_id,
        agent_id=assistant_id,
        run_id=None,
        kind="knowledge",
        tier="lpm",
    )


def public(item: dict[str, Any], score: float | None = None) -> dict[str, Any]:
    """The item as answered: without the internal time fields, with ``score`` when given."""
    out = {k: v for k, v in item.items() if not k.startswith("_")}
    if score is not None:
        out["score"] = float(score)
    return out


# ---------------------------------------------------------------------- history
_EVENTS = {"add": "ADD", "update": "UPDATE", "delete": "DELETE"}


def history_events(
    memory_id: MemoryId,
    events: list[dict[str, Any]],
    current: str | None,
    created: float | None = None,
) -> list[dict[str, Any]]:
    """The audit events of one memory in mem0's history shape, oldest first.

    The audit keeps the text before and after each edit, so the text a memory was added with is
    the first edit's "before" (or the current text when it was never edited). A knowledge
    entry's creation is not audited: its ADD is dated ``created`` (the entry's own time, what
    ``get`` answers; None once it is deleted), never the first edit's time."""
    texts = [_texts(memory_id.kind, e.get("detail") or {}) for e in events]
    first_before = next((b for b, _ in texts if b is not None), None)
    out: list[dict[str, Any]] = []
    if memory_id.kind == "knowledge" and not any(e["action"] == "add" for e in events):
        added = first_before or current
        out.append(_event(f"{memory_id}-add", memory_id, "ADD", None, added, created))
    for e, (before, after) in zip(events, texts, strict=True):
        kind = _EVENTS.get(e["action"])
        if kind is None:
            continue
        if kind == "ADD":
            before, after = None, first_before if first_before is not None else current
        out.append(_event(str(e["event_id"]), memory_id, kind, before, after, e["ts"]))
    return out


def _texts(kind: str, detail: Mapping[str, Any]) -> tuple[str | None, str | None]:
    before, after = detail.get("before"), detail.get("after")
    if kind == "page":
        before = page_text(before["user_input"], before["agent_response"]) if before else None
        after = page_text(after["user_input"], after["agent_response"]) if after else None
    return before, after


def _event(
    event_id: str,
    memory_id: MemoryId,
    event: str,
    old: str | None,
    new: str | None,
    ts: float | None,
) -> dict[str, Any]:
    return {
        "id": event_id,
        "memory_id": str(memory_id),
        "old_memory": old,
        "new_memory": new,
        "event": event,
        "created_at": iso(ts),
        "updated_at": iso(ts) if event != "ADD" else None,
        "is_deleted": event == "DELETE",
        "actor_id": None,
        "role": None,
    }

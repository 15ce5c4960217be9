"""A model's answer -> a typed, cleaned result, or ``None`` when it is unusable.

``parse_<stage>(value)`` accepts the decoded JSON value *or* the raw model text
(:func:`extract_json`). The top-level value must be an object and each field must have the right
container type; strings are whitespace-collapsed and capped (the ``MAX_*_CHARS`` below); list items
are cleaned, de-duplicated and capped; profile keys are mapped to the 90 dimension keys. On
``None`` the caller retries or uses the stage's fallback. The rules are in ``docs/prompts.md``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from memoryos_gpu.llm.jsonfix import strip_reasoning
from memoryos_gpu.profile_dims import normalize_dimension_key

from .rendering import _clean, truncate_text
from .schemas import DEFAULT_MAX_FACTS, DEFAULT_MAX_KEYWORDS, FACT_ACTIONS

__all__ = [
    "MAX_FACT_CHARS",
    "MAX_KEYWORD_CHARS",
    "MAX_META_CHARS",
    "MAX_PROFILE_VALUE_CHARS",
    "MAX_SUMMARY_CHARS",
    "FusedPageResult",
    "PromotionResult",
    "TopicSummary",
    "extract_json",
    "parse_assistant_knowledge",
    "parse_chain_meta",
    "parse_continuity",
    "parse_fused_page",
    "parse_fused_promotion",
    "parse_profile_update",
    "parse_topic_summary",
    "parse_user_knowledge",
]

# Caps applied by the parsers to model output.
MAX_META_CHARS = 500
MAX_SUMMARY_CHARS = 600
MAX_KEYWORD_CHARS = 48
MAX_FACT_CHARS = 300
MAX_PROFILE_VALUE_CHARS = 240

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

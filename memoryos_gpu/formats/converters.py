"""One input item (a parsed JSON object) -> its pages, per format: jsonl, sharegpt, openai, locomo.

Each converter (``_CONVERTERS[format]``) takes one item and returns its :class:`Record` s, with a
``_Bad`` for each unusable part (a LoCoMo turn, a session with a bad date); ``_Invalid`` rejects
the whole item. :func:`_convert` wraps a converter into the :class:`Record` / :class:`Reject`
stream the readers yield. Conversation formats pair a user turn with the following assistant
turn (:func:`_pair`); a conversation that names no user gets :func:`generated_user`.

These are the field-by-field rules of ``docs/formats.md``; finding the items in an input (lines,
JSON arrays, documents) is :mod:`.readers`.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from .records import (
    MAX_SOURCE_CHARS,
    PageCounter,
    Record,
    Reject,
    fit_name,
    legacy_source,
    normalise_text,
    page_digest,
    page_source,
)
from .timestamps import parse_timestamp

__all__ = ["NO_TURNS", "generated_user"]

_SESSION_RE = re.compile(r"session_(\d+)")

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": None,
    # tool traffic is not part of the user/assistant dialogue
    "function_call": None,
    "observation": None,
    "tool": None,
}
_OPENAI_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": None,
    "developer": None,
    "tool": None,
    "function": None,
}
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


class _Invalid(Exception):
    """The whole item is unusable (reason in args[0])."""


#: The reason of a conversation that makes no page. Such an item (``"conversations": []``, a
#: ShareGPT conversation of system turns only, a LoCoMo conversation without turns) is not
#: broken, but it holds no page to store: it is rejected so that the run's count, its summary
#: and the rejects file say it was read and left out (it used to vanish, and a user could not
#: tell a skipped conversation from one never read). What follows, in parentheses, says why;
#: the reason's kind (:func:`memoryos_gpu.rejects.reason_kind`) is this text alone.
NO_TURNS = "no user or assistant turn to make a page of"


def _no_turns(field: str, skipped: list[str]) -> _Invalid:
    """The refusal of a conversation whose ``field`` (``conversations``, ``messages``) gave no
    user or assistant turn; ``skipped``: a label for each turn left out (its role)."""
    if not skipped:
        return _Invalid(f"{NO_TURNS} ({field} is empty)")
    labels = ", ".join(dict.fromkeys(skipped))
    return _Invalid(f"{NO_TURNS} ({field} holds only turns that are skipped: {labels})")


@dataclass
class _Bad:
    """Part of an item is unusable; ``raw`` is the offending part (``None``: the whole item)."""

    reason: str
    raw: Any = None


@dataclass
class _Ctx:
    basename: str
    position: int  # 1-based line (lines) or item index (documents)
    seen: PageCounter  # the input's pages so far: one counter per input (page_source)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{what} must be a string, got {type(value).__name__}")
    return normalise_text(value)


def _opt_str(obj: dict, key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    return _text(value, key)


def _timestamp(value: object, what: str = "timestamp") -> str | float | None:
    """Validate a timestamp; keep strings as written (normalised), numbers as float."""
    if value is None:
        return None
    try:
        parse_timestamp(value)
    except ValueError as exc:
        raise _Invalid(f"{what}: {exc}") from None
    return normalise_text(value) if isinstance(value, str) else float(value)  # type: ignore[arg-type]


def _record(
    ctx: _Ctx,
    sub: int,
    user_id: str,
    assistant_id: str | None,
    user_input: str,
    agent_response: str,
    timestamp: str | float | None,
    meta: dict,
    generated: bool = False,
) -> Record:
    """The page, keyed by its content and its occurrence among identical pages of the input
    (:func:`page_source`); ``generated``: ``user_id`` was derived, the input named none."""
    content = (user_id, assistant_id, user_input, agent_response, timestamp)
    digest = page_digest(*content)
    old_user = _legacy_user(ctx) if generated else user_id
    return Record(
        user_id=user_id,
        user_input=user_input,
        agent_response=agent_response,
        assistant_id=assistant_id,
        timestamp=timestamp,
        source=page_source(digest, ctx.seen.occurrence(digest)),
        meta=meta,
        line=ctx.position,
        legacy_source=legacy_source(ctx.basename, ctx.position, sub, old_user, *content[1:]),
        generated_user=generated,
    )


def _pair(turns: list[tuple[str, Any]]) -> list[tuple[Any, Any]]:
    """Pair ``(role, turn)`` items: a user turn with the following assistant turn.

    A user turn not followed by an assistant turn pairs with ``None``; an assistant turn not
    preceded by an unpaired user turn pairs with ``None`` on the user side. Nothing is dropped.
    """
    out: list[tuple[Any, Any]] = []
    pending: Any = None
    for role, turn in turns:
        if role == "user":
            if pending is not None:
                out.append((pending, None))
            pending = turn
        else:
            out.append((pending, turn))
            pending = None
    if pending is not None:
        out.append((pending, None))
    return out


def _convert_page(obj: dict, ctx: _Ctx) -> list[Record | _Bad]:
    for key in ("user_id", "user_input", "agent_response"):
        if key not in obj:
            raise _Invalid(f"missing field {key!r}")
    user_id = _text(obj["user_id"], "user_id")
    if not user_id:
        raise _Invalid(_BLANK_ID.format("user_id"))
    meta = obj.get("meta")
    if meta is not None and not isinstance(meta, dict):  # was dropped without a word
        raise _Invalid(f"meta must be an object, got {_json_type(meta)}")
    source = None if obj.get("source") is None else _source_key(obj["source"])
    record = _record(
        ctx,
        0,
        user_id,
        _opt_str(obj, "assistant_id"),
        _text(obj["user_input"], "user_input"),
        _text(obj["agent_response"], "agent_response"),
        _timestamp(obj.get("timestamp")),
        dict(meta) if isinstance(meta, dict) else {},
    )
    if source is None:
        return [record]
    # the record's own key replaces the derived one, which becomes its legacy key: versions
    # that ignored ``source`` stored the page under it, and a re-run must not store it again
    return [replace(record, source=source, legacy_source=record.source)]


def _source_key(value: object) -> str:
    """An explicit ``source`` (a page's own idempotency key) as the engine checks a key
    (``validation._clean_id``: a non-blank string of at most :data:`MAX_SOURCE_CHARS`
    characters, no control character or lone surrogate), never rewritten: a key changed on the
    way would no longer match the page it names; :class:`_Invalid` saying why not."""
    if not isinstance(value, str):
        raise _Invalid(f"source must be a string, got {type(value).__name__}")
    if not value:
        raise _Invalid("source is empty: give a non-empty key or leave it out")
    if value.isspace():
        raise _Invalid("source is blank (only whitespace): give a visible key")
    if len(value) > MAX_SOURCE_CHARS:
        raise _Invalid(f"source is {len(value)} characters; the limit is {MAX_SOURCE_CHARS}")
    if not (value.isascii() and value.isprintable()):
        bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cs")), None)
        if bad is not None:
            kind = "a control character" if unicodedata.category(bad) == "Cc" else "a surrogate"
            raise _Invalid(
                f"source must be printable characters: it contains U+{ord(bad):04X}, {kind}"
            )
    return value


def _legacy_user(ctx: _Ctx) -> str:
    """``"{basename}:{position}"``: the user earlier versions gave a conversation that names
    none; needed only to rebuild the :func:`legacy_source` of its pages."""
    tail = f":{ctx.position}"
    return fit_name(ctx.basename, MAX_SOURCE_CHARS - len(tail)) + tail


def generated_user(content: object) -> str:
    """``"conv-{16 hex}"``: the user of a conversation that names none, from its content.

    A hash of the conversation itself (not of the file, its name or the line) so the same
    conversation gets the same user wherever and however it is read (renamed, moved, gzipped,
    piped), and two different conversations never share one (64 bits: a collision is unlikely
    below billions of conversations). ``conv-`` marks it as generated.
    """
    payload = json.dumps(content, ensure_ascii=False, sort_keys=True, default=str)
    digest = hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()
    return f"conv-{digest[:16]}"


#: The reason of a user id that is empty once normalised: in the words of the engine's refusal
#: of a blank one (``user_id is blank (only whitespace): ...``), so both count as one kind.
_BLANK_ID = "{} is blank (empty): give a visible id"


def _conversation_user(obj: dict, turns: list[tuple[str, int, str, object]]) -> tuple[str, bool]:
    """``(user_id, generated)``: ``user_id``, else ``id``, else :func:`generated_user` of the
    dialogue (roles, texts, timestamps, assistant). ``id`` names the user as ``user_id``
    does, by the same rule: a string (``"id": 5`` is refused as ``"user_id": 5`` is)."""
    field = "user_id" if obj.get("user_id") is not None else "id"
    if obj.get(field) is None:
        dialogue = [[t[0], t[2], t[3]] for t in turns]
        return generated_user([obj.get("assistant_id"), obj.get("timestamp"), dialogue]), True
    user_id = _text(obj[field], field)
    if not user_id:
        raise _Invalid(_BLANK_ID.format(field))
    return user_id, False


def _convert_turns(
    obj: dict,
    ctx: _Ctx,
    turns: list[tuple[str, int, str, object]],
) -> list[Record | _Bad]:
    """Shared tail of sharegpt/openai: ``turns`` = (role, index, text, turn timestamp)."""
    user_id, generated = _conversation_user(obj, turns)
    assistant_id = _opt_str(obj, "assistant_id")
    conv_id = obj.get("id")
    out: list[Record | _Bad] = []
    for sub, (u, a) in enumerate(_pair([(t[0], t) for t in turns])):
        indices = [t[1] for t in (u, a) if t is not None]
        try:
            ts = _page_timestamp(obj, u, a)
        except _Invalid as exc:  # this page only, as a LoCoMo session's bad date
            out.append(_Bad(exc.args[0], {"turns": indices, "id": conv_id}))
            continue
        meta: dict[str, Any] = {"turns": indices}
        if isinstance(conv_id, (str, int)) and not isinstance(conv_id, bool):
            meta["conversation_id"] = conv_id
        out.append(
            _record(
                ctx,
                sub,
                user_id,
                assistant_id,
                u[2] if u is not None else "",
                a[2] if a is not None else "",
                ts,
                meta,
                generated,
            )
        )
    return out


def _page_timestamp(obj: dict, u: Any, a: Any) -> str | float | None:
    """The timestamp of the page of turns ``u`` and ``a`` (either may be ``None``): the first
    one's own, else the conversation's; :class:`_Invalid` when that one does not parse.

    Why per page: a bad timestamp rejects only the pages that would carry it, so one bad
    field does not lose a long conversation (as a LoCoMo session's bad date rejects only that
    session's pages)."""
    for t in (u, a):
        if t is not None and t[3] is not None:
            return _timestamp(t[3], f"turn {t[1]} timestamp")
    return _timestamp(obj.get("timestamp"), "conversation timestamp")


def _convert_sharegpt(obj: dict, ctx: _Ctx) -> list[Record | _Bad]:
    conv = obj.get("conversations")
    if not isinstance(conv, list):
        raise _Invalid("missing or non-list field 'conversations'")
    turns = []
    skipped: list[str] = []
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict):
            raise _Invalid(f"conversations[{i}] is not an object")
        who = turn.get("from", turn.get("role"))
        if not isinstance(who, str):
            raise _Invalid(f"conversations[{i}] has no string 'from'")
        if who.lower() not in _SHAREGPT_ROLES:
            raise _Invalid(f"conversations[{i}] has unknown role {who!r}")
        role = _SHAREGPT_ROLES[who.lower()]
        if role is None:
            skipped.append(who.lower())
            continue
        if "value" not in turn:
            raise _Invalid(f"conversations[{i}] has no 'value'")
        text = _text(turn["value"], f"conversations[{i}].value")
        turns.append((role, i, text, turn.get("timestamp")))
    if not turns:
        raise _no_turns("conversations", skipped)
    return _convert_turns(obj, ctx, turns)


def _openai_content(content: object, i: int) -> str | None:
    if content is None:
        return None
    if isinstance(content, str):
        return normalise_text(content)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                if part.get("type") in _TEXT_PART_TYPES:
                    parts.append(_text(part.get("text"), f"messages[{i}].content[{j}].text"))
                # non-text parts (images, audio, files) carry no text: ignored
            else:
                raise _Invalid(f"messages[{i}].content[{j}] is not a text part")
        return normalise_text("\n".join(parts))
    raise _Invalid(f"messages[{i}].content must be a string or a list of parts")


def _convert_openai(obj: dict, ctx: _Ctx) -> list[Record | _Bad]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list):
        raise _Invalid("missing or non-list field 'messages'")
    turns = []
    skipped: list[str] = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise _Invalid(f"messages[{i}] is not an object")
        who = msg.get("role")
        if not isinstance(who, str):
            raise _Invalid(f"messages[{i}] has no string 'role'")
        if who not in _OPENAI_ROLES:
            raise _Invalid(f"messages[{i}] has unknown role {who!r}")
        role = _OPENAI_ROLES[who]
        if role is None:
            skipped.append(who)
            continue
        text = _openai_content(msg.get("content"), i)
        if text is None:  # e.g. an assistant message holding only tool calls
            skipped.append(f"{who} without content")
            continue
        turns.append((role, i, text, msg.get("timestamp")))
    if not turns:
        raise _no_turns("messages", skipped)
    return _convert_turns(obj, ctx, turns)


def _locomo_turn_text(turn: dict) -> str:
    text = turn.get("text", "")
    if not isinstance(text, str):
        raise _Invalid(f"text must be a string, got {type(text).__name__}")
    caption = turn.get("blip_caption")
    if isinstance(caption, str) and caption.strip():
        text = f"{text} [image: {caption.strip()}]" if text else f"[image: {caption.strip()}]"
    return normalise_text(text)


def _convert_locomo(obj: dict, ctx: _Ctx) -> list[Record | _Bad]:
    conv = obj.get("conversation")
    if not isinstance(conv, dict):
        raise _Invalid("missing or non-object field 'conversation'")
    speaker_a = conv.get("speaker_a")
    if not isinstance(speaker_a, str):
        raise _Invalid("conversation.speaker_a must be a string")
    speaker_b = conv.get("speaker_b")
    speaker_b = speaker_b if isinstance(speaker_b, str) else None
    sample_id = obj.get("sample_id")
    generated = not isinstance(sample_id, (str, int)) or isinstance(sample_id, bool)
    user_id = generated_user(conv) if generated else normalise_text(str(sample_id))
    assistant_id = f"{user_id}:{normalise_text(speaker_b)}" if speaker_b else None
    sessions = sorted(
        (int(m.group(1)), key)
        for key in conv
        if (m := _SESSION_RE.fullmatch(key)) and isinstance(conv[key], list)
    )
    out: list[Record | _Bad] = []
    sub = 0
    for number, key in sessions:
        date = conv.get(f"{key}_date_time")
        date_error = None
        try:
            ts = _timestamp(date, f"{key}_date_time")
        except _Invalid as exc:
            ts, date_error = None, exc.args[0]
        turns: list[tuple[str, tuple[str, str | None, str]]] = []  # (text, dia_id, where)
        for j, turn in enumerate(conv[key]):
            try:
                if not isinstance(turn, dict):
                    raise _Invalid("turn is not an object")
                speaker = turn.get("speaker")
                if not isinstance(speaker, str):
                    raise _Invalid("turn has no string 'speaker'")
                dia_id = turn.get("dia_id")
                dia_id = normalise_text(dia_id) if isinstance(dia_id, str) else None
                text = _locomo_turn_text(turn)
            except _Invalid as exc:
                out.append(_Bad(f"{key}[{j}]: {exc.args[0]}", turn))
                continue
            role = "user" if speaker == speaker_a else "assistant"
            turns.append((role, (text, dia_id, dia_id or f"{key}[{j}]")))
        for u, a in _pair(turns):
            dia_ids = [t[1] for t in (u, a) if t is not None and t[1] is not None]
            if date_error is not None:
                # which page: every page of the session has this reason, and its rejects
                # were N identical lines
                where = [t[2] for t in (u, a) if t is not None]
                turn = "turns" if len(where) > 1 else "turn"
                reason = f"{turn} {', '.join(where)}: {date_error}"
                out.append(_Bad(reason, {"session": number, "dia_ids": dia_ids}))
                continue
            meta = {
                "dia_ids": dia_ids,
                "session": number,
                "speaker_a": speaker_a,
                "speaker_b": speaker_b,
            }
            out.append(
                _record(
                    ctx,
                    sub,
                    user_id,
                    assistant_id,
                    u[0] if u is not None else "",
                    a[0] if a is not None else "",
                    ts,
                    meta,
                    generated,
                )
            )
            sub += 1
    if not out:  # no turn at all (a bad turn or date is a reject already)
        why = (
            "its session_N turn lists are all empty"
            if sessions
            else "conversation has no session_N turn list"
        )
        raise _Invalid(f"{NO_TURNS} ({why})")
    return out


_CONVERTERS: dict[str, Callable[[dict, _Ctx], list[Record | _Bad]]] = {
    "jsonl": _convert_page,
    "locomo": _convert_locomo,
    "sharegpt": _convert_sharegpt,
    "openai": _convert_openai,
}


# --------------------------------------------------------------------------------------------
# a converter's output as the records and rejects the readers yield


def _dump(obj: object) -> str:
    """``obj`` as JSON for a reject's ``raw`` (its repr when it is not JSON); a placeholder
    when it is nested too deeply for either: a reject must never crash the read."""
    try:
        return json.dumps(obj, ensure_ascii=False, default=str)[:4000]
    except (ValueError, TypeError, RecursionError):
        pass
    try:
        return repr(obj)[:4000]
    except RecursionError:
        return "<nested too deeply to show>"


def _convert(
    convert: Callable[[dict, _Ctx], list[Record | _Bad]],
    obj: object,
    ctx: _Ctx,
    path: str,
    raw: Callable[[], str],
) -> Iterator[Record | Reject]:
    if not isinstance(obj, dict):
        yield Reject(path, ctx.position, f"expected a JSON object, got {_json_type(obj)}", raw())
        return
    try:
        items = convert(obj, ctx)
    except _Invalid as exc:
        yield Reject(path, ctx.position, exc.args[0], raw())
        return
    for item in items:
        if isinstance(item, _Bad):
            text = raw() if item.raw is None else _dump(item.raw)
            yield Reject(path, ctx.position, item.reason, text)
        else:
            yield item


def _json_type(obj: object) -> str:
    return {
        list: "array",
        str: "string",
        int: "number",
        float: "number",
        bool: "boolean",
        type(None): "null",
    }.get(type(obj), type(obj).__name__)

"""The one rule by which an in-process backend shortens a prompt that is over its token budget.

The engine's prompts put the memory context (retrieved pages, profile, recent conversation)
at the start of the last user message and the question at its end, so what goes first is the
start of that message, down to its last ``limit // 4`` tokens: the system prompt (the task
and output format) and the question stay. If that is not enough, the oldest non-system
messages are dropped, then the last user message is cut further; if even that is not enough,
the request fails on its own (``ValueError``), never the batch.

The backends hand in their tokenizer as three functions, so the rule is tested without a
model: ``encode(messages)`` renders the chat template and tokenizes it; ``tokens(text)`` and
``text(ids)`` tokenize and detokenize message content.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["fit_messages"]

Messages = list[dict[str, str]]


def fit_messages(
    messages: Messages,
    limit: int,
    encode: Callable[[Messages], list[int]],
    tokens: Callable[[str], list[int]],
    text: Callable[[list[int]], str],
) -> tuple[Messages, list[int]]:
    """``(messages, prompt_ids)`` within ``limit`` tokens; raises ``ValueError`` when the
    prompt cannot be brought under it."""
    msgs = [dict(m) for m in messages]
    ids = encode(msgs)
    if len(ids) <= limit:
        return msgs, ids
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
    if last_user is not None:
        ids = _cut_start(msgs, last_user, ids, limit, limit // 4, encode, tokens, text)
    while len(ids) > limit:
        drop = next(
            (i for i, m in enumerate(msgs) if m["role"] != "system" and i != last_user), None
        )
        if drop is None:
            break
        del msgs[drop]
        if last_user is not None and drop < last_user:
            last_user -= 1
        ids = encode(msgs)
    if len(ids) > limit and last_user is not None:
        ids = _cut_start(msgs, last_user, ids, limit, 0, encode, tokens, text)
    if len(ids) > limit:
        raise ValueError(f"prompt needs {len(ids)} tokens even after truncation; limit {limit}")
    return msgs, ids


def _cut_start(
    msgs: Messages,
    at: int,
    ids: list[int],
    limit: int,
    keep: int,
    encode: Callable[[Messages], list[int]],
    tokens: Callable[[str], list[int]],
    text: Callable[[list[int]], str],
) -> list[int]:
    """Drop the start of ``msgs[at]``'s content (keeping at least its last ``keep`` tokens)
    until the prompt fits; returns the new prompt ids."""
    content_ids = tokens(msgs[at]["content"])
    for _ in range(4):  # re-rendering can shift token boundaries; converge in few steps
        over = len(ids) - limit
        if over <= 0 or len(content_ids) <= keep:
            break
        content_ids = content_ids[min(over + 1, len(content_ids) - keep) :]
        msgs[at]["content"] = text(content_ids)
        ids = encode(msgs)
    return ids

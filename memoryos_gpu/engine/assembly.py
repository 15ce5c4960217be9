"""Turning a retrieval batch's arrays into the :class:`~memoryos_gpu.types.Retrieval` objects.

The kernels leave ``[B, k]`` arrays of page ids, knowledge entry ids and scores; this module
makes one Python object per *returned* page or entry (never per candidate), with the texts from
the in-memory views (:mod:`memoryos_gpu.page_views`), and counts the prompt tokens from the
texts' lengths instead of building the prompt text. A page a view does not hold (never
expected: every writer keeps the views current) is read from the store and counted in
``stats()["views"]["store_reads"]``, so a test can assert there were none.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from memoryos_gpu.page_views import approx_tokens, page_view
from memoryos_gpu.types import KnowledgeEntry, Retrieval, RetrievedPage

from .state import EngineState, UserState

Hits = tuple[np.ndarray, np.ndarray]  # (scores [B, k], ids [B, k], -1 padded)


def assemble(
    s: EngineState,
    cleaned: Sequence[tuple[str, str]],
    users: Sequence[UserState],
    pages: Hits,
    user_knowledge: Hits,
    assistant_knowledge: Hits,
) -> list[Retrieval]:
    """One :class:`Retrieval` per query: MTM pages best first, the whole STM, the profile, the
    user's and the assistant's knowledge."""
    try:
        return _assemble(s, cleaned, users, pages, user_knowledge, assistant_knowledge)
    except KeyError:  # a view is missing (a bug elsewhere): read the batch's from the store
        _read_missing(s, pages[1], users, user_knowledge[1], assistant_knowledge[1])
        return _assemble(s, cleaned, users, pages, user_knowledge, assistant_knowledge)


def _assemble(
    s: EngineState,
    cleaned: Sequence[tuple[str, str]],
    users: Sequence[UserState],
    pages: Hits,
    user_knowledge: Hits,
    assistant_knowledge: Hits,
) -> list[Retrieval]:
    views = s.views.pages
    texts = s.views.knowledge
    profiles = s.profiles
    p_scores, p_ids = pages[0].tolist(), pages[1].tolist()
    uk_scores, uk_ids = user_knowledge[0].tolist(), user_knowledge[1].tolist()
    ak_scores, ak_ids = assistant_knowledge[0].tolist(), assistant_knowledge[1].tolist()
    out = []
    total = 0
    paused = gc.isenabled()  # ~30 objects a query, none cyclic: no collection can free any
    if paused:
        gc.disable()
    try:
        for i, ((uid, query), user) in enumerate(zip(cleaned, users, strict=True)):
            mtm = _pages(views, p_ids[i], p_scores[i], "mtm")
            stm = _pages(views, user.stm, None, "stm")
            uk = [
                KnowledgeEntry(e, texts[e], sc)
                for e, sc in zip(uk_ids[i], uk_scores[i], strict=True)
                if e >= 0
            ]
            ak = [
                KnowledgeEntry(e, texts[e], sc)
                for e, sc in zip(ak_ids[i], ak_scores[i], strict=True)
                if e >= 0
            ]
            profile = profiles.get(uid)
            profile = dict(profile) if profile else {}
            # prompt tokens from the objects just made (in cache), ~4 characters per token
            tokens = sum([_page_tokens(p) for p in mtm]) + sum([_page_tokens(p) for p in stm])
            if uk or ak or profile:
                tokens += sum([(len(e.text) + 3) // 4 for e in uk])
                tokens += sum([(len(e.text) + 3) // 4 for e in ak])
                tokens += sum([approx_tokens(k, v) for k, v in profile.items()])
            total += tokens
            out.append(Retrieval(uid, query, stm, mtm, profile, uk, ak, tokens))
    finally:
        if paused:
            gc.enable()
    s.counters["retrieval_tokens"] += total
    return out


def _pages(
    views: dict[int, Any], page_ids: Iterable[int], scores: list[float] | None, tier: str
) -> list[RetrievedPage]:
    """The returned pages of one query (ids < 0 are padding and end the list).

    Made with ``object.__new__`` and one store per field instead of the dataclass's
    ``__init__``: the same object (RetrievedPage has no ``__post_init__``), at half the cost,
    which is most of what a retrieval costs the host (0.3 instead of 0.6 us a page, measured).
    ``extra`` is the view's read-only dict, shared."""
    new = object.__new__
    out = []
    append = out.append
    for j, pid in enumerate(page_ids):
        if pid < 0:
            break
        user_input, agent_response, timestamp, meta, extra = views[pid]
        p = new(RetrievedPage)
        p.page_id = pid
        p.user_input = user_input
        p.agent_response = agent_response
        p.timestamp = timestamp
        p.tier = tier
        p.score = None if scores is None else scores[j]
        p.meta = meta
        p.extra = extra
        append(p)
    return out


def _page_tokens(p: RetrievedPage) -> int:
    return (len(p.user_input) + len(p.agent_response) + len(p.meta or "") + 3) // 4


def _read_missing(
    s: EngineState,
    page_ids: np.ndarray,
    users: Sequence[UserState],
    *entry_ids: np.ndarray,
) -> None:
    """Fill the views with the batch's pages and entries they lack, from the store."""
    views, texts = s.views.pages, s.views.knowledge
    need = [p for p in page_ids.ravel().tolist() if p >= 0 and p not in views]
    need += [p for u in users for p in u.stm if p not in views]
    for pid, v in s.store.page_views(need).items():
        views[pid] = page_view(v.user_input, v.agent_response, v.timestamp, v.meta, v.extra)
    entries = [e for ids in entry_ids for e in ids.ravel().tolist() if e >= 0 and e not in texts]
    texts.update(s.store.knowledge_texts(entries))
    s.views.store_reads += len(need) + len(entries)

"""Turning a retrieval batch's arrays into the :class:`~memoryos_gpu.types.Retrieval` objects.

The kernels leave ``[B, k]`` arrays of page ids, knowledge entry ids and scores; this module
makes one Python object per *returned* page or entry (never per candidate), with the texts from
the in-memory views (:mod:`memoryos_gpu.page_views`), and counts the prompt tokens from the
views' per-page counts instead of building the prompt text. A page a view does not hold (never
expected: every writer keeps the views current) is read from the store and counted in
``stats()["views"]["store_reads"]``, so a test can assert there were none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memoryos_gpu.page_views import PageView, approx_tokens, page_view
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
    for i, ((uid, query), user) in enumerate(zip(cleaned, users, strict=True)):
        mtm = [
            _page(pid, views[pid], "mtm", sc)
            for pid, sc in zip(p_ids[i], p_scores[i], strict=True)
            if pid >= 0
        ]
        stm = [_page(pid, views[pid], "stm", None) for pid in user.stm]
        uk = [_entry(e, texts, sc) for e, sc in zip(uk_ids[i], uk_scores[i], strict=True) if e >= 0]
        ak = [_entry(e, texts, sc) for e, sc in zip(ak_ids[i], ak_scores[i], strict=True) if e >= 0]
        profile = dict(profiles.get(uid, ()))
        tokens = (
            sum(views[p.page_id].tokens for p in mtm)
            + sum(views[p.page_id].tokens for p in stm)
            + sum(approx_tokens(e.text) for e in uk)
            + sum(approx_tokens(e.text) for e in ak)
            + sum(approx_tokens(k, v) for k, v in profile.items())
        )
        total += tokens
        out.append(Retrieval(uid, query, stm, mtm, profile, uk, ak, tokens))
    s.counters["retrieval_tokens"] += total
    return out


def _entry(entry_id: int, texts: dict[int, str], score: float) -> KnowledgeEntry:
    return KnowledgeEntry(entry_id, texts[entry_id], score)


def _page(page_id: int, v: PageView, tier: str, score: float | None) -> RetrievedPage:
    # ``extra`` is copied: the view's dict is shared by every retrieval of the page
    return RetrievedPage(
        page_id,
        v.user_input,
        v.agent_response,
        v.timestamp,
        tier,
        score,
        v.meta,
        dict(v.extra) if v.extra else {},
    )


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

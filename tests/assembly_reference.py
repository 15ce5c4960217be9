"""The result assembly of a retrieval batch in plain Python: the rule the native builder
(``memoryos_gpu._C.Assembler``, used by :mod:`memoryos_gpu.engine.assembly`) must follow, kept
for the tests that compare the two."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from memoryos_gpu.page_views import approx_tokens
from memoryos_gpu.types import KnowledgeEntry, Retrieval, RetrievedPage


def assemble_reference(
    cleaned, users, views, texts, pages, user_knowledge, assistant_knowledge, profiles
) -> tuple[list[Retrieval], int]:
    """(one Retrieval per query, the batch's prompt tokens); ``pages`` etc. are
    ``(scores [B, k], ids [B, k])`` with -1 padding."""
    p_scores, p_ids = pages[0].tolist(), pages[1].tolist()
    uk_scores, uk_ids = user_knowledge[0].tolist(), user_knowledge[1].tolist()
    ak_scores, ak_ids = assistant_knowledge[0].tolist(), assistant_knowledge[1].tolist()
    out, total = [], 0
    for i, ((uid, query), user) in enumerate(zip(cleaned, users, strict=True)):
        mtm, t_mtm = _pages(views, p_ids[i], p_scores[i], "mtm")
        # the short-term section: pages out of STM still pending, then the STM
        stm, t_stm = _pages(views, [*user.pending, *user.stm], None, "stm")
        uk, t_uk = _entries(texts, uk_ids[i], uk_scores[i])
        ak, t_ak = _entries(texts, ak_ids[i], ak_scores[i])
        profile = dict(profiles.get(uid) or {})
        tokens = t_mtm + t_stm + t_uk + t_ak
        tokens += sum(approx_tokens(k, v) for k, v in profile.items())
        total += tokens
        out.append(Retrieval(uid, query, stm, mtm, profile, uk, ak, tokens))
    return out, total


def _pages(
    views: dict[int, Any], page_ids: Iterable[int], scores: list[float] | None, tier: str
) -> tuple[list[RetrievedPage], int]:
    out, tokens = [], 0
    for j, pid in enumerate(page_ids):
        if pid < 0:
            break  # padding ends the row
        ui, ar, ts, meta, extra, n = views[pid]
        out.append(
            RetrievedPage(pid, ui, ar, ts, tier, None if scores is None else scores[j], meta, extra)
        )
        tokens += n
    return out, tokens


def _entries(
    texts: dict[int, str], ids: Sequence[int], scores: Sequence[float]
) -> tuple[list[KnowledgeEntry], int]:
    out, tokens = [], 0
    for eid, score in zip(ids, scores, strict=True):
        if eid < 0:
            continue
        out.append(KnowledgeEntry(eid, texts[eid], score, None))
        tokens += approx_tokens(texts[eid])
    return out, tokens

"""The batched retrieval pipeline: many users' queries, one pass of each kernel.

``retrieve_many`` embeds every query in one batch, then runs one call of each kernel over the
whole batch: segment scoring (cos + keyword Jaccard, each query confined to its own user's
slots), page selection inside the chosen segments, user knowledge and assistant knowledge
top-k. The dense page ranking is fused with the user's BM25 index when ``lexical_weight > 0``;
the chosen segments feed heat back; Python objects are made only for what is returned.

Boundary: this module reads the shared state (:class:`~memoryos_gpu.engine.state.EngineState`:
slot maps, users, arena, embedder, keyword statistics, lexical index, row caches, store
profiles) and writes nothing but the counters; its one effect on the tiers goes through the
:class:`HeatFeedback` it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from memoryos_gpu import ops
from memoryos_gpu.lexical import reciprocal_rank_fusion, zscore_fusion
from memoryos_gpu.store.sqlite import PageView
from memoryos_gpu.types import KnowledgeEntry, Retrieval, RetrievedPage

from .state import EngineState, UserState, keyword_rows, to_host
from .validation import InvalidInputError, clean_queries

Ranked = list[tuple[int, float]]  # (page id, score), best first


class HeatFeedback(Protocol):
    """What a retrieval tells the tiers: the segments it chose (see ``engine.heat``)."""

    def feed_hits(
        self, users: Sequence[UserState], chosen: np.ndarray, at: float | None
    ) -> None: ...


class RetrievalPipeline:
    """Retrieval over the shared state; heat feedback through ``heat``."""

    def __init__(self, state: EngineState, heat: HeatFeedback) -> None:
        self._s = state
        self._heat = heat

    def retrieve_many(
        self,
        queries: Sequence[tuple[str, str]],
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
        at: float | None = None,
        update_heat: bool = True,
    ) -> list[Retrieval]:
        """Many users' queries in one batched pass: one embedding batch, one call per kernel."""
        s = self._s
        m = s.memory
        k_pages = m.top_pages if top_pages is None else top_pages
        k_segs = m.top_segments if top_segments is None else top_segments
        if k_pages < 1 or k_segs < 1:
            raise InvalidInputError("top_pages and top_segments must be >= 1")
        cleaned = clean_queries(queries)
        if not cleaned:
            return []
        with s.lock:
            users = [s.user(u) for u, _ in cleaned]
            texts = [q for _, q in cleaned]
            q_emb = s.embedder.encode(texts)
            q_kw = keyword_rows(
                [s.extractor.extract(t, m.page_keywords) for t in texts], m.keyword_width
            )
            uslots = np.array([u.slot for u in users], np.int32)
            _, chosen = ops.score_segments(
                s.arena, q_emb, uslots, q_kw, k_segs, m.query_keyword_weight
            )
            k_dense = max(k_pages, m.fusion_candidates) if s.lexical else k_pages
            p_scores, p_slots = ops.select_pages(
                s.arena, q_emb, uslots, to_host(chosen), k_dense, m.page_min_score
            )
            ranked = self._rank_pages(cleaned, to_host(p_scores), to_host(p_slots), k_pages)
            k_kn = m.knowledge_top_k
            u_scores, u_ring = ops.knowledge_topk(s.arena, q_emb, [u.owner for u in users], k_kn)
            a_owner = [s.assistant_owner[u.assistant_id] for u in users]
            a_scores, a_ring = ops.knowledge_topk(s.arena, q_emb, a_owner, k_kn)
            chosen = to_host(chosen)
            if update_heat:
                self._heat.feed_hits(users, chosen, at)
            s.counters["retrievals"] += len(users)
            return self._assemble(
                cleaned,
                users,
                ranked,
                (to_host(u_scores), to_host(u_ring)),
                a_owner,
                (to_host(a_scores), to_host(a_ring)),
            )

    def _rank_pages(
        self, cleaned: Sequence[tuple[str, str]], scores: np.ndarray, slots: np.ndarray, k: int
    ) -> list[Ranked]:
        """Per query: (page id, score) best first. The kernels' dense ranking (cosines), or,
        when ``lexical_weight > 0``, its candidates fused with the user's BM25 keyword index:
        by default a weighted sum of each list's standardised scores (``fusion="zscore"``, the
        score returned is that sum), or weighted reciprocal rank (``fusion="rrf"``)."""
        s = self._s
        m = s.memory
        out = []
        for (uid, query), s_row, p_row in zip(cleaned, scores, slots, strict=True):
            dense = [
                (int(s.page_of_slot[p]), float(sc))
                for p, sc in zip(p_row, s_row, strict=True)
                if p >= 0
            ]
            if s.lexical is None:
                out.append(dense[:k])
                continue
            lexical = s.lexical.search(uid, query, m.fusion_candidates)
            if m.fusion == "rrf":
                fused = reciprocal_rank_fusion(
                    [([p for p, _ in dense], 1.0), ([p for p, _ in lexical], m.lexical_weight)]
                )
            else:
                fused = zscore_fusion([(dense, 1.0), (lexical, m.lexical_weight)])
            out.append(fused[:k])
        return out

    def _assemble(
        self,
        cleaned: Sequence[tuple[str, str]],
        users: Sequence[UserState],
        ranked: Sequence[Ranked],
        user_hits: tuple[np.ndarray, np.ndarray],
        a_owner: Sequence[int],
        assistant_hits: tuple[np.ndarray, np.ndarray],
    ) -> list[Retrieval]:
        """The :class:`Retrieval` objects: page and knowledge texts from the row caches (one
        store round trip for whatever they miss), profiles in one query. ``*_hits``: the
        knowledge kernel's ``(scores, ring positions)``, ``[queries, k]``, -1 padded."""
        s = self._s
        u_scores, u_ring = user_hits
        a_scores, a_ring = assistant_hits
        stm_ids = [list(u.stm) for u in users]
        need = {p for r in ranked for p, _ in r} | {p for ids in stm_ids for p in ids}
        views = s.page_views.get_many(need)
        entry_ids = {
            int(s.entry_of_ring[u.owner, r])
            for u, rr in zip(users, u_ring, strict=True)
            for r in rr
            if r >= 0
        }
        entry_ids |= {
            int(s.entry_of_ring[o, r])
            for o, rr in zip(a_owner, a_ring, strict=True)
            for r in rr
            if r >= 0
        }
        texts = s.knowledge_texts.get_many(entry_ids)
        profiles = s.store.profiles({uid for uid, _ in cleaned})

        def entries(owner: int, ring: np.ndarray, scores: np.ndarray) -> list[KnowledgeEntry]:
            ids = [
                (int(s.entry_of_ring[owner, r]), sc)
                for r, sc in zip(ring, scores, strict=True)
                if r >= 0
            ]
            return [KnowledgeEntry(e, texts[e], float(sc)) for e, sc in ids]

        out = []
        for i, ((uid, q), u) in enumerate(zip(cleaned, users, strict=True)):
            pages = [_retrieved(p, views[p], "mtm", sc) for p, sc in ranked[i]]
            stm = [_retrieved(p, views[p], "stm", None) for p in stm_ids[i]]
            uk = entries(u.owner, u_ring[i], u_scores[i])
            ak = entries(a_owner[i], a_ring[i], a_scores[i])
            ret = Retrieval(uid, q, stm, pages, profiles.get(uid, {}), uk, ak)
            ret.retrieval_tokens = _approx_tokens(_context_text(ret))
            s.counters["retrieval_tokens"] += ret.retrieval_tokens
            out.append(ret)
        return out


def _retrieved(page_id: int, v: PageView, tier: str, score: float | None) -> RetrievedPage:
    # a copy of ``extra``: the cached view is shared by every retrieval of the page
    return RetrievedPage(
        page_id, v.user_input, v.agent_response, v.timestamp, tier, score, v.meta, dict(v.extra)
    )


def _approx_tokens(text: str) -> int:
    """Tokens a prompt would carry: ~4 characters per token (no tokenizer dependency)."""
    return (len(text) + 3) // 4


def _context_text(r: Retrieval) -> str:
    parts = [f"{p.user_input} {p.agent_response} {p.meta or ''}" for p in r.all_pages()]
    parts += [e.text for e in (*r.user_knowledge, *r.assistant_knowledge)]
    parts += [f"{k}: {v}" for k, v in r.profile.items()]
    return "\n".join(parts)

"""The batched retrieval pipeline: many users' queries, a fixed number of native calls per batch.

Per batch, whatever its size: the queries are validated, embedded in one embedder call and
split into hashed terms in one native call, all outside the engine lock; then, under it, one
fused retrieval pass (``ops.retrieve``: segment scores, BM25 over each user's MTM pages from
the arena's lexical index, the fusion of both candidate sets, the top k), one knowledge top-k
for the users' rings and one for their assistants', and one heat credit of the served pages
(``ops.credit_served``). The results come back as ``[B, k]`` arrays; Python touches only what
is returned (one object per returned page or entry, texts from the in-memory views; with
``as_json`` none: each result's JSON is written natively from the views), and the
heat credit is two array appends that the write-behind takes to the store later
(:mod:`~memoryos_gpu.engine.heat`). Nothing here reads or writes the store.

``stats()["retrieval"]`` accumulates where the time went (total, embedding, native calls: the
term split, the fused pass, both knowledge top-k, the heat credit and the copies back), so a
benchmark can put the memory system's own cost beside its kernels'.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from memoryos_gpu import ops
from memoryos_gpu.embed.base import encode_checked
from memoryos_gpu.lexical import query_terms
from memoryos_gpu.ops import retrieval as fused
from memoryos_gpu.ops.retrieval import RetrievalParams, credit_served, to_host
from memoryos_gpu.store import derivations
from memoryos_gpu.types import Retrieval

from .assembly import assemble
from .heat import Heat
from .state import EngineState, UserState
from .validation import InvalidInputError, clean_count, clean_queries, clean_time


class RetrievalPipeline:
    """Retrieval over the shared state; served pages credit heat through ``heat``."""

    def __init__(self, state: EngineState, heat: Heat) -> None:
        self._s = state
        self._heat = heat
        self.timing = {"batches": 0, "queries": 0, "total_s": 0.0, "embed_s": 0.0, "kernel_s": 0.0}

    def retrieve_many(
        self,
        queries: Sequence[tuple[str, str]],
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
        at: float | None = None,
        update_heat: bool = True,
        sources: bool = False,
        as_json: bool = False,
    ) -> list[Retrieval] | list[bytes]:
        """Many users' queries in one batched pass (see the module docstring); ``sources``:
        each knowledge entry also says which pages it was derived from (one store query for
        the whole batch, only when asked); ``as_json``: each query's result as the bytes of
        its JSON object instead (``assembly.retrieval_json``), written natively.

        A closed engine refuses first (checked again under the lock, for a ``close`` racing
        the call): the user check before it answered UnknownUserError for a user the closed
        engine no longer knows, which a handler maps to 404 instead of 503."""
        self._s.check_open()
        if as_json and sources:
            raise InvalidInputError("as_json does not carry sources: ask for the objects")
        t_start = time.perf_counter()
        s = self._s
        m = s.memory
        k_pages = m.top_pages if top_pages is None else clean_count(top_pages, "top_pages")
        k_segs = (
            m.top_segments if top_segments is None else clean_count(top_segments, "top_segments")
        )
        at = clean_time(at, "at")
        cleaned = clean_queries(queries)
        if not cleaned:
            return []
        s.users_of([u for u, _ in cleaned])  # an unknown user fails before the embedding runs
        texts = [q for _, q in cleaned]
        t0 = time.perf_counter()
        q_emb = encode_checked(s.embedder, texts)
        t1 = time.perf_counter()
        terms = query_terms(texts)
        t_terms = time.perf_counter() - t1  # the term split is native work of the batch too
        t_embed = t1 - t0
        params = RetrievalParams(
            top_segments=k_segs,
            keyword_weight=m.query_keyword_weight,
            jaccard_terms=m.page_keywords,
            dense_floor=m.relevance_floor,
            lexical_weight=m.lexical_weight,
            lexical_candidates=m.lexical_candidates,
        )
        with s.lock:
            s.check_open()  # a closed engine's memory is no longer backed by its store
            users = s.users_of([u for u, _ in cleaned])
            n = len(users)
            ao = s.assistant_owner
            ids = np.array([(u.slot, u.owner, ao[u.assistant_id]) for u in users], np.int32)
            slots, owners, a_owners = ids[:, 0].copy(), ids[:, 1].copy(), ids[:, 2].copy()
            t1 = time.perf_counter()
            a = s.arena
            # looked up on the module at call time, as ``ops.<kernel>`` is: the server's
            # metrics time the fused pass by wrapping it there (memoryos_kernel_seconds)
            scores, pages, segments = fused.retrieve(a, q_emb, slots, terms, k_pages, params)
            u_scores, u_ring = ops.knowledge_topk(a, q_emb, owners, m.knowledge_top_k)
            a_scores, a_ring = ops.knowledge_topk(a, q_emb, a_owners, m.knowledge_top_k)
            heat = (
                credit_served(a, slots, segments, self._now(users, at), m.heat_params())
                if update_heat
                else ()
            )
            host = to_host(a, scores, pages, segments, u_scores, u_ring, a_scores, a_ring, *heat)
            t_kernel = time.perf_counter() - t1
            scores, pages, segments, u_scores, u_ring, a_scores, a_ring = host[:7]
            if update_heat:
                self._heat.credit(slots, segments, host[7], host[8])
            page_ids = np.where(pages >= 0, s.page_of_slot[np.maximum(pages, 0)], -1)
            out = assemble(
                s,
                cleaned,
                users,
                (scores, page_ids),
                (u_scores, _entries(s.entry_of_ring, owners, u_ring)),
                (a_scores, _entries(s.entry_of_ring, a_owners, a_ring)),
                as_json,
            )
            s.counters["retrievals"] += n
        if sources:
            _add_sources(s, out)
        t = self.timing
        t["batches"] += 1
        t["queries"] += n
        t["total_s"] += time.perf_counter() - t_start
        t["embed_s"] += t_embed
        t["kernel_s"] += t_kernel + t_terms
        return out

    def _now(self, users: Sequence[UserState], at: float | None) -> np.ndarray | float:
        """Each query's "now" for heat: ``at``, the wall clock, or the user's logical clock."""
        if at is not None:
            return float(at)
        if self._s.memory.clock == "wall":
            return time.time()
        return np.fromiter((u.clock for u in users), np.float64, len(users))


def _entries(entry_of_ring: np.ndarray, owners: np.ndarray, ring: np.ndarray) -> np.ndarray:
    """Knowledge entry ids of ring positions ``[B, k]`` (-1 where the kernel found none)."""
    return np.where(ring >= 0, entry_of_ring[owners[:, None], np.maximum(ring, 0)], -1)


def _add_sources(s: EngineState, out: list[Retrieval]) -> None:
    """Fill ``sources`` of every returned knowledge entry, with one query for the batch."""
    entries = [e for r in out for e in (*r.user_knowledge, *r.assistant_knowledge)]  # returned
    found = derivations.sources(s.store, derivations.KNOWLEDGE, [e.entry_id for e in entries])
    for e in entries:
        e.sources = found.get(e.entry_id, [])

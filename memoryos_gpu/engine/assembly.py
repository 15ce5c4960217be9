"""Turning a retrieval batch's arrays into the :class:`~memoryos_gpu.types.Retrieval` objects.

The kernels leave ``[B, k]`` arrays of page ids, knowledge entry ids and scores; this module
makes one Python object per *returned* page or entry (never per candidate), with the texts
copied out of the in-memory views' native tables (:mod:`memoryos_gpu.page_views`), and counts
the prompt tokens from the texts' lengths instead of building the prompt text. Or, for a
caller that only sends them on (the server's retrieval route), each query's JSON straight from
the tables (``assemble(..., as_json=True)``, ``retrieve_many(..., as_json=True)``): no object
at all, the same JSON as :func:`retrieval_json` of the objects. The objects are built natively,
one call per batch (``csrc/bindings/assembly_bindings.cpp``: in Python each object cost
0.5-0.9 us, most of a query's host time); ``tests/assembly_reference.py`` is the same rule in
Python, which the tests hold it to. A page a view does not hold (never
expected: every writer keeps the views current) is read from the store and counted in
``stats()["views"]["store_reads"]``, so a test can assert there were none.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Sequence
from typing import Any

import numpy as np

from memoryos_gpu.json_codec import dumps
from memoryos_gpu.page_views import approx_tokens
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
    as_json: bool = False,
) -> list[Retrieval] | list[bytes]:
    """One :class:`Retrieval` per query: MTM pages best first, the whole STM, the profile, the
    user's and the assistant's knowledge; ``as_json``: each one's JSON object instead
    (:func:`retrieval_json`'s bytes), written natively from the tables.

    The STM section (``stm``) also holds the user's *pending* pages -- pushed out of STM, their
    derived work not yet run, so in no MTM segment yet -- oldest first, before the STM pages
    (they are older): until a derived round places them (with the LLM down, for as long as it
    is down) they would be in neither section, and a retrieval would lose pages the user
    added. The native assembler reads them from each user's record (``UserState.pending``),
    as it reads its ``stm``: no SQL, no Python per query; their ``tier`` says ``"stm"`` like
    the section's other pages. Once in MTM they are retrieved (by score) from there only."""
    hits = (pages, user_knowledge, assistant_knowledge)
    try:
        return _assemble(s, cleaned, users, *hits, as_json)
    except KeyError:  # a view is missing (a bug elsewhere): read the batch's from the store
        _read_missing(s, pages[1], users, user_knowledge[1], assistant_knowledge[1])
        return _assemble(s, cleaned, users, *hits, as_json)


def retrieval_fields(r: Retrieval) -> dict[str, Any]:
    """A retrieval's fields but ``user_id``, in order (pages and entries stay dataclasses:
    the JSON encoder writes them as objects of their fields): the JSON object of a result."""
    return {
        "query": r.query,
        "stm": r.stm,
        "pages": r.pages,
        "profile": r.profile,
        "user_knowledge": r.user_knowledge,
        "assistant_knowledge": r.assistant_knowledge,
        "retrieval_tokens": r.retrieval_tokens,
    }


def retrieval_json(r: Retrieval) -> bytes:
    """:func:`retrieval_fields` as JSON: what ``assemble(..., as_json=True)`` writes natively."""
    return dumps(retrieval_fields(r))


def _assemble(
    s: EngineState,
    cleaned: Sequence[tuple[str, str]],
    users: Sequence[UserState],
    pages: Hits,
    user_knowledge: Hits,
    assistant_knowledge: Hits,
    as_json: bool = False,
) -> list[Any]:
    paused = gc.isenabled()  # ~20 objects a query, none cyclic: no collection can free any
    if paused:
        gc.disable()
    try:
        args = (
            cleaned if isinstance(cleaned, list) else list(cleaned),
            users if isinstance(users, list) else list(users),
            s.views.pages.table,
            s.views.pages.chains,
            s.views.knowledge.table,
            *_hits(pages),
            *_hits(user_knowledge),
            *_hits(assistant_knowledge),
            s.profiles,
            _profile_tokens,
        )
        assembler = _assembler()
        out, total = assembler.bodies(*args, dumps) if as_json else assembler.batch(*args)
    finally:
        if paused:
            gc.enable()
    s.counters["retrieval_tokens"] += total
    return out


@functools.cache
def _assembler() -> Any:
    """The native builder (``memoryos_gpu._C.Assembler``): it fills the slots of these three
    classes directly, one call per batch."""
    from memoryos_gpu import _C

    return _C.Assembler(RetrievedPage, KnowledgeEntry, Retrieval, "mtm", "stm")


def _hits(hits: Hits) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, scores float32), C-contiguous, as the builder reads them."""
    scores, ids = hits
    return np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(scores, np.float32)


def _profile_tokens(profile: dict[str, Any]) -> int:
    return sum([approx_tokens(k, v) for k, v in profile.items()])


def _read_missing(
    s: EngineState,
    page_ids: np.ndarray,
    users: Sequence[UserState],
    *entry_ids: np.ndarray,
) -> None:
    """Fill the views with the batch's pages and entries they lack, from the store."""
    views, texts = s.views.pages, s.views.knowledge
    need = [p for p in page_ids.ravel().tolist() if p >= 0 and p not in views]
    need += [p for u in users for ids in (u.pending, u.stm) for p in ids if p not in views]
    s.views.put_views((pid, "", v) for pid, v in s.store.page_views(need).items())
    entries = [e for ids in entry_ids for e in ids.ravel().tolist() if e >= 0 and e not in texts]
    texts.update(s.store.knowledge_texts(entries))
    s.views.store_reads += len(need) + len(entries)

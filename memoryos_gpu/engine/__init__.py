"""The engine: MemoryOS's three tiers for many users, on the arena, backed by the store.

Life of a page:

1. ``add_many`` validates the pages, embeds them in one batch, and commits them to the store's
   STM in one transaction before returning. A page pushed out of a full STM is marked
   ``pending`` in the same transaction: the store records the derived work still owed.
2. ``process_pending`` (run inside ``add_many`` when ``auto_process``) drains that work in
   *rounds* of *waves*: a wave takes the oldest pending page of every user, so one user's pages
   are applied in order while every stage batches across users. A wave runs the chain + summary
   stage (one LLM batch, or extractive), embeds the summaries, matches them against each user's
   segments with one kernel call, inserts (cos + Jaccard >= theta) or opens a segment (evicting
   the lowest-heat one when all slots are live), recomputes heat, and queues promotions. Each
   item's effects and the deletion of its pending row share one transaction. The LLM and
   embedding calls run without the engine lock (a round reads under it, computes, and applies
   under it only what still holds), so retrievals never wait for an LLM.
3. A promoted segment (heat >= tau) sends its unanalysed pages to the profile/knowledge stage;
   facts go to the user's and the assistant's FIFO rings, pages are marked analysed and
   ``L_interaction`` resets.

``retrieve_many`` answers many users' queries with one embedding batch and one pass of each
kernel (segments, pages, user knowledge, assistant knowledge), then feeds heat back.

Where each mechanic lives (one per file, each a small class over the shared state):

======================  =======================================================================
``facade.py``           :class:`MemoryEngine`: construction, the public API, the hooks
``state.py``            the shared state (users, slot maps, arena, store, caches, counters, lock)
                        and its slot bookkeeping; the hook protocol the parts call back through
``validation.py``       text / id / timestamp / page checks and limits, ``InvalidInputError``
``page_text.py``        the text a page is embedded from and its BM25 row is indexed from
``stm.py``              accepting pages; the STM FIFO and its overflow into pending work
``derived.py``          the rounds that drain pending work; saving the keyword statistics
``mtm.py``              segments: matching a round, join / open, eviction, the dialogue chain
``mtm_rounds.py``       what a round carries between its steps; the rows written once a round
``heat.py``             retrieval hits, heat recomputation, promotion queueing, stats write-behind
``lpm.py``              promotions into profile and knowledge rings; profile / knowledge reads
``knowledge_ring.py``   one promotion's writes to the rings: add, strengthen, supersede
``conflicts.py``        what a new fact does to the live ones (duplicate, contradiction, new)
``retrieval.py``        the batched retrieval pipeline (kernels, lexical fusion, assembly)
``responses.py``        ``respond_many``: retrieval, prompts, one LLM batch, the exchange added
``items.py``            item-level get / update / delete, history, export / delete of a user
``forget.py``           delete_page and what deleting forgets (derived items, summaries, stats)
``rebuild.py``          loading the store into the arena on open, resuming pending work
======================  =======================================================================

Two departures from a one-file-per-tier split, and why: heat has its own file because both the
MTM writers and retrieval feed it, and its write-behind is the piece the retrieval path must
not wait on; page text has its own file because acceptance, MTM, item edits and the lexical
index's loader must all derive a page's text the same way, and none of them owns it.

Composition, not mixins: the facade owns the parts and the one
:class:`~memoryos_gpu.engine.state.EngineState`; parts never call each other's overridable
steps directly but go through the engine's hooks (``_accept``, ``_learn_keywords``,
``process_pending``, ``_process_pages``, ``_process_promotions``, ``_push_knowledge``,
``_open_store``, ``_rebuild``), so a subclass such as
:class:`~memoryos_gpu.distributed.ShardEngine` changes a step once and it holds everywhere.
"""

from .facade import MemoryEngine
from .state import DEFAULT_ASSISTANT
from .validation import (
    MAX_ID_CHARS,
    MAX_META_BYTES,
    MAX_META_DEPTH,
    MAX_TEXT_CHARS,
    InvalidInputError,
    _clean_id,
    _clean_text,
    _timestamp,
    clean_queries,
    validate_page,
    validate_pages,
)

__all__ = [
    "DEFAULT_ASSISTANT",
    "MAX_ID_CHARS",
    "MAX_META_BYTES",
    "MAX_META_DEPTH",
    "MAX_TEXT_CHARS",
    "InvalidInputError",
    "MemoryEngine",
    "_clean_id",
    "_clean_text",
    "_timestamp",
    "clean_queries",
    "validate_page",
    "validate_pages",
]

"""``Memory``: mem0's Python API over the MemoryOS engine.

Code written against mem0's ``Memory`` switches by changing the import and the config::

    # from mem0 import Memory; m = Memory()
    from memoryos_gpu.mem0 import Memory
    m = Memory.from_config({"store": "./mem/memory.sqlite3"})

    m.add([{"role": "user", "content": "I moved to Boston."},
           {"role": "assistant", "content": "Welcome to Boston!"}], user_id="alice")
    m.search("Where does Alice live?", filters={"user_id": "alice"})["results"]

docs/migrating-from-mem0.md has the side-by-side table of both vocabularies and what differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine.validation import validate_pages
from memoryos_gpu.errors import UnknownUserError

from .filters import compile_filter, entity_id, split_scope
from .ops import Mem0Ops, MemoryNotFound
from .shapes import messages_to_pages

__all__ = [
    "SEARCH_DEFAULT",
    "Memory",
    "check_threshold",
    "listing_size",
    "refuse_expiration",
    "refuse_mem0_extraction",
    "refuse_metadata_edit",
    "resolve_user",
    "result_count",
]

#: Results a search gives when neither ``top_k`` nor ``limit`` is given: mem0 2's default.
SEARCH_DEFAULT = 20

# keys only mem0's config has, and mem0's {"provider": ..., "config": ...} form of the shared ones
_MEM0_ONLY_KEYS = ("vector_store", "graph_store", "history_db_path", "version")

#: ``update``'s default for ``expiration_date``: mem0 tells "not given" from None ("clear it").
_UNSET: Any = object()


class Memory:
    """mem0's verbs (``add``, ``search``, ``get_all``, ``get``, ``update``, ``delete``,
    ``delete_all``, ``history``, ``reset``) on a :class:`~memoryos_gpu.engine.MemoryEngine`.

    ``config``: an :class:`EngineConfig` (or its fields as a dict; default: the embedded
    defaults), or pass a ready ``engine`` (it stays the caller's to close). ``embedder`` /
    ``llm``: ready-made components for the engine built here.
    """

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | None = None,
        *,
        engine: Any = None,
        embedder: Any = None,
        llm: Any = None,
    ) -> None:
        if engine is not None and config is not None:
            raise ValueError("give config or engine, not both")
        self._owns_engine = engine is None
        if engine is None:
            from memoryos_gpu.engine import MemoryEngine

            engine = MemoryEngine(_engine_config(config), embedder=embedder, llm=llm)
        self.engine = engine
        self._ops = Mem0Ops(engine)

    @classmethod
    def from_config(cls, config_dict: Mapping[str, Any]) -> Memory:
        """A memory from :class:`EngineConfig` fields (mem0's own config keys are refused
        with the name of the field to use instead)."""
        return cls(config_dict)

    # ------------------------------------------------------------------ writes
    def add(
        self,
        messages: Any,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        timestamp: float | str | None = None,
        expiration_date: Any = None,
        infer: bool = True,
        memory_type: str | None = None,
        prompt: str | None = None,
    ) -> dict[str, Any]:
        """Remember ``messages`` (a string, a message dict or an OpenAI-style list): each user
        message with the assistant's answer becomes one page, stored before this returns.

        ``user_id`` / ``agent_id`` / ``run_id`` are read as mem0 reads them
        (:func:`~memoryos_gpu.mem0.filters.entity_id`: ``42`` is ``"42"``, surrounding
        whitespace is trimmed). ``infer`` is accepted for mem0 code: MemoryOS always keeps the
        exchange verbatim and derives long-term facts from it in the background, so both values
        store the same. ``prompt`` and ``memory_type`` (mem0's extraction prompt and memory
        kind) are accepted as None only (:func:`refuse_mem0_extraction`), ``expiration_date``
        too (:func:`refuse_expiration`)."""
        del infer
        refuse_mem0_extraction(prompt=prompt, memory_type=memory_type)
        refuse_expiration(expiration_date)
        uid = _need_user(user_id)
        made = messages_to_pages(
            messages,
            user_id=uid,
            assistant_id=entity_id(agent_id, "agent_id"),
            metadata=metadata,
            run_id=entity_id(run_id, "run_id"),
            timestamp=timestamp,
        )
        pages = validate_pages(made)  # as stored: what the answer shows
        results = self.engine.add_many(pages)
        return {"results": add_results(pages, results)}

    # ------------------------------------------------------------------ reads
    def search(
        self,
        query: str,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        filters: Mapping[str, Any] | None = None,
        top_k: int | None = None,
        limit: int | None = None,
        threshold: float | None = None,
        rerank: bool = False,
        explain: bool = False,
        reference_date: Any = None,
        show_expired: bool = False,
    ) -> dict[str, Any]:
        """The user's memories for ``query``, best first (``score``: cosine similarity), at most
        ``top_k`` (or ``limit``): default 20, mem0 2's ``top_k`` default (mem0 1's ``limit``
        defaulted to 100: pass ``limit=100`` for that).

        Candidates are what MemoryOS retrieves (the top mid-term pages, the whole short-term
        memory, the top user and assistant knowledge); ``agent_id``, ``run_id`` and
        ``filters`` narrow them (see :func:`resolve_user`, :mod:`memoryos_gpu.mem0.filters`),
        ``threshold`` (0 to 1, as in mem0) drops those scored below it.

        mem0 2's other arguments: ``explain=True`` adds mem0's ``score_details`` to each result
        (the cosine is the whole score: no keyword or entity part); ``show_expired`` changes
        nothing (no memory expires here: :func:`refuse_expiration`); ``rerank`` and
        ``reference_date`` are accepted at their defaults only (there is no reranker; the
        reference date is a mem0 Platform parameter that mem0's own ``Memory`` refuses too)."""
        _check_flag(explain, "explain")
        _check_flag(show_expired, "show_expired")
        _check_flag(rerank, "rerank")
        if rerank:
            raise ValueError(
                "rerank=True not supported: memoryos-gpu has no reranker; results are ranked by "
                "cosine similarity, as mem0 ranks them without one (pass rerank=False)"
            )
        if reference_date is not None:
            raise ValueError(
                "reference_date not supported: it is a mem0 Platform parameter (mem0's own "
                "Memory refuses it too)"
            )
        uid, rest = resolve_user(user_id, filters, agent_id=agent_id, run_id=run_id)
        k = result_count(top_k, limit, SEARCH_DEFAULT)
        check_threshold(threshold)
        keep = compile_filter(rest)
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be a non-empty string")
        try:
            retrieval = self.engine.retrieve(
                uid, query, top_pages=max(k, self.engine.memory.top_pages)
            )
        except UnknownUserError:
            return {"results": []}
        ranked = self._ops.rank(retrieval, keep=keep, threshold=threshold, top_k=k, explain=explain)
        return {"results": ranked}

    def get_all(
        self,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        filters: Mapping[str, Any] | None = None,
        page: int = 1,
        page_size: int | None = None,
        top_k: int | None = None,
        limit: int | None = None,
        show_expired: bool = False,
    ) -> dict[str, Any]:
        """The user's memories (narrowed as :meth:`search` narrows them), oldest first,
        ``page_size`` per page (``top_k`` / ``limit``: mem0's names for the size of the first
        page, default 100). Adds ``count`` and ``has_more``. ``show_expired`` (mem0 2) changes
        nothing: no memory expires here."""
        _check_flag(show_expired, "show_expired")
        uid, rest = resolve_user(user_id, filters, agent_id=agent_id, run_id=run_id)
        size = listing_size(page_size, limit, top_k)
        keep = compile_filter(rest) if rest else None
        return self._ops.list(uid, page=page, page_size=size, keep=keep)

    def get(self, memory_id: str) -> dict[str, Any] | None:
        """One memory by id (``page-<n>`` or ``knowledge-<n>``), or None."""
        return self._ops.get(memory_id)

    def history(self, memory_id: str) -> list[dict[str, Any]]:
        """How a memory changed: ADD, each UPDATE, DELETE (oldest first)."""
        return self._ops.history(memory_id)

    # ------------------------------------------------------------------ edits
    def update(
        self,
        memory_id: str,
        text: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        expiration_date: Any = _UNSET,
        data: str | None = None,
        *,
        agent_response: str | None = None,
    ) -> dict[str, Any]:
        """Replace a memory's text (``data``: mem0's older name). For a page ``text`` is the
        user's side of the exchange and ``agent_response`` the assistant's.

        mem0 2's ``metadata`` and ``expiration_date`` are accepted as None only: a page keeps
        the metadata it was added with (:func:`refuse_metadata_edit`) and no memory expires
        here, so ``expiration_date=None`` (mem0: "clear it") has nothing to clear."""
        if text is not None and data is not None:
            raise ValueError("give text or data, not both")
        refuse_metadata_edit(metadata)
        if expiration_date is not _UNSET:
            refuse_expiration(expiration_date)
        text = text if text is not None else data
        try:
            if text is None and agent_response is None and expiration_date is not _UNSET:
                self._ops.require(memory_id)  # nothing to change, as mem0 clears no expiry
                return {"message": "Memory updated successfully!"}
            return self._ops.update(memory_id, text, agent_response)
        except MemoryNotFound as exc:
            raise ValueError(str(exc)) from None

    def delete(self, memory_id: str) -> dict[str, Any]:
        try:
            return self._ops.delete(memory_id)
        except MemoryNotFound as exc:
            raise ValueError(str(exc)) from None

    def delete_all(
        self,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
    ) -> dict[str, Any]:
        """Delete a user with all their memory; with ``agent_id`` / ``run_id`` only the user's
        memories those select (as :meth:`get_all` lists them), the user staying. ``reset()``
        deletes every user."""
        uid, rest = resolve_user(user_id, None, agent_id=agent_id, run_id=run_id)
        if rest:
            self._ops.delete_matching(uid, compile_filter(rest))
        else:
            self.engine.delete_user(uid)
        return {"message": "Memories deleted successfully!"}

    def reset(self) -> None:
        """Delete every user and their memory."""
        self._ops.reset()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the engine built here (a ``engine=`` passed in stays open)."""
        if self._owns_engine:
            self.engine.close()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_results(pages: list[Any], results: list[Any]) -> list[dict[str, Any]]:
    """mem0's ``add`` answer: one ``ADD`` per stored page (``NONE`` for a duplicate source).
    ``pages`` as the engine stores them (``validate_pages``: a lone surrogate is U+FFFD, say),
    so the answer agrees with a ``get`` of the same id."""
    from .shapes import page_text

    return [
        {
            "id": f"page-{r.page_id}",
            "memory": page_text(p.user_input, p.agent_response),
            "event": "NONE" if r.duplicate else "ADD",
        }
        for p, r in zip(pages, results, strict=True)
    ]


def resolve_user(
    user_id: str | None,
    filters: Mapping[str, Any] | None,
    *,
    agent_id: str | None = None,
    run_id: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """The user a search, listing or deletion is about and the filters that narrow their
    memories: the one rule of the facade and the ``/v1/mem0`` routes.

    Each scope id may come as an argument (mem0 1's spelling) or in ``filters`` (mem0 2's); the
    two must agree. Ids are read as mem0 reads them (:func:`~memoryos_gpu.mem0.filters.
    entity_id`: ``42`` is ``"42"``, ``" pad "`` is ``"pad"``). ``user_id`` is required (memory
    is kept per user); ``agent_id`` and ``run_id`` become filters on the user's items."""
    scope, rest = split_scope(filters)
    for key, given in (("user_id", user_id), ("agent_id", agent_id), ("run_id", run_id)):
        value = entity_id(given, key)
        if value is None:
            continue
        named = scope.setdefault(key, value)
        if named != value:
            raise ValueError(f"{key}={value!r} and filters[{key!r}]={named!r} disagree")
    uid = _need_user(scope.pop("user_id", None))
    rest.update(scope)
    return uid, rest


def _need_user(user_id: Any) -> str:
    """The user id (:func:`~memoryos_gpu.mem0.filters.entity_id`); a ``ValueError`` saying
    where to give it when there is none."""
    uid = entity_id(user_id, "user_id")
    if uid is None:
        raise ValueError(
            "give user_id (or filters={'user_id': ...}): memoryos-gpu keeps memory per user; "
            "agent_id and run_id narrow a user's memories"
        )
    return uid


def check_threshold(threshold: Any) -> None:
    """Refuse a ``threshold`` mem0 refuses: not a number, or outside 0 to 1 (a cosine score
    above 1 never happens, so ``threshold=2`` silently answered nothing)."""
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, int | float):
        raise ValueError(f"threshold must be a number, got {type(threshold).__name__}")
    if not 0 <= threshold <= 1:
        raise ValueError(f"Invalid threshold: {threshold}. Must be between 0 and 1 (inclusive).")


def _check_flag(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def result_count(top_k: int | None, limit: int | None, default: int) -> int:
    """How many results a call asks for: ``top_k`` or ``limit`` (mem0's two names, which
    must agree when both are given), else ``default``."""
    if top_k is not None and limit is not None and top_k != limit:
        raise ValueError("give top_k or limit, not both")
    k = top_k if top_k is not None else limit if limit is not None else default
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError("top_k must be an integer >= 1")
    return k


def listing_size(page_size: int | None, limit: int | None, top_k: int | None) -> int:
    """A listing's page size: ``page_size``, or mem0's ``limit`` / ``top_k`` for it (default
    100). Several that differ are refused, in Python as over HTTP: one of them would be
    ignored silently otherwise."""
    if len({v for v in (page_size, limit, top_k) if v is not None}) > 1:
        raise ValueError("give one of page_size, limit and top_k")
    return page_size if page_size is not None else result_count(top_k, limit, 100)


def refuse_mem0_extraction(**given: Any) -> None:
    """Refuse mem0's extraction settings (``prompt``, ``memory_type``) when set: memoryos-gpu
    derives memories with its own stages (docs/migrating-from-mem0.md), so honouring the call
    would mean ignoring them silently. None, what mem0 code passes by default, is accepted."""
    named = sorted(k for k, v in given.items() if v is not None)
    if named:
        raise ValueError(
            f"{', '.join(named)} not supported: memoryos-gpu keeps each exchange verbatim and "
            "derives memories with its own stages, not a mem0 extraction prompt or memory type "
            "(see docs/migrating-from-mem0.md)"
        )


def refuse_expiration(expiration_date: Any) -> None:
    """Refuse mem0's ``expiration_date`` when set: memoryos-gpu has no expiry dates (a memory
    is kept until it is deleted; what search retrieves follows the engine's heat and eviction,
    not a date), so the date would be ignored silently. None, mem0's default, is accepted."""
    if expiration_date is not None:
        raise ValueError(
            "expiration_date not supported: memoryos-gpu keeps memories until they are "
            "deleted, it has no expiry dates (see docs/migrating-from-mem0.md)"
        )


def refuse_metadata_edit(metadata: Any) -> None:
    """Refuse mem0's ``update(..., metadata=...)`` when set: a page keeps the metadata it was
    added with (filters select on it) and a knowledge entry has none, so the edit would be
    ignored silently. None is accepted."""
    if metadata is not None:
        raise ValueError(
            "metadata not editable: a memory keeps the metadata it was added with "
            "(a knowledge entry has none); update changes text only. Delete the memory and "
            "add it again with the new metadata (see docs/migrating-from-mem0.md)"
        )


def _engine_config(config: EngineConfig | Mapping[str, Any] | None) -> EngineConfig:
    if config is None or isinstance(config, EngineConfig):
        return config or EngineConfig()
    mem0_keys = [k for k in _MEM0_ONLY_KEYS if k in config]
    mem0_keys += [
        k
        for k in ("llm", "embedder")
        if isinstance(config.get(k), Mapping) and "provider" in config[k]
    ]
    if mem0_keys:
        raise ValueError(
            f"{mem0_keys} are mem0 settings; memoryos-gpu takes EngineConfig fields: store= "
            "(the SQLite file or postgresql:// URL that holds what mem0 keeps in its vector "
            "store and history db), embedding_model=, llm={...} (see docs/migrating-from-mem0.md)"
        )
    return EngineConfig.model_validate(dict(config))

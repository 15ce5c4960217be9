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
from memoryos_gpu.errors import UnknownUserError

from .filters import compile_filter, split_scope
from .ops import Mem0Ops, MemoryNotFound
from .shapes import messages_to_pages

__all__ = ["SEARCH_DEFAULT", "Memory", "listing_size", "resolve_user", "result_count"]

#: Results a search gives when neither ``top_k`` nor ``limit`` is given: mem0 2's default.
SEARCH_DEFAULT = 20

# keys only mem0's config has, and mem0's {"provider": ..., "config": ...} form of the shared ones
_MEM0_ONLY_KEYS = ("vector_store", "graph_store", "history_db_path", "version")


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
        infer: bool = True,
        prompt: str | None = None,
        memory_type: str | None = None,
    ) -> dict[str, Any]:
        """Remember ``messages`` (a string, a message dict or an OpenAI-style list): each user
        message with the assistant's answer becomes one page, stored before this returns.

        ``infer`` is accepted for mem0 code: MemoryOS always keeps the exchange verbatim and
        derives long-term facts from it in the background, so both values store the same.
        ``prompt`` and ``memory_type`` (mem0's extraction prompt and memory kind) are accepted
        as None only: see :func:`_refuse_mem0_extraction`."""
        del infer
        _refuse_mem0_extraction(prompt=prompt, memory_type=memory_type)
        uid = _need_user(user_id)
        pages = messages_to_pages(
            messages,
            user_id=uid,
            assistant_id=agent_id,
            metadata=metadata,
            run_id=run_id,
            timestamp=timestamp,
        )
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
    ) -> dict[str, Any]:
        """The user's memories for ``query``, best first (``score``: cosine similarity), at most
        ``top_k`` (or ``limit``): default 20, mem0 2's ``top_k`` default (mem0 1's ``limit``
        defaulted to 100: pass ``limit=100`` for that).

        Candidates are what MemoryOS retrieves (the top mid-term pages, the whole short-term
        memory, the top user and assistant knowledge); ``agent_id``, ``run_id`` and
        ``filters`` narrow them (see :func:`resolve_user`, :mod:`memoryos_gpu.mem0.filters`),
        ``threshold`` drops those scored below it."""
        uid, rest = resolve_user(user_id, filters, agent_id=agent_id, run_id=run_id)
        k = result_count(top_k, limit, SEARCH_DEFAULT)
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, int | float)
        ):
            raise ValueError(f"threshold must be a number, got {type(threshold).__name__}")
        keep = compile_filter(rest)
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be a non-empty string")
        try:
            retrieval = self.engine.retrieve(
                uid, query, top_pages=max(k, self.engine.memory.top_pages)
            )
        except UnknownUserError:
            return {"results": []}
        return {
            "results": self._ops.rank(retrieval, query, keep=keep, threshold=threshold, top_k=k)
        }

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
    ) -> dict[str, Any]:
        """The user's memories (narrowed as :meth:`search` narrows them), oldest first,
        ``page_size`` per page (``top_k`` / ``limit``: mem0's names for the size of the first
        page, default 100). Adds ``count`` and ``has_more``."""
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
        *,
        data: str | None = None,
        agent_response: str | None = None,
    ) -> dict[str, Any]:
        """Replace a memory's text (``data``: mem0's older name). For a page ``text`` is the
        user's side of the exchange and ``agent_response`` the assistant's."""
        if text is not None and data is not None:
            raise ValueError("give text or data, not both")
        try:
            return self._ops.update(memory_id, text if text is not None else data, agent_response)
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
    """mem0's ``add`` answer: one ``ADD`` per stored page (``NONE`` for a duplicate source)."""
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
    two must agree. ``user_id`` is required (memory is kept per user); ``agent_id`` and
    ``run_id`` become filters on the user's items."""
    scope, rest = split_scope(filters)
    for key, value in (("user_id", user_id), ("agent_id", agent_id), ("run_id", run_id)):
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{key} must be a non-empty string, got {value!r}")
        named = scope.setdefault(key, value)
        if named != value:
            raise ValueError(f"{key}={value!r} and filters[{key!r}]={named!r} disagree")
    uid = _need_user(scope.pop("user_id", None))
    rest.update(scope)
    return uid, rest


def _need_user(user_id: str | None) -> str:
    if not isinstance(user_id, str) or not user_id.strip():
        raise ValueError(
            "give user_id (or filters={'user_id': ...}): memoryos-gpu keeps memory per user; "
            "agent_id and run_id narrow a user's memories"
        )
    return user_id


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


def _refuse_mem0_extraction(**given: Any) -> None:
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

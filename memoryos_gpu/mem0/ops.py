"""mem0's verbs over a :class:`~memoryos_gpu.engine.MemoryEngine`, shared by the Python
facade (:class:`memoryos_gpu.mem0.Memory`) and the HTTP routes (``/v1/mem0``).

What the two callers do differently stays with them: the facade calls the engine directly,
the server sends writes and retrievals through its batching queues and calls these verbs in
its engine thread. Everything else (listing, ranking a retrieval into scored items, get,
update, delete, history) is here, once.

Search ranks by cosine similarity, the score mem0 users know (its ``threshold`` applies to
it): the candidates are what MemoryOS retrieves for the query (the top mid-term pages, the
whole short-term memory, the user's and the assistant's top knowledge), scored against the
query's embedding (a cache hit: the retrieval just embedded the same text) in one vectorised
step. A result is the item ``get`` gives for its id, with the score: its times and text are
read from the store in a few batched queries per search, not one per result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from memoryos_gpu.embed.base import encode_checked
from memoryos_gpu.errors import UnknownItemError
from memoryos_gpu.types import Retrieval

from .filters import Predicate
from .shapes import (
    MemoryId,
    history_events,
    knowledge_item,
    page_item,
    parse_memory_id,
    public,
)

__all__ = ["Mem0Ops", "MemoryNotFound"]

MAX_PAGE_SIZE = 1000
#: The largest offset a listing may start at: SQLite's (and PostgreSQL's) signed 64-bit
#: integer; a larger one overflows in the database driver.
MAX_OFFSET = 2**63 - 1


class MemoryNotFound(KeyError):
    """No memory has this id (mem0 raises ``ValueError`` for it; :class:`Memory` does too)."""

    def __str__(self) -> str:
        return f"Memory with id {self.args[0]} not found"


class Mem0Ops:
    """The mem0 verbs that read or edit one engine's memory."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    # ------------------------------------------------------------------ reads
    def get(self, memory_id: str) -> dict[str, Any] | None:
        """The memory, or None when no memory has this id."""
        found = self._find(memory_id)
        return None if found is None else public(found[0])

    def owner(self, memory_id: str) -> str | None:
        """The stored id of the user (or ``"assistant:<id>"``) that owns a memory."""
        found = self._find(memory_id)
        return None if found is None else found[1]

    def list(
        self, user_id: str, *, page: int, page_size: int, keep: Predicate | None = None
    ) -> dict[str, Any]:
        """One page of the user's memories, oldest first: pages, then live knowledge."""
        check_paging(page, page_size)
        offset = (page - 1) * page_size
        store = self.engine.store
        user = store.user_row(user_id)
        if user is None:
            return _listing([], 0, page, page_size)
        if keep is None:  # a window read of the pages; knowledge after them
            pages, n_pages = store.page_window(user_id, offset, page_size)
            items = self._page_items(user_id, user["assistant_id"], pages)
            knowledge = self._knowledge_items(user_id, user["assistant_id"])
            room = page_size - len(items)
            start = max(0, offset - n_pages)
            items += knowledge[start : start + room] if room > 0 else []
            return _listing(items, n_pages + len(knowledge), page, page_size)
        everything = self._matching(user_id, user["assistant_id"], keep)
        return _listing(everything[offset : offset + page_size], len(everything), page, page_size)

    def _matching(self, user_id: str, assistant: str | None, keep: Predicate) -> list[dict]:
        """Every memory of the user that ``keep`` accepts, oldest first (pages, knowledge)."""
        pages = self._page_items(user_id, assistant, self.engine.store.user_pages(user_id))
        return [i for i in pages + self._knowledge_items(user_id, assistant) if keep(i)]

    def rank(
        self,
        retrieval: Retrieval,
        query: str | None = None,
        *,
        keep: Predicate,
        threshold: float | None,
        top_k: int,
        explain: bool = False,
    ) -> list[dict[str, Any]]:
        """A retrieval's pages and knowledge as items scored by cosine with the query, best
        first, filtered, at or above ``threshold``, at most ``top_k``; ``explain``: each with
        mem0's ``score_details``. A page or knowledge entry deleted since the retrieval (which
        returned before this runs: no store snapshot spans both) is not a result.

        The query (default: the retrieval's) is embedded as the engine reads a query (NFC, a
        lone surrogate as U+FFFD, as a page's text is stored): ``retrieval.query`` already is,
        a caller's raw text is normalised first, which an embedder's tokenizer may refuse."""
        eng = self.engine
        uid = retrieval.user_id
        assistant = (eng.store.user_row(uid) or {}).get("assistant_id")
        q = _unit(encode_checked(eng.embedder, [_query_text(retrieval, query)]))[0]
        pages, page_scores = self._scored_pages([*retrieval.pages, *retrieval.stm], q)
        updated = eng.store.last_updates(uid, "page")
        scored = [
            (
                float(sc),
                page_item(
                    {**_fields(p), "extra": p.extra},
                    user_id=uid,
                    assistant_id=assistant,
                    updated=updated.get(p.page_id),
                ),
            )
            for p, sc in zip(pages, page_scores.tolist(), strict=True)
        ]
        scored += self._scored_knowledge(
            assistant, [*retrieval.user_knowledge, *retrieval.assistant_knowledge]
        )
        scored.sort(key=lambda si: -si[0])
        out = [
            public(item, sc)
            for sc, item in scored
            if (threshold is None or sc >= threshold) and keep(item)
        ][:top_k]
        if explain:
            for item in out:
                item["score_details"] = _score_details(item["score"], threshold)
        return out

    def _scored_knowledge(
        self, assistant: str | None, entries: list[Any]
    ) -> list[tuple[float, dict[str, Any]]]:
        """Retrieved knowledge entries that are still live, each with its score and the item
        ``get`` gives for it (its text, ``created_at`` and ``updated_at`` as stored): one
        batched read of the rows, one of the edit times per owner."""
        if not entries:
            return []
        store = self.engine.store
        rows = store.knowledge_rows([e.entry_id for e in entries])
        edits: dict[str, dict[int, float]] = {}
        out = []
        for e in entries:
            row = rows.get(e.entry_id)
            if row is None or not row["live"]:
                continue
            owner = _audit_owner(row)
            if owner not in edits:
                edits[owner] = store.last_updates(owner, "knowledge")
            item = _knowledge_row_item(row, edits[owner].get(e.entry_id), assistant)
            out.append((float(e.score or 0.0), item))
        return out

    def _scored_pages(self, pages: list[Any], q: np.ndarray) -> tuple[list[Any], np.ndarray]:
        """The pages that are still stored, and their cosines with the unit query ``q``."""
        if not pages:
            return [], np.zeros(0)
        eng = self.engine
        kept, embs = eng.store.live_page_embeddings([p.page_id for p in pages], eng.embedder.dim)
        live = set(kept)
        return [p for p in pages if p.page_id in live], _unit(embs) @ q

    def history(self, memory_id: str) -> list[dict[str, Any]]:
        """mem0's history of a memory (added, each edit, deleted), oldest first; [] for an
        id that names nothing: neither stored nor named by the audit (a deleted memory keeps
        its history; an ADD is made up only for a knowledge entry that exists or existed)."""
        mid = parse_memory_id(memory_id)
        if mid is None:
            return []
        store = self.engine.store
        found = self._find(memory_id)
        owners = self.history_owners(memory_id)
        events = [e for o in owners for e in store.item_history(o, mid.kind, mid.number)]
        if found is None and not events:
            return []
        events.sort(key=lambda e: e["event_id"])
        adds = [i for i, e in enumerate(events) if e["action"] == "add"]
        if found is not None and adds:  # SQLite may reuse a deleted page's id: the live one's
            events = events[adds[-1] :]
        item = found[0] if found else {}
        return history_events(mid, events, item.get("memory"), item.get("_created_at_ts"))

    # ------------------------------------------------------------------ edits
    def update(
        self, memory_id: str, text: str | None = None, agent_response: str | None = None
    ) -> dict[str, Any]:
        """Replace a memory's text (a page: the user's side, ``agent_response`` the other; not
        both blank, :func:`_check_not_blanked`).
        :class:`MemoryNotFound` also when the memory is deleted after :meth:`_require` found
        it (a concurrent delete: the engine's ``UnknownItemError``)."""
        mid, item = self._require(memory_id)
        if text is None and agent_response is None:
            raise ValueError("give the new text")
        if mid.kind == "knowledge" and agent_response is not None:
            raise ValueError("a knowledge entry has no agent_response")
        if mid.kind == "page":
            _check_not_blanked(item, text, agent_response)
        try:
            if mid.kind == "page":
                self.engine.update_page(mid.number, user_input=text, agent_response=agent_response)
            else:
                self.engine.update_knowledge(mid.number, text)
        except UnknownItemError:
            raise MemoryNotFound(memory_id) from None
        return {"message": "Memory updated successfully!"}

    def delete(self, memory_id: str) -> dict[str, Any]:
        """Delete a memory; :class:`MemoryNotFound` when there is none, also when a concurrent
        delete took it after :meth:`_require` found it (as a second delete is answered)."""
        mid, _ = self._require(memory_id)
        if mid.kind == "page":
            deleted = self.engine.delete_page(mid.number)
        else:
            deleted = self.engine.delete_knowledge(mid.number)
        if not deleted:
            raise MemoryNotFound(memory_id)
        return {"message": "Memory deleted successfully!"}

    def delete_matching(self, user_id: str, keep: Predicate) -> int:
        """Delete the user's memories that ``keep`` accepts (mem0's ``delete_all`` narrowed by
        ``agent_id`` / ``run_id``); the user and the rest of their memory stay. The number
        deleted: a fact that went with a deleted page it was derived from is not counted."""
        user = self.engine.store.user_row(user_id)
        if user is None:
            return 0
        deleted = 0
        for item in self._matching(user_id, user["assistant_id"], keep):
            mid = parse_memory_id(item["id"])
            assert mid is not None
            delete = self.engine.delete_page if mid.kind == "page" else self.engine.delete_knowledge
            deleted += bool(delete(mid.number))
        return deleted

    def reset(self, owns: Callable[[str], bool] = lambda _: True) -> int:
        """Delete every user ``owns`` accepts, with their memory; the number deleted."""
        users = [u for u in self.engine.users() if owns(u)]
        for u in users:
            self.engine.delete_user(u)
        return len(users)

    # ------------------------------------------------------------------ helpers
    def require(self, memory_id: str) -> None:
        """:class:`MemoryNotFound` unless a memory has this id."""
        self._require(memory_id)

    def _require(self, memory_id: str) -> tuple[MemoryId, dict[str, Any]]:
        """The memory's parsed id and its item; :class:`MemoryNotFound` when there is none."""
        found = self._find(memory_id)
        if found is None:
            raise MemoryNotFound(memory_id)
        mid = parse_memory_id(memory_id)
        assert mid is not None
        return mid, found[0]

    def _find(self, memory_id: str) -> tuple[dict[str, Any], str] | None:
        """(the item, its audit owner) or None."""
        mid = parse_memory_id(memory_id)
        if mid is None:
            return None
        store = self.engine.store
        if mid.kind == "page":
            row = store.page_rows([mid.number]).get(mid.number)
            if row is None:
                return None
            updated = store.last_updates(row["user_id"], "page").get(mid.number)
            assistant = _user_assistant(store, row["user_id"])
            item = page_item(row, user_id=row["user_id"], assistant_id=assistant, updated=updated)
            return item, row["user_id"]
        row = store.knowledge_rows([mid.number]).get(mid.number)
        if row is None or not row["live"]:
            return None
        owner = _audit_owner(row)
        is_user = row["owner_kind"] == "user"
        item = _knowledge_row_item(
            row,
            store.last_updates(owner, "knowledge").get(mid.number),
            _user_assistant(store, row["owner_id"]) if is_user else None,
        )
        return item, owner

    def history_owners(self, memory_id: str) -> list[str]:
        """Whose audit holds a memory's events: its owner, or for a memory that is gone
        whoever's audit names it (one query)."""
        found = self._find(memory_id)
        if found is not None:
            return [found[1]]
        mid = parse_memory_id(memory_id)
        if mid is None:
            return []
        rows = self.engine.store.query(
            "SELECT DISTINCT user_id FROM audit WHERE item_kind = ? AND item_id = ?",
            (mid.kind, mid.number),
        )
        return [r[0] for r in rows]

    def _page_items(self, uid: str, assistant: str | None, rows: list[dict]) -> list[dict]:
        updated = self.engine.store.last_updates(uid, "page")
        return [
            page_item(r, user_id=uid, assistant_id=assistant, updated=updated.get(r["page_id"]))
            for r in rows
        ]

    def _knowledge_items(self, uid: str, assistant: str | None) -> list[dict[str, Any]]:
        """The user's live knowledge as items, ``agent_id`` the user's assistant (a user has
        exactly one: a scope of it keeps the user's own facts, as it keeps their pages)."""
        store = self.engine.store
        updated = store.last_updates(uid, "knowledge")
        return [
            knowledge_item(
                r["entry_id"],
                r["text"],
                created=r["created"],
                user_id=uid,
                assistant_id=assistant,
                updated=updated.get(r["entry_id"]),
            )
            for r in store.owner_knowledge("user", uid)
        ]


def _query_text(retrieval: Retrieval, query: str | None) -> str:
    """The text a ranking embeds: the retrieval's query (normalised by the engine), or
    ``query`` normalised the same way (:func:`~memoryos_gpu.engine.clean_queries`)."""
    if query is None or query == retrieval.query:
        return retrieval.query
    from memoryos_gpu.engine.validation import clean_queries

    return clean_queries([(retrieval.user_id, query)])[0][1]


def _audit_owner(row: dict[str, Any]) -> str:
    """Whose audit holds a knowledge entry's edits: its user, or ``"assistant:<id>"``."""
    is_user = row["owner_kind"] == "user"
    return row["owner_id"] if is_user else f"assistant:{row['owner_id']}"


def _knowledge_row_item(
    row: dict[str, Any], updated: float | None, user_assistant: str | None
) -> dict[str, Any]:
    """A knowledge row (:meth:`knowledge_rows`) as the item ``get``, ``get_all`` and
    ``search`` give: the user's fact (``user_id``, and ``agent_id``: ``user_assistant``, the
    user's assistant) or the assistant's (``agent_id`` only), with its stored text and times."""
    is_user = row["owner_kind"] == "user"
    return knowledge_item(
        row["entry_id"],
        row["text"],
        created=row["created"],
        user_id=row["owner_id"] if is_user else None,
        assistant_id=user_assistant if is_user else row["owner_id"],
        updated=updated,
    )


def _score_details(score: float, threshold: float | None) -> dict[str, Any]:
    """mem0's ``score_details`` (``search(explain=True)``) of a score that is the cosine
    alone: no keyword (BM25) or entity part, so the final score is the semantic one."""
    return {
        "semantic_score": score,
        "bm25_score": 0.0,
        "entity_boost": 0.0,
        "raw_score": score,
        "max_possible_score": 1.0,
        "final_score": score,
        "threshold": threshold,
    }


def _user_assistant(store: Any, user_id: str) -> str | None:
    """The assistant a user belongs to (the ``agent_id`` of all the user's items)."""
    return (store.user_row(user_id) or {}).get("assistant_id")


def _check_not_blanked(page: dict[str, Any], text: str | None, agent_response: str | None) -> None:
    """Refuse a page edit that leaves both sides blank: mem0's ``add`` refuses a memory of no
    words, so ``update`` does too (as for a knowledge entry). The engine itself keeps blank
    pages, on add and edit alike (it never drops a page it is given)."""
    user_side = page["user_input"] if text is None else text
    agent_side = page["agent_response"] if agent_response is None else agent_response
    if not (str(user_side).strip() or str(agent_side).strip()):
        raise ValueError("the update leaves both sides of the page blank: delete it instead")


def _fields(p: Any) -> dict[str, Any]:
    return {
        "page_id": p.page_id,
        "user_input": p.user_input,
        "agent_response": p.agent_response,
        "timestamp": p.timestamp,
        "tier": p.tier,
    }


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(n, 1e-12)


def check_paging(page: int, page_size: int) -> None:
    """Refuse (``ValueError``) a page or page size a listing cannot serve: the page's offset,
    ``(page - 1) * page_size``, must fit the store's 64-bit integers (at most
    :data:`MAX_OFFSET`)."""
    if isinstance(page, bool) or not isinstance(page, int) or page < 1:
        raise ValueError("page must be an integer >= 1")
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise ValueError("page_size must be an integer")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be between 1 and {MAX_PAGE_SIZE}")
    if (page - 1) * page_size > MAX_OFFSET:
        raise ValueError(
            f"page is too large: (page - 1) * page_size must be at most {MAX_OFFSET}, "
            f"got page={page}, page_size={page_size}"
        )


def _listing(items: list[dict], total: int, page: int, page_size: int) -> dict[str, Any]:
    return {
        "results": [public(i) for i in items],
        "count": total,
        "page": page,
        "page_size": page_size,
        "has_more": page * page_size < total,
    }

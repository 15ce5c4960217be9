"""Item-level control: read, edit and delete one page or knowledge entry; export or delete a
whole user; the audit history.

Every change is audited in the store in the transaction that makes it, and whatever the arena
or the row caches hold of the item follows (an edited page is re-embedded in place, a deleted
one leaves its arena row and BM25 index), so the next retrieval sees the change.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memoryos_gpu.errors import UnknownUserError
from memoryos_gpu.store.sqlite import emb_blob

from .heat import Heat
from .page_text import lexical_text, page_text
from .state import EngineState
from .validation import _clean_text


class Items:
    """get/update/delete of pages and knowledge entries, export/delete of users."""

    def __init__(self, state: EngineState, heat: Heat) -> None:
        self._s = state
        self._heat = heat

    # ---------------------------------------------------------------- pages
    def get_page(self, page_id: int) -> dict[str, Any] | None:
        return self._s.store.page_rows([page_id]).get(int(page_id))

    def update_page(
        self, page_id: int, *, user_input: str | None = None, agent_response: str | None = None
    ) -> dict[str, Any]:
        """Edit a page's text; its embedding (and its arena row, when in MTM) follow."""
        s = self._s
        with s.lock:
            row = self.get_page(page_id)
            if row is None:
                raise KeyError(f"no page {page_id}")
            new = {
                "user_input": _clean_text(user_input, "user_input")
                if user_input is not None
                else row["user_input"],
                "agent_response": _clean_text(agent_response, "agent_response")
                if agent_response is not None
                else row["agent_response"],
            }
            vec = s.embedder.encode([page_text({**row, **new}, s.memory.embed_dates)])[0]
            with s.store.transaction() as db:
                db.execute(
                    "UPDATE pages SET user_input = ?, agent_response = ?, embedding = ? "
                    "WHERE page_id = ?",
                    (new["user_input"], new["agent_response"], emb_blob(vec), page_id),
                )
                s.page_views.forget([page_id])
                s.store.audit(
                    db,
                    row["user_id"],
                    "update",
                    "page",
                    page_id,
                    {"before": {k: row[k] for k in new}, "after": new},
                )
            slots = np.flatnonzero(s.page_of_slot == page_id)
            if slots.size:
                s.arena.write_page_embeddings(slots, vec[None])
                if s.lexical is not None:
                    s.lexical.add(
                        row["user_id"],
                        page_id,
                        lexical_text(new["user_input"], new["agent_response"], row["extra"]),
                        row["timestamp"],
                    )
            return self.get_page(page_id)

    def delete_page(self, page_id: int) -> bool:
        """Remove a page from every tier; its chain neighbours are unlinked."""
        s = self._s
        with s.lock:
            row = self.get_page(page_id)
            if row is None:
                return False
            slots = np.flatnonzero(s.page_of_slot == page_id)
            s.arena.delete_pages(slots)
            s.page_of_slot[slots] = -1
            if s.lexical is not None:
                s.lexical.remove(row["user_id"], [page_id])
            user = s.users.get(row["user_id"])
            with s.store.transaction() as db:
                db.execute("DELETE FROM pending WHERE kind = 'page' AND ref = ?", (page_id,))
                db.execute("UPDATE pages SET next_page = NULL WHERE next_page = ?", (page_id,))
                db.execute("UPDATE pages SET prev_page = NULL WHERE prev_page = ?", (page_id,))
                db.execute("DELETE FROM pages WHERE page_id = ?", (page_id,))
                s.page_views.forget([page_id])
                if user is not None and page_id in user.stm:
                    user.stm.remove(page_id)
                if user is not None and user.chain_tail == page_id:
                    user.chain_tail = None
                    db.execute(
                        "UPDATE users SET chain_tail = NULL WHERE user_id = ?", (user.user_id,)
                    )
                s.store.audit(
                    db,
                    row["user_id"],
                    "delete",
                    "page",
                    page_id,
                    {"before": {k: row[k] for k in ("user_input", "agent_response")}},
                )
            return True

    # ---------------------------------------------------------------- knowledge
    def update_knowledge(self, entry_id: int, text: str) -> dict[str, Any]:
        """Edit a knowledge entry's text; its embedding (and its ring row, when live) follow."""
        s = self._s
        with s.lock:
            rows = s.store.knowledge_rows([entry_id])
            if entry_id not in rows:
                raise KeyError(f"no knowledge entry {entry_id}")
            row, text = rows[entry_id], _clean_text(text, "text")
            vec = s.embedder.encode([text])[0]
            with s.store.transaction() as db:
                db.execute(
                    "UPDATE knowledge SET text = ?, embedding = ? WHERE entry_id = ?",
                    (text, emb_blob(vec), entry_id),
                )
                s.knowledge_texts.forget([entry_id])
                s.store.audit(
                    db,
                    _audit_owner(row),
                    "update",
                    "knowledge",
                    entry_id,
                    {"before": row["text"], "after": text},
                )
            where = np.argwhere(s.entry_of_ring == entry_id)
            if where.size:
                s.arena.write_knowledge(where[:, 0], where[:, 1], vec[None])
            return s.store.knowledge_rows([entry_id])[entry_id]

    def delete_knowledge(self, entry_id: int) -> bool:
        s = self._s
        with s.lock:
            rows = s.store.knowledge_rows([entry_id])
            if entry_id not in rows:
                return False
            where = np.argwhere(s.entry_of_ring == entry_id)
            if where.size:
                s.arena.delete_knowledge(where[:, 0], where[:, 1])
                s.entry_of_ring[where[:, 0], where[:, 1]] = -1
            with s.store.transaction() as db:
                db.execute("DELETE FROM knowledge WHERE entry_id = ?", (entry_id,))
                s.knowledge_texts.forget([entry_id])
                s.store.audit(
                    db,
                    _audit_owner(rows[entry_id]),
                    "delete",
                    "knowledge",
                    entry_id,
                    {"before": rows[entry_id]["text"]},
                )
            return True

    # ---------------------------------------------------------------- users
    def history(self, user_id: str) -> list[dict[str, Any]]:
        """Append-only audit of changes to the user's memory."""
        return self._s.store.history(user_id)

    def export_user(self, user_id: str) -> dict[str, Any]:
        """Everything held about a user, derived profile and knowledge included (JSON-ready)."""
        s = self._s
        with s.lock:
            self._heat.sync()
            data = s.store.export_user(user_id)
            if data is None:
                raise UnknownUserError(f"unknown user {user_id!r}")
            data["assistant_knowledge"] = s.store.owner_knowledge(
                "assistant", data["user"]["assistant_id"]
            )
            return data

    def delete_user(self, user_id: str) -> bool:
        """Remove every row and arena slot held about the user."""
        s = self._s
        with s.lock:
            s.page_views.clear()  # cheaper than finding the user's ids; deletes are rare
            s.knowledge_texts.clear()
            user = s.users.pop(user_id, None)
            if user is None:
                return s.store.delete_user(user_id)
            live = s.arena.live_segments(user.slot)
            for slot in live:
                s.page_of_slot[s.arena.segment_pages(user.slot, int(slot))] = -1
            s.arena.remove_user(user.slot)
            s.arena.remove_owner(user.owner)
            s.segment_of[user.slot] = -1
            s.entry_of_ring[user.owner] = -1
            if s.lexical is not None:  # its keyword index holds the user's words
                s.lexical.drop_user(user_id)
            return s.store.delete_user(user_id)


def _audit_owner(row: dict[str, Any]) -> str:
    return row["owner_id"] if row["owner_kind"] == "user" else f"assistant:{row['owner_id']}"

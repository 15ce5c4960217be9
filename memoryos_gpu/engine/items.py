"""Item-level control: read, edit and delete one page or knowledge entry; export or delete a
whole user; the audit history.

Every change is audited in the store in the transaction that makes it, and whatever the arena
or the in-memory views hold of the item follows once it is committed (an edited page is
re-embedded and re-indexed in place, a deleted one leaves its arena row, term row and view),
so the next retrieval sees the change.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memoryos_gpu.embed.base import encode_checked
from memoryos_gpu.errors import UnknownItemError, UnknownUserError
from memoryos_gpu.lexical import terms_from_blobs, terms_to_blobs
from memoryos_gpu.store.rows import audit_owner, emb_blob

from .conflicts import fact_key
from .forget import Forgetting
from .heat import Heat
from .knowledge_ring import put_back, unsupersede
from .page_text import page_terms_of, page_text
from .state import EngineState
from .validation import MAX_ITEM_ID, InvalidInputError, _clean_text, clean_int, clean_user_id


class Items:
    """get/update/delete of pages and knowledge entries, export/delete of users."""

    def __init__(self, state: EngineState, heat: Heat) -> None:
        self._s = state
        self._heat = heat
        self._forget = Forgetting(state)

    # ---------------------------------------------------------------- pages
    def get_page(self, page_id: int) -> dict[str, Any] | None:
        return self._s.store.page_rows([page_id]).get(int(page_id))

    def list_pages(self, user_id: str, offset: int, limit: int) -> tuple[list[dict], int]:
        # cleaned as page ids are: a NumPy integer (a page count from an array) is taken as
        # the int it equals, and the bound is SQL's INTEGER (a larger one failed in the driver)
        offset = clean_int(offset, "offset", 0, MAX_ITEM_ID)
        limit = clean_int(limit, "limit", 1, MAX_ITEM_ID)
        if clean_user_id(user_id) not in self._s.users:
            raise UnknownUserError(f"unknown user {user_id!r}")
        return self._s.store.page_window(user_id, offset, limit)

    def update_page(
        self, page_id: int, *, user_input: str | None = None, agent_response: str | None = None
    ) -> dict[str, Any]:
        """Edit a page's text; its embedding (and its arena row, when in MTM) follow, and what
        was derived from its old text is re-derived (``Forgetting.rederive_edited``: its facts
        and profile values go and the page is re-analysed, so the next ``process_pending``
        brings back what the new text says). :class:`UnknownItemError` (a ``KeyError``) when
        there is no such page: a caller that checked it may have lost a race to its deletion."""
        s = self._s
        with s.locked():
            row = self.get_page(page_id)
            if row is None:
                raise UnknownItemError(f"no page {page_id}")
            new = {
                "user_input": _clean_text(user_input, "user_input")
                if user_input is not None
                else row["user_input"],
                "agent_response": _clean_text(agent_response, "agent_response")
                if agent_response is not None
                else row["agent_response"],
            }
            vec = encode_checked(s.embedder, [page_text({**row, **new}, s.memory.embed_dates)])[0]
            terms = page_terms_of(
                [(new["user_input"], new["agent_response"], row["timestamp"], row["extra"])]
            )
            old_terms = terms_from_blobs([s.store.page_terms([page_id]).get(page_id)])
            with s.store.transaction() as db:
                db.execute(
                    "UPDATE pages SET user_input = ?, agent_response = ? WHERE page_id = ?",
                    (new["user_input"], new["agent_response"], page_id),
                )
                db.execute(
                    "UPDATE page_vectors SET embedding = ?, terms = ? WHERE page_id = ?",
                    (emb_blob(vec), terms_to_blobs(terms)[0], page_id),
                )
                s.store.audit(
                    db,
                    row["user_id"],
                    "update",
                    "page",
                    page_id,
                    {"before": {k: row[k] for k in new}, "after": new},
                )
                redone = self._forget.rederive_edited(db, page_id)
            s.edits += 1  # a derived round that read this page re-checks it
            s.vocabulary.add([row["user_id"]], old_terms, sign=-1)
            s.vocabulary.add([row["user_id"]], terms)
            s.views.edit_page(page_id, new["user_input"], new["agent_response"])
            s.extractor.remove([f"{row['user_input']} {row['agent_response']}"])
            s.extractor.update([f"{new['user_input']} {new['agent_response']}"])
            slots = np.flatnonzero(s.page_of_slot == page_id)
            if slots.size:
                s.arena.write_page_embeddings(slots, vec[None])
                s.arena.write_terms(slots, *terms.columns())
            self._forget.apply(s.users.get(row["user_id"]), redone)
            return self.get_page(page_id)

    def delete_page(self, page_id: int) -> bool:
        """Remove a page from every tier and everything derived from it (forget.py)."""
        return self._forget.delete_page(page_id)

    # ---------------------------------------------------------------- knowledge
    def update_knowledge(self, entry_id: int, text: str) -> dict[str, Any]:
        """Edit a knowledge entry's text; its embedding (and its ring row, when live) follow.
        :class:`UnknownItemError` (a ``KeyError``) when there is no such entry (as for
        :meth:`update_page`)."""
        s = self._s
        text = _clean_text(text, "text")
        if not text.strip():  # a fact of no words: retrieved, embedded, conflict-keyed as one
            raise InvalidInputError("text is blank: delete the entry instead of blanking it")
        with s.locked():
            rows = s.store.knowledge_rows([entry_id])
            if entry_id not in rows:
                raise UnknownItemError(f"no knowledge entry {entry_id}")
            row = rows[entry_id]
            vec = encode_checked(s.embedder, [text])[0]
            key = fact_key(text)  # the attribute the conflict rule finds the entry by
            with s.store.transaction() as db:
                db.execute(
                    "UPDATE knowledge SET text = ?, embedding = ?, fact_key = ? WHERE entry_id = ?",
                    (text, emb_blob(vec), key[0] if key else None, entry_id),
                )
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
                s.views.knowledge[entry_id] = text
            return s.store.knowledge_rows([entry_id])[entry_id]

    def delete_knowledge(self, entry_id: int) -> bool:
        """Delete an entry (its text out of the audit too); the entry it superseded, if any, is
        live again (``knowledge_ring.unsupersede``). Once committed, memory follows before the
        log is truncated: the truncation may have to wait for readers (``store.checkpoint``
        retries it then), the entry must not be retrieved meanwhile."""
        s = self._s
        with s.locked():
            rows = s.store.knowledge_rows([entry_id])
            if entry_id not in rows:
                return False
            s.store.begin_erasure()
            with s.store.transaction() as db:
                restored = unsupersede(s, db, rows[entry_id])
                db.execute("DELETE FROM knowledge WHERE entry_id = ?", (entry_id,))
                db.execute(
                    "DELETE FROM provenance WHERE item_kind = 'knowledge' AND item_id = ?",
                    (entry_id,),
                )
                # the deletion is kept, the text is not (nor in the entry's earlier edits)
                db.execute(
                    "UPDATE audit SET detail = '{}' WHERE item_kind = 'knowledge' AND item_id = ?",
                    (entry_id,),
                )
                s.store.audit(db, _audit_owner(rows[entry_id]), "delete", "knowledge", entry_id)
            where = np.argwhere(s.entry_of_ring == entry_id)
            if where.size:
                s.arena.delete_knowledge(where[:, 0], where[:, 1])
                s.entry_of_ring[where[:, 0], where[:, 1]] = -1
            s.views.drop_knowledge([entry_id])
            put_back(s, restored)
            s.store.checkpoint()
            return True

    # ---------------------------------------------------------------- users
    def history(self, user_id: str) -> list[dict[str, Any]]:
        """Append-only audit of changes to the user's memory (a deleted user's too: its
        ``delete`` event; none for a user never seen)."""
        return self._s.store.history(clean_user_id(user_id))

    def export_user(self, user_id: str) -> dict[str, Any]:
        """Everything held about a user, derived profile and knowledge included (JSON-ready)."""
        s = self._s
        user_id = clean_user_id(user_id)
        with s.locked():
            self._heat.write_behind()
            data = s.store.export_user(user_id)
            if data is None:
                raise UnknownUserError(f"unknown user {user_id!r}")
            data["assistant_knowledge"] = s.store.owner_knowledge(
                "assistant", data["user"]["assistant_id"]
            )
            return data

    def delete_user(self, user_id: str) -> bool:
        """Remove every row and arena slot held about the user, and everything derived from
        the user's pages elsewhere (assistant knowledge, keyword statistics), and the user's
        rows of the rejects files ``memoryos-gpu ingest`` left in the store's folder (their
        records in plain text; :meth:`Forgetting.drop_rejects`)."""
        user_id = clean_user_id(user_id)
        s = self._s
        with s.locked():
            pages = s.store.query(
                "SELECT page_id, user_input || ' ' || agent_response FROM pages WHERE user_id = ?",
                (user_id,),
            )
            user = s.users.get(user_id)
            s.edits += 1
            s.views.drop_chains(s.views.drop_pages(p for p, _ in pages))  # all the user's
            s.profiles.pop(user_id, None)
            s.vocabulary.forget(user_id)
            if user is not None:
                s.views.drop_knowledge(int(e) for e in s.entry_of_ring[user.owner] if e >= 0)
                for slot in s.arena.live_segments(user.slot):
                    s.page_of_slot[s.arena.segment_pages(user.slot, int(slot))] = -1
                s.drop_user_state(user)  # segments, pages and their term rows, knowledge ring
                s.segment_of[user.slot] = -1
                s.entry_of_ring[user.owner] = -1
            forgotten = s.store.delete_user(user_id)
            if forgotten is None:
                return False
            s.extractor.remove(t for _, t in pages)
            self._forget.drop(forgotten)
        self._forget.drop_rejects(user_id)
        return True


def _audit_owner(row: dict[str, Any]) -> str:
    return audit_owner(row["owner_kind"], row["owner_id"])

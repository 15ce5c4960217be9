"""Assistant knowledge across shards: one writer per assistant, read replicas everywhere.

**Why.** Assistant knowledge is the one thing shared across users, hence across shards. Two
shards writing one assistant's ring would number its entries apart, so the rule is *one writer,
read replicas everywhere*. The writer of assistant ``A`` is its owner shard,
``shard_of(A, N)`` (:meth:`~memoryos_gpu.distributed.layout.ShardMap.assistant_owner`). A shard
never writes assistant facts itself: facts found by its promotions wait in its outbox; the
router (:meth:`~memoryos_gpu.distributed.sharding.ShardedEngine.sync_shards`, the Ray ingest
driver, the Serve ingress; :func:`route_assistant_facts`) hands each outbox to the owner, which
numbers the facts (``seq``, the ring position) and commits them
(:meth:`AssistantReplicas.append_assistant_facts`), then copies the numbered entries to every
other shard, which holds a read replica in its arena
(:meth:`AssistantReplicas.replicate_assistant_entries`; per-shard SQLite: rows with the same
``seq`` in its own file; a shared PostgreSQL store: re-read from the owner's rows).

Retrievals and responses therefore read assistant knowledge locally, with no cross-shard call
on the request path, and every shard sees the same entries once the router has synced. A
router whose call to an owner or a replica fails keeps the facts or entries owed and sends
them with its next exchange (a replica skips entries it holds already); a change across shards
delivers what is owed first. Facts still in an outbox when a shard dies, or owed by a router
that stops, are lost: they are derived data (the pages they came from are committed and are
re-promoted only if they were never marked analysed). A fact travels
with its provenance (source user, page ids), so deleting a user, or deleting or editing one of
its pages, reaches what those pages taught the assistants on every shard
(:mod:`~memoryos_gpu.distributed.sharded_forget`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memoryos_gpu.embed.base import encode_checked
from memoryos_gpu.engine.state import Fact

from . import sharded_forget
from .layout import ShardMap

__all__ = ["AssistantEntry", "AssistantReplicas", "route_assistant_facts"]


@dataclass(frozen=True)
class AssistantEntry:
    """An assistant-knowledge entry as numbered by its owner shard (``seq``: ring position);
    ``live`` False: the owner superseded it (replicas drop their copy)."""

    assistant_id: str
    seq: int
    text: str
    mode: str
    embedding: np.ndarray
    source_user: str | None = None
    live: bool = True


# ============================================================================ the shard's side
class AssistantReplicas:
    """The assistant-knowledge side of a shard engine (mixed into
    :class:`~memoryos_gpu.distributed.sharding.ShardEngine`, before ``MemoryEngine``): the outbox
    of the assistant facts its promotions find, the owner's commit of the facts it is sent, and
    the replica of every other owner's entries. Uses the engine's store, lock, arena and ring
    maps, and the shard engine's ``shared_store``."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._outbox: list[Fact] = []  # assistant facts for their owner shard
        super().__init__(*args, **kw)  # the engine (its promotions on open fill the outbox)

    # ------------------------------------------------------------------ outbox
    def _push_knowledge(self, db: Any, facts: list[Fact], emb: np.ndarray) -> None:
        """User facts go to the ring as usual; assistant facts wait in the outbox for the
        owner shard (module doc: one writer per assistant), with their provenance (source
        user, page ids, time). An LLM decision names an entry of this shard's replica, not
        the owner's: the owner's rule decides instead."""
        keep = [i for i, f in enumerate(facts) if f.kind == "user"]
        self._outbox.extend(Fact(*f[:7]) for f in facts if f.kind != "user")
        if keep:
            super()._push_knowledge(db, [facts[i] for i in keep], emb[keep])

    def take_assistant_facts(self) -> list[Fact]:
        """The assistant facts found since the last call (``Fact``: owner id = assistant)."""
        with self._lock:
            out, self._outbox = self._outbox, []
        return out

    def _drop_outbox_of(self, page_id: int) -> None:
        """Outbox facts derived from the page (not routed to their owner yet) go, as the
        owner's entries would; the other pages they came from are re-analysed."""
        row = self.get_page(page_id)
        if row is None:
            return
        uid = row["user_id"]
        hit = [f for f in self._outbox if f.source_user == uid and int(page_id) in f.pages]
        if not hit:
            return
        self._outbox = [f for f in self._outbox if f not in hit]
        again = {(int(p), uid) for f in hit for p in f.pages if int(p) != int(page_id)}
        sharded_forget.reanalyse_pages(self, sorted(again))

    # ------------------------------------------------------------------ owner
    def append_assistant_facts(self, facts: Sequence[Fact]) -> list[AssistantEntry]:
        """Owner side: commit facts of assistants this shard owns (provenance recorded as in
        one engine; the conflict rule may merge or supersede), and answer what changed in the
        rings for the replicas: the entries added, and those superseded (``live`` False)."""
        facts = [Fact(*f) for f in facts]  # over Ray: plain tuples are accepted too
        if not facts:
            return []
        with self._state.locked():  # touches the store: the rewrite gate first (engine/state.py)
            emb = encode_checked(self.embedder, [f.text for f in facts])
            # the rings change as the transaction goes (reloaded from the store if it fails);
            # committed under the lock this method holds (it answers what the rings hold)
            with self._state.write_transaction("commit") as db:
                self.store.ensure_assistants(db, (f.owner_id for f in facts), time.time())
                mark = db.execute("SELECT COALESCE(MAX(entry_id), 0) FROM knowledge").fetchone()
                # the engine's own ring write, not this class's outbox: this shard is the owner
                super()._push_knowledge(db, facts, emb)
                return self._ring_changes(db, int(mark[0]), {f.owner_id for f in facts})

    def _ring_changes(self, db: Any, mark: int, assistants: set[str]) -> list[AssistantEntry]:
        """The assistants' ring entries added after entry ``mark`` and those they superseded."""
        from memoryos_gpu.store.rows import blob_matrix

        ids = sorted(assistants)
        rows = db.execute(
            "SELECT owner_id, seq, text, mode, embedding, source_user, live FROM knowledge "
            f"WHERE owner_kind = 'assistant' AND owner_id IN ({','.join('?' * len(ids))}) AND "
            "seq >= 0 AND (entry_id > ? OR (live = 0 AND superseded_by > ?)) ORDER BY seq",
            (*ids, mark, mark),
        ).fetchall()
        vecs = blob_matrix([r[4] for r in rows], self.embedder.dim)
        return [
            AssistantEntry(r[0], int(r[1]), r[2], r[3], v, r[5], bool(r[6]))
            for r, v in zip(rows, vecs, strict=True)
        ]

    # ------------------------------------------------------------------ replica
    def replicate_assistant_entries(self, entries: Sequence[AssistantEntry]) -> None:
        """Replica side: hold the owner's numbered entries (same ring positions). Entries it
        holds already are skipped: a router sends entries again when it never heard that a
        copy succeeded (the reply lost), and a second row of one ring position would fail
        every later copy."""
        if not entries:
            return
        with self._state.locked():
            if self.shared_store:
                self._reload_assistants(sorted({e.assistant_id for e in entries}))
                return
            gone = [(e.assistant_id, e.seq) for e in entries if not e.live]
            held = self._held_entries(entries)
            # its ring rows change as it writes (reloaded from the store if it fails);
            # committed under the lock this method holds
            with self._state.write_transaction("commit") as db:
                self._write_replica(
                    db, [e for e in entries if e.live and (e.assistant_id, e.seq) not in held]
                )
            if gone:
                sharded_forget.drop_assistant_entries(self, gone, superseded=True)

    def _held_entries(self, entries: Sequence[AssistantEntry]) -> set[tuple[str, int]]:
        """The (assistant, seq) of ``entries`` this replica's store holds a row of (one query)."""
        ids = sorted({e.assistant_id for e in entries})
        rows = self.store.query(
            "SELECT owner_id, seq FROM knowledge WHERE owner_kind = 'assistant' AND "
            f"owner_id IN ({','.join('?' * len(ids))}) AND seq >= ?",
            (*ids, min(e.seq for e in entries)),
        )
        return {(r[0], int(r[1])) for r in rows}

    def _write_replica(self, db: Any, entries: Sequence[AssistantEntry]) -> None:
        cap = self.memory.knowledge_capacity
        t = time.time()
        self.store.ensure_assistants(db, (e.assistant_id for e in entries), time.time())
        for e in entries:
            slot = self._assistant_slot(e.assistant_id)
            db.execute(
                "UPDATE knowledge SET live = 0 WHERE owner_kind = 'assistant' AND "
                "owner_id = ? AND seq <= ?",
                (e.assistant_id, e.seq - cap),
            )
            (entry,) = self.store.new_ids(db, "knowledge", 1)
            db.execute(
                "INSERT INTO knowledge(entry_id, owner_kind, owner_id, seq, text, embedding, "
                "mode, created, source_user) VALUES (?, 'assistant', ?, ?, ?, ?, ?, ?, ?)",
                (
                    entry,
                    e.assistant_id,
                    e.seq,
                    e.text,
                    _emb_blob(e.embedding),
                    e.mode,
                    t,
                    e.source_user,
                ),
            )
            head = max(self.arena.ring_head(slot), e.seq + 1)
            db.execute(
                "UPDATE assistants SET knowledge_head = ? WHERE assistant_id = ?",
                (head, e.assistant_id),
            )
            self.arena.write_knowledge([slot], [e.seq % cap], e.embedding[None])
            self.arena.set_ring_head(slot, head)
            self._grow_maps()
            old = int(self._entry_of_ring[slot, e.seq % cap])
            if old >= 0:
                self._views.drop_knowledge([old])
            self._entry_of_ring[slot, e.seq % cap] = entry
            self._views.knowledge[entry] = e.text

    def _reload_assistants(self, assistant_ids: Sequence[str]) -> None:
        """Shared store: re-read assistants' live entries (written by their owner shard); the
        ring positions of entries no longer live there are cleared."""
        from memoryos_gpu.store.rows import blob_matrix

        cap = self.memory.knowledge_capacity
        for aid in assistant_ids:
            slot = self._assistant_slot(aid)
            rows = self.store.query(
                "SELECT entry_id, seq, embedding, text FROM knowledge "
                "WHERE owner_kind = 'assistant' AND owner_id = ? AND live = 1 ORDER BY seq",
                (aid,),
            )
            head = self.store.query(
                "SELECT knowledge_head FROM assistants WHERE assistant_id = ?", (aid,)
            )
            self._grow_maps()
            held = np.flatnonzero(self._entry_of_ring[slot] >= 0)
            self.arena.delete_knowledge(np.full(held.size, slot, np.int32), held)
            self._views.drop_knowledge(int(e) for e in self._entry_of_ring[slot, held])
            self._entry_of_ring[slot, held] = -1
            if not rows:
                continue
            ring = np.array([r[1] % cap for r in rows], np.int32)
            self.arena.write_knowledge(
                np.full(len(rows), slot, np.int32),
                ring,
                blob_matrix([r[2] for r in rows], self.embedder.dim),
            )
            self.arena.set_ring_head(slot, int(head[0][0]) if head else rows[-1][1] + 1)
            self._entry_of_ring[slot, ring] = [r[0] for r in rows]
            self._views.knowledge.update((r[0], r[3]) for r in rows)


def _emb_blob(vec: np.ndarray) -> bytes:
    from memoryos_gpu.store.rows import emb_blob

    return emb_blob(vec)


# ============================================================================ the router's side
def route_assistant_facts(
    facts: Sequence[Fact],
    shard_map: ShardMap,
    append: Callable[[int, list[Fact]], list[AssistantEntry]],
    replicate: Callable[[int, list[AssistantEntry]], None],
) -> int:
    """Send facts to their assistant's owner shard, then its numbered entries to every other
    shard (the module doc's rule). ``append(shard, facts)`` / ``replicate(shard, entries)`` do
    the calls (in process, or on Ray actors). Returns the entries written."""
    by_owner: dict[int, list[Fact]] = {}
    for f in facts:
        by_owner.setdefault(shard_map.assistant_owner(f[1]), []).append(f)
    written = 0
    for owner, owned in sorted(by_owner.items()):
        entries = append(owner, owned)
        written += len(entries)
        for j in range(shard_map.count):
            if j != owner:
                replicate(j, entries)
    return written

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

**The outbox is durable.** It is a table of the shard's store (``outbox``), written in the
transaction of the promotion that found the facts (which marks its pages analysed, so they are
never found again): facts held in the process's memory were lost for good when the shard or
the router stopped before the owner committed them. A router acknowledges a sender's facts
(:meth:`AssistantReplicas.ack_assistant_facts`: they leave the outbox) only once their owner
committed them and every replica copied the entries; a call that fails leaves them there, and
the next exchange sends them again. So a router keeps nothing owed in its memory, and an owner
may be sent a fact twice (its reply lost, a replica's copy failed): it keeps, per sender, the
newest fact id it committed (``outbox_marks``, in the same transaction), skips what it has,
and answers those facts' assistants' rings whole, so a replica that missed the entries gets
them (it skips those it holds).

Retrievals and responses therefore read assistant knowledge locally, with no cross-shard call
on the request path, and every shard sees the same entries once the router has synced. A fact
travels with its provenance (source user, page ids), so deleting a user, or deleting or editing
one of its pages, reaches what those pages taught the assistants on every shard
(:mod:`~memoryos_gpu.distributed.sharded_forget`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from memoryos_gpu.embed.base import encode_checked
from memoryos_gpu.engine.state import Fact

from . import sharded_forget
from .layout import ShardMap

__all__ = [
    "AssistantEntry",
    "AssistantReplicas",
    "OutboxFact",
    "by_owner",
    "outbox_facts",
    "outbox_upto",
    "route_assistant_facts",
]


class OutboxFact(NamedTuple):
    """An assistant fact from a shard's outbox: the shard it waits in (``sender``), its id
    there (increasing: what the owner's mark and the sender's acknowledgement count) and the
    fact (with its provenance)."""

    sender: int
    fact_id: int
    fact: Fact


def outbox_facts(sent: Iterable[Sequence[Any]]) -> list[OutboxFact]:
    """``sent`` as :class:`OutboxFact`s (over Ray or the engines' pipe they may come as plain
    tuples)."""
    return [OutboxFact(int(s), int(i), Fact(*f)) for s, i, f in sent]


def by_owner(sent: Iterable[OutboxFact], shard_map: ShardMap) -> dict[int, list[OutboxFact]]:
    """The facts of ``sent`` by their assistant's owner shard, in the order sent."""
    out: dict[int, list[OutboxFact]] = {}
    for s in sent:
        out.setdefault(shard_map.assistant_owner(s.fact.owner_id), []).append(s)
    return out


def outbox_upto(sent: Iterable[OutboxFact]) -> dict[int, int]:
    """The newest fact id of each sender among ``sent``: what acknowledges them."""
    upto: dict[int, int] = {}
    for s in sent:
        upto[s.sender] = max(upto.get(s.sender, 0), s.fact_id)
    return upto


def _fact_json(f: Fact) -> str:
    """A fact as an outbox row's ``fact`` (its source user is the row's own column)."""
    return json.dumps([f.kind, f.owner_id, f.text, f.mode, list(f.pages), f.valid_from])


def _fact_of(source_user: str | None, text: str) -> Fact:
    kind, owner, said, mode, pages, valid_from = json.loads(text)
    return Fact(kind, owner, said, mode, tuple(int(p) for p in pages), source_user, valid_from)


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

    # ------------------------------------------------------------------ outbox
    def _push_knowledge(self, db: Any, facts: list[Fact], emb: np.ndarray) -> None:
        """User facts go to the ring as usual; assistant facts wait in the outbox for the
        owner shard (module doc: one writer per assistant), with their provenance (source
        user, page ids, time), written in the promotion's transaction ``db``. An LLM decision
        names an entry of this shard's replica, not the owner's: the owner's rule decides
        instead."""
        keep = [i for i, f in enumerate(facts) if f.kind == "user"]
        sent = [f for f in facts if f.kind != "user"]
        if sent:
            ids = self.store.new_ids(db, "outbox", len(sent))
            db.executemany(
                "INSERT INTO outbox(fact_id, sender, source_user, fact) VALUES (?, ?, ?, ?)",
                [
                    (i, self.shard_index, f.source_user, _fact_json(f))
                    for i, f in zip(ids, sent, strict=True)
                ],
            )
        if keep:
            super()._push_knowledge(db, [facts[i] for i in keep], emb[keep])

    def take_assistant_facts(self) -> list[OutboxFact]:
        """The assistant facts waiting in this shard's outbox, oldest first. They stay there
        until :meth:`ack_assistant_facts` says their owners committed them: each sync takes
        them again until then."""
        rows = self.store.query(
            "SELECT fact_id, source_user, fact FROM outbox WHERE sender = ? ORDER BY fact_id",
            (self.shard_index,),
        )
        return [OutboxFact(self.shard_index, int(i), _fact_of(u, t)) for i, u, t in rows]

    def ack_assistant_facts(self, upto: int) -> int:
        """The outbox's facts up to id ``upto`` go: their owners committed them (a router's
        acknowledgement). Returns how many went."""
        # touches the store: the rewrite gate first (engine/state.py)
        with self._state.locked(), self._state.write_transaction("commit") as db:
            cur = db.execute(
                "DELETE FROM outbox WHERE sender = ? AND fact_id <= ?",
                (self.shard_index, int(upto)),
            )
            return max(int(cur.rowcount), 0)

    def _drop_outbox_of(self, page_id: int) -> None:
        """Outbox facts derived from the page (not routed to their owner yet) go, as the
        owner's entries would; the other pages they came from are re-analysed. Called under
        the engine lock (``_state.locked()``)."""
        row = self.get_page(page_id)
        if row is None:
            return
        uid = row["user_id"]
        rows = self.store.query(
            "SELECT fact_id, fact FROM outbox WHERE sender = ? AND source_user = ?",
            (self.shard_index, uid),
        )
        facts = [(int(i), _fact_of(uid, t)) for i, t in rows]
        hit = [(i, f) for i, f in facts if page_id in f.pages]
        if not hit:
            return
        with self._state.write_transaction("commit") as db:
            db.executemany("DELETE FROM outbox WHERE fact_id = ?", [(i,) for i, _ in hit])
        again = {(int(p), uid) for _, f in hit for p in f.pages if int(p) != int(page_id)}
        sharded_forget.reanalyse_pages(self, sorted(again))

    # ------------------------------------------------------------------ owner
    def append_assistant_facts(self, sent: Sequence[OutboxFact]) -> list[AssistantEntry]:
        """Owner side: commit facts of assistants this shard owns (provenance recorded as in
        one engine; the conflict rule may merge or supersede), and answer what changed in the
        rings for the replicas: the entries added, and those superseded (``live`` False).

        A fact committed before (per sender, ids up to the mark ``outbox_marks`` keeps) is
        skipped: it comes again when the reply to its first sending was lost, or its sender
        was down when the router acknowledged it. The rings of such facts' assistants are
        then answered whole, since the replicas may never have had their entries (a replica
        skips the entries it holds)."""
        sent = outbox_facts(sent)
        if not sent:
            return []
        with self._state.locked():  # touches the store: the rewrite gate first (engine/state.py)
            fresh = self._unseen(sent)
            again = {s.fact.owner_id for s in set(sent).difference(fresh)}
            facts = [s.fact for s in fresh]
            emb = encode_checked(self.embedder, [f.text for f in facts]) if facts else None
            # the rings change as the transaction goes (reloaded from the store if it fails);
            # committed under the lock this method holds (it answers what the rings hold)
            with self._state.write_transaction("commit") as db:
                mark = db.execute("SELECT COALESCE(MAX(entry_id), 0) FROM knowledge").fetchone()
                if facts:
                    self.store.ensure_assistants(db, (f.owner_id for f in facts), time.time())
                    # the engine's own ring write, not this class's outbox: this is the owner
                    super()._push_knowledge(db, facts, emb)
                    self._raise_marks(db, fresh)
                new = {f.owner_id for f in facts} - again
                return self._ring_changes(db, int(mark[0]), new) + self._ring_changes(db, 0, again)

    def _unseen(self, sent: Sequence[OutboxFact]) -> list[OutboxFact]:
        """The facts of ``sent`` this owner has not committed (above its sender's mark), each
        once."""
        senders = sorted({s.sender for s in sent})
        rows = self.store.query(
            f"SELECT sender, upto FROM outbox_marks WHERE owner = ? AND sender IN "
            f"({','.join('?' * len(senders))})",
            (self.shard_index, *senders),
        )
        marks = {int(r[0]): int(r[1]) for r in rows}
        out: dict[tuple[int, int], OutboxFact] = {}
        for s in sent:
            if s.fact_id > marks.get(s.sender, 0):
                out.setdefault((s.sender, s.fact_id), s)
        return sorted(out.values(), key=lambda s: (s.sender, s.fact_id))

    def _raise_marks(self, db: Any, fresh: Sequence[OutboxFact]) -> None:
        """The owner's mark of each sender of ``fresh``: the newest fact id it committed."""
        db.executemany(
            "INSERT INTO outbox_marks(owner, sender, upto) VALUES (?, ?, ?) "
            "ON CONFLICT(owner, sender) DO UPDATE SET upto = excluded.upto",
            [(self.shard_index, sender, upto) for sender, upto in outbox_upto(fresh).items()],
        )

    def _ring_changes(self, db: Any, mark: int, assistants: set[str]) -> list[AssistantEntry]:
        """The assistants' ring entries added after entry ``mark`` and those they superseded."""
        from memoryos_gpu.store.rows import blob_matrix

        if not assistants:
            return []
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
    sent: Sequence[OutboxFact],
    shard_map: ShardMap,
    append: Callable[[int, list[OutboxFact]], list[AssistantEntry]],
    replicate: Callable[[int, list[AssistantEntry]], None],
    ack: Callable[[int, int], Any],
) -> int:
    """Send outbox facts to their assistant's owner shard, then its numbered entries to every
    other shard (the module doc's rule), then acknowledge them to their senders, which drop
    them from their outboxes. ``append(shard, facts)`` / ``replicate(shard, entries)`` /
    ``ack(sender, upto)`` do the calls (in process, or on Ray actors); a call that raises
    stops the routing before any acknowledgement, so the facts stay in their outboxes for the
    next exchange (an owner skips what it committed). Returns the entries written."""
    written = 0
    for owner, owned in sorted(by_owner(sent, shard_map).items()):
        entries = append(owner, owned)
        written += len(entries)
        for j in range(shard_map.count):
            if j != owner:
                replicate(j, entries)
    for sender, upto in sorted(outbox_upto(sent).items()):
        ack(sender, upto)
    return written

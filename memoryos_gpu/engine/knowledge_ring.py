"""One promotion transaction's writes to the knowledge rings: add, strengthen, supersede.

:meth:`LongTerm.push_knowledge <memoryos_gpu.engine.lpm.LongTerm.push_knowledge>` decides what
each fact does (:meth:`KnowledgeRing.decide`, the rule in :mod:`~memoryos_gpu.engine.conflicts`
or the LLM's decisions) and calls :meth:`add_all`, :meth:`strengthen`, :meth:`supersede` and
:meth:`add_outdated`; the new entries are inserted together (:meth:`add_all`: one ``executemany``
with ids from ``store.new_ids``), the rarer strengthen / supersede / outdated rows one by one,
in the open transaction;
the arena's ring rows, the provenance rows and the ring heads once per batch in
:meth:`finish` (one arena push, one ``executemany``), so a batch of plain additions costs a
few statements however many facts it holds.

:func:`unsupersede` and :func:`put_back` undo a supersession when the newer entry is deleted by
hand (``delete_knowledge``): the value it replaced is the attribute's current value again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from memoryos_gpu import ops
from memoryos_gpu.store.derivations import KNOWLEDGE, record
from memoryos_gpu.store.rows import audit_owner, blob_matrix, emb_blob, emb_blobs

from .conflicts import Decision, LiveEntry, decide, fact_key
from .state import EngineState, Fact, to_host


class KnowledgeRing:
    """The writes of one batch of facts (see the module docstring)."""

    def __init__(self, state: EngineState, db: Any) -> None:
        self._s = state
        self._db = db
        self._heads: dict[int, int] = {}  # owner slot -> next seq
        self._pushed: list[tuple[int, int, np.ndarray, str]] = []  # (owner, entry, vec, text)
        self._sources: list[tuple[int, str, tuple[int, ...], str]] = []
        self._superseded: list[tuple[int, int]] = []  # (owner slot, entry)
        self._events: list[tuple[tuple[str, str, str, int], dict[str, Any]]] = []  # audit
        self._owners: dict[tuple[str, str], int] = {}

    # ---------------------------------------------------------------- deciding
    def owner_slot(self, kind: str, owner_id: str) -> int:
        key = (kind, owner_id)
        if key not in self._owners:
            s = self._s
            self._owners[key] = (
                s.users[owner_id].owner if kind == "user" else s.assistant_slot(owner_id)
            )
        return self._owners[key]

    def decide(self, facts: list[Fact], emb: np.ndarray) -> tuple[list[int], list[Decision]]:
        """The order to apply the facts in (by the time they were said) and each fact's
        decision: the LLM's where it gave one (an update or ignore of an entry that is not
        live in the fact owner's ring becomes an add), else the rule's."""
        s = self._s
        if not facts:
            return [], []
        now = time.time()
        times = [f.valid_from if f.valid_from is not None else now for f in facts]
        order = sorted(range(len(facts)), key=times.__getitem__)  # stable: batch order on ties
        facts = [facts[i] for i in order]
        emb = emb[order]
        owners = [self.owner_slot(f.kind, f.owner_id) for f in facts]
        scores, slots = ops.knowledge_topk(s.arena, emb, np.asarray(owners, np.int32), 1)
        scores, slots = to_host(scores)[:, 0], to_host(slots)[:, 0]
        nearest = [
            (int(s.entry_of_ring[o, r]) if r >= 0 else -1, float(c))
            for o, r, c in zip(owners, slots, scores, strict=True)
        ]
        keys = [fact_key(f.text) for f in facts]
        rule = decide(
            owners,
            keys,
            [times[i] for i in order],
            nearest,
            self._live_keyed(facts, keys, [e for e, _ in nearest if e >= 0]),
            _same_batch(owners, emb, s.memory.fact_duplicate_cos),
            s.memory.fact_duplicate_cos,
        )
        # back to the batch's indices: targets -(j + 1) name the j-th fact of the batch
        decided: list[Decision] = [Decision("add")] * len(order)
        self._keys = [None] * len(order)
        for pos, i in enumerate(order):
            d = (
                rule[pos]
                if facts[pos].decision is None
                else self._llm(facts[pos].decision, owners[pos])
            )
            if d.target is not None and d.target < 0:
                d = Decision(d.action, -(order[-d.target - 1] + 1))
            decided[i] = d
            self._keys[i] = keys[pos]
        return order, decided

    def _llm(self, decision: tuple[str, int | None], owner: int) -> Decision:
        action, target = decision
        live = target is not None and bool((self._s.entry_of_ring[owner] == target).any())
        if action == "update" and live:
            return Decision("supersede", target)
        if action == "ignore" and live:
            return Decision("merge", target)
        return Decision("add")

    def _live_keyed(
        self, facts: list[Fact], keys: list[tuple[str, str] | None], nearest: list[int]
    ) -> dict[int, LiveEntry]:
        """The owners' entries (live or superseded history) that state an attribute one of
        the facts states, and the nearest entries (a few queries): what the rule compares
        against. Only the batch's attributes are read: an attribute no fact states takes no
        part in the rule, and reading every keyed entry of an assistant shared by many users
        cost each promotion batch time in proportion to all it had ever learned."""
        near = sorted(set(nearest))
        rows: list[tuple] = []
        cols = "SELECT entry_id, owner_kind, owner_id, text, COALESCE(valid_from, created), live "
        for kind in ("user", "assistant"):  # (owner_kind, owner_id): the knowledge_live index
            owner_ids = sorted(
                {f.owner_id for f, k in zip(facts, keys, strict=True) if k and f.kind == kind}
            )
            attrs = sorted({k[0] for f, k in zip(facts, keys, strict=True) if k and f.kind == kind})
            for i in range(0, len(owner_ids), 500):  # bounded IN lists, whatever the batch
                chunk = owner_ids[i : i + 500]
                rows += self._db.execute(
                    f"{cols}FROM knowledge WHERE owner_kind = ? AND owner_id IN "
                    f"({','.join('?' * len(chunk))}) AND fact_key IN "
                    f"({','.join('?' * len(attrs))}) AND (live = 1 OR superseded_by IS NOT NULL)",
                    [kind, *chunk, *attrs],
                ).fetchall()
        for i in range(0, len(near), 500):
            chunk = near[i : i + 500]
            rows += self._db.execute(
                f"{cols}FROM knowledge WHERE live = 1 AND entry_id IN "
                f"({','.join('?' * len(chunk))})",
                chunk,
            ).fetchall()
        out: dict[int, LiveEntry] = {}
        for eid, kind, owner_id, text, since, live in rows:
            if kind == "user" and owner_id not in self._s.users:
                continue
            slot = self.owner_slot(kind, owner_id)
            out[int(eid)] = LiveEntry(slot, fact_key(text), since, bool(live))
        return out

    # ---------------------------------------------------------------- writing
    def add_all(self, adds: list[tuple[int, Fact, np.ndarray]]) -> dict[int, int]:
        """New entries, each at its ring's next ``seq`` (in the order given), in a few
        statements for the batch; returns each fact index's entry id (the arena rows follow
        in :meth:`finish`). The entries a ring's new ``seq``s push past its capacity stop
        being live."""
        s, db = self._s, self._db
        t = time.time()
        rows, spans, owners = [], {}, []  # spans: (owner kind, id) -> (first, last) new seq
        blobs = emb_blobs([vec for _, _, vec in adds])
        for (index, fact, _), blob in zip(adds, blobs, strict=True):
            o = self.owner_slot(fact.kind, fact.owner_id)
            owners.append(o)
            seq = self._heads.setdefault(o, s.arena.ring_head(o))
            self._heads[o] = seq + 1
            owner = (fact.kind, fact.owner_id)
            spans[owner] = (spans.get(owner, (seq, seq))[0], seq)
            key = self._keys[index]
            valid_from = fact.valid_from if fact.valid_from is not None else t
            rows.append(
                (
                    *(fact.kind, fact.owner_id, seq, fact.text, blob, fact.mode, t),
                    *(fact.source_user, valid_from, key[0] if key else None),
                )
            )
        ids = s.store.new_ids(db, "knowledge", len(rows))
        db.executemany(
            "INSERT INTO knowledge(entry_id, owner_kind, owner_id, seq, text, embedding, mode, "
            "created, source_user, valid_from, fact_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(e, *row) for e, row in zip(ids, rows, strict=True)],
        )
        # the new seqs first..last push seqs first - cap..last - cap out of the ring (the
        # older ones went before): a range of the unique index, not the owner's whole history;
        # none while the ring has not wrapped (a negative seq is history, never live)
        cap = s.memory.knowledge_capacity
        db.executemany(
            "UPDATE knowledge SET live = 0 WHERE owner_kind = ? AND owner_id = ? AND seq >= ? "
            "AND seq <= ? AND live = 1",
            [
                (kind, o, first - cap, last - cap)
                for (kind, o), (first, last) in spans.items()
                if last >= cap
            ],
        )
        made = {}
        for (index, fact, vec), entry, o in zip(adds, ids, owners, strict=True):
            made[index] = entry
            self._pushed.append((o, entry, vec, fact.text))
            self._source(entry, fact)
        return made

    def add_outdated(
        self, fact: Fact, vec: np.ndarray, index: int, newer: int, before: int | None
    ) -> int:
        """A fact said before ``newer`` (a later value of its attribute): kept as history (not
        live, superseded by ``newer``), ending ``before`` (the value that held until it
        was said) when there is one; outside the ring (a negative ``seq``, so ring positions
        stay the arena's)."""
        db = self._db
        low = db.execute(
            "SELECT COALESCE(MIN(seq), 0) FROM knowledge WHERE owner_kind = ? AND owner_id = ? "
            "AND seq < 0",
            (fact.kind, fact.owner_id),
        ).fetchone()[0]
        until = db.execute(
            "SELECT COALESCE(valid_from, created) FROM knowledge WHERE entry_id = ?", (int(newer),)
        ).fetchone()[0]
        key = self._keys[index]
        t = time.time()
        (entry,) = self._s.store.new_ids(db, "knowledge", 1)
        db.execute(
            "INSERT INTO knowledge(entry_id, owner_kind, owner_id, seq, text, embedding, live, "
            "mode, created, source_user, valid_from, valid_to, superseded_by, fact_key) "
            "VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?)",
            (
                entry,
                fact.kind,
                fact.owner_id,
                int(low) - 1,
                fact.text,
                emb_blob(vec),
                fact.mode,
                t,
                fact.source_user,
                fact.valid_from if fact.valid_from is not None else t,
                until,
                int(newer),
                key[0] if key else None,
            ),
        )
        self._source(entry, fact)
        if before is not None:
            db.execute(
                "UPDATE knowledge SET valid_to = ?, superseded_by = ? WHERE entry_id = ?",
                (fact.valid_from, entry, int(before)),
            )
        return entry

    def strengthen(self, entry: int, fact: Fact) -> None:
        """The same fact again: the entry's ``strength`` grows and it gains the new sources."""
        self._db.execute(
            "UPDATE knowledge SET strength = strength + 1 WHERE entry_id = ?", (int(entry),)
        )
        self._source(int(entry), fact)

    def supersede(self, old: int, new: int, fact: Fact) -> None:
        """``new`` contradicts ``old``: ``old`` stops being live, valid until ``new`` began."""
        at = fact.valid_from if fact.valid_from is not None else time.time()
        self._db.execute(
            "UPDATE knowledge SET live = 0, valid_to = ?, superseded_by = ? WHERE entry_id = ?",
            (at, int(new), int(old)),
        )
        owner = audit_owner(fact.kind, fact.owner_id)
        self._events.append(((owner, "supersede", "knowledge", int(old)), {"by": int(new)}))
        self._superseded.append((self.owner_slot(fact.kind, fact.owner_id), int(old)))

    def _source(self, entry: int, fact: Fact) -> None:
        if fact.pages and self._s.memory.provenance:
            self._sources.append((entry, "", fact.pages, fact.source_user or fact.owner_id))

    def finish(self) -> None:
        """The batch's audit events (one call: each took three statements for its id), arena
        ring rows (one push), provenance rows, ring heads, and the superseded entries out of
        the rings."""
        s, db = self._s, self._db
        if self._events:
            events, details = zip(*self._events, strict=True)
            s.store.audit_many(db, list(events), list(details))
        record(db, KNOWLEDGE, self._sources)
        if self._pushed:
            owners, entries, vecs, texts = zip(*self._pushed, strict=True)
            owners = np.array(owners, np.int32)
            ring = s.arena.push_knowledge(owners, np.asarray(vecs, np.float32))
            s.grow_maps()
            # the FIFO drops what held each slot: entries from before the batch, and the
            # batch's own when it wrapped a ring (the last write of a slot stays)
            slot = owners.astype(np.int64) * s.entry_of_ring.shape[1] + ring
            last = np.unique(slot[::-1], return_index=True)[1]
            keep = np.zeros(slot.size, bool)
            keep[slot.size - 1 - last] = True
            before = s.entry_of_ring[owners[keep], ring[keep]]
            dropped = [*before[before >= 0].tolist(), *np.asarray(entries)[~keep].tolist()]
            s.views.drop_knowledge(dropped)
            s.entry_of_ring[owners[keep], ring[keep]] = np.asarray(entries)[keep]
            s.views.knowledge.update(
                (e, t) for e, t, k in zip(entries, texts, keep.tolist(), strict=True) if k
            )
        for kind, table, key in (
            ("user", "users", "user_id"),
            ("assistant", "assistants", "assistant_id"),
        ):
            db.executemany(
                f"UPDATE {table} SET knowledge_head = ? WHERE {key} = ?",
                [
                    (self._heads[o], owner_id)
                    for (k, owner_id), o in self._owners.items()
                    if k == kind and o in self._heads
                ],
            )
        for o, entry in self._superseded:
            at = np.flatnonzero(s.entry_of_ring[o] == entry)
            s.arena.delete_knowledge(np.full(at.size, o), at)
            s.entry_of_ring[o, at] = -1
            s.views.drop_knowledge([entry])


#: Groups of at most this many facts are scored pair by pair, all groups' pairs in one
#: vectorised pass; a larger group (an assistant shared by the round's users) gets a matrix
#: product of its own (its pairs grow with the square of the round).
_PAIRED_GROUP = 64


def _same_batch(
    owners: list[int], emb: np.ndarray, threshold: float
) -> list[list[tuple[int, float]]]:
    """For each fact, (j, cosine) of the earlier facts j of the same owner in the batch whose
    cosine reaches ``threshold``, j ascending: the only ones the rule can merge into.

    A round's facts belong to hundreds of users, each with a handful: their pairs are
    gathered and scored in one pass (a product per group, or per padded size class, cost
    ~1 ms a round in NumPy's small stacked products). Python sees the pairs that pass, not
    every pair."""
    out: list[list[tuple[int, float]]] = [[] for _ in owners]
    if len(owners) < 2:
        return out
    # float64 sums (float32 ones wobble at 1e-7, past the rounding below) of the rows as given
    emb = np.asarray(emb)
    norm = np.maximum(np.sqrt(np.einsum("ij,ij->i", emb, emb, dtype=np.float64)), 1e-12)
    owner_of = np.asarray(owners, np.int64)
    by_owner = np.argsort(owner_of, kind="stable")  # each group ascending
    sorted_owners = owner_of[by_owner]
    starts = np.flatnonzero(np.concatenate(([True], sorted_owners[1:] != sorted_owners[:-1])))
    sizes = np.diff(starts, append=len(owners))
    a, b, cos = _small_group_pairs(emb, norm, by_owner, starts, sizes)
    for g in np.flatnonzero(sizes > _PAIRED_GROUP).tolist():
        members = by_owner[starts[g] : starts[g] + sizes[g]]
        unit = emb[members].astype(np.float64) / norm[members, None]
        sims = unit @ unit.T
        i, j = np.nonzero(np.tril(sims >= threshold, -1))  # row-major: each i's j ascending
        a, b = np.concatenate([a, members[i]]), np.concatenate([b, members[j]])
        cos = np.concatenate([cos, sims[i, j]])
    keep = np.flatnonzero(cos >= threshold)
    # to 12 places: a product's blocking moves the last bits, and copies of one fact must tie
    # (the rule takes the earliest of equal cosines) wherever they sit in it
    cos = np.round(cos[keep], 12)
    for i, j, c in zip(a[keep].tolist(), b[keep].tolist(), cos.tolist(), strict=True):
        out[i].append((j, c))
    return out


def _small_group_pairs(
    emb: np.ndarray, norm: np.ndarray, by_owner: np.ndarray, starts: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i, j, cosine) of every pair j < i within the groups of at most :data:`_PAIRED_GROUP`
    facts (``by_owner``: the facts sorted by owner, each group ascending, starting at
    ``starts`` with ``sizes``), each i's j ascending. ``emb``: the rows (an embedder's float32),
    ``norm`` their float64 norms; each dot product is summed in float64 from the rows as they
    are (float64 copies of the gathered pairs cost 2.6x as much, their passes memory-bound)."""
    rank = np.arange(by_owner.size) - np.repeat(starts, sizes)  # position within its group
    at = np.flatnonzero(np.repeat(sizes <= _PAIRED_GROUP, sizes) & (rank > 0))
    r = rank[at]  # the earlier facts of each: r of them, right before it
    first = np.cumsum(r) - r
    a = by_owner[np.repeat(at, r)]
    b = by_owner[np.repeat(at - r, r) + np.arange(int(r.sum())) - np.repeat(first, r)]
    return a, b, np.einsum("ij,ij->i", emb[a], emb[b], dtype=np.float64) / (norm[a] * norm[b])


@dataclass(frozen=True)
class Restored:
    """An entry live again after the one that superseded it was deleted by hand: where it goes
    in its owner's ring (``head``: the ring's write position afterwards)."""

    entry: int
    owner: int
    ring: int
    head: int
    text: str
    vec: np.ndarray


def unsupersede(state: EngineState, db: Any, gone: dict[str, Any]) -> Restored | None:
    """The entries a deleted entry ``gone`` (a ``knowledge_rows`` row) had superseded, in the
    open transaction: the attribute's timeline closes over the gap.

    - ``gone`` was itself superseded: they are superseded by its successor now (valid until it
      began);
    - ``gone`` was live: the newest of them (by ``valid_from``) is live again -- ``valid_to``
      and ``superseded_by`` cleared, back in its ring slot when the FIFO still holds that
      position, else at the ring's head like a new entry (a late-arrived statement has no
      position) -- and the others are superseded by it; an audit event ``restore`` says so;
    - ``gone`` had left the ring by the FIFO: they only lose the link to it.

    Returns the entry to put back into the arena after the commit (:func:`put_back`)."""
    eid = int(gone["entry_id"])
    older = db.execute(
        "SELECT entry_id, seq, embedding, text FROM knowledge WHERE superseded_by = ? "
        "ORDER BY COALESCE(valid_from, created) DESC, entry_id DESC",
        (eid,),
    ).fetchall()
    if not older:
        return None
    if gone["superseded_by"] is not None:
        db.execute(
            "UPDATE knowledge SET superseded_by = ?, valid_to = ? WHERE superseded_by = ?",
            (gone["superseded_by"], gone["valid_to"], eid),
        )
        return None
    if not gone["live"]:  # their validity still ended when it began
        db.execute("UPDATE knowledge SET superseded_by = NULL WHERE superseded_by = ?", (eid,))
        return None
    (back, seq, blob, text), rest = older[0], older[1:]
    kind, owner_id = gone["owner_kind"], gone["owner_id"]
    o = state.users[owner_id].owner if kind == "user" else state.assistant_slot(owner_id)
    cap, head = state.memory.knowledge_capacity, state.arena.ring_head(o)
    if not (seq >= 0 and seq > head - cap and state.entry_of_ring[o, seq % cap] < 0):
        seq, head = head, head + 1  # a new position at the head, as an add would take
        db.execute(
            "UPDATE knowledge SET live = 0 WHERE owner_kind = ? AND owner_id = ? AND seq = ?",
            (kind, owner_id, seq - cap),  # the one position the new head pushes out
        )
        table, key = ("users", "user_id") if kind == "user" else ("assistants", "assistant_id")
        db.execute(f"UPDATE {table} SET knowledge_head = ? WHERE {key} = ?", (head, owner_id))
    db.execute(
        "UPDATE knowledge SET live = 1, seq = ?, valid_to = NULL, superseded_by = NULL "
        "WHERE entry_id = ?",
        (seq, int(back)),
    )
    db.executemany(
        "UPDATE knowledge SET superseded_by = ? WHERE entry_id = ?",
        [(int(back), int(r[0])) for r in rest],
    )
    owner = audit_owner(kind, owner_id)
    state.store.audit(db, owner, "restore", "knowledge", int(back), {"after_delete": eid})
    vec = blob_matrix([blob], state.embedder.dim)[0]
    return Restored(int(back), o, seq % cap, head, text, vec)


def put_back(state: EngineState, restored: Restored | None) -> None:
    """The arena side of :func:`unsupersede`, once committed: the entry in its ring slot (the
    entry the FIFO dropped from that slot, if any, out of the views)."""
    if restored is None:
        return
    s, r = state, restored
    s.arena.write_knowledge([r.owner], [r.ring], r.vec[None])
    s.arena.set_ring_head(r.owner, max(r.head, s.arena.ring_head(r.owner)))
    dropped = int(s.entry_of_ring[r.owner, r.ring])
    if dropped >= 0:
        s.views.drop_knowledge([dropped])
    s.entry_of_ring[r.owner, r.ring] = r.entry
    s.views.knowledge[r.entry] = r.text

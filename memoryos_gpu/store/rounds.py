"""The order of a derived-work round: waves of users' pending items, tenants in turn.

:meth:`~memoryos_gpu.store.reads.StoreReads.pending_items` reads the pending items of a kind
in queue order; :class:`PendingQueue` hands out their rounds (its docstring has the order;
``tests/rounds_reference.py`` states it as array sorts, the reference it is tested against).
The order is computed in Python rather than by the database: as two SQL window functions and a
sort, SQLite took ~1 ms for a round read of 330 items (~3 us an item: a derived round's largest
statement at ingestion), where the plain read takes ~0.18 ms.

A drain (``process_pending`` until the queue is empty) reads the queue once into a
:class:`PendingQueue`, which hands out the same rounds from memory: reading the whole queue for
each round made a drain quadratic in its backlog (a deferred backlog of 93,000 pages: 150-200 ms
of reading a round of 256 pages, whose own work takes ~35 ms).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence

__all__ = ["PendingQueue", "tenant_of"]


def tenant_of(user_id: str) -> str:
    """The tenant a stored user id belongs to: its ``tenant/`` prefix ("" without one, as in
    the server's open mode and for library callers). The server's write queue and a round's
    turns both go by it."""
    head, sep, _ = user_id.partition("/")
    return head if sep else ""


Item = tuple[int, str, int]  # a pending row: (work id, user id, ref), as the store lists it


class PendingQueue:
    """A kind's pending items, read once, handing out their rounds at O(round * log users) a
    round instead of a pass over the whole queue.

    A round is the oldest ``per_user`` items of each user, at most ``limit``, in *waves*
    (every user's oldest item, then every user's second oldest, ...: a user's items stay in
    order, and a user with a long backlog does not push another user's one page into later
    rounds); within a wave the tenants take turns (the oldest item of every tenant, then the
    second oldest of each, ...; :func:`tenant_of`: a tenant with a thousand users pending does
    not push another tenant's one page into later rounds), ties in queue order
    (``tests/rounds_reference.py`` states the same as array sorts).

    Each user's items wait in a deque (queue order); each tenant's users in a heap keyed by
    their oldest item's work id; the tenants in a heap keyed by their oldest user's (entries
    go stale as users are taken: an entry is used only while it names its tenant's current
    oldest item). Wave 0 of a round is turns over the tenants (each tenant's oldest user, in
    queue order; then each one's next ...); later waves exist only when wave 0 held every
    user, so they are computed over the round's own users.

    The holder keeps it only while nothing but its own rounds changes the store's queue, and
    reports each round applied whole (:meth:`done`); any other outcome means reading the
    queue again (``DerivedWork`` does both)."""

    def __init__(self, items: Iterable[Item]) -> None:
        self._items: dict[str, deque[Item]] = {}
        for it in items:  # queue order: each deque oldest first
            self._items.setdefault(it[1], deque()).append(it)
        self._users: dict[str, list[tuple[int, str]]] = {}  # tenant -> heap (head id, user)
        for user, queue in self._items.items():
            self._users.setdefault(tenant_of(user), []).append((queue[0][0], user))
        self._tenants: list[tuple[int, str]] = []  # heap (tenant's oldest head id, tenant)
        for tenant, heap in self._users.items():
            heapq.heapify(heap)
            self._tenants.append((heap[0][0], tenant))
        heapq.heapify(self._tenants)
        self._out: list[str] = []  # the users of the round handed out, until done()

    def __bool__(self) -> bool:
        return bool(self._items)

    def next_round(self, limit: int, per_user: int) -> list[Item]:
        """The next round over the items left: at most ``limit`` items, at most ``per_user``
        of each user, in the order above. Call :meth:`done` after it was applied whole."""
        if limit <= 0 or per_user <= 0 or not self._items:
            return []
        users = self._first_wave(limit)
        self._out = users
        out = [self._items[u][0] for u in users]
        if len(out) < limit:  # wave 0 held every user: later waves are the round's users
            for w in range(1, per_user):
                wave = [q[w] for u in users if len(q := self._items[u]) > w]
                if not wave:
                    break
                out += _in_turns(wave)[: limit - len(out)]
                if len(out) == limit:
                    break
        return out

    def done(self, items: Sequence[Item]) -> None:
        """The round :meth:`next_round` handed out was applied whole: its items leave (each
        user's leading items) and its users wait again behind their next item."""
        for it in items:
            self._items[it[1]].popleft()
        for user in self._out:
            queue = self._items[user]
            if not queue:
                del self._items[user]
                continue
            tenant = tenant_of(user)
            heap = self._users.setdefault(tenant, [])
            heapq.heappush(heap, (queue[0][0], user))
            if heap[0][1] == user:  # the tenant's oldest now: its entry
                heapq.heappush(self._tenants, (queue[0][0], tenant))
        self._out = []

    def _first_wave(self, need: int) -> list[str]:
        """The users of wave 0, in order, at most ``need``: turns over the tenants, each turn
        taking every tenant's oldest user left in queue order (entries of a tenant already
        served this turn wait for the next)."""
        picked: list[str] = []
        while len(picked) < need:
            served: set[str] = set()
            later: list[tuple[int, str]] = []
            while len(picked) < need and self._tenants:
                head, tenant = heapq.heappop(self._tenants)
                heap = self._users.get(tenant)
                if not heap or heap[0][0] != head:
                    continue  # stale: the tenant's oldest changed
                if tenant in served:
                    later.append((head, tenant))
                    continue
                served.add(tenant)
                picked.append(heapq.heappop(heap)[1])
                if heap:
                    later.append((heap[0][0], tenant))
            for entry in later:
                heapq.heappush(self._tenants, entry)
            if not later:
                break
        return picked


def _in_turns(wave: list[Item]) -> list[Item]:
    """A later wave's items in a round's order: tenants in turn, each turn in
    queue order."""
    wave = sorted(wave)
    turn: dict[str, int] = {}
    ranked = []
    for it in wave:
        t = tenant_of(it[1])
        turn[t] = turn.get(t, -1) + 1
        ranked.append((turn[t], it))
    ranked.sort(key=lambda r: (r[0], r[1][0]))
    return [it for _, it in ranked]

"""A bounded least-recently-used cache of store rows by id, filled in batches.

Why: assembling a retrieval reads the texts of every page it returns (top pages plus the whole
STM, ~15 per query) and of the knowledge entries it returns. On the serving path those SQL reads
were ~15 % of the server's CPU, although a page's text is written once and read many times. The
engine keeps what a retrieval shows of a page (and a knowledge entry's text) here and forgets an
id wherever it rewrites or deletes the row, so the store stays the only source of truth and the
cache is never more than a shortcut to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

V = TypeVar("V")


class RowCache(Generic[V]):
    """Up to ``capacity`` values by integer id (0 turns caching off); misses are loaded in one
    call of ``load(ids) -> {id: value}`` per :meth:`get_many`."""

    def __init__(self, capacity: int, load: Callable[[Sequence[int]], dict[int, V]]) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._load = load
        self._rows: OrderedDict[int, V] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def get_many(self, ids: Iterable[int]) -> dict[int, V]:
        """Values of ``ids`` (ids the store does not have are absent from the result)."""
        out: dict[int, V] = {}
        missing: set[int] = set()
        rows = self._rows
        for i in ids:
            v = rows.get(i)
            if v is None:
                missing.add(i)
            else:
                rows.move_to_end(i)
                out[i] = v
        self.hits += len(out)
        self.misses += len(missing)
        if missing:
            loaded = self._load(sorted(missing))
            out.update(loaded)
            if self.capacity:
                rows.update(loaded)
                while len(rows) > self.capacity:
                    rows.popitem(last=False)
        return out

    def forget(self, ids: Iterable[int]) -> None:
        """Drop ids whose rows were rewritten or deleted (before or after the write commits:
        the caller holds the engine lock, so no read fills them in between)."""
        for i in ids:
            self._rows.pop(int(i), None)

    def stats(self) -> dict[str, int]:
        return {"rows": len(self._rows), "hits": self.hits, "misses": self.misses}

    def clear(self) -> None:
        self._rows.clear()

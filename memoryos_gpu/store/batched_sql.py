"""``executemany`` as a few multi-row statements: what SQLite's row-by-row stepping costs, saved.

Why: ``sqlite3``'s ``executemany`` runs its statement once per row -- a reset, a bind of each
parameter and a step -- and the module's work around SQLite's own is about 2 us a row. The
write path's statements are nearly all one-row INSERTs, UPDATEs by key and DELETEs by key,
repeated for every page of a batch (about ten a page in bulk ingestion). One statement over a
chunk of rows (a multi-row ``VALUES`` list, an ``UPDATE ... FROM (VALUES ...)``, a
``DELETE ... IN (...)``) makes the same changes in 35-40 % less time (benchmarks/README.md,
"Multi-row statements"), with no change at the call sites: the store's SQLite connection is a
:func:`batched_connection` whose ``executemany`` rewrites these shapes.

Rewritten (anything else runs row by row, as ``sqlite3`` runs it):

* ``INSERT ... VALUES (one group of ? and literals) [tail without ?]``: the group repeated;
  rows go in in order, so an ``ON CONFLICT`` clause sees the earlier rows of its own chunk as
  it would have seen the earlier statements.
* ``UPDATE t SET ... WHERE col = ?``, when the rows' keys are distinct (a key twice in one
  statement would update its row once, not twice in order): ``... WHERE col IN (?, ...)``
  when the SET clause takes no parameters, else ``UPDATE t SET ... FROM (VALUES ...) AS
  _rows WHERE col = _rows.columnN`` when SQLite has it (3.33) and the rows are narrow
  (:data:`MAX_UPDATE_FROM_BYTES`).
* ``DELETE FROM t WHERE col = ?``: ``DELETE FROM t WHERE col IN (?, ...)``.

A failing row fails its whole chunk's statement, where ``executemany`` would have kept the rows
before it; the engine runs every statement inside a transaction that it rolls back on any
error, so nothing it writes can tell the two apart. The cursor returned is the last chunk's.

Chunks hold a power of two of rows (at most :data:`MAX_CHUNK`, and at most
:data:`MAX_PARAMS` parameters), so a statement's SQL text is one of a few and stays in the
connection's statement cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import cache, lru_cache
from itertools import chain
from operator import itemgetter
from types import ModuleType
from typing import Any, NamedTuple

__all__ = ["MAX_CHUNK", "MAX_PARAMS", "batched_connection", "plan", "sql_for"]

#: Most rows in one statement (beyond ~100 rows a statement gets no faster).
MAX_CHUNK = 128
#: Most parameters in one statement: SQLite's lowest compiled-in limit (999, before 3.32).
MAX_PARAMS = 999

_INSERT = re.compile(r"^(INSERT\b.*?\bVALUES\s*)(\([^()]*\))(.*)$", re.IGNORECASE | re.DOTALL)
_UPDATE = re.compile(
    r"^UPDATE\s+(\w+)\s+SET\s+(.+?)\s+WHERE\s+(\w+)\s*=\s*\?\s*$", re.IGNORECASE | re.DOTALL
)
_DELETE = re.compile(
    r"^(DELETE\s+FROM\s+\w+\s+WHERE\s+\w+)\s*=\s*\?\s*$", re.IGNORECASE | re.DOTALL
)
_NAMED = re.compile(r"\?\d|[:@$][A-Za-z_]")
_QUOTED = re.compile(r"('(?:[^']|'')*'|\"(?:[^\"]|\"\")*\")")

#: Most bytes of text and blobs in a row of an ``UPDATE ... FROM``: SQLite copies the
#: ``VALUES`` rows into a table of their own first, which costs more than it saves for wide
#: rows (a segment's embedding and keyword counts, ~3 KB: 1.8 -> 3.5 us a row).
MAX_UPDATE_FROM_BYTES = 512

_LAST = itemgetter(-1)  # an UPDATE row's key


class Plan(NamedTuple):
    """A statement as multi-row statements: parameters per row, whether it is an UPDATE
    (rows need distinct keys), whether its rows are copied (``UPDATE ... FROM``), and its SQL
    for ``n`` rows."""

    width: int
    update: bool
    copies_rows: bool
    text: Callable[[int], str]


def _marks(text: str) -> int:
    """``?`` placeholders outside quoted strings and names."""
    return sum(part.count("?") for part in _QUOTED.split(text)[::2])


def _number_marks(text: str, start: int) -> str:
    """``text`` with its k-th ``?`` (outside quotes) made ``_rows.column{start + k}``."""
    k = start
    parts = _QUOTED.split(text)
    for i in range(0, len(parts), 2):
        pieces = parts[i].split("?")
        out = [pieces[0]]
        for piece in pieces[1:]:
            out.append(f"_rows.column{k}{piece}")
            k += 1
        parts[i] = "".join(out)
    return "".join(parts)


@lru_cache(maxsize=256)
def plan(sql: str, update_from: bool = True) -> Plan | None:
    """How ``sql`` goes as multi-row statements, or None (it runs row by row)."""
    flat = sql.strip()  # whitespace kept: a literal may hold some
    if any(_NAMED.search(part) for part in _QUOTED.split(flat)[::2]):
        return None  # numbered or named parameters: a repeated group would reuse them
    m = _INSERT.match(flat)
    if m:
        head, group, tail = m.groups()
        width = _marks(group)
        if not width or _marks(head) or _marks(tail):
            return None
        return Plan(width, False, False, lambda n: head + ",".join([group] * n) + tail)
    m = _DELETE.match(flat)
    if m:
        return Plan(1, False, False, lambda n: f"{m.group(1)} IN ({','.join('?' * n)})")
    m = _UPDATE.match(flat)
    if not m or re.search(r"\bFROM\b", m.group(2), re.IGNORECASE) or "_rows" in flat:
        return None
    table, sets, key = m.groups()
    width = _marks(sets) + 1
    if width == 1:  # the same change for every key: no rows to join
        return Plan(
            1,
            True,
            False,
            lambda n: f"UPDATE {table} SET {sets} WHERE {key} IN ({','.join('?' * n)})",
        )
    if not update_from:
        return None
    body = f"UPDATE {table} SET {_number_marks(sets, 1)} FROM (VALUES "
    where = f") AS _rows WHERE {key} = _rows.column{width}"
    group = "(" + ",".join("?" * width) + ")"
    return Plan(width, True, True, lambda n: body + ",".join([group] * n) + where)


def _chunks(n: int, cap: int) -> list[int]:
    """``n`` rows as chunk sizes: full chunks of ``cap``, the rest in powers of two."""
    sizes = [cap] * (n // cap)
    rest = n % cap
    bit = 1 << max(rest.bit_length() - 1, 0)
    while rest:
        if rest >= bit:
            sizes.append(bit)
            rest -= bit
        bit >>= 1
    return sizes


@cache
def batched_connection(dbapi: ModuleType) -> type:
    """A subclass of the DB-API module ``dbapi``'s ``Connection`` (``sqlite3``'s, or the
    encryption driver's) whose ``executemany`` runs the shapes above as multi-row statements:
    pass it as ``dbapi.connect(..., factory=...)``."""
    update_from = tuple(dbapi.sqlite_version_info) >= (3, 33)

    class BatchedConnection(dbapi.Connection):  # type: ignore[misc, name-defined]
        def executemany(self, sql: str, seq: Any) -> Any:
            rows = seq if isinstance(seq, list | tuple) else list(seq)
            how = plan(sql, update_from) if len(rows) > 1 else None
            if how is None or not _fits(how, rows):
                return super().executemany(sql, rows)  # sqlite3 says what is wrong, if any
            cap = 1 << (min(MAX_CHUNK, MAX_PARAMS // how.width).bit_length() - 1)
            cur, at = None, 0
            for size in _chunks(len(rows), cap):
                cur = self.execute(how.text(size), list(chain.from_iterable(rows[at : at + size])))
                at += size
            return cur

    return BatchedConnection


def _fits(how: Plan, rows: Sequence[Sequence[Any]]) -> bool:
    """Whether every row has the statement's width, an UPDATE's rows distinct keys, and an
    ``UPDATE ... FROM``'s rows (judged by the first: one call's rows come from one place)
    at most :data:`MAX_UPDATE_FROM_BYTES` of text and blobs. Rows it cannot judge (not
    sequences, unhashable keys) are not batched: ``sqlite3`` then says what is wrong. The row
    tests run as C-level ``map``, not a generator step a row."""
    try:
        if set(map(len, rows)) != {how.width}:
            return False
        if how.copies_rows:
            size = sum(len(v) for v in rows[0] if isinstance(v, str | bytes | bytearray))
            if size > MAX_UPDATE_FROM_BYTES:
                return False
        return not how.update or len(set(map(_LAST, rows))) == len(rows)
    except TypeError:
        return False


def sql_for(sql: str, n: int) -> str | None:
    """The statement ``executemany`` runs for ``n`` rows of ``sql`` (None: row by row): for
    tests and ``EXPLAIN QUERY PLAN``."""
    how = plan(sql)
    return how.text(n) if how else None

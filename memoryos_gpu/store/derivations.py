"""Provenance: which pages each derived item came from, and forgetting what deleted pages implied.

Why a table of its own: deleting a page (or a user) must find everything derived from it --
the knowledge entries (the user's and the assistant's, which every user of the assistant is
served) and the profile values -- and nothing else. One ``provenance`` row per (item, source
page), indexed by page, makes that one indexed lookup. Segments and chain metas need no rows:
a segment's sources are the pages whose ``segment_id`` names it, a chain meta's the pages of
its ``chain_id`` (the engine re-derives both from the pages left, ``engine/forget.py``).

The rule when pages go (:func:`forget_pages`): an item derived from a deleted page is removed,
whatever else it was derived from -- an LLM fact or a merged profile value may mix several
pages, and nothing can say which words came from which -- and the other pages it came from are
*re-analysed* (marked unanalysed, their segments queued for promotion), so the facts they
support on their own are derived again by the next ``process_pending``. An entry that an
affected entry superseded is treated the same way (its support comes back from its own pages,
live again). Editing a page's text (``update_page``) is the same with the page kept: it is
re-analysed too, so what its new text says comes back.

A source page is named by its id *and* its user: under per-shard stores an assistant's owner
shard records the pages of users on other shards, numbered by their own files
(:func:`forget_learned` removes what a user's pages taught there, ``distributed/
sharded_forget.py``). Every statement here is the SQL both dialects run (the store's ``?``
style).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from memoryos_gpu.store.rows import audit_owner, id_chunks, select_in

KNOWLEDGE = "knowledge"
PROFILE = "profile"


@dataclass
class Forgotten:
    """What :func:`forget_pages` removed, for the engine to drop from its memory."""

    entries: list[int] = field(default_factory=list)  # knowledge entries deleted
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)  # user -> new profile
    reanalysed: list[int] = field(default_factory=list)  # pages marked for re-analysis
    elsewhere: list[tuple[int, str]] = field(default_factory=list)  # (page, user) not held here
    assistant: list[tuple[str, int]] = field(default_factory=list)  # (assistant, seq) removed
    owners: list[tuple[int, str]] = field(default_factory=list)  # (entry, its audit owner)


def _chunks(ids: Iterable[int]) -> list[list[int]]:
    """The distinct ids, ascending, in :func:`~memoryos_gpu.store.rows.id_chunks`."""
    return id_chunks(sorted({int(i) for i in ids}))


def _ids_in(db: Any, select: str, ids: Iterable[int]) -> set[int]:
    """The first column, as ints, of ``select`` (ending in ``IN``) over the distinct ``ids``."""
    ids = sorted({int(i) for i in ids})
    rows = select_in(lambda sql, params: db.execute(sql, params).fetchall(), select, ids)
    return {int(r[0]) for r in rows}


def _marks(chunk: Sequence[Any]) -> str:
    return ",".join("?" * len(chunk))


def record(db: Any, kind: str, rows: Iterable[tuple[int, str, Sequence[int], str]]) -> None:
    """Provenance rows ``(item id, item key, source page ids, source user)`` of one kind, in
    the open transaction (one ``executemany``; rows already held are kept)."""
    flat = [(kind, int(item), key, int(p), user) for item, key, pages, user in rows for p in pages]
    if flat:
        db.executemany(
            "INSERT INTO provenance(item_kind, item_id, item_key, page_id, user_id) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            flat,
        )


def sources(store: Any, kind: str, item_ids: Sequence[int]) -> dict[int, list[int]]:
    """Source page ids of items by id, ascending (items without provenance are left out): the
    pages this store holds. Why not every provenance row: under sharding on per-shard stores
    an assistant's owner shard records the pages of users on other shards too, by those
    shards' page ids, which name other pages here (another user's, found serving
    ``--engines 2``); a shared PostgreSQL store, like one engine's, holds them all."""
    out: dict[int, list[int]] = {}
    for chunk in _chunks(item_ids):
        for item, page in store.query(
            "SELECT v.item_id, v.page_id FROM provenance v JOIN pages p ON "
            "p.page_id = v.page_id AND p.user_id = v.user_id WHERE v.item_kind = ? AND "
            f"v.item_id IN ({_marks(chunk)}) ORDER BY v.item_id, v.page_id",
            [kind, *chunk],
        ):
            out.setdefault(int(item), []).append(int(page))
    return out


def profile_sources(store: Any, user_id: str) -> dict[str, list[int]]:
    """Source page ids of each of a user's profile dimensions."""
    out: dict[str, list[int]] = {}
    for key, page in store.query(
        "SELECT item_key, page_id FROM provenance WHERE item_kind = 'profile' AND user_id = ? "
        "ORDER BY item_key, page_id",
        (user_id,),
    ):
        out.setdefault(key, []).append(int(page))
    return out


Page = tuple[int, str]  # (page id, its user): a page named across shards' stores


def forget_pages(
    db: Any, page_ids: Sequence[int], *, drop_user: str | None = None, edited: bool = False
) -> Forgotten:
    """Remove, in the open transaction ``db``, every item derived from ``page_ids`` (still in
    the store: call this before deleting them), and queue the re-analysis of the other pages
    those items came from (see the module docstring). ``drop_user``: the pages are all of that
    user's, being deleted with it: its own profile is not rewritten and its pages are not
    re-analysed. ``edited``: the pages stay, with new text (``update_page``): what their old
    text implied goes the same way, and they are re-analysed with the others. The audit events
    of the removed entries lose their content."""
    gone = _pages_in(db, page_ids)
    if not gone:
        return Forgotten()
    entries, dims = _derived_from(db, gone)
    support = _support(db, entries, dims)
    support = support | gone if edited else support - gone
    return _remove(db, entries, dims, support, drop_user, purge=drop_user is not None)


def forget_learned(
    db: Any, user_id: str, owns: Callable[[str], bool], pages: Sequence[int] | None = None
) -> Forgotten:
    """Remove the assistant entries this store holds that were learned from ``user_id``'s
    pages (a provenance row of the user, or the user as ``source_user``) for the assistants
    ``owns`` accepts, and the entries they had superseded; queue the re-analysis of the other
    pages behind them (those this store does not hold are left in ``elsewhere``).
    ``pages``: only what those pages of the user taught (a page deleted or edited: its other
    pages behind a removed fact are re-analysed too, the named pages are left to the user's
    own shard); None: every page of the user (the user is deleted).
    Why not :func:`forget_pages`: under per-shard stores an assistant's owner shard holds the
    facts (their provenance names the user's pages) but not the pages, which are on the user's
    shard."""
    if pages is None:
        rows = db.execute(
            "SELECT entry_id, owner_id FROM knowledge WHERE owner_kind = 'assistant' AND "
            "(source_user = ? OR entry_id IN (SELECT item_id FROM provenance WHERE "
            "item_kind = 'knowledge' AND user_id = ?))",
            (user_id, user_id),
        ).fetchall()
    else:
        rows = []
        for chunk in _chunks(pages):
            rows += db.execute(
                "SELECT entry_id, owner_id FROM knowledge WHERE owner_kind = 'assistant' AND "
                "entry_id IN (SELECT item_id FROM provenance WHERE item_kind = 'knowledge' AND "
                f"user_id = ? AND page_id IN ({_marks(chunk)}))",
                [user_id, *chunk],
            ).fetchall()
    entries = _with_superseded(db, {int(eid) for eid, aid in rows if owns(aid)})
    support = _support(db, entries, {})
    if pages is None:
        support = {p for p in support if p[1] != user_id}
    else:
        support -= {(int(p), user_id) for p in pages}
    return _remove(db, entries, {}, support, user_id if pages is None else None, purge=False)


def _remove(
    db: Any,
    entries: set[int],
    dims: dict[str, set[str]],
    support: set[Page],
    drop_user: str | None,
    *,
    purge: bool,
) -> Forgotten:
    """Delete the entries and profile dimensions (their provenance, their audit content) and
    re-analyse the support pages (not ``drop_user``'s); ``purge``: every provenance row of
    ``drop_user`` goes too (its pages are being deleted)."""
    out = Forgotten()
    for chunk in _chunks(entries):
        rows = db.execute(
            f"SELECT entry_id, owner_kind, owner_id, seq FROM knowledge WHERE entry_id IN "
            f"({_marks(chunk)})",
            chunk,
        ).fetchall()
        out.owners += [(int(e), audit_owner(str(k), str(o))) for e, k, o, _ in rows]
        out.assistant += [(str(o), int(q)) for _, k, o, q in rows if k == "assistant"]
        db.execute(
            "DELETE FROM provenance WHERE item_kind = 'knowledge' AND item_id IN "
            f"({_marks(chunk)})",
            chunk,
        )
        db.execute(f"DELETE FROM knowledge WHERE entry_id IN ({_marks(chunk)})", chunk)
        db.execute(
            "UPDATE audit SET detail = '{}' WHERE item_kind = 'knowledge' AND item_id IN "
            f"({_marks(chunk)})",
            chunk,
        )
    for user, keys in dims.items():
        db.executemany(
            "DELETE FROM provenance WHERE item_kind = 'profile' AND item_id = 0 AND "
            "item_key = ? AND user_id = ?",
            [(k, user) for k in keys],
        )
        if user != drop_user:
            out.profiles[user] = _drop_profile_keys(db, user, keys)
    if purge:
        db.execute("DELETE FROM provenance WHERE user_id = ?", (drop_user,))
    out.entries = sorted(entries)
    out.reanalysed, out.elsewhere = _reanalyse(db, support, drop_user)
    return out


def _pages_in(db: Any, page_ids: Iterable[int]) -> set[Page]:
    out: set[Page] = set()
    for chunk in _chunks(page_ids):
        rows = db.execute(
            f"SELECT page_id, user_id FROM pages WHERE page_id IN ({_marks(chunk)})", chunk
        ).fetchall()
        out.update((int(p), str(u)) for p, u in rows)
    return out


def _derived_from(db: Any, pages: set[Page]) -> tuple[set[int], dict[str, set[str]]]:
    """The knowledge entries and (by user) profile dimensions derived from the pages, one
    lookup of the page index per chunk (a row counts when it names the page's user too:
    under per-shard stores another shard's page may have the same id); plus, transitively,
    the entries those entries had superseded."""
    entries: set[int] = set()
    dims: dict[str, set[str]] = {}
    users = dict(pages)
    for chunk in _chunks(users):
        for kind, item, key, user, page in db.execute(
            "SELECT item_kind, item_id, item_key, user_id, page_id FROM provenance WHERE "
            f"page_id IN ({_marks(chunk)})",
            chunk,
        ).fetchall():
            if users.get(int(page)) != user:
                continue
            if kind == KNOWLEDGE:
                entries.add(int(item))
            else:
                dims.setdefault(user, set()).add(key)
    return _with_superseded(db, entries), dims


def _with_superseded(db: Any, entries: set[int]) -> set[int]:
    """The entries and, transitively, those they had superseded."""
    entries = set(entries)
    frontier = set(entries)
    while frontier:
        older = _ids_in(
            db,
            "SELECT entry_id FROM knowledge WHERE superseded_by IS NOT NULL AND superseded_by IN",
            frontier,
        )
        frontier = older - entries
        entries |= frontier
    return entries


def _support(db: Any, entries: set[int], dims: dict[str, set[str]]) -> set[Page]:
    """Every source page (with its user) of the given entries and profile dimensions."""
    pages: set[Page] = set()
    for chunk in _chunks(entries):
        rows = db.execute(
            "SELECT page_id, user_id FROM provenance WHERE item_kind = 'knowledge' AND "
            f"item_id IN ({_marks(chunk)})",
            chunk,
        ).fetchall()
        pages.update((int(p), str(u)) for p, u in rows)
    for user, keys in dims.items():
        for key in keys:
            pages.update(
                (int(r[0]), user)
                for r in db.execute(
                    "SELECT page_id FROM provenance WHERE item_kind = 'profile' AND "
                    "item_id = 0 AND item_key = ? AND user_id = ?",
                    (key, user),
                ).fetchall()
            )
    return pages


def _drop_profile_keys(db: Any, user_id: str, keys: set[str]) -> dict[str, Any]:
    row = db.execute("SELECT profile FROM users WHERE user_id = ?", (user_id,)).fetchone()
    profile = json.loads(row[0]) if row else {}
    for k in keys:
        profile.pop(k, None)
    db.execute(
        "UPDATE users SET profile = ? WHERE user_id = ?",
        (json.dumps(profile, ensure_ascii=False), user_id),
    )
    return profile


def _reanalyse(db: Any, pages: set[Page], drop_user: str | None) -> tuple[list[int], list[Page]]:
    """Mark the pages unanalysed and queue their live segments for promotion; returns them,
    and the pages this store does not hold (another shard's: its engine re-analyses them)."""
    done: list[int] = []
    found: set[Page] = set()
    now = time.time()
    wanted = {p for p in pages if p[1] != drop_user}
    for chunk in _chunks(p for p, _ in wanted):
        rows = db.execute(
            f"SELECT page_id, user_id, segment_id FROM pages WHERE page_id IN ({_marks(chunk)})",
            chunk,
        ).fetchall()
        rows = [r for r in rows if (int(r[0]), r[1]) in wanted]
        if not rows:
            continue
        found.update((int(r[0]), r[1]) for r in rows)
        ids = [int(r[0]) for r in rows]
        db.execute(f"UPDATE pages SET analysed = 0 WHERE page_id IN ({_marks(ids)})", ids)
        db.executemany(
            "INSERT INTO pending(user_id, kind, ref, created) VALUES (?, 'promote', ?, ?) "
            "ON CONFLICT DO NOTHING",
            sorted({(r[1], int(r[2]), now) for r in rows if r[2] is not None}),
        )
        done += ids
    return sorted(done), sorted(wanted - found)


def reanalyse(db: Any, pages: Iterable[Page]) -> list[int]:
    """Re-analyse the pages this store holds (another shard's forgetting found them behind a
    removed fact): marked unanalysed, their segments queued for promotion."""
    return _reanalyse(db, {(int(p), str(u)) for p, u in pages}, None)[0]

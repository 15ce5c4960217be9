"""The read side of a store: queries by id and by user, the streaming bulk loads of a reopen,
audit history and export.

Why a module of its own: :class:`~memoryos_gpu.store.sqlite.SQLiteStore` keeps what opens,
migrates, writes and erases (connections, transactions, ids, audit events, deletion); what only
reads is this mixin, :class:`StoreReads`, which it inherits. Every method here reads through the
store's :meth:`query` and :meth:`_snapshot`, so PostgreSQL (which overrides those) runs the same
code unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from memoryos_gpu.store.derivations import KNOWLEDGE, profile_sources, sources
from memoryos_gpu.store.errors import StoreError
from memoryos_gpu.store.rows import (
    PageView,
    blob_matrix,
    id_chunks,
    json_dict,
    knowledge_dict,
    kw_matrix,
    page_dict,
)

#: Rows fetched per round trip by the bulk loaders (bounds their transient memory).
LOAD_CHUNK = 65536
#: ... and the bytes of embeddings per chunk of a loader that reads them: a row of 384 float32
#: is 1.5 KB, held three times while a chunk is decoded (the row's blob, the joined blob, the
#: matrix), so 65,536 of them made a 350 MB transient, the peak of a reopen at 10,000 users
LOAD_CHUNK_BYTES = 16 << 20


class ArenaExtent(NamedTuple):
    """The arena a store's rows need: ``segments``; the page ``blocks`` they take (at least
    one each); the segment slots (``segment_width``) and knowledge ring positions
    (``knowledge_width``) every user must have room for. Why the widths: widening copies
    every user's rows into a new array (the old and the new resident at once): at 100,000
    users the knowledge rings' 8 -> 16 was a 2.5 GB transient, the peak of the whole reopen."""

    segments: int
    blocks: int
    segment_width: int
    knowledge_width: int


#: A page's readable columns in ``page_dict``'s order (its chain's meta among them): pages
#: ``p`` joined to their chains ``c``; a query adds its WHERE on ``p``.
_PAGE_SELECT = (
    "SELECT p.page_id, p.user_id, p.seq, p.user_input, p.agent_response, p.timestamp, p.tier, "
    "p.segment_id, p.prev_page, p.next_page, c.meta, p.summary, p.keywords, p.analysed, "
    "p.mode, p.source, p.extra FROM pages p LEFT JOIN chains c ON c.chain_id = p.chain_id"
)
#: Users joined to their chain tail ``p`` and its chain ``c``: a user's current chain meta is
#: ``c.meta`` (the meta of the chain its tail is on), with ``_USER_COLS`` before it.
_USER_COLS = "users.user_id, users.assistant_id, users.clock, users.next_seq, users.chain_tail"
_USER_FROM = (
    "FROM users LEFT JOIN pages p ON p.page_id = users.chain_tail "
    "LEFT JOIN chains c ON c.chain_id = p.chain_id"
)
#: What a retrieval shows of a page (:class:`PageView`'s fields after the page id).
_VIEW_SELECT = (
    "SELECT p.page_id, p.user_id, p.user_input, p.agent_response, p.timestamp, p.chain_id, "
    "c.meta, p.extra FROM pages p LEFT JOIN chains c ON c.chain_id = p.chain_id"
)


class StoreReads:
    """What a store answers without writing (a mixin of
    :class:`~memoryos_gpu.store.sqlite.SQLiteStore`): it reads through the store's
    :meth:`query` (one statement) and :meth:`_snapshot` (several in one read transaction)."""

    #: Seconds spent in the last bulk load, by phase (see :meth:`_stream`).
    load_stats: dict[str, dict[str, float]]

    if TYPE_CHECKING:

        def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]: ...

        def _snapshot(self) -> AbstractContextManager[Any]: ...

    # ------------------------------------------------------------------ users
    def user_row(self, user_id: str) -> dict[str, Any] | None:
        rows = self.query(
            f"SELECT {_USER_COLS}, c.meta, users.profile, users.knowledge_head {_USER_FROM} "
            "WHERE users.user_id = ?",
            (user_id,),
        )
        if not rows:
            return None
        r = rows[0]
        return {
            "user_id": r[0],
            "assistant_id": r[1],
            "clock": r[2],
            "next_seq": r[3],
            "chain_tail": r[4],
            "chain_meta": r[5],
            "profile": json.loads(r[6]),
            "knowledge_head": r[7],
        }

    def profiles(self, user_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Structured profiles of many users in one query (missing users are left out)."""
        ids = list(user_ids)
        out: dict[str, dict[str, Any]] = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            out.update(
                (uid, json.loads(p))
                for uid, p in self.query(
                    f"SELECT user_id, profile FROM users WHERE user_id IN ({marks})", chunk
                )
            )
        return out

    def all_users(self) -> list[tuple]:
        return self.query(
            f"SELECT {_USER_COLS}, c.meta, users.knowledge_head {_USER_FROM} ORDER BY users.rowid"
        )

    def all_assistants(self) -> list[tuple]:
        return self.query("SELECT assistant_id, knowledge_head FROM assistants ORDER BY rowid")

    # ------------------------------------------------------------------ journal
    def known_sources(self, sources: Iterable[str]) -> dict[str, tuple[int, str]]:
        """Which idempotency keys were already accepted, mapped to (page id, user id). The
        owner comes along because a source is unique across the store (``pages.source``):
        the same source again is a duplicate only for the user who stored it."""
        out: dict[str, tuple[int, str]] = {}
        keys = [s for s in sources if s]
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            marks = ",".join("?" * len(chunk))
            rows = self.query(
                f"SELECT source, page_id, user_id FROM pages WHERE source IN ({marks})", chunk
            )
            out.update((r[0], (r[1], r[2])) for r in rows)
        return out

    # ------------------------------------------------------------------ pages
    def page_rows(self, page_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Readable fields of pages by id (no embeddings)."""
        out: dict[int, dict[str, Any]] = {}
        for chunk in id_chunks(page_ids):
            marks = ",".join("?" * len(chunk))
            for r in self.query(f"{_PAGE_SELECT} WHERE p.page_id IN ({marks})", chunk):
                out[r[0]] = page_dict(r)
        return out

    def page_views(self, page_ids: Sequence[int]) -> dict[int, PageView]:
        """What a retrieval shows of each page, by id (the engine caches these)."""
        out: dict[int, PageView] = {}
        for chunk in id_chunks(page_ids):
            for r in self.query(
                f"{_VIEW_SELECT} WHERE p.page_id IN ({','.join('?' * len(chunk))})", chunk
            ):
                out[r[0]] = PageView(r[2], r[3], r[4], r[5], r[6], json_dict(r[7]))
        return out

    def live_chains(self, chain_ids: Iterable[int]) -> set[int]:
        """Those of ``chain_ids`` with a page still in MTM (the engine keeps their meta in
        memory)."""
        out: set[int] = set()
        for chunk in id_chunks(sorted(chain_ids)):
            marks = ",".join("?" * len(chunk))
            out.update(
                r[0]
                for r in self.query(
                    "SELECT DISTINCT chain_id FROM pages WHERE tier = 'mtm' AND chain_id IN "
                    f"({marks})",
                    chunk,
                )
            )
        return out

    def user_pages(self, user_id: str, tier: str | None = None) -> list[dict[str, Any]]:
        sql = f"{_PAGE_SELECT} WHERE p.user_id = ?"
        params: list[Any] = [user_id]
        if tier is not None:
            sql += " AND p.tier = ?"
            params.append(tier)
        return [page_dict(r) for r in self.query(sql + " ORDER BY p.seq", params)]

    def page_window(self, user_id: str, offset: int, limit: int) -> tuple[list[dict], int]:
        """One page of a user's pages, oldest first, and how many the user has: a listing
        that stays stable while pages are added (new ones come last)."""
        rows = self.query(
            f"{_PAGE_SELECT} WHERE p.user_id = ? ORDER BY p.seq LIMIT ? OFFSET ?",
            (user_id, int(limit), int(offset)),
        )
        total = self.query("SELECT COUNT(*) FROM pages WHERE user_id = ?", (user_id,))[0][0]
        return [page_dict(r) for r in rows], int(total)

    def page_embeddings(self, page_ids: Sequence[int], dim: int) -> np.ndarray:
        """The pages' embeddings, one row per id in order; ``KeyError`` for a page with no row
        (its callers hold the pages under the engine lock: a missing one is a bug)."""
        ids = [int(p) for p in page_ids]
        blobs = self._page_embedding_blobs(ids)
        return blob_matrix([blobs[i] for i in ids], dim)

    def live_page_embeddings(
        self, page_ids: Sequence[int], dim: int
    ) -> tuple[list[int], np.ndarray]:
        """The ids of ``page_ids`` that still have a row, in order, and their embeddings: for
        callers that hold page ids from outside the engine lock (a mem0 search ranks the pages
        a retrieval returned; one deleted since is simply not a result)."""
        ids = [int(p) for p in page_ids]
        blobs = self._page_embedding_blobs(ids)
        kept = [i for i in ids if i in blobs]
        return kept, blob_matrix([blobs[i] for i in kept], dim)

    def _page_embedding_blobs(self, ids: Sequence[int]) -> dict[int, bytes]:
        blobs: dict[int, bytes] = {}
        for chunk in id_chunks(ids):
            marks = ",".join("?" * len(chunk))
            blobs.update(
                self.query(
                    f"SELECT page_id, embedding FROM page_vectors WHERE page_id IN ({marks})", chunk
                )
            )
        return blobs

    # ------------------------------------------------------------------ pending work
    def pending(self, kind: str) -> list[tuple[int, str, int]]:
        """(work_id, user_id, ref) of pending work of a kind, oldest first."""
        return [
            tuple(r)
            for r in self.query(
                "SELECT work_id, user_id, ref FROM pending WHERE kind = ? ORDER BY work_id", (kind,)
            )
        ]

    def pending_items(self, kind: str) -> list[tuple[int, str, int]]:
        """(work_id, user_id, ref) of every pending item of ``kind``, in queue order: what a
        drain's :class:`~memoryos_gpu.store.rounds.PendingQueue` is read from, which hands
        out its rounds (waves per user, tenants in turn)."""
        return self.query(
            "SELECT work_id, user_id, ref FROM pending WHERE kind = ? ORDER BY work_id", (kind,)
        )

    def count_pending(self, user_id: str | None = None) -> int:
        if user_id is None:
            return self.query("SELECT COUNT(*) FROM pending")[0][0]
        return self.query("SELECT COUNT(*) FROM pending WHERE user_id = ?", (user_id,))[0][0]

    #: Whether an LLM derived any page: answered from the partial index ``pages_llm``
    #: (schema 8), which an extractive store's pages stay out of, not by reading every row.
    LLM_DERIVED_SQL = "SELECT 1 FROM pages WHERE mode IN ('llm', 'llm-fallback') LIMIT 1"

    def llm_derived(self) -> bool:
        """Whether an LLM derived any of the store's pages (an LLM's fallback too)."""
        return bool(self.query(self.LLM_DERIVED_SQL))

    # ------------------------------------------------------------------ bulk load (reopen)
    def arena_extent(self, block_size: int, knowledge_capacity: int) -> ArenaExtent:
        """What a reopen's arena must hold (:class:`ArenaExtent`), reserved before streaming
        so that it never grows by copying."""
        n, blocks, width = self.query(
            "SELECT COUNT(*), COALESCE(SUM((CASE WHEN n_pages > 1 THEN n_pages ELSE 1 END "
            "+ ? - 1) / ?), 0), COALESCE(MAX(slot) + 1, 0) FROM segments",
            (block_size, block_size),
        )[0]
        ring = self.query(
            "SELECT COALESCE(MAX(seq % ?) + 1, 0) FROM knowledge WHERE live = 1",
            (knowledge_capacity,),
        )[0][0]
        return ArenaExtent(int(n), int(blocks), int(width), int(ring))

    def _stream(
        self,
        name: str,
        sql: str,
        numeric: Sequence[tuple[str, Any]],
        dim: int,
        *,
        keep: Sequence[str] = (),
        params: Sequence[Any] = (),
    ) -> Iterator[dict[str, Any]]:
        """Yield ``sql``'s rows in chunks of :data:`LOAD_CHUNK_BYTES` of embeddings (at most
        :data:`LOAD_CHUNK` rows) as column arrays.

        Why chunks: a reopen of 10,000 users x 200 segments reads ~6 GB of embeddings; holding
        them all beside the arena they go into doubled the peak memory. Each chunk is consumed
        (written into the arena) before the next is fetched, all in one read snapshot.

        Row layout: the ``numeric`` columns (name, dtype) first, then the float32 embedding
        blob (one join per chunk into a ``[k, dim]`` matrix), then the ``keep`` columns,
        returned as Python lists. Timings accumulate in ``load_stats[name]``.
        """
        stats = self.load_stats[name] = {"rows": 0, "sql_s": 0.0, "join_s": 0.0}
        blob_col = len(numeric)
        chunk_rows = max(1, min(LOAD_CHUNK, LOAD_CHUNK_BYTES // (4 * dim)))
        with self._snapshot() as db:
            t0 = time.perf_counter()
            cur = db.execute(sql, params)
            while True:
                rows = cur.fetchmany(chunk_rows)
                t1 = time.perf_counter()
                stats["sql_s"] += t1 - t0
                if not rows:
                    return
                k = len(rows)
                cols = list(zip(*rows, strict=True))
                chunk: dict[str, Any] = {
                    key: np.asarray(cols[c], dt) for c, (key, dt) in enumerate(numeric)
                }
                joined = b"".join(cols[blob_col])
                if len(joined) != k * dim * 4:
                    raise StoreError(
                        f"{name}: embedding blobs hold {len(joined)} bytes, expected {k} x {dim} "
                        "float32; the store is corrupt or was written with another dimension"
                    )
                # frombuffer over bytes is read-only; the copy makes a writable array
                chunk["embedding"] = np.frombuffer(joined, "<f4").reshape(k, dim).copy()
                for c, key in enumerate(keep, start=blob_col + 1):
                    chunk[key] = list(cols[c])
                stats["rows"] += k
                stats["join_s"] += time.perf_counter() - t1
                yield chunk
                t0 = time.perf_counter()  # the consumer's time between chunks is not ours

    def iter_segments(self, dim: int, keyword_width: int) -> Iterator[dict[str, Any]]:
        """Every segment, in chunks ordered by ``segment_id`` (ascending across chunks).

        Keys: ``segment_id``, ``slot``, ``n_visit``, ``l_interaction``, ``last_access``,
        ``n_pages``, ``embedding`` ``[k, dim]``, ``user_id`` (list), ``kw_matrix``
        ``[k, keyword_width]`` int32 padded with -1 (built without a per-row loop).
        """
        numeric = [
            ("segment_id", np.int64),
            ("slot", np.int32),
            ("n_visit", np.int32),
            ("l_interaction", np.int32),
            ("last_access", np.float64),
            ("n_pages", np.int32),
        ]
        for chunk in self._stream(
            "segments",
            "SELECT segment_id, slot, n_visit, l_interaction, last_access, n_pages, "
            "embedding, user_id, kw_ids FROM segments ORDER BY segment_id",
            numeric,
            dim,
            keep=("user_id", "kw_ids"),
        ):
            t0 = time.perf_counter()
            chunk["kw_matrix"] = kw_matrix(chunk.pop("kw_ids"), keyword_width)
            self.load_stats["segments"]["join_s"] += time.perf_counter() - t0
            yield chunk

    def load_stm(self) -> dict[str, list[int]]:
        """Page ids of every user's STM, oldest first, in one query (tier 'stm' only: pages
        already pushed out to 'pending' are not in STM any more)."""
        out: dict[str, list[int]] = {}
        for uid, pid in self.query(
            "SELECT user_id, page_id FROM pages WHERE tier = 'stm' ORDER BY user_id, seq"
        ):
            out.setdefault(uid, []).append(pid)
        return out

    def iter_mtm_pages(self, dim: int) -> Iterator[dict[str, Any]]:
        """Every page in MTM, in chunks of ``page_id``, ``segment_id``, ``seg_pos``,
        ``embedding`` and ``terms`` (a list of term-row blobs, None where a page has none yet).
        Read in one sequential scan in key order (no random lookups, no SQL sort of the
        blobs): callers place each page by its (segment, position), so the order of the rows
        does not matter."""
        return self._stream(
            "mtm_pages",
            "SELECT p.page_id, p.segment_id, p.seg_pos, v.embedding, v.terms FROM pages p "
            "JOIN page_vectors v ON v.page_id = p.page_id WHERE p.tier = 'mtm' "
            "ORDER BY p.page_id",
            [("page_id", np.int64), ("segment_id", np.int64), ("seg_pos", np.int64)],
            dim,
            keep=("terms",),
        )

    def iter_page_views(self) -> Iterator[list[tuple[int, str, PageView]]]:
        """What retrievals show of every page in STM or MTM (or waiting between them), in
        chunks of ``(page_id, user_id, view)``: the engine holds these in memory, so
        assembling a retrieval reads no row. A user's pages come one after the other (the
        ``(user_id, seq)`` key's order), so the in-memory records of one user's pages, which a
        retrieval reads together, are made together and lie together."""
        with self._snapshot() as db:
            cur = db.execute(f"{_VIEW_SELECT} WHERE p.tier != 'evicted' ORDER BY p.user_id, p.seq")
            while rows := cur.fetchmany(LOAD_CHUNK):
                extras: dict[str, dict[str, Any]] = {}  # one dict per distinct text, per chunk
                out = []
                for r in rows:
                    extra = extras.get(r[7])
                    if extra is None:
                        extra = extras[r[7]] = json_dict(r[7])
                    out.append((r[0], r[1], PageView(r[2], r[3], r[4], r[5], r[6], extra)))
                yield out

    def iter_pages_without_terms(
        self, chunk: int = LOAD_CHUNK
    ) -> Iterator[list[tuple[int, str, str, str, float, dict[str, Any]]]]:
        """Pages not yet evicted whose term row is missing (written before term rows were
        stored, or set to be split again by a migration): ``(page_id, user_id, user_input,
        agent_response, timestamp, extra)``, in page-id order, ``chunk`` at a time, each read
        when asked for (a fresh query above the last id), so the caller may write the chunk's
        rows back (:meth:`~memoryos_gpu.store.sqlite.SQLiteStore.set_page_terms`) before the
        next. Why chunks: schema 13 splits every page again, and one list held every page's
        text at once."""
        last = 0
        while rows := self.query(
            "SELECT p.page_id, p.user_id, p.user_input, p.agent_response, p.timestamp, "
            "p.extra FROM pages p JOIN page_vectors v ON v.page_id = p.page_id "
            "WHERE p.tier != 'evicted' AND v.terms IS NULL AND p.page_id > ? "
            "ORDER BY p.page_id LIMIT ?",
            (last, chunk),
        ):
            last = rows[-1][0]
            yield [(r[0], r[1], r[2], r[3], r[4], json_dict(r[5])) for r in rows]

    def page_terms(self, page_ids: Sequence[int]) -> dict[int, bytes | None]:
        """Term-row blobs of pages by id (None for a page stored without one)."""
        out: dict[int, bytes | None] = {}
        for chunk in id_chunks(page_ids):
            marks = ",".join("?" * len(chunk))
            out.update(
                self.query(
                    f"SELECT page_id, terms FROM page_vectors WHERE page_id IN ({marks})", chunk
                )
            )
        return out

    def iter_knowledge(self, dim: int) -> Iterator[dict[str, Any]]:
        """Live knowledge entries, owner after owner (the ``(owner_kind, owner_id, seq)`` key's
        order: the texts of one owner's entries, which a retrieval reads together, are then
        made together and lie together in memory), in chunks of ``entry_id``, ``seq``,
        ``embedding``, ``owner_kind``, ``owner_id`` and ``text`` (lists)."""
        return self._stream(
            "knowledge",
            "SELECT entry_id, seq, embedding, owner_kind, owner_id, text FROM knowledge "
            "WHERE live = 1 ORDER BY owner_kind, owner_id, seq",
            [("entry_id", np.int64), ("seq", np.int64)],
            dim,
            keep=("owner_kind", "owner_id", "text"),
        )

    # ------------------------------------------------------------------ knowledge
    #: The columns of a knowledge entry's readable form (:func:`knowledge_dict`).
    _KNOWLEDGE_COLS = (
        "entry_id, owner_kind, owner_id, seq, text, live, mode, created, strength, valid_from, "
        "valid_to, superseded_by, source_user"
    )

    def knowledge_rows(self, entry_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Readable entries by id, each with its ``sources`` (the page ids it was derived
        from), validity (``valid_from``, ``valid_to``, ``superseded_by``) and ``strength``
        (how many times it was said)."""
        out: dict[int, dict[str, Any]] = {}
        for chunk in id_chunks(entry_ids):
            marks = ",".join("?" * len(chunk))
            for r in self.query(
                f"SELECT {self._KNOWLEDGE_COLS} FROM knowledge WHERE entry_id IN ({marks})",
                chunk,
            ):
                out[r[0]] = knowledge_dict(r)
        return self._with_sources(out)

    def _with_sources(self, rows: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        found = sources(self, KNOWLEDGE, list(rows))
        for eid, row in rows.items():
            row["sources"] = found.get(eid, [])
        return rows

    def knowledge_texts(self, entry_ids: Sequence[int]) -> dict[int, str]:
        """Text of each knowledge entry, by id (the engine caches these)."""
        out: dict[int, str] = {}
        for chunk in id_chunks(entry_ids):
            sql = "SELECT entry_id, text FROM knowledge WHERE entry_id IN ({})"
            out.update(self.query(sql.format(",".join("?" * len(chunk))), chunk))
        return out

    def owner_knowledge(self, kind: str, owner_id: str, live_only: bool = True) -> list[dict]:
        """An owner's entries in ring order (``live_only=False``: superseded and dropped ones
        too, the history), each as :meth:`knowledge_rows` gives it."""
        rows = self.query(
            f"SELECT {self._KNOWLEDGE_COLS} FROM knowledge WHERE owner_kind = ? AND owner_id = ?"
            + (" AND live = 1" if live_only else "")
            + " ORDER BY seq",
            (kind, owner_id),
        )
        out = self._with_sources({r[0]: knowledge_dict(r) for r in rows})
        for row in out.values():  # the owner is the caller's question: not repeated
            del row["owner_kind"], row["owner_id"]
        return list(out.values())

    # ------------------------------------------------------------------ audit history
    def history(self, user_id: str) -> list[dict[str, Any]]:
        return [
            {
                "event_id": r[0],
                "ts": r[1],
                "action": r[2],
                "item_kind": r[3],
                "item_id": r[4],
                "detail": json.loads(r[5]),
            }
            for r in self.query(
                "SELECT event_id, ts, action, item_kind, item_id, detail FROM "
                "audit WHERE user_id = ? ORDER BY event_id",
                (user_id,),
            )
        ]

    def item_history(self, user_id: str, item_kind: str, item_id: int) -> list[dict[str, Any]]:
        """The audit events of one page or knowledge entry of a user, oldest first."""
        return [
            {"event_id": r[0], "ts": r[1], "action": r[2], "detail": json.loads(r[3])}
            for r in self.query(
                "SELECT event_id, ts, action, detail FROM audit WHERE user_id = ? AND "
                "item_kind = ? AND item_id = ? ORDER BY event_id",
                (user_id, item_kind, int(item_id)),
            )
        ]

    def last_updates(self, user_id: str, item_kind: str) -> dict[int, float]:
        """When each edited page or knowledge entry of a user was last edited, by id."""
        return dict(
            self.query(
                "SELECT item_id, MAX(ts) FROM audit WHERE user_id = ? AND item_kind = ? AND "
                "action = 'update' GROUP BY item_id",
                (user_id, item_kind),
            )
        )

    # ------------------------------------------------------------------ export / counts
    def export_user(self, user_id: str) -> dict[str, Any] | None:
        user = self.user_row(user_id)
        if user is None:
            return None
        segs = self.query(
            "SELECT segment_id, slot, summary, keywords, n_visit, l_interaction, "
            "last_access, created, n_pages FROM segments WHERE user_id = ? "
            "ORDER BY slot",
            (user_id,),
        )
        segment_pages: dict[int, list[int]] = {}
        chains: dict[int, dict[str, Any]] = {}
        for pid, sid, chain, meta in self.query(
            "SELECT p.page_id, p.segment_id, p.chain_id, c.meta FROM pages p LEFT JOIN chains c "
            "ON c.chain_id = p.chain_id WHERE p.user_id = ? ORDER BY p.seq",
            (user_id,),
        ):
            if sid is not None:
                segment_pages.setdefault(sid, []).append(pid)
            if chain is not None:
                chains.setdefault(chain, {"chain_id": chain, "meta": meta, "sources": []})
                chains[chain]["sources"].append(pid)
        return {
            "user": user,
            "pages": self.user_pages(user_id),
            "chains": list(chains.values()),
            "segments": [
                {
                    "segment_id": r[0],
                    "slot": r[1],
                    "summary": r[2],
                    "keywords": json.loads(r[3]),
                    "n_visit": r[4],
                    "l_interaction": r[5],
                    "last_access": r[6],
                    "created": r[7],
                    "n_pages": r[8],
                    "sources": segment_pages.get(r[0], []),
                }
                for r in segs
            ],
            "user_knowledge": self.owner_knowledge("user", user_id, live_only=False),
            "profile_sources": profile_sources(self, user_id),
            "pending": self.count_pending(user_id),
            "history": self.history(user_id),
        }

    def rows_about(self, user_id: str) -> int:
        """Rows anywhere in the store that name the user or derive from the user's pages (0
        after delete_user, whose one content-free audit event of the deletion is not counted)."""
        total = 0
        for table, col in (
            ("users", "user_id"),
            ("pages", "user_id"),
            ("segments", "user_id"),
            ("pending", "user_id"),
            ("knowledge", "owner_id"),
            ("provenance", "user_id"),
        ):
            total += self.query(f"SELECT COUNT(*) FROM {table} WHERE {col} = ?", (user_id,))[0][0]
        total += self.query(  # assistant entries learned from the user's pages
            "SELECT COUNT(*) FROM knowledge WHERE owner_kind = 'assistant' AND source_user = ?",
            (user_id,),
        )[0][0]
        total += self.query(
            "SELECT COUNT(*) FROM audit WHERE user_id = ? AND NOT (action = 'delete' AND "
            "item_kind = 'user')",
            (user_id,),
        )[0][0]
        return total

    def counts(self) -> dict[str, int]:
        """Rows of each table, pages by tier as ``pages_<tier>``: every tier a page may be in
        (the schemas' CHECK on ``pages.tier``) has its key, 0 when it holds no page (``GROUP
        BY`` names only the tiers in use, and a script reading ``pages_mtm`` of a store whose
        pages were all in STM got a KeyError). SQLite and PostgreSQL stores share this."""
        out = {}
        for table in ("users", "assistants", "segments", "pending", "audit"):
            out[table] = self.query(f"SELECT COUNT(*) FROM {table}")[0][0]
        out.update({f"pages_{tier}": 0 for tier in ("stm", "pending", "mtm", "evicted")})
        for tier, n in self.query("SELECT tier, COUNT(*) FROM pages GROUP BY tier"):
            out[f"pages_{tier}"] = n
        out["knowledge_live"] = self.query("SELECT COUNT(*) FROM knowledge WHERE live = 1")[0][0]
        return out

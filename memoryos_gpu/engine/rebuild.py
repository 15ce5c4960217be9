"""Opening an engine: the store loaded into the arena, then the pending work resumed.

The arena is a cache of the store: everything in it is rebuilt from the store on open.
Vectorised and streamed: the arena is sized once from row counts (no doubling copies), then
segments, pages (embeddings and BM25 term rows) and knowledge arrive in chunks that go
straight into it, so the peak memory is the arena plus one chunk. The texts retrievals show
(pages, knowledge, profiles) are loaded into the in-memory views the same way. Heat is
recomputed, not stored; the keyword statistics are the saved copy plus every page accepted
after it; each user's vocabulary is counted from the pages' stored term rows. The C heap's
free pages are returned to the OS before and after (:mod:`memoryos_gpu.host_memory`): the
chunks' transients, and a closed predecessor's heap, would otherwise stay resident beside the
arena.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np

from memoryos_gpu import ops
from memoryos_gpu.config import ConfigError
from memoryos_gpu.host_memory import return_free_memory
from memoryos_gpu.lexical import terms_from_blobs, terms_to_blobs
from memoryos_gpu.store.errors import StoreError
from memoryos_gpu.store.reads import LOAD_CHUNK, ArenaExtent
from memoryos_gpu.text.keywords import KeywordExtractor

from .page_text import page_terms_of
from .state import EngineHooks, EngineState


class Rebuild:
    """Loads one engine's share of the store (all of it, or a shard's view of it)."""

    def __init__(self, state: EngineState, hooks: EngineHooks) -> None:
        self._s = state
        self._hooks = hooks

    def rebuild(self) -> None:
        """Load the store into the arena and resume pending work (through the engine's
        ``process_pending``, which a shard engine may hold back; a failure of that work leaves
        it pending and the store open: ``_process_owed``)."""
        s = self._s
        extent = self._extent()  # checked before anything is written to the store
        return_free_memory()
        self._backfill_terms()
        self._load(extent)
        self._refit_extractor()
        return_free_memory()
        if s.store.count_pending():
            self._hooks._process_owed()

    def reload(self) -> None:
        """The in-memory state loaded again from the store, after an apply failed halfway
        (:meth:`EngineState.write_transaction`): what the store committed is the truth.
        The keyword statistics stay (refitting them would reread page texts): a failed write
        takes what it taught them back out itself (``write_transaction``'s ``undo``), so they
        count committed pages only. The pending work stays pending for the next round. Under
        the engine lock."""
        with self._s.replaced():
            self._load()
        return_free_memory()

    def _extent(self) -> ArenaExtent:
        """The arena the store's rows need, refused when this engine's ``mtm_capacity`` has
        fewer segment slots than the store uses (:class:`ConfigError`, naming the setting,
        the value the store needs and how to give it).

        Why refused, not evicted down to the new capacity: eviction is derived work with its
        own rule (heat or visits) and writes (the evicted pages leave MTM for good, facts keep
        their provenance), and an open runs for reads too (``retrieve``, ``stats``): a
        smaller capacity given by mistake (the default preset on a store built with
        ``reference``'s 2,000) would have deleted memory silently. The slots above it failed
        the load with an error naming nothing ("segment slot out of range")."""
        s = self._s
        extent = s.store.arena_extent(s.arena.config.block_size, s.memory.knowledge_capacity)
        have = s.memory.mtm_capacity
        if extent.segment_width > have:
            need = extent.segment_width
            raise ConfigError(
                f"mtm_capacity {have} is too small for this store: it holds segments in slots "
                f"up to {need - 1} (it was built with a larger mtm_capacity), so it needs "
                f"mtm_capacity >= {need}. Open it with its own settings: --preset reference "
                f"(mtm_capacity 2000) if it was built with that preset, else [memory] "
                f"mtm_capacity = {need} (or more) in the config file "
                f"(Python: MemoryConfig(mtm_capacity={need}))"
            )
        return extent

    def _load(self, extent: ArenaExtent | None = None) -> None:
        """Users, segments, pages, knowledge, views, profiles and heat, from the store into an
        empty state; ``extent``: the store's, from :meth:`_extent` (read now when not given:
        the open reads it once, before anything is written)."""
        s = self._s
        extent = self._extent() if extent is None else extent
        users = s.store.all_users()
        assistants = s.store.all_assistants()
        s.arena.reserve(
            users=len(users),
            owners=len(users) + len(assistants),
            blocks=extent.blocks,
            segment_width=extent.segment_width,
            knowledge_width=extent.knowledge_width,
        )
        for uid, aid, clock, next_seq, tail, meta, _head in users:
            s.new_user_state(
                uid, aid, clock=clock, next_seq=next_seq, chain_tail=tail, chain_meta=meta
            )
        for aid, head in assistants:
            s.arena.set_ring_head(s.assistant_slot(aid), head)
        for uid, head in ((u[0], u[6]) for u in users):
            s.arena.set_ring_head(s.users[uid].owner, head)
        for uid, page_ids in s.store.load_stm().items():
            s.users[uid].stm.extend(page_ids)
        for _, uid, page_id in s.store.pending("page"):  # out of STM, not in MTM yet
            if uid in s.users:  # a shard's store lists every shard's work
                s.users[uid].pending.append(page_id)
        self._count_vocabulary()
        seg_index = self._load_segments()
        self._load_mtm_pages(*seg_index)
        self._load_knowledge()
        for chunk in s.store.iter_page_views():
            s.views.put_views(chunk)
        s.profiles.update(s.store.profiles(s.users))
        if s.users:  # heat is derived: recompute it at each user's clock
            all_slots = np.array([u.slot for u in s.users.values()], np.int32)
            ops.recompute_heat(
                s.arena,
                all_slots,
                np.array([s.now(u) for u in s.users.values()]),
                s.memory.heat_params(),
            )

    def _user_slots(self, user_ids: list[str]) -> np.ndarray:
        users = self._s.users
        try:
            return np.fromiter((users[u].slot for u in user_ids), np.int32, len(user_ids))
        except KeyError as exc:
            raise StoreError(f"a row belongs to unknown user {exc}; the store is corrupt") from None

    def _load_segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Stream segments into the arena; returns (segment ids ascending, user slot, segment
        slot) so pages can find their segment with one ``searchsorted``.

        The page pool is sized once, after every segment is read: one ``size_segments`` call
        hands out blocks in (user, segment) order, so each user's pages lie together in the
        pool. Streamed in ``segment_id`` order, a user's segments -- made over time between
        other users' -- got blocks scattered over the pool, and a query then read its user's
        page rows from as many places (cache and TLB misses that grow with the store)."""
        s = self._s
        ids, uslots, sslots, npages = [], [], [], []
        for c in s.store.iter_segments(s.embedder.dim, s.memory.keyword_width):
            us = self._user_slots(c["user_id"])
            s.arena.write_segments(
                us,
                c["slot"],
                c["embedding"],
                c["kw_matrix"],
                n_visit=c["n_visit"],
                l_interaction=c["l_interaction"],
                last_access=c["last_access"],
            )
            s.grow_maps()  # the arena may have widened for the stored slots
            s.segment_of[us, c["slot"]] = c["segment_id"]
            ids.append(c["segment_id"])
            uslots.append(us)
            sslots.append(c["slot"])
            npages.append(c["n_pages"])
        if not ids:
            return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32)
        seg_ids, users, slots = np.concatenate(ids), np.concatenate(uslots), np.concatenate(sslots)
        s.arena.size_segments(users, slots, np.concatenate(npages))
        s.grow_maps()  # ... and the pool for their pages
        return seg_ids, users, slots

    def _load_mtm_pages(self, seg_ids: np.ndarray, uslots: np.ndarray, sslots: np.ndarray) -> None:
        """Stream MTM pages into their segments' blocks, each at its stored position."""
        s = self._s
        for c in s.store.iter_mtm_pages(s.embedder.dim):
            if not c["segment_id"].size:  # a shard's view of a chunk of other shards' pages
                continue
            idx = np.searchsorted(seg_ids, c["segment_id"])
            idx = np.minimum(idx, max(seg_ids.size - 1, 0))
            if not seg_ids.size or (seg_ids[idx] != c["segment_id"]).any():
                raise StoreError("an MTM page names a missing segment; the store is corrupt")
            slots = s.arena.place_pages(uslots[idx], sslots[idx], c["seg_pos"])
            s.arena.write_pages(slots, c["embedding"])
            s.arena.write_terms(slots, *terms_from_blobs(c["terms"]).columns())
            s.map_pages(slots, c["page_id"])

    def _backfill_terms(self) -> None:
        """Give pages without a term row (stored before term rows were, schema 1, or set to be
        split again by a migration: schemas 10, 12, 13) their rows, from their text, in the
        store, once, a chunk at a time: every later open loads them like the embeddings."""
        s = self._s
        for chunk in s.store.iter_pages_without_terms():
            terms = page_terms_of([(r[2], r[3], r[4], r[5]) for r in chunk])
            s.store.set_page_terms(
                list(zip([r[0] for r in chunk], terms_to_blobs(terms), strict=True))
            )

    def _count_vocabulary(self) -> None:
        """Each user's document frequencies from every stored page's term row, in chunks
        (the rows a page was accepted with, so a reopen counts what acceptance counted)."""
        s = self._s
        last = 0
        while True:
            rows = s.store.query(
                "SELECT p.page_id, p.user_id, v.terms FROM pages p "
                "JOIN page_vectors v ON v.page_id = p.page_id WHERE p.page_id > ? "
                "ORDER BY p.page_id LIMIT ?",
                (last, LOAD_CHUNK),
            )
            if not rows:
                return
            last = rows[-1][0]
            users = [r[1] for r in rows]
            keep = np.fromiter((u in s.users for u in users), bool, len(users))
            s.vocabulary.add(users, terms_from_blobs([r[2] for r in rows]), keep)

    def _load_knowledge(self) -> None:
        """Stream live knowledge entries into their owners' rings."""
        s = self._s
        cap = s.memory.knowledge_capacity
        for c in s.store.iter_knowledge(s.embedder.dim):
            owners = np.array(
                [
                    s.users[o].owner if k == "user" else s.assistant_slot(o)
                    for k, o in zip(c["owner_kind"], c["owner_id"], strict=True)
                ],
                np.int32,
            )
            ring = (c["seq"] % cap).astype(np.int32)
            s.arena.write_knowledge(owners, ring, c["embedding"])
            s.grow_maps()
            s.entry_of_ring[owners, ring] = c["entry_id"]
            s.views.knowledge.update(zip(c["entry_id"].tolist(), c["text"], strict=True))

    def _refit_extractor(self) -> None:
        """Restore the keyword statistics: the saved copy plus every page of this engine's
        users accepted after it (a crash between saves must not leave pages out of the IDF for
        good). This engine's users only: a shard's view of a shared store (PostgreSQL) sees
        the other shards' pages too, and those reach a shard's statistics through the keyword
        exchange alone (counted here as well, an interrupted ``ingest --ray`` counted them
        twice once resumed)."""
        s = self._s
        blob = s.store.get_meta("keyword_extractor")
        watermark = 0
        if blob:
            saved = json.loads(blob)
            mark = saved.pop("page_watermark", None)
            if mark is None:  # a state saved without a watermark covered every page there was
                mark = s.store.query("SELECT COALESCE(MAX(page_id), 0) FROM pages")[0][0]
            watermark = int(mark)  # 0: saved while the store was empty, covers no page
            s.extractor.__dict__.update(KeywordExtractor.from_dict(saved).__dict__)
        for text in self._own_page_texts(watermark):
            s.extractor.update(text)

    def _own_page_texts(self, watermark: int) -> Iterator[str]:
        """The texts of the loaded users' pages with ``page_id > watermark`` (the users this
        engine loaded are the ones it owns: all of a store's, or a shard's share of it, as
        :meth:`_count_vocabulary` counts them)."""
        users = self._s.users
        rows = self._s.store.query(
            "SELECT user_id, user_input || ' ' || agent_response FROM pages WHERE page_id > ?",
            (watermark,),
        )
        return (text for uid, text in rows if uid in users)

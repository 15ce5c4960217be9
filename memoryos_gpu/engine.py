"""The engine: MemoryOS's three tiers for many users, on the arena, backed by the store.

Life of a page:

1. ``add_many`` validates the pages, embeds them in one batch, and commits them to the store's
   STM in one transaction before returning. A page pushed out of a full STM is marked
   ``pending`` in the same transaction: the store records the derived work still owed.
2. ``process_pending`` (run inside ``add_many`` when ``auto_process``) drains that work in
   *rounds*: each round takes the oldest pending page of every user, so one user's pages are
   applied in order while every stage batches across users. A round runs the chain + summary
   stage (one LLM batch, or extractive), embeds the summaries, matches them against each user's
   segments with one kernel call, inserts (cos + Jaccard >= theta) or opens a segment (evicting
   the lowest-heat one when all slots are live), recomputes heat, and queues promotions. Each
   item's effects and the deletion of its pending row share one transaction.
3. A promoted segment (heat >= tau) sends its unanalysed pages to the profile/knowledge stage;
   facts go to the user's and the assistant's FIFO rings, pages are marked analysed and
   ``L_interaction`` resets.

``retrieve_many`` answers many users' queries with one embedding batch and one pass of each
kernel (segments, pages, user knowledge, assistant knowledge), then feeds heat back.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import unicodedata
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memoryos_gpu import ops, prompts
from memoryos_gpu.arena import NO_ID, Arena, ArenaConfig
from memoryos_gpu.config import EngineConfig, MemoryConfig
from memoryos_gpu.errors import MemoryOSError, UnknownUserError
from memoryos_gpu.lexical import (
    LexicalIndex,
    date_words,
    reciprocal_rank_fusion,
    zscore_fusion,
)
from memoryos_gpu.row_cache import RowCache
from memoryos_gpu.stages import (
    ExtractiveStages,
    LLMStages,
    PageOutcome,
    PageWork,
    PromotionWork,
)
from memoryos_gpu.store import SQLiteStore, open_store
from memoryos_gpu.store.sqlite import PageView, StoreError, blob_matrix, emb_blob
from memoryos_gpu.text.keywords import KeywordExtractor, hash_keywords, keyword_tokens
from memoryos_gpu.types import (
    AddResult,
    KnowledgeEntry,
    PageInput,
    Response,
    Retrieval,
    RetrievedPage,
)

DEFAULT_ASSISTANT = "default"
MAX_TEXT_CHARS = 1_000_000
MAX_ID_CHARS = 256
MAX_META_BYTES = 65_536
_SURROGATE = re.compile("[\ud800-\udfff]")
EXTRACTOR_SAVE_EVERY = 5000  # pages between saves of the keyword statistics


class InvalidInputError(MemoryOSError, ValueError):
    """A page or query was rejected; the message says which field and why."""


@dataclass
class _User:
    user_id: str
    assistant_id: str
    slot: int  # arena user slot
    owner: int  # arena knowledge-ring owner slot of the user's knowledge
    clock: float = 0.0  # logical clock: the newest page timestamp seen
    next_seq: int = 0
    chain_tail: int | None = None
    chain_meta: str | None = None
    stm: deque = field(default_factory=deque)  # page ids, oldest first


def _clean_text(value: Any, what: str) -> str:
    """Normalise text: NFC, lone surrogates -> U+FFFD, control chars other than \\n \\t dropped."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be a string, got {type(value).__name__}")
    text = _SURROGATE.sub("\ufffd", value)
    text = "".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidInputError(f"{what} is {len(text)} characters; the limit is {MAX_TEXT_CHARS}")
    return unicodedata.normalize("NFC", text)


def _clean_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(f"{what} must be a non-empty string")
    if len(value) > MAX_ID_CHARS or any(unicodedata.category(c) in ("Cc", "Cs") for c in value):
        raise InvalidInputError(f"{what} must be at most {MAX_ID_CHARS} printable characters")
    return value


def _timestamp(value: Any) -> float:
    if value is None:
        return time.time()
    if isinstance(value, bool):
        raise InvalidInputError("timestamp must be epoch seconds or an ISO-8601 string")
    if isinstance(value, int | float):
        if not np.isfinite(value):
            raise InvalidInputError("timestamp must be finite")
        return float(value)
    if isinstance(value, str):
        from memoryos_gpu.formats import parse_timestamp

        try:
            return parse_timestamp(value)
        except ValueError as exc:
            raise InvalidInputError(f"timestamp {value!r} does not parse: {exc}") from exc
    raise InvalidInputError(f"timestamp must be a number or string, got {type(value).__name__}")


def _approx_tokens(text: str) -> int:
    """Tokens a prompt would carry: ~4 characters per token (no tokenizer dependency)."""
    return (len(text) + 3) // 4


class MemoryEngine:
    """MemoryOS for many users: STM, MTM, LPM on a shared arena, batched end to end.

    Parameters
    ----------
    config:
        Everything tunable (:class:`~memoryos_gpu.config.EngineConfig`).
    embedder, llm:
        Optional ready-made components (tests pass doubles); built from ``config`` otherwise.
    """

    def __init__(
        self, config: EngineConfig | None = None, *, embedder: Any = None, llm: Any = None
    ) -> None:
        self.config = config or EngineConfig()
        self.memory: MemoryConfig = self.config.memory
        self._lock = threading.RLock()
        self.embedder = embedder or self._make_embedder()
        self.store: SQLiteStore = open_store(self.config.store)
        self.store.check_embedding_model(self.embedder.model_id, self.embedder.dim)
        m = self.memory
        self.arena = Arena(
            ArenaConfig(
                dim=self.embedder.dim,
                segment_slots=m.mtm_capacity,
                keyword_width=m.keyword_width,
                knowledge_capacity=m.knowledge_capacity,
                device=self.config.resolved_device(),
                gpu_dtype=self.config.gpu_dtype,
            )
        )
        self.extractor = KeywordExtractor()
        extractive = ExtractiveStages(
            self.extractor,
            continuity_threshold=m.continuity_threshold,
            page_keywords=m.page_keywords,
        )
        self.llm = llm
        if self.config.llm.mode == "llm":
            self.llm = llm or self._make_llm()
            c = self.config.llm
            self.stages: ExtractiveStages | LLMStages = LLMStages(
                self.llm,
                extractive,
                fused=c.fused,
                max_tokens=c.max_tokens,
                temperature=c.temperature,
                batch_size=c.batch_size,
            )
        else:
            self.stages = extractive
        self.lexical = LexicalIndex(self._lexical_rows) if m.lexical_weight > 0 else None
        # the loaders look the store up at call time: a shard engine wraps it after this
        cache = self.config.row_cache_size
        self._page_views: RowCache[PageView] = RowCache(
            cache, lambda ids: self.store.page_views(ids)
        )
        self._knowledge_texts: RowCache[str] = RowCache(
            cache, lambda ids: self.store.knowledge_texts(ids)
        )
        self._users: dict[str, _User] = {}
        self._assistant_owner: dict[str, int] = {}
        self._page_of_slot = np.full(self.arena.page_live.shape[0], -1, np.int64)
        self._segment_of = np.full((self.arena.user_capacity, m.mtm_capacity), -1, np.int64)
        self._entry_of_ring = np.full(
            (self.arena.owner_capacity, m.knowledge_capacity), -1, np.int64
        )
        self._extractor_saved = 0
        self._dirty_stats: set[tuple[int, int]] = set()  # (user slot, segment slot) hit since
        # the last write transaction: retrievals stay read-only on the store (no fsync)
        self.counters = {
            "pages_added": 0,
            "duplicates_skipped": 0,
            "retrievals": 0,
            "retrieval_tokens": 0,
            "responses": 0,
            "segments_created": 0,
            "segments_evicted": 0,
            "promotions": 0,
        }
        self._rebuild()

    # ================================================================== construction
    def _make_embedder(self) -> Any:
        if self.config.embedder == "hashing":
            from memoryos_gpu.embedding import HashingEmbedder

            return HashingEmbedder()
        from memoryos_gpu.embedding import Embedder

        return Embedder(self.config.embedding_model, batch_size=self.config.embedding_batch_size)

    def _make_llm(self) -> Any:
        from memoryos_gpu.llm.factory import make_backend

        c = self.config.llm
        options = dict(c.options)
        if c.model:
            options["model"] = c.model
        if c.backend in ("openai",):
            options.setdefault("base_url", c.base_url)
            if c.api_key:
                options.setdefault("api_key", c.api_key)
        return make_backend(c.backend, **options)

    def _rebuild(self) -> None:
        """Load the store into the arena and resume pending work.

        Vectorised and streamed: the arena is sized once from row counts (no doubling copies),
        then segments, pages and knowledge arrive in chunks that go straight into it, so the
        peak memory is the arena plus one chunk. Heat is recomputed, not stored.
        """
        users = self.store.all_users()
        assistants = self.store.all_assistants()
        _n_seg, blocks = self.store.segment_block_count(self.arena.config.block_size)
        self.arena.reserve(users=len(users), owners=len(users) + len(assistants), blocks=blocks)
        for uid, aid, clock, next_seq, tail, meta, _head in users:
            self._new_user_state(
                uid, aid, clock=clock, next_seq=next_seq, chain_tail=tail, chain_meta=meta
            )
        for aid, head in assistants:
            self.arena.set_ring_head(self._assistant_slot(aid), head)
        for uid, head in ((u[0], u[6]) for u in users):
            self.arena.set_ring_head(self._users[uid].owner, head)
        for uid, page_ids in self.store.load_stm().items():
            self._users[uid].stm.extend(page_ids)
        seg_index = self._load_segments()
        self._load_mtm_pages(*seg_index)
        self._load_knowledge()
        if self._users:  # heat is derived: recompute it at each user's clock
            all_slots = np.array([u.slot for u in self._users.values()], np.int32)
            ops.recompute_heat(
                self.arena,
                all_slots,
                np.array([self._now(u) for u in self._users.values()]),
                self.memory.heat_params(),
            )
        self._refit_extractor()
        if self.store.count_pending():
            self.process_pending()

    def _user_slots(self, user_ids: list[str]) -> np.ndarray:
        try:
            return np.fromiter((self._users[u].slot for u in user_ids), np.int32, len(user_ids))
        except KeyError as exc:
            raise StoreError(f"a row belongs to unknown user {exc}; the store is corrupt") from None

    def _load_segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Stream segments into the arena; returns (segment ids ascending, user slot, segment
        slot) so pages can find their segment with one ``searchsorted``."""
        ids, uslots, sslots = [], [], []
        for c in self.store.iter_segments(self.embedder.dim, self.memory.keyword_width):
            us = self._user_slots(c["user_id"])
            self.arena.write_segments(
                us,
                c["slot"],
                c["embedding"],
                c["kw_matrix"],
                n_visit=c["n_visit"],
                l_interaction=c["l_interaction"],
                last_access=c["last_access"],
            )
            self.arena.size_segments(us, c["slot"], c["n_pages"])
            self._segment_of[us, c["slot"]] = c["segment_id"]
            ids.append(c["segment_id"])
            uslots.append(us)
            sslots.append(c["slot"])
        if not ids:
            return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32)
        return np.concatenate(ids), np.concatenate(uslots), np.concatenate(sslots)

    def _load_mtm_pages(self, seg_ids: np.ndarray, uslots: np.ndarray, sslots: np.ndarray) -> None:
        """Stream MTM pages into their segments' blocks, each at its stored position."""
        for c in self.store.iter_mtm_pages(self.embedder.dim):
            idx = np.searchsorted(seg_ids, c["segment_id"])
            idx = np.minimum(idx, max(seg_ids.size - 1, 0))
            if not seg_ids.size or (seg_ids[idx] != c["segment_id"]).any():
                raise StoreError("an MTM page names a missing segment; the store is corrupt")
            slots = self.arena.place_pages(uslots[idx], sslots[idx], c["seg_pos"])
            self.arena.write_pages(slots, c["embedding"])
            self._map_pages(slots, c["page_id"])

    def _load_knowledge(self) -> None:
        """Stream live knowledge entries into their owners' rings."""
        cap = self.memory.knowledge_capacity
        for c in self.store.iter_knowledge(self.embedder.dim):
            owners = np.array(
                [
                    self._users[o].owner if k == "user" else self._assistant_slot(o)
                    for k, o in zip(c["owner_kind"], c["owner_id"], strict=True)
                ],
                np.int32,
            )
            ring = (c["seq"] % cap).astype(np.int32)
            self.arena.write_knowledge(owners, ring, c["embedding"])
            self._grow_maps()
            self._entry_of_ring[owners, ring] = c["entry_id"]

    def _refit_extractor(self) -> None:
        """Restore the keyword statistics: the saved copy plus every page accepted after it
        (a crash between saves must not leave pages out of the IDF for good)."""
        state = self.store.get_meta("keyword_extractor")
        watermark = 0
        if state:
            saved = json.loads(state)
            # a state saved without a watermark covered every page there was
            watermark = int(
                saved.pop("page_watermark", None)
                or self.store.query("SELECT COALESCE(MAX(page_id), 0) FROM pages")[0][0]
            )
            self.extractor.__dict__.update(KeywordExtractor.from_dict(saved).__dict__)
        for (text,) in self.store.query(
            "SELECT user_input || ' ' || agent_response FROM pages WHERE page_id > ?", (watermark,)
        ):
            self.extractor.update(text)

    # ================================================================== slot bookkeeping
    def _grow_maps(self) -> None:
        a = self.arena
        if self._page_of_slot.size < a.page_live.shape[0]:
            extra = a.page_live.shape[0] - self._page_of_slot.size
            self._page_of_slot = np.concatenate([self._page_of_slot, np.full(extra, -1, np.int64)])
        if self._segment_of.shape[0] < a.user_capacity:
            extra = a.user_capacity - self._segment_of.shape[0]
            self._segment_of = np.concatenate(
                [self._segment_of, np.full((extra, self.memory.mtm_capacity), -1, np.int64)]
            )
        if self._entry_of_ring.shape[0] < a.owner_capacity:
            extra = a.owner_capacity - self._entry_of_ring.shape[0]
            self._entry_of_ring = np.concatenate(
                [
                    self._entry_of_ring,
                    np.full((extra, self.memory.knowledge_capacity), -1, np.int64),
                ]
            )

    def _map_pages(self, pool_slots: np.ndarray, page_ids: np.ndarray) -> None:
        self._grow_maps()
        self._page_of_slot[pool_slots] = page_ids

    def _assistant_slot(self, assistant_id: str) -> int:
        if assistant_id not in self._assistant_owner:
            self._assistant_owner[assistant_id] = int(self.arena.add_owners(1)[0])
            self._grow_maps()
        return self._assistant_owner[assistant_id]

    def _new_user_state(self, user_id: str, assistant_id: str, **kw: Any) -> _User:
        slot = int(self.arena.add_users(1)[0])
        owner = int(self.arena.add_owners(1)[0])
        self._assistant_slot(assistant_id)
        self._grow_maps()
        state = _User(user_id, assistant_id, slot, owner, **kw)
        self._users[user_id] = state
        return state

    def _user(self, user_id: str) -> _User:
        try:
            return self._users[user_id]
        except KeyError:
            raise UnknownUserError(f"unknown user {user_id!r}") from None

    def _now(self, user: _User, at: float | None = None) -> float:
        if at is not None:
            return float(at)
        return user.clock if self.memory.clock == "logical" else time.time()

    # ================================================================== add
    def add(
        self,
        user_id: str,
        user_input: str,
        agent_response: str = "",
        *,
        timestamp: float | str | None = None,
        assistant_id: str | None = None,
        source: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> AddResult:
        """Remember one exchange (committed to the store before this returns)."""
        return self.add_many(
            [
                PageInput(
                    user_id, user_input, agent_response, timestamp, assistant_id, source, meta or {}
                )
            ]
        )[0]

    def add_many(self, pages: Iterable[PageInput | dict[str, Any]]) -> list[AddResult]:
        """Remember many exchanges of many users, in order per user, as one transaction.

        Pages whose ``source`` was accepted before are skipped (``duplicate=True``). Derived work
        runs afterwards when ``config.auto_process`` (else call :meth:`process_pending`).
        """
        items = [self.validate_page(p) for p in pages]
        with self._lock:
            results = self._accept(items)
            if self.config.auto_process:
                self.process_pending()
        return results

    def validate_page(self, p: PageInput | dict[str, Any]) -> PageInput:
        """The normalised page ``add_many`` would store, or InvalidInputError saying why not
        (lets a bulk reader reject one record without failing its batch)."""
        if isinstance(p, dict):
            unknown = set(p) - set(PageInput.__dataclass_fields__)
            if unknown:
                raise InvalidInputError(f"unknown page field(s): {sorted(unknown)}")
            try:
                p = PageInput(**p)
            except TypeError as exc:
                raise InvalidInputError(str(exc)) from exc
        if not isinstance(p, PageInput):
            raise InvalidInputError(f"a page must be a PageInput or dict, got {type(p).__name__}")
        if not isinstance(p.meta, dict):
            raise InvalidInputError("meta must be a dict")
        try:
            encoded = json.dumps(p.meta, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"meta must be JSON-serialisable: {exc}") from exc
        if len(encoded) > MAX_META_BYTES:
            raise InvalidInputError(
                f"meta is {len(encoded)} bytes as JSON; the limit is {MAX_META_BYTES}"
            )
        return PageInput(
            user_id=_clean_id(p.user_id, "user_id"),
            user_input=_clean_text(p.user_input, "user_input"),
            agent_response=_clean_text(
                p.agent_response if p.agent_response is not None else "", "agent_response"
            ),
            timestamp=_timestamp(p.timestamp),
            assistant_id=_clean_id(p.assistant_id, "assistant_id") if p.assistant_id else None,
            source=_clean_id(p.source, "source") if p.source else None,
            meta=p.meta,
        )

    def _accept(self, items: list[PageInput]) -> list[AddResult]:
        """Commit pages (and the pending work their STM overflow creates) in one transaction.

        The in-memory user state is changed only as the transaction goes; if it fails, that
        state is restored and new users' arena slots are released, so memory and store agree.
        """
        known = self.store.known_sources(p.source for p in items if p.source)
        fresh = [i for i, p in enumerate(items) if not (p.source and p.source in known)]
        emb = self.embedder.encode([self.page_text(items[i]) for i in fresh]) if fresh else []
        vec_of = dict(zip(fresh, emb, strict=True))
        touched = {p.user_id for p in items}
        snapshot = {
            uid: (u.clock, u.next_seq, deque(u.stm))
            for uid, u in self._users.items()
            if uid in touched
        }
        counters = dict(self.counters)
        new_users: list[_User] = []
        try:
            results = self._insert_pages(items, known, vec_of, new_users)
        except BaseException:
            for uid, (clock, next_seq, stm) in snapshot.items():
                u = self._users[uid]
                u.clock, u.next_seq, u.stm = clock, next_seq, stm
            for u in new_users:
                self.arena.remove_user(u.slot)
                self.arena.remove_owner(u.owner)
                self._users.pop(u.user_id, None)
            self.counters = counters
            raise
        for i in fresh:
            self.extractor.update(f"{items[i].user_input} {items[i].agent_response}")
        return results

    def _insert_pages(
        self,
        items: list[PageInput],
        known: dict[str, int],
        vec_of: dict[int, np.ndarray],
        new_users: list[_User],
    ) -> list[AddResult]:
        seen_sources: dict[str, int] = {}
        results: list[AddResult] = []
        now = time.time()
        with self.store.transaction() as db:
            self._flush_stats(db)
            for i, p in enumerate(items):
                if p.source and (p.source in known or p.source in seen_sources):
                    pid = known.get(p.source, seen_sources.get(p.source))
                    results.append(AddResult(int(pid), p.user_id, duplicate=True))
                    self.counters["duplicates_skipped"] += 1
                    continue
                user = self._users.get(p.user_id)
                if user is None:
                    aid = p.assistant_id or DEFAULT_ASSISTANT
                    self.store.ensure_user(p.user_id, aid, now)
                    user = self._new_user_state(p.user_id, aid)
                    new_users.append(user)
                cur = db.execute(
                    "INSERT INTO pages(user_id, seq, user_input, agent_response, timestamp, tier, "
                    "embedding, source, extra, created) VALUES (?, ?, ?, ?, ?, 'stm', ?, ?, ?, ?) "
                    "RETURNING page_id",
                    (
                        p.user_id,
                        user.next_seq,
                        p.user_input,
                        p.agent_response,
                        p.timestamp,
                        emb_blob(vec_of[i]),
                        p.source,
                        json.dumps(p.meta, ensure_ascii=False),
                        now,
                    ),
                )
                page_id = cur.fetchone()[0]
                user.next_seq += 1
                user.clock = max(user.clock, float(p.timestamp))
                user.stm.append(page_id)
                while len(user.stm) > self.memory.stm_capacity:
                    old = user.stm.popleft()
                    db.execute("UPDATE pages SET tier = 'pending' WHERE page_id = ?", (old,))
                    db.execute(
                        "INSERT INTO pending(user_id, kind, ref, created) VALUES (?, 'page', ?, ?)",
                        (p.user_id, old, now),
                    )
                db.execute(
                    "UPDATE users SET clock = ?, next_seq = ? WHERE user_id = ?",
                    (user.clock, user.next_seq, p.user_id),
                )
                self.store.audit(db, p.user_id, "add", "page", page_id)
                if p.source:
                    seen_sources[p.source] = page_id
                results.append(AddResult(page_id, p.user_id))
                self.counters["pages_added"] += 1
        return results

    @staticmethod
    def _speakers(meta: dict[str, Any] | None) -> tuple[str, str]:
        """Names of the two sides when the log has them (``user_name``/``assistant_name``, or a
        LoCoMo reader's ``speaker_a``/``speaker_b``): questions often name people."""
        meta = meta or {}
        return (
            str(meta.get("user_name") or meta.get("speaker_a") or "User"),
            str(meta.get("assistant_name") or meta.get("speaker_b") or "Assistant"),
        )

    def page_text(self, page: Any) -> str:
        """The text a page is embedded and keyword-indexed from: its date written out (when
        ``embed_dates``), then each side's words after its speaker's name."""
        get = (lambda k: getattr(page, k)) if hasattr(page, "user_input") else page.get
        # a PageInput carries .meta; a store row carries "extra" ("meta" is its chain summary)
        meta = page.meta if isinstance(page, PageInput) else page.get("extra")
        user, assistant = self._speakers(meta)
        text = f"{user}: {get('user_input')} {assistant}: {get('agent_response')}"
        if self.memory.embed_dates and get("timestamp") is not None:
            text = f"[{date_words(float(get('timestamp')))}] {text}"
        return text

    def _lexical_rows(self, user_id: str) -> list[tuple[int, str, float]]:
        rows = self.store.query(
            "SELECT page_id, user_input, agent_response, timestamp, extra FROM pages "
            "WHERE user_id = ? AND tier = 'mtm'",
            (user_id,),
        )
        return [
            (r[0], self._lexical_text(r[1], r[2], json.loads(r[4] or "{}")), r[3]) for r in rows
        ]

    def _lexical_text(self, user_input: str, agent_response: str, meta: dict[str, Any]) -> str:
        user, assistant = self._speakers(meta)
        return f"{user} {user_input} {assistant} {agent_response}"

    # ================================================================== derived work
    def process_pending(self, max_batch: int | None = None) -> dict[str, int]:
        """Run every pending derived item (chain, MTM, promotion) to completion.

        Work goes in rounds: each round takes the oldest pending page of each user that has
        one (so a user's pages keep their order), at most ``max_batch`` (default
        ``config.derived_max_batch``) pages, and runs them as one batch through every stage
        (the LLM stages split it into ``llm.batch_size`` calls). ``max_batch=1`` is the
        reference's one-page-at-a-time processing.

        Safe to call at any time and after a crash: each item is applied and removed from the
        pending table in one transaction, so nothing is done twice.
        """
        limit = self.config.derived_max_batch if max_batch is None else max_batch
        if limit < 1:
            raise InvalidInputError("max_batch must be >= 1")
        done = {"pages": 0, "promotions": 0}
        while True:  # the lock is released between rounds so retrievals interleave
            with self._lock:
                round_items = self.store.pending_round("page", limit)
                if not round_items:
                    break
                self._process_pages(round_items)
                done["pages"] += len(round_items)
                done["promotions"] += self._process_promotions()
        with self._lock:
            done["promotions"] += self._process_promotions()
            if self.counters["pages_added"] - self._extractor_saved >= EXTRACTOR_SAVE_EVERY:
                self._save_extractor()
        return done

    def _save_extractor(self) -> None:
        """Persist the keyword statistics (IDF); reopening refits them from the pages if the
        saved copy is missing, so saving is an optimisation, not a durability requirement."""
        top = self.store.query("SELECT COALESCE(MAX(page_id), 0) FROM pages")[0][0]
        self.store.set_meta(
            "keyword_extractor", json.dumps({**self.extractor.to_dict(), "page_watermark": top})
        )
        self._extractor_saved = self.counters["pages_added"]

    def _process_pages(self, items: list[tuple[int, str, int]]) -> None:
        d = self.embedder.dim
        page_ids = [ref for _, _, ref in items]
        rows = self.store.page_rows(page_ids)
        embs = self.store.page_embeddings(page_ids, d)
        users = [self._user(uid) for _, uid, _ in items]
        prev_ids = [u.chain_tail for u in users]
        prev_rows = self.store.page_rows([p for p in prev_ids if p is not None])
        prev_embs = dict(
            zip(
                [p for p in prev_ids if p is not None],
                self.store.page_embeddings([p for p in prev_ids if p is not None], d),
                strict=True,
            )
        )
        work = [
            PageWork(
                rows[pid],
                embs[i],
                prev_rows.get(prev) if prev else None,
                prev_embs.get(prev) if prev else None,
                u.chain_meta,
            )
            for i, (pid, prev, u) in enumerate(zip(page_ids, prev_ids, users, strict=True))
        ]
        outcomes = self.stages.pages(work)
        for o in outcomes:  # LLM keywords may be phrases: one normalised token list, once
            o.keywords = keyword_tokens(o.keywords)
        summary_emb = self._summary_embeddings(outcomes, embs, [rows[p] for p in page_ids])
        kw_rows = self._keyword_rows([o.keywords for o in outcomes])
        uslots = np.array([u.slot for u in users], np.int32)
        best_score, best_slot = ops.match_segments(self.arena, summary_emb, uslots, kw_rows)
        best_score, best_slot = _host(best_score), _host(best_slot)
        join = (best_slot >= 0) & (best_score >= self.memory.theta)
        self._make_room([u for u, j in zip(users, join, strict=True) if not j])
        seg_info = self._segment_rows(
            [
                int(self._segment_of[u.slot, s])
                for u, s, j in zip(users, best_slot, join, strict=True)
                if j
            ]
        )
        with self.store.transaction() as db:
            for i, (work_id, _uid, pid) in enumerate(items):
                self._apply_page(
                    db,
                    users[i],
                    pid,
                    rows[pid],
                    embs[i],
                    outcomes[i],
                    summary_emb[i],
                    bool(join[i]),
                    int(best_slot[i]),
                    seg_info,
                )
                db.execute("DELETE FROM pending WHERE work_id = ?", (work_id,))
            self._refresh_heat(db, users)

    def _summary_embeddings(
        self, outcomes: Sequence[PageOutcome], page_emb: np.ndarray, rows: Sequence[dict]
    ) -> np.ndarray:
        """What a page contributes to its segment's embedding e_s.

        LLM mode: the embedding of the LLM's topic summary (the paper). Extractive mode: the
        page's own embedding -- the page is its best extractive summary, while the embedding of
        a first sentence ("Hey Mel, what's up?") routes queries to the wrong segments (LoCoMo
        dev, routed dense recall@10: 0.32 with first-sentence embeddings). It also saves one
        embedding per page.
        """
        if self.stages.mode == "extractive":
            return page_emb
        return self.embedder.encode(
            [o.summary or r["user_input"] for o, r in zip(outcomes, rows, strict=True)]
        )

    def _keyword_rows(self, token_lists: Sequence[Sequence[str]]) -> np.ndarray:
        """Normalised keyword tokens (best first) -> the arena's padded rows of hashed ids."""
        width = self.memory.keyword_width
        out = np.full((len(token_lists), width), -1, np.int32)
        for i, tokens in enumerate(token_lists):
            ids = hash_keywords(tokens[:width])
            out[i, : ids.size] = ids
        return out

    def _segment_rows(self, segment_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Current summary, keywords, embedding and statistics of segments (one query)."""
        ids = sorted(set(segment_ids))
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self.store.query(
            "SELECT segment_id, summary, keywords, embedding, n_pages, l_interaction, "
            f"last_access FROM segments WHERE segment_id IN ({marks})",
            ids,
        )
        emb = blob_matrix([r[3] for r in rows], self.embedder.dim)
        return {
            r[0]: {
                "summary": r[1],
                "keywords": json.loads(r[2]),
                "embedding": e,
                "n_pages": r[4],
                "l_interaction": r[5],
                "last_access": r[6],
            }
            for r, e in zip(rows, emb, strict=True)
        }

    def _make_room(self, users: Sequence[_User]) -> None:
        """Users about to open a segment with every slot live lose their lowest-heat one."""
        full = [u for u in users if self.arena.free_segment_slot(u.slot) == NO_ID]
        if not full:
            return
        slots = np.array([u.slot for u in full], np.int32)
        now = np.array([self._now(u) for u in full])
        _, victims = ops.recompute_heat(
            self.arena, slots, now, self.memory.heat_params(), np.ones(len(full), np.uint8)
        )
        with self.store.transaction() as db:
            for u, v in zip(full, victims, strict=True):
                self._evict_segment(db, u, int(v))

    def _evict_segment(self, db: Any, user: _User, slot: int) -> None:
        sid = int(self._segment_of[user.slot, slot])
        pool = self.arena.segment_pages(user.slot, slot)
        if self.lexical is not None:
            self.lexical.remove(user.user_id, self._page_of_slot[pool])
        self._page_of_slot[pool] = -1
        self.arena.free_segments(np.array([user.slot]), np.array([slot]))
        self._segment_of[user.slot, slot] = -1
        db.execute(
            "UPDATE pages SET tier = 'evicted', segment_id = NULL WHERE segment_id = ?", (sid,)
        )
        db.execute("DELETE FROM pending WHERE kind = 'promote' AND ref = ?", (sid,))
        db.execute("DELETE FROM segments WHERE segment_id = ?", (sid,))
        self.store.audit(db, user.user_id, "evict", "segment", sid, {"slot": slot})
        self.counters["segments_evicted"] += 1

    def _apply_page(
        self,
        db: Any,
        user: _User,
        page_id: int,
        row: dict[str, Any],
        page_emb: np.ndarray,
        out: PageOutcome,
        summary_emb: np.ndarray,
        join: bool,
        slot: int,
        seg_info: dict[int, dict[str, Any]],
    ) -> None:
        now = self._now(user)
        kw_counts: dict[str, int]
        if join:
            sid = int(self._segment_of[user.slot, slot])
            info = seg_info[sid]
            n = info["n_pages"]
            emb = info["embedding"] * n + summary_emb / max(1e-12, np.linalg.norm(summary_emb))
            emb = emb / max(1e-12, float(np.linalg.norm(emb)))
            kw_counts = dict(info["keywords"])
            for w in out.keywords:
                kw_counts[w] = kw_counts.get(w, 0) + 1
            summary = _merge_summary(info["summary"], out.summary, self.memory.summary_chars)
            l_inter = info["l_interaction"] + 1
            last = max(info["last_access"], now)
            kw_row = self._kw_matrix(kw_counts)
            info.update(
                embedding=emb,
                keywords=kw_counts,
                summary=summary,
                n_pages=n + 1,
                l_interaction=l_inter,
                last_access=last,
            )
            db.execute(
                "UPDATE segments SET summary = ?, keywords = ?, kw_ids = ?, embedding = ?, "
                "l_interaction = ?, last_access = ?, n_pages = ? WHERE segment_id = ?",
                (
                    summary,
                    json.dumps(kw_counts),
                    _kw_blob(kw_row),
                    emb_blob(emb),
                    l_inter,
                    last,
                    n + 1,
                    sid,
                ),
            )
            self.arena.write_segments(
                [user.slot],
                [slot],
                emb[None],
                kw_row,
                l_interaction=[l_inter],
                last_access=[last],
            )
            seg_pos = n
        else:
            slot = self.arena.free_segment_slot(user.slot)
            emb = summary_emb / max(1e-12, float(np.linalg.norm(summary_emb)))
            kw_counts = {w: 1 for w in out.keywords}
            kw_row = self._kw_matrix(kw_counts)
            summary = out.summary[: self.memory.summary_chars]
            cur = db.execute(
                "INSERT INTO segments(user_id, slot, summary, keywords, kw_ids, embedding, "
                "n_visit, l_interaction, last_access, created, n_pages) "
                "VALUES (?, ?, ?, ?, ?, ?, 0, 1, ?, ?, 1) RETURNING segment_id",
                (
                    user.user_id,
                    slot,
                    summary,
                    json.dumps(kw_counts),
                    _kw_blob(kw_row),
                    emb_blob(emb),
                    now,
                    now,
                ),
            )
            sid = cur.fetchone()[0]
            self._segment_of[user.slot, slot] = sid
            self.arena.write_segments(
                [user.slot],
                [slot],
                emb[None],
                kw_row,
                n_visit=[0],
                l_interaction=[1],
                last_access=[now],
            )
            self.counters["segments_created"] += 1
            seg_pos = 0
        pool = self.arena.append_pages([user.slot], [slot], page_emb[None])
        self._map_pages(pool, np.array([page_id]))
        if self.lexical is not None:
            self.lexical.add(
                user.user_id,
                page_id,
                self._lexical_text(row["user_input"], row["agent_response"], row["extra"]),
                row["timestamp"],
            )
        # dialogue chain: link to the previous evicted page, regenerate the chain's meta
        prev = user.chain_tail if out.continuous else None
        if prev is not None:
            chain_id = self.store.query(
                "SELECT COALESCE(chain_id, page_id) FROM pages WHERE page_id = ?", (prev,)
            )[0][0]
            db.execute("UPDATE pages SET next_page = ? WHERE page_id = ?", (page_id, prev))
            chain = db.execute(
                "UPDATE pages SET meta = ? WHERE chain_id = ? RETURNING page_id",
                (out.meta, chain_id),
            ).fetchall()
            self._page_views.forget(r[0] for r in chain)
        else:
            chain_id = page_id
        db.execute(
            "UPDATE pages SET tier = 'mtm', segment_id = ?, seg_pos = ?, prev_page = ?, "
            "chain_id = ?, meta = ?, summary = ?, keywords = ?, mode = ? WHERE page_id = ?",
            (
                sid,
                seg_pos,
                prev,
                chain_id,
                out.meta,
                out.summary,
                json.dumps(out.keywords),
                out.mode,
                page_id,
            ),
        )
        self._page_views.forget([page_id])  # it has a chain and meta now
        user.chain_tail, user.chain_meta = page_id, out.meta
        db.execute(
            "UPDATE users SET chain_tail = ?, chain_meta = ? WHERE user_id = ?",
            (page_id, out.meta, user.user_id),
        )

    def _kw_top(self, counts: dict[str, int]) -> list[str]:
        ranked = sorted(counts, key=lambda w: -counts[w])  # stable: first seen wins ties
        return ranked[: self.memory.keyword_width]

    def _kw_matrix(self, counts: dict[str, int]) -> np.ndarray:
        return self._keyword_rows([self._kw_top(counts)])

    def _refresh_heat(self, db: Any, users: Sequence[_User], at: float | None = None) -> int:
        """Recompute heat for users at their "now" and queue promotions: segments at or over
        tau that hold pages not yet analysed (L_interaction > 0; after a promotion it is 0, so
        a segment hot from visits alone is not promoted again and again). ``db``: the open
        transaction to write in, or None to open one only if something is queued."""
        uniq = list({u.user_id: u for u in users}.values())
        if not uniq:
            return 0
        slots = np.array([u.slot for u in uniq], np.int32)
        now = np.array([self._now(u, at) for u in uniq])
        promote, _ = ops.recompute_heat(self.arena, slots, now, self.memory.heat_params())
        if promote.any():
            promote &= self.arena.pull_heat(slots)["l_interaction"] > 0
        rows, cols = np.nonzero(promote)
        if not rows.size:
            return 0
        t = time.time()
        items = [
            (uniq[r].user_id, int(self._segment_of[uniq[r].slot, c]), t)
            for r, c in zip(rows, cols, strict=True)
        ]
        if db is None:
            with self.store.transaction() as own:
                self._queue_promotions(own, items)
        else:
            self._queue_promotions(db, items)
        return len(items)

    def _queue_promotions(self, db: Any, items: list[tuple[str, int, float]]) -> None:
        self._flush_stats(db)
        db.executemany(
            "INSERT INTO pending(user_id, kind, ref, created) "
            "VALUES (?, 'promote', ?, ?) ON CONFLICT DO NOTHING",
            items,
        )

    def _flush_stats(self, db: Any) -> None:
        """Write the heat statistics changed by retrievals since the last write transaction.

        Retrievals only mark segments dirty, so a read never waits on an fsync; the marks ride
        along with the next write (or close). A crash can lose recent visit counts, never pages.
        """
        if not self._dirty_stats:
            return
        pairs = sorted(self._dirty_stats)
        self._dirty_stats.clear()
        u = np.array([p[0] for p in pairs], np.int64)
        s = np.array([p[1] for p in pairs], np.int64)
        sid = self._segment_of[u, s]
        keep = sid >= 0
        if not keep.any():
            return
        u, s, sid = u[keep], s[keep], sid[keep]
        stats = self.arena.pull_heat(u)
        r = np.arange(u.size)
        db.executemany(
            "UPDATE segments SET n_visit = ?, last_access = ? WHERE segment_id = ?",
            [
                (int(nv), float(la), int(x))
                for nv, la, x in zip(
                    stats["n_visit"][r, s], stats["last_access"][r, s], sid, strict=True
                )
            ],
        )

    def _process_promotions(self) -> int:
        items = self.store.pending("promote")
        if not items:
            return 0
        sids = [sid for _, _, sid in items]
        marks = ",".join("?" * len(sids))
        unanalysed: dict[int, list[tuple]] = {}
        for row in self.store.query(  # one query for every promoted segment's pages
            "SELECT segment_id, page_id, user_input, agent_response, timestamp FROM pages "
            f"WHERE segment_id IN ({marks}) AND analysed = 0 ORDER BY segment_id, seg_pos",
            sids,
        ):
            unanalysed.setdefault(row[0], []).append(row[1:])
        profiles = self.store.profiles({uid for _, uid, _ in items})
        work, valid = [], []
        for work_id, uid, sid in items:
            pages = unanalysed.get(sid, [])
            if uid not in self._users or not pages:
                valid.append((work_id, uid, sid, None, []))
                continue
            profile = profiles[uid]
            rows = [{"user_input": p[1], "agent_response": p[2], "timestamp": p[3]} for p in pages]
            work.append(PromotionWork(profile, rows))
            valid.append((work_id, uid, sid, profile, [p[0] for p in pages]))
        outcomes = iter(self.stages.promotions(work))
        facts: list[tuple[str, str, str, str]] = []  # (kind, owner, text, mode)
        results = []
        for work_id, uid, sid, profile, page_ids in valid:
            out = next(outcomes) if profile is not None else None
            results.append((work_id, uid, sid, profile, page_ids, out))
            if out is not None:
                aid = self._users[uid].assistant_id
                facts += [("user", uid, f, out.mode) for f in out.user_facts]
                facts += [("assistant", aid, f, out.mode) for f in out.assistant_facts]
        fact_emb = self.embedder.encode([f[2] for f in facts]) if facts else None
        with self.store.transaction() as db:
            for work_id, uid, sid, profile, page_ids, out in results:
                db.execute("DELETE FROM pending WHERE work_id = ?", (work_id,))
                if out is None:
                    continue
                user = self._users[uid]
                if out.profile_updates:
                    profile = {**profile, **out.profile_updates}
                    db.execute(
                        "UPDATE users SET profile = ? WHERE user_id = ?",
                        (json.dumps(profile, ensure_ascii=False), uid),
                    )
                marks = ",".join("?" * len(page_ids))
                db.execute(f"UPDATE pages SET analysed = 1 WHERE page_id IN ({marks})", page_ids)
                slot = int(np.flatnonzero(self._segment_of[user.slot] == sid)[0])
                reset = {"l_interaction": [0]}
                if self.memory.reset_visits_on_promotion:
                    reset["n_visit"] = [0]
                self.arena.set_segment_stats([user.slot], [slot], **reset)
                db.execute(
                    "UPDATE segments SET l_interaction = 0"
                    + (", n_visit = 0" if self.memory.reset_visits_on_promotion else "")
                    + " WHERE segment_id = ?",
                    (sid,),
                )
                self.store.audit(
                    db, uid, "promote", "segment", sid, {"pages": len(page_ids), "mode": out.mode}
                )
                self.counters["promotions"] += 1
            if facts:
                self._push_knowledge(db, facts, fact_emb)
            self._refresh_heat(db, [self._users[r[1]] for r in results if r[1] in self._users])
        return len(items)

    def _push_knowledge(
        self, db: Any, facts: list[tuple[str, str, str, str]], emb: np.ndarray
    ) -> None:
        cap = self.memory.knowledge_capacity
        owners = np.array(
            [
                self._users[o].owner if k == "user" else self._assistant_slot(o)
                for k, o, _, _ in facts
            ],
            np.int32,
        )
        heads = {int(o): self.arena.ring_head(int(o)) for o in owners}
        ring = self.arena.push_knowledge(owners, emb)
        self._grow_maps()
        t = time.time()
        for (kind, owner_id, text, mode), o, r, vec in zip(facts, owners, ring, emb, strict=True):
            seq = heads[int(o)]
            heads[int(o)] += 1
            db.execute(
                "UPDATE knowledge SET live = 0 WHERE owner_kind = ? AND owner_id = ? AND seq <= ?",
                (kind, owner_id, seq - cap),
            )
            cur = db.execute(
                "INSERT INTO knowledge(owner_kind, owner_id, seq, text, embedding, "
                "mode, created) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING entry_id",
                (kind, owner_id, seq, text, emb_blob(vec), mode, t),
            )
            self._entry_of_ring[o, r] = cur.fetchone()[0]
            table = "users" if kind == "user" else "assistants"
            key = "user_id" if kind == "user" else "assistant_id"
            db.execute(
                f"UPDATE {table} SET knowledge_head = ? WHERE {key} = ?", (seq + 1, owner_id)
            )

    # ================================================================== retrieval
    def retrieve(
        self,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
        at: float | None = None,
    ) -> Retrieval:
        """STM whole, the top MTM pages, and LPM profile + knowledge for one query."""
        return self.retrieve_many(
            [(user_id, query)], top_pages=top_pages, top_segments=top_segments, at=at
        )[0]

    def retrieve_many(
        self,
        queries: Sequence[tuple[str, str]],
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
        at: float | None = None,
        update_heat: bool = True,
    ) -> list[Retrieval]:
        """Many users' queries in one batched pass: one embedding batch, one call per kernel."""
        m = self.memory
        k_pages = m.top_pages if top_pages is None else top_pages
        k_segs = m.top_segments if top_segments is None else top_segments
        if k_pages < 1 or k_segs < 1:
            raise InvalidInputError("top_pages and top_segments must be >= 1")
        cleaned = [(_clean_id(u, "user_id"), _clean_text(q, "query")) for u, q in queries]
        if not cleaned:
            return []
        with self._lock:
            users = [self._user(u) for u, _ in cleaned]
            texts = [q for _, q in cleaned]
            q_emb = self.embedder.encode(texts)
            q_kw = self._keyword_rows([self.extractor.extract(t, m.page_keywords) for t in texts])
            uslots = np.array([u.slot for u in users], np.int32)
            _, chosen = ops.score_segments(
                self.arena, q_emb, uslots, q_kw, k_segs, m.query_keyword_weight
            )
            k_dense = max(k_pages, m.fusion_candidates) if self.lexical else k_pages
            p_scores, p_slots = ops.select_pages(
                self.arena, q_emb, uslots, _host(chosen), k_dense, m.page_min_score
            )
            ranked = self._rank_pages(cleaned, _host(p_scores), _host(p_slots), k_pages)
            k_kn = m.knowledge_top_k
            u_scores, u_ring = ops.knowledge_topk(self.arena, q_emb, [u.owner for u in users], k_kn)
            a_owner = [self._assistant_owner[u.assistant_id] for u in users]
            a_scores, a_ring = ops.knowledge_topk(self.arena, q_emb, a_owner, k_kn)
            chosen = _host(chosen)
            if update_heat:
                self._feed_heat(users, chosen, at)
            self.counters["retrievals"] += len(users)
            return self._assemble(
                cleaned,
                users,
                ranked,
                _host(u_scores),
                _host(u_ring),
                a_owner,
                _host(a_scores),
                _host(a_ring),
            )

    def _rank_pages(
        self, cleaned: Sequence[tuple[str, str]], scores: np.ndarray, slots: np.ndarray, k: int
    ) -> list[list[tuple[int, float]]]:
        """Per query: (page id, score) best first. The kernels' dense ranking (cosines), or,
        when ``lexical_weight > 0``, its candidates fused with the user's BM25 keyword index:
        by default a weighted sum of each list's standardised scores (``fusion="zscore"``, the
        score returned is that sum), or weighted reciprocal rank (``fusion="rrf"``)."""
        m = self.memory
        out = []
        for (uid, query), s_row, p_row in zip(cleaned, scores, slots, strict=True):
            dense = [
                (int(self._page_of_slot[p]), float(s))
                for p, s in zip(p_row, s_row, strict=True)
                if p >= 0
            ]
            if self.lexical is None:
                out.append(dense[:k])
                continue
            lexical = self.lexical.search(uid, query, m.fusion_candidates)
            if m.fusion == "rrf":
                fused = reciprocal_rank_fusion(
                    [([p for p, _ in dense], 1.0), ([p for p, _ in lexical], m.lexical_weight)]
                )
            else:
                fused = zscore_fusion([(dense, 1.0), (lexical, m.lexical_weight)])
            out.append(fused[:k])
        return out

    def _feed_heat(self, users: Sequence[_User], chosen: np.ndarray, at: float | None) -> None:
        rows, cols = np.nonzero(chosen >= 0)
        if rows.size:
            hit_users = np.array([users[r].slot for r in rows], np.int32)
            now = np.array([self._now(users[r], at) for r in rows])
            ops.apply_hits(self.arena, hit_users, chosen[rows, cols], now)
            self._dirty_stats.update(
                zip(hit_users.tolist(), chosen[rows, cols].tolist(), strict=True)
            )
        if self._refresh_heat(None, users, at) and self.config.auto_process:
            self._process_promotions()

    def _assemble(
        self, cleaned, users, ranked, u_scores, u_ring, a_owner, a_scores, a_ring
    ) -> list[Retrieval]:
        stm_ids = [list(u.stm) for u in users]
        need = {p for r in ranked for p, _ in r} | {p for s in stm_ids for p in s}
        views = self._page_views.get_many(need)
        entry_ids = {
            int(self._entry_of_ring[u.owner, r])
            for u, rr in zip(users, u_ring, strict=True)
            for r in rr
            if r >= 0
        }
        entry_ids |= {
            int(self._entry_of_ring[o, r])
            for o, rr in zip(a_owner, a_ring, strict=True)
            for r in rr
            if r >= 0
        }
        texts = self._knowledge_texts.get_many(entry_ids)
        profiles = self.store.profiles({uid for uid, _ in cleaned})
        out = []
        for i, ((uid, q), u) in enumerate(zip(cleaned, users, strict=True)):
            pages = [_retrieved(p, views[p], "mtm", s) for p, s in ranked[i]]
            stm = [_retrieved(p, views[p], "stm", None) for p in stm_ids[i]]
            uk = [
                KnowledgeEntry(
                    int(self._entry_of_ring[u.owner, r]),
                    texts[int(self._entry_of_ring[u.owner, r])],
                    float(s),
                )
                for r, s in zip(u_ring[i], u_scores[i], strict=True)
                if r >= 0
            ]
            ak = [
                KnowledgeEntry(
                    int(self._entry_of_ring[a_owner[i], r]),
                    texts[int(self._entry_of_ring[a_owner[i], r])],
                    float(s),
                )
                for r, s in zip(a_ring[i], a_scores[i], strict=True)
                if r >= 0
            ]
            ret = Retrieval(uid, q, stm, pages, profiles.get(uid, {}), uk, ak)
            ret.retrieval_tokens = _approx_tokens(_context_text(ret))
            self.counters["retrieval_tokens"] += ret.retrieval_tokens
            out.append(ret)
        return out

    # ================================================================== response
    def respond(self, user_id: str, query: str, **kw: Any) -> Response:
        """Answer with memory (retrieve, prompt the LLM), then remember the exchange."""
        return self.respond_many([(user_id, query)], **kw)[0]

    def respond_many(
        self,
        queries: Sequence[tuple[str, str]],
        *,
        timestamp: float | str | None = None,
        assistant_id: str | None = None,
    ) -> list[Response]:
        """Answer many users at once: one retrieval pass, one LLM batch, one add_many.

        A user with no memory yet is answered from empty memory (and created by the add).
        A failed generation is returned with its error and not stored as a page.
        """
        if not isinstance(self.stages, LLMStages):
            raise MemoryOSError("respond needs an LLM backend: set config.llm.mode = 'llm'")
        queries = [(_clean_id(u, "user_id"), _clean_text(q, "query")) for u, q in queries]
        found = iter(self.retrieve_many([q for q in queries if q[0] in self._users]))
        retrievals = [
            next(found) if u in self._users else Retrieval(u, q, [], [], {}, [], [])
            for u, q in queries
        ]
        assistants = [
            self._users[r.user_id].assistant_id
            if r.user_id in self._users
            else (assistant_id or DEFAULT_ASSISTANT)
            for r in retrievals
        ]
        messages = [
            prompts.response(
                r.query,
                _page_dicts(r.stm),
                _page_dicts(r.pages),
                r.profile,
                [e.text for e in r.user_knowledge],
                [e.text for e in r.assistant_knowledge],
                a,
            )
            for r, a in zip(retrievals, assistants, strict=True)
        ]
        results = self.stages.respond(messages)
        ok = [i for i, res in enumerate(results) if not res.error]
        added = self.add_many(
            [
                PageInput(
                    retrievals[i].user_id,
                    retrievals[i].query,
                    results[i].text or "",
                    timestamp,
                    assistants[i],
                )
                for i in ok
            ]
        )
        page_of = {i: a.page_id for i, a in zip(ok, added, strict=True)}
        self.counters["responses"] += len(ok)
        return [
            Response(
                r.user_id,
                r.query,
                res.text,
                r,
                page_of.get(i),
                res.prompt_tokens,
                res.completion_tokens,
                res.error,
            )
            for i, (r, res) in enumerate(zip(retrievals, results, strict=True))
        ]

    def promote(self, user_id: str, segment_slot: int | None = None) -> int:
        """Force promotion of a user's segments now (all with unanalysed pages, or one slot):
        what the reference calls mid-term analysis. Returns the promotions processed."""
        with self._lock:
            user = self._user(user_id)
            slots = (
                self.arena.live_segments(user.slot)
                if segment_slot is None
                else np.array([segment_slot])
            )
            with self.store.transaction() as db:
                db.executemany(
                    "INSERT INTO pending(user_id, kind, ref, created) "
                    "VALUES (?, 'promote', ?, ?) ON CONFLICT DO NOTHING",
                    [
                        (user_id, int(self._segment_of[user.slot, s]), time.time())
                        for s in slots
                        if self._segment_of[user.slot, s] >= 0
                    ],
                )
            return self._process_promotions()

    # ================================================================== LPM access
    def profile(self, user_id: str) -> dict[str, str]:
        self._user(user_id)
        return self.store.user_row(user_id)["profile"]

    def knowledge(self, user_id: str) -> dict[str, list[dict[str, Any]]]:
        """Live user knowledge and the user's assistant's knowledge, oldest first."""
        u = self._user(user_id)
        return {
            "user": self.store.owner_knowledge("user", user_id),
            "assistant": self.store.owner_knowledge("assistant", u.assistant_id),
        }

    def users(self) -> list[str]:
        with self._lock:
            return list(self._users)

    # ================================================================== item-level control
    def get_page(self, page_id: int) -> dict[str, Any] | None:
        return self.store.page_rows([page_id]).get(int(page_id))

    def update_page(
        self, page_id: int, *, user_input: str | None = None, agent_response: str | None = None
    ) -> dict[str, Any]:
        """Edit a page's text; its embedding (and its arena row, when in MTM) follow."""
        with self._lock:
            row = self.get_page(page_id)
            if row is None:
                raise KeyError(f"no page {page_id}")
            new = {
                "user_input": _clean_text(user_input, "user_input")
                if user_input is not None
                else row["user_input"],
                "agent_response": _clean_text(agent_response, "agent_response")
                if agent_response is not None
                else row["agent_response"],
            }
            vec = self.embedder.encode([self.page_text({**row, **new})])[0]
            with self.store.transaction() as db:
                db.execute(
                    "UPDATE pages SET user_input = ?, agent_response = ?, embedding = ? "
                    "WHERE page_id = ?",
                    (new["user_input"], new["agent_response"], emb_blob(vec), page_id),
                )
                self._page_views.forget([page_id])
                self.store.audit(
                    db,
                    row["user_id"],
                    "update",
                    "page",
                    page_id,
                    {"before": {k: row[k] for k in new}, "after": new},
                )
            slots = np.flatnonzero(self._page_of_slot == page_id)
            if slots.size:
                self.arena.write_page_embeddings(slots, vec[None])
                if self.lexical is not None:
                    self.lexical.add(
                        row["user_id"],
                        page_id,
                        self._lexical_text(new["user_input"], new["agent_response"], row["extra"]),
                        row["timestamp"],
                    )
            return self.get_page(page_id)

    def delete_page(self, page_id: int) -> bool:
        with self._lock:
            row = self.get_page(page_id)
            if row is None:
                return False
            slots = np.flatnonzero(self._page_of_slot == page_id)
            self.arena.delete_pages(slots)
            self._page_of_slot[slots] = -1
            if self.lexical is not None:
                self.lexical.remove(row["user_id"], [page_id])
            user = self._users.get(row["user_id"])
            with self.store.transaction() as db:
                db.execute("DELETE FROM pending WHERE kind = 'page' AND ref = ?", (page_id,))
                db.execute("UPDATE pages SET next_page = NULL WHERE next_page = ?", (page_id,))
                db.execute("UPDATE pages SET prev_page = NULL WHERE prev_page = ?", (page_id,))
                db.execute("DELETE FROM pages WHERE page_id = ?", (page_id,))
                self._page_views.forget([page_id])
                if user is not None and page_id in user.stm:
                    user.stm.remove(page_id)
                if user is not None and user.chain_tail == page_id:
                    user.chain_tail = None
                    db.execute(
                        "UPDATE users SET chain_tail = NULL WHERE user_id = ?", (user.user_id,)
                    )
                self.store.audit(
                    db,
                    row["user_id"],
                    "delete",
                    "page",
                    page_id,
                    {"before": {k: row[k] for k in ("user_input", "agent_response")}},
                )
            return True

    def update_knowledge(self, entry_id: int, text: str) -> dict[str, Any]:
        with self._lock:
            rows = self.store.knowledge_rows([entry_id])
            if entry_id not in rows:
                raise KeyError(f"no knowledge entry {entry_id}")
            row, text = rows[entry_id], _clean_text(text, "text")
            vec = self.embedder.encode([text])[0]
            with self.store.transaction() as db:
                db.execute(
                    "UPDATE knowledge SET text = ?, embedding = ? WHERE entry_id = ?",
                    (text, emb_blob(vec), entry_id),
                )
                self._knowledge_texts.forget([entry_id])
                self.store.audit(
                    db,
                    self._audit_owner(row),
                    "update",
                    "knowledge",
                    entry_id,
                    {"before": row["text"], "after": text},
                )
            where = np.argwhere(self._entry_of_ring == entry_id)
            if where.size:
                self.arena.write_knowledge(where[:, 0], where[:, 1], vec[None])
            return self.store.knowledge_rows([entry_id])[entry_id]

    def delete_knowledge(self, entry_id: int) -> bool:
        with self._lock:
            rows = self.store.knowledge_rows([entry_id])
            if entry_id not in rows:
                return False
            where = np.argwhere(self._entry_of_ring == entry_id)
            if where.size:
                self.arena.delete_knowledge(where[:, 0], where[:, 1])
                self._entry_of_ring[where[:, 0], where[:, 1]] = -1
            with self.store.transaction() as db:
                db.execute("DELETE FROM knowledge WHERE entry_id = ?", (entry_id,))
                self._knowledge_texts.forget([entry_id])
                self.store.audit(
                    db,
                    self._audit_owner(rows[entry_id]),
                    "delete",
                    "knowledge",
                    entry_id,
                    {"before": rows[entry_id]["text"]},
                )
            return True

    @staticmethod
    def _audit_owner(row: dict[str, Any]) -> str:
        return row["owner_id"] if row["owner_kind"] == "user" else f"assistant:{row['owner_id']}"

    def history(self, user_id: str) -> list[dict[str, Any]]:
        """Append-only audit of changes to the user's memory."""
        return self.store.history(user_id)

    # ================================================================== export / delete / stats
    def export_user(self, user_id: str) -> dict[str, Any]:
        """Everything held about a user, derived profile and knowledge included (JSON-ready)."""
        with self._lock:
            self.sync()
            data = self.store.export_user(user_id)
            if data is None:
                raise UnknownUserError(f"unknown user {user_id!r}")
            data["assistant_knowledge"] = self.store.owner_knowledge(
                "assistant", data["user"]["assistant_id"]
            )
            return data

    def delete_user(self, user_id: str) -> bool:
        """Remove every row and arena slot held about the user."""
        with self._lock:
            self._page_views.clear()  # cheaper than finding the user's ids; deletes are rare
            self._knowledge_texts.clear()
            user = self._users.pop(user_id, None)
            if user is None:
                return self.store.delete_user(user_id)
            live = self.arena.live_segments(user.slot)
            for s in live:
                self._page_of_slot[self.arena.segment_pages(user.slot, int(s))] = -1
            self.arena.remove_user(user.slot)
            self.arena.remove_owner(user.owner)
            self._segment_of[user.slot] = -1
            self._entry_of_ring[user.owner] = -1
            if self.lexical is not None:  # its keyword index holds the user's words
                self.lexical.drop_user(user_id)
            return self.store.delete_user(user_id)

    def pending_count(self, user_id: str | None = None) -> int:
        return self.store.count_pending(user_id)

    def flush(self) -> dict[str, int]:
        """Finish all derived work now (read-your-writes for a following retrieval)."""
        return self.process_pending()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "users": len(self._users),
                "store": self.store.counts(),
                "arena_bytes": self.arena.nbytes(),
                "device": "cuda" if self.arena.on_cuda else "cpu",
                "mode": self.stages.mode,
                "preset": self.memory.preset,
                "counters": dict(self.counters),
                "row_cache": {
                    "pages": self._page_views.stats(),
                    "knowledge": self._knowledge_texts.stats(),
                },
                "llm": self.stages.stats.as_dict(),
                "embedder": getattr(getattr(self.embedder, "stats", None), "__dict__", {}),
                "native": ops.build_info(),
            }

    def sync(self) -> None:
        """Write retrieval-driven heat statistics to the store now (they otherwise ride along
        with the next write transaction)."""
        with self._lock:
            if self._dirty_stats:
                with self.store.transaction() as db:
                    self._flush_stats(db)

    def close(self) -> None:
        with self._lock:
            self.sync()
            self._save_extractor()
            self.store.close()
            if self.llm is not None:
                self.llm.close()

    def __enter__(self) -> MemoryEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ================================================================== async twins
    async def aadd_many(self, pages: Iterable[PageInput | dict[str, Any]]) -> list[AddResult]:
        return await asyncio.to_thread(self.add_many, list(pages))

    async def aretrieve_many(
        self, queries: Sequence[tuple[str, str]], **kw: Any
    ) -> list[Retrieval]:
        return await asyncio.to_thread(self.retrieve_many, queries, **kw)

    async def arespond_many(self, queries: Sequence[tuple[str, str]], **kw: Any) -> list[Response]:
        return await asyncio.to_thread(self.respond_many, queries, **kw)

    async def aflush(self) -> dict[str, int]:
        return await asyncio.to_thread(self.flush)


# ====================================================================== helpers
def _host(x: Any) -> np.ndarray:
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def _kw_blob(kw_row: np.ndarray) -> bytes:
    """The store's copy of a segment's hashed keyword ids (one ``[1, K]`` arena row, unpadded)."""
    row = kw_row[0]
    return np.ascontiguousarray(row[row >= 0], "<i4").tobytes()


def _merge_summary(old: str, new: str, cap: int) -> str:
    """A segment's summary: its pages' topic summaries, newest last, capped at ``cap`` chars."""
    if not new or new in old:
        return old
    merged = f"{old} | {new}" if old else new
    return merged if len(merged) <= cap else merged[-cap:]


def _retrieved(page_id: int, v: PageView, tier: str, score: float | None) -> RetrievedPage:
    # a copy of ``extra``: the cached view is shared by every retrieval of the page
    return RetrievedPage(
        page_id, v.user_input, v.agent_response, v.timestamp, tier, score, v.meta, dict(v.extra)
    )


def _page_dicts(pages: Sequence[RetrievedPage]) -> list[dict[str, Any]]:
    return [
        {
            "user_input": p.user_input,
            "agent_response": p.agent_response,
            "timestamp": p.timestamp,
            "meta": p.meta,
        }
        for p in pages
    ]


def _context_text(r: Retrieval) -> str:
    parts = [f"{p.user_input} {p.agent_response} {p.meta or ''}" for p in r.all_pages()]
    parts += [e.text for e in (*r.user_knowledge, *r.assistant_knowledge)]
    parts += [f"{k}: {v}" for k, v in r.profile.items()]
    return "\n".join(parts)

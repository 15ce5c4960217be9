"""What a round of MTM work carries between its steps (:mod:`~memoryos_gpu.engine.mtm`): the
inputs it read under the engine lock, what the stages made of them, a wave's items to apply,
and the rows its waves write once for the whole round (:class:`RoundWrites`), plus the two
encodings of a segment's row that deletion (:mod:`~memoryos_gpu.engine.forget`) shares.

Why a module of its own: the waves of a round are applied one after another in one
transaction, and what they share (the chain of each page linked so far, each touched
segment's row, the statements written once at the end) is state of the round, not of the
engine; keeping it here leaves :mod:`~memoryos_gpu.engine.mtm` the matching, joining,
opening and eviction of segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memoryos_gpu.json_codec import dumps_text
from memoryos_gpu.lexical import PageTerms
from memoryos_gpu.stage_prompts.rendering import grapheme_ceil
from memoryos_gpu.stages import PageOutcome, PageWork
from memoryos_gpu.store.rows import emb_blobs

from .state import UserState, WorkItem


@dataclass
class RoundInput:
    """What a round read under the lock: its items, the stage inputs, and what they depend on
    (each user's record, chain tail and meta as read, the engine's edit count)."""

    items: list[WorkItem]
    users: list[UserState]
    tails: list[tuple[int | None, str | None]]
    embs: np.ndarray
    work: list[PageWork]
    edits: int
    terms: PageTerms  # the pages' BM25 rows, as stored with them
    clocks: np.ndarray  # each page's time when it left STM (NaN: not recorded)


@dataclass
class SegmentRow:
    """A segment's row as a round's waves change it (its summary, keyword counts, unit
    embedding and keyword row, page count), where it lives in the arena, and whether a
    join changed it (a segment the round opened is written by its INSERT)."""

    summary: str
    counts: dict[str, int]
    emb: np.ndarray
    kw_row: np.ndarray
    n_pages: int
    uslot: int
    slot: int
    joined: bool = False


@dataclass
class RoundWrites:
    """What the waves of a round share while they are applied in its one transaction: the
    chain of each page linked so far (a user's next page links to it without asking the
    store), and the rows no later wave reads, written once for the round by :meth:`flush`
    (a user's backlog is a wave per page: one statement of each kind a round, not a wave) --
    the pending rows of the items applied, the chain links, each chain's meta and each
    user's chain tail (the last written wins, as the waves' statements would have)."""

    chains: dict[int, int] = field(default_factory=dict)
    segments: dict[int, SegmentRow] = field(default_factory=dict)  # by segment id
    done: list[int] = field(default_factory=list)
    next_page: list[tuple[int, int]] = field(default_factory=list)  # (next, page)
    chain_meta: dict[int, tuple[str, str | None]] = field(default_factory=dict)
    tails: dict[str, int] = field(default_factory=dict)

    def flush(self, db: Any, arena: Any) -> None:
        self._flush_segments(db, arena)
        db.executemany("DELETE FROM pending WHERE work_id = ?", [(w,) for w in self.done])
        db.executemany("UPDATE pages SET next_page = ? WHERE page_id = ?", self.next_page)
        db.executemany(
            "INSERT INTO chains(chain_id, user_id, meta) VALUES (?, ?, ?) "
            "ON CONFLICT(chain_id) DO UPDATE SET meta = excluded.meta",
            [(chain, user, meta) for chain, (user, meta) in self.chain_meta.items()],
        )
        db.executemany(
            "UPDATE users SET chain_tail = ? WHERE user_id = ?",
            [(page, user) for user, page in self.tails.items()],
        )

    def _flush_segments(self, db: Any, arena: Any) -> None:
        """The joined segments' rows as the round left them; L_interaction and last access
        from the arena, which took every change in order (a promotion claim in a later wave
        restarts L_interaction there and in the store at once)."""
        rows = [(sid, r) for sid, r in self.segments.items() if r.joined]
        if not rows:
            return
        users = np.array([r.uslot for _, r in rows], np.int32)
        slots = np.array([r.slot for _, r in rows], np.int32)
        heat = arena.pull_heat(users)
        at = (np.arange(users.size), slots)
        db.executemany(
            "UPDATE segments SET summary = ?, keywords = ?, kw_ids = ?, embedding = ?, "
            "l_interaction = ?, last_access = ?, n_pages = ? WHERE segment_id = ?",
            zip(
                [r.summary for _, r in rows],
                [dumps_text(r.counts) for _, r in rows],
                [kw_blob(r.kw_row) for _, r in rows],
                emb_blobs([r.emb for _, r in rows]),
                heat["l_interaction"][at].tolist(),
                heat["last_access"][at].tolist(),
                [r.n_pages for _, r in rows],
                [sid for sid, _ in rows],
                strict=True,
            ),
        )


@dataclass
class Wave:
    """The items of a wave to apply (those still current), with what the round read and the
    stages made of them, by position."""

    items: list[WorkItem]
    users: list[UserState]
    embs: np.ndarray
    terms: PageTerms
    outcomes: list[PageOutcome]
    summary_emb: np.ndarray
    kw_rows: np.ndarray
    clocks: np.ndarray


@dataclass
class RoundOutput:
    """What the stages made of a round, before anything is applied."""

    outcomes: list[PageOutcome]
    summary_emb: np.ndarray
    kw_rows: np.ndarray


@dataclass
class Round:
    """The pages of a round being applied, by position: their users, outcomes, what each
    contributes to its segment's embedding, and (filled in as it goes) the segment each joins
    or opens and its position there."""

    users: list[UserState]
    uslots: np.ndarray
    outcomes: list[PageOutcome]
    summary_emb: np.ndarray
    now: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.users)
        self.seg_slot = np.full(n, -1, np.int32)
        self.segment_id = np.full(n, -1, np.int64)
        self.seg_pos = np.zeros(n, np.int64)


def kw_blob(row: np.ndarray) -> bytes:
    """The store's copy of a segment's hashed keyword ids (its ``[K]`` arena row, unpadded)."""
    return np.ascontiguousarray(row[row >= 0], "<i4").tobytes()


def merge_summary(old: str, new: str, cap: int) -> str:
    """A segment's summary: its pages' topic summaries, newest last, capped at ``cap`` chars.
    The oldest words go first, whole: a summary never opens mid-word (nor on a separator),
    nor inside a grapheme (a ZWJ emoji's tail, a flag's second half, a lone combining mark),
    which scripts without spaces would otherwise meet where no space realigns the cut."""
    if not new or new in old:
        return old
    merged = f"{old} | {new}" if old else new
    if len(merged) <= cap:
        return merged
    start = grapheme_ceil(merged, len(merged) - cap)
    tail = merged[start:]
    if merged[start - 1] != " " and " " in tail:  # the cut fell inside a word: drop its rest
        tail = tail[tail.index(" ") + 1 :]
    return tail.lstrip(" |")

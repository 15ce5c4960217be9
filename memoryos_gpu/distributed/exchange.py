"""Keyword statistics across shards: every shard ranks keywords as if it had seen every page.

**Why.** The keyword extractor's document frequencies (its IDF) are corpus-wide in one engine,
but a shard accepts only its own users' pages. So shards exchange the frequencies of the pages
they accepted: each shard keeps the texts it accepted since the last exchange
(:meth:`KeywordExchange.take_keyword_delta`), and every other shard adds them
(:meth:`KeywordExchange.apply_keyword_delta`; a router runs the round: :func:`exchange_keywords`).
With that, a :class:`~memoryos_gpu.distributed.sharding.ShardedEngine` produces the same pages,
segments and retrievals as one :class:`~memoryos_gpu.engine.MemoryEngine` fed the same calls
(tests/test_distributed.py checks it).

**Exchange by marks.** Texts kept in memory are lost with the process: pages no exchange has
given the other shards yet (an ``ingest --ray`` stopped before its exchange) are found by the
*exchange marks* saved with each shard's statistics, through which page of every shard they
count (:meth:`KeywordExchange.exchange_marks`); an exchange by marks sends the pages above them
and saves the statistics with the new marks in one write
(:meth:`KeywordExchange.apply_exchange`). The Ray ingest driver runs one after its last window;
the *catch-up* (:func:`catch_up_rounds`) is one run by a
:class:`~memoryos_gpu.distributed.sharding.ShardedEngine`'s open before the work the store owes
(:func:`catch_up_keywords`), and by the router of ``serve --ray`` and ``serve --engines`` before
its first exchange by deltas (:func:`catch_up_async`).

The shard engine's side lives here as a mixin of
:class:`~memoryos_gpu.distributed.sharding.ShardEngine` (:class:`KeywordExchange`), the router's
side as functions over the shards' answers, so in-process routers and Ray drivers share both.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

from memoryos_gpu.text.keywords import KeywordExtractor

from .layout import EXTRACTOR_KEY

if TYPE_CHECKING:
    from .sharding import ShardEngine

__all__ = [
    "EXCHANGE_MARKS",
    "KeywordExchange",
    "catch_up_async",
    "catch_up_keywords",
    "catch_up_rounds",
    "exchange_keywords",
    "exchange_receipts",
    "exchange_senders",
    "merge_deltas",
    "sent_documents",
]

#: The exchange marks saved with a shard's keyword statistics
#: (:meth:`KeywordExchange.exchange_marks`).
EXCHANGE_MARKS = "ray_exchanged"


# ============================================================================ the shard's side
class KeywordExchange:
    """The keyword-statistics side of a shard engine (mixed into
    :class:`~memoryos_gpu.distributed.sharding.ShardEngine`, before ``MemoryEngine``): the texts
    accepted since the last exchange, the deltas it sends, the deltas it adds, and the exchange
    marks saved with its statistics. Uses the engine's ``extractor``, ``store``, ``_lock`` and
    ``_state`` (its ``locked()``: the rewrite gate, then the engine lock, for a store write),
    and the shard engine's ``owns`` and ``shard_count``."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._kw_texts: list[str] = []  # accepted since the last keyword exchange
        self._kw_lock = threading.Lock()
        # whether an exchange by deltas took texts: the statistics then count pages their saved
        # marks do not say (an exchange by marks no longer adds to them, see exchange_marks)
        self._kw_exchanged = False
        super().__init__(*args, **kw)  # the engine (its hooks below use the state above)
        self._opened_top = self.page_watermark()

    # ------------------------------------------------------------------ the engine's hooks
    def _learn_keywords(self, texts: list[str]) -> None:
        """The engine's hook for the texts its keyword statistics learn on acceptance: kept
        for the next exchange with the other shards too."""
        super()._learn_keywords(texts)
        with self._kw_lock:
            self._kw_texts.extend(texts)

    def _unlearn_keywords(self, texts: list[str]) -> None:
        """A rolled-back batch's texts out of the statistics and out of the next exchange
        (those an exchange already took are the other shards' to count: they stay)."""
        super()._unlearn_keywords(texts)
        owed = Counter(texts)
        with self._kw_lock:
            kept = []
            for t in reversed(self._kw_texts):  # the batch's are the latest
                if owed[t] > 0:
                    owed[t] -= 1
                else:
                    kept.append(t)
            self._kw_texts = kept[::-1]

    # ------------------------------------------------------------------ deltas
    def _scratch_extractor(self) -> KeywordExtractor:
        ex = self.extractor
        return KeywordExtractor(
            stopwords=ex.stopwords,
            language_stopwords=ex.language_stopwords,
            proper_noun_boost=ex.proper_noun_boost,
            number_boost=ex.number_boost,
            min_len=ex.min_len,
            fold_plurals=ex.fold_plurals,
        )

    def take_keyword_delta(self) -> dict[str, Any]:
        """Document frequencies of the pages accepted since the last call (and forget them)."""
        with self._kw_lock:
            texts, self._kw_texts = self._kw_texts, []
            self._kw_exchanged = True
        return _delta_of(self._scratch_extractor().update(texts))

    def keyword_delta_since(
        self, page_watermark: int, through: int | None = None
    ) -> dict[str, Any]:
        """Document frequencies of this shard's pages with ``page_id > page_watermark``, read
        from the store: exact even when the process restarted in between (ingestion). Those
        up to ``through`` only, when given (pages this engine accepted since it opened are
        left to the exchange by deltas); without it, every page, and the texts kept for the
        next exchange by deltas are dropped (this one counts them)."""
        bound, args = "", [int(page_watermark)]
        if through is None:
            with self._kw_lock:
                self._kw_texts.clear()
        else:
            bound = " AND page_id <= ?"
            args.append(int(through))
        scratch = self._scratch_extractor()
        rows = self.store.query(
            "SELECT user_id, user_input || ' ' || agent_response FROM pages WHERE page_id > ?"
            f"{bound} ORDER BY page_id",
            tuple(args),
        )
        scratch.update(text for uid, text in rows if self.owns(uid))
        return _delta_of(scratch)

    def apply_keyword_delta(self, delta: dict[str, Any]) -> None:
        """Add other shards' document frequencies to this shard's keyword statistics."""
        with self._lock:
            self.extractor.df.update(delta["df"])
            self.extractor.n_docs += int(delta["n_docs"])

    def page_watermark(self) -> int:
        """The largest page id in the store (pages added later have larger ids)."""
        return int(self.store.query("SELECT COALESCE(MAX(page_id), 0) FROM pages")[0][0])

    def opened_watermark(self) -> int:
        """:meth:`page_watermark` when this engine opened: the pages it accepted since are
        above it (those reach the other shards through the exchange by deltas)."""
        return self._opened_top

    # ------------------------------------------------------------------ exchange by marks
    def exchange_marks(self, tops: list[int]) -> list[int]:
        """Receiver side of an exchange by marks (:func:`catch_up_keywords`, the Ray ingest
        driver): through which page id of each shard's store (``[i]``) this shard's keyword
        statistics count that shard's pages. Statistics never saved count none (the open
        refits them from this shard's own pages): zeros. Saved with marks (by an exchange by
        marks): those marks. Saved by an engine (it writes no marks, and saves after its
        exchanges): every page there is, ``tops``, saved now with the statistics, so that a
        run stopped before its exchange leaves marks below the pages it committed and the
        next exchange by marks sends those pages too.

        Once an exchange by deltas took this engine's texts (:meth:`take_keyword_delta`), its
        statistics count pages that no saved mark says, and an exchange by marks would add
        them again: it then answers ``tops`` and saves nothing (the router exchanges by marks
        before its first exchange by deltas, :func:`catch_up_rounds`, so this is a second
        router's late catch-up)."""
        if self._kw_exchanged:
            return list(tops)
        raw = self.store.get_meta(EXTRACTOR_KEY)
        if raw is None:
            return [0] * self.shard_count
        saved = json.loads(raw).get(EXCHANGE_MARKS)
        if isinstance(saved, dict) and saved.get("count") == self.shard_count:
            return [int(m) for m in saved["through"]]
        self.save_keywords(list(tops))
        return list(tops)

    def keyword_deltas(self, since: Sequence[int], through: int | None = None) -> dict[str, Any]:
        """Sender side: this shard's last page id (``top``) and the document frequencies of its
        pages above each mark of ``since``, up to ``top`` (the caller accepts nothing
        meanwhile). With ``through`` (:meth:`opened_watermark`), up to it: ``top`` is
        ``through``, and pages accepted meanwhile are left to the exchange by deltas."""
        if through is None:
            top = self.page_watermark()
            return {"top": top, "deltas": {m: self.keyword_delta_since(m) for m in since}}
        return {
            "top": int(through),
            "deltas": {m: self.keyword_delta_since(m, through) for m in since},
        }

    def apply_exchange(self, delta: dict[str, Any], through: list[int]) -> None:
        """Receiver side: add the other shards' frequencies and save them with the new marks in
        one write, so a statistic and the mark that says it is counted are never apart."""
        with self._state.locked():  # touches the store: the rewrite gate first (engine/state.py)
            self.apply_keyword_delta(delta)
            self.save_keywords(through)

    def save_keywords(self, through: list[int]) -> None:
        """The keyword statistics as the engine saves them (the state and the page watermark
        the open refits from), plus the exchange marks ``through``."""
        with self._state.locked():
            state = {
                **self.extractor.to_dict(),
                "page_watermark": self.page_watermark(),
                EXCHANGE_MARKS: {"count": self.shard_count, "through": list(through)},
            }
            self.store.set_meta(EXTRACTOR_KEY, json.dumps(state))


# ============================================================================ the router's side
def _delta_of(scratch: KeywordExtractor) -> dict[str, Any]:
    return {"n_docs": scratch.n_docs, "df": dict(scratch.df)}


def merge_deltas(deltas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The sum of keyword deltas."""
    df: Counter[str] = Counter()
    for d in deltas:
        df.update(d["df"])
    return {"n_docs": sum(int(d["n_docs"]) for d in deltas), "df": dict(df)}


def exchange_senders(marks: Sequence[Sequence[int]]) -> list[list[int]]:
    """For an exchange by marks (``marks[j][i]``: through which page of shard ``i`` receiver
    ``j`` counts), the marks each shard ``i`` sends its pages above (one delta per distinct
    mark, ascending)."""
    n = len(marks)
    return [sorted({marks[j][i] for j in range(n) if j != i}) for i in range(n)]


def exchange_receipts(
    marks: Sequence[Sequence[int]], sent: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """What each receiver ``j`` adds: every other shard ``i``'s delta above ``marks[j][i]``
    (``sent[i]``: :meth:`ShardEngine.keyword_deltas` of :func:`exchange_senders`' marks)."""
    n = len(marks)
    return [
        merge_deltas([sent[i]["deltas"][marks[j][i]] for i in range(n) if i != j]) for j in range(n)
    ]


def sent_documents(marks: Sequence[Sequence[int]], sent: Sequence[dict[str, Any]]) -> int:
    """The documents an exchange by marks sent: each shard's pages above its lowest mark."""
    since = exchange_senders(marks)
    return sum(int(sent[i]["deltas"][s[0]]["n_docs"]) for i, s in enumerate(since) if s)


#: One round of calls on the shard engines, one per shard in shard order: a method name and its
#: arguments, or None for no call on that shard.
Calls = list[tuple[str, tuple[Any, ...]] | None]


def catch_up_rounds(count: int) -> Generator[Calls, list[Any], int]:
    """The catch-up on open, as rounds of calls on ``count`` shard engines, so that every
    router runs the same one wherever its shards are (:func:`catch_up_keywords` in one
    process; ``serve --ray`` and ``serve --engines``, awaited: :func:`catch_up_async`).

    An exchange by marks: each shard gets the keyword statistics of the other shards' pages
    its own do not count yet (those an ``ingest --ray`` committed before it was stopped) and
    saves them with the marks that say so. It reaches only the pages each shard held when it
    opened (:meth:`KeywordExchange.opened_watermark`), so the shards may take writes
    meanwhile: those reach the others through the exchange by deltas, and count once. Run it
    before a router's first exchange by deltas. Each round yields its calls and is sent back
    their answers; returns the documents sent."""
    tops = yield [("opened_watermark", ())] * count
    marks = yield [("exchange_marks", (tops,))] * count
    since = exchange_senders(marks)
    sent = yield [("keyword_deltas", (since[i], tops[i])) for i in range(count)]
    receipts = exchange_receipts(marks, sent)
    yield [  # (a shard with nothing new: no call, no write)
        ("apply_exchange", (receipts[j], tops))
        if any(marks[j][i] != tops[i] for i in range(count) if i != j)
        else None
        for j in range(count)
    ]
    return sent_documents(marks, sent)


def catch_up_keywords(engines: Sequence[ShardEngine]) -> int:
    """:func:`catch_up_rounds` on shard engines in this process (a :class:`ShardedEngine`'s
    open, before they accept anything). Returns the documents sent."""
    rounds = catch_up_rounds(len(engines))
    answers: list[Any] | None = None
    while True:
        try:
            calls = rounds.send(answers)  # (None starts it)
        except StopIteration as done:
            return int(done.value)
        answers = [
            None if c is None else getattr(engines[i], c[0])(*c[1]) for i, c in enumerate(calls)
        ]


async def catch_up_async(
    call: Callable[[int, str, tuple[Any, ...]], Awaitable[Any]], count: int
) -> int:
    """:func:`catch_up_rounds` through ``call(shard, method, args)`` (a router's call of a
    shard engine's method by name), each round's calls at once. Returns the documents sent."""
    rounds = catch_up_rounds(count)
    answers: list[Any] | None = None
    while True:
        try:
            calls = rounds.send(answers)  # (None starts it)
        except StopIteration as done:
            return int(done.value)
        answers = list(
            await asyncio.gather(
                *(_no_call() if c is None else call(i, *c) for i, c in enumerate(calls))
            )
        )


async def _no_call() -> None:
    return None


def exchange_keywords(
    take: Sequence[Callable[[], dict[str, Any]]], apply: Sequence[Callable[[dict], None]]
) -> int:
    """Give every shard the keyword delta of every other shard; returns documents exchanged."""
    deltas = [t() for t in take]
    total = merge_deltas(deltas)
    if not total["n_docs"]:
        return 0
    for i, fn in enumerate(apply):
        others = merge_deltas([d for j, d in enumerate(deltas) if j != i])
        if others["n_docs"]:
            fn(others)
    return int(total["n_docs"])

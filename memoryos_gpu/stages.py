"""The LLM stages of MemoryOS, each run as one batch across every user with work pending.

Two modes share one interface so the engine never branches on it:

- :class:`LLMStages` sends each stage's prompts (:mod:`memoryos_gpu.prompts`) to an
  :class:`~memoryos_gpu.llm.LLMBackend` as one batch. ``fused=True`` asks one structured call per
  evicted page (continuity + chain meta + topic summary + keywords) and one per promoted
  segment (profile + user facts + assistant facts); ``fused=False`` makes the paper's separate
  calls. Invalid output falls back to the extractive result for that item (counted in
  ``stats.fallbacks`` per stage, and logged), so a bad model answer never loses a page. A
  backend that fails a whole batch (an unreachable server, or one whose every request failed
  server-side: :class:`~memoryos_gpu.llm.LLMBackendError`) fails the stage instead, and the
  round's work stays pending: a fallback is stored for good, an outage is waited out.
- :class:`ExtractiveStages` makes no LLM call: continuity by embedding similarity, keywords by
  the TF-IDF extractor weighed against the user's own vocabulary (words the page shares with
  the user's other pages, so pages on one topic share keywords and form segments), extractive
  summaries and first-person user facts. Results say which mode produced them (``mode``
  field), so nothing pretends to be an LLM.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memoryos_gpu import prompts
from memoryos_gpu.llm.base import ChatRequest, LLMBackend
from memoryos_gpu.log_setup import LogThrottle
from memoryos_gpu.text.keywords import (
    KeywordExtractor,
)
from memoryos_gpu.text.statements import user_statements
from memoryos_gpu.text.topics import topic_keywords, topic_weights
from memoryos_gpu.text.vocabulary import UserVocabulary

log = logging.getLogger("memoryos_gpu.stages")
#: why an item fell back when no request failed: its output did not parse for its stage
UNUSABLE_OUTPUT = "the model's output did not fit the stage's schema"


@dataclass
class PageWork:
    """One evicted page on its way into MTM, with its chain context."""

    page: dict[str, Any]  # user_input, agent_response, timestamp
    embedding: np.ndarray
    prev_page: dict[str, Any] | None
    prev_embedding: np.ndarray | None
    prev_meta: str | None


@dataclass
class PageOutcome:
    continuous: bool
    meta: str
    summary: str
    keywords: list[str]
    mode: str  # "llm", "llm-fallback" or "extractive"


@dataclass
class PromotionWork:
    profile: dict[str, str]
    pages: list[dict[str, Any]]
    # the owners' live entries (entry id, text) the LLM may update or ignore facts against
    known_user: list[tuple[int, str]] = field(default_factory=list)
    known_assistant: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class PromotionOutcome:
    profile_updates: dict[str, str]
    user_facts: list[str]
    assistant_facts: list[str]
    mode: str
    # per user fact, the index of the page it was taken from (extractive: exactly one page);
    # None: derived from all of the promotion's pages (an LLM reads them together)
    user_fact_pages: list[int] | None = None
    # per fact, the LLM's decision against the known entries: (action, entry id), action
    # "add" | "update" | "ignore"; None: no decision (the engine's rule decides)
    user_decisions: list[tuple[str, int | None]] | None = None
    assistant_decisions: list[tuple[str, int | None]] | None = None


@dataclass
class StageStats:
    """Calls, tokens and fallbacks per stage (thread-safe)."""

    calls: Counter = field(default_factory=Counter)
    batches: Counter = field(default_factory=Counter)
    prompt_tokens: Counter = field(default_factory=Counter)
    completion_tokens: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, stage: str, n: int, prompt: int, completion: int) -> None:
        with self._lock:
            self.calls[stage] += n
            self.batches[stage] += 1
            self.prompt_tokens[stage] += prompt
            self.completion_tokens[stage] += completion

    def add_fallbacks(self, stage: str, n: int) -> None:
        with self._lock:
            self.fallbacks[stage] += n

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            stages = sorted(set(self.calls) | set(self.fallbacks))
            return {
                "llm_calls": sum(self.calls.values()),
                "prompt_tokens": sum(self.prompt_tokens.values()),
                "completion_tokens": sum(self.completion_tokens.values()),
                "fallbacks": sum(self.fallbacks.values()),
                "per_stage": {
                    s: {
                        "calls": self.calls[s],
                        "batches": self.batches[s],
                        "mean_batch": round(self.calls[s] / max(1, self.batches[s]), 2),
                        "prompt_tokens": self.prompt_tokens[s],
                        "completion_tokens": self.completion_tokens[s],
                        "fallbacks": self.fallbacks[s],
                    }
                    for s in stages
                },
            }


def page_waves_in_order(
    pages: Callable[[Sequence[PageWork]], list[PageOutcome]],
    waves: Sequence[Sequence[PageWork]],
) -> list[list[PageOutcome]]:
    """The outcomes of a round's *waves* (wave ``j``: the ``j``-th page of each user; a page
    of a later wave follows its user's page of the wave before), staged by ``pages`` one wave
    at a time: a page whose predecessor was staged in this call takes that outcome's chain meta
    as its own context first (``prev_meta``, which the caller then reads as the context the
    outcome was made in)."""
    meta_of: dict[int, str] = {}
    out: list[list[PageOutcome]] = []
    for work in waves:
        for w in work:
            _take_context(w, meta_of)
        done = pages(work)
        meta_of.update((w.page["page_id"], o.meta) for w, o in zip(work, done, strict=True))
        out.append(done)
    return out


def _take_context(w: PageWork, meta_of: dict[int, str]) -> None:
    """Give ``w`` its predecessor's chain meta from ``meta_of`` (page id -> meta of the pages
    staged before it) when it has none yet."""
    if w.prev_meta is None and w.prev_page is not None:
        w.prev_meta = meta_of.get(w.prev_page["page_id"])


def _chain_meta(prev_meta: str | None, continuous: bool, summary: str) -> str:
    """A page's chain meta without an LLM: its chain's meta when it continues a chain that
    has one, else its own first sentence (its extractive summary; for one page the same as
    ``fallback_chain_meta(None, page)``, computed once)."""
    return (prev_meta if (continuous and prev_meta) else summary) or ""


class ExtractiveStages:
    """LLM-free stages: a documented quality/cost trade-off for bulk ingestion.

    ``vocabulary`` (each user's document frequencies) makes a page's keywords the words that tie
    it to the user's other pages (:func:`~memoryos_gpu.text.topics.topic_weights`); without
    one, a page keeps its own most distinctive words, which pages on one topic rarely share.
    """

    mode = "extractive"

    def __init__(
        self,
        extractor: KeywordExtractor,
        *,
        vocabulary: UserVocabulary | None = None,
        continuity_threshold: float = 0.55,
        page_keywords: int = 8,
        max_facts: int = 5,
    ) -> None:
        self.extractor = extractor
        self.vocabulary = vocabulary
        self.continuity_threshold = continuity_threshold
        self.page_keywords = page_keywords
        self.max_facts = max_facts
        self.stats = StageStats()

    def pages(self, work: Sequence[PageWork]) -> list[PageOutcome]:
        """Each page's outcome: its keywords, whether it continues its chain, and as summary
        its first sentence (``fallback_chain_meta``'s, which the chain meta is too when the
        page starts a chain)."""
        keywords = self._keywords(work)
        continuous = self._continuous(work).tolist()
        summaries = [prompts.fallback_chain_meta(None, w.page) for w in work]
        return [
            PageOutcome(c, _chain_meta(w.prev_meta, c, summary), summary, k, self.mode)
            for w, k, c, summary in zip(work, keywords, continuous, summaries, strict=True)
        ]

    def page_waves(self, waves: Sequence[Sequence[PageWork]]) -> list[list[PageOutcome]]:
        """The outcomes of several waves (:func:`page_waves_in_order`'s contract) from one
        batch: only a page's chain meta depends on the wave before (keywords, continuity and
        summary read the page, its predecessor's text and embedding, and statistics that the
        round does not change), so the batch is staged first and each wave's metas are
        remade, by the rule :meth:`_page` applies, once its pages took their context. One
        user's backlog (a wave per page) then costs one pass of the stage instead of one a
        page."""
        done = iter(self.pages([w for work in waves for w in work]))

        def remade(work: Sequence[PageWork]) -> list[PageOutcome]:
            part = [next(done) for _ in work]
            for w, o in zip(work, part, strict=True):
                o.meta = _chain_meta(w.prev_meta, o.continuous, o.summary)
            return part

        return page_waves_in_order(remade, waves)

    def _continuous(self, work: Sequence[PageWork]) -> np.ndarray:
        """Whether each page continues its chain: cos(previous page, page) >= the threshold,
        for the whole round in one matrix product (False without a previous page)."""
        linked = [i for i, w in enumerate(work) if w.prev_embedding is not None]
        out = np.zeros(len(work), bool)
        if linked:
            a = np.asarray([work[i].prev_embedding for i in linked], np.float32)
            b = np.asarray([work[i].embedding for i in linked], np.float32)
            # float64 sums of the float32 rows without float64 copies of them (4.6 -> 1.7 us
            # a page: the copies and their passes were memory-bound)
            dot = np.einsum("ij,ij->i", a, b, dtype=np.float64)
            denom = np.sqrt(
                np.einsum("ij,ij->i", a, a, dtype=np.float64)
                * np.einsum("ij,ij->i", b, b, dtype=np.float64)
            )
            cos = np.where(denom > 0, dot / np.where(denom > 0, denom, 1.0), 0.0)
            out[linked] = cos >= self.continuity_threshold
        return out

    def _keywords(self, work: Sequence[PageWork]) -> list[list[str]]:
        """Each page's keywords; with a vocabulary, one weighing for the whole batch."""
        texts = [f"{w.page['user_input'] or ''}\n{w.page['agent_response'] or ''}" for w in work]
        if self.vocabulary is None:
            return self.extractor.extract_many(texts, top_n=self.page_keywords)
        c = self.extractor.candidates(texts)  # first occurrence order, one native scan
        users = [str(w.page.get("user_id", "")) for w in work]
        sizes = np.diff(c.offsets)
        weights = topic_weights(
            c.scores,
            self.vocabulary.df(users, c.ids.astype(np.int64), sizes.tolist()),
            np.repeat(self.vocabulary.pages(users), sizes),
        )
        words = [c.words[a:b] for a, b in itertools.pairwise(c.offsets.tolist())]
        return topic_keywords(words, weights, c.scores, self.page_keywords)

    def promotions(self, work: Sequence[PromotionWork]) -> list[PromotionOutcome]:
        out = []
        for w in work:
            facts = self._user_facts(w.pages)
            out.append(
                PromotionOutcome(
                    {}, [f for f, _ in facts], [], self.mode, user_fact_pages=[i for _, i in facts]
                )
            )
        return out

    def _user_facts(self, pages: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
        """Sentences in which the user speaks about themself (first person), verbatim, each
        with the index of the page it is from: the newest ``max_facts`` distinct sentences,
        every page that says one kept. The cap counts facts, not their repetitions: a sentence
        said on three pages is one fact whose sources must be all three (the knowledge ring
        merges them), or editing the pages it names would leave the others' word for it
        analysed and underived."""
        facts = [
            (s, i) for i, p in enumerate(pages) for s in user_statements(p.get("user_input") or "")
        ]
        newest = list(dict.fromkeys(s for s, _ in reversed(facts)))[: self.max_facts]
        kept = set(newest)
        return [(s, i) for s, i in facts if s in kept]


class LLMStages:
    """Stage prompts through one backend, batched across users; fallbacks per item."""

    mode = "llm"

    def __init__(
        self,
        backend: LLMBackend,
        fallback: ExtractiveStages,
        *,
        fused: bool = True,
        max_tokens: int = 256,
        temperature: float = 0.0,
        batch_size: int = 64,
    ) -> None:
        self.backend = backend
        self.fallback = fallback
        self.fused = fused
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        self.stats = fallback.stats  # one ledger for both
        self._fallback_log = LogThrottle()  # a fallback per wave while the LLM is down

    # ------------------------------------------------------------------ plumbing
    def _generate(self, stage: str, built: Sequence[tuple[list[dict], dict | None]]) -> list[Any]:
        """One stage's prompts through the backend in batches of ``batch_size``, recorded in
        the stage ledger; returns the backend's ChatResults in order."""
        out: list[Any] = []
        for i in range(0, len(built), self.batch_size):
            requests = [
                ChatRequest(
                    messages=tuple(m),
                    json_schema=s,
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                    stage=stage,
                )
                for m, s in built[i : i + self.batch_size]
            ]
            results = self.backend.generate(requests)
            self.stats.record(
                stage,
                len(results),
                sum(r.prompt_tokens for r in results),
                sum(r.completion_tokens for r in results),
            )
            out.extend(results)
        return out

    def _run(
        self, stage: str, built: list[tuple[list[dict], dict | None]]
    ) -> tuple[list[Any], str | None]:
        """Structured stage calls: the parsed JSON (or the raw text, for the stage parser to
        repair) per prompt, None where the request failed; and the first request's error (why
        items fell back, for the log)."""
        results = self._generate(stage, built)
        values = [
            r.parsed if r.parsed is not None else (r.text if not r.error else None) for r in results
        ]
        return values, next((r.error for r in results if r.error), None)

    def _count_fallbacks(self, stage: str, n: int, reason: str | None) -> None:
        """Count and log ``n`` items of ``stage`` stored with the extractive fallback: they are
        not redone, so a downgrade must show (``stats.fallbacks``, ``/v1/stats``, the log)."""
        if not n:
            return
        self.stats.add_fallbacks(stage, n)
        # once per wave while the LLM is down: throttled per stage (the counters stay exact)
        self._fallback_log.log(
            log,
            stage,
            logging.WARNING,
            "LLM stage %r: %d item(s) stored with the extractive fallback "
            "(mode 'llm-fallback', not redone): %s",
            stage,
            n,
            reason or UNUSABLE_OUTPUT,
        )

    # ------------------------------------------------------------------ pages
    def pages(self, work: Sequence[PageWork]) -> list[PageOutcome]:
        if not work:
            return []
        return self._pages_fused(work) if self.fused else self._pages_separate(work)

    def page_waves(self, waves: Sequence[Sequence[PageWork]]) -> list[list[PageOutcome]]:
        """Wave after wave: the model is shown each page's chain meta, its predecessor's
        outcome (:func:`page_waves_in_order`)."""
        return page_waves_in_order(self.pages, waves)

    def _pages_fused(self, work: Sequence[PageWork]) -> list[PageOutcome]:
        raw, error = self._run(
            "page", [prompts.fused_page(w.prev_page, w.prev_meta, w.page) for w in work]
        )
        out, failed = [], 0
        for w, value in zip(work, raw, strict=True):
            r = prompts.parse_fused_page(value) if value is not None else None
            if r is None:
                failed += 1
                out.append(self._fallback_page(w))
            else:
                continuous = r.continuous and w.prev_page is not None
                out.append(PageOutcome(continuous, r.meta, r.summary, r.keywords, "llm"))
        self._count_fallbacks("page", failed, error)
        return out

    def _pages_separate(self, work: Sequence[PageWork]) -> list[PageOutcome]:
        has_prev = [w for w in work if w.prev_page is not None]
        cont_raw, cont_error = self._run(
            "continuity", [prompts.continuity(w.prev_page, w.page) for w in has_prev]
        )
        continuity: dict[int, bool | None] = {
            id(w): prompts.parse_continuity(v) for w, v in zip(has_prev, cont_raw, strict=True)
        }
        flags = [bool(continuity.get(id(w))) for w in work]
        meta_raw, meta_error = self._run(
            "chain_meta",
            [
                prompts.chain_meta(w.prev_meta if c else None, w.page)
                for w, c in zip(work, flags, strict=True)
            ],
        )
        topic_raw, topic_error = self._run(
            "topic_summary", [prompts.topic_summary([w.page]) for w in work]
        )
        out, failed = [], 0
        for w, c, mv, tv in zip(work, flags, meta_raw, topic_raw, strict=True):
            meta = prompts.parse_chain_meta(mv) if mv is not None else None
            topic = prompts.parse_topic_summary(tv) if tv is not None else None
            bad_continuity = w.prev_page is not None and continuity.get(id(w)) is None
            if meta is None or topic is None or bad_continuity:
                failed += 1
                fb = self._fallback_page(w)
                out.append(
                    PageOutcome(
                        c if not bad_continuity else fb.continuous,
                        meta or fb.meta,
                        topic.summary if topic else fb.summary,
                        topic.keywords if topic else fb.keywords,
                        "llm-fallback",
                    )
                )
            else:
                out.append(PageOutcome(c, meta, topic.summary, topic.keywords, "llm"))
        self._count_fallbacks("page", failed, cont_error or meta_error or topic_error)
        return out

    def _partial_promotion(
        self,
        w: PromotionWork,
        profile: dict[str, str] | None,
        user_facts: list[str] | None,
        assistant_facts: list[str] | None,
    ) -> PromotionOutcome:
        """A promotion of separate calls where some failed (``None``): the others' answers are
        kept and each failed part is the extractive fallback's, as a page's separate calls
        fall back field by field. Stored as ``llm-fallback``: the pages are not analysed
        again, so dropping the calls that answered would lose their facts for good."""
        fb = self.fallback.promotions([w])[0]
        return PromotionOutcome(
            fb.profile_updates if profile is None else profile,
            fb.user_facts if user_facts is None else user_facts,
            fb.assistant_facts if assistant_facts is None else assistant_facts,
            "llm-fallback",
            user_fact_pages=fb.user_fact_pages if user_facts is None else None,
        )

    def _fallback_page(self, w: PageWork) -> PageOutcome:
        fb = self.fallback.pages([w])[0]
        fb.mode = "llm-fallback"
        return fb

    # ------------------------------------------------------------------ promotions
    def promotions(self, work: Sequence[PromotionWork]) -> list[PromotionOutcome]:
        if not work:
            return []
        if self.fused:
            raw, error = self._run(
                "promotion",
                [
                    prompts.fused_promotion(
                        w.profile,
                        w.pages,
                        known_user=w.known_user,
                        known_assistant=w.known_assistant,
                    )
                    for w in work
                ],
            )
            parsed = [prompts.parse_fused_promotion(v) if v is not None else None for v in raw]
        else:
            prof, p_error = self._run(
                "profile", [prompts.profile_update(w.profile, w.pages) for w in work]
            )
            uk, u_error = self._run(
                "user_knowledge", [prompts.user_knowledge(w.pages) for w in work]
            )
            ak, a_error = self._run(
                "assistant_knowledge", [prompts.assistant_knowledge(w.pages) for w in work]
            )
            error = p_error or u_error or a_error
            parsed = []
            for w, p, u, a in zip(work, prof, uk, ak, strict=True):
                pu = prompts.parse_profile_update(p) if p is not None else None
                uu = prompts.parse_user_knowledge(u) if u is not None else None
                aa = prompts.parse_assistant_knowledge(a) if a is not None else None
                if pu is not None and uu is not None and aa is not None:
                    parsed.append(prompts.PromotionResult(pu, uu, aa))
                elif pu is None and uu is None and aa is None:
                    parsed.append(None)
                else:  # kept: what the calls that answered gave
                    parsed.append(self._partial_promotion(w, pu, uu, aa))
        out, failed = [], 0
        for w, r in zip(work, parsed, strict=True):
            if isinstance(r, PromotionOutcome):
                failed += 1
                out.append(r)
            elif r is None:
                failed += 1
                fb = self.fallback.promotions([w])[0]
                fb.mode = "llm-fallback"
                out.append(fb)
            else:
                out.append(
                    PromotionOutcome(
                        r.profile_updates,
                        r.user_facts,
                        r.assistant_facts,
                        "llm",
                        user_decisions=_known(r.user_decisions, w.known_user),
                        assistant_decisions=_known(r.assistant_decisions, w.known_assistant),
                    )
                )
        self._count_fallbacks("promotion", failed, error)
        return out

    # ------------------------------------------------------------------ response
    def respond(self, message_lists: Sequence[list[dict]]) -> list[Any]:
        """Free-text responses for a batch of prompts (no schema)."""
        return self._generate("response", [(m, None) for m in message_lists])


def _known(
    decisions: list[tuple[str, int | None]] | None, known: Sequence[tuple[int, str]]
) -> list[tuple[str, int | None]] | None:
    """The LLM's decisions with targets it was not shown dropped (an update or ignore of an
    unknown entry becomes a plain add: the model cannot change what it did not see)."""
    if decisions is None:
        return None
    shown = {eid for eid, _ in known}
    return [(a, t) if a == "add" or t in shown else ("add", None) for a, t in decisions]

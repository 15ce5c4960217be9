"""LoCoMo loading and LLM-free retrieval scoring (evidence recall at a page budget).

Pages come from :mod:`memoryos_gpu.formats` (one pairing rule for the reader and the evaluation):
a speaker_a turn plus the following speaker_b turn; unpaired turns become half-empty pages.

Evidence ids are normalised (``"D8:6; D9:17"`` -> two ids, ``"D:11:26"`` -> ``"D11:26"``,
whitespace removed, leading zeros dropped); ids that cannot be parsed are *malformed* and left
out of the denominator; well-formed ids naming no turn of the conversation are *unmatched* and
stay in the denominator (they can never be hit). Both are counted.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..formats import Record, Reject
from ..formats.locomo import iter_locomo_conversations, locomo_conversation_records

__all__ = [
    "SCORED_CATEGORIES",
    "Conversation",
    "Page",
    "Question",
    "QuestionResult",
    "RecallReport",
    "aggregate_recall",
    "all_evidence_hit",
    "default_locomo_path",
    "evaluate_rankings",
    "evidence_recall",
    "load_locomo",
    "normalise_dia_id",
    "normalise_evidence",
    "retrieved_dia_ids",
]

#: Categories scored (1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop in the LoCoMo file's
#: numbering); 5 (adversarial) is excluded.
SCORED_CATEGORIES = (1, 2, 3, 4)

_ID_RE = re.compile(r"D:?(\d+):(\d+)", re.IGNORECASE)
_IDS_RE = re.compile(r"(?:D:?\d+:\d+)+", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# evidence ids


def normalise_dia_id(dia_id: str) -> str | None:
    """``"D1:3"``-style id in canonical form, or ``None`` when it is not one id."""
    m = _ID_RE.fullmatch(re.sub(r"\s+", "", dia_id))
    return f"D{int(m.group(1))}:{int(m.group(2))}" if m else None


def normalise_evidence(evidence: Iterable[object]) -> tuple[list[str], list[str]]:
    """Split and canonicalise evidence ids: ``(valid ids, deduplicated, in order; malformed)``.

    Entries may hold several ids separated by ``;``, ``,`` or whitespace (``"D8:6; D9:17"``).
    """
    valid: list[str] = []
    malformed: list[str] = []
    for entry in evidence:
        if not isinstance(entry, str):
            malformed.append(repr(entry))
            continue
        for piece in re.split(r"[;,]", entry):
            compact = re.sub(r"\s+", "", piece)
            if not compact:
                continue
            if not _IDS_RE.fullmatch(compact):
                malformed.append(piece.strip())
                continue
            for m in _ID_RE.finditer(compact):
                canon = f"D{int(m.group(1))}:{int(m.group(2))}"
                if canon not in valid:
                    valid.append(canon)
    return valid, malformed


def _canonical_set(dia_ids: Iterable[str]) -> set[str]:
    out = set()
    for d in dia_ids:
        c = normalise_dia_id(d)
        out.add(c if c is not None else d)
    return out


def evidence_recall(retrieved_dia_ids: set[str], evidence: Sequence[object]) -> float:
    """Fraction of the (normalised, deduplicated) evidence ids found in ``retrieved_dia_ids``.

    Raises ``ValueError`` when ``evidence`` holds no valid id (such questions are not scored).
    """
    valid, _ = normalise_evidence(evidence)
    if not valid:
        raise ValueError(f"no valid evidence id in {list(evidence)!r}")
    got = _canonical_set(retrieved_dia_ids)
    return sum(1 for e in valid if e in got) / len(valid)


def all_evidence_hit(retrieved_dia_ids: set[str], evidence: Sequence[object]) -> bool:
    """Whether every valid evidence id was retrieved (``ValueError`` when there is none)."""
    return evidence_recall(retrieved_dia_ids, evidence) == 1.0


# --------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class Page:
    """One MemoryOS page of a LoCoMo conversation (index = position in the conversation)."""

    index: int
    user_input: str
    agent_response: str
    speaker_a: str
    speaker_b: str | None
    session: int
    date: str | None  # session_N_date_time as written
    timestamp: float | None  # the same, as UTC epoch seconds
    dia_ids: tuple[str, ...]
    source: str

    @property
    def text(self) -> str:
        """``"{speaker_a}: {a} {speaker_b}: {b}"`` (an empty side is left out)."""
        parts = []
        if self.user_input:
            parts.append(f"{self.speaker_a}: {self.user_input}")
        if self.agent_response:
            parts.append(f"{self.speaker_b or 'assistant'}: {self.agent_response}")
        return " ".join(parts)

    @property
    def dense_text(self) -> str:
        """:attr:`text` with the session date prefixed (``"[1:56 pm on 8 May, 2023] ..."``)."""
        return f"[{self.date}] {self.text}" if self.date else self.text

    @classmethod
    def from_record(cls, index: int, record: Record) -> Page:
        meta = record.meta
        return cls(
            index=index,
            user_input=record.user_input,
            agent_response=record.agent_response,
            speaker_a=meta.get("speaker_a") or "user",
            speaker_b=meta.get("speaker_b"),
            session=int(meta.get("session", 0)),
            date=record.timestamp if isinstance(record.timestamp, str) else None,
            timestamp=record.epoch,
            dia_ids=tuple(meta.get("dia_ids", ())),
            source=record.source,
        )


@dataclass(frozen=True)
class Question:
    index: int  # position in the conversation's qa list
    question: str
    answer: str | None  # stringified (some answers are numbers); None for adversarial-only
    category: int
    evidence: tuple[str, ...]  # normalised, deduplicated
    raw_evidence: tuple[str, ...]
    malformed_evidence: tuple[str, ...]
    adversarial_answer: str | None = None

    @property
    def scored(self) -> bool:
        """Category 1-4 with at least one valid evidence id."""
        return self.category in SCORED_CATEGORIES and bool(self.evidence)


@dataclass
class Conversation:
    sample_id: str
    speaker_a: str
    speaker_b: str | None
    pages: list[Page]
    questions: list[Question]
    rejects: list[Reject] = field(default_factory=list)
    #: well-formed evidence ids that name no turn of this conversation (question index, id)
    unmatched_evidence: list[tuple[int, str]] = field(default_factory=list)

    @property
    def malformed_evidence(self) -> list[tuple[int, str]]:
        return [(q.index, m) for q in self.questions for m in q.malformed_evidence]

    @property
    def scored_questions(self) -> list[Question]:
        return [q for q in self.questions if q.scored]

    def truncated(self, max_pages: int) -> Conversation:
        """The first ``max_pages`` pages and only the questions whose evidence lies entirely
        inside them: a smaller but still fully answerable conversation (for slow LLM runs).
        A limit past the end returns the conversation unchanged."""
        if max_pages >= len(self.pages):
            return self
        pages = self.pages[:max_pages]
        kept = {normalise_dia_id(d) or d for p in pages for d in p.dia_ids}
        questions = [q for q in self.questions if q.evidence and set(q.evidence) <= kept]
        return Conversation(self.sample_id, self.speaker_a, self.speaker_b, pages, questions)

    def page_of(self) -> dict[str, int]:
        """Canonical dia_id -> page index."""
        out = {}
        for p in self.pages:
            for d in p.dia_ids:
                out[normalise_dia_id(d) or d] = p.index
        return out


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def load_locomo(path: str | os.PathLike[str]) -> list[Conversation]:
    """Load a LoCoMo file (list of conversations; gzip and JSONL also accepted).

    Pages are produced by the same code as ``read_records(path, "locomo")``. A conversation that
    cannot be read at all raises ``ValueError``; page-level problems land in ``rejects``.
    """
    out: list[Conversation] = []
    for index, raw in iter_locomo_conversations(path):
        if isinstance(raw, Reject):
            raise ValueError(f"{raw.path}: item {raw.line}: {raw.reason}")
        conv = raw.get("conversation")
        if not isinstance(conv, dict) or not isinstance(conv.get("speaker_a"), str):
            raise ValueError(
                f"{os.fspath(path)}: item {index}: not a LoCoMo conversation "
                "(needs conversation.speaker_a)"
            )
        items = locomo_conversation_records(raw, index, path)
        rejects = [r for r in items if isinstance(r, Reject)]
        records = [r for r in items if isinstance(r, Record)]
        pages = [Page.from_record(i, r) for i, r in enumerate(records)]
        questions = []
        for qi, qa in enumerate(raw.get("qa") or []):
            if not isinstance(qa, dict):
                continue
            raw_ev = qa.get("evidence") or []
            raw_ev = raw_ev if isinstance(raw_ev, list) else [raw_ev]
            valid, malformed = normalise_evidence(raw_ev)
            category = qa.get("category")
            questions.append(
                Question(
                    index=qi,
                    question=str(qa.get("question", "")),
                    answer=_str_or_none(qa.get("answer")),
                    category=int(category) if isinstance(category, (int, float, str)) else 0,
                    evidence=tuple(valid),
                    raw_evidence=tuple(str(e) for e in raw_ev),
                    malformed_evidence=tuple(malformed),
                    adversarial_answer=_str_or_none(qa.get("adversarial_answer")),
                )
            )
        sample_id = raw.get("sample_id")
        c = Conversation(
            sample_id=str(sample_id) if sample_id is not None else str(index),
            speaker_a=str(conv.get("speaker_a", "")),
            speaker_b=_str_or_none(conv.get("speaker_b")),
            pages=pages,
            questions=questions,
            rejects=rejects,
        )
        known = c.page_of()
        c.unmatched_evidence = [
            (q.index, e) for q in questions for e in q.evidence if e not in known
        ]
        out.append(c)
    return out


# --------------------------------------------------------------------------------------------
# scoring


def retrieved_dia_ids(conversation: Conversation, page_indices: Iterable[int]) -> set[str]:
    """Union of the dia_ids of the given pages."""
    return {d for i in page_indices for d in conversation.pages[i].dia_ids}


@dataclass(frozen=True)
class QuestionResult:
    category: int
    recall: float
    all_hit: bool


@dataclass
class RecallReport:
    """Mean evidence recall overall and per category (categories 1-4 only)."""

    overall: float
    per_category: dict[int, float]
    all_hit: float  # fraction of questions whose every evidence turn was retrieved
    n: int
    n_per_category: dict[int, int]
    k: int | None = None
    skipped_no_evidence: int = 0  # category 1-4 questions without a valid evidence id
    unmatched_evidence: int = 0
    malformed_evidence: int = 0

    def row(self) -> str:
        cats = " ".join(f"c{c}={v:.3f}" for c, v in sorted(self.per_category.items()))
        return (
            f"@{self.k}: recall={self.overall:.3f} all_hit={self.all_hit:.3f} ({cats}; n={self.n})"
        )


def aggregate_recall(results: Iterable[QuestionResult | tuple[int, float, bool]]) -> RecallReport:
    """Means over question results; category 5 (and anything outside 1-4) is excluded."""
    sums: dict[int, float] = {}
    hits: dict[int, int] = {}
    counts: dict[int, int] = {}
    for r in results:
        cat, recall, hit = (r.category, r.recall, r.all_hit) if isinstance(r, QuestionResult) else r
        if cat not in SCORED_CATEGORIES or math.isnan(recall):
            continue
        sums[cat] = sums.get(cat, 0.0) + recall
        hits[cat] = hits.get(cat, 0) + int(bool(hit))
        counts[cat] = counts.get(cat, 0) + 1
    n = sum(counts.values())
    return RecallReport(
        overall=sum(sums.values()) / n if n else float("nan"),
        per_category={c: sums[c] / counts[c] for c in sorted(counts)},
        all_hit=sum(hits.values()) / n if n else float("nan"),
        n=n,
        n_per_category=dict(sorted(counts.items())),
    )


def evaluate_rankings(
    conversations: Sequence[Conversation],
    rank: Callable[[Conversation, list[Question]], Sequence[Sequence[int]]],
    ks: Sequence[int] = (5, 10, 20),
) -> dict[int, RecallReport]:
    """Score a retriever: ``rank(conversation, questions)`` returns, per question, page indices
    best first (at least ``max(ks)`` of them where available). One report per page budget k.
    """
    per_k: dict[int, list[QuestionResult]] = {k: [] for k in ks}
    skipped = unmatched = malformed = 0
    for conv in conversations:
        in_cats = [q for q in conv.questions if q.category in SCORED_CATEGORIES]
        skipped += sum(1 for q in in_cats if not q.evidence)
        malformed += sum(len(q.malformed_evidence) for q in in_cats)
        scored = [q for q in in_cats if q.evidence]
        idx = {q.index for q in scored}
        unmatched += sum(1 for qi, _ in conv.unmatched_evidence if qi in idx)
        if not scored:
            continue
        rankings = rank(conv, scored)
        if len(rankings) != len(scored):
            raise ValueError(f"rank returned {len(rankings)} rankings for {len(scored)} questions")
        for q, ranking in zip(scored, rankings, strict=True):
            for k in ks:
                got = retrieved_dia_ids(conv, list(ranking)[:k])
                recall = evidence_recall(got, q.evidence)
                per_k[k].append(QuestionResult(q.category, recall, recall == 1.0))
    out = {}
    for k in ks:
        rep = aggregate_recall(per_k[k])
        rep.k = k
        rep.skipped_no_evidence = skipped
        rep.unmatched_evidence = unmatched
        rep.malformed_evidence = malformed
        out[k] = rep
    return out


def default_locomo_path() -> Path:
    """The LoCoMo dev split: ``$MEMORYOS_GPU_LOCOMO``, else ``shared/data/locomo/locomo_dev.json``
    beside the repository checkout (where the project keeps its benchmark data)."""
    env = os.environ.get("MEMORYOS_GPU_LOCOMO")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    for base in (repo.parent / "shared", Path("/work/shared")):
        candidate = base / "data" / "locomo" / "locomo_dev.json"
        if candidate.exists():
            return candidate
    return repo.parent / "shared" / "data" / "locomo" / "locomo_dev.json"

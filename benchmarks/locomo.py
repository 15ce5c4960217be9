"""Retrieval quality on LoCoMo: evidence recall of the engine vs the retrievers a user would pick.

Each LoCoMo conversation is ingested as one user (speaker_a's turn + speaker_b's reply = one
page, session date-times as timestamps); every question of categories 1-4 is a query. Evidence
recall at a page budget B = the fraction of the question's evidence turns inside the B pages
returned (STM pages count: they follow the MTM pages inside the same budget).

Methods, all over the same pages and the same embedding model, in the same run:
``flat-dense`` (top-B by cosine), ``bm25`` (rank-bm25), ``rrf`` (reciprocal-rank fusion of the
two, k = 60), and ``engine-...`` configurations (LLM-free extractive mode; paper and reference
presets; ablations). With ``--llm`` also the LLM mode with the bundled SmolLM2 (slow on CPU: use
``--llm-conversations`` to bound it).

With ``--cv`` also a leave-one-conversation-out report of the engine's BM25 weight (only a
dev split exists, so no setting may be chosen on the questions it is scored on): the
conversations are ingested once, each weight of ``--cv-grid`` (``lexical_weight``)
reopens that store and ranks every question, and for each conversation the setting with the best
mean recall over the budgets on the OTHER conversations is scored on it. The held-out figures
(pooled over all questions) sit beside each fixed setting's and the baselines' (which have no
setting to choose).

With ``--answer-backend`` (transformers = the bundled SmolLM2, openai = any OpenAI-compatible
server such as ``vllm serve``, vllm = in process) the methods in ``--answer-methods`` also
answer a sample of ``--answer-questions`` questions from their top ``--answer-budget`` pages
(the same sample and prompt for every method) and report the paper's token F1 and BLEU-1 per
category (``memoryos_gpu.eval.qa``).

Usage: python benchmarks/locomo.py [--data FILE] [--budgets 5 10 20] [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cli_args, also when imported

import numpy as np
from cli_args import (
    Parser,
    apply_defaults,
    check_locomo_work,
    check_output,
    load_locomo_data,
    machine_info,
    nonnegative_int,
    positive_int,
    run_main,
    today,
    write_json,
)

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.eval import baselines, qa
from memoryos_gpu.eval.locomo import (
    Conversation,
    Question,
    RecallReport,
    default_locomo_path,
    evaluate_rankings,
)
from memoryos_gpu.types import PageInput

DEFAULT_DATA = default_locomo_path()


def engine_configs(with_llm: bool) -> dict[str, dict[str, Any]]:
    """Name -> (memory preset overrides, llm config, retrieval overrides)."""
    configs: dict[str, dict[str, Any]] = {
        "engine-llm-free-paper": {"memory": preset("paper")},
        "engine-llm-free-reference": {"memory": preset("reference")},
        "engine-llm-free-paper-no-lexical": {"memory": preset("paper", lexical_weight=0.0)},
        # the paper's pages without the relevance floor (every page of a chosen segment)
        "engine-llm-free-paper-no-floor": {"memory": preset("paper", relevance_floor=-1.0)},
        # ablation: no MTM structure = every segment searched, pages ranked flat
        "engine-llm-free-paper-flat-pages": {"memory": preset("paper", top_segments=200)},
    }
    if with_llm:
        configs["engine-llm-paper"] = {
            "memory": preset("paper"),
            "llm": LLMConfig(mode="llm", backend="transformers", max_tokens=96),
        }
        configs["engine-llm-paper-separate"] = {  # the paper's separate calls per stage
            "memory": preset("paper"),
            "llm": LLMConfig(mode="llm", backend="transformers", max_tokens=96, fused=False),
        }
    return configs


class EngineRanker:
    """Ingest each conversation once per configuration, then rank pages per question."""

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        embedder: Any,
        budget: int,
        workdir: Path,
        store: Path | None = None,
    ) -> None:
        self.name, self.embedder, self.budget = name, embedder, budget
        self.config = EngineConfig(
            memory=spec["memory"],
            llm=spec.get("llm", LLMConfig()),
            store=str(store or workdir / f"{name}.sqlite3"),
        )
        self.engine = MemoryEngine(self.config, embedder=embedder)
        self.ingest_s = 0.0
        self.tokens: list[int] = []
        self.index_of: dict[int, int] = {}  # page id -> page index in its conversation

    def __call__(self, conv: Conversation, questions: list[Question]) -> list[list[int]]:
        self.ingest(conv)
        return self.rank(conv, questions)

    def ingest(self, conv: Conversation) -> None:
        t0 = time.perf_counter()
        results = self.engine.add_many(
            PageInput(
                conv.sample_id,
                p.user_input,
                p.agent_response,
                p.timestamp,
                assistant_id=f"{conv.sample_id}:assistant",
                source=p.source,
                meta={"index": p.index, "speaker_a": p.speaker_a, "speaker_b": p.speaker_b},
            )
            for p in conv.pages
        )
        for p, r in zip(conv.pages, results, strict=True):
            self.index_of[r.page_id] = p.index
        self.ingest_s += time.perf_counter() - t0

    def rank(self, conv: Conversation, questions: list[Question]) -> list[list[int]]:
        index_of = self.index_of
        retrievals = self.engine.retrieve_many(
            [(conv.sample_id, q.question) for q in questions],
            top_pages=self.budget,
            update_heat=False,
        )
        rankings = []
        for r in retrievals:
            # STM pages count, after the MTM pages inside the same budget (conservative: the
            # engine's own ranking decides, STM never displaces a retrieved MTM page)
            ids = [p.page_id for p in r.pages] + [p.page_id for p in reversed(r.stm)]
            rankings.append([index_of[pid] for pid in ids[: self.budget]])
            self.tokens.append(r.retrieval_tokens)
        return rankings

    def llm_calls_per_page(self) -> float:
        pages = max(1, self.engine.counters["pages_added"])
        return self.engine.stats()["llm"]["llm_calls"] / pages


class Recorder:
    """Wraps a ranker and keeps each question's ranking, so answers can be generated from the
    pages the method actually retrieved."""

    def __init__(self, rank: Callable[[Conversation, list[Question]], Any]) -> None:
        self.rank = rank
        self.seen: dict[tuple[str, int], tuple[Conversation, Question, list[int]]] = {}

    def __call__(self, conv: Conversation, questions: list[Question]) -> Any:
        rankings = self.rank(conv, questions)
        for q, r in zip(questions, rankings, strict=True):
            self.seen[(conv.sample_id, q.index)] = (conv, q, list(r))
        return rankings


class Answerer:
    """Answers the same question sample for every method (``--answer-*`` options)."""

    def __init__(self, args: argparse.Namespace, convs: list[Conversation]) -> None:
        from memoryos_gpu.llm.factory import make_backend

        options: dict[str, Any] = {}
        if args.answer_model:
            options["model"] = args.answer_model
        if args.answer_base_url:
            options["base_url"] = args.answer_base_url
        self.backend = make_backend(args.answer_backend, **options)
        self.budget = args.answer_budget
        self.max_tokens = args.answer_max_tokens
        keys = [
            (c.sample_id, q.index)
            for c in convs
            for q in c.scored_questions
            if q.answer is not None
        ]
        rng = np.random.default_rng(0)
        take = min(args.answer_questions, len(keys))
        self.sample = [keys[i] for i in sorted(rng.choice(len(keys), take, replace=False))]

    def __call__(self, recorder: Recorder) -> dict[str, Any]:
        items, cats, golds = [], [], []
        for key in self.sample:
            conv, q, ranking = recorder.seen[key]
            items.append((q.question, [conv.pages[i] for i in ranking[: self.budget]]))
            cats.append(q.category)
            golds.append(str(q.answer))
        t0 = time.perf_counter()
        answers, failed = qa.answer_questions(self.backend, items, max_tokens=self.max_tokens)
        report = qa.score_answers(cats, answers, golds)
        report.failed = failed
        out = report.as_dict()
        out.update(budget=self.budget, seconds=round(time.perf_counter() - t0, 1))
        out["examples"] = [
            {"question": it[0], "gold": g, "answer": a}
            for it, g, a in list(zip(items, golds, answers, strict=True))[:5]
        ]
        return out


def pool_reports(reports: Sequence[RecallReport]) -> dict[str, Any]:
    """Per-conversation reports of one budget -> means over all their questions pooled."""
    n = sum(r.n for r in reports)
    cats: dict[int, list[float]] = {}
    for r in reports:
        for c, v in r.per_category.items():
            acc = cats.setdefault(c, [0.0, 0.0])
            acc[0] += v * r.n_per_category[c]
            acc[1] += r.n_per_category[c]
    return {
        "evidence_recall": sum(r.overall * r.n for r in reports) / n if n else float("nan"),
        "all_evidence_hit": sum(r.all_hit * r.n for r in reports) / n if n else float("nan"),
        "per_category": {str(c): s / k for c, (s, k) in sorted(cats.items())},
        "questions": n,
    }


def parse_cv_setting(text: str) -> float:
    """``"0.67"`` -> 0.67: a BM25 weight (``MemoryConfig.lexical_weight``) for ``--cv``."""
    try:
        weight = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a BM25 weight, got {text!r}") from None
    if not weight >= 0:
        raise argparse.ArgumentTypeError(f"a BM25 weight is >= 0, got {text!r}")
    return weight


def leave_one_out(
    per_conv: dict[str, list[dict[int, RecallReport]]], ks: Sequence[int]
) -> dict[str, Any]:
    """``per_conv[setting][i][k]``: the report of conversation i at budget k. For each
    conversation, the setting with the best mean recall over ``ks`` on the other conversations
    (ties: the first setting) is scored on it; returns the pooled held-out reports and picks."""
    settings = list(per_conv)
    n_conv = len(next(iter(per_conv.values())))
    picks, held = [], []
    for i in range(n_conv):
        train = [j for j in range(n_conv) if j != i]

        def score(setting: str, train: list[int] = train) -> float:
            reps = per_conv[setting]
            return float(
                np.mean([pool_reports([reps[j][k] for j in train])["evidence_recall"] for k in ks])
            )

        best = max(settings, key=score)  # max keeps the first of equal scores
        picks.append(best)
        held.append(per_conv[best][i])
    return {
        "picks": picks,
        "held_out": {str(k): pool_reports([h[k] for h in held]) for k in ks},
    }


def cross_validate(
    convs: list[Conversation],
    embedder: Any,
    ks: Sequence[int],
    grid: Sequence[float],
    workdir: Path,
    baselines_per_conv: dict[str, list[dict[int, RecallReport]]],
    rrf_per_conv: dict[str, list[dict[int, RecallReport]]],
) -> dict[str, Any]:
    """Leave-one-conversation-out choice of the engine's BM25 weight (``--cv``),
    and, for a fair comparison, of the RRF baseline's k (``rrf_per_conv``: one entry per k)."""
    budget = max(ks)
    store = workdir / "cv.sqlite3"
    ingest = EngineRanker(
        "cv-ingest", {"memory": preset("paper")}, embedder, budget, workdir, store
    )
    for conv in convs:
        ingest.ingest(conv)
    ingest.engine.close()
    per_conv: dict[str, list[dict[int, RecallReport]]] = {}
    for weight in grid:
        name = f"lexical_weight={weight:g}"
        mem = preset("paper", lexical_weight=weight)
        ranker = EngineRanker(name, {"memory": mem}, embedder, budget, workdir, store)
        ranker.index_of = ingest.index_of
        per_conv[name] = [evaluate_rankings([c], ranker.rank, ks) for c in convs]
        ranker.engine.close()
        full = pool_reports([r[max(ks)] for r in per_conv[name]])["evidence_recall"]
        print(f"cv {name:<32} @{max(ks)}={full:.3f} (all conversations)", file=sys.stderr)
    fixed = {
        name: {str(k): pool_reports([r[k] for r in reps]) for k in ks}
        for name, reps in {**baselines_per_conv, **rrf_per_conv, **per_conv}.items()
    }
    return {
        "conversations": [c.sample_id for c in convs],
        "grid": list(per_conv),
        "rrf_grid": list(rrf_per_conv),
        "selection": "mean evidence recall over the budgets on the other conversations",
        "engine": leave_one_out(per_conv, ks),
        **({"rrf": leave_one_out(rrf_per_conv, ks)} if rrf_per_conv else {}),
        "fixed": fixed,
    }


def report_rows(method: str, reports: dict[int, Any], extra: dict[str, Any]) -> list[dict]:
    return [
        {
            "method": method,
            "budget": k,
            "evidence_recall": round(r.overall, 4),
            "all_evidence_hit": round(r.all_hit, 4),
            "per_category": {str(c): round(v, 4) for c, v in r.per_category.items()},
            "questions": r.n,
            **extra,
        }
        for k, r in reports.items()
    ]


#: LoCoMo's question categories by their number in the file (memoryos_gpu.eval.locomo's
#: SCORED_CATEGORIES comment): what the plot names its groups
CATEGORY_NAMES = {
    1: "multi-hop",
    2: "temporal",
    3: "open-domain",
    4: "single-hop",
    5: "adversarial",
}


def select(convs: list[Conversation], args: argparse.Namespace) -> list[Conversation]:
    """The conversations and questions the run scores (--conversations, --max-pages, --quick),
    chosen before the run so that a selection with nothing to score is refused up front."""
    if args.conversations:
        convs = convs[: args.conversations]
    if args.max_pages:
        convs = [c.truncated(args.max_pages) for c in convs]
    if args.quick:
        for c in convs:
            c.questions = c.questions[:40]
    return convs


def run(args: argparse.Namespace, convs: list[Conversation]) -> dict[str, Any]:
    """Every method over ``convs`` (:func:`select`'s)."""
    from memoryos_gpu.embed import Embedder

    embedder = Embedder()
    ks = tuple(args.budgets)
    results: list[dict] = []
    embed = embedder.encode

    answerer = Answerer(args, convs) if args.answer_backend else None
    qa_results: dict[str, Any] = {}

    def answer(method: str, recorder: Recorder) -> None:
        if answerer is None or method not in args.answer_methods:
            return
        qa_results[method] = answerer(recorder)
        r = qa_results[method]
        print(f"{method:<36} QA F1={r['f1']:.3f} BLEU-1={r['bleu1']:.3f}", file=sys.stderr)

    baselines_per_conv: dict[str, list[dict[int, RecallReport]]] = {}

    def timed(method: str, rank: Callable, extra: dict[str, Any] | None = None) -> None:
        t0 = time.perf_counter()
        recorder = Recorder(rank)
        reports = evaluate_rankings(convs, recorder, ks)
        if args.cv:  # the same rankings, scored per conversation (no re-ranking)
            baselines_per_conv[method] = [
                evaluate_rankings(
                    [c], lambda c, qs: [recorder.seen[(c.sample_id, q.index)][2] for q in qs], ks
                )
                for c in convs
            ]
        elapsed = time.perf_counter() - t0
        results.extend(
            report_rows(method, reports, {"seconds": round(elapsed, 2), **(extra or {})})
        )
        print(
            f"{method:<36} " + "  ".join(f"@{k}={reports[k].overall:.3f}" for k in ks),
            file=sys.stderr,
        )
        answer(method, recorder)

    budget = max(ks)
    timed("flat-dense", lambda c, qs: baselines.flat_dense(c.pages, qs, embed, budget))
    timed("bm25", lambda c, qs: baselines.bm25(c.pages, qs, budget))

    full_rankings: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def rrf(conv: Conversation, qs: list[Question]) -> list[list[int]]:
        dense = baselines.flat_dense(conv.pages, qs, embed, None)
        lexical = baselines.bm25(conv.pages, qs, None)
        if args.cv:  # kept for RRF at the other k of --cv-rrf-k
            full_rankings[conv.sample_id] = (dense, lexical)
        return [baselines.rrf(d, b, limit=budget) for d, b in zip(dense, lexical, strict=True)]

    timed("rrf", rrf)
    rrf_per_conv: dict[str, list[dict[int, RecallReport]]] = {}
    for k_rrf in args.cv_rrf_k if args.cv else ():

        def rrf_at(conv: Conversation, qs: list[Question], k_rrf: int = k_rrf) -> list[list[int]]:
            dense, lexical = full_rankings[conv.sample_id]  # the same questions, same order
            return [
                baselines.rrf(d, b, k=k_rrf, limit=budget)
                for d, b in zip(dense, lexical, strict=True)
            ]

        rrf_per_conv[f"rrf k={k_rrf}"] = [evaluate_rankings([c], rrf_at, ks) for c in convs]
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in engine_configs(args.llm).items():
            if args.only and name not in args.only:
                continue
            ranker = EngineRanker(name, spec, embedder, budget, Path(tmp))
            use = convs[: args.llm_conversations] if "-llm-paper" in name else convs
            t0 = time.perf_counter()
            recorder = Recorder(ranker)
            reports = evaluate_rankings(use, recorder, ks)
            extra = {
                "seconds": round(time.perf_counter() - t0, 2),
                "ingest_seconds": round(ranker.ingest_s, 2),
                "retrieval_tokens_per_question": round(float(np.mean(ranker.tokens)), 1),
                "llm_calls_per_page": round(ranker.llm_calls_per_page(), 3),
                "conversations": len(use),
            }
            results.extend(report_rows(name, reports, extra))
            print(
                f"{name:<36} " + "  ".join(f"@{k}={reports[k].overall:.3f}" for k in ks),
                file=sys.stderr,
            )
            ranker.engine.close()
            if use is convs:
                answer(name, recorder)
        cv = None
        if args.cv and len(convs) < 2:
            print("--cv needs at least 2 conversations: skipped", file=sys.stderr)
        elif args.cv:
            cv = cross_validate(
                convs, embedder, ks, args.cv_grid, Path(tmp), baselines_per_conv, rrf_per_conv
            )
    n_questions = sum(len(c.scored_questions) for c in convs)
    return {
        "data": str(args.data),
        "questions": n_questions,
        "budgets": list(ks),
        "date": today(),
        "hardware": machine_info(),
        "results": results,
        **({"qa": qa_results} if qa_results else {}),
        **({"cv": cv} if cv else {}),
    }


def print_table(report: dict[str, Any]) -> None:
    for method, r in report.get("qa", {}).items():
        cats = "  ".join(f"c{c}: {m['f1']:.3f}" for c, m in r["per_category"].items())
        print(
            f"QA {method:<33} F1 {r['f1']:.3f}  BLEU-1 {r['bleu1']:.3f}  ({r['questions']} "
            f"questions, top {r['budget']} pages; F1 by category {cats})"
        )
    ks = report["budgets"]
    methods = list(dict.fromkeys(r["method"] for r in report["results"]))
    hit_k = 10 if 10 in ks else ks[0]  # the all-hit column's budget, named in its header
    print(f"{'method':<36} " + " ".join(f"{'@' + str(k):>7}" for k in ks) + f"   all-hit@{hit_k}")
    for m in methods:
        rows = {r["budget"]: r for r in report["results"] if r["method"] == m}
        hit = rows[hit_k]["all_evidence_hit"]
        print(
            f"{m:<36} "
            + " ".join(f"{rows[k]['evidence_recall']:>7.3f}" for k in ks)
            + f"   {hit:.3f}"
        )


def print_cv(cv: dict[str, Any]) -> None:
    ks = list(cv["engine"]["held_out"])

    def line(name: str, reps: dict[str, Any]) -> str:
        cats = sorted({c for r in reps.values() for c in r["per_category"]})
        per_cat = "  ".join(
            f"c{c} " + "/".join(f"{reps[k]['per_category'].get(c, float('nan')):.3f}" for k in ks)
            for c in cats
        )
        return (
            f"{name:<36} "
            + " ".join(f"{reps[k]['evidence_recall']:>7.3f}" for k in ks)
            + f"   {per_cat}"
        )

    print(
        f"\nleave-one-conversation-out ({len(cv['conversations'])} folds), recall at "
        + "/".join(ks)
        + "; per category at the same budgets"
    )
    for family in ("engine", "rrf"):
        if family not in cv:
            continue
        print(line(f"{family} (setting chosen per fold)", cv[family]["held_out"]))
        picks = zip(cv["conversations"], cv[family]["picks"], strict=True)
        print("  picks: " + ", ".join(f"{c}={p}" for c, p in picks))
    for name, reps in cv["fixed"].items():
        print(line(name, reps))


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = 10 if 10 in report["budgets"] else report["budgets"][0]
    rows = [r for r in report["results"] if r["budget"] == budget]
    cats = sorted({c for r in rows for c in r["per_category"]})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        xs = np.arange(len(cats)) + i * width
        ax.bar(xs, [r["per_category"].get(c, 0) for c in cats], width, label=r["method"])
    ax.set_xticks(np.arange(len(cats)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{c}: {CATEGORY_NAMES.get(int(c), 'category')}" for c in cats])
    ax.set_ylabel(f"evidence recall @{budget}")
    ax.set_title(f"LoCoMo evidence recall per category ({report['questions']} questions)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA.resolve(),
        help=f"LoCoMo file (default {DEFAULT_DATA.resolve()}, $MEMORYOS_GPU_LOCOMO)",
    )
    p.add_argument(
        "--budgets",
        type=positive_int,
        nargs="+",
        default=[5, 10, 20],
        help="page budgets B at which evidence recall is scored (default 5 10 20)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one conversation (unless --conversations is given), its first 40 questions",
    )
    p.add_argument("--llm", action="store_true", help="also the LLM mode (bundled SmolLM2)")
    p.add_argument(
        "--llm-conversations",
        type=positive_int,
        default=1,
        help="conversations the --llm mode runs on (slow on CPU; default 1)",
    )
    p.add_argument(
        "--conversations",
        type=nonnegative_int,
        default=None,
        help="first N conversations (default 0 = all; --quick: 1)",
    )
    p.add_argument(
        "--max-pages",
        type=nonnegative_int,
        default=0,
        help="keep the first N pages of each conversation and the questions answerable from "
        "them (bounds slow LLM-mode runs; 0 = all)",
    )
    p.add_argument("--only", nargs="*", help="engine configurations to run (default: all)")
    p.add_argument("--json", type=Path, default=None, help="write the report here (JSON)")
    p.add_argument(
        "--cv",
        action="store_true",
        help="also choose the engine's BM25 weight (lexical_weight) leave-one-conversation-out: "
        "for each conversation, the --cv-grid weight with the best mean recall on the OTHER "
        "conversations is scored on it (only a dev split exists); needs 2+ conversations",
    )
    p.add_argument(
        "--cv-rrf-k",
        type=positive_int,
        nargs="+",
        default=[60, 1, 2, 5, 10, 20],
        help="k of the RRF baseline --cv chooses from (the same leave-one-out rule)",
    )
    p.add_argument(
        "--cv-grid",
        type=parse_cv_setting,
        nargs="+",
        default=[1.0, 0.5, 0.67, 0.8, 1.25, 1.5, 2.0],
        help="BM25 weights --cv chooses from (the first is the tie winner)",
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG bar chart per category")
    p.add_argument(
        "--answer-backend",
        choices=["transformers", "openai", "vllm"],
        help="also answer questions and report token F1 / BLEU-1 (default: no answering)",
    )
    p.add_argument("--answer-model", help="model (folder, GGUF or served name)")
    p.add_argument("--answer-base-url", help="OpenAI-compatible server, e.g. http://host:8000/v1")
    p.add_argument("--answer-questions", type=positive_int, default=100, help="questions answered")
    p.add_argument(
        "--answer-budget", type=positive_int, default=10, help="pages in the answer prompt"
    )
    p.add_argument(
        "--answer-max-tokens",
        type=positive_int,
        default=32,
        help="tokens an answer may have (default 32)",
    )
    p.add_argument(
        "--answer-methods",
        nargs="+",
        default=["rrf", "engine-llm-free-paper"],
        help="methods whose retrievals are answered",
    )
    args = p.parse_args(argv)
    check_output(p, args.json, args.plot)  # a bad output path fails now, not after the run
    apply_defaults(args, full={"conversations": 0}, quick={"conversations": 1})
    convs = select(load_locomo_data(p, args.data), args)  # not LoCoMo: one line, exit 2
    check_locomo_work(p, args.data, convs, scored=True)
    report = run(args, convs)
    print_table(report)
    if "cv" in report:
        print_cv(report["cv"])
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    run_main(main)

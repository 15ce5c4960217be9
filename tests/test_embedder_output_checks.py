"""A custom embedder's bad rows are refused before they are stored.

The engine took ``encode``'s output as it came: rows of the wrong width or with a NaN were
committed, and every derived-work round that later read them failed, for every user in the
round (rounds mix users), until the page was found and deleted; too few rows failed in a
``zip``, naming nothing. Every engine encode now goes through ``embed.base.encode_checked``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu.embed import HashingEmbedder
from memoryos_gpu.embed.base import EmbeddingError

BAD: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "narrow": lambda v: v[:, :10],
    "nan": lambda v: np.where(np.arange(v.shape[1]) == 0, np.nan, v).astype(np.float32),
    "inf": lambda v: np.full_like(v, np.inf),
    "short": lambda v: v[:-1],
    "flat": lambda v: v.ravel(),
}


class Switchable(HashingEmbedder):
    """The hashing embedder, whose output ``spoil`` (when set) spoils."""

    spoil: Callable[[np.ndarray], np.ndarray] | None = None

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        v = super().encode(texts)
        return self.spoil(v) if self.spoil else v


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_rows_refuse_the_batch_and_leave_the_others_derived_work_alone(
    tmp_path: Path, bad: str
) -> None:
    emb = Switchable()
    cfg = EngineConfig(store=str(tmp_path / "s"), embedder="hashing")
    with MemoryEngine(cfg, embedder=emb) as e:
        emb.spoil = BAD[bad]
        with pytest.raises(EmbeddingError, match=emb.model_id):
            e.add_many(
                [{"user_id": "u", "user_input": "bad page"}, {"user_id": "a", "user_input": "x"}]
            )
        emb.spoil = None
        assert e.stats()["users"] == 0 and e.stats()["store"]["audit"] == 0  # nothing written
        for i in range(12):  # enough to push pages out of both users' STM into MTM
            e.add_many(
                [
                    {"user_id": "u", "user_input": f"filler {i}"},
                    {"user_id": "a", "user_input": f"alice page {i} marathon"},
                ]
            )
        e.flush()
        assert e.stats()["counters"]["derived_failures"] == 0
        assert e.retrieve("a", "marathon").pages  # alice's pages reached mid-term memory


def test_a_bad_query_embedding_is_refused_naming_the_embedder(tmp_path: Path) -> None:
    emb = Switchable()
    with MemoryEngine(EngineConfig(store=":memory:", embedder="hashing"), embedder=emb) as e:
        e.add("u", "hello there")
        emb.spoil = BAD["narrow"]
        with pytest.raises(EmbeddingError, match="one row of its dim per text"):
            e.retrieve("u", "hello")

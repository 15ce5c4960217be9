"""A chat log added in one batch ages as it does one page at a time: each page's segment is
stamped (recency, eviction heat, promotion heat) with its user's logical clock when the page
left STM, recorded in its pending row (schema 9). The round used the user's clock when it
ran: every segment of a batch got the batch's newest time, all heats tied, and eviction could
drop the newest segment while an older one stayed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu.config import preset

TEXTS = ["AAA apple orchard", "BBB bicycle gears", "CCC cello strings", "DDD dolphin sonar",
         "EEE eagle nest", "ZZZ zebra"]  # fmt: skip
TIMES = [1_000.0, 2e6, 4e6, 6e6, 8e6, 1e7]


class AxisEmbedder:
    """Each page on its own axis (by its marker, AAA to ZZZ), so no page joins another's
    segment; any other text (a fact) on the last axis."""

    dim, model_id = 8, "axes-8"

    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, t in enumerate(texts):
            axis = next((k for k, m in enumerate(TEXTS) if m[:3] in t), self.dim - 1)
            out[i, axis] = 1.0
        return out


def _ingest(one_batch: bool, **memory: Any) -> MemoryEngine:
    cfg = EngineConfig(store=":memory:", memory=preset("paper", stm_capacity=1, **memory))
    engine = MemoryEngine(cfg, embedder=AxisEmbedder())
    pages = [
        {"user_id": "u", "user_input": t, "agent_response": "", "timestamp": ts}
        for t, ts in zip(TEXTS, TIMES, strict=True)
    ]
    if one_batch:
        engine.add_many(pages)
    else:
        for p in pages:
            engine.add_many([p])
    engine.process_pending()
    return engine


def _segments(engine: MemoryEngine) -> list[tuple[str, float]]:
    rows = engine.store.query("SELECT summary, last_access FROM segments ORDER BY summary")
    return [(summary[:3], last) for summary, last in rows]


def _evicted(engine: MemoryEngine) -> list[str]:
    pages, _total = engine.list_pages("u")
    return sorted(p["user_input"][:3] for p in pages if p["tier"] == "evicted")


def test_one_batch_stamps_each_segment_as_one_page_a_call_does() -> None:
    one = _ingest(one_batch=False, mtm_capacity=3)
    batch = _ingest(one_batch=True, mtm_capacity=3)
    try:
        assert _segments(batch) == _segments(one)
        assert _evicted(batch) == _evicted(one) == ["AAA", "BBB"]  # the two oldest
        assert {last for _, last in _segments(batch)} == {6e6, 8e6, 1e7}  # not all 1e7
    finally:
        one.close()
        batch.close()


@pytest.mark.parametrize("one_batch", [False, True])
def test_the_stamp_is_the_time_of_the_page_that_pushed_it_out(one_batch: bool) -> None:
    engine = _ingest(one_batch=one_batch, mtm_capacity=10)
    try:
        # STM holds one page: page i leaves it when page i + 1 comes, at page i + 1's time
        assert _segments(engine) == [
            (t[:3], ts) for t, ts in zip(TEXTS[:-1], TIMES[1:], strict=True)
        ]
    finally:
        engine.close()

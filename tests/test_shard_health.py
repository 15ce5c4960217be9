"""``serve --engines K``: the engines' health as one for ``/ready``, ``/metrics`` and
``/v1/stats``: a state any engine is degraded in, derived rounds summed, the LLM backends'
counts summed under the worst breaker state."""

from __future__ import annotations

import types
from typing import Any

from memoryos_gpu.server.shard_router import ShardedRemoteService


def _part(health: dict[str, Any]) -> Any:
    return types.SimpleNamespace(health=lambda: health)


def test_the_shards_health_is_merged_with_the_worst_breaker() -> None:
    parts = [
        _part(
            {
                "degraded": ["store_full"],
                "llm": {"backend": "openai", "calls": 3, "errors": 0, "breaker": "closed"},
                "derived_runs": 2,
            }
        ),
        _part(
            {
                "degraded": ["llm_unavailable", "store_full"],
                "llm": {"backend": "openai", "calls": 5, "errors": 5, "breaker": "open"},
                "derived_runs": 4,
            }
        ),
    ]
    merged = ShardedRemoteService.health(types.SimpleNamespace(parts=parts))  # type: ignore[arg-type]
    assert merged["degraded"] == ["store_full", "llm_unavailable"]
    assert merged["derived_runs"] == 6
    assert merged["llm"]["calls"] == 8 and merged["llm"]["errors"] == 5
    assert merged["llm"]["breaker"] == "open"


def test_shards_without_an_llm_merge_to_none() -> None:
    parts = [_part({"degraded": [], "llm": None, "derived_runs": 1})] * 2
    merged = ShardedRemoteService.health(types.SimpleNamespace(parts=parts))  # type: ignore[arg-type]
    assert merged == {"degraded": [], "llm": None, "derived_runs": 2}

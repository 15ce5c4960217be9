"""A drain (``flush``, an ``add_many``'s derived work) takes the pages pending when it began:
pages written meanwhile by other threads wait for the next call. Before, a ``flush`` called for
read-your-writes under writers that never paused drained their pages too, and ran as long as
they wrote (150 s under 32 writer threads), every other caller's derived work behind it."""

from __future__ import annotations

import threading
from typing import Any

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu.config import preset


def _pages(user: str, n: int) -> list[dict[str, Any]]:
    return [
        {"user_id": user, "user_input": f"{user} note {i} about topic {i % 3}"} for i in range(n)
    ]


def test_a_flush_leaves_the_pages_written_during_it_pending(tmp_path) -> None:
    cfg = EngineConfig(
        store=str(tmp_path / "s"),
        embedder="hashing",
        auto_process=False,
        derived_max_batch=4,
        memory=preset("paper", stm_capacity=1),
    )
    with MemoryEngine(cfg) as engine:
        engine.add_many([p for u in ("a", "b", "c") for p in _pages(u, 5)])
        before = engine.pending_count()
        assert before == 12  # 5 pages a user, 1 kept in STM
        rounds = [0]
        original = engine._process_pages

        def round_with_a_writer(items: Any) -> int:  # another thread writes during each round
            rounds[0] += 1
            if rounds[0] <= 40:
                writer = threading.Thread(
                    target=engine.add_many, args=(_pages(f"w{rounds[0]}", 3),)
                )
                writer.start()
                writer.join()
            return original(items)

        engine._process_pages = round_with_a_writer  # type: ignore[method-assign]
        done = engine.flush()
        assert done["pages"] == before  # exactly what was pending when it began
        assert rounds[0] == 3  # 12 pages in rounds of 4; before: 40 more rounds of others'
        assert engine.pending_count() == 2 * rounds[0]  # each writer's 3 pages, 1 in STM
        del engine._process_pages
        assert engine.flush()["pages"] == 2 * rounds[0]  # the next call takes them

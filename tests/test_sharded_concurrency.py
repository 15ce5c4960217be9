"""The in-process ShardedEngine keeps calls apart only where they cross shards.

Before, one router lock kept every call apart: a retrieval waited for another caller's whole
``add_many`` (its embedding included, which ``accept_many`` also made under the shard's engine
lock) and for another caller's LLM response. Now writes, retrievals, responses and promotions
share the router's gate and a deletion across shards takes it alone
(``distributed/sharding.py``). Here the embedder or the LLM blocks on an event until the test
releases it, so each test knows the slow call is in flight while it retrieves: every wait is
bounded, and a router that kept the calls apart fails the latency assertion instead of
hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gates import GATE_TIMEOUT, Background, GatedScript

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.distributed.layout import ShardMap
from memoryos_gpu.distributed.sharding import ShardedEngine
from memoryos_gpu.embed.hashing import HashingEmbedder
from memoryos_gpu.llm.scripted import ScriptedBackend

FAST_S = 1.0  # what a call beside a blocked one must take at most (idle: milliseconds)
SHORT_S = 0.3  # how long something that must wait is watched waiting

MARK = "zebra-crossing"  # a page or query with this text blocks its embedding while armed


class GatedEmbedder:
    """The hashing embedder, whose batches holding :data:`MARK` block while armed."""

    def __init__(self) -> None:
        self._inner = HashingEmbedder(dim=64)
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()

    @property
    def dim(self) -> int:
        return self._inner.dim

    @property
    def model_id(self) -> str:
        return self._inner.model_id

    def arm(self) -> None:
        self.entered.clear()
        self.release.clear()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not self.release.is_set() and any(MARK in t for t in texts):
            self.entered.set()
            self.release.wait(GATE_TIMEOUT)
        return self._inner.encode(texts)


def started(fn: Callable[[], Any]) -> Background:
    """``fn`` running on a thread of its own."""
    worker = Background(fn)
    worker.start()
    return worker


def users_on_both_shards() -> tuple[str, str]:
    """Two user ids, one on each of two shards."""
    m = ShardMap(2)
    names = [f"user-{i}" for i in range(50)]
    return next(u for u in names if m.shard(u) == 0), next(u for u in names if m.shard(u) == 1)


@pytest.fixture
def sharded(tmp_path: Path, kit: Any) -> Any:
    """Two shards in LLM mode (scripted answers), a user on each."""
    embedder, script = (
        GatedEmbedder(),
        GatedScript(kit.Script(response="a scripted reply"), "response"),
    )
    cfg = EngineConfig(
        memory=preset("paper"),
        llm=LLMConfig(mode="llm", backend="scripted"),
        device="cpu",
        store=str(tmp_path / "sharded"),
    )
    eng = ShardedEngine(cfg, shards=2, embedder=embedder, llm=ScriptedBackend(script))
    a, b = users_on_both_shards()
    eng.add_many(
        [
            {"user_id": u, "user_input": f"{u} likes hiking in the hills", "agent_response": "ok"}
            for u in (a, b)
        ]
    )
    yield eng, embedder, script, (a, b)
    embedder.release.set()
    script.release.set()
    eng.close()


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_retrievals_go_on_while_an_add_embeds(sharded: Any) -> None:
    """A batch blocked in its embedding (on one shard) holds up no retrieval on either shard,
    and its pages are there once it finishes."""
    eng, embedder, _, (a, b) = sharded
    embedder.arm()
    add = started(
        lambda: eng.add_many(
            [{"user_id": a, "user_input": f"a {MARK} today", "agent_response": ""}]
        )
    )
    assert embedder.entered.wait(GATE_TIMEOUT)
    for user in (a, b):
        assert timed(lambda u=user: eng.retrieve_many([(u, "hiking")])) < FAST_S
    assert add.is_alive()  # still embedding: the retrievals did not wait for it
    embedder.release.set()
    assert not add.finish()[0].duplicate
    pages = eng.retrieve(a, MARK, top_pages=20).stm
    assert any(MARK in p.user_input for p in pages)


def test_a_write_goes_on_while_another_embeds(sharded: Any) -> None:
    """Two writers to different shards: the second does not wait for the first's embedding."""
    eng, embedder, _, (a, b) = sharded
    embedder.arm()
    slow = started(
        lambda: eng.add_many([{"user_id": a, "user_input": f"{MARK} here", "agent_response": ""}])
    )
    assert embedder.entered.wait(GATE_TIMEOUT)
    page = {"user_id": b, "user_input": "the second writer", "agent_response": ""}
    assert timed(lambda: eng.add_many([page])) < FAST_S
    embedder.release.set()
    slow.finish()


def test_retrievals_go_on_while_a_response_waits_for_the_llm(sharded: Any) -> None:
    eng, _, script, (a, b) = sharded
    script.arm()
    respond = started(lambda: eng.respond(a, "what do I like?"))
    assert script.entered.wait(GATE_TIMEOUT)
    assert timed(lambda: eng.retrieve_many([(a, "hiking"), (b, "hiking")])) < FAST_S
    script.release.set()
    assert respond.finish().text == "a scripted reply"


def test_a_deletion_waits_for_the_calls_in_flight_and_goes_alone(sharded: Any) -> None:
    """A deletion across shards waits for the add in flight (so it cannot forget half of what
    the add brings), and calls that come while it waits wait behind it; afterwards the user
    is gone on every shard and the other user answers as before."""
    eng, embedder, _, (a, b) = sharded
    embedder.arm()
    add = started(
        lambda: eng.add_many([{"user_id": a, "user_input": f"{MARK} again", "agent_response": ""}])
    )
    assert embedder.entered.wait(GATE_TIMEOUT)
    delete = started(lambda: eng.delete_user(a))
    time.sleep(SHORT_S)
    assert delete.is_alive()  # waits for the add
    later = started(lambda: eng.retrieve_many([(b, "hiking")]))
    time.sleep(SHORT_S)
    assert later.is_alive()  # a waiting deletion goes first
    embedder.release.set()
    add.finish()
    assert delete.finish() is True
    assert later.finish()[0].user_id == b
    assert a not in eng.users()
    assert b in eng.users()

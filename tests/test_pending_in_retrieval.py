"""Pages pushed out of STM whose derived work is pending are retrieved with the STM.

A page leaving the 7-page STM waits (tier ``pending``) for a derived round to place it in MTM,
which in LLM mode needs the LLM. Before the fix, a retrieval showed such a page nowhere: while
the LLM was down (or before the derived-work thread ran), the retrievable memory shrank. Now
the pending pages lead the ``stm`` list, oldest first, until a round places them in MTM; then
they are retrieved from there only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm.base import ChatRequest, ChatResult, LLMBackendError
from memoryos_gpu.llm.scripted import ScriptedBackend

USER = "alice"
N_PAGES = 10  # 7 in STM, 3 pushed out


class SwitchedLLM(ScriptedBackend):
    """A scripted LLM that fails every batch (the server down) while ``down``."""

    def __init__(self, responder: object) -> None:
        super().__init__(responder)  # type: ignore[arg-type]
        self.down = True

    def _generate_batch(self, requests: list[ChatRequest]) -> list[ChatResult]:
        if self.down:
            raise LLMBackendError("cannot connect to the LLM server: unreachable (test)")
        return super()._generate_batch(requests)


@pytest.fixture
def open_engine(kit, tmp_path: Path):
    """``open_engine(store)`` -> (engine, its SwitchedLLM, down), closed after the test."""
    made: list[MemoryEngine] = []

    def make(store: str = ":memory:") -> tuple[MemoryEngine, SwitchedLLM]:
        cfg = EngineConfig(
            memory=preset("paper"),
            llm=LLMConfig(mode="llm", backend="scripted"),
            embedder="hashing",
            device=kit.device,
            store=store,
        )
        llm = SwitchedLLM(kit.Script())
        eng = MemoryEngine(cfg, embedder=kit.TableEmbedder(), llm=llm)
        made.append(eng)
        return eng, llm

    yield make
    for eng in made:
        eng.close()


def _add_pages(eng: MemoryEngine) -> list[int]:
    """N_PAGES pages of USER, one add each (each add's derived work fails: LLM down)."""
    return [
        eng.add(USER, f"message {i} about topic {i}", f"reply {i}", timestamp=1000.0 + i).page_id
        for i in range(N_PAGES)
    ]


def test_pages_out_of_stm_are_retrieved_while_their_derived_work_is_pending(
    open_engine,
) -> None:
    eng, llm = open_engine()
    ids = _add_pages(eng)
    assert eng.pending_count(USER) == N_PAGES - 7  # the LLM is down: nothing placed in MTM
    r = eng.retrieve(USER, "message about topic")
    assert [p.page_id for p in r.stm] == ids  # 3 pending (oldest first), then the 7 in STM
    assert r.pages == []  # nothing in MTM yet
    assert [p.user_input for p in r.stm[:3]] == [f"message {i} about topic {i}" for i in range(3)]
    (body,) = eng.retrieve_many([(USER, "message")], as_json=True)  # the server's route
    assert [p["page_id"] for p in json.loads(body)["stm"]] == ids

    llm.down = False  # the LLM is back: the round places the pending pages in MTM
    eng.process_pending()
    assert eng.pending_count(USER) == 0
    r = eng.retrieve(USER, "message about topic", top_pages=N_PAGES)
    assert [p.page_id for p in r.stm] == ids[3:]  # the STM only
    assert sorted(p.page_id for p in r.pages) == ids[:3]  # in MTM, not duplicated in stm


def test_pending_pages_are_retrieved_after_a_reopen(open_engine, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    eng, _ = open_engine(store)
    ids = _add_pages(eng)
    eng.close()
    eng, _ = open_engine(store)  # resumes the pending work, which fails again: LLM down
    assert eng.pending_count(USER) == N_PAGES - 7
    assert [p.page_id for p in eng.retrieve(USER, "message").stm] == ids


def test_a_deleted_pending_page_leaves_the_stm_list(open_engine) -> None:
    eng, _ = open_engine()
    ids = _add_pages(eng)
    assert eng.delete_page(ids[1])
    assert [p.page_id for p in eng.retrieve(USER, "message").stm] == [ids[0], *ids[2:]]
    assert eng.delete_user(USER)
    eng.add(USER, "a new life", "hello", timestamp=5000.0)  # a namesake starts empty
    assert [p.user_input for p in eng.retrieve(USER, "life").stm] == ["a new life"]

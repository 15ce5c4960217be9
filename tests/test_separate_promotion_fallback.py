"""Promotion by the paper's separate calls (``fused=False``): one call that fails (or answers
outside its schema) falls back alone; the other calls' answers are kept. Before, the whole
promotion took the extractive fallback, and as its pages are not analysed again, the facts the
other calls gave were lost for good."""

from __future__ import annotations

from typing import Any

import pytest

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu.config import LLMConfig, preset
from memoryos_gpu.llm.scripted import ScriptedBackend

USER_FACT = "User owns a boat named Nautilus"
ASSISTANT_FACT = "Assistant recommended life jackets"


def _responder(failing: str) -> Any:
    def answer(req: Any) -> Any:
        if req.stage == failing:
            return RuntimeError(f"{failing} call timed out")
        return {
            "continuity": {"continuous": True},
            "chain_meta": {"meta": "boats"},
            "topic_summary": {"summary": "boats", "keywords": ["boat"]},
            "profile": {"updates": {}},
            "user_knowledge": {"facts": [USER_FACT]},
            "assistant_knowledge": {"facts": [ASSISTANT_FACT]},
        }[req.stage]

    return answer


def _promoted(failing: str) -> tuple[list[str], list[str], dict[str, Any]]:
    cfg = EngineConfig(
        store=":memory:",
        embedder="hashing",
        memory=preset("paper", stm_capacity=1),
        llm=LLMConfig(mode="llm", backend="scripted", fused=False),
    )
    engine = MemoryEngine(cfg, llm=ScriptedBackend(_responder(failing)))
    try:
        for i in range(3):
            engine.add("u", f"My boat is called Nautilus, question {i}", f"ok {i}", timestamp=i)
        engine.process_pending()
        assert engine.promote("u") >= 1
        kn = engine.knowledge("u")
        return (
            [k["text"] for k in kn["user"]],
            [k["text"] for k in kn["assistant"]],
            engine.stats()["llm"],
        )
    finally:
        engine.close()


@pytest.mark.parametrize("failing", ["profile", "assistant_knowledge"])
def test_the_calls_that_answered_are_kept(failing: str) -> None:
    user, assistant, llm = _promoted(failing)
    assert user == [USER_FACT]
    assert assistant == ([] if failing == "assistant_knowledge" else [ASSISTANT_FACT])
    assert llm["per_stage"]["promotion"]["fallbacks"] >= 1  # still counted as a fallback


def test_a_failed_user_knowledge_call_takes_the_extractive_facts_alone() -> None:
    user, assistant, _ = _promoted("user_knowledge")
    assert USER_FACT not in user and user  # the extractive facts: the pages' own words
    assert assistant == [ASSISTANT_FACT]

"""End to end with the real bundled models: MiniLM embeddings and SmolLM2-135M (GGUF, through
transformers) doing every LLM stage. Checks that every tier is exercised, not answer quality."""

from __future__ import annotations

import time

import pytest

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.types import PageInput

# two users, six exchanges each: their evicted pages share every LLM batch (half the calls)
CONVERSATIONS = {
    "dana": [
        ("Hi! I'm Dana and I just moved to Lisbon for a new job.", "Welcome to Lisbon, Dana!"),
        ("I work as a marine biologist at the aquarium.", "That sounds fascinating."),
        ("My favourite animals are octopuses.", "Octopuses are remarkably clever."),
        ("I have a dog named Pico.", "Pico is a lovely name."),
        ("Pico loves running on the beach with me.", "Sounds like a happy dog."),
        ("I'm allergic to peanuts, by the way.", "I'll keep that in mind."),
    ],
    "eli": [
        ("I'm Eli, a student of physics in Berlin.", "Nice to meet you, Eli."),
        ("I play the cello in a student orchestra.", "That must be fun."),
        ("We are rehearsing Dvorak's cello concerto.", "A beautiful piece."),
        ("My exams start next month.", "Good luck with them!"),
        ("Quantum mechanics is my hardest subject.", "It is hard for everyone."),
        ("I drink too much coffee when I study.", "Try to take breaks."),
    ],
}
N_TURNS = 6


@pytest.mark.slow
def test_every_tier_with_the_bundled_models():
    try:
        from memoryos_gpu.embed import bundled_minilm_path
        from memoryos_gpu.llm.transformers_backend import TransformersBackend, bundled_smollm2_path

        bundled_minilm_path()
        bundled_smollm2_path()
    except Exception as e:  # the optional model packages are missing
        pytest.skip(f"bundled models unavailable: {type(e).__name__}: {e}")

    cfg = EngineConfig(
        memory=preset("paper", stm_capacity=3, tau=2.0),
        llm=LLMConfig(mode="llm", backend="transformers", max_tokens=48),
    )
    # json_retry off: a 48-token budget truncates JSON often; the engine falls back per item
    llm = TransformersBackend(max_input_tokens=1024, json_retry=False)
    t0 = time.perf_counter()
    with MemoryEngine(cfg, llm=llm) as eng:
        for turn in range(N_TURNS):
            eng.add_many(
                [
                    PageInput(user, *CONVERSATIONS[user][turn], 1_700_000_000.0 + 60.0 * turn)
                    for user in CONVERSATIONS
                ]
            )
        n_mtm = N_TURNS - 3
        st = eng.stats()
        assert st["store"]["pages_stm"] == 2 * 3
        assert st["store"]["pages_mtm"] == 2 * n_mtm
        assert st["store"]["segments"] >= 2
        assert st["counters"]["segments_created"] >= 2
        for user in CONVERSATIONS:
            mtm = eng.store.user_pages(user, "mtm")
            assert len(mtm) == n_mtm
            assert {p["mode"] for p in mtm} <= {"llm", "llm-fallback"}
            # tau = 2: a fresh segment (0 + 1 + 1) is promoted at once
            assert all(p["analysed"] for p in mtm)
        assert st["counters"]["promotions"] >= 2
        # the page stage batched both users: 3 rounds of 2
        assert st["llm"]["per_stage"]["page"]["calls"] == 2 * n_mtm
        assert st["llm"]["per_stage"]["page"]["batches"] == n_mtm

        r = eng.retrieve("dana", "What is the name of my dog?")
        assert len(r.stm) == 3 and r.pages
        assert all(p.tier == "mtm" for p in r.pages)
        assert {p.page_id for p in r.pages} <= {p["page_id"] for p in eng.store.user_pages("dana")}

        res = eng.respond("dana", "What is the name of my dog?")
        assert isinstance(res.text, str) and res.error is None
        assert res.prompt_tokens > 0 and res.completion_tokens > 0
        assert eng.get_page(res.page_id)["agent_response"] == res.text

        llm_stats = eng.stats()["llm"]
        assert llm_stats["llm_calls"] >= 2 * n_mtm + 1
        assert llm_stats["prompt_tokens"] > 0 and llm_stats["completion_tokens"] > 0
        for stage in ("page", "promotion", "response"):
            assert llm_stats["per_stage"][stage]["calls"] >= 1
    print(f"engine work with the real models: {time.perf_counter() - t0:.1f} s")

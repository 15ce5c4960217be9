"""The row cache behind retrieval assembly: on its own against a dict model, and in the engine,
where every retrieval with the cache must equal the same retrieval read from the store."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm.scripted import ScriptedBackend
from memoryos_gpu.row_cache import RowCache

ops = st.lists(
    st.tuples(
        st.sampled_from(["get", "write", "delete"]),
        st.lists(st.integers(0, 9), max_size=6),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 6), steps=ops)
def test_row_cache_equals_its_backing_store(capacity: int, steps) -> None:
    backing = {i: f"v{i}" for i in range(10)}
    loads: list[list[int]] = []

    def load(ids):
        loads.append(list(ids))
        return {i: backing[i] for i in ids if i in backing}

    cache = RowCache(capacity, load)
    version = 0
    for op, ids in steps:
        if op == "get":
            before = set(cache._rows)
            got = cache.get_many(ids)
            assert got == {i: backing[i] for i in ids if i in backing}
            if len(set(ids) - before):  # only misses are loaded, once each, sorted
                assert loads[-1] == sorted(set(ids) - before)
        else:
            version += 1
            for i in ids:
                if op == "write":
                    backing[i] = f"v{i}.{version}"
                else:
                    backing.pop(i, None)
            cache.forget(ids)
        assert len(cache) <= capacity


def test_row_cache_keeps_the_most_recently_used() -> None:
    cache = RowCache(2, lambda ids: {i: i * 10 for i in ids})
    cache.get_many([1, 2])
    cache.get_many([1])  # 1 is now the most recently used
    cache.get_many([3])  # evicts 2
    assert set(cache._rows) == {1, 3}
    assert (cache.hits, cache.misses) == (1, 3)
    with pytest.raises(ValueError):
        RowCache(-1, dict)


def _engine(cache_size: int, kit) -> MemoryEngine:
    # every page after a user's first continues the chain: its meta is rewritten for the
    # whole chain on each new page, the case the cache must not serve stale
    pages = {f"u{u} p{i}": {"continuous": i % 4 != 0} for u in range(3) for i in range(40)}
    facts = {"user_facts": ["User likes tea.", "User has a cat."], "assistant_facts": ["A."]}
    cfg = EngineConfig(
        memory=preset("paper", stm_capacity=3, mtm_capacity=4, tau=1.5),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
        row_cache_size=cache_size,
    )
    return MemoryEngine(
        cfg,
        embedder=kit.TableEmbedder(),
        llm=ScriptedBackend(kit.Script(pages=pages, promotion=facts)),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_retrievals_equal_store_reads(seed: int, kit) -> None:
    rng = random.Random(seed)
    cached, uncached = _engine(8, kit), _engine(0, kit)  # a tiny cache: evictions happen too
    users = ["u0", "u1", "u2"]
    added = {u: 0 for u in users}
    pages: dict[str, list[int]] = {u: [] for u in users}

    def both(method: str, *args, view=lambda r: r, **kw):
        """Call ``method`` on both engines; what ``view`` keeps of the answers must agree."""
        a = view(getattr(cached, method)(*args, **kw))
        assert a == view(getattr(uncached, method)(*args, **kw))
        return a

    for step in range(60):
        u = rng.choice(users)
        action = rng.random()
        if action < 0.45 or not pages[u]:
            ui = f"{u} p{added[u]}"
            added[u] += 1
            pages[u].append(both("add", u, ui, f"r {ui}", timestamp=step).page_id)
        elif action < 0.6:
            both("update_page", rng.choice(pages[u]), agent_response=f"edited {step}")
        elif action < 0.7:
            both("delete_page", pages[u].pop(rng.randrange(len(pages[u]))))
        elif action < 0.8:
            # knowledge rows carry their wall-clock creation time: compare ids and texts
            entries = both("knowledge", u, view=lambda k: [e["entry_id"] for e in k["user"]])
            if entries and rng.random() < 0.5:
                eid = rng.choice(entries)
                both("update_knowledge", eid, f"fact {step}", view=lambda row: row["text"])
            elif entries:
                both("delete_knowledge", rng.choice(entries))
        elif action < 0.83:
            both("delete_user", u)
            pages[u] = []
        for v in users:  # retrievals heat segments, so promotions (knowledge) follow
            if pages[v]:
                both("retrieve", v, f"{v} p{rng.randrange(40)}", view=lambda r: r.to_dict())
    hits = cached.stats()["row_cache"]
    assert hits["pages"]["hits"] > 0 and hits["knowledge"]["hits"] > 0
    assert 0 < hits["pages"]["rows"] <= 8
    off = uncached.stats()["row_cache"]["pages"]  # capacity 0: every read goes to the store
    assert off["hits"] == 0 and off["rows"] == 0 and off["misses"] > 0

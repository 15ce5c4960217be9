"""Derived work runs its LLM stages without the engine lock (issue 15, item 1).

A round reads under the lock, calls the LLM (and embeds) without it and applies under it again,
applying only the items whose inputs still hold. The scripted LLM here blocks a stage on an
event until the test releases it, so each test knows the stage is running while it retrieves,
writes or deletes: an engine that held the lock through the stage would make those calls wait
for the gate's timeout, and the assertions below fail instead of hanging. Nothing depends on
how fast the machine is except one comparison of retrieval latency with the idle latency
measured in the same test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import statistics
import time
from typing import Any

import pytest
from gates import GATE_TIMEOUT, Background, GatedScript
from store_backends import make_backend

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm.base import ChatRequest, ChatResult, LLMBackendError
from memoryos_gpu.llm.scripted import ScriptedBackend
from memoryos_gpu.server.service import MemoryService
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import PageInput


class FailingBackend(ScriptedBackend):
    """A backend that fails a whole stage batch (as a real one does when its server is gone)
    while ``fail_stage`` names that stage."""

    def __init__(self, responder: Any) -> None:
        super().__init__(responder)
        self.fail_stage: str | None = None

    def _generate_batch(self, requests: list[ChatRequest]) -> list[ChatResult]:
        if requests[0].stage == self.fail_stage:
            raise LLMBackendError("the LLM server went away")
        return super()._generate_batch(requests)


_ENGINES: list[MemoryEngine] = []


@pytest.fixture(autouse=True)
def _close_engines() -> Any:
    """Every engine a test built is closed after it (its gate released first)."""
    yield
    while _ENGINES:
        with contextlib.suppress(Exception):  # already closed by the test
            _ENGINES.pop().close()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def store_backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A SQLite file, or a fresh schema of the PostgreSQL test server (skipped without one,
    see tests/store_backends.py): the checks of what a round re-reads run on both stores."""
    b = make_backend(request.param, tmp_path_factory.mktemp(request.param))
    yield b
    b.cleanup()


def build(
    responder: Any,
    *,
    backend: type[ScriptedBackend] = ScriptedBackend,
    store: str = ":memory:",
    **memory: Any,
) -> MemoryEngine:
    """An LLM-mode engine on the hashing embedder, STM of one page, derived work on demand."""
    cfg = EngineConfig(
        store=store,
        memory=preset("paper", **{"stm_capacity": 1, **memory}),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device=os.environ.get("MEMORYOS_TEST_DEVICE", "cpu"),
        auto_process=False,
    )
    engine = MemoryEngine(cfg, llm=backend(responder))
    _ENGINES.append(engine)
    return engine


def two_pages(eng: MemoryEngine, user: str, t0: float = 1.0) -> list[int]:
    """Pages ``<user> one`` and ``<user> two``: the first is pushed out of STM (pending)."""
    return [
        eng.add(user, f"{user} {name}", f"ok {name}", timestamp=t0 + i).page_id
        for i, name in enumerate(("one", "two"))
    ]


def retrieval_seconds(eng: MemoryEngine, users: list[str], n: int = 7) -> float:
    """Median wall time of a batched retrieval for ``users``."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.retrieve_many([(u, f"what did {u} say") for u in users])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def page_requests(eng: MemoryEngine, kit: Any, user_input: str) -> list[ChatRequest]:
    """The page-stage requests about the page whose user input is ``user_input``."""
    return [
        r for r in eng.llm.requests if r.stage == "page" and kit.current_user_input(r) == user_input
    ]


# ---------------------------------------------------------------------------- latency
def test_retrievals_and_writes_do_not_wait_for_a_rounds_llm_call(kit) -> None:
    gate = GatedScript(kit.Script(), "page")
    eng = build(gate)
    users = [f"u{i}" for i in range(4)]
    for u in users:
        two_pages(eng, u)
    eng.add("w", "w one", "ok", timestamp=1.0)
    assert eng.pending_count() == 4
    eng.retrieve_many([(u, "warm up") for u in users])
    idle = retrieval_seconds(eng, users)
    gate.arm()
    worker = Background(eng.process_pending)
    worker.start()
    assert gate.entered.wait(GATE_TIMEOUT)
    during = retrieval_seconds(eng, users)
    eng.add("w", "w two, written while the LLM thinks", "ok", timestamp=2.0)
    assert eng.get_page(eng.add("w", "w three", "ok", timestamp=3.0).page_id) is not None
    blocked = worker.is_alive() and not gate.release.is_set()
    gate.release.set()
    done = worker.finish()
    assert blocked  # every call above returned while the round's LLM call was still waiting
    assert during < idle + 0.05, (idle, during)
    # the round's 4 pages: w's 2 pages pushed out meanwhile wait for the next drain
    assert done["pages"] == 4 and eng.pending_count() == 2
    assert eng.process_pending()["pages"] == 2 and eng.pending_count() == 0
    for u in users:
        first = eng.export_user(u)["pages"][0]
        assert first["tier"] == "mtm" and first["summary"] == f"sum {u} one"
    w_pages = eng.export_user("w")["pages"]
    assert [p["tier"] for p in w_pages] == ["mtm", "mtm", "stm"]


def test_retrievals_do_not_wait_for_a_promotion_llm_call(kit) -> None:
    promotion = {
        "profile_updates": {"openness": "curious"},
        "user_facts": ["User hikes every weekend."],
        "assistant_facts": [],
    }
    gate = GatedScript(kit.Script(promotion=promotion), "promotion")
    eng = build(gate, tau=1e9)  # heat never promotes by itself: only promote() does
    two_pages(eng, "u")
    eng.process_pending()
    eng.retrieve("u", "warm up")
    idle = retrieval_seconds(eng, ["u"])
    gate.arm()
    worker = Background(lambda: eng.promote("u"))
    worker.start()
    assert gate.entered.wait(GATE_TIMEOUT)
    during = retrieval_seconds(eng, ["u"])
    blocked = worker.is_alive() and not gate.release.is_set()
    gate.release.set()
    assert worker.finish() == 1
    assert blocked and during < idle + 0.05, (idle, during)
    assert eng.profile("u") == {"openness": "curious"}
    assert [e["text"] for e in eng.knowledge("u")["user"]] == ["User hikes every weekend."]
    assert eng.pending_count() == 0


# ---------------------------------------------------------------------------- deletions
def test_a_page_deleted_while_its_round_runs_is_not_resurrected(kit, store_backend) -> None:
    gate = GatedScript(kit.Script(), "page")
    eng = build(gate, store=store_backend.spec("deleted-page"))
    a_one, _ = two_pages(eng, "a")
    b_one, _ = two_pages(eng, "b")
    gate.arm()
    worker = Background(eng.process_pending)
    worker.start()
    assert gate.entered.wait(GATE_TIMEOUT)
    assert eng.delete_page(a_one)  # takes the lock: returns while the LLM call waits
    blocked = worker.is_alive()
    gate.release.set()
    done = worker.finish()
    assert blocked
    assert done["pages"] == 2  # b's page applied, a's dropped: both off the queue
    assert eng.pending_count() == 0
    assert eng.get_page(a_one) is None
    assert eng.export_user("a")["segments"] == []
    assert not (eng._page_of_slot == a_one).any()
    assert eng.get_page(b_one)["tier"] == "mtm"
    r = eng.retrieve("a", "a one")
    assert a_one not in [p.page_id for p in r.pages + r.stm]


def test_a_user_deleted_while_its_round_runs_is_not_resurrected(kit) -> None:
    gate = GatedScript(kit.Script(), "page")
    eng = build(gate)
    two_pages(eng, "a")
    b_one, _ = two_pages(eng, "b")
    gate.arm()
    worker = Background(eng.process_pending)
    worker.start()
    assert gate.entered.wait(GATE_TIMEOUT)
    assert eng.delete_user("a")
    blocked = worker.is_alive()
    gate.release.set()
    done = worker.finish()
    assert blocked and done["pages"] == 2
    assert eng.users() == ["b"] and eng.store.rows_about("a") == 0
    assert eng.pending_count() == 0
    assert eng.get_page(b_one)["tier"] == "mtm"


def test_a_page_deleted_during_its_promotion_leaves_no_facts(kit, store_backend) -> None:
    """The promotion of a segment whose page was deleted while the LLM read it is queued
    again, and the next run finds facts only in the pages that are left."""

    def facts(req: ChatRequest) -> dict[str, Any]:
        said = re.findall(r"\nUser: (.*?)\n", req.messages[-1]["content"])
        return {"profile_updates": {}, "user_facts": [f"User said {s}." for s in said]}

    gate = GatedScript(kit.Script(pages={"u two": {"continuous": True}}, promotion=facts), "x")
    store = store_backend.spec("deleted-promoted")
    eng = build(gate, store=store, tau=1e9, theta=-1.0)  # every page joins the first segment
    one, two, three = [
        eng.add("u", f"u {n}", "ok", timestamp=i + 1.0).page_id
        for i, n in enumerate(("one", "two", "three"))
    ]
    eng.process_pending()
    assert eng.get_page(one)["segment_id"] == eng.get_page(two)["segment_id"]
    gate.stage = "promotion"
    gate.arm()
    worker = Background(lambda: eng.promote("u"))
    worker.start()
    assert gate.entered.wait(GATE_TIMEOUT)
    assert eng.delete_page(one)
    gate.release.set()
    assert worker.finish() == 0  # its pages changed: not applied, still queued
    assert eng.knowledge("u")["user"] == [] and eng.pending_count() == 1
    assert eng.process_pending()["promotions"] == 1
    assert [e["text"] for e in eng.knowledge("u")["user"]] == ["User said u two."]
    assert eng.get_page(two)["analysed"] and eng.get_page(three)["tier"] == "stm"


# ---------------------------------------------------------------------------- changed inputs
@pytest.mark.parametrize("change", ["edit the page", "delete the chain tail"])
def test_items_whose_inputs_changed_are_requeued_and_applied_later(
    kit, store_backend, change: str
) -> None:
    gate = GatedScript(kit.Script(), "page")
    eng = build(gate, store=store_backend.spec("requeued"))
    one, two = two_pages(eng, "u")
    eng.process_pending()  # "u one" in MTM: the chain tail two's round reads
    three = eng.add("u", "u three", "ok three", timestamp=3.0).page_id
    gate.arm()
    worker = Background(eng.process_pending)
    worker.start()
    assert gate.entered.wait(GATE_TIMEOUT)
    if change == "edit the page":
        eng.update_page(two, user_input="u two edited")
    else:
        assert eng.delete_page(one)
    gate.release.set()
    done = worker.finish()
    assert done["pages"] == 0  # nothing applied: the round's only item changed under it
    row = eng.get_page(two)
    assert row["tier"] == "pending" and row["summary"] is None and eng.pending_count() == 1
    assert eng.process_pending()["pages"] == 1  # applied from what is there now
    row = eng.get_page(two)
    assert row["tier"] == "mtm" and eng.pending_count() == 0
    if change == "edit the page":
        assert row["summary"] == "sum u two edited" and row["prev_page"] is None
        assert len(page_requests(eng, kit, "u two edited")) == 1
    else:
        assert row["summary"] == "sum u two" and row["prev_page"] is None
        prompts = [r.messages[-1]["content"] for r in page_requests(eng, kit, "u two")]
        assert len(prompts) == 2  # the first saw the deleted page, the one applied did not
        assert "User: u one" in prompts[0] and "User: u one" not in prompts[1]
    assert eng.get_page(three)["tier"] == "stm"


# ---------------------------------------------------------------------------- failures
def test_an_exception_in_a_stage_leaves_every_item_pending(kit) -> None:
    eng = build(kit.Script(), backend=FailingBackend)
    pages = [two_pages(eng, u)[0] for u in ("a", "b")]
    eng.llm.fail_stage = "page"
    with pytest.raises(LLMBackendError):
        eng.process_pending()
    assert eng.pending_count() == 2
    assert all(eng.get_page(p)["tier"] == "pending" for p in pages)
    assert eng.export_user("a")["segments"] == []
    eng.llm.fail_stage = None  # the next call (the lease was given back) applies them
    assert eng.process_pending()["pages"] == 2
    assert all(eng.get_page(p)["tier"] == "mtm" for p in pages)


def test_an_exception_in_the_promotion_stage_leaves_it_queued(kit) -> None:
    promotion = {"profile_updates": {"openness": "curious"}, "user_facts": ["User sings."]}
    eng = build(kit.Script(promotion=promotion), backend=FailingBackend, tau=1e9)
    two_pages(eng, "u")
    eng.process_pending()
    eng.llm.fail_stage = "promotion"
    with pytest.raises(LLMBackendError):
        eng.promote("u")
    assert eng.pending_count() == 1 and eng.profile("u") == {}
    eng.llm.fail_stage = None
    assert eng.process_pending()["promotions"] == 1
    assert eng.profile("u") == {"openness": "curious"} and eng.pending_count() == 0
    assert [e["text"] for e in eng.knowledge("u")["user"]] == ["User sings."]


# ---------------------------------------------------------------------------- two callers
def test_two_callers_at_once_apply_each_item_once(kit) -> None:
    gate = GatedScript(kit.Script(), "page")
    eng = build(gate)
    users = [f"u{i}" for i in range(3)]
    for u in users:
        two_pages(eng, u)
    gate.arm()
    first = Background(eng.process_pending)
    first.start()
    assert gate.entered.wait(GATE_TIMEOUT)
    second = Background(eng.process_pending)
    second.start()
    time.sleep(0.2)  # time for the second caller to reach the lease (it passes on too slowly)
    gate.release.set()
    done = [first.finish(), second.finish()]
    assert sum(d["pages"] for d in done) == 3 and eng.pending_count() == 0
    for u in users:  # one LLM request per page, one segment per user, nothing applied twice
        assert len(page_requests(eng, kit, f"{u} one")) == 1
        assert len(eng.export_user(u)["segments"]) == 1
    assert eng.stats()["counters"]["segments_created"] == 3


# ---------------------------------------------------------------------------- the server
def test_the_servers_worker_leaves_retrievals_free_while_it_waits_for_the_llm(kit) -> None:
    gate = GatedScript(kit.Script(), "page")
    eng = build(gate)
    gate.arm()

    async def scenario() -> tuple[bool, Any, bool, dict[str, Any]]:
        svc = MemoryService(eng, ServerSettings(derived_max_wait_ms=0))
        await svc.start()
        try:
            await svc.add_pages([PageInput("u", "u one", "ok", 1.0), PageInput("u", "u two")])
            entered = await asyncio.to_thread(gate.entered.wait, GATE_TIMEOUT)
            found = await asyncio.wait_for(svc.retrieve("u", "u two"), GATE_TIMEOUT / 2)
            blocked = not gate.release.is_set()
            gate.release.set()
            waited = await svc.wait_for_user("u", timeout=GATE_TIMEOUT)
        finally:
            gate.release.set()
            await svc.close()
        return entered, found, blocked, waited

    entered, found, blocked, waited = asyncio.run(scenario())
    assert entered and blocked
    # "u one", out of STM and waiting for the LLM, is retrieved with the STM meanwhile
    assert [p.user_input for p in found.stm] == ["u one", "u two"]
    assert waited["done"]
    assert eng.export_user("u")["pages"][0]["summary"] == "sum u one"
    eng.close()

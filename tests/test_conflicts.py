"""Conflicts and duplicates among long-term facts (issue 17, item 3): the rule, the engine in
extractive and LLM mode, and the scripted change-of-mind measurement."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.engine.conflicts import fact_key
from memoryos_gpu.llm.base import ChatRequest
from memoryos_gpu.llm.scripted import ScriptedBackend

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("I live in Seattle.", ("residence", "seattle")),
        ("I moved to Boston last month.", ("residence", "boston")),
        ("The user lives in New York City.", ("residence", "new york city")),
        ("I work as a nurse now.", ("job", "nurse")),
        ("My job is software engineer.", ("job", "software engineer")),
        ("I work at Google.", ("employer", "google")),
        ("My dog is called Max.", ("dog.name", "max")),
        ("My dog Max comes along.", ("dog.name", "max")),
        ("We renamed our dog Rex.", ("dog.name", "rex")),
        ("My favourite colour is green.", ("favourite colour", "green")),
        ("My name is Sam.", ("name", "sam")),
        ("My brother is a doctor.", None),  # one of many facts about him, not an attribute
        ("My sister is Anna.", None),
        ("I like long walks.", None),
        ("Hello there!", None),
        # the broadened rule: other ways of stating the same attributes
        ("I'm now working as a chef.", ("job", "chef")),
        ("I got a job as a pilot.", ("job", "pilot")),
        ("I got a job at Microsoft.", ("employer", "microsoft")),
        ("I relocated to Denver.", ("residence", "denver")),
        ("We moved to Austin.", ("residence", "austin")),
        ("I'm now based in Chicago.", ("residence", "chicago")),
        ("My home is now in Miami.", ("residence", "miami")),
        ("My cat's name is Luna.", ("cat.name", "luna")),
        ("We named our dog Milo.", ("dog.name", "milo")),
        ("We call our cat Coco.", ("cat.name", "coco")),
        # similar sentences that state no attribute of the speaker
        ("My sister lives in Boston.", None),
        ("I visited my friend who lives in Boston.", None),
        ("My sister's dog is called Rex.", None),
        ("I used to live in Seattle.", None),
        ("I want to move to Boston.", None),
        ("I don't live in Seattle anymore.", None),
        ("I moved to a new flat.", None),
        ("I got a job at a startup.", None),
        ("We got a cat called Luna.", None),  # maybe a second cat, not a new name
    ],
)
def test_fact_key(text: str, key: tuple[str, str] | None) -> None:
    assert fact_key(text) == key


_KEYED = [
    "I live in Seattle.",
    "The user lives in New York City.",
    "I'm now working as a chef.",
    "I got a job at Microsoft.",
    "My home is now in Miami.",
    "My cat's name is Luna.",
    "We renamed our dog Rex.",
    "My favourite colour is green.",
    "My name is Sam.",
    "My sister lives in Boston.",  # no key: a prefilter must not change that either
]
# what re.IGNORECASE reads as an ASCII letter, and spaces other than " "
_LOOKALIKE = {"i": ["\u0131", "\u0130", "I"], "s": ["\u017f", "S"], "k": ["\u212a", "K"]}
_SPACES = ["\u00a0", "\u2028", "\t", "\n  "]


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from(_KEYED), st.randoms(use_true_random=False), st.booleans())
def test_the_rules_prefilter_never_misses_a_key(text: str, rnd, upper: bool) -> None:
    """The word search that skips the rules for most sentences skips none a rule keys,
    whatever the case, the spacing, or the non-ASCII letters re.IGNORECASE equates with
    ASCII ones (dotless and dotted I, long s, the Kelvin sign)."""
    from memoryos_gpu.engine.conflicts import _rules_key

    chars = []
    for c in text.upper() if upper else text:
        options = _LOOKALIKE.get(c.lower(), []) + (_SPACES if c == " " else [])
        chars.append(rnd.choice(options) if options and rnd.random() < 0.3 else c)
    varied = "".join(chars)
    assert fact_key.__wrapped__(varied) == _rules_key(varied)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 150),  # one owner's group beyond the padded size classes (64)
    st.integers(1, 4),
    st.floats(0.5, 0.99),
    st.randoms(use_true_random=False),
)
def test_same_batch_pairs_under_the_threshold_change_no_decision(
    n: int, n_owners: int, threshold: float, rnd
) -> None:
    """The rule sees only the same-owner pairs that reach the threshold (an assistant shared
    by a round's users owns most of its facts, so every pair was O(round^2) Python): the pairs
    it gets are exactly the reaching ones, j ascending, and its decisions are those it made
    with every pair (near-duplicates, shared keys and ties included), whether the groups are
    scored padded and stacked (small) or alone (large)."""
    import numpy as np

    from memoryos_gpu.engine.conflicts import LiveEntry, decide
    from memoryos_gpu.engine.knowledge_ring import _same_batch

    rng = np.random.default_rng(rnd.randrange(1 << 30))
    base = rng.normal(size=(4, 8))
    emb = base[rng.integers(0, 4, n)] + rng.normal(scale=rnd.choice([0.0, 0.05, 0.5]), size=(n, 8))
    emb = emb.astype(rnd.choice([np.float32, np.float64]))  # an embedder's rows, or float64
    owners = [rnd.randrange(n_owners) for _ in range(n)]
    keys = [rnd.choice([None, ("city", "oslo"), ("city", "rome")]) for _ in range(n)]
    times = sorted(rnd.uniform(0, 10) for _ in range(n))
    live = {100: LiveEntry(0, ("city", "oslo"), 0.0)}
    nearest = [rnd.choice([(-1, 0.0), (100, rnd.uniform(0.4, 1.0))]) for _ in range(n)]
    wide = emb.astype(np.float64)
    unit = wide / np.maximum(np.linalg.norm(wide, axis=1, keepdims=True), 1e-12)
    # to 12 places, as the rule's input: copies of one fact (noise 0.0) must tie, whatever
    # the last bits of each product (a dot's SIMD path moves with the rows' alignment)
    every = [
        [(j, round(float(unit[i] @ unit[j]), 12)) for j in range(i) if owners[j] == owners[i]]
        for i in range(n)
    ]
    got = _same_batch(owners, emb, threshold)
    assert [[j for j, _ in row] for row in got] == [
        [j for j, c in row if c >= threshold] for row in every
    ]
    for row, full in zip(got, every, strict=True):
        want = {j: c for j, c in full}
        assert all(abs(c - want[j]) < 1e-9 for j, c in row)
    assert decide(owners, keys, times, nearest, live, got, threshold) == decide(
        owners, keys, times, nearest, live, every, threshold
    )


def engine(tmp: Path, llm: Any = None, store: str | None = None) -> MemoryEngine:
    cfg = EngineConfig(
        store=store or str(tmp / "store"),
        embedder="hashing",
        device="cpu",
        memory=preset("paper", stm_capacity=1, tau=1e9),
        llm=LLMConfig(mode="llm" if llm else "extractive", backend="scripted"),
    )
    return MemoryEngine(cfg, llm=llm)


def say(e: MemoryEngine, user: str, lines: list[str], t: float) -> None:
    for i, line in enumerate([*lines, "Bye."]):  # the last page stays in STM
        e.add(user, line, "I see.", timestamp=t + 60 * i)
    e.flush()
    e.promote(user)
    e.flush()


def test_a_change_of_mind_supersedes_and_history_keeps_both(tmp_path: Path) -> None:
    e = engine(tmp_path)
    try:
        say(e, "ann", ["I live in Seattle.", "My dog Max comes along."], 1.7e9)
        say(e, "ann", ["I moved to Boston last month.", "My dog Max comes along."], 1.8e9)
        live = [k["text"] for k in e.knowledge("ann")["user"]]
        assert live.count("My dog Max comes along.") == 1  # said twice, held once
        assert "I moved to Boston last month." in live and "I live in Seattle." not in live
        hist = {k["text"]: k for k in e.knowledge("ann", history=True)["user"]}
        old, new = hist["I live in Seattle."], hist["I moved to Boston last month."]
        assert not old["live"] and old["superseded_by"] == new["entry_id"]
        assert old["valid_to"] == new["valid_from"] == pytest.approx(1.8e9)
        assert hist["My dog Max comes along."]["strength"] == 2
        r = e.retrieve("ann", "Where do I live?")
        said = [k.text for k in r.user_knowledge]
        assert "I moved to Boston last month." in said and "I live in Seattle." not in said
        assert ("supersede", old["entry_id"]) in {
            (h["action"], h["item_id"]) for h in e.history("ann")
        }
    finally:
        e.close()
    e = engine(tmp_path)  # the arena's rings after a reopen: the same live entries
    try:
        r = e.retrieve("ann", "Where do I live?")
        assert "I live in Seattle." not in [k.text for k in r.user_knowledge]
    finally:
        e.close()


def test_similar_but_different_facts_supersede_nothing(tmp_path: Path) -> None:
    """Someone else's residence, job or pet, and past or wished-for values, are other facts:
    the user's own entries stay live beside them."""
    e = engine(tmp_path)
    try:
        own = ["I live in Seattle.", "I work as a nurse.", "My dog is called Max."]
        say(e, "di", own, 1.7e9)
        others = [
            "My sister lives in Boston.",
            "My brother works as a pilot.",
            "My sister's dog is called Rex.",
            "I want to move to Denver.",
            "I used to live in Austin.",
        ]
        say(e, "di", others, 1.8e9)
        entries = e.knowledge("di", history=True)["user"]
        live = {k["text"] for k in entries if k["live"]}
        assert set(own) <= live and set(others) <= live
        assert all(k["superseded_by"] is None for k in entries)
    finally:
        e.close()


def test_an_entry_edited_into_an_attribute_is_superseded_by_a_later_value(
    tmp_path: Path,
) -> None:
    """The rule finds an owner's entries by the attribute stored with each: an entry edited
    by hand (a taste -> "I live in Lisbon.") states a residence from then on, and the next
    residence said supersedes it; the attributes no new fact states are not read."""
    e = engine(tmp_path)
    try:
        tea_text = "I love drinking green tea every morning."
        say(e, "ed", [tea_text, "My dog is called Max."], 1.7e9)
        tea = next(k for k in e.knowledge("ed")["user"] if k["text"] == tea_text)
        e.update_knowledge(tea["entry_id"], "I live in Lisbon.")
        say(e, "ed", ["I moved to Porto."], 1.8e9)
        hist = {k["text"]: k for k in e.knowledge("ed", history=True)["user"]}
        porto = hist["I moved to Porto."]
        assert not hist["I live in Lisbon."]["live"]
        assert hist["I live in Lisbon."]["superseded_by"] == porto["entry_id"]
        assert hist["My dog is called Max."]["live"]  # another attribute: untouched
    finally:
        e.close()


def test_deleting_the_newer_value_makes_the_older_one_live_again(
    tmp_path: Path, backend: Any
) -> None:
    """delete_knowledge of an entry that superseded another: the older one is the current value
    again (live, validity open, in the ring: retrieval sees it), history says so, and it stays
    so after a reopen; deleting an entry in the middle of a timeline relinks it."""
    spec = backend.spec("unsupersede")
    e = engine(tmp_path, store=spec)
    try:
        say(e, "el", ["I live in Seattle."], 1.7e9)
        say(e, "el", ["I moved to Denver."], 1.8e9)
        say(e, "el", ["I moved to Boston."], 1.9e9)
        hist = {k["text"]: k for k in e.knowledge("el", history=True)["user"]}
        sea, den, bos = (
            hist[t] for t in ("I live in Seattle.", "I moved to Denver.", "I moved to Boston.")
        )
        assert sea["superseded_by"] == den["entry_id"] and den["superseded_by"] == bos["entry_id"]
        assert e.delete_knowledge(den["entry_id"])  # the middle: Seattle now ends at Boston
        hist = {k["text"]: k for k in e.knowledge("el", history=True)["user"]}
        assert hist["I live in Seattle."]["superseded_by"] == bos["entry_id"]
        assert hist["I live in Seattle."]["valid_to"] == pytest.approx(1.9e9)
        assert [k["text"] for k in e.knowledge("el")["user"]] == ["I moved to Boston."]
        assert e.delete_knowledge(bos["entry_id"])  # the live one: Seattle is live again
        live = e.knowledge("el")["user"]
        assert [k["text"] for k in live] == ["I live in Seattle."]
        assert live[0]["valid_to"] is None and live[0]["superseded_by"] is None
        r = e.retrieve("el", "Where do I live?")
        assert [k.text for k in r.user_knowledge] == ["I live in Seattle."]
        events = {(h["action"], h["item_id"]) for h in e.history("el")}
        assert ("restore", sea["entry_id"]) in events
        say(e, "el", ["I relocated to Austin."], 2.0e9)  # the timeline goes on from Seattle
        hist = {k["text"]: k for k in e.knowledge("el", history=True)["user"]}
        assert (
            hist["I live in Seattle."]["superseded_by"]
            == hist["I relocated to Austin."]["entry_id"]
        )
        assert "I moved to Denver." not in hist
        e.delete_knowledge(hist["I relocated to Austin."]["entry_id"])
    finally:
        e.close()
    e = engine(tmp_path, store=spec)  # the arena's ring after a reopen holds it too
    try:
        r = e.retrieve("el", "Where do I live?")
        assert [k.text for k in r.user_knowledge] == ["I live in Seattle."]
        assert [k["text"] for k in e.knowledge("el")["user"]] == ["I live in Seattle."]
    finally:
        e.close()


def test_a_late_statement_restored_takes_a_new_ring_position(tmp_path: Path) -> None:
    """An older statement that arrived late (history outside the ring) becomes live at the
    ring's head when the value that superseded it is deleted."""
    e = engine(tmp_path)
    try:
        say(e, "fa", ["I work as a nurse now."], 1.9e9)
        say(e, "fa", ["I work as a teacher."], 1.7e9)  # said earlier, promoted later
        hist = {k["text"]: k for k in e.knowledge("fa", history=True)["user"]}
        assert hist["I work as a teacher."]["seq"] < 0
        assert e.delete_knowledge(hist["I work as a nurse now."]["entry_id"])
        live = e.knowledge("fa")["user"]
        assert [k["text"] for k in live] == ["I work as a teacher."] and live[0]["seq"] >= 0
        r = e.retrieve("fa", "What is my job?")
        assert [k.text for k in r.user_knowledge] == ["I work as a teacher."]
    finally:
        e.close()


def test_an_older_statement_arriving_late_stays_history(tmp_path: Path) -> None:
    e = engine(tmp_path)
    try:
        say(e, "bo", ["I work as a nurse now."], 1.9e9)
        say(e, "bo", ["I work as a teacher."], 1.7e9)  # said earlier, promoted later
        live = [k["text"] for k in e.knowledge("bo")["user"]]
        assert live == ["I work as a nurse now."]
        hist = {k["text"]: k for k in e.knowledge("bo", history=True)["user"]}
        assert (
            hist["I work as a teacher."]["superseded_by"]
            == hist["I work as a nurse now."]["entry_id"]
        )
    finally:
        e.close()


def promotion_with_decisions(req: ChatRequest) -> Any:
    """A scripted model that updates the known fact about where the user lives and ignores a
    repeat of a known fact (reading the ids from the prompt it is given)."""
    if req.stage == "page":
        return {"continuous": False, "meta": "m", "summary": "s", "keywords": ["k"]}
    if req.stage != "promotion":
        return "ok"
    text = req.messages[-1]["content"]
    known = dict((t, int(i)) for i, t in re.findall(r"- \[(\d+)\] (.+)", text))
    if "Boston" in text:
        facts = [
            {
                "fact": "The user lives in Boston.",
                "action": "update",
                "entry": known.get("The user lives in Seattle.", 0),
            },
            {
                "fact": "The user has a dog.",
                "action": "ignore",
                "entry": known.get("The user has a dog.", 0),
            },
        ]
    else:
        facts = [
            {"fact": "The user lives in Seattle.", "action": "add"},
            {"fact": "The user has a dog.", "action": "add"},
        ]
    return {"profile_updates": {}, "user_facts": facts, "assistant_facts": []}


def test_llm_decisions_update_and_ignore(tmp_path: Path) -> None:
    llm = ScriptedBackend(promotion_with_decisions)
    e = engine(tmp_path, llm)
    try:
        say(e, "cy", ["I live in Seattle with my dog."], 1.7e9)
        say(e, "cy", ["Now I am in Boston."], 1.8e9)
        live = sorted(k["text"] for k in e.knowledge("cy")["user"])
        assert live == ["The user has a dog.", "The user lives in Boston."]
        hist = {k["text"]: k for k in e.knowledge("cy", history=True)["user"]}
        assert (
            hist["The user lives in Seattle."]["superseded_by"]
            == hist["The user lives in Boston."]["entry_id"]
        )
        assert hist["The user has a dog."]["strength"] == 2
        prompts = [r.messages[-1]["content"] for r in llm.requests if r.stage == "promotion"]
        assert "KNOWN user facts:\n(none)" in prompts[0]
        assert "The user lives in Seattle." in prompts[-1]  # the second call was shown it
        e.respond("cy", "Where do I live?")  # the response prompt's facts: the newer one only
        [answer] = [r.messages[-1]["content"] for r in llm.requests if r.stage == "response"]
        facts = answer.split("## USER FACTS")[1].split("## ")[0]
        assert "The user lives in Boston." in facts and "Seattle" not in facts
    finally:
        e.close()


def test_conflicts_benchmark_quick(tmp_path: Path) -> None:
    """The scripted change-of-mind set (benchmarks/conflicts.py): every change superseded, no
    stale value live, every repeat merged, in order and with sessions arriving last first."""
    out = tmp_path / "conflicts.json"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "conflicts.py"),
            "--users",
            "6",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["results"]
    for held_out in ("unseen phrasings", "unseen phrasings 2"):  # repeats still merge there
        unseen = rows.pop(held_out)
        assert unseen["duplicates_merged"] == 1.0 and unseen["copies_live"] == 0
    for name, r in rows.items():
        assert r["changes"] > 0 and r["repeats"] > 0, name
        assert r["superseded_ok"] == 1.0 and r["stale_live"] == 0, name
        assert r["current_ok"] == 1.0 and r["prompt_ok"] == 1.0, name
        assert r["duplicates_merged"] == 1.0 and r["copies_live"] == 0, name
    assert rows["reverse order"]["arrived_late"] > 0


def test_same_batch_copies_of_one_fact_tie() -> None:
    """Copies of one fact (an embedder's float32 rows) in a group past the padded sizes all
    score the same cosine against each other, whatever a product's blocking does to the last
    bits: the rule's choice among them is its tie-break, not rounding noise."""
    import numpy as np

    from memoryos_gpu.engine.knowledge_ring import _same_batch

    vec = np.random.default_rng(0).normal(size=(1, 384)).astype(np.float32)
    got = _same_batch([7] * 100, np.repeat(vec, 100, axis=0), 0.9)
    assert [[j for j, _ in row] for row in got] == [list(range(i)) for i in range(100)]
    assert {c for row in got for _, c in row} == {1.0}

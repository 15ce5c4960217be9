"""Tests for memoryos_gpu.prompts and memoryos_gpu.profile_dims."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from memoryos_gpu import prompts as P
from memoryos_gpu.profile_dims import (
    DIMENSION_KEYS,
    DIMENSIONS,
    GROUPS,
    dimensions_prompt_text,
    normalize_dimension_key,
    render_profile,
)


@dataclass
class Page:
    user_input: str
    agent_response: str
    timestamp: str | float
    meta: str = ""


ALICE = [
    Page("I adopted a puppy called Rex last Sunday.", "Congratulations! What breed?", 1683500000.0),
    {
        "user_input": "He is a beagle.",
        "agent_response": "Beagles are great.",
        "timestamp": "2023-05-08 10:00:00",
    },
]
BOB = [
    Page("My exam in Berlin is on 3 June.", "Good luck with the exam!", "2023-05-20"),
    Page("It is about thermodynamics.", "Let's review entropy first.", 1684600000),
]

SCHEMA_STAGES = [s for s in P.STAGES if s != "response"]


def build(stage: str, pages, profile=None):
    prev, page = pages[0], pages[1]
    return {
        "continuity": lambda: P.continuity(prev, page),
        "chain_meta": lambda: P.chain_meta("Talking about a new pet.", page),
        "topic_summary": lambda: P.topic_summary(pages),
        "profile_update": lambda: P.profile_update(profile or {}, pages),
        "user_knowledge": lambda: P.user_knowledge(pages),
        "assistant_knowledge": lambda: P.assistant_knowledge(pages),
        "fused_page": lambda: P.fused_page(prev, "meta of the thread", page),
        "fused_promotion": lambda: P.fused_promotion(profile or {}, pages),
    }[stage]()


# ------------------------------------------------------------ profile dims
def test_ninety_unique_dimensions_in_three_groups():
    assert len(GROUPS) == 3
    assert len(DIMENSIONS) == 90 == len(DIMENSION_KEYS) == len(set(DIMENSION_KEYS))
    assert sum(len(g.dimensions) for g in GROUPS) == 90
    assert all(len(g.dimensions) >= 10 for g in GROUPS)
    for d in DIMENSIONS:
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", d.key), d.key
        assert d.name and d.description and "\n" not in d.description
    assert len({d.name.lower() for d in DIMENSIONS}) == 90
    text = dimensions_prompt_text()
    assert all(f"- {k} (" in text for k in DIMENSION_KEYS)


def test_normalize_dimension_key():
    assert normalize_dimension_key("Need for Security") == "need_for_security"
    assert normalize_dimension_key("need-for-security") == "need_for_security"
    assert normalize_dimension_key("TV series") == "tv_series_interest"
    assert normalize_dimension_key("favourite colour") is None
    assert normalize_dimension_key(3) is None


def test_render_profile_grouped_and_skips_empty():
    text = render_profile(
        {
            "food_interest": "High: cooks daily",
            "openness": "Medium: x",
            "safety": "  ",
            "bogus": "y",
        }
    )
    lines = text.splitlines()
    assert lines[0] == "Basic needs and personality:"
    assert "- Openness: Medium: x" in lines
    assert "Content-platform interest tags:" in lines
    assert "AI alignment" not in text and "bogus" not in text
    assert lines.index("- Openness: Medium: x") < lines.index("- Food: High: cooks daily")
    assert render_profile({}) == "" and render_profile({"safety": None}, empty_text="-") == "-"
    assert "Other:" in render_profile({"bogus": "y"}, include_unknown=True)


# ------------------------------------------------------------------ schemas
@pytest.mark.parametrize("stage", SCHEMA_STAGES)
def test_schema_valid_and_system_message_shared(stage):
    msgs_a, schema_a = build(stage, ALICE, {"openness": "High: likes new things"})
    msgs_b, schema_b = build(stage, BOB)
    Draft202012Validator.check_schema(schema_a)
    assert schema_a == schema_b == P.SCHEMAS[stage]
    assert schema_a is not P.SCHEMAS[stage]  # callers get a copy
    for msgs in (msgs_a, msgs_b):
        assert [m["role"] for m in msgs] == ["system", "user"]
        assert all(isinstance(m["content"], str) and m["content"] for m in msgs)
    assert msgs_a[0] == msgs_b[0]  # identical shared prefix for prefix caching
    assert msgs_a[1] != msgs_b[1]
    assert "He is a beagle." in msgs_a[1]["content"]
    assert "He is a beagle." not in msgs_a[0]["content"]


def test_response_system_shared_and_sections():
    common = dict(user_facts=["The user has a dog."], assistant_facts=["The assistant likes jazz."])
    a = P.response("What breed is Rex?", ALICE[1:], ALICE[:1], "Likes dogs", **common)
    b = P.response(
        "When is my exam?", BOB[1:], BOB[:1], {"openness": "High"}, assistant_name="Ada", **common
    )
    assert a[0] == b[0] and a[0]["role"] == "system"
    body = a[1]["content"]
    order = [
        body.index(h)
        for h in (
            "## ASSISTANT",
            "## USER PROFILE",
            "## USER FACTS",
            "## RECALLED PAGES",
            "## RECENT CONVERSATION",
        )
    ]
    assert order == sorted(order)
    assert body.rstrip().endswith("User: What breed is Rex?")
    assert "2023-05-07T22:53:20Z" in body  # float timestamp rendered as ISO UTC
    assert "Name: Ada" in b[1]["content"] and "Openness: High" in b[1]["content"]
    c = P.response("q", [], [], None, [], [], now=0.0, extra_instructions="Answer in 5 words.")
    assert "Current time: 1970-01-01T00:00:00Z\nAnswer in 5 words.\nUser: q" in c[1]["content"]
    assert "(none)" in c[1]["content"] and "(unknown)" in c[1]["content"]


def test_retrieved_pages_carry_meta_and_timestamp():
    retrieved = [Page("Q1", "R1", 1700000000.0, meta="Thread about hiking in Alps.")]
    msgs = P.response("q", [], retrieved, "", [], [])
    assert "Conversation thread: Thread about hiking in Alps." in msgs[1]["content"]
    assert "2023-11-14T22:13:20Z" in msgs[1]["content"]


def test_long_text_truncated_only_in_prompt():
    long_q = "word " * 2000
    page = {"user_input": long_q, "agent_response": "ok", "timestamp": 0}
    msgs, _ = P.topic_summary([page], max_page_chars=300)
    content = msgs[1]["content"]
    assert len(content) < 1000 and "\u2026" in content
    assert page["user_input"] == long_q  # stored text untouched
    msgs_full, _ = P.topic_summary([page], max_page_chars=None)
    assert long_q in msgs_full[1]["content"]
    # default limit also applies to the response prompt
    r = P.response("q", [page], [page], "", [], [])
    assert len(r[1]["content"]) < 2 * P.DEFAULT_PAGE_CHARS + 2000


def test_truncate_and_timestamp_helpers():
    assert P.truncate_text("abcdef", 4) == "abc\u2026"
    assert P.truncate_text("abc", 4) == "abc" and P.truncate_text("abc", 0) == "abc"
    assert P.format_timestamp(0) == "1970-01-01T00:00:00Z"
    assert P.format_timestamp(" 7 May 2023 ") == "7 May 2023"
    assert P.format_timestamp(None) == ""
    assert P.first_sentence("Hello there. More text.") == "Hello there."
    assert P.first_sentence("  no punctuation here ") == "no punctuation here"


# ------------------------------------------------------------------- parsing
def test_parse_continuity():
    assert P.parse_continuity({"continuous": True}) is True
    assert P.parse_continuity('{"continuous": false}') is False
    assert P.parse_continuity('```json\n{"continuous": true}\n```') is True
    assert P.parse_continuity("<think>hmm</think> true") is True
    assert P.parse_continuity({"continuous": "yes"}) is None
    assert P.parse_continuity({"continuous": 1}) is None
    assert P.parse_continuity({"other": True}) is None
    assert P.parse_continuity("garbage") is None
    assert P.parse_continuity(None) is None


def test_extract_json_keeps_a_reasoning_tag_inside_a_string():
    """The parsers share jsonfix's reasoning stripping: a block outside strings is dropped,
    a tag inside a string value is the value's text."""
    text = '<think>draft {"meta": "no"}</think>{"meta": "typed <think>x</think> in chat"}'
    assert P.extract_json(text) == {"meta": "typed <think>x</think> in chat"}


def test_parse_meta_and_summary():
    assert P.parse_chain_meta({"meta": "  The user   got a dog. "}) == "The user got a dog."
    assert P.parse_chain_meta({"meta": "   "}) is None
    assert P.parse_chain_meta({"meta": ["x"]}) is None
    assert len(P.parse_chain_meta({"meta": "x" * 5000})) == P.MAX_META_CHARS
    r = P.parse_topic_summary(
        {
            "summary": "Dog adoption.",
            "keywords": ["Rex", "rex", " ", "beagle", 3, *"abcdefgh"],
        }
    )
    assert r == P.TopicSummary("Dog adoption.", ["Rex", "beagle", "a", "b", "c", "d", "e", "f"])
    assert P.parse_topic_summary({"summary": "x", "keywords": "Rex"}) is None
    assert P.parse_topic_summary({"summary": 5, "keywords": []}) is None
    assert P.parse_topic_summary({"summary": "x"}) == P.TopicSummary("x", [])
    assert P.parse_topic_summary(
        'Here: {"summary": "s", "keywords": ["k"]} done'
    ) == P.TopicSummary("s", ["k"])


def test_parse_profile_update_restricts_keys():
    out = P.parse_profile_update(
        {
            "updates": {
                "openness": "High: tries new food",
                "Food Interest": "High",
                "made_up": "x",
                "safety": 3,
                "honesty": "",
            }
        }
    )
    assert out == {"openness": "High: tries new food", "food_interest": "High"}
    assert P.parse_profile_update({"updates": ["openness"]}) is None
    assert P.parse_profile_update({"updates": {}}) == {}
    assert P.parse_profile_update([]) is None


def test_parse_knowledge():
    facts = ["- The user has a dog named Rex.", "None", "", "The user has a dog named Rex.", 7]
    assert P.parse_user_knowledge({"facts": facts}) == ["The user has a dog named Rex."]
    assert P.parse_assistant_knowledge({"facts": []}) == []
    assert P.parse_user_knowledge({"facts": "The user has a dog."}) is None
    assert P.parse_user_knowledge({"fact": []}) is None
    many = {"facts": [f"fact {i}" for i in range(50)]}
    assert len(P.parse_assistant_knowledge(many)) == P.DEFAULT_MAX_FACTS
    assert len(P.parse_user_knowledge(many, max_facts=3)) == 3


def test_parse_fused():
    ok = {"continuous": True, "meta": "m", "summary": "s", "keywords": ["k"]}
    assert P.parse_fused_page(ok) == P.FusedPageResult(True, "m", "s", ["k"])
    assert P.parse_fused_page(json.dumps(ok)) == P.FusedPageResult(True, "m", "s", ["k"])
    assert P.parse_fused_page({**ok, "continuous": "maybe"}) is None
    assert P.parse_fused_page({**ok, "meta": ""}) is None
    assert P.parse_fused_page({**ok, "keywords": {"k": 1}}) is None
    prom = {"profile_updates": {"openness": "High"}, "user_facts": ["a"], "assistant_facts": []}
    assert P.parse_fused_promotion(prom) == P.PromotionResult({"openness": "High"}, ["a"], [])
    assert P.parse_fused_promotion({}) == P.PromotionResult()
    assert P.parse_fused_promotion({**prom, "user_facts": "a"}) is None
    assert P.parse_fused_promotion({**prom, "profile_updates": "openness"}) is None


def test_fused_promotion_decisions():
    """Facts may carry add / update / ignore decisions against the known entries shown; plain
    strings (older models, scripted tests) are adds; a decision without a usable entry id, or
    with an unknown action, is an add."""
    got = P.parse_fused_promotion(
        {
            "user_facts": [
                {"fact": "The user moved to Boston.", "action": "update", "entry": 7},
                {"fact": "The user has a dog.", "action": "ignore", "entry": 2},
                {"fact": "The user sings.", "action": "update"},
                {"fact": "The user skis.", "action": "explode", "entry": 1},
                "The user reads.",
            ]
        }
    )
    assert got.user_facts == [
        "The user moved to Boston.",
        "The user has a dog.",
        "The user sings.",
        "The user skis.",
        "The user reads.",
    ]
    assert got.user_decisions == [
        ("update", 7),
        ("ignore", 2),
        ("add", None),
        ("add", None),
        ("add", None),
    ]
    assert got.assistant_decisions is None
    assert P.parse_fused_promotion({"user_facts": ["a"]}).user_decisions is None
    messages, _ = P.fused_promotion({}, [], known_user=[(7, "The user lives in Seattle.")])
    assert "[7] The user lives in Seattle." in messages[-1]["content"]


@pytest.mark.parametrize("stage", SCHEMA_STAGES)
def test_valid_schema_instances_parse(stage):
    """An instance that satisfies the schema must parse to a non-None result."""
    samples = {
        "continuity": {"continuous": False},
        "chain_meta": {"meta": "m"},
        "topic_summary": {"summary": "s", "keywords": []},
        "profile_update": {"updates": {"openness": "Low: x"}},
        "user_knowledge": {"facts": ["f"]},
        "assistant_knowledge": {"facts": []},
        "fused_page": {"continuous": True, "meta": "m", "summary": "s", "keywords": ["k"]},
        "fused_promotion": {
            "profile_updates": {},
            "user_facts": [],
            "assistant_facts": [{"fact": "a", "action": "update", "entry": 3}],
        },
    }
    jsonschema.validate(samples[stage], P.SCHEMAS[stage], cls=Draft202012Validator)
    assert getattr(P, f"parse_{stage}")(samples[stage]) is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**samples[stage], "extra": 1}, P.SCHEMAS[stage])


# ----------------------------------------------------------------- fallbacks
def test_fallbacks_well_formed():
    page = ALICE[0]
    assert P.fallback_continuity(ALICE[1], page) is False
    assert P.fallback_chain_meta("old", page) == "I adopted a puppy called Rex last Sunday."
    assert (
        P.fallback_chain_meta(
            None, {"user_input": "", "agent_response": "Hi! Sure.", "timestamp": 0}
        )
        == "Hi!"
    )
    ts = P.fallback_topic_summary(ALICE)
    assert isinstance(ts, P.TopicSummary)
    assert ts.summary == "I adopted a puppy called Rex last Sunday."
    assert 0 < len(ts.keywords) <= P.DEFAULT_MAX_KEYWORDS
    assert set(ts.keywords[:2]) == {"rex", "sunday"}  # proper noun / date boosts
    assert P.fallback_topic_summary(
        [{"user_input": "x" * 1000, "agent_response": "", "timestamp": 0}]
    ).summary.endswith("\u2026")
    assert P.fallback_profile_update({}, ALICE) == {}
    assert P.fallback_user_knowledge(ALICE) == [] and P.fallback_assistant_knowledge(ALICE) == []
    fp = P.fallback_fused_page(ALICE[0], "m", ALICE[1])
    assert fp.continuous is False and fp.meta == fp.summary == "He is a beagle."
    assert "beagle" in fp.keywords
    assert P.fallback_fused_promotion({}, ALICE) == P.PromotionResult({}, [], [])
    # fallback results satisfy the stage schemas
    jsonschema.validate(
        {"summary": ts.summary, "keywords": ts.keywords}, P.SCHEMAS["topic_summary"]
    )
    jsonschema.validate(
        {
            "continuous": fp.continuous,
            "meta": fp.meta,
            "summary": fp.summary,
            "keywords": fp.keywords,
        },
        P.SCHEMAS["fused_page"],
    )


@given(
    st.lists(
        st.tuples(
            st.text(st.sampled_from("ab .!?\n\u3002"), max_size=60),
            st.text(st.sampled_from("cd .!?\n"), max_size=60),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_extractive_page_outcomes_are_the_fallbacks(pages: list[tuple[str, str, bool]]) -> None:
    """The extractive stage's summary and a new chain's meta are the prompt fallbacks of the
    page (the stage computes the shared first sentence once); a continuing page keeps the
    chain's meta."""
    import numpy as np

    from memoryos_gpu.stages import ExtractiveStages, PageWork
    from memoryos_gpu.text.keywords import KeywordExtractor

    stages = ExtractiveStages(KeywordExtractor(), continuity_threshold=0.5)
    v = np.ones(4, np.float32)
    work = [
        PageWork(
            {"user_input": ui, "agent_response": ar, "timestamp": 1.0, "user_id": "u"},
            v,
            {"user_input": "before", "agent_response": "", "timestamp": 0.0} if linked else None,
            v if linked else None,
            "the thread so far" if linked else None,
        )
        for ui, ar, linked in pages
    ]
    for w, out in zip(work, stages.pages(work), strict=True):
        first = P.fallback_topic_summary([w.page], max_keywords=0).summary
        assert out.summary == first
        assert out.continuous == (w.prev_page is not None)
        want = w.prev_meta if out.continuous else P.fallback_chain_meta(None, w.page)
        assert out.meta == want

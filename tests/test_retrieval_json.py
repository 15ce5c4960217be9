"""``retrieve_many(..., as_json=True)``: the engine writes each result's JSON natively from its
tables (what the server's retrieval route answers), and it must be the JSON of the objects
(``assembly.retrieval_json``) for every kind of text the tables hold: ASCII with characters
JSON escapes, Latin-1, other BMP scripts and astral code points (CPython's 1-, 2- and 4-byte
strings), page metadata, a profile, knowledge entries, STM and MTM pages."""

from __future__ import annotations

import json

import pytest

from memoryos_gpu.engine.assembly import retrieval_json
from memoryos_gpu.engine.validation import InvalidInputError

PAGES = [
    ('She said "hi" \\ then left\tearly\nnext line', "plain ascii reply"),
    ("café au lait, naïve señor", "Ünïcödé ok"),
    ("日本語のテキストです", "русский текст"),
    ("emoji 🎉 and music 𝄞", 'mixed é 日 🎉 \\ "'),
    ("the last one", "stays in short-term memory"),
    ("another page", "also recent"),
]
PROMOTION = {
    "profile_updates": {"extraversion": 'outgoing, "very" much 🎉'},
    "user_facts": ["User drinks green tea every morning in Kyōto 京都."],
    "assistant_facts": ['Assistant said "see you" \\ twice.'],
}
QUERIES = [
    ("u", 'What did "she" say about café?'),
    ("u", "🎉 music 日本語"),
    ("u", "green tea"),
    ("v", "anything at all"),
]


@pytest.fixture
def engine(make_engine, kit):
    eng = make_engine(mode="llm", script=kit.Script(promotion=PROMOTION), stm_capacity=2)
    for i, (ui, ar) in enumerate(PAGES):
        meta = {"speaker_a": "Zoë", "tags": ["a", "ü", 3], "n": i, "x": None, "f": 0.25}
        eng.add("u", ui, ar, timestamp=1_700_000_000.0 + 60.5 * i, meta=meta)
    eng.add("v", "a user without metadata", "ok", timestamp=5.0)
    eng.flush()
    eng.promote("u")
    eng.flush()
    return eng


def test_the_native_json_is_the_objects_json(engine) -> None:
    objects = engine.retrieve_many(QUERIES, update_heat=False)
    bodies = engine.retrieve_many(QUERIES, update_heat=False, as_json=True)
    assert all(isinstance(b, bytes) for b in bodies)
    for r, body in zip(objects, bodies, strict=True):
        assert json.loads(body) == json.loads(retrieval_json(r))
    u = objects[0]  # the case covers what it claims: every part of a result is there
    assert u.stm and u.pages and u.profile and u.user_knowledge and u.assistant_knowledge
    assert any(p.meta for p in u.pages) and all(p.extra for p in u.pages + u.stm)
    assert not objects[3].profile and objects[3].stm


def test_floats_stay_floats_and_the_token_count_agrees(engine) -> None:
    before = engine.stats()["counters"]["retrieval_tokens"]
    (body,) = engine.retrieve_many(QUERIES[:1], update_heat=False, as_json=True)
    got = json.loads(body)
    assert all(isinstance(p["timestamp"], float) for p in got["stm"] + got["pages"])
    assert all(isinstance(p["score"], float) for p in got["pages"])
    assert all(p["score"] is None for p in got["stm"])
    counted = engine.stats()["counters"]["retrieval_tokens"] - before
    assert got["retrieval_tokens"] == counted > 0


def test_json_does_not_carry_sources(engine) -> None:
    with pytest.raises(InvalidInputError, match="sources"):
        engine.retrieve_many(QUERIES, as_json=True, sources=True)


def test_an_integer_beyond_64_bits_in_a_meta_is_served(make_engine) -> None:
    """Validation lets JSON's unbounded integers through, and orjson refuses one past 64 bits:
    the codec falls back to the standard library, so the page is stored and every retrieval
    that shows it (objects and native JSON) carries the number, not a TypeError."""
    eng = make_engine()
    big = {"n": 2**70, "m": -(2**64) - 5}
    eng.add("u", "I keep a very large counter", "noted", timestamp=5.0, meta=big)
    (r,) = eng.retrieve_many([("u", "counter")], update_heat=False)
    (body,) = eng.retrieve_many([("u", "counter")], update_heat=False, as_json=True)
    assert r.stm[0].extra == big
    assert json.loads(body) == json.loads(retrieval_json(r))
    assert json.loads(body)["stm"][0]["extra"] == big

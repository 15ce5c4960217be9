"""The ``reject_reasons`` of an ingest report: one short, stable kind per rule broken, so the
counts of a large input gather under a few readable keys instead of one garbled key per value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memoryos_gpu.config import EngineConfig, LLMConfig
from memoryos_gpu.ingest import ingest
from memoryos_gpu.rejects import reason_kind

GOOD = {"user_id": "u", "user_input": "hello", "agent_response": "hi"}


def _report_reasons(tmp_path: Path, lines: list[str]) -> dict[str, int]:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    cfg = EngineConfig(embedder="hashing", llm=LLMConfig(mode="extractive"))
    return ingest([path], cfg, progress=False).reject_reasons


def test_typical_rejects_are_counted_by_their_rule(tmp_path: Path) -> None:
    lines = [
        json.dumps({**GOOD, "timestamp": 1_717_000_000_000}),  # milliseconds
        json.dumps({**GOOD, "timestamp": 1_717_000_000_123}),
        json.dumps({**GOOD, "timestamp": "2024-02-30"}),  # no such day
        json.dumps({**GOOD, "timestamp": "yesterday"}),
        json.dumps({**GOOD, "timestamp": True}),
        '{"user_id": "u", "user_input": "unterminated',
        '{"user_id": "u", "user_input": 1, "agent_response": "x"}',
        json.dumps({"user_id": "u", "user_input": "no response"}),
        json.dumps({**GOOD, "user_input": "x" * 1_000_001}),  # the engine's text limit
        json.dumps(GOOD),
    ]
    assert _report_reasons(tmp_path, lines) == {
        "timestamp: after the year 9999 in epoch seconds (milliseconds?)": 2,
        "timestamp: unparseable": 2,
        "timestamp: a boolean": 1,
        "invalid JSON: Unterminated string starting at": 1,
        "user_input must be a string, got int": 1,
        "missing field 'agent_response'": 1,
        "user_input is N characters; the limit is N": 1,
    }


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        # the engine's wrapping of a timestamp refusal, and a conversation turn's
        (
            "timestamp '1e13' does not parse: timestamp 1e13 is after the year 9999 in epoch "
            "seconds: milliseconds? send seconds",
            "timestamp: after the year 9999 in epoch seconds (milliseconds?)",
        ),
        (
            "turn 3 timestamp: unparseable timestamp nan: not a finite number",
            "timestamp: not a finite number",
        ),
        (
            "timestamp: timestamp '9999-12-31T23:00-05:00' is outside the years 1-9999 in UTC",
            "timestamp: outside the years 1-9999",
        ),
        # values go, field names and the rule stay
        ("conversations[3] has unknown role 'bot 2'", "conversations[i] has unknown role"),
        ("messages[12] has no string 'role'", "messages[i] has no string 'role'"),
        (
            "invalid UTF-8 at byte 17: invalid start byte",
            "invalid UTF-8 at byte N: invalid start byte",
        ),
        (
            "line longer than 26214400 bytes (30000000 bytes); skipped",
            "line longer than N bytes; skipped",
        ),
        # too long: its first clause (the rule), not a cut with an ellipsis
        (
            "source 'm1' of a page of user 'f' belongs to another user's page; a source is "
            "unique across users (this record was not stored)",
            "source of a page of user belongs to another user's page",
        ),
    ],
)
def test_kind_of_a_reason(reason: str, kind: str) -> None:
    assert reason_kind(reason) == kind


def test_a_long_reason_is_shortened_between_words() -> None:
    reason = "a rule " + " ".join(f"word{i}" for i in range(40))
    kind = reason_kind(reason)
    assert len(kind) <= 80 and kind.endswith("\u2026")
    assert kind[:-1].split(" ")[-1] in reason.split(" ")  # the last word is whole


def test_the_same_rule_with_other_values_is_one_kind() -> None:
    kinds = {
        reason_kind(f"timestamp: unparseable timestamp {v!r}: {rest}")
        for v, rest in [
            ("2024-02-30", "expected ISO-8601, epoch seconds, or LoCoMo style '1:56 pm'"),
            ("1:56 pm on 31 Feb, 2023", "day is out of range for month"),
            ("it's late", "expected ISO-8601, epoch seconds, or LoCoMo style '1:56 pm'"),
        ]
    }
    assert kinds == {"timestamp: unparseable"}

"""Conversations that make no page: a ShareGPT ``"conversations": []``, one of only ``system``
turns, an OpenAI ``messages`` list with nothing but system or tool traffic, a LoCoMo
conversation without turns. They used to vanish: no count, no line on stderr, no row in the
rejects file, so a user ingesting a large chat log could not tell that conversations were left
out. Each is now one reject naming why (the way every other unusable item is reported), and
the rest of the input is read as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.eval.locomo import load_locomo
from memoryos_gpu.formats import Record, Reject, read_records
from memoryos_gpu.ingest import ingest
from memoryos_gpu.rejects import reason_kind

_KIND = "no user or assistant turn to make a page of"
_GOOD_SHAREGPT = {
    "id": "good",
    "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
}


def _write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
    return path


def _read(path: Path, fmt: str = "auto") -> tuple[list[Record], list[Reject]]:
    items = list(read_records(path, fmt))
    return (
        [r for r in items if isinstance(r, Record)],
        [r for r in items if isinstance(r, Reject)],
    )


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMORYOS_GPU_")}
    env["MEMORYOS_GPU_EMBEDDER"] = "hashing"
    return env


# ------------------------------------------------------------------ ShareGPT
@pytest.mark.parametrize(
    ("turns", "why"),
    [
        ([], "(conversations is empty)"),
        ([{"from": "system", "value": "be kind"}], "only turns that are skipped: system"),
        (
            [{"from": "System", "value": "a"}, {"from": "tool", "value": "{}"}],
            "only turns that are skipped: system, tool",
        ),
    ],
)
def test_a_sharegpt_conversation_without_dialogue_is_one_reject(
    tmp_path: Path, turns: list[dict], why: str
) -> None:
    src = _write_jsonl(tmp_path / "sg.jsonl", [_GOOD_SHAREGPT, {"id": "c", "conversations": turns}])
    records, rejects = _read(src)
    assert [(r.user_input, r.agent_response) for r in records] == [("hi", "hello")]
    assert [(r.line, reason_kind(r.reason)) for r in rejects] == [(2, _KIND)]
    assert why in rejects[0].reason
    assert json.loads(rejects[0].raw) == {"id": "c", "conversations": turns}


def test_a_system_turn_beside_a_dialogue_is_no_reject(tmp_path: Path) -> None:
    """Only a conversation that makes no page at all is reported; one lone user turn is a
    page (with an empty response) as before."""
    conv = {
        "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "alone"}]
    }
    records, rejects = _read(_write_jsonl(tmp_path / "sg.jsonl", [conv]))
    assert [(r.user_input, r.agent_response) for r in records] == [("alone", "")]
    assert rejects == []


def test_a_sharegpt_json_array_reports_the_item_index(tmp_path: Path) -> None:
    src = tmp_path / "sg.json"
    src.write_text(json.dumps([{"conversations": []}, _GOOD_SHAREGPT]), encoding="utf-8")
    records, rejects = _read(src)
    assert len(records) == 1
    assert [(r.line, reason_kind(r.reason)) for r in rejects] == [(1, _KIND)]


# ------------------------------------------------------------------ OpenAI chat messages
@pytest.mark.parametrize(
    ("messages", "why"),
    [
        ([], "(messages is empty)"),
        ([{"role": "system", "content": "s"}], "only turns that are skipped: system"),
        (
            [
                {"role": "developer", "content": "d"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                {"role": "tool", "content": "42"},
            ],
            "only turns that are skipped: developer, assistant without content, tool",
        ),
    ],
)
def test_an_openai_conversation_without_dialogue_is_one_reject(
    tmp_path: Path, messages: list[dict], why: str
) -> None:
    good = {"user_id": "m", "messages": [{"role": "user", "content": "q"}]}
    src = _write_jsonl(tmp_path / "oa.jsonl", [{"user_id": "m", "messages": messages}, good])
    records, rejects = _read(src)
    assert [r.user_input for r in records] == ["q"]
    assert [(r.line, reason_kind(r.reason)) for r in rejects] == [(1, _KIND)]
    assert why in rejects[0].reason


# ------------------------------------------------------------------ LoCoMo
def _locomo(sample_id: str, **sessions: Any) -> dict:
    conv = {"speaker_a": "Ann", "speaker_b": "Bob", **sessions}
    return {"sample_id": sample_id, "conversation": conv, "qa": []}


_TURN = {"speaker": "Ann", "text": "hi", "dia_id": "D1:1"}


@pytest.mark.parametrize(
    ("sessions", "why"),
    [
        ({}, "(conversation has no session_N turn list)"),
        ({"session_1": [], "session_2": []}, "(its session_N turn lists are all empty)"),
    ],
)
def test_a_locomo_conversation_without_turns_is_one_reject(
    tmp_path: Path, sessions: dict, why: str
) -> None:
    src = tmp_path / "lo.json"
    items = [_locomo("empty", **sessions), _locomo("full", session_1=[_TURN])]
    src.write_text(json.dumps(items), encoding="utf-8")
    records, rejects = _read(src)
    assert [(r.user_id, r.user_input) for r in records] == [("full", "hi")]
    assert [(r.line, reason_kind(r.reason)) for r in rejects] == [(1, _KIND)]
    assert why in rejects[0].reason
    # the evaluation reads the same conversation with the same rule: its reject, no pages
    empty = load_locomo(src)[0]
    assert empty.pages == [] and [reason_kind(r.reason) for r in empty.rejects] == [_KIND]


def test_a_locomo_conversation_of_bad_turns_only_gets_no_second_reject(tmp_path: Path) -> None:
    """Its bad turn is reported already: the conversation is not also called empty."""
    src = tmp_path / "lo.json"
    src.write_text(json.dumps([_locomo("x", session_1=[{"text": "no speaker"}])]), "utf-8")
    records, rejects = _read(src)
    assert records == []
    assert [r.reason for r in rejects] == ["session_1[0]: turn has no string 'speaker'"]


# ------------------------------------------------------------------ ingestion
def test_ingest_counts_and_files_each_empty_conversation(tmp_path: Path) -> None:
    src = _write_jsonl(
        tmp_path / "chats.jsonl",
        [
            {"id": "a", "conversations": []},
            _GOOD_SHAREGPT,
            {"id": "b", "conversations": [{"from": "system", "value": "be nice"}]},
        ],
    )
    rejects = tmp_path / "rejects.jsonl"
    config = EngineConfig(store=str(tmp_path / "s"), embedder="hashing")
    rep = ingest(src, config, rejects_path=rejects, progress=False)
    assert (rep.accepted, rep.rejected, rep.exit_code) == (1, 2, 3)
    assert rep.reject_reasons == {_KIND: 2}
    rows = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [(r["line"], r["stage"]) for r in rows] == [(1, "read"), (3, "read")]
    assert "conversations is empty" in rows[0]["reason"]
    assert "skipped: system" in rows[1]["reason"]


def test_the_cli_summary_and_json_say_a_conversation_made_nothing(tmp_path: Path) -> None:
    src = _write_jsonl(
        tmp_path / "chats.jsonl",
        [_GOOD_SHAREGPT, {"id": "sys", "conversations": [{"from": "system", "value": "x"}]}],
    )
    store = tmp_path / "s"
    args = ("ingest", str(src), "--store", str(store), "--json", "--embedder", "hashing")
    p = subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert p.returncode == 3, p.stderr[-2000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert (report["accepted"], report["rejected"]) == (1, 1)
    assert report["reject_reasons"] == {_KIND: 1}
    assert f"chats.jsonl:2: rejected: {_KIND}" in p.stderr
    row = json.loads((store / "rejects.jsonl").read_text())
    assert row["line"] == 2 and json.loads(row["raw"])["id"] == "sys"

"""Inputs at the edges of what the readers take: items nested very deep, a pipe whose first JSONL
line is longer than its read-ahead, ids with control characters or only blanks, and ShareGPT
conversations with one bad timestamp. Each is refused for what it is (one reject, a clear
reason), and the rest of the input is read."""

from __future__ import annotations

import base64
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import InvalidInputError, validate_page
from memoryos_gpu.formats import Record, Reject, detect_format, read_records, readers
from memoryos_gpu.formats.records import FormatError
from memoryos_gpu.ingest import ingest
from memoryos_gpu.types import PageInput

_PAGE = {"user_id": "d", "user_input": "ok", "agent_response": "fine"}
_DEEP = "nested deeper than 100 levels"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMORYOS_GPU_")}
    env["MEMORYOS_GPU_EMBEDDER"] = "hashing"
    return env


def _page(text: str, **extra: Any) -> str:
    return json.dumps({**_PAGE, "user_input": text, **extra})


def _deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_meta(depth: int) -> str:
    """A page whose ``meta`` is ``depth`` objects within each other (the page: one more)."""
    nested = '{"a":' * depth + "1" + "}" * depth
    return _page("deep meta")[:-1] + f', "meta": {nested}}}'


def _split(items: list[Record | Reject]) -> tuple[list[Record], list[Reject]]:
    return (
        [r for r in items if isinstance(r, Record)],
        [r for r in items if isinstance(r, Reject)],
    )


# ------------------------------------------------------------------ deeply nested items
def test_a_json_array_item_nested_too_deep_is_rejected_alone(tmp_path: Path) -> None:
    """A deep item used to crash the read (RecursionError) and lose the items around it."""
    src = tmp_path / "deep.json"
    items = [_page("before"), _deep_list(5000), _deep_meta(150), _page("after")]
    src.write_text("[" + ",".join(items) + "]", encoding="utf-8")
    records, rejects = _split(list(read_records(src)))
    assert [r.user_input for r in records] == ["before", "after"]
    assert [(r.line, _DEEP in r.reason) for r in rejects] == [(2, True), (3, True)]


def test_jsonl_lines_nested_too_deep_are_rejected_alone(tmp_path: Path) -> None:
    src = tmp_path / "deep.jsonl"
    lines = [_page("one"), _deep_meta(150), _deep_list(100_000), _deep_meta(90), _page("two")]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    records, rejects = _split(list(read_records(src)))
    assert [r.user_input for r in records] == ["one", "deep meta", "two"]
    assert [(r.line, _DEEP in r.reason) for r in rejects] == [(2, True), (3, True)]


def test_a_deep_first_item_does_not_decide_the_format(tmp_path: Path) -> None:
    src = tmp_path / "deepfirst.json"
    src.write_text("[" + _deep_list(3000) + "," + _page("kept") + "]", encoding="utf-8")
    assert detect_format(src) == "jsonl"
    records, rejects = _split(list(read_records(src)))
    assert [r.user_input for r in records] == ["kept"]
    assert len(rejects) == 1 and _DEEP in rejects[0].reason


_BOUNDED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1_500_000_000, 1_500_000_000))
from memoryos_gpu.formats import Record, read_records
got = [(type(r).__name__, getattr(r, "reason", "")) for r in read_records(sys.argv[1])]
print(json.dumps(got))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux's")
def test_an_array_nested_100000_deep_reads_in_bounded_memory(tmp_path: Path) -> None:
    """200 KB nested 100,000 deep took 22 GB through ``ijson.items``: the item is now cut off at
    the limit while it is parsed. Run under a 1.5 GB address-space cap, in its own process."""
    src = tmp_path / "deep.json"
    src.write_text(f"[{_page('a')},{_deep_list(100_000)},{_page('b')}]", encoding="utf-8")
    p = subprocess.run(
        [sys.executable, "-c", _BOUNDED, str(src)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    assert [kind for kind, _ in got] == ["Record", "Reject", "Record"]
    assert _DEEP in got[1][1]


def test_ingest_of_a_deep_item_exits_3_and_keeps_the_others(tmp_path: Path) -> None:
    src = tmp_path / "deep.json"
    src.write_text(f"[{_page('a')},{_deep_list(20_000)},{_page('b')}]", encoding="utf-8")
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
    assert (report["accepted"], report["rejected"]) == (2, 1)
    assert "deep.json:2: rejected: item nested deeper than 100 levels" in p.stderr


def test_a_meta_nested_past_the_stack_is_refused_not_crashed() -> None:
    meta: dict[str, Any] = {}
    inner = meta
    for _ in range(5000):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(InvalidInputError, match="meta is nested too deeply"):
        validate_page(PageInput("u", "hi", "ok", None, None, None, meta))


# ------------------------------------------------------------------ a pipe's long first line
def test_a_pipe_whose_first_jsonl_line_is_over_4_mib_is_recognised(kit: Any) -> None:
    """Over a pipe the format is sniffed from a read-ahead; a valid first page longer than
    4 MiB (500,000 emoji as JSON escapes: 6 MB) was refused as "not a recognisable record"."""
    first = json.dumps({**_PAGE, "user_input": "\U0001f600" * 500_000})
    data = (first + "\n" + _page("second") + "\n").encode()
    path, fd, feeder = kit.pipe(data)
    try:
        assert detect_format(path) == "jsonl"
        records, rejects = _split(list(read_records(path)))
    finally:
        feeder.join(5)
        os.close(fd)
    assert rejects == []
    assert [len(r.user_input) for r in records] == [500_000, 6]


def test_a_gzip_pipe_whose_first_line_is_past_the_read_ahead_says_so(kit: Any) -> None:
    """A gzip pipe is read ahead 4 MiB compressed: a first line that ends past what that
    decompresses to gets an error saying so and to name the format, which then reads it."""
    text = base64.b64encode(os.urandom(6_000_000)).decode()  # 8 MB, barely compressible
    data = (json.dumps({**_PAGE, "user_input": text}) + "\n").encode()
    path, fd, feeder = kit.pipe(gzip.compress(data, compresslevel=1))
    try:
        with pytest.raises(FormatError, match=r"first line is longer than .*--format"):
            detect_format(path)
        records, rejects = _split(list(read_records(path, format="jsonl")))
    finally:
        feeder.join(5)
        os.close(fd)
    assert rejects == [] and [r.user_input for r in records] == [text]


def test_the_first_line_read_ahead_covers_the_longest_line() -> None:
    from memoryos_gpu.formats import opening

    assert opening._FIRST_LINE_BYTES > readers.MAX_LINE_BYTES


# ------------------------------------------------------------------ ids: control chars, blank
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("user_id", "a\nb", r"user_id .*contains U\+000A, a control character"),
        ("user_id", "a\tb", r"user_id .*contains U\+0009, a control character"),
        ("user_id", "caf\u00e9\x07", r"user_id .*contains U\+0007, a control character"),
        ("assistant_id", "bot\n", r"assistant_id .*contains U\+000A, a control character"),
        ("user_id", "  ", "user_id is blank"),
        ("user_id", "\t", "user_id is blank"),
        ("user_id", "x" * 300, "user_id is 300 characters; the limit is 256"),
    ],
)
def test_a_bad_id_gets_a_message_naming_what_is_wrong(field: str, value: str, match: str) -> None:
    page = PageInput(**{**_PAGE, "user_input": "hi", field: value})
    with pytest.raises(InvalidInputError, match=match):
        validate_page(page)


def test_ingest_rejects_name_the_control_character_and_the_blank_id(tmp_path: Path) -> None:
    src = tmp_path / "ids.jsonl"
    src.write_text(
        "\n".join(_page("x", user_id=u) for u in ("a\nb", "a\tb", "  ", "fine")) + "\n",
        encoding="utf-8",
    )
    rejects = tmp_path / "rejects.jsonl"
    config = EngineConfig(store=str(tmp_path / "s"), embedder="hashing")
    rep = ingest(src, config, rejects_path=rejects, progress=False)
    assert (rep.accepted, rep.rejected) == (1, 3)
    reasons = [json.loads(ln)["reason"] for ln in rejects.read_text().splitlines()]
    assert "U+000A, a control character" in reasons[0]
    assert "U+0009, a control character" in reasons[1]
    assert reasons[2].startswith("user_id is blank")


# ------------------------------------------------------------------ ShareGPT timestamps
def _turn(who: str, value: str, ts: object = None) -> dict:
    return {"from": who, "value": value, **({"timestamp": ts} if ts is not None else {})}


def test_a_bad_sharegpt_turn_timestamp_rejects_only_its_page(tmp_path: Path) -> None:
    conv = {
        "id": "c1",
        "conversations": [
            _turn("human", "q1", "bad"),
            _turn("gpt", "a1"),
            _turn("human", "q2", "2024-01-01"),
            _turn("gpt", "a2"),
        ],
    }
    src = tmp_path / "sg.jsonl"
    src.write_text(json.dumps(conv) + "\n", encoding="utf-8")
    records, rejects = _split(list(read_records(src)))
    assert [(r.user_input, r.agent_response, r.timestamp) for r in records] == [
        ("q2", "a2", "2024-01-01")
    ]
    assert len(rejects) == 1 and rejects[0].reason.startswith("turn 0 timestamp: unparseable")


def test_a_bad_conversation_timestamp_rejects_only_the_pages_that_take_it(
    tmp_path: Path,
) -> None:
    conv = {
        "id": "c2",
        "timestamp": "nope",
        "conversations": [
            _turn("human", "q1"),
            _turn("gpt", "a1"),
            _turn("human", "q2", "2024-01-01"),
            _turn("gpt", "a2"),
            _turn("human", "q3"),
        ],
    }
    src = tmp_path / "sg.jsonl"
    src.write_text(json.dumps(conv) + "\n", encoding="utf-8")
    records, rejects = _split(list(read_records(src)))
    assert [r.user_input for r in records] == ["q2"]
    assert [r.reason.split(":")[0] for r in rejects] == ["conversation timestamp"] * 2

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


# ------------------------------------------------------------------ a record the engine refuses
def test_a_record_refused_in_its_batch_says_only_it_was_not_stored(tmp_path: Path) -> None:
    """The engine refuses a whole batch for one page (a user of another assistant); ingest
    stores the rest without it, so the record's reason must not say "the batch was not
    stored" (its two neighbours were)."""
    src = tmp_path / "a.jsonl"
    src.write_text(
        "\n".join(
            [
                _page("1", user_id="al", assistant_id="bot"),
                _page("2", user_id="al", assistant_id="other"),
                _page("3", user_id="al"),
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    rejects = tmp_path / "rejects.jsonl"
    config = EngineConfig(store=str(tmp_path / "s"), embedder="hashing")
    rep = ingest(src, config, rejects_path=rejects, progress=False)
    assert (rep.accepted, rep.rejected) == (2, 1)
    (row,) = [json.loads(ln) for ln in rejects.read_text().splitlines()]
    assert row["line"] == 2
    assert "belongs to assistant 'bot', not 'other'" in row["reason"]
    assert "batch" not in row["reason"]
    assert row["reason"].endswith("(this record was not stored)")


def test_a_ray_shard_words_a_refused_record_as_ingest_does(tmp_path: Path) -> None:
    """``ingest --ray``'s shard actor (called in process, no Ray) retries the rest of a refused
    chunk too, so its reject says the record, not the batch, was not stored."""
    from memoryos_gpu.distributed.layout import prepare_layout, shard_store
    from memoryos_gpu.distributed.ray_ingest import ShardIngestActor, _records

    src = tmp_path / "a.jsonl"
    lines = [
        _page("1", user_id="al", assistant_id="bot"),
        _page("2", user_id="al", assistant_id="other"),
        _page("3", user_id="al"),
    ]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    store = tmp_path / "s"
    prepare_layout(str(store), 1)
    config = EngineConfig(store=shard_store(str(store), 0, 1), embedder="hashing")
    chunk = [r for r in _records({str(src): "jsonl"}, 1, 1) if isinstance(r, dict)]
    actor = ShardIngestActor(config.model_dump(), 0, 1)
    try:
        outcomes = actor.ingest(chunk, actor.engine.page_watermark())
    finally:
        actor.close()
    assert [o["status"] for o in outcomes] == ["accepted", "rejected", "accepted"]
    reason = outcomes[1]["reason"]
    assert "belongs to assistant 'bot'" in reason and "batch" not in reason
    assert reason.endswith("(this record was not stored)")


def test_both_batch_refusals_of_the_engine_become_this_record() -> None:
    """The engine's two refusals of a whole batch, as it words them (engine/stm.py)."""
    from memoryos_gpu.engine.stm import _foreign_source, _other_assistant
    from memoryos_gpu.ingest import record_refusal

    page = PageInput(**{**_PAGE, "assistant_id": "other", "source": "pg-1"})
    for exc in (_other_assistant(page, "bot"), _foreign_source(page)):
        assert "the batch was not stored" in str(exc)  # what the engine says of its batch
        reason = record_refusal(exc)
        assert "batch" not in reason and reason.endswith(" (this record was not stored)")
    assert record_refusal(InvalidInputError("user_id is blank")) == "user_id is blank"


# ------------------------------------------------------------------ inputs that are not UTF-8
def test_a_utf16_file_is_named_as_such_not_as_unrecognisable(tmp_path: Path) -> None:
    text = "".join(_page(f"p{i}") + "\n" for i in range(5))
    for encoding, what in (("utf-16", "UTF-16"), ("utf-32", "UTF-32")):
        src = tmp_path / f"{encoding}.jsonl"
        src.write_bytes(text.encode(encoding))  # with its byte-order mark, as iconv writes it
        with pytest.raises(FormatError, match=rf"not UTF-8 \({what} BOM found\)"):
            detect_format(src)
    src = tmp_path / "le.jsonl"
    src.write_bytes(text.encode("utf-16-le"))  # no byte-order mark: NUL bytes
    with pytest.raises(FormatError, match=r"not UTF-8 \(NUL bytes at line 1"):
        detect_format(src)


def test_a_latin1_file_says_where_its_utf8_is_invalid(tmp_path: Path) -> None:
    src = tmp_path / "latin1.jsonl"
    page = {**_PAGE, "agent_response": "d\u00e9j\u00e0"}
    lines = [
        json.dumps({**page, "user_input": f"caf\u00e9 {i}"}, ensure_ascii=False) for i in range(5)
    ]
    src.write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    with pytest.raises(FormatError) as refused:
        detect_format(src)
    message = str(refused.value)
    at = lines[0].encode("latin-1").index(b"\xe9")
    assert f"not UTF-8 (invalid UTF-8 at line 1 byte {at}: invalid continuation byte)" in message
    assert "recognisable record" in message  # what detection looked for is said too


def test_one_latin1_line_among_utf8_ones_is_still_a_reject_of_its_own(tmp_path: Path) -> None:
    src = tmp_path / "mixed.jsonl"
    latin1 = json.dumps({**_PAGE, "user_input": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")
    src.write_bytes(latin1 + b"\n" + _page("ok").encode() + b"\n")
    assert detect_format(src) == "jsonl"
    records, rejects = _split(list(read_records(src)))
    assert [r.user_input for r in records] == ["ok"]
    assert len(rejects) == 1 and rejects[0].reason.startswith("invalid UTF-8")


# ------------------------------------------------------------------ LoCoMo: a bad session date
def test_the_rejects_of_a_bad_locomo_session_date_name_their_turns(tmp_path: Path) -> None:
    conversation = {
        "speaker_a": "Ann",
        "speaker_b": "Bob",
        "session_1_date_time": "1:56 pm on 8 May, 2023",
        "session_1": [
            {"speaker": "Ann", "dia_id": "D1:1", "text": "hi"},
            {"speaker": "Bob", "dia_id": "D1:2", "text": "hello"},
        ],
        "session_2_date_time": "sometime",
        "session_2": [
            {"speaker": "Ann", "dia_id": "D2:1", "text": "q1"},
            {"speaker": "Bob", "dia_id": "D2:2", "text": "a1"},
            {"speaker": "Ann", "dia_id": "D2:3", "text": "q2"},
            {"speaker": "Bob", "text": "a2 (no dia_id)"},
            {"speaker": "Bob", "dia_id": "D2:5", "text": "a3"},
        ],
    }
    src = tmp_path / "locomo_bad.json"
    src.write_text(json.dumps([{"sample_id": "s1", "conversation": conversation}]))
    records, rejects = _split(list(read_records(src)))
    assert [r.user_input for r in records] == ["hi"]
    reasons = [r.reason for r in rejects]
    assert len(set(reasons)) == len(reasons) == 3  # one line per page, each telling which
    assert reasons[0].startswith("turns D2:1, D2:2: session_2_date_time: unparseable")
    assert reasons[1].startswith("turns D2:3, session_2[3]: session_2_date_time: ")
    assert reasons[2].startswith("turn D2:5: session_2_date_time: ")


# ------------------------------------------------------------------ meta, id, blank user
def test_a_jsonl_meta_that_is_not_an_object_is_rejected_naming_meta(tmp_path: Path) -> None:
    src = tmp_path / "meta.jsonl"
    metas = ['"notadict"', "[1, 2]", "5", "null", '{"k": "v"}']
    src.write_text(
        "".join(_page(f"m{i}")[:-1] + f', "meta": {m}}}\n' for i, m in enumerate(metas)),
        encoding="utf-8",
    )
    records, rejects = _split(list(read_records(src)))
    assert [(r.user_input, r.meta) for r in records] == [("m3", {}), ("m4", {"k": "v"})]
    assert [r.reason for r in rejects] == [
        "meta must be an object, got string",
        "meta must be an object, got array",
        "meta must be an object, got number",
    ]


@pytest.mark.parametrize("fmt", ["sharegpt", "openai"])
def test_a_conversation_id_names_its_user_by_the_user_id_rule(tmp_path: Path, fmt: str) -> None:
    """``"id": 5`` was taken as user "5" where ``"user_id": 7`` is refused as not a string."""
    turns: Any = (
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
        if fmt == "sharegpt"
        else {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    )
    items = [
        {"id": 5, **turns},
        {"user_id": 7, **turns},
        {"id": True, **turns},
        {"id": "", **turns},
        {"id": "c-1", **turns},
        {"user_id": "u", "id": 5, **turns},  # id is then only the conversation's id
    ]
    src = tmp_path / f"{fmt}.jsonl"
    src.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
    records, rejects = _split(list(read_records(src, format=fmt)))
    assert [(r.line, r.user_id) for r in records] == [(5, "c-1"), (6, "u")]
    assert records[1].meta["conversation_id"] == 5
    assert [(r.line, r.reason) for r in rejects] == [
        (1, "id must be a string, got int"),
        (2, "user_id must be a string, got int"),
        (3, "id must be a string, got bool"),
        (4, "id is blank (empty): give a visible id"),
    ]


def test_an_empty_user_id_is_blank_as_the_docs_and_the_engine_say(tmp_path: Path) -> None:
    src = tmp_path / "blank.jsonl"
    src.write_text(_page("x", user_id="") + "\n" + _page("y", user_id="  ") + "\n")
    rejects = tmp_path / "rejects.jsonl"
    config = EngineConfig(store=str(tmp_path / "s"), embedder="hashing")
    rep = ingest(src, config, rejects_path=rejects, progress=False)
    reasons = [json.loads(ln)["reason"] for ln in rejects.read_text().splitlines()]
    assert [r.split(" (")[0] for r in reasons] == ["user_id is blank"] * 2
    assert list(rep.reject_reasons) == ["user_id is blank: give a visible id"]  # one kind

"""Readers: every format, gzip, auto-detection, rejects, LoCoMo pairing, idempotency keys."""

from __future__ import annotations

import gzip
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu.eval.locomo import default_locomo_path
from memoryos_gpu.formats import (
    RAW_LIMIT,
    FormatError,
    Record,
    Reject,
    detect_format,
    normalise_text,
    parse_timestamp,
    read_records,
)

DATA = Path(__file__).parent / "data"


def split(items):
    recs = [r for r in items if isinstance(r, Record)]
    rejs = [r for r in items if isinstance(r, Reject)]
    assert len(recs) + len(rejs) == len(items)
    return recs, rejs


def gz_copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(gzip.compress(src.read_bytes(), mtime=0))
    return dst


# ------------------------------------------------------------------------------------ jsonl


def test_jsonl_records_and_rejects_with_line_numbers():
    recs, rejs = split(list(read_records(DATA / "pages.jsonl")))
    assert [r.user_id for r in recs] == ["alice", "bob", "frank", "alice"]
    alice = recs[0]
    assert alice.assistant_id == "bot"
    assert alice.user_input == "I moved to Lisbon in March."
    assert alice.agent_response == "Congratulations on the move!"
    assert alice.timestamp == "2024-03-02T10:00:00Z"
    assert alice.epoch == datetime(2024, 3, 2, 10, tzinfo=UTC).timestamp()
    assert recs[1].timestamp == 1717000000.0 and recs[1].assistant_id is None
    # control characters stripped except \n and \t; empty response kept
    assert recs[2].user_input == "Tab\there, bell and CR\nkept?"
    assert recs[2].agent_response == ""
    assert recs[2].timestamp == "1:56 pm on 8 May, 2023"

    assert [r.line for r in rejs] == [4, 5, 6, 7, 8, 11]
    reasons = [r.reason for r in rejs]
    assert "invalid JSON" in reasons[0]
    assert "agent_response" in reasons[1] and "missing" in reasons[1]
    assert "user_input must be a string" in reasons[2]
    assert "UTF-8" in reasons[3]
    assert "timestamp" in reasons[4] and "next tuesday-ish" in reasons[4]
    assert "JSON object" in reasons[5]
    assert all(r.path == str(DATA / "pages.jsonl") for r in rejs)
    assert "gina" in rejs[3].raw and "\ufffd" in rejs[3].raw  # decoded with replacement
    assert rejs[0].raw.startswith('{"user_id": "carol"')


def test_identical_pages_of_an_input_are_numbered_by_occurrence():
    recs, _ = split(list(read_records(DATA / "pages.jsonl")))
    assert recs[0].to_page() | {"source": None} == recs[3].to_page() | {"source": None}
    assert (recs[0].line, recs[3].line) == (1, 12)
    first, again = recs[0].source, recs[3].source
    assert first.startswith("pg-") and first.endswith("-1")
    assert again == first[:-1] + "2"  # same content, second occurrence: kept distinct
    # the key earlier versions gave the page, looked for so their stores are not filled twice
    assert recs[0].legacy_source.startswith("pages.jsonl:1:0:")
    assert recs[3].legacy_source.startswith("pages.jsonl:12:0:")


@pytest.mark.parametrize("name", ["pages.jsonl.gz", "pages.jsonl", "pages_no_extension"])
def test_gzip_detected_by_magic_bytes(tmp_path, name):
    path = gz_copy(DATA / "pages.jsonl", tmp_path / name)
    plain = list(read_records(DATA / "pages.jsonl"))
    got = list(read_records(path))
    assert detect_format(path) == "jsonl"
    assert len(got) == len(plain)
    for a, b in zip(plain, got, strict=True):
        assert type(a) is type(b)
        if isinstance(a, Record):
            assert (a.user_id, a.user_input, a.agent_response, a.timestamp) == (
                b.user_id,
                b.user_input,
                b.agent_response,
                b.timestamp,
            )
            assert a.source == b.source  # the key does not name the file
            assert a.legacy_source.split(":", 1)[1] == b.legacy_source.split(":", 1)[1]
        else:
            assert (a.line, a.reason) == (b.line, b.reason)


def test_gzip_locomo_and_array(tmp_path):
    for src, fmt in [("locomo_mini.json", "locomo"), ("sharegpt_array.json", "sharegpt")]:
        path = gz_copy(DATA / src, tmp_path / (src + ".gz"))
        assert detect_format(path) == fmt
        a = [r.user_input for r in read_records(DATA / src) if isinstance(r, Record)]
        b = [r.user_input for r in read_records(path) if isinstance(r, Record)]
        assert a == b and a


def test_utf8_bom_is_ignored(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (DATA / "pages.jsonl").read_bytes())
    recs, rejs = split(list(read_records(path)))
    assert recs[0].user_id == "alice" and len(rejs) == 6


def test_invalid_utf8_line_does_not_stop_reading(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"user_id": "u", "user_input": "a", "agent_response": "b"}).encode()
    path.write_bytes(good + b"\n\xc3\x28\xa0\xa1 garbage\n" + good + b"\n")
    recs, rejs = split(list(read_records(path, "jsonl")))
    assert len(recs) == 2
    assert [(r.line, "invalid UTF-8" in r.reason) for r in rejs] == [(2, True)]


def test_raw_is_truncated(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(
        json.dumps({"user_id": "u", "user_input": "a", "agent_response": "b"})
        + "\n"
        + json.dumps({"user_id": 5, "user_input": "x" * 10_000, "agent_response": ""})
        + "\n"
    )
    _, rejs = split(list(read_records(path)))
    assert len(rejs) == 1 and len(rejs[0].raw) == RAW_LIMIT and rejs[0].line == 2


# ------------------------------------------------------------------------------------ detection


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("pages.jsonl", "jsonl"),
        ("sharegpt.jsonl", "sharegpt"),
        ("sharegpt_array.json", "sharegpt"),
        ("openai.jsonl", "openai"),
        ("locomo_mini.json", "locomo"),
    ],
)
def test_auto_detection(name, fmt):
    assert detect_format(DATA / name) == fmt
    assert list(read_records(DATA / name)) == list(read_records(DATA / name, format=fmt))


def test_detection_skips_bad_first_lines(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("not json\n\n" + json.dumps({"messages": []}) + "\n")
    assert detect_format(path) == "openai"


def test_undetectable_input_raises_clear_error():
    with pytest.raises(FormatError, match="cannot detect the format"):
        detect_format(DATA / "undetectable.jsonl")
    with pytest.raises(FormatError, match="format="):
        read_records(DATA / "undetectable.jsonl")


def test_empty_input(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    assert list(read_records(path)) == []
    with pytest.raises(FormatError, match="empty"):
        detect_format(path)


def test_explicit_override_and_unknown_format():
    got = list(read_records(DATA / "pages.jsonl", format="sharegpt"))
    assert got and all(isinstance(r, Reject) for r in got)
    assert any("conversations" in r.reason for r in got)
    with pytest.raises(FormatError, match="unknown format"):
        read_records(DATA / "pages.jsonl", format="csv")


# ------------------------------------------------------------------------------------ sharegpt


def test_sharegpt_jsonl():
    recs, rejs = split(list(read_records(DATA / "sharegpt.jsonl")))
    pages = [(r.user_id, r.user_input, r.agent_response) for r in recs]
    assert pages == [
        ("conv-1", "I adopted a beagle named Pepper.", "Pepper is a lovely name!"),
        ("conv-1", "She is 2 years old.", "A fun age."),
        ("conv-1", "Thanks, bye.", ""),
        ("u-77", "", "Welcome back! How was Kyoto?"),
        ("u-77", "Amazing, the temples were beautiful.", "Which one did you like most?"),
        (recs[5].user_id, "no id here", "fallback id"),
    ]
    assert recs[5].user_id.startswith("conv-") and recs[5].generated_user
    assert recs[0].meta == {"turns": [1, 2], "conversation_id": "conv-1"}
    assert recs[3].timestamp == "2023-11-05" and recs[0].timestamp is None
    assert [r.line for r in rejs] == [4, 5]
    assert "unknown role 'martian'" in rejs[0].reason
    assert "must be a string" in rejs[1].reason
    assert len({r.source for r in recs}) == len(recs)


def test_sharegpt_json_array():
    recs, rejs = split(list(read_records(DATA / "sharegpt_array.json")))
    assert not rejs
    lines = [r for r in read_records(DATA / "sharegpt.jsonl") if isinstance(r, Record)]
    assert [(r.user_input, r.agent_response) for r in recs] == [
        (r.user_input, r.agent_response) for r in lines
    ]
    # the same conversation as the JSONL file's third line: the same generated user
    assert recs[-1].user_id == lines[-1].user_id and recs[-1].user_id.startswith("conv-")
    assert [r.source for r in recs] == [r.source for r in lines]


def test_truncated_json_array_rejects_and_stops(tmp_path):
    text = (DATA / "sharegpt_array.json").read_text()
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"no id here"') + 5])
    recs, rejs = split(list(read_records(path, "sharegpt")))
    assert len(recs) == 5  # the two complete items
    assert len(rejs) == 1 and rejs[0].line == 3 and "reading stopped" in rejs[0].reason


# ------------------------------------------------------------------------------------ openai


def test_openai_messages():
    recs, rejs = split(list(read_records(DATA / "openai.jsonl")))
    assert [(r.user_id, r.user_input, r.agent_response) for r in recs] == [
        ("maria", "Book a table in Porto for Friday.", "Booked for 8 pm\nat Cantinho."),
        ("maria", "Here is the menu", "Looks tasty."),
        (recs[2].user_id, "Only a question", ""),
    ]
    assert recs[2].user_id.startswith("conv-") and recs[2].generated_user
    assert not recs[0].generated_user
    assert recs[1].meta["turns"] == [3, 6]
    assert [r.line for r in rejs] == [3]
    assert "content" in rejs[0].reason


# ------------------------------------------------------------------------------------ locomo


def locomo_turns(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    return [
        t["dia_id"]
        for c in data
        for k, v in c["conversation"].items()
        if isinstance(v, list)
        for t in v
    ]


def test_locomo_pairing_never_drops_a_turn():
    recs, rejs = split(list(read_records(DATA / "locomo_mini.json")))
    got = [(r.user_id, r.meta["session"], r.meta["dia_ids"]) for r in recs]
    assert got == [
        ("conv-a", 1, ["D1:1", "D1:2"]),
        ("conv-a", 1, ["D1:3", "D1:4"]),
        ("conv-a", 1, ["D1:5"]),  # trailing speaker_a turn: empty response
        ("conv-a", 2, ["D2:1"]),  # leading speaker_b turn: empty user input
        ("conv-a", 2, ["D2:2", "D2:3"]),
        ("conv-b", 2, ["D2:1"]),  # sessions in numeric order (2 before 10)
        ("conv-b", 2, ["D2:2", "D2:3"]),
        ("conv-b", 2, ["D2:4"]),
        ("conv-b", 10, ["D10:1"]),
    ]
    assert recs[2].agent_response == "" and recs[2].user_input == "Talk soon!"
    assert recs[3].user_input == "" and recs[3].agent_response == "Morning! Any news?"
    assert recs[1].user_input == "Look at this view [image: a photo of a foggy bay]"
    assert recs[0].assistant_id == "conv-a:Ivan"
    assert recs[0].timestamp == "1:56 pm on 8 May, 2023"
    assert recs[0].epoch == datetime(2023, 5, 8, 13, 56, tzinfo=UTC).timestamp()
    assert recs[3].epoch == datetime(2023, 6, 19, 10, 4, tzinfo=UTC).timestamp()
    # the malformed turn is reported, not silently dropped
    assert len(rejs) == 1 and rejs[0].line == 2 and "session_2[4]" in rejs[0].reason
    assert '"D2:5"' in rejs[0].raw
    seen = [d for r in recs for d in r.meta["dia_ids"]] + ["D2:5"]
    assert sorted(seen) == sorted(locomo_turns(DATA / "locomo_mini.json"))


def test_locomo_single_object_document(tmp_path):
    data = json.loads((DATA / "locomo_mini.json").read_text())
    path = tmp_path / "one.json"
    path.write_text(json.dumps(data[0], indent=2))
    assert detect_format(path) == "locomo"
    recs, rejs = split(list(read_records(path)))
    assert len(recs) == 5 and not rejs


def test_locomo_bad_session_date_rejects_its_pages(tmp_path):
    data = json.loads((DATA / "locomo_mini.json").read_text())
    data[0]["conversation"]["session_2_date_time"] = "sometime in June"
    path = tmp_path / "bad_date.json"
    path.write_text(json.dumps(data))
    recs, rejs = split(list(read_records(path)))
    assert len(recs) == 7
    bad = [r for r in rejs if "session_2_date_time" in r.reason]
    assert len(bad) == 2 and all(r.line == 1 for r in bad)


def test_real_locomo_covers_every_turn():
    path = default_locomo_path()
    if not path.exists():
        pytest.skip("LoCoMo data not available")
    recs, rejs = split(list(read_records(path)))
    assert not rejs
    assert sorted(d for r in recs for d in r.meta["dia_ids"]) == sorted(locomo_turns(path))


# ------------------------------------------------------------------------------------ keys


def test_idempotency_keys_stable_across_reads_and_content_sensitive(tmp_path):
    for name in ["pages.jsonl", "sharegpt.jsonl", "openai.jsonl", "locomo_mini.json"]:
        a = [r.source for r in read_records(DATA / name) if isinstance(r, Record)]
        b = [r.source for r in read_records(DATA / name) if isinstance(r, Record)]
        assert a == b and len(set(a)) == len(a), name

    copy = tmp_path / "locomo_mini.json"
    shutil.copy(DATA / "locomo_mini.json", copy)
    before = [r.source for r in read_records(copy) if isinstance(r, Record)]
    copy.write_text(copy.read_text().replace("Send me a slice.", "Send me two slices."))
    after = [r.source for r in read_records(copy) if isinstance(r, Record)]
    changed = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
    assert changed == [4]


# ------------------------------------------------------------------------------------ timestamps


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1700000000, 1700000000.0),
        (1.5, 1.5),
        ("1700000000", 1700000000.0),
        ("2023-05-08", datetime(2023, 5, 8, tzinfo=UTC).timestamp()),
        ("2023-05-08T13:56:00Z", datetime(2023, 5, 8, 13, 56, tzinfo=UTC).timestamp()),
        (
            "2023-05-08T15:56:00+02:00",
            datetime(2023, 5, 8, 13, 56, tzinfo=UTC).timestamp(),
        ),
        ("2023-05-08 13:56:00", datetime(2023, 5, 8, 13, 56, tzinfo=UTC).timestamp()),
        ("1:56 pm on 8 May, 2023", datetime(2023, 5, 8, 13, 56, tzinfo=UTC).timestamp()),
        (
            "12:06 am on 11 November, 2022",
            datetime(2022, 11, 11, 0, 6, tzinfo=UTC).timestamp(),
        ),
        ("12:30 PM on 3 Sept 2021", datetime(2021, 9, 3, 12, 30, tzinfo=UTC).timestamp()),
    ],
)
def test_parse_timestamp(value, expected):
    assert parse_timestamp(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "tomorrow",
        "13:00 pm on 8 May, 2023",
        "1:56 pm on 31 February, 2023",
        True,
        None,
        [1],
        float("nan"),
    ],
)
def test_parse_timestamp_errors(value):
    with pytest.raises(ValueError, match="unparseable timestamp"):
        parse_timestamp(value)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (10**400, "an integer of 401 digits"),  # float(int) overflows: was an OverflowError
        ("9999-12-31T23:59:59-14:00", "outside the years 1-9999"),  # past the end once in UTC
        ("0001-01-01T00:00:00+14:00", "outside the years 1-9999"),
    ],
)
def test_parse_timestamp_out_of_range_is_a_value_error(value, says):
    with pytest.raises(ValueError, match=says):
        parse_timestamp(value)


def test_a_huge_integer_timestamp_rejects_its_line_only(tmp_path):
    log = tmp_path / "big.jsonl"
    good = {"user_id": "a", "user_input": "hi", "agent_response": "ok", "timestamp": 1.7e9}
    log.write_text(
        json.dumps(good)
        + "\n"
        + json.dumps({**good, "timestamp": 10**400})
        + "\n"
        + json.dumps({**good, "user_input": "again"})
        + "\n"
    )
    recs, rejs = split(list(read_records(log)))
    assert [r.user_input for r in recs] == ["hi", "again"]
    assert [r.line for r in rejs] == [2] and "401 digits" in rejs[0].reason


# ------------------------------------------------------------------------------------ round trip

_text = st.text(max_size=40)
_page = st.fixed_dictionaries(
    {
        "user_id": st.text(min_size=1, max_size=12).filter(lambda s: normalise_text(s) != ""),
        "user_input": _text,
        "agent_response": _text,
    },
    optional={
        "assistant_id": st.none() | st.text(max_size=8),
        "timestamp": st.none()
        | st.integers(min_value=0, max_value=4_000_000_000)
        | st.floats(min_value=0, max_value=4e9, allow_nan=False)
        | st.datetimes(min_value=datetime(1971, 1, 1)).map(lambda d: d.isoformat()),
    },
)


@settings(max_examples=60, deadline=None)
@given(pages=st.lists(_page, max_size=8), ascii_only=st.booleans(), gz=st.booleans())
def test_jsonl_round_trip(tmp_path_factory, pages, ascii_only, gz):
    path = tmp_path_factory.mktemp("rt") / "pages.jsonl"
    data = "".join(json.dumps(p, ensure_ascii=ascii_only) + "\n" for p in pages).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    got = list(read_records(path, "jsonl" if not pages else "auto"))
    assert all(isinstance(r, Record) for r in got), got
    assert len(got) == len(pages)
    for p, r in zip(pages, got, strict=True):
        assert r.user_id == normalise_text(p["user_id"])
        assert r.user_input == normalise_text(p["user_input"])
        assert r.agent_response == normalise_text(p["agent_response"])
        aid = p.get("assistant_id")
        assert r.assistant_id == (None if aid is None else normalise_text(aid))
        ts = p.get("timestamp")
        assert r.timestamp == (float(ts) if isinstance(ts, (int, float)) else ts)
    assert [r.source for r in got] == [r.source for r in read_records(path, "jsonl")]


def test_bundled_sample_reads_clean():
    from memoryos_gpu.formats import sample_chats_path

    recs, rejs = split(list(read_records(sample_chats_path())))
    assert not rejs and len(recs) == 75
    assert {r.user_id for r in recs} == {"maya_chen", "tomas_rivera", "priya_nair"}
    for uid in {r.user_id for r in recs}:
        times = [r.epoch for r in recs if r.user_id == uid]
        assert times == sorted(times) and len(set(times)) == len(times)


def test_json_documents_without_ijson(monkeypatch, tmp_path):
    from memoryos_gpu.formats import readers

    streamed = {
        name: list(read_records(DATA / name))
        for name in ["locomo_mini.json", "sharegpt_array.json"]
    }
    monkeypatch.setattr(readers, "ijson", None)  # the documented json.load fallback
    for name, expected in streamed.items():
        assert list(read_records(DATA / name)) == expected
    text = (DATA / "sharegpt_array.json").read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[:-20])
    got = list(read_records(cut, "sharegpt"))
    assert len(got) == 1 and isinstance(got[0], Reject) and "reading stopped" in got[0].reason

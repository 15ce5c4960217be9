"""A corrupt compressed input is refused as a whole, before anything of it is stored.

gzip checks a member's CRC and length only at its end, so one flipped byte of a gzip of 40,000
pages gave 6,760 accepted pages (some garbled text filed under real users) and 45,905 rejects
of garbage "lines", the corruption showing only as the last reject. A gzip file is now
decompressed once to its end before its records are read (``opening.check_integrity``). A pipe
cannot be read twice: a corruption within its read-ahead is refused before anything is read
(it used to pass for an empty input); one past it ends the read with a reject saying that the
records before it were read. Inputs that are bzip2, xz or zstd (not read) are named as such.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import random
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.formats import FormatError, detect_format, opening, read_records
from memoryos_gpu.ingest import EXIT_REJECTED, ingest, resolve_formats

_WORDS = ["apple", "banana", "cat", "dog", "tea", "coffee", "nurse"]


def _pages(n: int, seed: int = 1) -> bytes:
    rnd = random.Random(seed)
    rows = (
        {
            "user_id": f"user{rnd.randrange(40)}",
            "user_input": " ".join(rnd.choices(_WORDS, k=12)) + f" #{i}",
            "agent_response": "resp",
            "timestamp": 1_700_000_000 + i * 60,
        }
        for i in range(n)
    )
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _flipped(data: bytes, at: float) -> bytes:
    out = bytearray(data)
    out[int(len(out) * at)] ^= 0xFF
    return bytes(out)


def _cfg(store: Path) -> EngineConfig:
    return EngineConfig(store=str(store), embedder="hashing")


def _stored(store: Path) -> int:
    with MemoryEngine(_cfg(store)) as engine:
        return sum(v for k, v in engine.store.counts().items() if k.startswith("pages_"))


# ------------------------------------------------------------------ a gzip file
def test_a_gzip_file_with_one_flipped_byte_is_refused_whole_before_anything_is_stored(
    tmp_path: Path,
) -> None:
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps({"user_id": "u", "user_input": "x", "agent_response": "y"}) + "\n")
    bad = tmp_path / "corrupt.jsonl.gz"
    bad.write_bytes(_flipped(gzip.compress(_pages(6000)), 0.6))
    rejects = tmp_path / "rejects.jsonl"
    log = io.StringIO()
    store = tmp_path / "s"
    rep = ingest([bad, good], _cfg(store), rejects_path=rejects, progress=False, reject_log=log)
    assert (rep.accepted, rep.rejected) == (1, 1)  # the next file is read
    assert rep.exit_code == EXIT_REJECTED
    (row,) = [json.loads(ln) for ln in rejects.read_text().splitlines()]
    assert row["file"] == str(bad) and row["line"] == 0  # the file, not a line of it
    assert row["reason"].startswith("corrupt gzip file, refused as a whole")
    assert "CRC check failed" in row["reason"] or "decompressing" in row["reason"]
    assert log.getvalue().count("rejected:") == 1
    assert _stored(store) == 1


def test_a_truncated_gzip_file_is_refused_whole(tmp_path: Path) -> None:
    data = gzip.compress(_pages(400))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) * 2 // 3])
    rep = ingest([cut], _cfg(tmp_path / "s"), progress=False, reject_log=io.StringIO())
    assert (rep.accepted, rep.rejected) == (0, 1)
    assert rep.reject_reasons == {
        "corrupt gzip file, refused as a whole: none of its records was read": 1
    }


def test_read_records_raises_for_a_corrupt_gzip_before_yielding(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.jsonl.gz"
    bad.write_bytes(_flipped(gzip.compress(_pages(3000)), 0.5))
    from memoryos_gpu.formats.opening import CorruptInputError

    assert detect_format(bad) == "jsonl"  # its start decompresses: the format is known
    with pytest.raises(CorruptInputError, match=r"corrupt gzip file.*cannot read further"):
        read_records(bad)


def test_valid_gzip_files_pass_the_check(tmp_path: Path) -> None:
    """Several members (``cat a.gz b.gz``), an empty member, a plain file: all intact."""
    from memoryos_gpu.formats.opening import check_integrity

    multi = tmp_path / "multi.jsonl.gz"
    multi.write_bytes(
        gzip.compress(_pages(50, 1)) + gzip.compress(b"") + gzip.compress(_pages(50, 2))
    )
    check_integrity(multi)
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(_pages(10))
    check_integrity(plain)
    rep = ingest([multi], _cfg(tmp_path / "s"), progress=False)
    assert (rep.accepted, rep.rejected) == (100, 0)


def test_a_gzip_damaged_where_the_format_is_sniffed_says_it_is_corrupt(tmp_path: Path) -> None:
    bad = tmp_path / "early.jsonl.gz"
    data = gzip.compress(_pages(50))
    bad.write_bytes(data[:12] + bytes(b ^ 0xFF for b in data[12:40]) + data[40:])
    with pytest.raises(FormatError, match=r"early\.jsonl\.gz.*corrupt gzip file"):
        resolve_formats([bad])


# ------------------------------------------------------------------ a gzip pipe
def test_a_corrupt_gzip_pipe_within_its_read_ahead_is_refused_not_taken_as_empty(
    tmp_path: Path, kit: Any
) -> None:
    """The read-ahead of a gzip pipe is decompressed to detect its format; when that failed it
    was taken as empty, and the run ingested nothing and exited 0."""
    data = _flipped(gzip.compress(_pages(3000)), 0.5)
    path, fd, feeder = kit.pipe(data)
    try:
        with pytest.raises(FormatError, match=r"corrupt gzip pipe, refused as a whole"):
            resolve_formats([path])
    finally:
        feeder.join(5)
        os.close(fd)
    path, fd, feeder = kit.pipe(data)
    try:  # the format named: one reject for the pipe
        rep = ingest(
            [path], _cfg(tmp_path / "s"), fmt="jsonl", progress=False, reject_log=io.StringIO()
        )
    finally:
        feeder.join(5)
        os.close(fd)
    assert (rep.accepted, rep.rejected, rep.exit_code) == (0, 1, EXIT_REJECTED)
    assert "corrupt gzip pipe, refused as a whole" in next(iter(rep.reject_reasons))


def test_a_gzip_pipe_corrupt_past_its_read_ahead_says_what_was_read(
    tmp_path: Path, kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipe is read once: a corruption past the read-ahead is found by the read, and the
    reject says that the records before it were read (documented; give the file instead)."""
    monkeypatch.setattr(opening, "_HEAD_BYTES", 4096)
    data = _flipped(gzip.compress(_pages(3000)), 0.8)
    path, fd, feeder = kit.pipe(data)
    rejects = tmp_path / "rejects.jsonl"
    try:
        rep = ingest(
            [path],
            _cfg(tmp_path / "s"),
            rejects_path=rejects,
            progress=False,
            reject_log=io.StringIO(),
        )
    finally:
        feeder.join(5)
        os.close(fd)
    assert rep.exit_code == EXIT_REJECTED
    last = json.loads(rejects.read_text().splitlines()[-1])["reason"]
    assert "cannot read further" in last
    assert "a pipe cannot be checked before it is read" in last


# ------------------------------------------------------------------ compressions not read
@pytest.mark.parametrize(
    ("name", "compress", "what"),
    [
        ("x.jsonl.bz2", bz2.compress, "bzip2-compressed"),
        ("x.jsonl.xz", lzma.compress, "xz-compressed"),
        ("x.jsonl.zst", lambda d: b"\x28\xb5\x2f\xfd" + d, "zstd-compressed"),
    ],
)
def test_other_compressions_are_named_not_read_as_text(
    tmp_path: Path, name: str, compress: Any, what: str
) -> None:
    src = tmp_path / name
    src.write_bytes(compress(_pages(5)))
    with pytest.raises(FormatError, match=rf"it is {what}, which is not read \(only gzip is\)"):
        detect_format(src)

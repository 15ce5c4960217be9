"""``ingest --ray`` stopped and run again: keyword statistics counted once, a PostgreSQL
store's shard count kept, and the stop signals answered as the single-process path does.

* PostgreSQL: a run stopped before its exchange, then run again, ends with the statistics of a
  clean run (was: the pages committed before the stop counted twice on every shard).
* SQLite: the same with a :class:`ShardedEngine` opened and closed in between (was: the stopped
  run's pages never reached the other shards' statistics).
* A PostgreSQL store sharded N ways refuses another ``--shards`` before Ray starts (was: taken,
  statistics counted again under the new count).
* SIGINT, SIGTERM and SIGHUP end the run after the chunks in flight with its report, exit
  128 + the signal (was: SIGTERM exit 15 with a stack dump, SIGHUP killed the driver while
  the actors went on writing, SIGINT no report); a repeated SIGTERM changes nothing (was: it
  aborted).

One local Ray for the module (as tests/test_ray_ingest_edges.py); skipped without Ray.
PostgreSQL tests need ``MEMORYOS_GPU_TEST_PG_URL``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from test_distributed import PG_URL, conversation, engine_config, store_for
from test_ray_ingest_edges import _keyword_state, _wait_released, cli, write_chats

from memoryos_gpu.distributed import ray_ingest
from memoryos_gpu.distributed.layout import prepare_layout
from memoryos_gpu.distributed.ray_ingest import ingest_ray
from memoryos_gpu.distributed.sharding import ShardedEngine
from memoryos_gpu.store import StoreLockedError, open_store

pytest.importorskip("ray", reason="Ray is not installed: pip install 'memoryos-gpu[ray]'")
pytest.importorskip("ray.data", reason="Ray Data is not installed")

needs_pg = pytest.mark.skipif(not PG_URL, reason="MEMORYOS_GPU_TEST_PG_URL is not set")
KW: dict[str, Any] = {"batch_size": 16, "shard_cpus": 0.25}


class _Stop(Exception):
    """Stands for a crash (or a Ctrl-C under the old code) between two windows."""


def _stop_after_first_window(n: int, report: Any) -> None:
    if n == 0:
        raise _Stop


def _pg_keyword_state(url: str, shards: int) -> list[tuple[int, dict[str, int]]]:
    """Each shard's saved keyword statistics in a shared store (per-shard meta keys)."""
    st = open_store(url, writer=False)
    try:
        raws = [st.get_meta(f"keyword_extractor@shard-{i}-of-{shards}") for i in range(shards)]
    finally:
        st.close()
    return [(json.loads(r)["n_docs"], json.loads(r)["df"]) for r in raws]


def _wait_released_pg(url: str, timeout: float = 60.0) -> None:
    """The killed actors' sessions end (and give their shard claims back) shortly after."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            open_store(url).close()  # the whole store: free once no shard is claimed
            return
        except StoreLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _stopped_then_rerun(store: str, src: Path, half: int, between: Any = None) -> dict:
    with pytest.raises(_Stop):
        ingest_ray(
            [src], engine_config(store), 2, window=half, on_window=_stop_after_first_window, **KW
        )
    if "://" in store:
        _wait_released_pg(store)
    else:
        _wait_released(store, 2)
    if between is not None:
        between()
    return ingest_ray([src], engine_config(store), 2, **KW)


# ====================================================================== keyword statistics
@needs_pg
def test_a_stopped_run_into_postgres_run_again_counts_every_page_once(ray_local, tmp_path):
    rows = conversation(users=8, per_user=8)
    src = write_chats(tmp_path / "chats.jsonl", rows)
    clean, resumed = store_for("postgres", tmp_path), store_for("postgres", tmp_path)
    ingest_ray([src], engine_config(clean), 2, **KW)
    half = len(rows) // 2
    again = _stopped_then_rerun(resumed, src, half)
    assert (again["accepted"], again["skipped"], again["pending"]) == (half, half, 0)
    state = _pg_keyword_state(resumed, 2)
    assert [n for n, _ in state] == [len(rows), len(rows)]  # was: + the first half again
    assert state == _pg_keyword_state(clean, 2)


def test_a_sharded_open_between_a_stopped_run_and_its_rerun_loses_nothing(ray_local, tmp_path):
    """Opened (and closed) by a ShardedEngine in between, the stopped run's pages still reach
    every shard's statistics (was: never: the engines saved them as if exchanged)."""
    rows = conversation(users=8, per_user=8)
    src = write_chats(tmp_path / "chats.jsonl", rows)
    clean, resumed = str(tmp_path / "clean"), str(tmp_path / "resumed")
    ingest_ray([src], engine_config(clean), 2, **KW)

    def open_and_close() -> None:
        ShardedEngine(engine_config(resumed), shards=2).close()

    again = _stopped_then_rerun(resumed, src, len(rows) // 2, open_and_close)
    assert again["accepted"] == len(rows) // 2 and again["pending"] == 0
    assert [n for n, _ in _keyword_state(resumed, 2)] == [len(rows), len(rows)]
    assert _keyword_state(resumed, 2) == _keyword_state(clean, 2)


# ====================================================================== a shared store's count
@needs_pg
def test_another_shard_count_on_postgres_is_refused_before_ray(monkeypatch, tmp_path):
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("Ray was started before the store was checked")

    monkeypatch.setattr(ray_ingest, "ensure_ray", refuse)
    src = write_chats(tmp_path / "chats.jsonl", conversation(users=3, per_user=2))
    url = store_for("postgres", tmp_path)
    prepare_layout(url, 2)  # as `ingest --ray --shards 2` records it
    with pytest.raises(ValueError, match="holds 2 shards"):
        ingest_ray([src], engine_config(url), 3)
    res = cli("ingest", str(src), "--ray", "--shards", "3", "--store", url, "--no-progress")
    assert res.exit_code == 2 and "holds 2 shards" in res.output, res.output


# ====================================================================== stop signals
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_ends_the_run_with_its_report(ray_local, tmp_path, sig):
    """The signal (sent to this process after the first window) stops the run: no further
    window, no derived work, the report says so with exit 128 + the signal, and the handlers
    found before are back. A re-run does the rest."""
    signum = int(getattr(signal, sig))
    rows = conversation(users=4, per_user=8)  # 4 pages a user in the first half: STM is 3
    src = write_chats(tmp_path / "chats.jsonl", rows)
    store = str(tmp_path / "s")
    before = signal.getsignal(signum)

    def send(n: int, report: Any) -> None:
        if n == 0:
            os.kill(os.getpid(), signum)

    half = len(rows) // 2
    rep = ingest_ray([src], engine_config(store), 2, window=half, on_window=send, **KW)
    assert rep["interrupted"] and rep["stop_signal"] == signum
    assert rep["exit_code"] == 128 + signum
    assert rep["accepted"] == half and rep["pending"] > 0  # the derived work waits
    assert rep["ray"]["derived"] == {}
    assert signal.getsignal(signum) == before
    _wait_released(store, 2)
    again = ingest_ray([src], engine_config(store), 2, **KW)
    assert (again["accepted"], again["skipped"], again["pending"]) == (half, half, 0)
    assert not again["interrupted"] and again["exit_code"] == 0


def test_cli_ingest_ray_on_sigterm_prints_its_report_and_exits_143(
    ray_local, monkeypatch, tmp_path
):
    rows = conversation(users=4, per_user=4)
    src = write_chats(tmp_path / "chats.jsonl", rows)
    store = str(tmp_path / "s")
    window = ray_ingest._run_window

    def then_sigterm(*args: Any, **kw: Any) -> Any:
        out = window(*args, **kw)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # repeated: no abort (was: KeyboardInterrupt)
        return out

    monkeypatch.setattr(ray_ingest, "_run_window", then_sigterm)
    args = ["ingest", str(src), "--ray", "--shards", "2", "--store", store, "--no-progress"]
    res = cli(*args, "--json")
    assert res.exit_code == 143, res.output
    report = json.loads(res.output.strip().splitlines()[-1])
    assert report["interrupted"] and report["exit_code"] == 143
    assert report["accepted"] == len(rows) and report["ray"]["derived"] == {}
    assert "SIGTERM: finishing the chunks in flight" in res.output
    assert res.output.count("SIGTERM:") == 1  # the repeat changed nothing

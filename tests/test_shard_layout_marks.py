"""Sharded stores without Ray: the keyword statistics a shard counts when it opens, the shard
count a PostgreSQL store records, and how a shard actor of ``ingest --ray`` stops.

* An ``ingest --ray`` stopped before its keyword exchange leaves pages that no other shard
  counts; a :class:`ShardedEngine` opened then catches up on them (was: each shard counted
  its own pages only, then saved its statistics as if exchanged, so a re-run never sent them).
* A shard of a shared (PostgreSQL) store refits its statistics from its own users' pages (was:
  from every shard's, which the exchange then added again).
* A PostgreSQL store records its shard count and refuses another one, as a sharded directory
  does (was: any count, with statistics counted again under the new count's keys).

SQLite always; PostgreSQL too when ``MEMORYOS_GPU_TEST_PG_URL`` is set.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
from test_distributed import BACKENDS, PG_URL, conversation, engine_config, store_for

from memoryos_gpu.cli.stores import ray_shards, store_shards
from memoryos_gpu.distributed.exchange import EXCHANGE_MARKS
from memoryos_gpu.distributed.layout import LAYOUT_KEY, check_layout, prepare_layout, shard_store
from memoryos_gpu.distributed.sharding import ShardedEngine, ShardEngine
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.ingest import shard_of
from memoryos_gpu.store import open_store
from memoryos_gpu.types import PageInput

needs_pg = pytest.mark.skipif(not PG_URL, reason="MEMORYOS_GPU_TEST_PG_URL is not set")
KEY = "keyword_extractor"


def pages(rows: list[dict[str, Any]]) -> list[PageInput]:
    return [PageInput(**r) for r in rows]


def own(rows: list[dict[str, Any]], shard: int, count: int = 2) -> list[dict[str, Any]]:
    return [r for r in rows if shard_of(r["user_id"], count) == shard]


def keyword_state(engine: Any) -> tuple[int, dict[str, int]]:
    return engine.extractor.n_docs, dict(engine.extractor.df)


def one_engine_state(rows: list[dict[str, Any]], tmp_path: Any) -> tuple[int, dict[str, int]]:
    """The statistics of one engine holding every page: what every shard must count."""
    with MemoryEngine(engine_config(str(tmp_path / "one"), auto_process=False)) as one:
        one.add_many(pages(rows))
        return keyword_state(one)


def drop_saved_keywords(store: str, count: int) -> None:
    """Leave the shards' stores as an ``ingest --ray`` stopped before its keyword exchange
    leaves a new store: pages committed, no statistics saved."""
    for i in range(count):
        st = open_store(shard_store(store, i, count))
        try:
            with st.transaction() as db:
                db.execute("DELETE FROM meta WHERE key LIKE ?", (f"{KEY}%",))
        finally:
            st.close()


def commit_unexchanged(store: str, rows: list[dict[str, Any]], count: int = 2) -> None:
    """Each shard commits its users' pages, with no exchange and no derived work (a shard
    actor of ``ingest --ray`` until the run was stopped)."""
    prepare_layout(store, count)
    for i in range(count):
        cfg = engine_config(shard_store(store, i, count))
        with ShardEngine(cfg, shard=i, count=count, hold_pending=True) as e:
            e.accept_many(pages(own(rows, i, count)))
    drop_saved_keywords(store, count)


# ====================================================================== keyword statistics
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sharded_engine_counts_the_pages_no_exchange_gave_it(backend, tmp_path):
    """Opened on the pages of a stopped ``ingest --ray``, every shard counts every page, as
    one engine does, and saves them with marks that say so; reopened, nothing is counted
    twice (SQLite was: each shard its own pages only, for good)."""
    rows = conversation(users=6, per_user=5)
    store = store_for(backend, tmp_path)
    commit_unexchanged(store, rows)
    want = one_engine_state(rows, tmp_path)
    with ShardedEngine(engine_config(store), shards=2) as sharded:
        assert [keyword_state(e) for e in sharded.engines] == [want, want]
        tops = [e.page_watermark() for e in sharded.engines]
        marks = [e.exchange_marks(tops) for e in sharded.engines]
        assert marks == [tops, tops]  # saved with the statistics by the catch-up
        assert sharded.pending_count() == 0  # the work owed ran, after the catch-up
    with ShardedEngine(engine_config(store), shards=2) as sharded:
        assert [keyword_state(e) for e in sharded.engines] == [want, want]


@needs_pg
def test_a_shard_of_a_shared_store_refits_from_its_own_pages(tmp_path):
    """No statistics saved: a shard's open counts its users' pages, not every shard's (was:
    every shard's; the exchange then added the other shards' pages a second time)."""
    rows = conversation(users=6, per_user=4)
    store = store_for("postgres", tmp_path)
    commit_unexchanged(store, rows)
    for i in range(2):
        with ShardEngine(engine_config(store), shard=i, count=2, hold_pending=True) as e:
            assert e.extractor.n_docs == len(own(rows, i)) < len(rows)


def test_saved_marks_survive_and_an_engine_save_means_fully_exchanged(tmp_path):
    """The marks an exchange saves are read back as saved; statistics an engine saved last
    (no marks: it saves after its exchanges) count every page there is, and get those marks."""
    store = str(tmp_path / "s")
    prepare_layout(store, 2)
    with ShardEngine(engine_config(shard_store(store, 0, 2)), shard=0, count=2) as e:
        assert e.exchange_marks([5, 7]) == [0, 0]  # nothing saved: counts no other page
        e.save_keywords([3, 4])
        assert e.exchange_marks([5, 7]) == [3, 4]
    # closed: the engine saved its statistics itself, without marks
    with ShardEngine(engine_config(shard_store(store, 0, 2)), shard=0, count=2) as e:
        assert e.exchange_marks([5, 7]) == [5, 7]
        saved = json.loads(e.store.get_meta(KEY))
        assert saved[EXCHANGE_MARKS] == {"count": 2, "through": [5, 7]}


# ====================================================================== a shared store's count
@needs_pg
def test_a_postgres_store_records_its_shard_count_and_refuses_another(tmp_path):
    url = store_for("postgres", tmp_path)
    assert check_layout(url, 3) is True  # nothing recorded yet
    assert ray_shards(url, None) == 2 and store_shards(url) == 1
    with ShardedEngine(engine_config(url), shards=2) as sharded:
        sharded.add_many(pages(conversation(users=4, per_user=2)))
    st = open_store(url)
    try:
        assert json.loads(st.get_meta(LAYOUT_KEY))["count"] == 2
    finally:
        st.close()
    assert check_layout(url, 2) is False
    for refused in (lambda: check_layout(url, 3), lambda: prepare_layout(url, 3)):
        with pytest.raises(ValueError, match="holds 2 shards; users are placed by hash mod"):
            refused()
    with pytest.raises(ValueError, match="holds 2 shards"):
        ShardedEngine(engine_config(url), shards=3)
    assert ray_shards(url, None) == 2 and store_shards(url) == 2
    assert ray_shards(url, 4) == 4  # given: checked where the store is opened


@needs_pg
def test_a_postgres_store_sharded_before_counts_were_recorded_keeps_its_count(tmp_path):
    """A store whose shards saved statistics before the count was recorded: its count is the
    one their keys name (the password, if any, is not in the message)."""
    url = store_for("postgres", tmp_path)
    st = open_store(url)
    try:
        for i in range(2):
            st.set_meta(f"{KEY}@shard-{i}-of-2", "{}")
    finally:
        st.close()
    with pytest.raises(ValueError, match="holds 2 shards"):
        check_layout(url, 3)
    assert ray_shards(url, None) == 2
    prepare_layout(url, 2)  # recorded now
    st = open_store(url)
    try:
        assert json.loads(st.get_meta(LAYOUT_KEY))["count"] == 2
    finally:
        st.close()


# ====================================================================== stopping a shard actor
def test_a_stopped_shard_actor_sends_chunks_back_undone(tmp_path):
    """After ``stop`` (the driver got SIGINT, SIGTERM or SIGHUP), chunks are not committed but
    answered ``unsent``, which the report does not count; the chunk in flight was committed."""
    from memoryos_gpu.distributed.ray_ingest import ShardIngestActor, _records, _Tally

    rows = conversation(users=1, per_user=4)
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    chunk = [r for r in _records({str(src): "jsonl"}, 1, 1) if isinstance(r, dict)]
    store = str(tmp_path / "s")
    prepare_layout(store, 1)
    actor = ShardIngestActor(engine_config(shard_store(store, 0, 1)).model_dump(), 0, 1)
    try:
        first = actor.ingest(chunk[:2], 0)
        actor.stop()
        rest = actor.ingest(chunk[2:], 0)
        assert [o["status"] for o in first + rest] == ["accepted"] * 2 + ["unsent"] * 2
        assert actor.engine.page_watermark() > 0
        assert len(actor.engine.export_user(rows[0]["user_id"])["pages"]) == 2
    finally:
        actor.close()
    tally = _Tally(1)
    tally.add(first + rest)
    assert (tally.total("accepted"), tally.total("unsent"), len(tally.users[0])) == (2, 0, 1)


def test_the_driver_stops_on_the_first_signal_and_aborts_on_a_second_ctrl_c():
    """``ingest --ray``'s handler, by the rule of every ingest (memoryos_gpu/stop_signals.py):
    the first signal asks for a stop (and says so), a repeated SIGTERM or SIGHUP changes
    nothing, a second Ctrl-C aborts; the handlers found before are given back (was: any
    second signal aborted)."""
    from memoryos_gpu.distributed.ray_ingest import _Stop

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    stop = _Stop()
    stop.install()
    stop.install()  # twice (around ray.init): what is restored is still what was there
    try:
        assert signal.getsignal(signal.SIGHUP) == stop.handle
        stop.handle(signal.SIGHUP, None)
        assert stop.stopped and stop.signum == signal.SIGHUP
        stop.handle(signal.SIGTERM, None)  # ignored: still the graceful stop
        stop.handle(signal.SIGHUP, None)
        assert stop.stopped and stop.signum == signal.SIGHUP
        with pytest.raises(KeyboardInterrupt):
            stop.handle(signal.SIGINT, None)
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in before} == before

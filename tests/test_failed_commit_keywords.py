"""The keyword statistics (IDF) count committed pages only, once each.

Accepting a batch teaches the statistics its texts before the COMMIT; when a statement after
that or the COMMIT itself fails (a full disk), the batch is rolled back and must leave the
statistics as they were. Otherwise ``close`` saves them with the newest committed page id as
watermark, the next open trusts that copy, and the batch, accepted again, counts twice: the
keywords of pages, segments and knowledge then differ from an ingestion that never failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_write_transaction import _free_space

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store import StoreFullError

WORDS = ["violin", "harbor", "quartz", "lantern", "meadow", "falcon", "copper", "saffron"]


def _batch(k: int) -> list[dict[str, Any]]:
    """Batch ``k``: pages whose words differ between batches (distinct document frequencies)."""
    return [
        {
            "user_id": f"u{i % 2}",
            "user_input": f"{WORDS[(k + i) % len(WORDS)]} Batch{k} item{i} {WORDS[k]}",
            "agent_response": f"noted {WORDS[(k * 3 + i) % len(WORDS)]} number {k * 10 + i}",
            "source": f"b{k}-{i}",
        }
        for i in range(6)
    ]


def _open(store: Path) -> MemoryEngine:
    return MemoryEngine(EngineConfig(store=str(store), embedder="hashing", auto_process=False))


def _statistics(store: Path, batches: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An uninterrupted run's keyword statistics after ``batches``: in memory, and reopened."""
    with _open(store) as engine:
        for k in batches:
            engine.add_many(_batch(k))
        live = engine.extractor.to_dict()
    with _open(store) as engine:
        return live, engine.extractor.to_dict()


class FailingCommit:
    """The store's connection, with the next COMMIT failing as a full disk's does."""

    def __init__(self, db: Any) -> None:
        self._db = db
        self.armed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT" and self.armed:
            self.armed = False
            raise StoreFullError("database or disk is full (simulated at COMMIT)")
        return self._db.execute(sql, *args)


def _fail_commit(engine: MemoryEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.store, "_db", FailingCommit(engine.store._db))


def _fail_after_learning(engine: MemoryEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The statement-side step after the keyword statistics learned the batch fails once."""
    vocabulary = engine._state.vocabulary
    add = vocabulary.add

    def failing_add(*args: Any, **kw: Any) -> None:
        monkeypatch.setattr(vocabulary, "add", add)
        raise StoreFullError("database or disk is full (simulated after the learning)")

    monkeypatch.setattr(vocabulary, "add", failing_add)


@pytest.mark.parametrize("fail", [_fail_commit, _fail_after_learning], ids=["commit", "body"])
def test_a_rolled_back_batch_leaves_the_keyword_statistics_as_if_never_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: Any
) -> None:
    committed_live, committed_reopened = _statistics(tmp_path / "ref-ac", [0, 2])
    whole_live, whole_reopened = _statistics(tmp_path / "ref-abc", [0, 1, 2])
    assert committed_live != whole_live  # the batch that fails changes the statistics
    store = tmp_path / "store"
    with _open(store) as engine:
        engine.add_many(_batch(0))
        before = engine.extractor.to_dict()
        fail(engine, monkeypatch)
        with pytest.raises(StoreFullError):
            engine.add_many(_batch(1))
        monkeypatch.undo()
        _free_space(monkeypatch)  # a full disk's writes wait for room (full_disk.py)
        assert engine.store.query("SELECT COUNT(*) FROM pages")[0][0] == 6  # rolled back
        assert engine.extractor.to_dict() == before
        engine.add_many(_batch(2))
        assert engine.extractor.to_dict() == committed_live
    with _open(store) as engine:  # the copy close saved, refitted on open
        assert engine.extractor.to_dict() == committed_reopened == committed_live
        engine.add_many(_batch(1))  # the failed batch, resumed
        assert engine.extractor.to_dict() == whole_live
    with _open(store) as engine:
        assert engine.extractor.to_dict() == whole_reopened == whole_live


def test_a_shard_sends_no_rolled_back_text_to_the_other_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard engine keeps the texts it learned for its next exchange with the other shards;
    a rolled-back batch's leave that list too, or the other shards would count pages that
    were never stored (and count them again when the batch is resumed)."""
    from memoryos_gpu.distributed.sharding import ShardEngine

    cfg = EngineConfig(store=str(tmp_path / "shard"), embedder="hashing", auto_process=False)
    engine = ShardEngine(cfg)
    try:
        engine.add_many(_batch(0))
        _fail_commit(engine, monkeypatch)
        with pytest.raises(StoreFullError):
            engine.add_many(_batch(1))
        monkeypatch.undo()
        _free_space(monkeypatch)
        engine.add_many(_batch(2))
        assert sorted(engine._kw_texts) == sorted(
            f"{p['user_input']} {p['agent_response']}" for k in (0, 2) for p in _batch(k)
        )
    finally:
        engine.close()

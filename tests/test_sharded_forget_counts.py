"""Deleting a user from a sharded store un-counts its pages' texts only from the other shards'
keyword statistics that were given them by the keyword exchange (D8): ``ingest --workers``
shards never exchange, so a delete leaves the other shards' statistics as they were; a
:class:`ShardedEngine` store exchanged them, and they are un-counted (through the exchange
marks, when the statistics were saved with some)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from memoryos_gpu.cli import cli
from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.exchange import EXCHANGE_MARKS
from memoryos_gpu.distributed.layout import ShardMap
from memoryos_gpu.distributed.sharding import ShardedEngine

M = ShardMap(2)
NAMES = [f"u{i}" for i in range(40)]
ON = {s: [u for u in NAMES if M.shard(u) == s] for s in (0, 1)}
SAVED = "SELECT value FROM meta WHERE key = 'keyword_extractor'"


def rows(users: list[str], per: int = 5) -> list[dict]:
    return [
        {
            "user_id": u,
            "user_input": f"I play the guitar and talk about topic{k} with {u}.",
            "agent_response": "Nice.",
            "timestamp": 1.7e9 + 60 * k,
        }
        for u in users
        for k in range(per)
    ]


def saved_stats(store: str, shard: int) -> tuple[int, dict, int]:
    """(pages, saved statistics, the saved statistics' n_docs) of a shard's file."""
    with sqlite3.connect(Path(store) / f"shard-{shard}" / "memory.sqlite3") as db:
        pages = db.execute("SELECT COUNT(*) FROM pages").fetchone()[0]
        state = json.loads(db.execute(SAVED).fetchone()[0])
    return pages, state, int(state["n_docs"])


def delete(store: str, user: str) -> None:
    res = CliRunner().invoke(cli, ["delete", "--store", store, "--user", user, "--yes"])
    assert res.exit_code == 0, res.output


def workers_store(tmp_path: Path) -> str:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows(ON[0][:3] + ON[1][:3])))
    store = str(tmp_path / "st")
    res = CliRunner().invoke(
        cli,
        ["ingest", str(src), "--store", store, "--workers", "2", "--no-progress",
         "--embedder", "hashing", "--device", "cpu"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    return store


def test_cli_delete_leaves_a_workers_shards_statistics_alone(tmp_path: Path) -> None:
    store = workers_store(tmp_path)
    pages, before, n = saved_stats(store, 0)
    assert n == pages == 15
    delete(store, ON[1][0])
    delete(store, ON[1][1])  # again: no drift toward zero
    _pages, after, n_after = saved_stats(store, 0)
    assert n_after == pages and after["df"] == before["df"]


def test_engine_delete_leaves_a_workers_shards_statistics_alone(tmp_path: Path) -> None:
    store = workers_store(tmp_path)
    cfg = EngineConfig(store=store, embedder="hashing", device="cpu")
    with ShardedEngine(cfg, shards=2) as e:
        before = e.engines[0].extractor.to_dict()
        assert e.delete_user(ON[1][0])
        assert e.engines[0].extractor.to_dict() == before
    assert saved_stats(store, 0)[2] == 15


def engine_store(tmp_path: Path) -> str:
    store = str(tmp_path / "eng")
    cfg = EngineConfig(store=store, embedder="hashing", device="cpu")
    with ShardedEngine(cfg, shards=2) as e:
        e.add_many(rows(ON[0][:3] + ON[1][:3]))
        e.flush()
    return store


def test_cli_delete_uncounts_what_the_exchange_gave(tmp_path: Path) -> None:
    store = engine_store(tmp_path)
    pages, _state, n = saved_stats(store, 0)
    assert (pages, n) == (15, 30)  # its own pages and shard 1's, given by the exchange
    delete(store, ON[1][0])
    assert saved_stats(store, 0)[2] == 25


def test_cli_delete_uncounts_only_the_pages_through_the_exchange_mark(tmp_path: Path) -> None:
    """Statistics saved by an exchange by marks count the home shard's pages through its mark
    only (an ``ingest --ray`` stopped before its last exchange): the pages above it were never
    given, and are not un-counted."""
    store = engine_store(tmp_path)
    victim = ON[1][2]  # its pages are shard 1's last five
    with sqlite3.connect(Path(store) / "shard-1" / "memory.sqlite3") as db:
        ids = [p for (p,) in db.execute("SELECT page_id FROM pages WHERE user_id = ? "
                                        "ORDER BY page_id", (victim,))]  # fmt: skip
    path = Path(store) / "shard-0" / "memory.sqlite3"
    with sqlite3.connect(path) as db:  # as if shard 1's pages after the victim's 2nd were not given
        state = json.loads(db.execute(SAVED).fetchone()[0])
        state["n_docs"] -= 15 - ids[1]  # (ids from 1)
        state[EXCHANGE_MARKS] = {"count": 2, "through": [15, ids[1]]}
        db.execute(
            "UPDATE meta SET value = ? WHERE key = 'keyword_extractor'", (json.dumps(state),)
        )
    n = state["n_docs"]
    delete(store, victim)
    _pages, after, n_after = saved_stats(store, 0)
    assert n_after == n - 2 and after[EXCHANGE_MARKS] == state[EXCHANGE_MARKS]


def test_a_cli_delete_stopped_after_the_other_shards_is_finished_by_its_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed once every other shard had un-counted the user's pages, before its own rows
    went: the re-run still finds the user, deletes it, and un-counts nothing twice."""
    from memoryos_gpu.distributed import sharded_forget

    store = engine_store(tmp_path)
    victim = ON[1][0]
    real = sharded_forget.forget_in_stores

    def then_killed(*args: object, **kw: object) -> int:
        real(*args, **kw)
        raise RuntimeError("killed")

    monkeypatch.setattr(sharded_forget, "forget_in_stores", then_killed)
    res = CliRunner().invoke(cli, ["delete", "--store", store, "--user", victim, "--yes"])
    assert res.exit_code != 0 and saved_stats(store, 0)[2] == 25
    monkeypatch.setattr(sharded_forget, "forget_in_stores", real)
    delete(store, victim)
    assert saved_stats(store, 0)[2] == 25  # once, not 20
    with sqlite3.connect(Path(store) / "shard-1" / "memory.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM pages WHERE user_id = ?", (victim,)).fetchone() == (
            0,
        )
    delete(store, ON[1][1])  # another user's pages still un-count
    assert saved_stats(store, 0)[2] == 20

"""``serve --engines`` and ``serve --ray`` catch up on the keyword statistics no exchange gave
their shards, as a :class:`ShardedEngine` does on open.

A store left by an ``ingest --ray`` stopped before its keyword exchange holds pages that only
their own shard counts. A :class:`ShardedEngine` opened on it catches up on them
(tests/test_shard_layout_marks.py); the shards of ``serve --engines`` (engine processes behind
the workers' router) and of ``serve --ray`` (Serve replicas behind the ingress) did not: each
counted its own pages only, then saved its statistics as if exchanged, so nothing ever sent
the others' pages again (2 shards, 30 pages: 15 and 15 documents instead of 30, for good). Now
the router's first sync catches up (:func:`~memoryos_gpu.distributed.exchange.catch_up_rounds`,
the exchange by marks a :class:`ShardedEngine` runs on open), and pages accepted meanwhile are
counted once.

Both in one process, without Ray: the engine processes' ZeroMQ servers and the workers' router
in one event loop (as tests/test_serve_engines.py), and the Serve router over the shard
replicas' classes called directly instead of through Serve handles. SQLite, and PostgreSQL
when ``MEMORYOS_GPU_TEST_PG_URL`` is set.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest
from test_distributed import BACKENDS, conversation, engine_config, store_for
from test_shard_layout_marks import commit_unexchanged, keyword_state, one_engine_state, own, pages

from memoryos_gpu.distributed.sharding import ShardedEngine
from memoryos_gpu.server.settings import ServerSettings

pytest.importorskip("zmq")


def _reopened(store: str) -> list[tuple[int, dict[str, int]]]:
    """Each shard's keyword statistics as a :class:`ShardedEngine` opens them (it catches up
    itself only on pages its shards' saved marks do not cover)."""
    with ShardedEngine(engine_config(store), shards=2) as sharded:
        return [keyword_state(e) for e in sharded.engines]


def _store_with_unexchanged_pages(backend: str, tmp_path: Any) -> tuple[str, list, list]:
    rows = conversation(users=6, per_user=5)
    store = store_for(backend, tmp_path)
    commit_unexchanged(store, rows[:20])
    return store, rows[:20], rows[20:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_serve_engines_shards_catch_up_on_open(backend, tmp_path):
    """The engines of ``serve --engines`` count the pages an interrupted ``ingest --ray`` left
    after the router's first sync, as one engine does, pages added meanwhile once."""
    from tests.test_serve_engines import _sharded

    store, before, after = _store_with_unexchanged_pages(backend, tmp_path)
    want = one_engine_state(before + after, tmp_path)

    async def go() -> None:
        async with _sharded(tmp_path, store) as service:
            await service.add_pages(pages(after))  # accepted before the first sync
            await service.router.sync()

    asyncio.run(go())
    assert _reopened(store) == [want, want]


class _Handle:
    """A Serve deployment handle over a replica in this process: ``handle.m.remote(*a)``."""

    def __init__(self, replica: Any) -> None:
        self._replica = replica

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._replica, name)
        return types.SimpleNamespace(remote=lambda *args: method(*args))


@pytest.mark.parametrize("backend", BACKENDS)
def test_serve_ray_shards_catch_up_on_open(backend, tmp_path):
    """The shard replicas of ``serve --ray`` count the pages an interrupted ``ingest --ray``
    left after the router's first sync, pages added meanwhile once; the orderly end saves
    them (reopened: the same statistics)."""
    from memoryos_gpu.distributed.layout import prepare_layout, shard_store
    from memoryos_gpu.distributed.ray_serve import RouterService, ShardReplica

    store, before, after = _store_with_unexchanged_pages(backend, tmp_path)
    want = one_engine_state(before + after, tmp_path)
    prepare_layout(store, 2)
    config = engine_config(store)

    async def go() -> None:
        class Replica(ShardReplica):
            def __del__(self) -> None:  # Serve's (async) shutdown hook: finish_shards closes
                pass

        replicas = [
            Replica(
                config.model_copy(update={"store": shard_store(store, i, 2)}).model_dump(),
                i,
                2,
                ServerSettings().model_dump(),
            )
            for i in range(2)
        ]
        router = RouterService([_Handle(r) for r in replicas], config, sync_interval_s=None)
        await router.start(wait=True)
        try:
            await router.add_pages(pages(after))
            await router.sync()
            assert [keyword_state(r.service.engine) for r in replicas] == [want, want]
        finally:
            await router.finish_shards()

    asyncio.run(go())
    assert _reopened(store) == [want, want]


def test_a_catch_up_meanwhile_writes_counts_every_page_once(tmp_path):
    """What a router's catch-up relies on: it reaches the pages each shard held when it opened
    (those accepted since travel by deltas, once), and a second one, after an exchange by
    deltas, adds nothing (a late router's catch-up, or a repeated one)."""
    from memoryos_gpu.distributed.exchange import catch_up_keywords, exchange_keywords
    from memoryos_gpu.distributed.layout import shard_store
    from memoryos_gpu.distributed.sharding import ShardEngine

    store, before, after = _store_with_unexchanged_pages("sqlite", tmp_path)
    want = one_engine_state(before + after, tmp_path)
    engines = [
        ShardEngine(engine_config(shard_store(store, i, 2)), shard=i, count=2, hold_pending=True)
        for i in range(2)
    ]
    try:
        for i, e in enumerate(engines):  # accepted after the open, before the catch-up
            e.accept_many(pages(own(after, i)))
        assert catch_up_keywords(engines) == len(before)
        exchange_keywords(
            [e.take_keyword_delta for e in engines], [e.apply_keyword_delta for e in engines]
        )
        assert [keyword_state(e) for e in engines] == [want, want]
        assert catch_up_keywords(engines) == 0
        assert [keyword_state(e) for e in engines] == [want, want]
    finally:
        for e in engines:
            e.close()
    assert _reopened(store) == [want, want]

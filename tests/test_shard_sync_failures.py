"""A sync of ``serve --ray`` / ``serve --engines`` whose call to one shard fails (its engine
restarting) loses no shard's keyword statistics.

A sync takes each shard's keyword delta (the texts it accepted since the last one, which the
shard then forgets) and adds it on every other shard. When the call adding it on one shard
failed, that shard never counted those pages: its IDF stayed short of them for good, while
the shards that were up counted them. The router now keeps what a shard is owed and sends it
with the next sync (:meth:`RouterService._add_owed`).

The Serve router runs over the shard replicas' classes called in process (as
tests/test_shard_catch_up_serve.py does), with one replica's call failing on purpose.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest
from test_distributed import conversation, engine_config, store_for
from test_shard_layout_marks import keyword_state, one_engine_state, pages

from memoryos_gpu.server.settings import ServerSettings

pytest.importorskip("zmq")


class _Handle:
    """A Serve handle over a replica in this process; ``fail`` names engine methods whose
    next ``call`` fails (as when the shard's engine is restarting)."""

    def __init__(self, replica: Any) -> None:
        self._replica = replica
        self.fail: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._replica, name)

        async def remote(*args: Any) -> Any:
            if name == "call" and args[0] in self.fail:
                self.fail.discard(args[0])
                raise ConnectionError(f"shard down during {args[0]}")
            return await method(*args)

        return types.SimpleNamespace(remote=remote)


def _replicas(store: str) -> list[Any]:
    from memoryos_gpu.distributed.layout import prepare_layout, shard_store
    from memoryos_gpu.distributed.ray_serve import ShardReplica

    class Replica(ShardReplica):
        def __del__(self) -> None:  # Serve's (async) shutdown hook: finish_shards closes
            pass

    prepare_layout(store, 2)
    config = engine_config(store)
    return [
        Replica(
            config.model_copy(update={"store": shard_store(store, i, 2)}).model_dump(),
            i,
            2,
            ServerSettings().model_dump(),
        )
        for i in range(2)
    ]


@pytest.mark.parametrize(("failing", "short"), [("apply_keyword_delta", 1), ("take_sync", 0)])
def test_a_shard_missed_by_a_sync_gets_its_keyword_statistics_at_the_next(tmp_path, failing, short):
    """``apply_keyword_delta`` failing on shard 1: shard 0's delta reaches it with the next
    sync (shard 1 is short of it meanwhile). ``take_sync`` failing on shard 1: shard 1 keeps
    its texts for the next sync (shard 0 is short of them meanwhile) and still gets shard 0's
    delta. Either way every shard ends with the statistics of one engine holding every
    page."""
    from memoryos_gpu.distributed.ray_serve import RouterService

    rows = conversation(users=6, per_user=4)
    store = store_for("sqlite", tmp_path)
    want = one_engine_state(rows, tmp_path)
    replicas = _replicas(store)
    handles = [_Handle(r) for r in replicas]

    async def go() -> None:
        router = RouterService(handles, engine_config(store), sync_interval_s=None)
        await router.start(wait=True)
        try:
            await router.add_pages(pages(rows))
            handles[1].fail.add(failing)
            with pytest.raises(ConnectionError, match="shard down"):
                await router.sync()
            states = [keyword_state(r.service.engine) for r in replicas]
            assert states[short] != want and states[1 - short] == want
            await router.sync()
            assert [keyword_state(r.service.engine) for r in replicas] == [want, want]
            await router.sync()  # nothing owed twice
            assert [keyword_state(r.service.engine) for r in replicas] == [want, want]
        finally:
            await router.finish_shards()

    asyncio.run(go())

"""A sync of ``serve --ray`` / ``serve --engines`` whose call to one shard fails (its engine
restarting) loses no shard's keyword statistics and no assistant fact.

A sync takes each shard's keyword delta (the texts it accepted since the last one, which the
shard then forgets) and adds it on every other shard. When the call adding it on one shard
failed, that shard never counted those pages: its IDF stayed short of them for good, while
the shards that were up counted them. The router now keeps what a shard is owed and sends it
with the next sync (:meth:`RouterService._add_owed`). Assistant facts taken from a shard's
outbox were lost the same way when their owner's commit or a replica's copy failed: a fact
now stays in its shard's outbox, in the store, until its owner committed it (a router or a
shard that stops loses none), the owner lands a fact sent twice once, and a replica's entries
stay owed (:meth:`RouterService._route_facts`); a change across shards delivers those before it
forgets what a user's pages taught.

The Serve router runs over the shard replicas' classes called in process (as
tests/test_shard_catch_up_serve.py does), with one replica's call failing on purpose.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from test_distributed import conversation, engine_config, store_for
from test_shard_layout_marks import keyword_state, one_engine_state, pages

from memoryos_gpu.server.settings import ServerSettings

pytest.importorskip("zmq")


class _Handle:
    """A Serve handle over a replica in this process; ``fail`` names engine methods whose
    next ``call`` fails (as when the shard's engine is restarting), ``fail_after`` those whose
    next ``call`` runs but whose reply is lost."""

    def __init__(self, replica: Any) -> None:
        self._replica = replica
        self.fail: set[str] = set()
        self.fail_after: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._replica, name)

        async def remote(*args: Any) -> Any:
            if name == "call" and args[0] in self.fail:
                self.fail.discard(args[0])
                raise ConnectionError(f"shard down during {args[0]}")
            out = await method(*args)
            if name == "call" and args[0] in self.fail_after:
                self.fail_after.discard(args[0])
                raise ConnectionError(f"reply lost after {args[0]}")
            return out

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


# ------------------------------------------------------------------------- assistant facts
def _entries(replica: Any) -> list[tuple[str, int, str, int]]:
    """A shard's assistant ring rows (assistant, seq, text, live), as its store holds them."""
    return [
        tuple(r)
        for r in replica.service.engine.store.query(
            "SELECT owner_id, seq, text, live FROM knowledge WHERE owner_kind = 'assistant' "
            "ORDER BY owner_id, seq"
        )
    ]


@dataclass
class _Facts:
    """A router over two in-process shard replicas after a conversation, with one assistant
    fact in the outbox of a user's shard for an assistant the other shard owns (as a
    promotion puts it there)."""

    router: Any
    replicas: list[Any]
    handles: list[_Handle]
    owner: int  # the assistant's owner shard
    text: str  # the fact
    user: str  # whose page taught it


def _with_a_fact(tmp_path: Any, scenario: Callable[[_Facts], Awaitable[None]]) -> None:
    """Run ``scenario`` on a :class:`_Facts` set up in ``tmp_path``; the shards finish after."""
    from memoryos_gpu.distributed.ray_serve import RouterService

    store = store_for("sqlite", tmp_path)
    replicas = _replicas(store)
    handles = [_Handle(r) for r in replicas]

    async def go() -> None:
        router = RouterService(handles, engine_config(store), sync_interval_s=None)
        await router.start(wait=True)
        try:
            owner, user, text = await _a_fact_in_an_outbox(router, replicas)
            await scenario(_Facts(router, replicas, handles, owner, text, user))
        finally:
            await router.finish_shards()

    asyncio.run(go())


async def _a_fact_in_an_outbox(router: Any, replicas: list[Any]) -> tuple[int, str, str]:
    """A conversation through ``router``, then one fact for ``asst-0`` in the outbox of a
    user whose shard does not own it, as a promotion puts it there: (owner, user, text)."""
    from memoryos_gpu.engine.state import Fact

    rows = conversation(users=6, per_user=4)
    await router.add_pages(pages(rows))
    owner = router.shard_map.assistant_owner("asst-0")
    user = next(
        r["user_id"]
        for r in rows
        if r["assistant_id"] == "asst-0" and router.shard_map.shard(r["user_id"]) != owner
    )
    engine = replicas[router.shard_map.shard(user)].service.engine
    page = engine.export_user(user)["pages"][0]
    text = f"the assistant helped {user} with hiking"
    fact = Fact("assistant", "asst-0", text, "llm", (page["page_id"],), user, page["timestamp"])
    with engine._state.locked(), engine._state.write_transaction("commit") as db:
        engine._push_knowledge(db, [fact], np.zeros((1, engine.embedder.dim)))
    return owner, user, text


@pytest.mark.parametrize("failing", ["append_assistant_facts", "replicate_assistant_entries"])
def test_an_assistant_fact_missed_by_a_sync_reaches_every_shard_at_the_next(tmp_path, failing):
    """The owner's commit failing: the router keeps the fact and sends it with the next sync
    (it was lost: the outbox had given it up). A replica's copy failing: the entries stay
    owed to that replica. Either way both shards end with one row of the fact, once."""

    async def scenario(f: _Facts) -> None:
        f.handles[f.owner if failing == "append_assistant_facts" else 1 - f.owner].fail.add(failing)
        with pytest.raises(ConnectionError, match="shard down"):
            await f.router.sync()
        await f.router.sync()
        await f.router.sync()  # nothing owed twice
        for r in f.replicas:
            assert [e[2:] for e in _entries(r)] == [(f.text, 1)]

    _with_a_fact(tmp_path, scenario)


def test_a_copy_sent_again_after_a_lost_reply_is_held_once(tmp_path):
    """A replica that copied the entries but whose reply was lost gets them again with the
    next sync: it skips what it holds (a second row of one ring position failed every later
    copy with a UNIQUE constraint error)."""

    async def scenario(f: _Facts) -> None:
        f.handles[1 - f.owner].fail_after.add("replicate_assistant_entries")
        with pytest.raises(ConnectionError, match="reply lost"):
            await f.router.sync()
        await f.router.sync()
        assert [e[2:] for e in _entries(f.replicas[1 - f.owner])] == [(f.text, 1)]
        assert _entries(f.replicas[1 - f.owner]) == _entries(f.replicas[f.owner])

    _with_a_fact(tmp_path, scenario)


def test_deleting_a_user_whose_fact_is_owed_leaves_no_trace_of_it(tmp_path):
    """A fact owed to its owner (its commit failed) is delivered before the user's deletion
    forgets what the user taught: delivered after it, it would bring the fact back."""

    async def scenario(f: _Facts) -> None:
        f.handles[f.owner].fail.add("append_assistant_facts")
        with pytest.raises(ConnectionError, match="shard down"):
            await f.router.sync()
        assert await f.router.delete_user(f.user)
        await f.router.sync()
        for r in f.replicas:
            assert not [e for e in _entries(r) if e[2] == f.text and e[3]]

    _with_a_fact(tmp_path, scenario)


def test_a_commit_whose_reply_was_lost_lands_once_and_reaches_the_replica(tmp_path):
    """The owner committed the fact but the router never heard so: the next sync sends it
    again, and the owner commits it once (it had two rows: the router kept the fact owed and
    the owner numbered it again), answering its ring so the replica gets the entry."""

    async def scenario(f: _Facts) -> None:
        f.handles[f.owner].fail_after.add("append_assistant_facts")
        with pytest.raises(ConnectionError, match="reply lost"):
            await f.router.sync()
        await f.router.sync()
        await f.router.sync()
        for r in f.replicas:
            assert [e[2:] for e in _entries(r)] == [(f.text, 1)]

    _with_a_fact(tmp_path, scenario)


def test_a_fact_stays_in_the_outbox_until_its_sender_hears_it_landed(tmp_path):
    """The acknowledgement to the fact's shard failing: the fact stays in its outbox (the
    store), is sent again with the next sync, lands once, and only then leaves the outbox."""

    async def scenario(f: _Facts) -> None:
        sender = f.router.shard_map.shard(f.user)
        f.handles[sender].fail.add("ack_assistant_facts")
        with pytest.raises(ConnectionError, match="shard down"):
            await f.router.sync()
        engine = f.replicas[sender].service.engine
        assert [x.fact.text for x in engine.take_assistant_facts()] == [f.text]
        await f.router.sync()
        assert engine.take_assistant_facts() == []
        for r in f.replicas:
            assert [e[2:] for e in _entries(r)] == [(f.text, 1)]

    _with_a_fact(tmp_path, scenario)


def test_a_fact_outlives_the_shards_and_the_router_that_never_synced(tmp_path):
    """The fact's shard and the router stop before any sync (the fact was in the process's
    memory: lost for good, its pages marked analysed); shards opened again on the store and a
    new router deliver it, once, to both shards."""
    from memoryos_gpu.distributed.ray_serve import RouterService

    store = store_for("sqlite", tmp_path)
    text = _put_a_fact(store)
    replicas = _replicas(store)

    async def go() -> None:
        router = RouterService([_Handle(r) for r in replicas], engine_config(store), None)
        await router.start(wait=True)
        try:
            await router.sync()
            for r in replicas:
                assert [e[2:] for e in _entries(r) if e[2] == text] == [(text, 1)]
        finally:
            await router.finish_shards()

    asyncio.run(go())


def _put_a_fact(store: str) -> str:
    """:func:`_a_fact_in_an_outbox` on shards over ``store``, which then close without any
    sync (no finish, no last exchange); returns the text of the fact."""
    from memoryos_gpu.distributed.ray_serve import RouterService

    replicas = _replicas(store)

    async def go() -> str:
        router = RouterService([_Handle(r) for r in replicas], engine_config(store), None)
        await router.start(wait=True)
        _, _, text = await _a_fact_in_an_outbox(router, replicas)
        for r in replicas:
            await r.close()
        return text

    return asyncio.run(go())

"""Deleting a user, or deleting or editing one of its pages, under sharding (issue 17): the
assistant facts those pages taught, written by the assistant's owner shard and copied to every
shard, go everywhere, and a fact other pages supported too comes back from those pages
(re-analysed on their own shard). In process (ShardedEngine: the same ShardEngine methods the
Ray Serve router calls, see ``sharded_forget.py``), SQLite (one file per shard) and
PostgreSQL (one shared database) when ``MEMORYOS_GPU_TEST_PG_URL`` is set.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_distributed import BACKENDS, store_for

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.distributed.layout import ShardMap
from memoryos_gpu.distributed.sharding import ShardedEngine
from memoryos_gpu.engine import InvalidInputError
from memoryos_gpu.llm.base import ChatRequest
from memoryos_gpu.llm.scripted import ScriptedBackend

MARK = re.compile(r"zq[a-z]{6,}")
ASSISTANT = "asst"


def echo(req: ChatRequest) -> Any:
    """Every derived item names the marker words of the new pages it was derived from."""
    text = req.messages[-1]["content"].split("New pages:")[-1]
    said = " ".join(sorted(set(MARK.findall(text)))) or "plain"
    if req.stage == "page":
        return {"continuous": True, "meta": "m", "summary": f"topic {said}", "keywords": []}
    if req.stage == "promotion":
        return {
            "profile_updates": {},
            "user_facts": [f"The user said {said}."],
            "assistant_facts": [f"The assistant heard {said}."],
        }
    return "ok"


def sharded(store: str, responder: Any = echo) -> ShardedEngine:
    cfg = EngineConfig(
        store=store,
        embedder="hashing",
        device="cpu",
        memory=preset("paper", stm_capacity=2, mtm_capacity=8, tau=100.0),
        llm=LLMConfig(mode="llm", backend="scripted"),
    )
    return ShardedEngine(cfg, shards=2, llm=ScriptedBackend(responder))


def users() -> tuple[str, str, str]:
    """The deleted user on a shard that does not own the assistant, a user beside it, and a
    user on the owner shard."""
    m = ShardMap(2)
    owner = m.assistant_owner(ASSISTANT)
    names = [f"u{i}" for i in range(40)]
    away = [u for u in names if m.shard(u) != owner]
    home = [u for u in names if m.shard(u) == owner]
    return away[0], away[1], home[0]


def talk(e: ShardedEngine, user: str, lines: list[str], t0: float) -> list[int]:
    rows = [
        {
            "user_id": user,
            "user_input": line,
            "agent_response": "I see.",
            "timestamp": t0 + 60 * i,
            "assistant_id": ASSISTANT,
        }
        for i, line in enumerate(lines)
    ]
    ids = [r.page_id for r in e.add_many(rows)]
    e.flush()
    e.promote(user)
    e.flush()
    return ids


def fact_waiting(e: ShardedEngine, user: str, word: str) -> Any:
    """Pages of ``user`` naming ``word``, promoted by its shard's own round: the assistant
    fact they teach waits in that shard's outbox, not synced. Returns the shard."""
    shard = e.engine_for(user)
    shard.add_many(
        [
            {
                "user_id": user,
                "user_input": f"I keep a {word} {i} note.",
                "timestamp": 1.8e9 + 60 * i,
                "assistant_id": ASSISTANT,
            }
            for i in range(4)
        ]
    )
    shard.process_pending()
    assert shard.promote(user) >= 1
    shard.process_pending()
    return shard


def served(e: ShardedEngine, user: str) -> str:
    r = e.retrieve_many([(user, "what did the assistant hear")], update_heat=False)[0]
    return json.dumps([e.knowledge(user, history=True), [k.text for k in r.assistant_knowledge]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_delete_user_forgets_assistant_facts_everywhere(backend, tmp_path: Path) -> None:
    victim, beside, home = users()
    store = store_for(backend, tmp_path)
    e = sharded(store)
    try:
        talk(e, beside, ["I like tea.", "I swim.", "I read.", "I cook."], 1.7e9)
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        talk(e, victim, [f"I keep a zqshardsecret {i} note." for i in range(4)], 1.8e9)
        talk(e, victim, ["I walk.", "I paint.", "I bake.", "I row."], 1.9e9)  # "plain" again
        for user in (beside, home):  # both shards' rings hold the victim's facts
            assert "zqshardsecret" in served(e, user), user
        [plain] = [k for k in e.knowledge(home)["assistant"] if "plain" in k["text"]]
        assert plain["strength"] >= 2  # the victim's pages and the others' say it
        assert e.delete_user(victim)
        for user in (beside, home):
            assert "zqshardsecret" not in served(e, user), user
            assert not [k for k in e.knowledge(user)["assistant"] if "plain" in k["text"]]
        e.flush()  # the other users' pages behind the removed fact, re-analysed on their shards
        for user in (beside, home):
            again = [k for k in e.knowledge(user)["assistant"] if "plain" in k["text"]]
            assert len(again) == 1 and again[0]["source_user"] != victim, user
        # said again by both others: the pages of the user beside the victim (not on the
        # owner's shard) were re-analysed on their own shard too
        [owned] = [k for k in e.knowledge(home)["assistant"] if "plain" in k["text"]]
        assert owned["strength"] == 2 and owned["source_user"] in (beside, home)
    finally:
        e.close()
    if backend == "sqlite":  # no shard file or log holds the deleted user's word
        files = [f for f in Path(store).rglob("*") if f.is_file()]
        assert files and not [f for f in files if b"zqshardsecret" in f.read_bytes()]
    with sharded(store) as again:  # the rings after a reopen: the same
        for user in (beside, home):
            assert "zqshardsecret" not in served(again, user), user


def assistant_texts(e: ShardedEngine, user: str) -> list[str]:
    return sorted(k["text"] for k in e.knowledge(user)["assistant"])


def keyword_marks(e: ShardedEngine) -> list[list[str]]:
    """The marker words each shard's keyword statistics count."""
    return [sorted(MARK.findall(" ".join(x.extractor.df))) for x in e.engines]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_delete_page_forgets_what_it_taught_everywhere(backend, tmp_path: Path) -> None:
    """One page of a user on a shard that does not own the assistant: the assistant fact it
    taught leaves the owner and every replica; what the user's other pages of that fact say
    comes back from them (re-analysed on their shard); other facts stay."""
    victim, beside, home = users()
    store = store_for(backend, tmp_path)
    e = sharded(store)
    try:
        talk(e, beside, ["I like tea.", "I swim.", "I read.", "I cook."], 1.7e9)
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        lines = ["I keep a zqpagesecret note.", "I like zqkeepword.", "I walk.", "I bake."]
        page, *_ = talk(e, victim, lines, 1.8e9)
        both = "The assistant heard zqkeepword zqpagesecret."
        for user in (victim, beside, home):
            assert both in assistant_texts(e, user), user
        assert e.delete_page(page, user_id=beside) is False  # ids are per user's shard
        assert e.delete_page(page, user_id=victim) is True
        for user in (victim, beside, home):
            assert "zqpagesecret" not in served(e, user), user
            assert assistant_texts(e, user) == ["The assistant heard plain."], user
        assert keyword_marks(e) == [["zqkeepword"]] * 2  # every shard un-counted the page
        e.flush()  # the victim's other pages behind the removed fact, re-analysed
        for user in (victim, beside, home):
            texts = assistant_texts(e, user)
            assert texts == ["The assistant heard plain.", "The assistant heard zqkeepword."]
        assert e.delete_page(page, user_id=victim) is False
    finally:
        e.close()
    if backend == "sqlite":  # no shard file or log holds the deleted page's word
        files = [f for f in Path(store).rglob("*") if f.is_file()]
        assert files and not [f for f in files if b"zqpagesecret" in f.read_bytes()]
    with sharded(store) as again:
        for user in (victim, beside, home):
            assert "zqpagesecret" not in served(again, user), user
            assert "zqkeepword" in served(again, user), user


def test_a_deleted_pages_unrouted_facts_never_reach_the_owner(tmp_path: Path) -> None:
    """A fact of the page still in its shard's outbox (found by a round, not routed yet) goes
    with the page; the other pages it came from are re-analysed, so what they say still
    arrives."""
    victim, _, home = users()
    e = sharded(str(tmp_path / "store"))
    try:
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        lines = ["I keep a zqboxsecret note.", "I like zqboxkeep.", "I walk.", "I bake."]
        rows = [
            {"user_id": victim, "user_input": t, "timestamp": 1.8e9 + i, "assistant_id": ASSISTANT}
            for i, t in enumerate(lines)
        ]
        page = e.add_many(rows)[0].page_id
        e.flush()
        shard = e.engine_for(victim)
        assert shard.promote(victim) >= 1  # the shard's own round: the fact waits in its outbox
        assert any("zqboxsecret" in f.fact.text for f in shard.take_assistant_facts())
        assert e.delete_page(page, user_id=victim)
        assert not [f for f in shard.take_assistant_facts() if "zqboxsecret" in f.fact.text]
        e.flush()
        for user in (victim, home):
            assert "zqboxsecret" not in served(e, user), user
            assert "The assistant heard zqboxkeep." in assistant_texts(e, user), user
    finally:
        e.close()


def test_sharded_update_page_rederives_on_every_shard(tmp_path: Path) -> None:
    """An edited page: the fact of its old text leaves every shard at once, the fact of its
    new text is served everywhere after the next round; every shard's keyword statistics
    count the new text instead of the old. Bad text is refused before anything goes."""
    victim, beside, home = users()
    e = sharded(str(tmp_path / "store"))
    try:
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        page, *_ = talk(e, victim, ["I like zqoldword.", "I walk.", "I bake.", "I row."], 1.8e9)
        assert all("zqoldword" in served(e, u) for u in (victim, home))
        with pytest.raises(InvalidInputError):
            e.update_page(page, user_id=victim, user_input=7)  # type: ignore[arg-type]
        with pytest.raises(KeyError):
            e.update_page(page, user_id=beside, user_input="I like zqnewword.")
        assert all("zqoldword" in served(e, u) for u in (victim, home))
        row = e.update_page(page, user_id=victim, user_input="I like zqnewword.")
        assert row["user_input"] == "I like zqnewword." and not row["analysed"]
        for user in (victim, home):
            assert "zqoldword" not in json.dumps(assistant_texts(e, user)), user
        assert keyword_marks(e) == [["zqnewword"]] * 2
        e.flush()
        for user in (victim, home):
            assert "The assistant heard zqnewword." in assistant_texts(e, user), user
            r = e.retrieve_many([(user, "what did the assistant hear")], update_heat=False)[0]
            assert "The assistant heard zqnewword." in [k.text for k in r.assistant_knowledge]
    finally:
        e.close()


class _Remote:
    """``handle.method.remote(...)`` of a Ray Serve handle, as a coroutine."""

    def __init__(self, fn: Any) -> None:
        async def remote(*args: Any) -> Any:
            return fn(*args)

        self.remote = remote


class _ShardHandle:
    """A Serve shard replica's handle over an in-process ShardEngine: the calls the router's
    deletes and edits make (``call`` of an engine method by name, ``delete_user``)."""

    def __init__(self, engine: Any) -> None:
        self.call = _Remote(lambda name, args, kw: getattr(engine, name)(*args, **kw))
        self.delete_user = _Remote(engine.delete_user)


def test_serve_router_delete_forgets_on_every_shard(tmp_path: Path) -> None:
    """The Ray Serve router's delete runs the same steps, awaited, on the shard replicas."""
    import asyncio

    from memoryos_gpu.distributed.ray_serve import RouterService

    victim, beside, home = users()
    e = sharded(str(tmp_path / "store"))
    try:
        talk(e, beside, ["I like tea.", "I swim.", "I read.", "I cook."], 1.7e9)
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        talk(e, victim, [f"I keep a zqservesecret {i} note." for i in range(4)], 1.8e9)
        assert all("zqservesecret" in served(e, u) for u in (beside, home))
        router = RouterService([_ShardHandle(x) for x in e.engines], e.engines[0].config)
        router.state = "ready"
        assert asyncio.run(router.delete_user(victim)) is True
        for user in (beside, home):
            assert "zqservesecret" not in served(e, user), user
        assert not e.engines[e.shard_map.shard(victim)].has_user(victim)
    finally:
        e.close()


def test_serve_router_page_changes_reach_every_shard(tmp_path: Path) -> None:
    """The HTTP page routes' calls on the router (``service.call(service.engine_for(user)
    .delete_page / .update_page, ...)``) run the same steps over the shard replicas."""
    import asyncio

    from memoryos_gpu.distributed.ray_serve import RouterService

    victim, beside, home = users()
    e = sharded(str(tmp_path / "store"))
    try:
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        lines = ["I keep a zqroutesecret note.", "I like zqroutenew.", "I walk.", "I row."]
        gone, edited, *_ = talk(e, victim, lines, 1.8e9)
        router = RouterService([_ShardHandle(x) for x in e.engines], e.engines[0].config)
        router.state = "ready"
        shard = router.engine_for(victim)
        assert asyncio.run(router.call(shard.delete_page, gone)) is True
        assert asyncio.run(router.call(router.engine_for(beside).delete_page, gone)) is False
        for user in (victim, home):
            assert "zqroutesecret" not in served(e, user), user
        row = asyncio.run(router.call(shard.update_page, edited, user_input="I like zqroutetwo."))
        assert row["user_input"] == "I like zqroutetwo."
        for user in (victim, home):
            assert "zqroutenew" not in served(e, user), user
        e.flush()
        assert all("zqroutetwo" in served(e, u) for u in (victim, home))
    finally:
        e.close()


def test_cli_delete_on_a_sharded_directory_forgets_on_every_shard(tmp_path: Path) -> None:
    """``memoryos-gpu delete`` through the stores alone: the same, with no engine open."""
    from click.testing import CliRunner

    from memoryos_gpu.cli import cli

    victim, beside, home = users()
    store = str(tmp_path / "store")
    with sharded(store) as e:
        talk(e, beside, ["I like tea.", "I swim.", "I read.", "I cook."], 1.7e9)
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        talk(e, victim, [f"I keep a zqclisecret {i} note." for i in range(4)], 1.8e9)
        assert all("zqclisecret" in served(e, u) for u in (beside, home))
    res = CliRunner().invoke(cli, ["delete", "--store", store, "--user", victim, "--yes"])
    assert res.exit_code == 0, res.output
    files = [f for f in Path(store).rglob("*") if f.is_file()]
    assert files and not [f for f in files if b"zqclisecret" in f.read_bytes()]
    with sharded(store) as e:
        for user in (beside, home):
            assert "zqclisecret" not in served(e, user), user
        assert "zqclisecret" not in json.dumps([x.extractor.to_dict() for x in e.engines])


def test_a_cli_delete_killed_before_the_other_shards_finishes_on_its_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed before the assistant's owner shard forgot the user's facts: the user's own rows
    are still there (they go last), so the re-run finds it and forgets on every shard."""
    from click.testing import CliRunner

    from memoryos_gpu.cli import cli
    from memoryos_gpu.distributed import sharded_forget

    victim, beside, _home = users()
    store = str(tmp_path / "store")
    with sharded(store) as e:
        talk(e, beside, ["I like tea.", "I swim.", "I read.", "I cook."], 1.7e9)
        talk(e, victim, [f"I keep a zqkilled {i} note." for i in range(4)], 1.8e9)
        assert "zqkilled" in served(e, beside)  # the owner shard's fact, replicated
    args = ["delete", "--store", store, "--user", victim, "--yes"]

    def killed(*args: Any, **kw: Any) -> int:
        raise RuntimeError("killed")

    monkeypatch.setattr(sharded_forget, "forget_in_stores", killed)
    assert CliRunner().invoke(cli, args).exit_code != 0
    monkeypatch.undo()
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    files = [f for f in Path(store).rglob("*") if f.is_file()]
    assert files and not [f for f in files if b"zqkilled" in f.read_bytes()]


def moves(req: ChatRequest) -> Any:
    """Assistant facts that state an attribute: the city named in the new pages."""
    text = req.messages[-1]["content"].split("New pages:")[-1]
    if req.stage == "page":
        return {"continuous": True, "meta": "m", "summary": "s", "keywords": []}
    if req.stage == "promotion":
        city = "Boston" if "Boston" in text else "Seattle"
        return {
            "profile_updates": {},
            "user_facts": [],
            "assistant_facts": [f"The user lives in {city}."],
        }
    return "ok"


def test_a_fact_the_owner_superseded_leaves_every_replica(tmp_path: Path) -> None:
    """The owner's conflict rule supersedes an assistant entry: the replicas stop serving it
    too (kept there as history, not live)."""
    _, beside, home = users()
    e = sharded(str(tmp_path / "store"), moves)
    try:
        talk(e, beside, ["I live in Seattle.", "I swim.", "I read.", "I cook."], 1.7e9)
        talk(e, home, ["I moved to Boston.", "I sail.", "I fish.", "I sing."], 1.8e9)
        for user in (beside, home):
            live = [k["text"] for k in e.knowledge(user)["assistant"]]
            assert live == ["The user lives in Boston."], user
            r = e.retrieve_many([(user, "where does the user live")], update_heat=False)[0]
            assert [k.text for k in r.assistant_knowledge] == ["The user lives in Boston."]
        away = e.knowledge(beside, history=True)["assistant"]
        assert [k["text"] for k in away if not k["live"]] == ["The user lives in Seattle."]
    finally:
        e.close()


class _GatedHandle(_ShardHandle):
    """A shard handle whose owner-side commit of assistant facts waits for ``gate``: a sync
    with facts in flight, held open while a deletion arrives."""

    def __init__(self, engine: Any, gate: Any) -> None:
        super().__init__(engine)
        plain = self.call.remote

        async def call(name: str, args: tuple, kw: dict) -> Any:
            if name == "append_assistant_facts":
                await gate.wait()
            return await plain(name, args, kw)

        self.call.remote = call


def test_a_deletion_waits_for_the_facts_a_sync_has_in_flight(tmp_path: Path) -> None:
    """The router's sync has taken a user's assistant fact from its shard's outbox and the
    owner has not committed it yet when the user is deleted: the deletion waits for it to land
    (the router's exchange lock) and then removes it, so it is not served afterwards."""
    import asyncio

    from memoryos_gpu.distributed.ray_serve import RouterService

    victim, _beside, home = users()
    e = sharded(str(tmp_path / "store"))
    try:
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        fact_waiting(e, victim, "zqflightsecret")

        async def scenario() -> None:
            gate = asyncio.Event()
            router = RouterService([_GatedHandle(x, gate) for x in e.engines], e.engines[0].config)
            router.state = "ready"
            sync = asyncio.create_task(router.sync())
            await asyncio.sleep(0.05)  # the outboxes are taken; the owner's commit waits
            delete = asyncio.create_task(router.delete_user(victim))
            await asyncio.sleep(0.05)
            gate.set()
            await sync
            assert await delete is True

        asyncio.run(scenario())
        assert "zqflightsecret" not in served(e, home)
        assert "zqflightsecret" not in json.dumps(assistant_texts(e, home))
    finally:
        e.close()


def test_cli_delete_keeps_the_exchange_marks_of_the_statistics_it_rewrites(
    tmp_path: Path,
) -> None:
    """The offline delete rewrites the other shards' saved keyword statistics without the
    victim's texts; the marks saying which pages of every shard they count stay with them (a
    resumed ``ingest --ray`` reads them: without, it took the statistics for fully exchanged)."""
    import sqlite3

    from click.testing import CliRunner

    from memoryos_gpu.cli import cli
    from memoryos_gpu.distributed.exchange import EXCHANGE_MARKS

    victim, _beside, home = users()
    store = str(tmp_path / "store")
    with sharded(store) as e:
        talk(e, home, ["I like tea.", "I swim.", "I read.", "I cook."], 1.7e9)
        talk(e, victim, [f"I keep a zqmarks {i} note." for i in range(4)], 1.8e9)
    marks = {"count": 2, "through": [3, 4]}
    saved = "SELECT value FROM meta WHERE key = 'keyword_extractor'"
    files = []  # the shards whose statistics were saved (a shard's first save comes later)
    for f in sorted(Path(store).glob("shard-*/memory.sqlite3")):
        with sqlite3.connect(f) as db:
            row = db.execute(saved).fetchone()
            if row is None:
                continue
            state = {**json.loads(row[0]), EXCHANGE_MARKS: marks}
            db.execute(
                "UPDATE meta SET value = ? WHERE key = 'keyword_extractor'", (json.dumps(state),)
            )
            files.append(f)
    other = Path(store) / f"shard-{ShardMap(2).shard(home)}" / "memory.sqlite3"
    assert other in files and ShardMap(2).shard(home) != ShardMap(2).shard(victim)
    res = CliRunner().invoke(cli, ["delete", "--store", store, "--user", victim, "--yes"])
    assert res.exit_code == 0, res.output
    with sqlite3.connect(other) as db:  # rewritten without the victim's texts, marks kept
        state = json.loads(db.execute(saved).fetchone()[0])
    assert "zqmarks" not in json.dumps(state) and state[EXCHANGE_MARKS] == marks


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_assistant_entry_names_only_pages_its_store_holds(backend, tmp_path: Path) -> None:
    """Page ids are per shard on per-shard stores: the owner shard's provenance of a fact
    learned from a user on another shard names that shard's page ids, which the owner shard
    served as its own (another user's pages: the sweep's ``/v1/users/carol/pages/1`` was
    carol's). An entry's sources are the pages its reader's store holds; a shared
    PostgreSQL store numbers pages once and holds them all."""
    victim, _, home = users()
    e = sharded(store_for(backend, tmp_path))
    try:
        talk(e, home, ["I knit.", "I sail.", "I fish.", "I sing."], 1.7e9)
        talk(e, victim, [f"I keep a zqawaynote {i} note." for i in range(4)], 1.8e9)
        e.flush()
        owner = e.engines[e.shard_map.assistant_owner(ASSISTANT)]
        entries = e.knowledge(home)["assistant"]
        for k in entries:
            held = owner.store.query(
                "SELECT page_id FROM pages WHERE user_id = ?", (k["source_user"],)
            )
            assert set(k["sources"]) <= {r[0] for r in held}, k
        [away] = [k for k in entries if "zqawaynote" in k["text"]]
        assert (away["sources"] == []) if backend == "sqlite" else away["sources"]
        assert next(k["sources"] for k in entries if k["source_user"] == home)
    finally:
        e.close()

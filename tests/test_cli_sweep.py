"""CLI defects found by a user's sweep of the commands against their docs: `eval` scoring
another engine than `ingest` builds, `chat --show-memory` hiding the memory, `chat` creating a
mistyped store and sending blank messages, `--shards` ignored without `--ray`, and `bench
--batch` repeating users it calls distinct."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cli import DATA, SAMPLE, cli, fake_llm, store_pages  # noqa: F401 (fake_llm: fixture)

from memoryos_gpu import cli as cli_mod
from memoryos_gpu.cli import measure
from memoryos_gpu.engine.page_text import page_text
from memoryos_gpu.formats import Record, read_records
from memoryos_gpu.types import PageInput

LOCOMO_MINI = DATA / "locomo_mini.json"


def _llm_args(base_url: str) -> list[str]:
    return [
        "--llm-mode",
        "llm",
        "--llm-backend",
        "openai",
        "--llm-base-url",
        base_url,
        "--llm-model",
        "fake",
    ]


def _maya_store(tmp_path: Path, lines: int = 10) -> Path:
    """A store of maya_chen's first ``lines`` exchanges of the sample chats (hashing)."""
    src = tmp_path / "maya.jsonl"
    src.write_text("".join(Path(SAMPLE).read_text().splitlines(keepends=True)[:lines]))
    store = tmp_path / "store"
    p = cli("ingest", src, "--store", store)
    assert p.returncode == 0, p.stderr
    return store


# ------------------------------------------------------------------------------ eval
def test_eval_gives_the_engine_the_pages_ingest_gives_it(monkeypatch):
    """The engine page text of a LoCoMo page is written with the speakers' names from the
    page's meta: `eval` must pass the reader's meta as `ingest` does (it passed only
    page_index, so the engine saw "User:"/"Assistant:" while BM25 got the names)."""
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    added: list[PageInput] = []
    real_make_engine = measure.make_engine

    def spying_make_engine(cfg):
        engine = real_make_engine(cfg)
        add_many = engine.add_many

        def add_and_keep(pages):
            pages = list(pages)
            added.extend(pages)
            return add_many(pages)

        monkeypatch.setattr(engine, "add_many", add_and_keep)
        return engine

    monkeypatch.setattr(measure, "make_engine", spying_make_engine)
    res = CliRunner().invoke(cli_mod.cli, ["eval", str(LOCOMO_MINI), "--json", "--k", "5"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["recall"]["memoryos"]["5"]["overall"] > 0

    # what `ingest` reads (the file has a malformed turn: a reject, in neither)
    records = [r for r in read_records(LOCOMO_MINI, "locomo") if isinstance(r, Record)]
    assert len(added) == len(records) > 0
    per_conv: dict[str, int] = {}
    for page, rec in zip(added, records, strict=True):
        ingested = PageInput(**rec.to_page(), meta=dict(rec.meta))
        extra = dict(page.meta)
        index = extra.pop("page_index")  # eval's own key: a page's place in its conversation
        assert index == per_conv.get(rec.user_id, 0)
        per_conv[rec.user_id] = index + 1
        text = page_text(page, False)  # what the engine embeds and indexes
        assert text.startswith(f"{rec.meta['speaker_a']}: ")
        assert f" {rec.meta['speaker_b']}: " in text and "User:" not in text
        assert text == page_text(ingested, False)
        assert extra == ingested.meta
        assert (page.user_id, page.assistant_id, page.source, page.timestamp) == (
            ingested.user_id,
            ingested.assistant_id,
            ingested.source,
            ingested.timestamp,
        )


# ------------------------------------------------------------------------------ chat
def test_chat_show_memory_prints_the_retrieved_context(tmp_path, fake_llm):  # noqa: F811
    store = _maya_store(tmp_path)
    p = cli(
        "chat",
        "--store",
        store,
        "--user",
        "maya_chen",
        *_llm_args(fake_llm),
        "-m",
        "When is my marathon?",
        "--show-memory",
    )
    assert p.returncode == 0, p.stderr
    context, _, answer = p.stdout.partition("assistant> ")
    assert answer.startswith("fake answer")
    # printed as `retrieve` prints it: query, mid-term and short-term pages with their text
    assert "query When is my marathon?" in context
    assert "mid-term pages" in context and "short-term memory" in context
    assert "I'm training for the Portland Marathon on October 6th" in context
    assert "She hides under the bed most of the day" in context  # the newest, in STM
    assert "[memory:" not in context


def test_chat_refuses_a_store_that_is_not_there(tmp_path, fake_llm):  # noqa: F811
    typo = tmp_path / "stroe"
    p = cli("chat", "--store", typo, "--user", "maya_chen", *_llm_args(fake_llm), "-m", "hi")
    assert p.returncode == 1
    assert f"no store at {typo}" in p.stderr
    assert f"memoryos-gpu ingest /dev/null --store {typo}" in p.stderr  # the way to start empty
    assert not typo.exists()
    # the hint works: an empty store, then a chat from empty memory that is remembered
    p = cli("ingest", "/dev/null", "--store", typo)
    assert p.returncode == 0, p.stderr
    p = cli("chat", "--store", typo, "--user", "newbie", *_llm_args(fake_llm), "-m", "hi")
    assert p.returncode == 0, p.stderr
    assert [r[0] for r in store_pages(typo)] == ["newbie"]


@pytest.mark.parametrize("command", ["retrieve", "stats"])
def test_a_command_that_reads_refuses_an_empty_store_file(tmp_path, command):
    """A 0-byte memory.sqlite3 (a creation cut short, a truncated copy) was taken by SQLite
    for a new database: ``retrieve`` wrote a fresh schema into it and answered "unknown
    user" as if the store were real and empty."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "memory.sqlite3").touch()
    args = [command, "--store", store] + (["--user", "u", "hi"] if command == "retrieve" else [])
    p = cli(*args)
    assert p.returncode == 1, p.stdout
    assert "is empty (0 bytes), not a store" in p.stderr
    assert (store / "memory.sqlite3").stat().st_size == 0  # nothing written into it


@pytest.mark.parametrize("blank", ["", "   ", "\t\n"])
def test_chat_refuses_a_blank_message(tmp_path, fake_llm, blank):  # noqa: F811
    store = _maya_store(tmp_path, lines=2)
    before = store_pages(store)
    args = ["chat", "--store", store, "--user", "maya_chen", *_llm_args(fake_llm)]
    p = cli(*args, "-m", "hello", "-m", blank)
    assert p.returncode == 2, p.stderr
    assert "-m/--message" in p.stderr and "blank" in p.stderr
    assert "assistant>" not in p.stdout  # refused before anything was sent
    assert store_pages(store) == before


# ------------------------------------------------------------------------------ --shards
def test_shards_without_ray_is_a_usage_error_in_ingest(tmp_path):
    store = tmp_path / "store"
    p = cli("ingest", SAMPLE, "--shards", "3", "--store", store)
    assert p.returncode == 2, p.stderr
    assert "--shards is for --ray" in p.stderr and "--workers 3" in p.stderr
    assert not store.exists()  # refused before anything was written


def test_shards_without_ray_is_a_usage_error_in_serve(tmp_path, monkeypatch):
    started: list[dict] = []
    app = types.ModuleType("memoryos_gpu.server.app")
    app.run = lambda **kw: started.append(kw)  # the server, had it been started
    monkeypatch.setitem(sys.modules, "memoryos_gpu.server.app", app)
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    args = ["serve", "--store", str(tmp_path / "s"), "--workers", "0"]
    res = CliRunner().invoke(cli_mod.cli, [*args, "--shards", "3"])
    assert res.exit_code == 2, res.output
    assert "--shards is for --ray" in res.output and "--engines 3" in res.output
    assert started == []
    assert CliRunner().invoke(cli_mod.cli, args).exit_code == 0 and len(started) == 1


# ------------------------------------------------------------------------------ bench
def test_bench_batch_is_of_distinct_users():
    small = ["bench", "--users", "10", "--slots", "4", "--repeat", "1", "--json"]
    p = cli(*small, "--batch", "11")
    assert p.returncode == 2
    assert "--batch 11 is more than --users 10" in p.stderr
    p = cli(*small, "--batch", "10")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["batch"] == 10
    p = cli(*small)  # the default 256 is more than 10 users: every user, once
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["batch"] == 10

"""memoryos_gpu.ingest: the bulk-ingestion pipeline as a library (hashing embedder: fast)."""

from __future__ import annotations

import gzip
import io
import json
import shutil
import signal
import threading
from pathlib import Path

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import InvalidInputError, MemoryEngine
from memoryos_gpu.formats import FormatError, sample_chats_path
from memoryos_gpu.ingest import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    IngestReport,
    Shard,
    ingest,
    resolve_formats,
    shard_of,
)

DATA = Path(__file__).parent / "data"


def cfg(store: Path | str = ":memory:", **kw) -> EngineConfig:
    return EngineConfig(embedder="hashing", store=str(store), **kw)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def synthetic(users: int, per_user: int, interleave: bool = True) -> list[dict]:
    rows = []
    order = (
        [(j, u) for j in range(per_user) for u in range(users)]
        if interleave
        else [(j, u) for u in range(users) for j in range(per_user)]
    )
    for j, u in order:
        rows.append(
            {
                "user_id": f"user-{u}",
                "user_input": f"message {j} of user {u} about topic {j % 5}",
                "agent_response": f"reply {j} to user {u}",
                "timestamp": 1_700_000_000 + 60 * j,
            }
        )
    return rows


def page_rows(engine: MemoryEngine) -> list[tuple]:
    return engine.store.query("SELECT user_id, seq, user_input, source FROM pages ORDER BY page_id")


# ------------------------------------------------------------------------------ sharding
def test_shard_of_is_stable_and_spreads():
    assert shard_of("alice", 4) == shard_of("alice", 4)
    # blake2b-64, big-endian, mod N: pinned so that stores stay routable across versions
    assert [shard_of(f"u{i}", 4) for i in range(8)] == [shard_of(f"u{i}", 4) for i in range(8)]
    counts = [0] * 4
    for i in range(4000):
        counts[shard_of(f"user-{i}", 4)] += 1
    assert min(counts) > 800


def test_shard_parse():
    assert Shard.parse("1/3") == Shard(1, 3)
    assert str(Shard.parse((0, 2))) == "0/2"
    for bad in ("3/3", "-1/2", "x/2", "1", "0/0"):
        with pytest.raises(ValueError):
            Shard.parse(bad)


# ------------------------------------------------------------------------------ formats
def test_every_format_and_gzip(tmp_path):
    gz = tmp_path / "sample.jsonl.gz"
    gz.write_bytes(gzip.compress(sample_chats_path().read_bytes()))
    files = [
        gz,
        DATA / "sharegpt.jsonl",
        DATA / "sharegpt_array.json",
        DATA / "openai.jsonl",
        DATA / "locomo_mini.json",
    ]
    with MemoryEngine(cfg()) as engine:
        rep = ingest(files, engine, progress=False)
        assert rep.formats == {
            str(gz): "jsonl",
            str(DATA / "sharegpt.jsonl"): "sharegpt",
            str(DATA / "sharegpt_array.json"): "sharegpt",
            str(DATA / "openai.jsonl"): "openai",
            str(DATA / "locomo_mini.json"): "locomo",
        }
        assert rep.accepted > 75  # the 75 sample pages + the fixtures' good records
        stored = sum(v for k, v in engine.store.counts().items() if k.startswith("pages_"))
        assert stored == rep.accepted
        assert rep.rejected > 0  # the fixtures hold deliberately bad items
        assert rep.exit_code == EXIT_REJECTED


def test_format_override_and_detection_errors(tmp_path):
    with pytest.raises(FormatError):
        resolve_formats([DATA / "undetectable.jsonl"])
    with pytest.raises(FormatError):
        resolve_formats([DATA / "pages.jsonl"], "csv")
    with pytest.raises(FileNotFoundError):
        resolve_formats([tmp_path / "missing.jsonl"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n \n")
    assert resolve_formats([empty]) == {str(empty): "empty"}
    rep = ingest([empty], cfg(), progress=False)
    assert (rep.accepted, rep.rejected, rep.exit_code) == (0, 0, EXIT_OK)
    # forcing a wrong format turns every item into a reject, it does not crash
    rep = ingest([sample_chats_path()], cfg(), fmt="sharegpt", progress=False)
    assert rep.accepted == 0 and rep.rejected == 75


# ------------------------------------------------------------------------------ idempotence
def test_rerun_skips_everything(tmp_path):
    store = tmp_path / "store"
    first = ingest([sample_chats_path()], cfg(store), progress=False, batch_size=16)
    assert (first.accepted, first.skipped, first.rejected) == (75, 0, 0)
    assert first.users == 3 and first.exit_code == EXIT_OK and first.batches == 5
    second = ingest([sample_chats_path()], cfg(store), progress=False, batch_size=16)
    assert (second.accepted, second.skipped) == (0, 75)
    assert second.users == 3
    with MemoryEngine(cfg(store)) as engine:
        rows = page_rows(engine)
    assert len(rows) == 75 and len({r[3] for r in rows}) == 75


def test_per_user_order_is_file_order(tmp_path):
    rows = synthetic(users=6, per_user=12, interleave=True)
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    with MemoryEngine(cfg()) as engine:
        ingest([path], engine, progress=False, batch_size=7)
        got = page_rows(engine)
    for u in range(6):
        mine = [r for r in got if r[0] == f"user-{u}"]
        assert [r[1] for r in mine] == sorted(r[1] for r in mine)
        assert [r[2] for r in mine] == [
            x["user_input"] for x in rows if x["user_id"] == f"user-{u}"
        ]


# ------------------------------------------------------------------------------ rejects
def test_rejects_file_and_engine_validation(tmp_path):
    good = synthetic(users=2, per_user=3)
    bad_engine = [
        # the reader accepts these, the engine's validation refuses them
        {"user_id": "   ", "user_input": "blank user id", "agent_response": "x"},
        {"user_id": "x" * 300, "user_input": "user id too long", "agent_response": "x"},
    ]
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(r) for r in good[:3]]
    lines.append("{not json")
    lines += [json.dumps(r) for r in bad_engine]
    lines.append(json.dumps({"user_id": "z", "user_input": 5, "agent_response": ""}))
    lines += [json.dumps(r) for r in good[3:]]
    path.write_text("\n".join(lines) + "\n")
    rejects = tmp_path / "out" / "rejects.jsonl"
    log = tmp_path / "log.txt"
    with open(log, "w") as log_f, MemoryEngine(cfg()) as engine:
        rep = ingest([path], engine, rejects_path=rejects, progress=False, reject_log=log_f)
    assert (rep.accepted, rep.rejected) == (6, 4)
    assert rep.exit_code == EXIT_REJECTED
    rows = [json.loads(x) for x in rejects.read_text().splitlines()]
    assert [(r["line"], r["stage"]) for r in rows] == [
        (4, "read"),
        (5, "validate"),
        (6, "validate"),
        (7, "read"),
    ]
    assert all(r["file"] == str(path) and r["reason"] for r in rows)
    assert "user_id" in rows[1]["reason"]
    text = log.read_text()
    assert f"{path}:4: rejected: invalid JSON" in text
    assert f"{path}:5: rejected:" in text
    assert sum(rep.reject_reasons.values()) == 4


def test_each_reject_is_in_the_file_once_its_batch_is_acknowledged(tmp_path):
    """A run killed outright (SIGKILL, the OOM killer) lists in its rejects file what it
    rejected up to its last acknowledged batch: each row reaches the file as it is rejected.
    Read here from another open of the file right after the batch (the run still going, the
    file not closed): before, the rows sat in the writer's buffer until the run ended, and a
    killed run left an empty file although it had reported the rejects."""
    rows = [json.dumps(r) for r in synthetic(users=2, per_user=4)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([*rows[:2], "{not json", *rows[2:]]) + "\n", encoding="utf-8")
    rejects = tmp_path / "rejects.jsonl"
    seen: list[str] = []
    with MemoryEngine(cfg()) as engine:
        rep = ingest(
            [path],
            engine,
            rejects_path=rejects,
            progress=False,
            batch_size=4,
            reject_log=io.StringIO(),
            on_batch=lambda _: seen.append(rejects.read_text(encoding="utf-8")),
        )
    assert (rep.accepted, rep.rejected, rep.batches) == (8, 1, 2)
    assert [json.loads(x)["line"] for x in seen[0].splitlines()] == [3]


class _PickyEngine(MemoryEngine):
    """An engine refusing pages only inside add_many (no per-record pre-validation)."""

    def add_many(self, pages):
        pages = list(pages)
        if any(p.user_input == "poison" for p in pages):
            raise InvalidInputError("user_input: poison refused")
        return super().add_many(pages)


def test_batch_split_when_add_many_refuses(tmp_path):
    rows = synthetic(users=3, per_user=5)
    rows.insert(7, {"user_id": "user-1", "user_input": "poison", "agent_response": ""})
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    with _PickyEngine(cfg()) as engine:
        rep = ingest([path], engine, progress=False, batch_size=64, reject_log=io.StringIO())
        assert (rep.accepted, rep.rejected) == (15, 1)
        assert len(page_rows(engine)) == 15


# ------------------------------------------------------------------------------ stop / resume
def test_stop_event_finishes_the_batch_and_resumes(tmp_path):
    rows = synthetic(users=20, per_user=10)
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    store = tmp_path / "store"
    stop = threading.Event()

    def after_batch(rep: IngestReport) -> None:
        if rep.batches == 2:
            stop.set()

    first = ingest(
        [path], cfg(store), progress=False, batch_size=25, stop_event=stop, on_batch=after_batch
    )
    assert first.interrupted and first.exit_code == EXIT_INTERRUPTED
    assert first.accepted == 50
    second = ingest([path], cfg(store), progress=False, batch_size=25)
    assert not second.interrupted
    assert second.skipped == 50 and second.accepted == 150
    with MemoryEngine(cfg(store)) as engine:
        got = page_rows(engine)
        assert len(got) == 200 and len({r[3] for r in got}) == 200
        assert engine.store.count_pending() == 0


def _signalling_add_many(engine: MemoryEngine, signals: list[int]) -> None:
    """Make ``engine.add_many`` receive ``signals`` (their handlers run at once, in this
    thread) before it writes: signals that arrive while a batch is in flight."""
    real = engine.add_many

    def add_many(pages):
        for sig in signals:
            signal.raise_signal(sig)
        return real(pages)

    engine.add_many = add_many


def test_a_repeated_sigterm_still_finishes_the_batch_in_flight(tmp_path):
    """The kernel sends a shard process of ``ingest --workers`` whose parent was SIGKILLed its
    parent-death SIGTERM once per thread of the parent (memoryos_gpu/parent_death.py). The
    first asks to finish the batch in flight; the repeats must not abort it (they did: the
    second raised KeyboardInterrupt inside the write, which rolled back, and the shard logged
    "an apply failed halfway" next to "SIGTERM: finishing the batch in flight")."""
    path = write_jsonl(tmp_path / "in.jsonl", synthetic(users=4, per_user=5))
    with MemoryEngine(cfg()) as engine:
        _signalling_add_many(engine, [signal.SIGTERM] * 3)
        try:
            rep = ingest([path], engine, progress=False, batch_size=5, handle_sigint=True)
        except KeyboardInterrupt:
            pytest.fail("a repeated SIGTERM aborted the batch in flight")
        assert rep.interrupted and rep.stop_signal == signal.SIGTERM and rep.exit_code == 143
        assert rep.accepted == 5 == len(page_rows(engine))


def test_ctrl_c_after_a_sigterm_still_aborts(tmp_path):
    """Only a repeated stop that is Ctrl-C aborts at once (docs/cli.md): nothing of the batch
    in flight is written."""
    path = write_jsonl(tmp_path / "in.jsonl", synthetic(users=4, per_user=5))
    before = signal.getsignal(signal.SIGTERM)
    with MemoryEngine(cfg()) as engine:
        _signalling_add_many(engine, [signal.SIGTERM, signal.SIGINT])
        with pytest.raises(KeyboardInterrupt):
            ingest([path], engine, progress=False, batch_size=5, handle_sigint=True)
        assert page_rows(engine) == []
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers were put back


def test_process_defer_leaves_work_pending(tmp_path):
    rows = synthetic(users=2, per_user=12)
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    store = tmp_path / "store"
    rep = ingest([path], cfg(store), progress=False, process="defer")
    assert rep.accepted == 24 and rep.pending == 2 * (12 - 7)
    with MemoryEngine(cfg(store)) as engine:  # opening the store runs the pending work
        assert engine.store.count_pending() == 0
    rep = ingest([path], cfg(store), progress=False, process="batch")
    assert rep.skipped == 24 and rep.pending == 0


def test_a_deferred_run_leaves_an_earlier_runs_work_pending(tmp_path):
    """A second ``process="defer"`` run (a resumed one) runs none of the work the first left
    pending at its open: it used to run it all before reading a line."""
    store = tmp_path / "store"
    first = write_jsonl(tmp_path / "a.jsonl", synthetic(users=2, per_user=12))
    rep = ingest([first], cfg(store), progress=False, process="defer")
    assert rep.pending == 2 * (12 - 7)
    later = [{**r, "user_input": r["user_input"] + " (later)"} for r in synthetic(2, 12)]
    more = write_jsonl(tmp_path / "b.jsonl", later)
    rep = ingest([more], cfg(store), progress=False, process="defer")
    assert rep.accepted == 24 and rep.pending == 2 * (24 - 7)
    with MemoryEngine(cfg(store), hold_pending=True) as engine:
        assert engine.process_pending() == {"pages": 0, "promotions": 0}
        assert engine.store.count_pending() == 2 * (24 - 7)
        engine.release_pending()
        engine.process_pending()
        assert engine.store.count_pending() == 0


def _scripted(req):
    """A scripted LLM's answer for each stage (LLM mode without a model)."""
    if req.stage == "page":
        return {"continuous": False, "meta": "m", "summary": "s", "keywords": ["k"]}
    if req.stage == "promotion":
        return {"profile_updates": {}, "user_facts": ["a fact"], "assistant_facts": []}
    return "ok"


def test_the_report_counts_the_llm_calls_of_resumed_work(tmp_path, monkeypatch):
    """A run that opens the store resumes what an interrupted (or deferred) run left pending,
    with LLM calls of its own: the report counted only those after the open (0 here)."""
    import memoryos_gpu.engine as engine_module
    from memoryos_gpu.config import LLMConfig
    from memoryos_gpu.llm.scripted import ScriptedBackend

    class Scripted(MemoryEngine):
        def _make_llm(self):
            return ScriptedBackend(_scripted)

    monkeypatch.setattr(engine_module, "MemoryEngine", Scripted)  # what ingest() opens
    path = write_jsonl(tmp_path / "in.jsonl", synthetic(users=2, per_user=12))
    store = tmp_path / "store"
    config = cfg(store, llm=LLMConfig(mode="llm", backend="scripted"))
    rep = ingest([path], config, progress=False, process="defer")
    assert rep.pending == 2 * (12 - 7) and rep.llm_calls == 0
    rep = ingest([path], config, progress=False, process="batch")  # resumes at its open
    assert rep.skipped == 24 and rep.pending == 0
    assert rep.llm_calls >= 2 * (12 - 7)  # one page call each, at least


def test_process_defer_refuses_an_engine_that_processes_inline(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", synthetic(users=1, per_user=2))
    with MemoryEngine(cfg(tmp_path / "store")) as engine:  # auto_process: the default
        with pytest.raises(ValueError, match="auto_process=False"):
            ingest([path], engine, progress=False, process="defer")  # was silently inline
        assert engine.store.counts().get("pages_stm", 0) == 0


# ------------------------------------------------------------------------------ shards
def test_shards_cover_every_user_once(tmp_path):
    rows = synthetic(users=40, per_user=2)
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"user_id": "zz", "user_input": "no response"}\n{broken\n[1]\n')
    seen: dict[str, int] = {}
    total = rejected = 0
    for i in range(3):
        with MemoryEngine(cfg()) as engine:
            rep = ingest(
                [path, bad], engine, shard=f"{i}/3", progress=False, reject_log=io.StringIO()
            )
            for u in engine.users():
                assert u not in seen
                seen[u] = i
                assert shard_of(u, 3) == i
            total += rep.accepted
            rejected += rep.rejected
            assert rep.shard == f"{i}/3"
            assert rep.accepted + rep.other_shards == 80
    assert len(seen) == 40 and total == 80
    assert rejected == 3  # each bad line is reported by exactly one shard


def test_library_defaults_in_memory(tmp_path):
    rep = ingest(sample_chats_path(), cfg(), progress=False)  # a single path works too
    assert rep.accepted == 75 and rep.store == ":memory:"
    d = rep.to_dict()
    for key in ("accepted", "rejected", "skipped", "users", "pages_per_s", "exit_code"):
        assert key in d


def test_progress_display_does_not_break(tmp_path, capsys):
    src = tmp_path / "s.jsonl"
    shutil.copy(sample_chats_path(), src)
    rep = ingest([src], cfg(), progress=True, batch_size=10)
    assert rep.accepted == 75


def test_truncated_gzip_is_a_reject_not_a_crash(tmp_path):
    data = gzip.compress(sample_chats_path().read_bytes())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) * 2 // 3])
    log = io.StringIO()
    rep = ingest([cut, DATA / "openai.jsonl"], cfg(), progress=False, reject_log=log)
    assert rep.accepted > 0
    assert rep.exit_code == EXIT_REJECTED
    assert "cannot read further" in log.getvalue()
    assert rep.formats[str(DATA / "openai.jsonl")] == "openai"  # the next file was read too

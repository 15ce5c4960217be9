"""A lone surrogate in a page's ``meta`` (a ``"\\ud800"`` escape in a JSONL ``meta``, a ShareGPT or
OpenAI ``id`` copied into ``meta.conversation_id``, a LoCoMo speaker name) is replaced by U+FFFD
as in the text fields, by the engine's validation: no UTF-8 encodes it, so once stored it broke
``export`` (which left a 0-byte file) and ``retrieve --json`` for that user. ``export --out``
writes its file whole or not at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memoryos_gpu import cli as cli_mod
from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import (
    InvalidInputError,
    MemoryEngine,
    validate_page,
    validate_pages,
    validation,
)
from memoryos_gpu.ingest import ingest
from memoryos_gpu.types import PageInput

_LONE = "\ud800"
_FFFD = "\ufffd"


def _page(meta: dict[str, Any]) -> PageInput:
    return PageInput("q", "a", "b", None, None, None, meta)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMORYOS_GPU_")}
    env["MEMORYOS_GPU_EMBEDDER"] = "hashing"
    return env


def _cli(*args: Any) -> subprocess.CompletedProcess[bytes]:
    """The CLI in its own process: its stdout is a real UTF-8 stream, as a user's is."""
    cmd = [sys.executable, "-m", "memoryos_gpu", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, env=_env(), timeout=120, check=False)


# ------------------------------------------------------------------ the engine's rule
def test_lone_surrogates_in_meta_keys_and_values_become_u_fffd_at_any_depth() -> None:
    meta = {
        "k": _LONE,
        f"{_LONE}x": [f"a{_LONE}", {"z": "\udfff"}, ("t\udc00",)],
        "e": "\U0001f600",
    }
    want = {"k": _FFFD, f"{_FFFD}x": [f"a{_FFFD}", {"z": _FFFD}, (f"t{_FFFD}",)], "e": "\U0001f600"}
    assert validate_page(_page(meta)).meta == want
    assert validate_pages([_page(meta)])[0].meta == want
    assert meta["k"] == _LONE  # the caller's dict is not changed


def test_the_fast_path_of_a_flat_string_meta_does_not_let_a_surrogate_through() -> None:
    """``validate_pages`` takes a page of plain ASCII fields and a flat string meta as it is."""
    assert validate_pages([_page({"k": f"x{_LONE}"})])[0].meta == {"k": f"x{_FFFD}"}
    assert validate_pages([_page({f"{_LONE}": "v"})])[0].meta == {_FFFD: "v"}


def test_a_meta_without_surrogates_is_stored_as_given_not_copied() -> None:
    meta = {"k": "caf\u00e9", "n": [1, {"x": None}]}
    assert validate_page(_page(meta)).meta is meta


def test_keys_that_become_one_once_replaced_are_refused_not_merged() -> None:
    with pytest.raises(InvalidInputError, match="become the same key"):
        validate_page(_page(dict([("a\ud800", 1), ("a\udc00", 2)])))


def test_the_engine_stores_and_reads_back_the_replacement(tmp_path: Path) -> None:
    with MemoryEngine(EngineConfig(store=str(tmp_path / "s"), embedder="hashing")) as engine:
        page_id = engine.add("q", "hello", meta={"k": _LONE, "n": {"m": [_LONE]}}).page_id
        assert engine.get_page(page_id)["extra"] == {"k": _FFFD, "n": {"m": [_FFFD]}}


# ------------------------------------------------------------------ through ingest and the CLI
def test_a_surrogate_meta_ingested_exports_and_retrieves(tmp_path: Path) -> None:
    """The user's repro: ``"meta": {"k": "\\ud800"}`` in a JSONL page, a ShareGPT conversation
    whose ``id`` is a lone surrogate (its ``meta.conversation_id``), then ``export --out`` and
    ``retrieve --json`` for those users (both were tracebacks, export left a 0-byte file)."""
    src = tmp_path / "m.jsonl"
    src.write_text(
        '{"user_id": "q", "user_input": "a", "agent_response": "b", "meta": {"k": "\\ud800"}}\n',
        encoding="utf-8",
    )
    conv = tmp_path / "c.jsonl"
    conv.write_text(
        '{"user_id": "r", "id": "c\\ud800", "conversations": '
        '[{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}\n',
        encoding="utf-8",
    )
    store = tmp_path / "store"
    config = EngineConfig(store=str(store), embedder="hashing")
    rep = ingest([src, conv], config, progress=False)
    assert (rep.accepted, rep.rejected) == (2, 0)
    for user, key, want in (("q", "k", _FFFD), ("r", "conversation_id", f"c{_FFFD}")):
        out = tmp_path / f"{user}.json"
        res = _cli("export", "--store", store, "--user", user, "--out", out)
        assert res.returncode == 0, res.stderr.decode()
        (page,) = json.loads(out.read_text(encoding="utf-8"))["pages"]
        assert page["extra"][key] == want
        res = _cli("retrieve", "--store", store, "--user", user, "a", "--json")
        assert res.returncode == 0, res.stderr.decode()
        assert json.loads(res.stdout)["pages"][0]["extra"][key] == want


# ------------------------------------------------------------------ export's output file
def _store_with(tmp_path: Path, meta: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Path:
    """A store holding a page with ``meta`` stored as given: as a store written before the
    engine replaced lone surrogates holds it."""
    store = tmp_path / "old"
    with monkeypatch.context() as m:
        m.setattr(validation, "_plain_meta", lambda meta: False)
        m.setattr(validation, "_check_meta", lambda meta: meta)
        with MemoryEngine(EngineConfig(store=str(store), embedder="hashing")) as engine:
            engine.add("q", "hello", meta=meta)
    return store


def test_export_of_a_surrogate_a_store_holds_from_before_writes_its_escape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store_with(tmp_path, {"k": _LONE}, monkeypatch)
    out = tmp_path / "q.json"
    res = _cli("export", "--store", store, "--user", "q", "--out", out)
    assert res.returncode == 0, res.stderr.decode()
    assert '"k": "\\ud800"' in out.read_text(encoding="utf-8")  # its JSON escape: valid JSON
    assert json.loads(out.read_text(encoding="utf-8"))["pages"][0]["extra"] == {"k": _LONE}


def test_a_surrogate_a_store_holds_from_before_prints_as_its_escape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``export`` to stdout and ``retrieve --json`` print JSON (cli/output.json_text): a lone
    surrogate, which no UTF-8 encodes, ended them in a UnicodeEncodeError traceback."""
    store = _store_with(tmp_path, {"k": _LONE}, monkeypatch)
    for args in (("export", "--user", "q"), ("retrieve", "--user", "q", "hello", "--json")):
        res = _cli(args[0], "--store", store, *args[1:])
        assert res.returncode == 0, res.stderr.decode()
        assert b"\\ud800" in res.stdout
        assert json.loads(res.stdout)["pages"][0]["extra"] == {"k": _LONE}


def test_a_failed_export_leaves_no_file_and_keeps_the_one_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written in place, a failure part way (here: the disk full as the file is flushed) left
    a cut or 0-byte file where the export was asked for, the one there before lost."""
    store = tmp_path / "s"
    with MemoryEngine(EngineConfig(store=str(store), embedder="hashing")) as engine:
        engine.add("q", "hello")
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    runner = CliRunner()
    fresh = tmp_path / "fresh.json"
    res = runner.invoke(
        cli_mod.cli, ["export", "--store", str(store), "--user", "q", "--out", str(fresh)]
    )
    assert res.exit_code != 0
    assert not fresh.exists()
    kept = tmp_path / "kept.json"
    kept.write_text("the export of yesterday\n", encoding="utf-8")
    res = runner.invoke(
        cli_mod.cli, ["export", "--store", str(store), "--user", "q", "--out", str(kept)]
    )
    assert res.exit_code != 0
    assert kept.read_text(encoding="utf-8") == "the export of yesterday\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json", "s"]  # no temporary left

"""Where a command's store and embedder come from, when what is given is blank or wrong: an
empty ``--store`` / ``$MEMORYOS_GPU_STORE`` (an unset variable expanded into it) or a config
file's ``store = 5`` wrote ./memoryos-store silently, a file's ``store = ":memory:"`` was
replaced by it, a bad ``$MEMORYOS_GPU_EMBEDDER`` was reported as a file key, and an engine
configuration error did not say which file it came from."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from memoryos_gpu.cli import cli

SAMPLE = Path(__file__).resolve().parents[1] / "memoryos_gpu" / "data" / "sample_chats.jsonl"


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)
    monkeypatch.chdir(tmp_path)  # where ./memoryos-store would appear


def _run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _nothing_written(tmp_path: Path) -> bool:
    return sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".toml") == []


@pytest.mark.parametrize("blank", ["", "   "])
def test_a_blank_store_flag_or_variable_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blank: str
) -> None:
    res = _run("ingest", SAMPLE, "--store", blank)
    assert res.exit_code == 2 and "--store is empty" in res.output, res.output
    monkeypatch.setenv("MEMORYOS_GPU_STORE", blank)
    res = _run("ingest", SAMPLE)
    assert res.exit_code == 2 and "$MEMORYOS_GPU_STORE is empty" in res.output, res.output
    assert _nothing_written(tmp_path)


def test_a_config_files_store_is_taken_as_given(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("store = 5\n", encoding="utf-8")
    res = _run("ingest", SAMPLE, "--config", bad)
    assert (
        res.exit_code == 2 and "store must be a string" in res.output and "bad.toml" in res.output
    )
    memory = tmp_path / "memory.toml"
    memory.write_text('store = ":memory:"\n', encoding="utf-8")
    res = _run("ingest", SAMPLE, "--config", memory, "--json")
    assert res.exit_code == 0, res.output
    assert _nothing_written(tmp_path)  # was: ./memoryos-store


def test_a_bad_embedder_variable_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "HASHING")
    res = _run("ingest", SAMPLE, "--store", tmp_path / "s")
    assert res.exit_code == 2
    assert "$MEMORYOS_GPU_EMBEDDER: 'HASHING' is not an embedder" in res.output, res.output
    assert not (tmp_path / "s").exists()


def test_an_engine_configuration_error_names_its_file(tmp_path: Path) -> None:
    cfg = tmp_path / "engine.toml"
    cfg.write_text("[memory]\nstm_capacity = 'seven'\n", encoding="utf-8")
    res = _run("stats", "--store", tmp_path / "s", "--config", cfg)
    assert res.exit_code == 2
    assert f"invalid engine configuration (config file {cfg})" in res.output, res.output
    assert "memory.stm_capacity" in res.output


@pytest.mark.parametrize("table", ["memory", "llm"])
def test_a_table_that_is_not_one_is_refused_by_every_reader(tmp_path: Path, table: str) -> None:
    """The CLI and ``EngineConfig.from_toml`` (the MCP server, ``server.app.run``) read a config
    file one way (``config.engine_data``): ``memory = 5`` crashed the latter with a TypeError."""
    from memoryos_gpu.config import EngineConfig

    cfg = tmp_path / "t.toml"
    cfg.write_text(f"{table} = 5\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"\[{table}\] must be a table of settings, not a int"):
        EngineConfig.from_toml(cfg)
    res = _run("stats", "--store", tmp_path / "s", "--config", cfg)
    assert res.exit_code == 2 and f"[{table}] must be a table" in res.output, res.output


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("shutdown_drain_s = inf", "shutdown_drain_s"),
        ("shutdown_drain_s = 1e12", "shutdown_drain_s"),
        ("[llm]\ntemperature = nan", "llm.temperature"),
    ],
)
def test_an_engine_number_that_is_not_finite_or_sane_is_refused(
    tmp_path: Path, text: str, key: str
) -> None:
    """``shutdown_drain_s = inf`` was taken: a server's shutdown then ran derived work forever
    (the [server] table's numbers are bounded the same way: tests/test_serve_config_edges.py)."""
    cfg = tmp_path / "n.toml"
    cfg.write_text(text + "\n", encoding="utf-8")
    res = _run("stats", "--store", tmp_path / "s", "--config", cfg)
    assert res.exit_code == 2 and f"invalid engine configuration (config file {cfg}): {key}" in (
        res.output
    ), res.output

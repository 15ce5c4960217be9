"""What the CLI says and how it ends: a closed pipe is a quiet exit 0, ``serve`` says when it
creates a store, and the docs list what the code reads (tester's report, defects 17, 19, 20)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_runs import run_cli, sample_store

from memoryos_gpu.cli import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sample_store(tmp_path_factory.mktemp("exits_and_docs"))


# ------------------------------------------------------------------ #20: a closed pipe
@pytest.mark.parametrize("command", ["users", "retrieve"])  # click.echo, and rich's Console
def test_a_closed_stdout_pipe_is_a_quiet_exit_0(store: Path, command: str) -> None:
    args = ["--user", "maya_chen", "where?"] if command == "retrieve" else []
    env = {k: v for k, v in os.environ.items() if k not in ("MEMORYOS_GPU_STORE",)}
    env["MEMORYOS_GPU_EMBEDDER"] = "hashing"
    p = subprocess.Popen(
        [sys.executable, "-m", "memoryos_gpu", command, "--store", str(store), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader is gone before the command writes (`| head -0`)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err


# ------------------------------------------------------------------ #19: serve creates a store
def test_serve_warns_that_it_creates_a_new_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memoryos_gpu.server.app as server_app

    served: dict[str, Any] = {}

    def run(**kwargs: Any) -> None:
        served.update(kwargs)

    monkeypatch.setattr(server_app, "run", run)
    typo = tmp_path / "typo_store"
    res = run_cli("serve", "--store", typo, "--workers", "0")
    assert res.exit_code == 0, res.output
    assert served["store"] == str(typo)
    assert f"warning: no store at {typo} yet: the server will create a new, empty one" in res.stderr


def test_serve_on_an_existing_store_does_not_warn(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memoryos_gpu.server.app as server_app

    monkeypatch.setattr(server_app, "run", lambda **kwargs: None)
    res = run_cli("serve", "--store", store, "--workers", "0")
    assert res.exit_code == 0, res.output
    assert "will create a new, empty one" not in res.stderr


# ------------------------------------------------------------------ #17: docs and help
def test_the_readme_command_list_names_every_command() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = text.split("## Command line", 1)[1].split("```", 1)[0]
    for name in cli.commands:
        shown = "eval" if name == "eval" else name
        assert f"`{shown}`" in listed, name


def test_docs_list_the_variables_and_transports_the_code_reads() -> None:
    from memoryos_gpu.server.mcp_server import _parser

    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for variable in ("MEMORYOS_GPU_API_KEYS", "MEMORYOS_GPU_LOCOMO"):
        assert f"| `{variable}` |" in doc, variable
    transport = next(a for a in _parser()._actions if "--transport" in a.option_strings)
    assert f"`--transport {'|'.join(transport.choices)}`" in doc


def test_serve_help_names_the_api_keys_variable() -> None:
    res = run_cli("serve", "--help")
    assert res.exit_code == 0
    assert "MEMORYOS_GPU_API_KEYS" in res.output


def test_a_broken_pipe_other_than_stdout_is_still_an_error(
    store: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import memoryos_gpu.store as store_pkg
    from memoryos_gpu.cli.app import main

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise BrokenPipeError(32, "Broken pipe (a server's connection)")

    monkeypatch.setattr(store_pkg, "open_store", broken)
    assert main(["users", "--store", str(store)]) == 1
    assert "error: " in capsys.readouterr().err

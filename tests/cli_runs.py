"""The CLI run in process as the CLI tests drive it: the hashing embedder, no store or key
from the environment, and a store of the sample chats made once per test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from memoryos_gpu.cli import cli
from memoryos_gpu.formats import sample_chats_path

HASHING = {"MEMORYOS_GPU_EMBEDDER": "hashing", "MEMORYOS_GPU_STORE": None, "MEMORYOS_GPU_KEY": None}


def run_cli(*args: object, env: dict[str, Any] | None = None) -> Result:
    """``memoryos-gpu ARGS`` in process (``env`` added to :data:`HASHING`)."""
    return CliRunner().invoke(cli, [str(a) for a in args], env={**HASHING, **(env or {})})


def sample_store(folder: Path) -> Path:
    """A store of the sample chats (users maya_chen, ...) in ``folder``."""
    path = folder / "st"
    res = run_cli("ingest", sample_chats_path(), "--store", path)
    assert res.exit_code == 0, res.output
    return path

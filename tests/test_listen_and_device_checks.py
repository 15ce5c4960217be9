"""An empty ``--host`` (``--host "$HOST"`` with the variable unset) listened on every interface,
open to the network, for ``serve`` and ``mcp --transport http``: refused now (exit 2, nothing
created). And ``mcp`` refuses a CUDA device torch does not see as a configuration error (exit
2) before its store is made, as the CLI's commands do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import run_cli

from memoryos_gpu.cli.options import device_problem


@pytest.mark.parametrize("host", ["", "  "])
def test_serve_refuses_an_empty_host(tmp_path: Path, host: str) -> None:
    res = run_cli("serve", "--store", tmp_path / "st", "--host", host, "--workers", "0")
    assert res.exit_code == 2, res.output
    assert "every interface" in res.output and "0.0.0.0" in res.output
    assert not (tmp_path / "st").exists()


def _mcp(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memoryos_gpu.server.mcp_server", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "MEMORYOS_GPU_EMBEDDER": "hashing"},
    )


def test_mcp_refuses_an_empty_host(tmp_path: Path) -> None:
    p = _mcp("--store", str(tmp_path / "st"), "--transport", "http", "--host", "", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "every interface" in p.stderr and not (tmp_path / "st").exists()


@pytest.mark.skipif(device_problem("cuda") is None, reason="a CUDA device is present")
def test_mcp_refuses_cuda_without_a_gpu_before_making_its_store(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "user_id": "u",
                "data_storage_path": str(tmp_path / "st"),
                "embedding_model_kwargs": {"device": "cuda"},
            }
        )
    )
    p = _mcp("--config", str(config), cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "torch sees no CUDA device" in p.stderr and not (tmp_path / "st").exists()
    p = _mcp("--store", str(tmp_path / "st2"), "--device", "cuda", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert not (tmp_path / "st2").exists()

"""A part used without its extra installed says which extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from memoryos_gpu.extras import EXTRAS, MissingExtra, require


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rank_bm25", None)  # import -> ImportError
    with pytest.raises(MissingExtra, match=r"pip install 'memoryos-gpu\[eval\]'"):
        require("rank_bm25", "eval", "the BM25 baseline")
    assert require("json", "eval", "x").dumps([]) == "[]"


def test_local_embedder_without_torch_names_embed(monkeypatch: pytest.MonkeyPatch) -> None:
    from memoryos_gpu.embed.local import Embedder

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtra, match=r"memoryos-gpu\[embed\]"):
        Embedder()


def test_every_extra_named_in_errors_is_declared() -> None:
    import tomllib

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = set(meta["project"]["optional-dependencies"])
    assert set(EXTRAS) <= declared, set(EXTRAS) - declared
    core = " ".join(meta["project"]["dependencies"])
    for heavy in ("torch", "transformers", "rank-bm25", "fastapi"):
        assert heavy not in core, heavy  # optional parts stay out of the core install


def test_embed_fast_brings_what_the_onnx_embedder_imports() -> None:
    """The ONNX embedder exports with torch, tokenizes with transformers and defaults to the
    bundled MiniLM: installed with embed-fast alone it failed (docs named only embed-fast)."""
    import tomllib

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "memoryos-gpu[embed]" in meta["project"]["optional-dependencies"]["embed-fast"]


# ------------------------------------------------------------------ the CLI says it in a line
def _cli_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``memoryos-gpu ARGS`` in a fresh interpreter in which ``module`` cannot be imported."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; "
        "from memoryos_gpu.cli.app import main; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )


def test_a_missing_extra_is_one_error_line_not_a_traceback(tmp_path: Path) -> None:
    sample = Path(__file__).parents[1] / "memoryos_gpu" / "data" / "sample_chats.jsonl"
    p = _cli_without("transformers", "ingest", str(sample), "--store", str(tmp_path / "s"))
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith("error: ") and "pip install 'memoryos-gpu[embed]'" in p.stderr


def test_mcp_without_the_server_extra_names_it(tmp_path: Path) -> None:
    """``serve`` said it; ``mcp`` ended in a traceback: No module named 'fastapi'."""
    p = _cli_without("fastapi", "mcp", "--store", str(tmp_path / "s"))
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert "the MCP server is not available" in p.stderr
    assert "pip install 'memoryos-gpu[server]'" in p.stderr


def test_eval_without_its_extra_says_so_before_ingesting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The BM25 baseline's package was first imported after the whole ingestion."""
    from memoryos_gpu.cli import measure
    from memoryos_gpu.cli.app import main

    def no_engine(*a: object, **k: object) -> None:
        raise AssertionError("an engine was built before the missing extra was said")

    monkeypatch.setitem(sys.modules, "rank_bm25", None)
    monkeypatch.setattr(measure, "make_engine", no_engine)
    locomo = Path(__file__).parent / "data" / "locomo_mini.json"
    assert main(["eval", str(locomo), "--quick"]) == 1
    assert "pip install 'memoryos-gpu[eval]'" in capsys.readouterr().err

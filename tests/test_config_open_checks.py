"""Settings the engine refuses are refused before any store is created or changed, and the CLI
reports them as a bad configuration (exit 2): the new-user configuration sweep, defects 1, 2, 7,
8 and 10."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runs import run_cli, sample_store

from memoryos_gpu.config import ConfigError, EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.formats import sample_chats_path
from memoryos_gpu.llm.base import LLMBackendError, LLMConfigError


def _cuda_seen() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


no_gpu = pytest.mark.skipif(_cuda_seen(), reason="needs a machine where torch sees no GPU")
SERVER = {"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"}


def _engine(store: Path, **kw: object) -> MemoryEngine:
    return MemoryEngine(EngineConfig(store=str(store), embedder="hashing", device="cpu", **kw))


# ------------------------------------------------------------------ 1: a smaller mtm_capacity
def _segmented_store(path: Path) -> None:
    """A store of one user whose segments fill slots 0..3 (theta 2: every page its own
    segment)."""
    with _engine(path, memory=preset("paper", stm_capacity=1, mtm_capacity=4, theta=2.0)) as e:
        for i in range(6):
            e.add("alice", f"topic {i} word{i} thing{i}", "ok", timestamp=float(i + 1))
        assert e.store.arena_extent(16, 100).segment_width == 4


def test_a_store_refuses_an_mtm_capacity_below_its_segment_slots(tmp_path: Path) -> None:
    store = tmp_path / "s"
    _segmented_store(store)
    before = (store / "memory.sqlite3").read_bytes()
    with pytest.raises(ConfigError) as ei:
        _engine(store, memory=preset("paper", mtm_capacity=2))
    message = str(ei.value)
    assert "mtm_capacity 2" in message and "mtm_capacity >= 4" in message
    assert "--preset reference" in message and "[memory] mtm_capacity = 4" in message
    assert (store / "memory.sqlite3").read_bytes() == before  # refused, nothing written
    with _engine(store, memory=preset("paper", mtm_capacity=4)) as e:  # as told: it opens
        assert e.retrieve("alice", "topic 3").pages is not None


def test_the_cli_refuses_a_smaller_mtm_capacity_as_a_config_error(tmp_path: Path) -> None:
    big, small = tmp_path / "big.toml", tmp_path / "small.toml"
    big.write_text("[memory]\nstm_capacity = 1\nmtm_capacity = 4\ntheta = 2.0\n")
    small.write_text("[memory]\nmtm_capacity = 2\n")
    pages = tmp_path / "p.jsonl"
    pages.write_text(
        "".join(
            f'{{"user_id": "alice", "user_input": "topic {i} word{i}", "agent_response": "ok", '
            f'"timestamp": {i + 1}}}\n'
            for i in range(6)
        )
    )
    store = tmp_path / "st"
    assert run_cli("ingest", pages, "--store", store, "--config", big).exit_code == 0
    res = run_cli("retrieve", "--store", store, "--config", small, "--user", "alice", "topic")
    assert res.exit_code == 2, res.output
    assert "mtm_capacity >= 4" in res.output and "segment slot out of range" not in res.output
    ok = run_cli("retrieve", "--store", store, "--config", big, "--user", "alice", "topic")
    assert ok.exit_code == 0, ok.output


# ------------------------------------------------------------------ 2: refused before the store
@no_gpu
def test_cuda_without_a_gpu_leaves_no_store(tmp_path: Path) -> None:
    store = tmp_path / "x"
    with pytest.raises(Exception, match=r"CUDA|cuda|torch"):
        MemoryEngine(EngineConfig(store=str(store), embedder="hashing", device="cuda"))
    assert not store.exists()


def test_an_llm_option_typo_leaves_no_store(tmp_path: Path) -> None:
    store = tmp_path / "x"
    llm = LLMConfig(mode="llm", **SERVER, options={"temprature": 0.5})
    with pytest.raises(LLMConfigError, match="temprature"):
        _engine(store, llm=llm)
    assert not store.exists()


def test_a_missing_llm_model_file_leaves_no_store(tmp_path: Path) -> None:
    store = tmp_path / "x"
    llm = LLMConfig(mode="llm", backend="transformers", model=str(tmp_path / "none.gguf"))
    with pytest.raises(LLMConfigError, match="not found"):  # a setting's error: exit 2
        _engine(store, llm=llm)
    assert not store.exists()


def test_vllm_not_installed_leaves_no_store(tmp_path: Path) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vllm is installed here")
    store = tmp_path / "x"
    with pytest.raises(LLMBackendError):
        _engine(store, llm=LLMConfig(mode="llm", backend="vllm", model="m"))
    assert not store.exists()


def test_the_cli_reports_an_llm_option_typo_as_exit_2_and_makes_no_store(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[llm]\nmode = "llm"\nbackend = "openai"\nmodel = "m"\n'
        'base_url = "http://127.0.0.1:9/v1"\noptions = {temprature = 0.5}\n'
    )
    store = tmp_path / "s"
    res = run_cli("ingest", sample_chats_path(), "--store", store, "--config", cfg)
    assert res.exit_code == 2, res.output
    assert "temprature" in res.output and "Traceback" not in res.output
    assert not store.exists()


@no_gpu
def test_the_cli_refuses_cuda_without_a_gpu_before_the_store(tmp_path: Path) -> None:
    store = tmp_path / "s"
    res = run_cli("ingest", sample_chats_path(), "--store", store, "--device", "cuda")
    assert res.exit_code == 2, res.output
    assert not store.exists()


# ------------------------------------------------------------------ 8: bench --device cuda
@no_gpu
def test_bench_on_cuda_without_a_gpu_is_a_usage_error() -> None:
    res = run_cli("bench", "--device", "cuda", "--users", 2, "--slots", 2)
    assert res.exit_code == 2, res.output
    assert "--device cuda" in res.output


# ------------------------------------------------------------------ 7, 10: unused flags
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sample_store(tmp_path_factory.mktemp("open_checks"))


def test_llm_flags_without_llm_mode_are_warned_about(store: Path) -> None:
    flags = ["--llm-backend", "openai", "--llm-base-url", "http://127.0.0.1:9/v1"]
    res = run_cli("stats", "--store", store, *flags, "--llm-model", "gpt")
    assert res.exit_code == 0, res.output
    assert "have no effect without --llm-mode llm" in res.output
    assert "--llm-backend, --llm-model, --llm-base-url" in res.output


def test_embedding_flags_the_embedder_does_not_read_are_warned_about(store: Path) -> None:
    res = run_cli(
        "stats", "--store", store, "--embedder", "hashing", "--embedding-dtype", "float16"
    )
    assert res.exit_code == 0, res.output
    assert "--embedding-dtype have no effect with the hashing embedder" in res.output


def test_no_warning_without_unused_flags(store: Path) -> None:
    res = run_cli("stats", "--store", store)
    assert res.exit_code == 0 and "warning:" not in res.output


@pytest.mark.parametrize("flag", ["--embedding-model", "--llm-model"])
def test_an_empty_model_flag_is_refused(store: Path, flag: str) -> None:
    res = run_cli("stats", "--store", store, flag, "")
    assert res.exit_code == 2, res.output
    assert "is empty" in res.output


def test_an_embedding_url_without_its_scheme_is_refused(tmp_path: Path) -> None:
    flags = ["--embedder", "openai", "--embedding-model", "m", "--embedding-base-url"]
    res = run_cli("ingest", sample_chats_path(), "--store", tmp_path / "s", *flags, "localhost:9")
    assert res.exit_code == 2, res.output
    assert "embedding_base_url must start with http:// or https://" in res.output
    assert not (tmp_path / "s").exists()

"""Bad configuration is a usage error (exit 2) found before any store is opened, shows no
secret, and ``retrieve`` needs no LLM (tester's report, defects 4, 5, 6, 7 and 10)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_runs import run_cli, sample_store

SECRET = "SECRETPW"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sample_store(tmp_path_factory.mktemp("config_checks"))


# ------------------------------------------------------------------ #4, #10: mcp's config
@pytest.mark.parametrize("how", ["flag", "variable"])
def test_mcp_refuses_an_empty_store_and_makes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.chdir(tmp_path)
    if how == "flag":
        res = run_cli("mcp", "--store", "")
    else:
        res = run_cli("mcp", env={"MEMORYOS_GPU_STORE": ""})
    assert res.exit_code == 2, res.output
    assert "is empty" in res.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ["--config", "nonexist.toml"],
        ["--config", "bad.toml"],
        ["--user-id", ""],
        ["--log-level", "BOGUS"],
    ],
    ids=["missing-config", "unknown-key", "blank-user", "bad-log-level"],
)
def test_mcp_config_errors_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text("nonsense_key = 1\n")
    res = run_cli("mcp", "--store", tmp_path / "st", *args)
    assert res.exit_code == 2, res.output
    assert not (tmp_path / "st").exists()


# ------------------------------------------------------------------ #5: no credentials shown
@pytest.mark.parametrize("via", ["file", "flag"])
def test_a_bad_base_url_is_named_without_its_value(store: Path, tmp_path: Path, via: str) -> None:
    url = f"ftp://user:{SECRET}@host/v1"
    if via == "file":
        cfg = tmp_path / "bu.toml"
        cfg.write_text(f'[llm]\nbase_url = "{url}"\n')
        res = run_cli("stats", "--store", store, "--config", cfg)
    else:
        res = run_cli("stats", "--store", store, "--llm-base-url", url)
    assert res.exit_code == 2, res.output
    assert "base_url" in res.output
    assert SECRET not in res.output and "user:" not in res.output


# ------------------------------------------------------------------ #6: checked before the open
@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--llm-backend", "openai"], "--llm-base-url"),
        (["--llm-backend", "openai", "--llm-base-url", "http://127.0.0.1:9/v1"], "--llm-model"),
        (["--llm-backend", "vllm"], "--llm-model"),
    ],
    ids=["openai-no-url", "openai-no-model", "vllm-no-model"],
)
def test_incomplete_llm_settings_are_a_usage_error_before_ingest_makes_a_store(
    tmp_path: Path, flags: list[str], problem: str
) -> None:
    res = run_cli("ingest", "/dev/null", "--store", tmp_path / "new", "--llm-mode", "llm", *flags)
    assert res.exit_code == 2, res.output
    assert problem in res.output
    assert list(tmp_path.iterdir()) == []


def test_chat_with_incomplete_llm_settings_is_a_usage_error(store: Path) -> None:
    url = ["--llm-base-url", "http://127.0.0.1:9/v1"]
    res = run_cli(
        "chat", "--store", store, "--user", "maya_chen", "--llm-mode", "llm",
        "--llm-backend", "openai", *url, "-m", "hi",
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "--llm-model" in res.output


def test_cuda_without_a_gpu_is_a_usage_error_before_ingest_makes_a_store(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: --device cuda is valid")
    res = run_cli("ingest", "/dev/null", "--store", tmp_path / "cudast", "--device", "cuda")
    assert res.exit_code == 2, res.output
    assert "CUDA" in res.output
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ #7: retrieve builds no LLM
def test_retrieve_builds_no_llm_backend(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import memoryos_gpu.llm.factory as factory

    def no_backend(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("retrieve built an LLM backend")

    monkeypatch.setattr(factory, "make_backend", no_backend)
    for flags in (["--llm-mode", "llm"], ["--llm-mode", "llm", "--llm-backend", "openai"]):
        res = run_cli(
            "retrieve", "--store", store, "--user", "maya_chen", "where?", "--json", *flags
        )
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["user_id"] == "maya_chen"


# ------------------------------------------------------------------ #10: an empty store key
def test_an_empty_store_key_variable_is_a_usage_error(store: Path) -> None:
    res = run_cli("stats", "--store", store, env={"MEMORYOS_GPU_KEY": ""})
    assert res.exit_code == 2, res.output
    assert "$MEMORYOS_GPU_KEY" in res.output and "empty" in res.output

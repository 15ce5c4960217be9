"""A secret given as a command-line flag is warned about (security sweep, defect 6).

``serve --llm-api-key sk-...`` and ``--llm-base-url http://user:password@...`` stayed readable in
full by every local user in the process list (``ps``) for as long as the server ran; the
variable and the config file are not shown there. One warning line names what to use instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runs import run_cli, sample_store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sample_store(tmp_path_factory.mktemp("secret_flags"))


def test_an_api_key_flag_is_warned_about(store: Path) -> None:
    res = run_cli("stats", "--store", store, "--llm-api-key", "sk-SECRET1")
    assert res.exit_code == 0, res.output
    assert "--llm-api-key: the command line is visible" in res.output
    assert "$MEMORYOS_GPU_LLM_API_KEY" in res.output and "sk-SECRET1" not in res.output


def test_a_password_in_the_base_url_is_warned_about(store: Path) -> None:
    url = "http://bob:PwdSECRET@127.0.0.1:9/v1"
    res = run_cli("stats", "--store", store, "--llm-base-url", url)
    assert res.exit_code == 0, res.output
    assert "a password in --llm-base-url: the command line is visible" in res.output
    assert "PwdSECRET" not in res.output


def test_the_key_in_its_variable_is_not(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_LLM_API_KEY", "sk-SECRET2")
    res = run_cli("stats", "--store", store, "--llm-base-url", "http://127.0.0.1:9/v1")
    assert res.exit_code == 0, res.output
    assert "command line is visible" not in res.output

"""Shared fixtures for the LLM backend tests: the bundled GGUF, a real llama.cpp server, and
one TransformersBackend loaded once per session."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

IN_CI = bool(os.environ.get("CI"))


def _need(condition: bool, reason: str) -> None:
    """Skip locally when a heavy optional dependency is missing; in CI that is a failure."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{reason} (CI is set, so this must not be skipped)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from memoryos_gpu.llm.base import LLMBackendError
    from memoryos_gpu.llm.transformers_backend import bundled_smollm2_path

    try:
        return bundled_smollm2_path()
    except LLMBackendError as e:
        _need(False, str(e))
        raise  # unreachable


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def llama_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real llama-cpp-python OpenAI-compatible server on loopback serving SmolLM2."""
    _need(
        importlib.util.find_spec("llama_cpp") is not None,
        "llama-cpp-python is not installed (see docs/llm_backends.md for the portable build)",
    )
    port = _free_port()
    log_path = tmp_path_factory.mktemp("llama") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(smollm2_gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "2048",
        "--n_threads",
        "2",
    ]
    log = open(log_path, "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"llama_cpp.server exited with {proc.returncode}:\n"
                    + log_path.read_text()[-3000:]
                )
            try:
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"llama_cpp.server not ready after 120 s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield base + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()


@pytest.fixture(scope="session")
def tf_backend(smollm2_gguf: Path):
    from memoryos_gpu.llm import TransformersBackend

    backend = TransformersBackend(device="cpu", batch_size=8, max_input_tokens=1024)
    yield backend
    backend.close()


@pytest.fixture
def server():
    """A scripted OpenAI-compatible server (``fake_openai_server.FakeServer``)."""
    from fake_openai_server import FakeServer

    s = FakeServer()
    yield s
    s.close()

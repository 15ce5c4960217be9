"""The log of a real ``memoryos-gpu serve`` (subprocesses: what an operator reads). Its LLM is
an OpenAI-compatible fake whose ``--llm-base-url`` carries a password: the password never
shows, at INFO nor at DEBUG, in one process nor across the workers and the engine process;
httpx's per-request lines show at DEBUG only; uvicorn's lines carry the timestamp and the
process tag of the app's; one line says what was loaded; the processes' starts and stops are
INFO, so ``--log-level WARNING`` is quiet while nothing is wrong; an LLM that is down is one
WARNING for a burst of requests, not one per request."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

from tests.llm.fake_openai_server import FakeServer
from tests.served import ROOT, free_port, wait_ready

PASSWORD = "pa55word"
API_KEY = "sk-topsecret-123"
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


@pytest.fixture
def llm() -> Iterator[FakeServer]:
    fake = FakeServer()
    try:
        yield fake
    finally:
        fake.close()


def serve_log(
    tmp_path: Path, llm: FakeServer, args: list[str], responds: int = 1, adds: int = 1
) -> str:
    """Run ``serve ARGS`` against ``llm``, add a page and ask ``responds`` times, stop it with
    SIGTERM; its log (stdout and stderr)."""
    port = free_port()
    url = f"http://bob:{PASSWORD}@127.0.0.1:{llm.port}/v1"
    env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_API_KEYS"}
    env.update(
        MEMORYOS_GPU_EMBEDDER="hashing", OMP_WAIT_POLICY="PASSIVE", MEMORYOS_GPU_LLM_API_KEY=API_KEY
    )
    cmd = [
        *(sys.executable, "-m", "memoryos_gpu", "serve", "--store", ":memory:"),
        *("--port", str(port), "--llm-mode", "llm", "--llm-backend", "openai"),
        *("--llm-base-url", url, "--llm-model", "m", *args),
    ]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(proc, base, lambda: log.read_text()[-3000:])
        with httpx.Client(base_url=base, timeout=30) as client:
            for i in range(adds):
                page = {"user_input": f"I like tea {i}", "agent_response": "noted"}
                assert client.post("/v1/users/u1/pages", json=page).status_code == 201
            for _ in range(responds):
                client.post("/v1/users/u1/respond", json={"query": "what do I like?"})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    # the CLI's one line for the password the command line carries (test_secret_flags.py),
    # before any logging: the log is what follows it
    said, _, rest = text.partition("\n")
    assert said.startswith("warning: a password in --llm-base-url"), text[:500]
    return rest


def test_one_process_at_info(tmp_path: Path, llm: FakeServer) -> None:
    log = serve_log(tmp_path, llm, ["--workers", "0"])
    assert len(llm.bodies) >= 1  # the LLM was asked
    assert PASSWORD not in log and API_KEY not in log, log
    assert "HTTP Request:" not in log, log  # httpx's per-request line: off at INFO
    assert all(LINE.match(line) for line in log.splitlines()), log  # uvicorn's too
    assert "INFO uvicorn.access: 127.0.0.1:" in log and '"POST /v1/users/u1/respond' in log
    (loaded,) = [line for line in log.splitlines() if "memoryos-gpu: loaded in" in line]
    assert f"LLM openai m http://bob:***@127.0.0.1:{llm.port}/v1" in loaded, loaded
    assert "embedder hashing" in loaded and "device cpu" in loaded and "store " in loaded


def test_workers_and_engine_at_debug(tmp_path: Path, llm: FakeServer) -> None:
    log = serve_log(tmp_path, llm, ["--workers", "1", "--log-level", "DEBUG"])
    assert PASSWORD not in log and API_KEY not in log, log
    # the engine process asks the LLM: its httpx line shows at DEBUG, masked
    assert re.search(r"httpx\[engine\]: HTTP Request: POST http://bob:\*\*\*@", log), log
    assert "INFO uvicorn.access[worker 0]: 127.0.0.1:" in log, log
    assert re.search(r"DEBUG \S+\[engine\]: ", log), log  # the level reached the engine
    assert "memoryos_gpu.server[engine]: memoryos-gpu: loaded in" in log, log
    for started in (
        "INFO memoryos_gpu.server: memoryos-gpu: engine process started",
        "INFO memoryos_gpu.server: memoryos-gpu: HTTP worker 0 started",
    ):
        assert started in log, log


def test_warning_level_is_quiet_while_nothing_is_wrong(tmp_path: Path, llm: FakeServer) -> None:
    log = serve_log(
        tmp_path,
        llm,
        ["--workers", "1", "--log-level", "WARNING", "--api-keys", _keys(tmp_path)],
        adds=0,
        responds=0,
    )
    assert log == ""  # no start, stop nor request line: nothing went wrong


def test_an_llm_down_is_one_warning_for_a_burst(tmp_path: Path, llm: FakeServer) -> None:
    llm.script = lambda n, body: (500, {}, {"error": {"message": "boom"}}, 0.0)
    log = serve_log(tmp_path, llm, ["--workers", "0"], responds=15)
    said = [ln for ln in log.splitlines() if "respond: the LLM cannot be used" in ln]
    assert len(said) == 1, log
    assert PASSWORD not in log


def _keys(tmp_path: Path) -> str:
    """A key file: a server with keys logs no OPEN-mode warning."""
    path = tmp_path / "keys.txt"
    path.write_text("key-acme-0123456789 acme\n")
    return str(path)

"""``chat``'s interactive loop (CLI report defect #16): Ctrl-C at the prompt exits 130
(interrupted), as every command does, not 0; with stdin not a terminal no ``you> `` prompt
goes to stdout between the answers; with stdout not a terminal it goes to stderr."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli import _FakeOpenAI

from memoryos_gpu.cli import memory


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Path]:
    """A config file for chat through the fake server, and an empty store it names."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path = tmp_path / "engine.toml"
    path.write_text(
        f'store = "{tmp_path / "store"}"\n[llm]\nmode = "llm"\nbackend = "openai"\n'
        f'base_url = "http://127.0.0.1:{server.server_address[1]}"\nmodel = "fake"\n'
    )
    assert _cli("ingest", "/dev/null", "--config", path).returncode == 0
    yield path
    server.shutdown()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_STORE"}
    return {**env, "MEMORYOS_GPU_EMBEDDER": "hashing"}


def _cli(*args: object, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", *map(str, args)],
        capture_output=True,
        text=True,
        input=input,
        env=_env(),
        timeout=180,
    )


def test_piped_input_gets_answers_without_prompts(config: Path) -> None:
    p = _cli("chat", "--config", config, "--user", "u", input="hello\n\n  \nagain\n/quit\nx\n")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()  # was: "you> assistant> ..."
    assert len(lines) == 2 and all(line.startswith("assistant> fake answer") for line in lines)
    assert "you>" not in p.stderr


def test_ctrl_c_at_the_prompt_exits_130(config: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "memoryos_gpu", "chat", "--config", str(config), "--user", "u"],
        stdin=subprocess.PIPE,  # kept open: chat waits for a line
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        # a suite started in the background inherits SIGINT ignored, and so would chat
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        seen = ""
        while "chatting as u" not in seen:  # the banner: the loop starts right after it
            line = proc.stderr.readline()
            assert line, f"chat ended before its prompt: {seen}"
            seen += line
        time.sleep(1.0)  # into input()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err  # was: 0, as if the session had ended
    assert "interrupted" in err


@pytest.mark.parametrize(
    ("stdin_tty", "stdout_tty", "prompt_on"),
    [(False, False, None), (False, True, None), (True, False, "stderr"), (True, True, "input")],
)
def test_where_the_prompt_goes(
    stdin_tty: bool,
    stdout_tty: bool,
    prompt_on: str | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    asked: list[tuple[object, ...]] = []
    monkeypatch.setattr("builtins.input", lambda *a: asked.append(a) or "line")
    ttys = {id(sys.stdin): stdin_tty, id(sys.stdout): stdout_tty}
    monkeypatch.setattr(memory, "is_terminal", lambda stream: ttys[id(stream)])
    assert memory._read_message() == "line"
    out, err = capsys.readouterr()
    assert "you>" not in out
    assert asked == ([("you> ",)] if prompt_on == "input" else [()])
    assert err == ("you> " if prompt_on == "stderr" else "")

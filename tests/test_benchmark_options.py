"""The benchmark scripts' options (benchmarks/*.py, their helpers in benchmarks/cli_args.py).

Why: benchmarks/README.md promises a bad option is "refused before the run with a one-line
error, exit 2", but a user sweep found tracebacks (0 / negative counts, a missing LoCoMo file,
``--device nosuch``), ``--quick`` silently overriding options given explicitly (``--quick
--embedder minilm`` ran the hashing embedder), options without help text, and a 50-line
traceback on Ctrl-C. One rule for each, in cli_args: ``Parser`` (one-line errors),
``apply_defaults`` (--quick sets only the options not given), ``run_main`` (Ctrl-C: one line,
exit 130), ``write_json`` (atomic).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
LOCOMO_MINI = Path(__file__).parent / "data" / "locomo_mini.json"


def env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONDONTWRITEBYTECODE": "1",
        "MEMORYOS_GPU_EMBEDDER": "hashing",
        "MEMORYOS_GPU_LOCOMO": str(LOCOMO_MINI),
        **extra,
    }


def script(name: str, *args: Any, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / name), *map(str, args)],
        capture_output=True,
        text=True,
        env=env(**extra),
        timeout=120,
    )


def module(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/<name>.py as a fresh module (it imports ``cli_args`` from its folder)."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------- 1: bad options, one line, exit 2
BAD = [
    ("kernel_speed.py", ["--device", "nosuch"], {}),
    ("kernel_speed.py", ["--slots", "0"], {}),
    ("kernel_speed.py", ["--dim", "-3"], {}),
    ("kernel_speed.py", ["--reference-queries", "0"], {}),
    ("kernel_speed.py", ["--quick", "--batch", "128"], {}),  # more than --users 64
    ("store_cache.py", ["--waves", "0"], {}),
    ("store_cache.py", ["--quick"], {"MEMORYOS_GPU_LOCOMO": "/nonexistent/nope.json"}),
    ("history.py", ["--quick"], {"MEMORYOS_GPU_LOCOMO": "/nonexistent/nope.json"}),
    ("drain.py", ["--backlog", "0"], {}),
    ("drain.py", ["--quick"], {"MEMORYOS_GPU_LOCOMO": "/nonexistent/nope.json"}),
    ("instructions.py", ["--quick"], {"MEMORYOS_GPU_LOCOMO": "/nonexistent/nope.json"}),
    ("reopen.py", ["--segments", "0"], {}),
    ("derived_latency.py", ["--llm-seconds", "-1"], {}),
    ("throughput.py", ["--queries", "0"], {}),
    ("serve_load.py", ["--write-frac", "2"], {}),
]


@pytest.mark.parametrize(("name", "args", "extra"), BAD, ids=lambda v: str(v))
def test_a_bad_option_is_one_line_and_exit_2(
    name: str, args: list[str], extra: dict[str, str]
) -> None:
    p = script(name, *args, **extra)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{name}: error: " in lines[0], p.stderr


def test_cuda_without_a_device_is_the_cli_s_one_line() -> None:
    from memoryos_gpu import ops

    if ops.build_info()["cuda_usable"]:
        pytest.skip("a usable CUDA device: --device cuda is valid here")
    p = script("kernel_speed.py", "--device", "cuda")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "device 'cuda' requested but torch sees no CUDA device" in p.stderr


# ----------------------------------------------- 2: --quick sets only the options not given
class Stop(Exception):
    """Raised by a stub where the run would start: the test has what it needs."""


def test_apply_defaults_lets_an_explicit_option_win(monkeypatch: pytest.MonkeyPatch) -> None:
    cli_args = module("cli_args", monkeypatch)
    args = argparse.Namespace(quick=True, users=7, pages=None, embedder=None)
    cli_args.apply_defaults(
        args,
        full={"users": 100, "pages": 20, "embedder": "minilm"},
        quick={"users": 2, "pages": 5},
    )
    assert (args.users, args.pages, args.embedder) == (7, 5, "minilm")


def test_kernel_speed_quick_keeps_the_users_and_batch_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mod = module("kernel_speed", monkeypatch)
    seen: list[argparse.Namespace] = []

    def bench(run: argparse.Namespace) -> dict[str, Any]:
        seen.append(run)
        raise Stop

    monkeypatch.setattr(mod, "bench", bench)
    with pytest.raises(Stop):
        mod.main(["--quick", "--routine", "engine", "--users", "100", "--batch", "50"])
    run = seen[0]
    assert (run.users, run.batch) == (100, 50)  # given: kept
    assert (run.repeat, run.pages_per_segment, run.reference_queries) == (2, 4, 32)  # quick's


def test_throughput_quick_keeps_the_embedder_given(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = module("throughput", monkeypatch)

    def make_embedder(kind: str) -> Any:
        raise Stop(kind)

    monkeypatch.setattr(mod, "make_embedder", make_embedder)
    with pytest.raises(Stop) as got:
        mod.main(["--quick", "--embedder", "minilm", "--data", str(LOCOMO_MINI)])
    assert got.value.args == ("minilm",)


def test_derived_latency_quick_keeps_the_llm_seconds_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mod = module("derived_latency", monkeypatch)

    def run(users: int, llm_seconds: float, lock_held: bool) -> dict[str, Any]:
        raise Stop(llm_seconds)

    monkeypatch.setattr(mod, "run", run)
    with pytest.raises(Stop) as got:
        mod.main(["--quick", "--llm-seconds", "0.5"])
    assert got.value.args == (0.5,)
    with pytest.raises(Stop) as got:
        mod.main(["--quick"])
    assert got.value.args == (0.1,)


# ------------------------------------------------------------------ 5: atomic JSON, Ctrl-C
def test_write_json_never_shows_a_partial_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cli_args = module("cli_args", monkeypatch)
    out = tmp_path / "out.json"
    out.write_text('{"old": true}\n')
    replaced: list[tuple[str, str]] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        # the new text is complete in a temporary file before it takes the target's name
        assert json.loads(Path(src).read_text()) == {"new": [1, 2]}
        assert json.loads(out.read_text()) == {"old": True}
        replaced.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    cli_args.write_json(out, {"new": [1, 2]})
    assert replaced and replaced[0][1] == str(out)
    assert json.loads(out.read_text()) == {"new": [1, 2]}
    with pytest.raises(TypeError):  # not serialisable: the old file stays as it was
        cli_args.write_json(out, {"bad": object()})
    assert json.loads(out.read_text()) == {"new": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left


def test_run_main_turns_ctrl_c_into_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cli_args = module("cli_args", monkeypatch)
    monkeypatch.setattr(cli_args, "handle_sigterm", lambda: None)
    monkeypatch.setattr(sys, "argv", ["x.py"])

    def main() -> int:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as done:
        cli_args.run_main(main)
    assert done.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted; nothing written"


def test_sigint_during_a_run_is_one_line_exit_130_and_no_file(tmp_path: Path) -> None:
    """ingest.py's parent, interrupted while its first child runs (the child takes over a
    second to start: the signal lands in the run, not in the imports)."""
    out = tmp_path / "ingest.json"
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "ingest.py"), "--quick", "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        # Ctrl-C as a terminal delivers it: a test run started in the background by a shell
        # inherits SIGINT ignored, and a Python started so never raises KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    seen = ""
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen += line
        if line.startswith("running ") or not line:
            break
    assert "running " in seen, seen
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, (proc.returncode, stderr[-3000:])
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "interrupted; nothing written"
    assert not out.exists()
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------- 6: --help text
SCRIPTS = sorted(
    p.stem for p in BENCH.glob("*.py") if p.stem != "cli_args" and "add_argument(" in p.read_text()
)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_option_has_help_text(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = module(name, monkeypatch)
    parsers: list[argparse.ArgumentParser] = []

    def parse_args(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        parsers.append(self)
        raise Stop

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    with pytest.raises(Stop):
        mod.main()
    missing = [
        a.option_strings[0]
        for a in parsers[0]._actions
        if a.option_strings and a.help is None and a.dest != "help"
    ]
    assert not missing, f"{name}.py: options without help: {missing}"
    text = parsers[0].format_help()
    assert "(see above)" not in text

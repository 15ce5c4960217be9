"""Edges of ``memoryos-gpu serve``'s configuration.

* ``[server]`` numbers are finite and bounded: ``max_wait_ms = inf`` (or ``1e12``) used to start
  a server whose batching window never closed, so it answered nothing; now it is refused before
  anything starts (exit 2, naming the key).
* A port in use or a ``--host`` that is no address: one ``error:`` line naming the address and
  the cause, exit 1, in every worker mode, checked before the engine loads (it was a traceback
  with ``--workers N``, and uvicorn's exit 3 after the model had loaded with ``--workers 0``).
* A key file that is not UTF-8: the error names the file and line, as other key-file errors do.

No test here serves: ``uvicorn.run`` (and, where the refusal comes before it, the workers'
supervisor) is replaced by a recorder; the ``--workers N`` address refusals happen before any
process is started.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from pydantic import ValidationError  # noqa: E402

from memoryos_gpu.cli import cli  # noqa: E402
from memoryos_gpu.server.auth import KeyFileError, parse_key_file  # noqa: E402
from memoryos_gpu.server.settings import ServerSettings  # noqa: E402

KEY = "key-acme-0123456789"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The apps ``uvicorn.run`` was given, instead of serving them (``--workers 0``)."""
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_API_KEYS", raising=False)
    apps: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    return apps


@pytest.fixture
def started(served: list[Any], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What was served, ``--workers N`` included (its supervisor replaced by a recorder): a
    refusal that failed to happen records a start instead of leaving processes serving."""
    import memoryos_gpu.server.workers as workers_module

    monkeypatch.setattr(workers_module, "run_workers", lambda *a, **kw: served.append(kw))
    return served


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process (here: this test) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(tmp_path: Path, *args: str, port: int | None = None) -> Result:
    store = tmp_path / "store"
    argv = ["serve", "--store", str(store), "--embedder", "hashing"]
    argv += ["--port", str(port if port is not None else free_port()), *args]
    return CliRunner().invoke(cli, argv)


# ============================================================================ [server] bounds
@pytest.mark.parametrize(
    "line",
    [
        "max_wait_ms = inf",
        "write_max_wait_ms = 1e12",
        "respond_max_wait_ms = nan",
        "derived_max_wait_ms = 60001",
        "rate_limit_per_s = inf",
        "max_wait_timeout_s = inf",
        "max_body_bytes = 1_000_000_000_000",
        "read_queue_limit = 1_000_000_000_000",
    ],
)
@pytest.mark.parametrize("workers", ["0", "1"])
def test_an_infinite_or_huge_server_setting_is_refused_naming_it(
    tmp_path: Path, started: list[Any], line: str, workers: str
) -> None:
    cfg = tmp_path / "memoryos.toml"
    cfg.write_text(f"[server]\n{line}\n")
    res = serve(tmp_path, "--config", str(cfg), "--workers", workers)
    assert res.exit_code == 2, res.output
    key = line.split(" = ")[0]
    assert f"invalid [server] settings in {cfg}" in res.output and key in res.output
    assert started == [] and not (tmp_path / "store").exists()


def test_the_documented_bounds_themselves_are_accepted() -> None:
    s = ServerSettings(
        max_wait_ms=60_000, write_max_wait_ms=60_000, derived_max_wait_ms=60_000, retry_after_s=3600
    )
    assert (s.max_wait_ms, s.derived_max_wait_ms, s.retry_after_s) == (60_000, 60_000, 3600)
    for bad in ({"max_wait_ms": float("inf")}, {"write_max_wait_ms": float("nan")}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            ServerSettings(**bad)


# ============================================================================ address in use
@pytest.mark.parametrize("mode", [["--workers", "0"], ["--workers", "1"]])
def test_a_port_in_use_is_one_error_line_and_exit_1(
    tmp_path: Path, served: list[Any], taken_port: int, mode: list[str]
) -> None:
    res = serve(tmp_path, *mode, port=taken_port)
    assert res.exit_code == 1, res.output
    assert f"error: cannot listen on 127.0.0.1:{taken_port}: address already in use" in res.output
    assert "Traceback" not in res.output
    assert served == []  # told before the app (and its engine) was built


def test_a_port_in_use_with_engines_creates_no_shards(
    tmp_path: Path, served: list[Any], taken_port: int
) -> None:
    res = serve(tmp_path, "--workers", "1", "--engines", "2", port=taken_port)
    assert res.exit_code == 1, res.output
    assert f"cannot listen on 127.0.0.1:{taken_port}" in res.output
    assert not (tmp_path / "store").exists()


def test_the_single_process_server_checks_the_port_before_loading_the_engine(
    tmp_path: Path, served: list[Any], taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memoryos_gpu.server.app as app_module

    built: list[Any] = []
    monkeypatch.setattr(app_module, "create_app", lambda *a, **kw: built.append(a))
    res = serve(tmp_path, "--workers", "0", port=taken_port)
    assert res.exit_code == 1, res.output
    assert built == [] and served == []


@pytest.mark.parametrize("mode", [["--workers", "0"], ["--workers", "1"]])
def test_a_host_that_is_no_address_is_one_error_line_and_exit_1(
    tmp_path: Path, served: list[Any], mode: list[str]
) -> None:
    res = serve(tmp_path, *mode, "--host", "999.1.1.1")
    assert res.exit_code == 1, res.output
    assert "error: cannot listen on 999.1.1.1:" in res.output and "--host" in res.output
    assert "Traceback" not in res.output and served == []


def test_uvicorn_failing_to_start_is_exit_1_not_3(
    tmp_path: Path, served: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn exits 3 when it cannot start (a port taken between the check and its bind, a
    failed startup); the CLI's 3 means "ingest rejected records"."""
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: sys.exit(3))
    res = serve(tmp_path, "--workers", "0")
    assert res.exit_code == 1, res.output
    assert "error: the HTTP server did not start" in res.output


# ============================================================================ key file
def test_a_key_file_that_is_not_utf8_is_named(tmp_path: Path, started: list[Any]) -> None:
    keys = tmp_path / "keys_bin.txt"
    keys.write_bytes(f"{KEY} acme\n".encode() + b"\xff\xfe1234567890 beta\n")
    with pytest.raises(KeyFileError, match=r"keys_bin\.txt:2: not UTF-8"):
        parse_key_file(keys)
    for workers in ("0", "1"):
        res = serve(tmp_path, "--api-keys", str(keys), "--workers", workers)
        assert res.exit_code == 2, res.output
        assert f"{keys}:2: not UTF-8" in res.output and "codec" not in res.output
        assert started == [] and not (tmp_path / "store").exists()

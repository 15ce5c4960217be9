"""How ``memoryos-gpu serve`` starts. The config file's ``[server]`` table: the HTTP server's
settings beside the engine's in one TOML. ``memoryos-gpu serve`` and
``server.app.run(config=...)`` apply them (a flag or keyword given in Python wins), every other
command reads the same file and leaves the table alone, and a bad table is refused before
anything starts, naming the key. A PostgreSQL store whose server is not up yet: serve starts
and waits for it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from served import HA, KEY_A, free_port, running  # noqa: E402

from memoryos_gpu.cli import cli  # noqa: E402
from memoryos_gpu.config import EngineConfig  # noqa: E402
from memoryos_gpu.server.app import run  # noqa: E402

CONFIG = """embedder = "hashing"
device = "cpu"

[memory]
stm_capacity = 5

[server]
max_text_chars = 20
rate_limit_per_s = 3.5
"""


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The apps ``uvicorn.run`` was given, instead of serving them."""
    apps: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    return apps


def files(tmp_path: Path, config: str = CONFIG) -> tuple[str, str]:
    cfg = tmp_path / "memoryos.toml"
    cfg.write_text(config)
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY_A} acme\n")
    return str(cfg), str(keys)


def serve_args(tmp_path: Path, config: str = CONFIG) -> list[str]:
    cfg, keys = files(tmp_path, config)
    store = str(tmp_path / "store")
    port = str(free_port())  # serve checks that it can listen there before it starts
    return [
        "serve",
        "--config",
        cfg,
        "--store",
        store,
        "--workers",
        "0",
        "--api-keys",
        keys,
        "--port",
        port,
    ]


def test_serve_applies_the_server_table_and_serves_by_it(
    tmp_path: Path, captured: list[Any]
) -> None:
    res = CliRunner().invoke(cli, serve_args(tmp_path))
    assert res.exit_code == 0, res.output
    (app,) = captured
    settings = app.state.settings
    assert (settings.max_text_chars, settings.rate_limit_per_s) == (20, 3.5)
    with running(app) as (port, _server):
        url = f"http://127.0.0.1:{port}/v1/users/u1/pages"
        ok = {"user_input": "short", "agent_response": "ok"}
        too_long = {"user_input": "x" * 21, "agent_response": "ok"}
        with httpx.Client(timeout=30) as c:
            for _ in range(300):  # the engine loads in a thread
                if c.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
                time.sleep(0.05)
            assert c.post(url, json=ok, headers=HA).status_code == 201
            assert c.post(url, json=too_long, headers=HA).status_code == 413


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ("[server]\nmax_text_char = 20\n", "did you mean 'max_text_chars'"),
        ("[server]\nmax_text_chars = 0\n", "max_text_chars"),
        ("server = 3\n", "[server] must be a table"),
    ],
)
def test_a_bad_server_table_is_a_usage_error_before_serving(
    tmp_path: Path, captured: list[Any], table: str, said: str
) -> None:
    res = CliRunner().invoke(cli, serve_args(tmp_path, 'embedder = "hashing"\n' + table))
    assert res.exit_code == 2, res.output
    assert said in res.output and captured == []


def test_other_commands_read_the_same_file(tmp_path: Path) -> None:
    cfg, _keys = files(tmp_path)
    log = tmp_path / "chat.jsonl"
    log.write_text('{"user_id": "u1", "user_input": "I like tea", "agent_response": "ok"}\n')
    store = str(tmp_path / "store")
    res = CliRunner().invoke(
        cli, ["ingest", str(log), "--config", cfg, "--store", store, "--no-progress"]
    )
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["stats", "--config", cfg, "--store", store])
    assert res.exit_code == 0, res.output
    assert EngineConfig.from_toml(cfg).memory.stm_capacity == 5


def test_run_reads_the_table_under_its_keywords(tmp_path: Path, captured: list[Any]) -> None:
    cfg, _keys = files(tmp_path)
    run(store=str(tmp_path / "store"), config=cfg, api_keys={KEY_A: "acme"}, max_text_chars=50)
    settings = captured[0].state.settings
    assert (settings.max_text_chars, settings.rate_limit_per_s) == (50, 3.5)


def test_serve_on_a_postgres_store_not_up_yet_starts_and_waits(
    tmp_path: Path, captured: list[Any]
) -> None:
    """Reading the store's shard count opened it before the server started, so `serve` exited
    with the connection error when the database was not up yet; it starts now (its load
    retries, /ready 503 meanwhile), saying in a warning what it serves."""
    pytest.importorskip("psycopg")
    _cfg, keys = files(tmp_path)
    down = "postgresql://memoryos@127.0.0.1:1/db"  # nothing listens on port 1
    args = ["serve", "--store", down, "--embedder", "hashing", "--workers", "0"]
    args += ["--port", str(free_port())]  # serve checks that it can listen there first
    res = CliRunner().invoke(cli, [*args, "--api-keys", keys])
    assert res.exit_code == 0, res.output
    assert len(captured) == 1 and "serving 1 engine(s) once it answers" in res.output

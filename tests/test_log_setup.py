"""The servers' one logging setup (:mod:`memoryos_gpu.log_setup`): secrets masked in every
record whatever its logger and level, httpx's per-request lines off unless DEBUG, uvicorn's
lines in the same format, ``serve --log-level``, and the throttle that keeps a persistent
failure from logging a line per request.

The setup is process-wide state: each test runs it on a root logger emptied for the test (the
test runner's own handlers set aside, as a fresh server process has none) and restored after,
and reads what the handler wrote to stderr."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from memoryos_gpu.log_setup import (
    CHATTY_LOGGERS,
    LOG_LEVELS,
    UVICORN_LOGGERS,
    LogThrottle,
    RedactSecrets,
    level_number,
    loaded_line,
    redact,
    setup_logging,
    uvicorn_logging,
)

URL = "http://bob:pa55word@127.0.0.1:18203/v1"


Configure = Callable[..., None]


@pytest.fixture
def fresh_setup() -> Iterator[Configure]:
    """:func:`setup_logging` on a root logger without handlers (a new process's: the test
    runner's are set aside when it is called), everything the setup touches restored after."""
    root = logging.getLogger()
    names = [*CHATTY_LOGGERS, *UVICORN_LOGGERS]
    saved = (root.level, root.handlers[:])
    loggers = [logging.getLogger(n) for n in names]
    others = {lg.name: (lg.level, lg.handlers[:], lg.propagate) for lg in loggers}

    def configure(level: str, *, tag: str = "", keep: list[logging.Handler] | None = None) -> None:
        root.handlers[:] = keep or []
        setup_logging(level, tag=tag)

    try:
        yield configure
    finally:
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])
        for n, (level, handlers, propagate) in others.items():
            lg = logging.getLogger(n)
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate


# ---------------------------------------------------------------------------- redact
@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"POST {URL}/chat/completions", "POST http://bob:***@127.0.0.1:18203/v1/chat/completions"),
        ("postgresql://u:p@ss@db:5432/x", "postgresql://u:***@db:5432/x"),  # an '@' in it
        ("http://eve:s3cretpw@h/v1 and https://a:b@k", "http://eve:***@h/v1 and https://a:***@k"),
        ("{'Authorization': 'Bearer sk-abc123'}", "{'Authorization': '***'}"),
        ("Authorization: Basic Ym9iOnB3", "Authorization: ***"),
        ("token Bearer sk-abc.def", "token Bearer ***"),
        ("api_key=sk-live-1 next", "api_key=*** next"),
        ('{"api_key": "sk-live-1"}', '{"api_key": "***"}'),
        ("host=db password=hunter2 user=u", "host=db password=*** user=u"),
        ("postgresql://db/x?sslpassword=k&a=1", "postgresql://db/x?sslpassword=***&a=1"),
    ],
)
def test_secrets_are_masked(text: str, shown: str) -> None:
    assert redact(text) == shown


@pytest.mark.parametrize(
    "text",
    [
        "http://127.0.0.1:18203/v1/chat/completions",  # a port is no password
        "http://bob@host/v1",  # a user name alone is shown
        "http://host:8000/x?mail=a@b.example",  # an '@' after the path is no credential
        "memoryos-gpu server: 2 API key(s) for 1 tenant(s)",
        'INFO:     127.0.0.1:40796 - "GET /ready HTTP/1.1" 200 OK',
    ],
)
def test_lines_without_secrets_are_left_alone(text: str) -> None:
    assert redact(text) == text


# ---------------------------------------------------------------------------- the setup
def test_a_url_password_comes_out_masked_from_any_logger_at_any_level(
    fresh_setup: Configure, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh_setup("DEBUG", tag="engine")
    logging.getLogger("memoryos_gpu.server").info("LLM at %s", URL)
    logging.getLogger("httpx").debug("HTTP Request: POST %s/chat/completions", URL)
    logging.getLogger("some.library").warning("headers %s", {"authorization": "Bearer sk-x1"})
    err = capsys.readouterr().err
    assert "pa55word" not in err and "sk-x1" not in err, err
    assert "memoryos_gpu.server[engine]: LLM at http://bob:***@127.0.0.1:18203/v1" in err
    assert "httpx[engine]: HTTP Request: POST http://bob:***@" in err


def test_a_traceback_is_masked_too(
    fresh_setup: Configure, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh_setup("INFO")
    try:
        raise ConnectionError(f"cannot reach {URL}")
    except ConnectionError:
        logging.getLogger("memoryos_gpu.server").exception("engine error")
    err = capsys.readouterr().err
    assert "ConnectionError: cannot reach http://bob:***@127.0.0.1" in err, err
    assert "pa55word" not in err


def test_httpx_request_lines_are_not_emitted_at_info(
    fresh_setup: Configure, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh_setup("INFO", tag="worker 0")
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).info('HTTP Request: POST %s "HTTP/1.0 200 OK"', URL)
    logging.getLogger("httpx").warning("a real problem")
    err = capsys.readouterr().err
    assert "HTTP Request" not in err, err
    assert "WARNING httpx[worker 0]: a real problem" in err


def test_the_level_holds_for_every_logger_the_setup_quiets(
    fresh_setup: Configure, capsys: pytest.CaptureFixture[str]
) -> None:
    """At ERROR, neither httpx's warnings nor uvicorn's INFO lines get through."""
    fresh_setup("ERROR")
    logging.getLogger("httpx").warning("retrying")
    logging.getLogger("uvicorn.error").info("Started server process")
    logging.getLogger("memoryos_gpu.server").error("the engine failed to load")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the engine failed to load" in err, err


def test_uvicorn_lines_have_the_servers_format(
    fresh_setup: Configure, capsys: pytest.CaptureFixture[str]
) -> None:
    uvicorn = pytest.importorskip("uvicorn")
    fresh_setup("INFO", tag="worker 1")
    # what uvicorn does with the keywords every server here gives it: nothing of its own
    uvicorn.Config(app=lambda *a: None, **uvicorn_logging("info")).configure_logging()
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 42)
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d', "127.0.0.1:40796", "GET", "/ready", "1.1", 200
    )
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("INFO uvicorn.error[worker 1]: Started server process [42]")
    assert lines[1].endswith(
        'INFO uvicorn.access[worker 1]: 127.0.0.1:40796 - "GET /ready HTTP/1.1" 200'
    )
    assert all(line[:4].isdigit() for line in lines), lines  # a timestamp first
    assert uvicorn_logging("WARNING") == {"log_config": None, "log_level": "warning"}


def test_a_second_setup_adds_no_handler(
    fresh_setup: Configure, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh_setup("INFO")
    setup_logging("WARNING", tag="engine")
    root = logging.getLogger()
    assert len(root.handlers) == 1 and root.level == logging.WARNING
    logging.getLogger("x").warning("once")
    assert capsys.readouterr().err.count("once") == 1


def test_handlers_of_another_setup_are_kept_and_filtered(fresh_setup: Configure) -> None:
    """A program that configured logging itself keeps its handlers and level; they mask too."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    fresh_setup("DEBUG", keep=[handler])
    assert root.handlers == [handler] and root.level == logging.WARNING
    assert any(isinstance(f, RedactSecrets) for f in handler.filters)
    logging.getLogger("x").warning("at %s", URL)
    assert records[0].getMessage() == "at http://bob:***@127.0.0.1:18203/v1"


def test_a_misspelt_level_is_refused() -> None:
    assert [level_number(n.lower()) for n in LOG_LEVELS] == [50, 40, 30, 20, 10]
    with pytest.raises(ValueError, match="unknown log level 'verbose'"):
        level_number("verbose")


# ---------------------------------------------------------------------------- throttle
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_failure_logs_its_first_then_one_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    throttle = LogThrottle(interval_s=10.0, clock=clock)
    log = logging.getLogger("memoryos_gpu.test_throttle")
    caplog.set_level(logging.WARNING, logger=log.name)
    logged = []
    for i in range(48):  # 48 rejected writes in a second
        clock.now += 1 / 48
        logged.append(throttle.log(log, "disk-full", logging.ERROR, "disk full (write %d)", i))
    assert logged == [True] + [False] * 47
    assert throttle.log(log, "llm-down", logging.WARNING, "LLM down")  # another kind: its own
    clock.now += 10.0
    assert throttle.log(log, "disk-full", logging.ERROR, "disk full (write %d)", 48)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "disk full (write 0)",
        "LLM down",
        "disk full (write 48) [47 more like this in the last 11 s not logged]",
    ]
    clock.now += 10.0  # nothing left out since: no count
    throttle.log(log, "disk-full", logging.ERROR, "disk full (write %d)", 49)
    assert caplog.records[-1].getMessage() == "disk full (write 49)"


def test_a_line_below_the_level_is_neither_logged_nor_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    throttle = LogThrottle(interval_s=10.0, clock=Clock())
    log = logging.getLogger("memoryos_gpu.test_throttle")
    caplog.set_level(logging.ERROR, logger=log.name)
    assert not throttle.log(log, "k", logging.WARNING, "quiet")
    caplog.set_level(logging.WARNING, logger=log.name)
    assert throttle.log(log, "k", logging.WARNING, "said")
    assert [r.getMessage() for r in caplog.records] == ["said"]


def test_respond_logs_an_llm_outage_once_not_per_request(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("fastapi")
    from memoryos_gpu.llm.base import LLMBackendError
    from memoryos_gpu.server import memory_routes

    monkeypatch.setattr(memory_routes, "LLM_LOG", LogThrottle())
    caplog.set_level(logging.WARNING, logger="memoryos_gpu.server")
    for _ in range(20):
        memory_routes._llm_outage(LLMBackendError("the LLM server at x cannot be reached"))
    said = [r for r in caplog.records if "the LLM cannot be used" in r.getMessage()]
    assert len(said) == 1


def test_stage_fallbacks_log_once_per_interval_per_engine(caplog: pytest.LogCaptureFixture) -> None:
    from memoryos_gpu.stages import LLMStages

    class Ledger:
        def add_fallbacks(self, stage: str, n: int) -> None:
            self.n = getattr(self, "n", 0) + n

    stages = LLMStages.__new__(LLMStages)  # only the ledger and the log are used here
    stages.stats = Ledger()  # type: ignore[assignment]
    stages._fallback_log = LogThrottle()
    caplog.set_level(logging.WARNING, logger="memoryos_gpu.stages")
    for _ in range(23):  # one per wave while the LLM is down
        stages._count_fallbacks("page", 2, "HTTP 500: boom")
    stages._count_fallbacks("promotion", 1, "HTTP 500: boom")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "'page'" in said[0] and "'promotion'" in said[1], said
    assert stages.stats.n == 47  # every item still counted


# ---------------------------------------------------------------------------- startup line
def test_the_startup_line_says_what_was_loaded_with_urls_masked() -> None:
    from memoryos_gpu.config import EngineConfig

    config = EngineConfig(
        store="postgresql://app:dbpw@db:5432/mem",
        embedder="openai",
        embedding_model="e5",
        embedding_base_url="http://eve:s3cretpw@emb:9000/v1",
        llm={"mode": "llm", "backend": "openai", "model": "qwen", "base_url": URL},
    )

    class Engine:
        def __init__(self) -> None:
            self.config = config

        def stats(self) -> dict[str, Any]:
            return {
                "users": 3,
                "device": "cuda",
                "store": {"users": 3, "pages_stm": 4, "pages_mtm": 6, "pages_evicted": 9},
            }

    line = loaded_line(Engine(), 2.345)
    assert line == (
        "memoryos-gpu: loaded in 2.3 s: store postgresql://app:***@db:5432/mem; embedder openai "
        "e5 http://eve:***@emb:9000/v1; LLM openai qwen http://bob:***@127.0.0.1:18203/v1; "
        "device cuda; 3 user(s), 10 page(s)"
    )


# ---------------------------------------------------------------------------- serve --log-level
def test_serve_takes_a_log_level_and_passes_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    from click.testing import CliRunner

    from memoryos_gpu.cli import cli
    from memoryos_gpu.server import app as server_app

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(server_app, "run", lambda **kw: calls.append(kw))
    env = {"MEMORYOS_GPU_EMBEDDER": "hashing", "MEMORYOS_GPU_STORE": None, "MEMORYOS_GPU_KEY": None}
    runner = CliRunner()
    base = ["serve", "--store", ":memory:", "--workers", "2"]
    assert runner.invoke(cli, [*base, "--log-level", "debug"], env=env).exit_code == 0
    assert runner.invoke(cli, base, env=env).exit_code == 0
    assert [c["log_level"] for c in calls] == ["DEBUG", "INFO"]
    assert calls[0]["workers"] == 2
    bad = runner.invoke(cli, [*base, "--log-level", "verbose"], env=env)
    assert bad.exit_code == 2 and "--log-level" in bad.output
    assert "--log-level" in runner.invoke(cli, ["serve", "--help"]).output


def test_the_workers_and_engine_processes_get_the_level(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # the Supervisor sets it
    from memoryos_gpu.config import EngineConfig
    from memoryos_gpu.server.settings import ServerSettings
    from memoryos_gpu.server.workers import Supervisor

    sup = Supervisor(
        EngineConfig(embedder="hashing"),
        ServerSettings(),
        workers=2,
        host="127.0.0.1",
        port=0,
        api_keys=None,
        log_level="DEBUG",
    )
    try:
        assert sup.worker_spec["log_level"] == "DEBUG"
        assert [s["log_level"] for s in sup.engine_specs] == ["DEBUG"]
    finally:
        sup.sock.close()
        sup.stop()
    # stop() put the variable back: a later registry must not read the deleted directory
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ

"""Error messages of configuration and backend failures: one line naming the cause, the
documented exit code, and never a secret's value (the sweep's defects 3, 4, 5, 7 and 8)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from memoryos_gpu.cli.app import main as cli_main
from memoryos_gpu.cli.options import (
    CLIError,
    EngineOptions,
    UsageFailure,
    build_config,
    handle_errors,
)
from memoryos_gpu.config import EngineConfig, LLMConfig
from memoryos_gpu.embed import EmbedderConfigError, EmbeddingError, OpenAIEmbedder, make_embedder
from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.reference import ConfigError, ReferenceSettings, engine_config, settings
from memoryos_gpu.server import mcp_server
from memoryos_gpu.server.batching import Unavailable
from memoryos_gpu.server.service import MemoryService
from memoryos_gpu.store.errors import StoreError

SECRETS: list[Any] = [4242424242, ["sk-LEAKME"]]
LEAKS = ("4242424242", "LEAKME")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MEMORYOS_GPU_EMBEDDER", "MEMORYOS_GPU_STORE", "MEMORYOS_GPU_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # cli main sets it; restored after


def _chats(tmp_path: Path) -> Path:
    path = tmp_path / "chats.jsonl"
    page = {"user_id": "u", "user_input": "hello", "agent_response": "hi"}
    path.write_text(json.dumps(page) + "\n")
    return path


def _one_error_line(err: str) -> str:
    """The single ``error: ...`` line of a runtime failure (no traceback before it)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ====================================================================== 3: openai embedder
def test_openai_embedder_without_its_settings_is_a_usage_error_naming_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UsageFailure, match=r"--embedding-model.*--embedding-base-url"):
        build_config(EngineOptions(embedder="openai"), store=":memory:")
    with pytest.raises(UsageFailure) as only_url:
        build_config(EngineOptions(embedder="openai", embedding_model="m"), store=":memory:")
    assert "--embedding-base-url" in str(only_url.value)
    assert "--embedding-model" not in str(only_url.value)
    chats, store = str(_chats(tmp_path)), str(tmp_path / "s")
    assert cli_main(["ingest", chats, "--store", store, "--embedder", "hashing"]) == 0
    for command in (["retrieve", "--user", "u", "q"], ["ingest", chats]):
        code = cli_main([*command, "--store", store, "--embedder", "openai"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert "--embedding-model" in err and "--embedding-base-url" in err, err
        assert "Traceback" not in err


def test_the_factory_raises_a_documented_config_error() -> None:
    with pytest.raises(EmbedderConfigError, match=r"embedding_model.*embedding_base_url") as exc:
        make_embedder(EngineConfig(embedder="openai"))
    assert isinstance(exc.value, MemoryOSError) and isinstance(exc.value, ValueError)


# ====================================================================== 4: embeddings server
class _Refusing:
    """An OpenAI-compatible embeddings server that answers every request with 401."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.dumps({"error": {"message": "invalid api key"}}).encode()
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def refusing() -> Iterator[_Refusing]:
    server = _Refusing()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_embedding_error_is_the_packages_own_and_still_a_runtime_error() -> None:
    assert issubclass(EmbeddingError, MemoryOSError) and issubclass(EmbeddingError, RuntimeError)

    @handle_errors
    def fails() -> None:
        raise EmbeddingError("embedding server http://h/v1/embeddings answered 401")

    with pytest.raises(CLIError, match="answered 401"):
        fails()


@pytest.mark.parametrize("server", ["refusing", "unreachable"])
def test_an_embeddings_server_failure_is_one_error_line(
    server: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if server == "refusing":
        url, cause = request.getfixturevalue("refusing").url, "answered 401"
    else:
        monkeypatch.setattr(OpenAIEmbedder, "_wait", lambda self, attempt, retry_after: None)
        url, cause = _closed_port_url(), "unreachable after 6 attempts"
    flags = ["--embedder", "openai", "--embedding-model", "m", "--embedding-base-url", url]
    code = cli_main(["ingest", str(_chats(tmp_path)), "--store", str(tmp_path / "s"), *flags])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 1 and cause in line and url in line, line


# ====================================================================== 5: mcp --port
@pytest.mark.parametrize("port", ["99999", "0", "-1", "65536", "http"])
def test_mcp_refuses_a_port_outside_1_to_65535(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        mcp_server._parser().parse_args(["--port", port])
    assert exc.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_mcp_takes_a_port_in_range() -> None:
    assert mcp_server._parser().parse_args(["--port", "65535"]).port == 65535
    assert mcp_server._parser().parse_args([]).port == 8765


# ====================================================================== 7: secrets
def _toml_value(value: Any) -> str:
    return json.dumps(value)  # an int or a list of strings: the same in TOML


def _assert_named_not_shown(message: str, name: str) -> None:
    assert name in message, message
    assert not any(leak in message for leak in LEAKS), message
    assert "errors.pydantic.dev" not in message and "input_value" not in message, message


@pytest.mark.parametrize("secret", SECRETS, ids=["int", "list"])
@pytest.mark.parametrize(
    ("toml", "name"),
    [
        ('[llm]\nmode = "llm"\nbackend = "openai"\napi_key = {}\n', "llm.api_key"),
        ("embedding_api_key = {}\n", "embedding_api_key"),
        ("encryption_key = {}\n", "encryption_key"),
        ("[llm]\napi_kye = {}\n", "llm.api_kye"),  # a misspelt key: its value too
        ("llm = {}\n", "[llm] must be a table"),  # a key where the table should be
    ],
    ids=["llm.api_key", "embedding_api_key", "encryption_key", "misspelt", "llm-table"],
)
def test_the_cli_names_a_bad_secret_setting_without_its_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, name: str, secret: Any
) -> None:
    config = tmp_path / "engine.toml"
    config.write_text(toml.format(_toml_value(secret)))
    code = cli_main(["stats", "--store", str(tmp_path / "s"), "--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2, err
    _assert_named_not_shown(err, name)
    assert "invalid engine configuration" in err


def test_the_cli_names_an_unknown_setting_with_the_closest_known_one(tmp_path: Path) -> None:
    config = tmp_path / "engine.toml"
    config.write_text('[llm]\napi_kye = "sk-LEAKME"\n')
    with pytest.raises(UsageFailure, match=r"llm\.api_kye.*did you mean 'api_key'"):
        build_config(EngineOptions(config=str(config)), store=":memory:")
    config.write_text("[memory]\ntop_segmnts = 3\n")
    with pytest.raises(UsageFailure, match=r"memory\.top_segmnts.*did you mean 'top_segments'"):
        build_config(EngineOptions(config=str(config)), store=":memory:")


@pytest.mark.parametrize("secret", SECRETS, ids=["int", "list"])
def test_the_mcp_server_names_a_bad_secret_without_its_value(tmp_path: Path, secret: Any) -> None:
    ref = tmp_path / "config.json"
    ref.write_text(json.dumps({"user_id": "u", "openai_api_key": secret}))
    toml = tmp_path / "engine.toml"
    toml.write_text(f'[llm]\nmode = "llm"\napi_key = {_toml_value(secret)}\n')
    for path, name in ((ref, "openai_api_key"), (toml, "llm.api_key")):
        with pytest.raises(SystemExit) as exc:
            mcp_server.main(["--config", str(path)])
        message = str(exc.value.code)
        assert message.startswith("memoryos-gpu MCP server: "), message
        _assert_named_not_shown(message, name)


def test_a_reference_setting_the_engine_refuses_is_named() -> None:
    ref = settings({"embedding_model_kwargs": {"device": "gpu"}})  # passed on unchecked
    with pytest.raises(ConfigError, match=r"^settings: device: Input should be 'auto'"):
        engine_config(ref)


@pytest.mark.parametrize("secret", SECRETS, ids=["int", "list"])
def test_library_validation_errors_never_show_a_secret(secret: Any) -> None:
    for build in (
        lambda: LLMConfig(api_key=secret),
        lambda: EngineConfig(llm={"api_key": secret}),
        lambda: EngineConfig(embedding_api_key=secret),
        lambda: ReferenceSettings(openai_api_key=secret),
    ):
        with pytest.raises(ValidationError) as exc:
            build()
        assert not any(leak in str(exc.value) for leak in LEAKS), str(exc.value)


# ====================================================================== 8: failed load log
@pytest.mark.parametrize(
    ("cause", "traceback"),
    [(StoreError("store s was built with embedding model hashing-384"), False), (OSError(), True)],
    ids=["own-error", "bug"],
)
def test_a_failed_engine_load_logs_a_traceback_only_for_a_bug(
    caplog: pytest.LogCaptureFixture, cause: Exception, traceback: bool
) -> None:
    def engine() -> Any:
        raise cause

    async def start() -> None:
        service = MemoryService(engine)
        try:
            await mcp_server.start_serving(service)
        finally:
            await service.close()

    with (
        caplog.at_level(logging.ERROR, logger="memoryos_gpu.server"),
        pytest.raises(Unavailable, match=f"failed to load: {type(cause).__name__}"),
    ):
        asyncio.run(start())
    [record] = [r for r in caplog.records if "the engine failed to load" in r.getMessage()]
    assert (record.exc_info is not None) is traceback
    if not traceback:
        assert "built with embedding model hashing-384" in record.getMessage()


def test_an_embedding_servers_password_is_never_in_its_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``user:password@`` in ``embedding_base_url`` is masked in what the embedder says,
    as the LLM backend masks its own."""
    monkeypatch.setattr(OpenAIEmbedder, "_wait", lambda self, attempt, retry_after: None)
    url = _closed_port_url().replace("http://", "http://alice:hunter2@")
    with pytest.raises(EmbeddingError) as exc:
        OpenAIEmbedder("m", url, max_retries=1)
    assert "hunter2" not in str(exc.value) and "alice:***@" in str(exc.value)

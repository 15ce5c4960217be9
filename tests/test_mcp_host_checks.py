"""The MCP HTTP transport's Host/Origin checks beyond loopback (security sweep, defect 9).

The SDK checks Host and Origin (DNS rebinding) only when the server's host is a loopback one:
``--host 0.0.0.0`` turned them off without a word, on a transport with no authentication.
``--allowed-host`` / ``--allowed-origin`` turn them on for any host, and a non-loopback host
without them is one warning line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("mcp.server.mcpserver")
pytest.importorskip("uvicorn")

from served import running
from test_mcp import raw_initialize

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.server.mcp_server import build_mcp, http_app, warn_if_unchecked
from memoryos_gpu.server.service import MemoryService


@contextmanager
def _server(**checks: list[str]) -> Iterator[int]:
    service = MemoryService(EngineConfig(embedder="hashing", store=":memory:", auto_process=False))
    app = http_app(
        service, build_mcp(service), host="0.0.0.0", stateless=True, json_response=True, **checks
    )
    with running(app) as (port, _):
        yield port


def _post(port: int, **headers: str) -> int:
    return raw_initialize(f"http://127.0.0.1:{port}/mcp", **headers).status_code


def test_allowed_hosts_and_origins_are_checked_on_any_host() -> None:
    with _server(allowed_hosts=["mem.example:*"], allowed_origins=["https://app.example"]) as port:
        assert _post(port, Host=f"mem.example:{port}") == 200
        assert _post(port, Host="evil.example") == 421
        assert _post(port, Host=f"mem.example:{port}", Origin="https://evil.example") == 403
        assert _post(port, Host=f"mem.example:{port}", Origin="https://app.example") == 200


def test_a_host_beyond_loopback_without_checks_is_said(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="memoryos_gpu.server.mcp")
    for host in ("127.0.0.1", "::1", "[::1]", "localhost"):
        warn_if_unchecked(host, None)
    warn_if_unchecked("0.0.0.0", ["mem.example:*"])
    assert caplog.records == []
    warn_if_unchecked("0.0.0.0", None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "without Host/Origin checks" in line and "--allowed-host" in line

"""X-Forwarded-For is trusted only from the proxies ``forwarded_allow_ips`` names (security
sweep, defect 10).

uvicorn trusted it from 127.0.0.1 by default: a local process that sent another
``X-Forwarded-For`` on each request posed as another address each time and guessed API keys
past the per-address throttle of unknown keys (25 x 401 where 5 x 401 then 429 were due).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from memoryos_gpu.server.app import run
from memoryos_gpu.server.settings import ServerSettings


def test_the_headers_are_ignored_unless_a_proxy_is_named() -> None:
    assert ServerSettings().proxy_headers() == {"proxy_headers": False}
    named = ServerSettings(forwarded_allow_ips="10.0.0.5").proxy_headers()
    assert named == {"proxy_headers": True, "forwarded_allow_ips": "10.0.0.5"}


def test_the_single_process_server_is_run_with_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: given.append(kw))
    run(store=str(tmp_path / "s"), embedder="hashing", port=0, api_keys=None)
    run(store=str(tmp_path / "s"), embedder="hashing", port=0, forwarded_allow_ips="10.0.0.5")
    assert given[0]["proxy_headers"] is False
    assert (given[1]["proxy_headers"], given[1]["forwarded_allow_ips"]) == (True, "10.0.0.5")


def test_a_worker_throttles_unknown_keys_whatever_x_forwarded_for_says(tmp_path: Path) -> None:
    from tests.test_serve_workers import Supervised

    server = Supervised(
        tmp_path / "store", tmp_path / "server.log", workers=1, auth_failures_burst=5
    )
    try:
        server.wait_ready()
        codes = [
            httpx.get(
                f"{server.base}/v1/users",
                headers={"Authorization": "Bearer guess-000000", "X-Forwarded-For": f"10.0.0.{i}"},
                timeout=30,
            ).status_code
            for i in range(12)
        ]
    finally:
        server.stop()
    assert set(codes) == {401, 429} and codes.index(429) <= 6, codes

"""Who may read ``/metrics``, and what ``/ready`` tells an unauthenticated client.

1. ``/metrics`` shows server-wide load (every tenant's request counts and latencies, queue
   depths, engine counters), which docs/server.md keeps to the admin key. It answered anyone
   with or without a key. Now, with API keys, it needs the admin key (401 without a key or with
   an unknown one, 403 for a tenant's key) unless the ``metrics_public`` setting opens it for a
   scraper on a private network; an open server (no keys) serves it to anyone, as before.
2. After a failed load, ``/ready`` (no key) gave the load error, the store's absolute path
   included. With API keys it now gives a generic reason; the admin's ``/v1/stats`` has the
   whole error (``detail``, ``server.error``). An open server keeps the detail in ``/ready``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from served import ADMIN_KEYS, HA, HADMIN, hashing, serve

from memoryos_gpu.engine import MemoryEngine


def _scrape(c: Any, headers: dict[str, str] | None = None) -> Any:
    return c.get("/metrics", headers=headers or {})


def test_metrics_need_the_admin_key_on_a_keyed_server() -> None:
    with serve(hashing(), keys=ADMIN_KEYS) as c:
        r = c.post("/v1/users/u1/pages", json={"user_input": "hi"}, headers=HA)
        assert r.status_code == 201, r.text
        r = _scrape(c)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert r.json()["error"] == "unauthorized" and "memoryos_" not in r.text
        r = _scrape(c, {"Authorization": "Bearer not-a-known-key-123"})
        assert r.status_code == 401 and "memoryos_" not in r.text
        r = _scrape(c, HA)  # a tenant's key never sees the other tenants' load
        assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
        r = _scrape(c, HADMIN)
        assert r.status_code == 200, r.text
        assert 'memoryos_engine_events_total{event="pages_added"} 1.0' in r.text
        assert 'memoryos_rejected_total{reason="unauthorized"} 2.0' in r.text
        assert 'memoryos_rejected_total{reason="forbidden"} 1.0' in r.text


@pytest.mark.parametrize("keys", [ADMIN_KEYS, None], ids=["metrics_public", "open"])
def test_metrics_open_to_anyone_when_public_or_without_keys(keys: Any) -> None:
    settings = {"metrics_public": True} if keys else {}
    with serve(hashing(), keys=keys, **settings) as c:
        r = _scrape(c)
        assert r.status_code == 200 and "memoryos_queue_depth" in r.text, r.text


def _wrong_key_store(tmp_path: Path) -> Any:
    store = tmp_path / "encrypted"
    with MemoryEngine(hashing(store, encryption_key="the-right-key")) as eng:
        eng.add_many([{"user_id": "acme/u1", "user_input": "I like tea"}])
    return hashing(store, encryption_key="a-wrong-key"), str(store)


def _failed_status(c: Any) -> str:
    deadline = time.monotonic() + 30
    while not (status := c.get("/ready").json()["status"]).startswith("failed"):
        assert time.monotonic() < deadline, status
        time.sleep(0.02)
    return status


def test_ready_gives_clients_a_generic_reason_and_the_admin_the_detail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MEMORYOS_GPU_KEY", raising=False)
    config, path = _wrong_key_store(tmp_path)
    with serve(config, keys=ADMIN_KEYS, wait_ready=False) as c:
        status = _failed_status(c)
        assert path not in status and "encryption" not in status, status
        assert "failed to load (the server's log says why)" in status and "not retried" in status
        r = c.get("/v1/stats", headers=HADMIN)  # the operator's view: the whole load error
        assert r.status_code == 503 and r.headers["retry-after"] == "30", r.text
        body = r.json()
        assert body["error"] == "unavailable" and "wrong encryption key" in body["detail"]
        assert body["server"]["state"] == "failed" and path in body["server"]["error"]


def test_an_open_server_keeps_the_load_error_in_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MEMORYOS_GPU_KEY", raising=False)
    config, _ = _wrong_key_store(tmp_path)
    with serve(config, keys=None, wait_ready=False) as c:
        assert "wrong encryption key" in _failed_status(c)

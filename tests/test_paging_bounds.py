"""Paging offsets and ids beyond the store's 64-bit integers are a 422 with the JSON error body
(not a driver ``OverflowError`` answered as a plain-text 500), and a mistyped
``MEMORYOS_GPU_*`` environment variable is warned about rather than silently ignored."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from memoryos_gpu import config as cfg
from memoryos_gpu.config import EngineConfig
from memoryos_gpu.mem0 import Memory

HUGE = "99999999999999999999"  # > 2**63 - 1


def _is_422(r: Any, field: str) -> None:
    assert r.status_code == 422, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert body["error"] in ("validation_error", "invalid_input"), body
    assert field in str(body["detail"]), body


def test_huge_offsets_pages_and_ids_are_422s() -> None:
    pytest.importorskip("fastapi")
    from served import HA, hashing, serve

    with serve(hashing()) as c:
        assert c.post("/v1/users/alice/pages", json={"user_input": "hi"}, headers=HA).is_success
        _is_422(c.get(f"/v1/users/alice/pages?offset={HUGE}", headers=HA), "offset")
        _is_422(c.get(f"/v1/users/alice/pages?offset={2**63}", headers=HA), "offset")
        edge = c.get(f"/v1/users/alice/pages?offset={2**63 - 1}", headers=HA)
        assert edge.status_code == 200 and edge.json()["pages"] == [], edge.text
        for q in (f"page={HUGE}", "page=92233720368547758&page_size=1000"):
            r = c.get(f"/v1/mem0/memories?user_id=alice&{q}", headers=HA)
            _is_422(r, "page")
        ok = c.get("/v1/mem0/memories?user_id=alice&page=2&page_size=1", headers=HA)
        assert ok.status_code == 200, ok.text
        for method in ("get", "delete"):
            for pid in (HUGE, str(2**63), "-1", "0"):
                r = getattr(c, method)(f"/v1/users/alice/pages/{pid}", headers=HA)
                _is_422(r, "page_id")
        r = c.patch(f"/v1/users/alice/pages/{HUGE}", json={"user_input": "x"}, headers=HA)
        _is_422(r, "page_id")


def test_mem0_facade_refuses_an_offset_beyond_64_bits(make_engine: Any) -> None:
    m = Memory(engine=make_engine(mode="extractive"))
    m.add("I keep bees.", user_id="ana")
    with pytest.raises(ValueError, match="page"):
        m.get_all(user_id="ana", page=int(HUGE))
    with pytest.raises(ValueError, match="page"):
        m.get_all(user_id="ana", page=92233720368547758, page_size=1000)
    assert m.get_all(user_id="ana", page=9223372036854775, page_size=1000)["results"] == []


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cfg, "_warned_env", set(), raising=False)
    for name in [n for n in os.environ if n.startswith("MEMORYOS_GPU_")]:
        monkeypatch.delenv(name)


def test_a_mistyped_variable_is_warned_about_once(
    fresh_warnings: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_ENCRYPTION_KEY", "correct horse battery staple")
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDER", "hashing")
    with caplog.at_level(logging.WARNING, logger="memoryos_gpu.config"):
        assert EngineConfig().encryption_key is None  # still not an error
        EngineConfig()
    text = [r.getMessage() for r in caplog.records]
    assert len(text) == 2, text  # once per variable, not per config
    key = next(t for t in text if "ENCRYPTION_KEY" in t)
    assert "$MEMORYOS_GPU_KEY?" in key and "staple" not in key
    assert any("$MEMORYOS_GPU_EMBEDDER?" in t for t in text), text


def test_every_variable_the_project_reads_is_known(fresh_warnings: None) -> None:
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    dirs = ("memoryos_gpu", "scripts", "tests", "benchmarks", ".ci", "csrc")
    found: set[str] = set()
    for d in dirs:
        if not (root / d).is_dir():
            continue
        out = subprocess.run(
            [
                "grep",
                "-rhoE",
                "--exclude=*.pyc",
                f"--exclude={Path(__file__).name}",
                "MEMORYOS_GPU_[A-Z0-9_]*[A-Z0-9]",
                d,
            ],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        found |= set(re.findall(r"MEMORYOS_GPU_[A-Z0-9_]*[A-Z0-9]", out))
    found -= {"MEMORYOS_GPU_" + typo for typo in cfg._ENV_ALIASES}  # config.py names them
    assert len(found) >= 15, found  # the grep found the project's variables
    assert cfg.warn_unknown_env(dict.fromkeys(found, "1")) == []  # this file's typos left out
    assert "MEMORYOS_GPU_TEST_PG_URL" in cfg.KNOWN_ENV
    assert cfg.warn_unknown_env({"MEMORYOS_GPU_STOR": "x", "OTHER": "y"}) == ["MEMORYOS_GPU_STOR"]

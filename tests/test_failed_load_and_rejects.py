"""Two leaks of a store that cannot or must not be read.

1. After the engine fails to load (a wrong key, a corrupt store) or while it waits for its store,
   EVERY route of the app that needs the engine answers 503 with the load error, as the write
   and retrieval routes did: before, profile, knowledge, export and /v1/stats answered a bare
   500 (``AttributeError: 'NoneType' object has no attribute ...``), history and pages
   ``404 unknown user`` for a user the store holds, and the mem0 routes ``501 need one engine``.
   The routes are enumerated from ``app.routes``, so a route added later is covered too.
2. ``memoryos-gpu ingest`` into an encrypted store wrote the rejected records verbatim, in plain
   text, to STORE/rejects.jsonl, inside the folder that is backed up by copying. Now that
   default file says where each rejected record is and why, without its content; an explicit
   ``--rejects FILE`` still gets the content; a plain store is unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from fastapi.routing import APIRoute
from pydantic import BaseModel
from served import ADMIN_KEYS, HA, HADMIN, hashing, serve
from starlette.routing import Route

from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.ingest import ingest
from memoryos_gpu.server.service import NOT_RETRIED
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.store import StoreUnavailableError

USER = "maya_chen"
#: A value for each body field a route's model may have (only the fields it has are sent):
#: enough for the handler to get past its own checks to the engine.
BODY_VALUES: dict[str, Any] = {
    "user_input": "I like green tea",
    "agent_response": "noted",
    "query": "what do I drink?",
    "text": "likes green tea",
    "messages": "I like green tea",
    "user_id": USER,
    "pages": [{"user_id": USER, "user_input": "I like green tea"}],
    "queries": [{"user_id": USER, "query": "tea"}],
}
PATH_VALUES = {"user_id": USER, "entry_id": "1", "page_id": "1", "memory_id": "page-1"}
QUERY_VALUES = {"user_id": USER}
RETRY_AFTER = str(ServerSettings().retry_after_s)


# ====================================================================== the app's routes
@dataclass
class Call:
    method: str
    path: str
    params: dict[str, str]
    body: dict[str, Any] | None


def _path(template: str) -> str:
    for name, value in PATH_VALUES.items():
        template = template.replace("{" + name + "}", value)
    assert "{" not in template, f"no test value for a parameter of {template}"
    return template


def _body(route: APIRoute) -> dict[str, Any] | None:
    """A body the route's model accepts, or None for a route without one."""
    params = route.dependant.body_params
    if not params:
        return None
    (param,) = params
    model = param.field_info.annotation
    assert isinstance(model, type) and issubclass(model, BaseModel), route.path
    body = {k: v for k, v in BODY_VALUES.items() if k in model.model_fields}
    model.model_validate(body)  # a new model's required field needs a BODY_VALUES entry
    return body


def _api_calls(route: APIRoute) -> Iterator[Call]:
    query = route.dependant.query_params
    needed = [q.name for q in query if q.field_info.is_required()]
    missing = [n for n in needed if n not in QUERY_VALUES]
    assert not missing, f"no test value for query parameter(s) {missing} of {route.path}"
    params = {n: QUERY_VALUES[n] for n in needed}
    for method in sorted(route.methods):
        yield Call(method, _path(route.path), params, _body(route))


def app_calls(app: Any) -> list[Call]:
    """One request for every method of every route of ``app`` (static mounts aside)."""
    calls: list[Call] = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            calls.extend(_api_calls(route))
        elif isinstance(route, Route):
            calls.append(Call("GET", route.path, {}, None))
    return calls


# ====================================================================== stores that do not load
def _wrong_key(tmp_path: Path) -> Any:
    store = tmp_path / "encrypted"
    with MemoryEngine(hashing(store, encryption_key="the-right-key")) as eng:
        eng.add_many([{"user_id": u, "user_input": "I like tea"} for u in (USER, f"acme/{USER}")])
    return hashing(store, encryption_key="a-wrong-key")


def _corrupt(tmp_path: Path) -> Any:
    store = tmp_path / "corrupt"
    store.mkdir()
    (store / "memory.sqlite3").write_bytes(b"SQLite format 3\x00" + os.urandom(4096))
    return hashing(store, encryption_key=None)


def _unreachable(tmp_path: Path) -> Callable[[], Any]:
    def build() -> Any:
        raise StoreUnavailableError("store postgresql://u@db/x: connection refused")

    return build


SOURCES = {
    "wrong key": (_wrong_key, "failed", "wrong encryption key"),
    "corrupt store": (_corrupt, "failed", "StoreError"),
    "store unreachable": (_unreachable, "starting", "waiting for the store"),
}


def _wait_for(client: Any, state: str) -> str:
    """``/ready``'s status once the load failed (or is waiting for the store)."""
    deadline = time.monotonic() + 30
    while True:
        status = client.get("/ready").json()["status"]
        if status.startswith(f"{state}: "):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.02)


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyed"])
@pytest.mark.parametrize("kind", list(SOURCES))
def test_every_route_answers_503_naming_the_load_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, keyed: bool
) -> None:
    """Every route answers 503 while the engine is not loaded; an open server names the load
    error (its one tenant is its operator), a server with API keys names it to the admin key
    only: the error names the store's file or database host (security sweep, defect 7)."""
    monkeypatch.delenv("MEMORYOS_GPU_KEY", raising=False)
    make, state, cause = SOURCES[kind]
    headers = HA if keyed else {}
    with serve(make(tmp_path), keys=ADMIN_KEYS if keyed else None, wait_ready=False) as c:
        status = _wait_for(c, state)
        assert (cause in status) is not keyed, status
        if state == "failed":
            assert NOT_RETRIED in status  # a permanent failure says so
        calls = app_calls(c.app)  # type: ignore[attr-defined]
        assert sum(x.path.startswith("/v1/") for x in calls) >= 25  # the enumeration works
        for call in calls:
            r = c.request(
                call.method, call.path, params=call.params, json=call.body, headers=headers
            )
            what = f"{call.method} {call.path} -> {r.status_code} {r.text[:300]}"
            assert r.status_code < 500 or r.status_code == 503, what
            if call.path == "/ready":
                assert r.status_code == 503 and r.json()["ready"] is False, what
                assert r.json()["status"] == status and "retry-after" in r.headers, what
            elif call.path == "/metrics" and keyed:
                assert r.status_code == 403, what  # every tenant's load: the admin's
            elif not call.path.startswith("/v1/"):
                assert r.status_code == 200, what  # /health, /metrics, the API's description
            else:
                assert r.status_code == 503, what
                detail = r.json()["detail"]
                assert r.json()["error"] == "unavailable" and (cause in detail) is not keyed, what
                assert int(r.headers["retry-after"]) >= 1, what
                if state == "failed":
                    assert "failed to load" in detail and NOT_RETRIED in detail, what
                else:  # tried again: the configured Retry-After, as /ready says
                    assert r.headers["retry-after"] == RETRY_AFTER, what
        if keyed:  # the operator's view: the whole error
            r = c.get("/v1/stats", headers=HADMIN)
            assert r.status_code == 503 and cause in r.json()["detail"], r.text


# ====================================================================== rejects of an ingest
SECRET = "my card 4111-1111-1111-1111 exp 12/29"
INPUT = [
    {"user_id": "alice", "user_input": "fine page", "agent_response": "ok"},
    {"user_id": "alice", "user_input": SECRET, "agent_response": "ok", "timestamp": "no-time"},
    "this line is not JSON: SSN 078-05-1120 belongs to bob",
    {"user_id": "", "user_input": "SSN 078-05-1120 belongs to bob", "agent_response": "ok"},
]


def _input(tmp_path: Path) -> Path:
    src = tmp_path / "in.jsonl"
    lines = [x if isinstance(x, str) else json.dumps(x) for x in INPUT]
    src.write_text("\n".join(lines) + "\n")
    return src


def _cli(*args: Any, key: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MEMORYOS_GPU_KEY",)}
    env.update(MEMORYOS_GPU_EMBEDDER="hashing", **({"MEMORYOS_GPU_KEY": key} if key else {}))
    env.pop("MEMORYOS_GPU_STORE", None)
    cmd = [sys.executable, "-m", "memoryos_gpu", "ingest", *map(str, args), "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_where_and_why_only(path: Path, src: Path) -> None:
    text = path.read_text()
    assert "4111" not in text and "078-05" not in text, text
    rows = _rows(path)
    assert sorted(r["line"] for r in rows) == [2, 3, 4]  # a sharded run: in shard order
    assert all(r["file"] == str(src) and r["reason"] and "raw" not in r for r in rows), rows


def _assert_raw(path: Path) -> None:
    rows = _rows(path)
    assert [r["line"] for r in rows] == [2, 3, 4]
    assert SECRET in rows[0]["raw"] and "078-05-1120" in rows[1]["raw"], rows


def test_an_encrypted_store_gets_no_plaintext_rejects_by_default(tmp_path: Path) -> None:
    pytest.importorskip("sqlcipher3")
    src = _input(tmp_path)
    store = tmp_path / "enc"
    p = _cli(src, "--store", store, "--json", key="k")
    assert p.returncode == 3, p.stderr
    _assert_where_and_why_only(store / "rejects.jsonl", src)
    rep = json.loads(p.stdout.splitlines()[-1])
    assert rep["rejected"] == 3 and rep["accepted"] == 1 and rep["rejects_raw"] is False
    note = " ".join(p.stderr.split())
    assert "the store is encrypted" in note and "without its content" in note, p.stderr
    assert "--rejects FILE" in note, p.stderr
    # an explicit file is the user's informed choice: the content, as before
    mine = tmp_path / "mine.jsonl"
    p = _cli(src, "--store", store, "--rejects", mine, "--json", key="k")
    assert p.returncode == 3 and json.loads(p.stdout.splitlines()[-1])["rejects_raw"] is True
    _assert_raw(mine)
    assert "the store is encrypted" not in p.stderr
    # the key in the config file instead of the environment: the same
    toml = tmp_path / "engine.toml"
    toml.write_text('encryption_key = "k"\n')
    p = _cli(src, "--store", tmp_path / "enc-toml", "--config", toml, key=None)
    assert p.returncode == 3, p.stderr
    _assert_where_and_why_only(tmp_path / "enc-toml" / "rejects.jsonl", src)


def test_sharded_encrypted_ingest_keeps_content_out_of_the_store_folders(tmp_path: Path) -> None:
    pytest.importorskip("sqlcipher3")
    src = _input(tmp_path)
    store = tmp_path / "enc-shards"
    p = _cli(src, "--store", store, "--workers", "2", "--json", key="k")
    assert p.returncode == 3, p.stderr
    _assert_where_and_why_only(store / "rejects.jsonl", src)
    for part in store.rglob("*.jsonl"):
        assert "4111" not in part.read_text() and "078-05" not in part.read_text(), part
    mine = tmp_path / "mine.jsonl"
    p = _cli(src, "--store", tmp_path / "enc2", "--workers", "2", "--rejects", mine, key="k")
    assert p.returncode == 3, p.stderr
    assert sorted(r["line"] for r in _rows(mine)) == [2, 3, 4]
    assert SECRET in mine.read_text()
    assert not list(tmp_path.glob("mine.jsonl.shard-*"))  # the parts were merged, then removed
    for part in (tmp_path / "enc2").rglob("*.jsonl"):
        assert "4111" not in part.read_text(), part


def test_sharded_plain_ingest_writes_the_rejects_where_asked_only(tmp_path: Path) -> None:
    """``--workers`` with ``--rejects FILE`` into a plain store: each shard wrote its own copy
    of its rejects (raw records) into STORE/shard-i/rejects.jsonl and left it there, where the
    user had asked for one file elsewhere (docs/cli.md: the parts go beside FILE and are
    removed once merged)."""
    src = _input(tmp_path)
    store, mine = tmp_path / "plain-shards", tmp_path / "elsewhere" / "mine.jsonl"
    mine.parent.mkdir()
    p = _cli(src, "--store", store, "--workers", "2", "--rejects", mine, key=None)
    assert p.returncode == 3, p.stderr
    assert sorted(r["line"] for r in _rows(mine)) == [2, 3, 4]
    _assert_raw(mine)
    assert sorted(f.name for f in mine.parent.iterdir()) == ["mine.jsonl"]
    assert not list(store.rglob("*.jsonl"))


def test_a_plain_store_keeps_the_content_in_its_default_rejects_file(tmp_path: Path) -> None:
    src = _input(tmp_path)
    store = tmp_path / "plain"
    p = _cli(src, "--store", store, key=None)
    assert p.returncode == 3, p.stderr
    _assert_raw(store / "rejects.jsonl")
    assert "the store is encrypted" not in p.stderr


def test_the_library_writes_where_and_why_only_when_asked(tmp_path: Path) -> None:
    src = _input(tmp_path)
    for raw in (True, False):
        out = tmp_path / f"rejects-{raw}.jsonl"
        report = ingest(src, hashing(), rejects_path=out, rejects_raw=raw, progress=False)
        assert report.rejected == 3 and report.rejects_raw is raw
        if raw:
            _assert_raw(out)
        else:
            _assert_where_and_why_only(out, src)


def test_the_shards_rejects_merge_in_input_order(tmp_path: Path) -> None:
    """The shards' parts were written one after the other: a read-stage reject goes to the
    shard its path hashes to, so the merged file's order changed from run to run. Merged by
    (file, line) now; a row cut short (a killed shard) goes last."""
    from memoryos_gpu.cli.ingest import _merge_rejects

    def row(file: str, line: int) -> str:
        return json.dumps({"file": file, "line": line, "reason": "r"}) + "\n"

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(row("x.jsonl", 3) + row("y.jsonl", 1) + '{"file": "x.jsonl", "li')
    b.write_text(row("x.jsonl", 1) + row("x.jsonl", 7) + row("y.jsonl", 2))
    out = tmp_path / "merged.jsonl"
    with out.open("w") as f:
        _merge_rejects([a, b], ["x.jsonl", "y.jsonl"], f)
    lines = out.read_text().splitlines()
    assert [(r["file"], r["line"]) for r in map(json.loads, lines[:-1])] == [
        ("x.jsonl", 1),
        ("x.jsonl", 3),
        ("x.jsonl", 7),
        ("y.jsonl", 1),
        ("y.jsonl", 2),
    ]
    assert lines[-1] == '{"file": "x.jsonl", "li'

"""A page's ``meta`` nested deep: refused at the write past ``MAX_META_DEPTH`` on every way in,
and nothing deep takes down what travels beside it.

Before: a meta ~490 levels deep made ``serve --workers`` fail to pickle the worker's batch of
requests (every request of that loop iteration, of any tenant, waited until the server
stopped); 1,000 levels was a plain-text 500 (``RecursionError`` in ``json_codec.dumps``); 500
to 950 levels was stored and then every listing and export of that user was a 500.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu.engine.validation import (
    MAX_META_DEPTH,
    InvalidInputError,
    validate_page,
)
from memoryos_gpu.json_codec import dumps
from memoryos_gpu.types import PageInput


def _nested(levels: int) -> dict[str, Any]:
    """A meta of ``levels`` levels: ``{"a": {"a": ... {"a": 1}}}`` (the meta itself is one)."""
    meta: dict[str, Any] = {"a": 1}
    for _ in range(levels - 1):
        meta = {"a": meta}
    return meta


def _nested_json(levels: int) -> str:
    return '{"a":' * levels + "1" + "}" * levels


def _engine() -> MemoryEngine:
    return MemoryEngine(EngineConfig(store=":memory:", embedder="hashing", device="cpu"))


# ------------------------------------------------------------------ the engine's rule
def test_the_depth_is_counted_as_documented() -> None:
    assert validate_page(PageInput("u", "x", meta=_nested(MAX_META_DEPTH))).meta
    lists: Any = [1]
    for _ in range(MAX_META_DEPTH - 2):
        lists = [lists]
    validate_page(PageInput("u", "x", meta={"l": lists}))  # dict + 63 lists: 64 levels
    with pytest.raises(InvalidInputError, match=f"the limit is {MAX_META_DEPTH}"):
        validate_page(PageInput("u", "x", meta={"l": [lists]}))


@pytest.mark.parametrize("levels", [MAX_META_DEPTH + 1, 600, 1000, 20_000])
def test_a_meta_past_the_limit_is_refused_by_add_and_add_many(levels: int) -> None:
    deep = _nested(levels)
    with _engine() as e:
        e.add("u", "first")
        with pytest.raises(InvalidInputError, match=f"meta is nested too deeply.*{MAX_META_DEPTH}"):
            e.add("u", "deep", meta=deep)
        with pytest.raises(InvalidInputError, match=f"the limit is {MAX_META_DEPTH}"):
            e.add_many([{"user_id": "u", "user_input": "ok"}, PageInput("u", "x", meta=deep)])
        assert e.list_pages("u")[1] == 1  # nothing of the batch was stored


def test_a_meta_at_the_limit_is_stored_and_served_back() -> None:
    meta = _nested(MAX_META_DEPTH)
    with _engine() as e:
        e.add("u", "at the limit", meta=meta)
        assert e.retrieve("u", "limit").stm[0].extra == meta
        assert dumps(e.export_user("u"))  # encodes with the rest of the export


def test_a_meta_that_holds_itself_is_refused_not_looped_on() -> None:
    meta: dict[str, Any] = {"k": 1}
    meta["self"] = meta
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        validate_page(PageInput("u", "x", meta=meta))


def test_json_codec_dumps_refuses_a_too_deep_value_with_a_value_error() -> None:
    """A ``RecursionError`` escaped the ``(TypeError, ValueError)`` of its callers: a 500."""
    with pytest.raises(ValueError, match="nested too deeply"):
        dumps(_nested(20_000))


def test_strip_ids_takes_any_depth() -> None:
    pytest.importorskip("fastapi")
    from memoryos_gpu.server.scope import Scope

    scope = Scope.__new__(Scope)
    scope.prefix = "acme/"
    deep = {"user_id": "acme/u", "meta": _nested(5_000), "pages": [{"source": "acme/s"}]}
    out = scope.strip_ids(deep)
    assert out["user_id"] == "u" and out["pages"] == [{"source": "s"}]
    node, levels = out["meta"], 1
    while node != {"a": 1}:  # walked, not compared: == recurses too
        node, levels = node["a"], levels + 1
    assert levels == 5_000


# ------------------------------------------------------------------ the HTTP API, one process
@pytest.fixture(scope="module")
def http() -> Any:
    pytest.importorskip("uvicorn")
    from tests.served import hashing, serve

    with serve(hashing(), keys=None) as client:
        yield client


@pytest.mark.parametrize("levels", [MAX_META_DEPTH + 1, 600, 1020])
@pytest.mark.parametrize(
    ("path", "wrap", "field"),
    [
        ("/v1/users/ann/pages", '{{"user_input":"x","meta":{0}}}', "meta"),
        ("/v1/pages", '{{"pages":[{{"user_id":"ann","user_input":"x","meta":{0}}}]}}', "meta"),
        (
            "/v1/mem0/memories",
            '{{"user_id":"ann","messages":"x","metadata":{0}}}',
            "metadata",
        ),
    ],
)
def test_http_refuses_a_deep_meta_with_a_422_naming_the_limit(
    http: httpx.Client, levels: int, path: str, wrap: str, field: str
) -> None:
    body = wrap.format(_nested_json(levels))
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text[:500]
    err = r.json()
    assert err["error"] == "validation_error", err
    (first,) = err["detail"]
    assert first["loc"][-1] == field and f"the limit is {MAX_META_DEPTH}" in first["msg"], first


def test_http_stores_a_meta_at_the_limit_and_lists_and_exports_it(http: httpx.Client) -> None:
    body = '{"user_input":"limit","meta":' + _nested_json(MAX_META_DEPTH) + "}"
    r = http.post("/v1/users/bo/pages", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 201, r.text[:500]
    for path in ("/v1/users/bo/pages", "/v1/users/bo/export", "/v1/mem0/memories?user_id=bo"):
        assert http.get(path).status_code == 200, path
    r = http.post("/v1/users/bo/retrieve", json={"query": "limit", "sources": True})
    assert r.status_code == 200, r.text[:500]


# ------------------------------------------------------------------ the worker-engine channel
class _Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this object does not travel")


def test_a_request_that_cannot_be_pickled_fails_alone(tmp_path: Path) -> None:
    """Requests of one loop iteration go as one message; one that pickle cannot carry used to
    drop them all, answered never. Now it fails alone and the others are answered."""
    pytest.importorskip("zmq")
    from tests.served import fake_engine

    deep: Any = 1
    for _ in range(20_000):
        deep = [deep]

    async def go() -> list[Any]:
        address = f"ipc://{tmp_path}/engine.sock"
        async with fake_engine(address, lambda _method, args: (True, args[0] * 2)) as client:
            calls = [  # queued in one loop iteration: one batch
                client.request("x", 1),
                client.request("x", _Unpicklable()),
                client.request("x", 2),
                client.request("x", deep),
                client.request("x", 3),
            ]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)

    one, bad, two, too_deep, three = asyncio.run(go())
    assert (one, two, three) == (2, 4, 6)
    assert isinstance(bad, TypeError) and "does not travel" in str(bad)
    assert isinstance(too_deep, InvalidInputError) and "nested too deeply" in str(too_deep)


# ------------------------------------------------------------------ serve --workers 1
def test_a_deep_meta_under_workers_is_a_422_and_other_tenants_are_answered(
    tmp_path: Path,
) -> None:
    """The report's case: tenant A's write of a meta 600 levels deep, sent with tenant B's
    writes and retrievals in flight. Every request is answered (B's 201/200), A's is a 422."""
    pytest.importorskip("zmq")
    pytest.importorskip("uvicorn")
    from tests.served import HA, HB
    from tests.test_serve_workers import UNLIMITED, Supervised

    server = Supervised(tmp_path / "store", tmp_path / "server.log", workers=1, **UNLIMITED)
    try:
        server.wait_ready()
        deep = ('{"user_input":"x","meta":' + _nested_json(600) + "}").encode()

        async def go() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base, timeout=20) as c:
                json_type = {"Content-Type": "application/json"}
                calls = []
                for i in range(8):
                    calls.append(c.post("/v1/users/bob/retrieve", json={"query": "b"}, headers=HB))
                    calls.append(
                        c.post("/v1/users/bob/pages", json={"user_input": f"b{i}"}, headers=HB)
                    )
                    if i % 4 == 0:
                        calls.append(
                            c.post("/v1/users/eve/pages", content=deep, headers={**HA, **json_type})
                        )
                return await asyncio.gather(*calls)

        answers = asyncio.run(go())
        deep_ones = [r for r in answers if r.request.url.path == "/v1/users/eve/pages"]
        others = [r for r in answers if r.request.url.path != "/v1/users/eve/pages"]
        assert [r.status_code for r in deep_ones] == [422, 422], [r.text for r in deep_ones]
        assert all(f"the limit is {MAX_META_DEPTH}" in r.text for r in deep_ones)
        assert sorted({r.status_code for r in others}) == [200, 201], [r.text for r in others]
        with httpx.Client(base_url=server.base, timeout=20, headers=HB) as c:
            assert len(c.get("/v1/users/bob/pages").json()["pages"]) == 8
    finally:
        server.stop()

"""An embedding server that fails while the HTTP server runs: the client is told to come back
(503 ``unavailable`` with Retry-After, nothing of the request stored), the operator gets one
log line and no traceback, and the server serves again once the embedder is back."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from served import HA, serve

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu.embed import EmbeddingError
from memoryos_gpu.embed.hashing import HashingEmbedder

DOWN = "embedding server http://embed:8080/v1/embeddings unreachable after 4 attempts"


class Switchable:
    """The hashing embedder behind a switch: ``down`` makes every call fail as the OpenAI
    embedder does once its retries are spent."""

    def __init__(self) -> None:
        self.inner = HashingEmbedder()
        self.down = False

    @property
    def dim(self) -> int:
        return self.inner.dim

    @property
    def model_id(self) -> str:
        return self.inner.model_id

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if self.down:
            raise EmbeddingError(DOWN)
        return self.inner.encode(texts)


def test_an_embedding_outage_is_503_with_retry_after_and_nothing_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    emb = Switchable()
    engine = MemoryEngine(EngineConfig(store=":memory:", auto_process=False), embedder=emb)
    page = {"user_input": "my cat is Tom", "agent_response": "noted"}
    with serve(engine) as c:
        assert c.post("/v1/users/u1/pages", json=page, headers=HA).status_code == 201
        emb.down = True
        with caplog.at_level(logging.WARNING):
            w = c.post("/v1/users/u1/pages", json={**page, "user_input": "x"}, headers=HA)
            r = c.post("/v1/users/u1/retrieve", json={"query": "cat"}, headers=HA)
        for resp in (w, r):
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"] == "unavailable"
            assert int(resp.headers["Retry-After"]) > 0
            assert "unreachable" in resp.json()["detail"]
        logged = [rec for rec in caplog.records if "embedder" in rec.getMessage()]
        assert logged and not any(rec.exc_info for rec in logged)
        emb.down = False
        listed = c.get("/v1/users/u1/pages", headers=HA).json()
        assert [p["user_input"] for p in listed["pages"]] == ["my cat is Tom"]
        again = c.post("/v1/users/u1/retrieve", json={"query": "cat"}, headers=HA)
        assert again.status_code == 200, again.text

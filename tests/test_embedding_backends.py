"""The other embedding backends: an OpenAI-compatible server (a real local HTTP server in the
test, speaking the /v1/embeddings protocol, backed by the bundled MiniLM), the int8 ONNX
backend, and how an engine config picks a backend."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.embed import (
    EMBEDDER_KINDS,
    Embedder,
    EmbeddingError,
    HashingEmbedder,
    OpenAIEmbedder,
    make_embedder,
)

TEXTS = [
    "Caroline went to an LGBTQ support group on 7 May 2023.",
    "Melanie painted a lake at sunrise.",
    "",
    "What time is it?",
    "The quarterly revenue report was delayed by two weeks because of an audit.",
] + [f"page number {i} about running the Portland marathon" for i in range(20)]


class EmbeddingsServer:
    """A real HTTP server answering POST /v1/embeddings from a local embedder, with scripted
    failures (``fail``: statuses answered, in order, before requests succeed again)."""

    def __init__(self, embedder: Any, key: str | None = None) -> None:
        self.embedder, self.key = embedder, key
        self.fail: list[int] = []
        self.batches: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.key and self.headers.get("Authorization") != f"Bearer {outer.key}":
                    return self._reply(401, {"error": {"message": "invalid api key"}})
                if self.path != "/v1/embeddings":
                    return self._reply(404, {"error": {"message": f"no route {self.path}"}})
                if body.get("model") != "minilm":
                    return self._reply(404, {"error": {"message": "model not found"}})
                if outer.fail:
                    status = outer.fail.pop(0)
                    return self._reply(status, {"error": {"message": "busy"}}, retry_after="0")
                outer.batches.append(len(body["input"]))
                vecs = outer.embedder.encode(body["input"])
                data = [
                    {"object": "embedding", "index": i, "embedding": v.tolist()}
                    for i, v in enumerate(vecs)
                ][::-1]  # any order: the client sorts by index
                self._reply(200, {"object": "list", "data": data, "model": "minilm"})

            def _reply(self, status: int, obj: Any, retry_after: str | None = None) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def minilm() -> Embedder:
    return Embedder(device="cpu", cache_size=0)


@pytest.fixture
def server(minilm: Embedder) -> Iterator[EmbeddingsServer]:
    srv = EmbeddingsServer(minilm, key="sekrit")
    yield srv
    srv.close()


# ----------------------------------------------------------------------------- openai
@pytest.mark.slow
def test_openai_backend_gives_the_servers_vectors_in_batches(server, minilm):
    e = OpenAIEmbedder("minilm", server.url, api_key="sekrit", batch_size=8, backoff=0)
    assert e.dim == 384 and e.model_id == "openai:minilm"
    server.batches.clear()
    v = e.encode(TEXTS + TEXTS[:3])  # duplicates are sent once
    np.testing.assert_allclose(v, minilm.encode(TEXTS + TEXTS[:3]), atol=1e-6)
    assert server.batches == [8, 8, 8, 1]  # 25 unique texts in requests of <= 8
    assert e.encode(TEXTS[:2]).shape == (2, 384) and server.batches == [8, 8, 8, 1]  # cached


@pytest.mark.slow
def test_openai_backend_retries_429_and_5xx(server):
    e = OpenAIEmbedder("minilm", server.url, api_key="sekrit", backoff=0, max_retries=3)
    server.fail = [429, 503, 500]
    assert e.encode(["retried"]).shape == (1, 384)
    assert e.stats.retries == 3 and not server.fail
    server.fail = [502] * 4  # one more than max_retries
    with pytest.raises(EmbeddingError, match=r"answered 502.*after 4 attempts\): busy"):
        e.encode(["gives up"])


@pytest.mark.slow
def test_openai_backend_clear_errors_without_retry(server):
    with pytest.raises(EmbeddingError, match=r"answered 401.*invalid api key"):
        OpenAIEmbedder("minilm", server.url, api_key="wrong", backoff=0)
    with pytest.raises(EmbeddingError, match=r"answered 404.*'nope'.*model not found"):
        OpenAIEmbedder("nope", server.url, api_key="sekrit", backoff=0)
    e = OpenAIEmbedder("minilm", server.url, api_key="sekrit", backoff=0)
    server.fail = [400]
    with pytest.raises(EmbeddingError, match=r"answered 400.*after 1 attempts"):
        e.encode(["bad request"])
    assert e.stats.retries == 0


def test_openai_backend_connection_errors_are_retried_then_reported():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EmbeddingError, match="unreachable after 3 attempts"):
        OpenAIEmbedder("m", f"http://127.0.0.1:{port}/v1", max_retries=2, backoff=0)


def test_openai_backend_refuses_malformed_replies():
    import httpx

    replies = iter(
        [
            '{"data": [{"index": 0, "embedding": [3.0, 4.0]}]}',  # the probe: dim 2
            '{"data": [{"index": 0, "embedding": [1.0, 2.0, 3.0]}]}',  # wrong size
            '{"data": [{"index": 0, "embedding": [NaN, 1.0]}]}',
            '{"nodata": true}',
        ]
    )
    transport = httpx.MockTransport(lambda req: httpx.Response(200, text=next(replies)))
    e = OpenAIEmbedder("m", "http://x/v1", transport=transport, cache_size=0)
    assert e.dim == 2
    with pytest.raises(EmbeddingError, match="expected 1 vectors of size 2"):
        e.encode(["a"])
    with pytest.raises(EmbeddingError, match="NaN"):
        e.encode(["a"])
    with pytest.raises(EmbeddingError, match="not an embeddings reply"):
        e.encode(["a"])


# ------------------------------------------------------------------------------- onnx
@pytest.fixture(scope="module")
def onnx_embedder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("onnxruntime")
    from memoryos_gpu.embed import OnnxEmbedder

    return OnnxEmbedder(cache_dir=tmp_path_factory.mktemp("onnx-cache"), batch_size=8)


@pytest.mark.slow
def test_onnx_int8_close_to_torch_same_space(onnx_embedder, minilm):
    v, ref = onnx_embedder.encode(TEXTS), minilm.encode(TEXTS)
    cos = (v * ref).sum(axis=1)
    assert cos.min() > 0.95 and cos.mean() > 0.98, cos
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert onnx_embedder.model_id == minilm.model_id and onnx_embedder.dim == 384
    # each text is still nearest to its own fp32 vector among all of them
    assert (np.argmax(v @ ref.T, axis=1) == np.arange(len(TEXTS))).all()


@pytest.mark.slow
def test_onnx_export_is_cached(onnx_embedder, monkeypatch):
    from memoryos_gpu.embed import OnnxEmbedder, onnx

    path = onnx_embedder.onnx_path
    mtime = path.stat().st_mtime_ns
    monkeypatch.setattr(onnx, "_export_fp32", lambda *a: pytest.fail("exported again"))
    again = OnnxEmbedder(cache_dir=path.parent.parent.parent)
    assert again.onnx_path == path and path.stat().st_mtime_ns == mtime
    onnx_embedder.clear_cache()  # the same batch: int8 activations are scaled per batch
    np.testing.assert_allclose(again.encode(TEXTS[:3]), onnx_embedder.encode(TEXTS[:3]), atol=1e-6)


@pytest.mark.slow
def test_onnx_graph_is_fused_then_quantized(onnx_embedder):
    onnx = pytest.importorskip("onnx")
    graph = onnx.load(str(onnx_embedder.onnx_path), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    # MiniLM's 6 attention blocks and its embeddings fused, then quantized; no fp32 product
    assert sum(n.op_type == "QAttention" for n in graph.node) == 6
    assert {"QEmbedLayerNormalization", "SkipLayerNormalization", "BiasGelu"} <= ops
    assert not ops & {"MatMul", "Attention", "Softmax", "Gather"}


@pytest.mark.slow
def test_onnx_export_refuses_a_graph_that_strays_and_caches_nothing(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime")
    from memoryos_gpu.embed import OnnxEmbedder, onnx

    monkeypatch.setattr(onnx, "_INT8_MIN_COS", 1.01)  # no int8 graph can pass
    with pytest.raises(EmbeddingError, match=r"int8 model of .* cosine"):
        OnnxEmbedder(cache_dir=tmp_path)
    assert not list(tmp_path.rglob("*.onnx"))  # neither the result nor a temporary left


def test_onnx_cache_key_follows_the_recipe(monkeypatch):
    pytest.importorskip("onnxruntime")
    from memoryos_gpu.embed import onnx
    from memoryos_gpu.embed.folder import bundled_minilm_path, read_folder

    spec = read_folder(bundled_minilm_path().resolve(), None, None, None)
    key = onnx._cache_key(spec)
    assert onnx._cache_key(spec) == key
    monkeypatch.setattr(onnx, "_RECIPE", onnx._RECIPE + "-changed")
    assert onnx._cache_key(spec) != key


@pytest.mark.slow
def test_batch_size_defaults_per_backend(onnx_embedder, monkeypatch):
    from memoryos_gpu.embed import onnx

    monkeypatch.setenv(onnx.ENV_CACHE, str(onnx_embedder.onnx_path.parents[2]))  # warm cache
    assert make_embedder(EngineConfig(embedder="onnx")).batch_size == onnx.DEFAULT_BATCH_SIZE
    assert make_embedder(EngineConfig(embedder="transformers")).batch_size == 64
    cfg = EngineConfig(embedder="onnx", embedding_batch_size=5)
    assert make_embedder(cfg).batch_size == 5


def test_onnx_backend_refuses_gpu_and_dtype():
    pytest.importorskip("onnxruntime")
    from memoryos_gpu.embed import OnnxEmbedder

    with pytest.raises(ValueError, match="int8 on the CPU"):
        OnnxEmbedder(device="cuda")


# ------------------------------------------------------------------------ choosing
def test_config_kinds_match_factory_and_cli():
    from memoryos_gpu.cli import options

    field = EngineConfig.model_fields["embedder"].annotation
    assert tuple(field.__args__) == EMBEDDER_KINDS == options.EMBEDDER_KINDS


def test_factory_builds_the_named_backend(server):
    assert isinstance(make_embedder(EngineConfig(embedder="hashing")), HashingEmbedder)
    with pytest.raises(ValueError, match=r"needs embedding_model.*embedding_base_url"):
        make_embedder(EngineConfig(embedder="openai"))
    cfg = EngineConfig(
        embedder="openai",
        embedding_model="minilm",
        embedding_base_url=server.url,
        embedding_api_key="sekrit",
        embedding_batch_size=4,
    )
    e = make_embedder(cfg)
    assert isinstance(e, OpenAIEmbedder) and e.batch_size == 4 and e.dim == 384


@pytest.mark.slow
def test_engine_on_the_openai_backend(server):
    from memoryos_gpu.engine import MemoryEngine

    cfg = EngineConfig(
        embedder="openai",
        embedding_model="minilm",
        embedding_base_url=server.url,
        embedding_api_key="sekrit",
    )
    with MemoryEngine(cfg) as eng:
        eng.add("alice", "I'm running the Portland Marathon on October 6th.", "Good luck!")
        eng.add("alice", "My cat is called Tom.", "Cute!")
        r = eng.retrieve("alice", "When is my race?")
        assert "Marathon" in r.all_pages()[0].user_input
        assert eng.store.get_meta("embedding_model") == "openai:minilm"


def test_cli_passes_the_backend_options(monkeypatch):
    from memoryos_gpu.cli import options

    monkeypatch.setenv(options.ENV_EMBEDDING_API_KEY, "k")
    o = options.EngineOptions(
        embedder="openai", embedding_model="m", embedding_base_url="http://h/v1"
    )
    cfg = options.build_config(o, store=":memory:")
    assert (cfg.embedder, cfg.embedding_model, cfg.embedding_base_url, cfg.embedding_api_key) == (
        "openai",
        "m",
        "http://h/v1",
        "k",
    )
    assert "--embedding-base-url" in o.argv() and "k" not in o.argv()  # the key stays in env


def test_openai_backend_engine_needs_no_torch():
    """A user whose embeddings come from a server never loads torch or transformers."""
    import subprocess
    import sys

    code = """
import sys, httpx
from memoryos_gpu.config import EngineConfig
from memoryos_gpu.embed import OpenAIEmbedder
from memoryos_gpu.engine import MemoryEngine

def reply(req):
    n = len(__import__("json").loads(req.content)["input"])
    return httpx.Response(200, json={"data": [
        {"index": i, "embedding": [1.0, float(i), 0.5]} for i in range(n)]})

e = OpenAIEmbedder("m", "http://x/v1", transport=httpx.MockTransport(reply))
with MemoryEngine(EngineConfig(device="cpu"), embedder=e) as eng:
    eng.add("u", "hello there", "hi")
    eng.retrieve("u", "hello?")
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]

"""Embeddings from an OpenAI-compatible ``/v1/embeddings`` server (vLLM, TEI, llama.cpp, ...).

Texts go in batches of ``batch_size`` per request. A 429, a 5xx or a connection error is
retried with exponential backoff (honouring ``Retry-After``) up to ``max_retries`` times;
any other error, or a reply that does not hold one finite vector of the right size per
input, raises :class:`~memoryos_gpu.embed.base.EmbeddingError` with the server's message.
Rows are L2-normalised here (the engine ranks by cosine; not every server normalises).
Needs no torch or transformers: only httpx.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import httpx
import numpy as np

from memoryos_gpu.embed.base import CachedEmbedder, EmbeddingError
from memoryos_gpu.llm.openai_compat import redact_url

__all__ = ["OpenAIEmbedder"]

_PROBE = "dimension probe"
_RETRY_STATUS = {408, 409, 429}  # and every 5xx


def _retryable(status: int) -> bool:
    return status in _RETRY_STATUS or status >= 500


def _server_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:500]
    except ValueError:
        return resp.text[:500]


class OpenAIEmbedder(CachedEmbedder):
    """Embedder over an OpenAI-compatible server.

    Args:
        model: the served model's name (the request's ``model``).
        base_url: the server's URL up to ``/v1`` (e.g. ``http://127.0.0.1:8001/v1``).
        api_key: sent as ``Authorization: Bearer``; ``None`` = no header.
        batch_size: texts per request.
        timeout: seconds per request.
        max_retries: retries of a transient failure before giving up.
        backoff: first retry delay in seconds (doubles each retry, at most 30 s).
        normalize: L2-normalise the rows.
        cache_size: LRU entries; 0 disables caching.
        transport: an ``httpx`` transport (tests).

    The vector size is read from the server at construction (one probe request), so a
    wrong URL or model fails here, not at the first page.
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key: str | None = None,
        batch_size: int = 64,
        timeout: float = 60.0,
        max_retries: int = 5,
        backoff: float = 0.5,
        normalize: bool = True,
        cache_size: int = 100_000,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not model or not base_url:
            raise ValueError("embedder='openai' needs a model name and a base URL")
        if batch_size < 1 or max_retries < 0 or backoff < 0:
            raise ValueError("batch_size >= 1, max_retries >= 0 and backoff >= 0 required")
        super().__init__(cache_size)
        self.model = model
        self.url = base_url.rstrip("/") + "/embeddings"
        self._shown_url = redact_url(self.url)  # for messages: a user:password@ part masked
        self.batch_size, self.max_retries, self.backoff = int(batch_size), max_retries, backoff
        self.normalize = bool(normalize)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers, transport=transport)
        self._dim = 0
        self._dim = int(self._request([_PROBE]).shape[1])
        self._model_id = f"openai:{model}"

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"OpenAIEmbedder({self.model!r} at {self._shown_url}, dim={self._dim})"

    def _embed(self, texts: list[str]) -> np.ndarray:
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        for s in range(0, len(texts), self.batch_size):
            out[s : s + self.batch_size] = self._request(texts[s : s + self.batch_size])
        return out

    # ------------------------------------------------------------------ one request
    def _request(self, texts: list[str]) -> np.ndarray:
        """One batch, retried on transient failures."""
        payload = {"model": self.model, "input": texts, "encoding_format": "float"}
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                resp = self._client.post(self.url, json=payload)
            except httpx.TransportError as exc:  # refused, reset, timed out
                if last:
                    raise EmbeddingError(
                        f"embedding server {self._shown_url} unreachable after {attempt + 1} "
                        f"attempts: {exc!r}. Is it running, and is embedding_base_url "
                        "(--embedding-base-url) right?"
                    ) from exc
                self._wait(attempt, None)
                continue
            if resp.status_code == 200:
                self.stats.batches += 1
                return self._parse(resp, len(texts))
            if not _retryable(resp.status_code) or last:
                raise EmbeddingError(
                    f"embedding server {self._shown_url} answered {resp.status_code} "
                    f"(model {self.model!r}, after {attempt + 1} attempts): "
                    f"{_server_message(resp)}"
                )
            self._wait(attempt, resp.headers.get("retry-after"))
        raise AssertionError("unreachable")  # pragma: no cover

    def _wait(self, attempt: int, retry_after: str | None) -> None:
        delay = min(30.0, self.backoff * 2**attempt)
        if retry_after:
            with contextlib.suppress(ValueError):  # an HTTP date: keep our own delay
                delay = min(30.0, max(delay, float(retry_after)))
        self.stats.retries += 1
        time.sleep(delay)

    def _parse(self, resp: httpx.Response, n: int) -> np.ndarray:
        """The reply's vectors in input order, checked and (optionally) normalised."""
        try:
            data: list[dict[str, Any]] = resp.json()["data"]
            rows = sorted(data, key=lambda d: int(d["index"]))
            vecs = np.asarray([r["embedding"] for r in rows], dtype=np.float32)
        except (ValueError, KeyError, TypeError) as exc:
            raise EmbeddingError(f"{self._shown_url}: not an embeddings reply ({exc!r})") from None
        if vecs.ndim != 2 or vecs.shape[0] != n or (self._dim and vecs.shape[1] != self._dim):
            raise EmbeddingError(
                f"{self._shown_url}: expected {n} vectors of size {self._dim or 'any'}, "
                f"got shape {vecs.shape}"
            )
        if not np.isfinite(vecs).all():
            raise EmbeddingError(f"{self._shown_url}: the reply holds NaN or infinite values")
        if self.normalize:
            norms = np.linalg.norm(vecs, axis=1, keepdims=True)
            vecs = vecs / np.maximum(norms, 1e-12)
        return vecs

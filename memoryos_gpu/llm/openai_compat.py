"""An OpenAI-compatible HTTP backend (vLLM / SGLang / llama.cpp servers, OpenAI itself).

Every request of a batch is POSTed to ``/v1/chat/completions`` concurrently, with an
``asyncio.Semaphore`` bounding how many are in flight, so the server's continuous batching sees
many of them at once. All HTTP work runs on one private event-loop thread that owns the
``httpx.AsyncClient``; :meth:`generate` submits to it and blocks (so it works from plain code and
from inside a running event loop in another thread), :meth:`agenerate` awaits it without
blocking the caller's loop.

Structured output uses ``response_format``:

* ``"json_schema"``: ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (vLLM, SGLang, OpenAI); ``strict`` is true only for schemas inside OpenAI's strict subset
  (:func:`~memoryos_gpu.llm.openai_body.strict_schema_ok`);
* ``"json_object"``: ``{"type": "json_object", "schema": schema}`` (llama.cpp's server,
  llama-cpp-python);
* ``"none"``: no ``response_format``; the output is only parsed and repaired;
* ``"auto"``: start with ``json_schema``; when the server answers 400/422 complaining about
  ``response_format`` (llama-cpp-python says so with a 500 naming the field), that request's
  stage drops ``strict`` first, then steps down to ``json_object`` and from there to ``none``,
  resending at once. Each stage (``ChatRequest.stage``) steps down on its own, so one schema
  the server dislikes does not cost the others their constrained decoding.

A 400 that rejects ``max_tokens`` (OpenAI's o-series and GPT-5: "Use 'max_completion_tokens'")
or a non-default ``temperature`` is learned for the model (base URL + model name, shared by
every backend instance of this process) and the request is resent at once with
``max_completion_tokens`` or without ``temperature``.

``api_key`` defaults to ``$OPENAI_API_KEY`` (as the OpenAI SDK does: it is sent to whatever
``base_url`` is configured).

``timeout_s`` bounds each request attempt as a whole (connect, send, the server's work and
reading the answer): httpx's own timeout only bounds each read, so a server trickling its
answer a byte at a time would otherwise hold a request for minutes. ``connect_timeout_s``
(default ``min(timeout_s, 10)``) bounds the connect alone: a host that drops packets should
not cost a whole ``timeout_s`` per try.

Retries: 429, 5xx, connection errors and timeouts are retried up to ``max_retries`` times with
exponential backoff and jitter (``Retry-After`` is honoured). Other 4xx answers become
``ChatResult.error`` with the server's message, except 401/403/404 before any request has
succeeded, which raise :class:`LLMBackendError` (wrong key, wrong URL, wrong model name). A
server that cannot be connected to after the retries (refused, or the connect timed out)
raises :class:`LLMBackendError` too, whether or not it answered before: every request of the
batch would fail the same way, and the caller must retry the work later rather than take the
failure as the model's answer. So does a batch whose requests *all* failed for a server-side
reason after their retries (5xx, 429, a timeout, a dropped connection): a gateway answering
502, a crashed model, a hung one. A malformed 200 answer (not JSON, not OpenAI's shape) and a
4xx other than 429 are that request's error alone, and so is a server-side failure among
answers: one request the server failed is not an outage.

Unreachable endpoint (:mod:`~memoryos_gpu.llm.breaker`): connect failures are counted per
backend instance. While the endpoint is unproven (before the first connection, after a connect
failure) one request at a time connects and the rest of the batch waits for it, so a batch
sent to a dead endpoint makes ``max_retries + 1`` connect attempts in all, not that many per
request. After ``max_retries + 1`` consecutive connect failures the circuit breaker opens:
every request fails at once with :class:`LLMBackendError` for ``breaker_cooldown_s`` (30 s),
then one probe may connect (success closes the breaker, failure reopens it). HTTP answers of
any status and read timeouts of a reachable server never count as connect failures: a failing
or slow model is not an unreachable one. A batch whose every request failed server-side opens
the breaker at once (:meth:`CircuitBreaker.trip`) with a message saying the server answers but
cannot serve: the next batches would fail alike, each paying its retries.

:meth:`OpenAICompatBackend.close` cancels the batches in flight: their callers get
:class:`LLMBackendError` at once instead of waiting for a server that may never answer (a
server's shutdown deadline relies on it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import json
import os
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import httpx

from memoryos_gpu.llm.base import (
    ChatRequest,
    ChatResult,
    LLMBackend,
    LLMBackendError,
    _check_requests,
)
from memoryos_gpu.llm.breaker import (
    DEFAULT_COOLDOWN_S,
    OPEN,
    CircuitBreaker,
    ConnectGate,
    EndpointUnreachable,
    Outage,
    describe,
)
from memoryos_gpu.llm.jsonfix import parse_json_output
from memoryos_gpu.llm.openai_body import (
    STYLES,
    ServerError,
    answer_text,
    build_response_format,
    is_format_rejection,
    parse_error,
    rejects_max_tokens,
    rejects_temperature,
    usage_counts,
)

__all__ = ["OpenAICompatBackend", "learned_quirks", "normalize_base_url"]

ENV_API_KEY = "OPENAI_API_KEY"
_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 521, 522, 524, 529})
_FATAL_FIRST_CONTACT = frozenset({401, 403, 404})
_LOWER_STYLE = {"json_schema": "json_object", "json_object": "none"}
_MAX_RESENDS = 6  # two learned fields + strict off + two style steps, and one spare
#: the default connect timeout when timeout_s is longer: a reachable server accepts in far less
DEFAULT_CONNECT_TIMEOUT_S = 10.0
#: what 400s taught about each (base_url, model): "max_completion_tokens", "no_temperature"
_QUIRKS: dict[tuple[str, str], frozenset[str]] = {}
_QUIRKS_LOCK = threading.Lock()


def learned_quirks(base_url: str, model: str) -> frozenset[str]:
    """What this process has learned about ``model`` at ``base_url`` from its 400s."""
    return _QUIRKS.get((normalize_base_url(base_url), model), frozenset())


def normalize_base_url(base_url: str) -> str:
    """``http://h:8000``, ``http://h:8000/`` and ``http://h:8000/v1`` all → ``http://h:8000/v1``."""
    url = base_url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    if url.endswith("/chat/completions"):
        url = url[: -len("/chat/completions")]
    if not re.search(r"/v\d+$", url):
        url += "/v1"
    return url


def redact_url(url: str) -> str:
    """``url`` without the password of a ``user:password@`` part, for error messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


class _Fatal(Exception):
    """Internal: abort the whole batch with LLMBackendError."""


class _ConnectFailed(Exception):
    """Internal: an attempt could not connect; ``kind``: "connect timed out", "connection
    refused" or "connect failed"; ``detail``: the exception behind it."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def _check_numbers(**options: Any) -> None:
    """ValueError naming the first numeric option that is not a number (None: not given):
    ``timeout_s = "3"`` in a config file failed a comparison and said only "'>' not supported
    between instances of 'str' and 'int'"."""
    for name, value in options.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


class OpenAICompatBackend(LLMBackend):
    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        max_concurrency: int = 32,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        response_format_style: str = "auto",
        extra_body: dict | None = None,
        *,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 20.0,
        max_retry_after_s: float = 60.0,
        headers: dict[str, str] | None = None,
        connect_timeout_s: float | None = None,
        breaker_cooldown_s: float = DEFAULT_COOLDOWN_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__()
        _check_numbers(
            max_concurrency=max_concurrency,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_base_s=backoff_base_s,
            backoff_max_s=backoff_max_s,
            max_retry_after_s=max_retry_after_s,
            connect_timeout_s=connect_timeout_s,
            breaker_cooldown_s=breaker_cooldown_s,
        )
        if response_format_style not in STYLES:
            raise ValueError(
                f"response_format_style must be one of {STYLES}, got {response_format_style!r}"
            )
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if not timeout_s > 0:  # also NaN: each attempt's deadline
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not model:
            raise ValueError("model must be given (the served model name)")
        if connect_timeout_s is None:
            connect_timeout_s = min(float(timeout_s), DEFAULT_CONNECT_TIMEOUT_S)
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s!r}")
        if not breaker_cooldown_s >= 0:
            raise ValueError(f"breaker_cooldown_s must be >= 0, got {breaker_cooldown_s!r}")
        self.base_url = normalize_base_url(base_url)
        self.url = self.base_url + "/chat/completions"
        self._shown_url = redact_url(self.base_url)  # for messages
        self.model = model
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_retries = int(max_retries)
        self.requested_style = response_format_style
        # the style a stage starts with; "auto" starts at json_schema, and each stage may step
        # down on its own (remembered in _stage_styles; _loose: stages sent without strict)
        self.style = "json_schema" if response_format_style == "auto" else response_format_style
        self._stage_styles: dict[str, str] = {}
        self._loose: set[str] = set()
        self.extra_body = dict(extra_body or {})
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.max_retry_after_s = float(max_retry_after_s)
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        api_key = api_key or os.environ.get(ENV_API_KEY) or None
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._contacted = False  # a request has succeeded at least once
        self._transport = transport  # None: httpx's own (tests and proxies may pass one)
        #: connect failures of this endpoint; ``breaker.clock`` may be replaced (tests)
        self.breaker = CircuitBreaker(self.max_retries + 1, breaker_cooldown_s)
        self._gate = ConnectGate(
            self.breaker,
            lambda n: self._backoff(n, None),
            connect_limit_s=min(self.timeout_s, self.connect_timeout_s),
        )
        self._style_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._closed = False

    # ------------------------------------------------------------------ loop management

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The backend's event loop, started on first use; the caller holds ``_start_lock``."""
        if self._closed:
            raise LLMBackendError("OpenAICompatBackend is closed")
        if self._loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            t = threading.Thread(target=run, name="memoryos-llm-http", daemon=True)
            t.start()
            ready.wait()
            self._loop, self._thread = loop, t
        return self._loop

    def _submit(self, requests: list[ChatRequest]) -> Future[list[ChatResult]]:
        """Schedule a batch on the loop. Under ``_start_lock``, as :meth:`close` marks the
        backend closed: a batch is either scheduled before close cancels what is in flight,
        or refused, never left on a stopped loop (its caller would wait for good)."""
        with self._start_lock:
            loop = self._ensure_loop()
            if threading.current_thread() is self._thread:
                raise LLMBackendError("generate() called from the backend's own event loop thread")
            return asyncio.run_coroutine_threadsafe(self._run_batch(requests), loop)

    # ------------------------------------------------------------------ public API

    def _generate_batch(self, requests: list[ChatRequest]) -> list[ChatResult]:
        try:
            return self._submit(requests).result()
        except concurrent.futures.CancelledError:  # close() cancelled it
            raise LLMBackendError(self._closed_in_flight()) from None

    async def agenerate(self, requests: Sequence[ChatRequest]) -> list[ChatResult]:
        reqs = _check_requests(requests)
        if not reqs:
            return []
        try:
            results = await asyncio.wrap_future(self._submit(reqs))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._closed or (task is not None and task.cancelling()):
                raise  # the caller was cancelled, not the batch
            raise LLMBackendError(self._closed_in_flight()) from None
        self.stats.record_batch(reqs, results)
        return results

    def _closed_in_flight(self) -> str:
        return (
            f"the LLM backend for {self._shown_url} was closed while this batch was in flight: "
            "it was not answered"
        )

    def close(self) -> None:
        """Cancel the batches in flight (their callers get :class:`LLMBackendError` now, not
        when a hung server answers), close the HTTP client and stop the loop. Idempotent."""
        with self._start_lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None:
            return

        async def shutdown() -> None:
            me = asyncio.current_task()
            in_flight = [t for t in asyncio.all_tasks() if t is not me]
            for t in in_flight:
                t.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            if self._client is not None:
                await self._client.aclose()

        fut = asyncio.run_coroutine_threadsafe(shutdown(), loop)
        if thread is not None and thread is not threading.current_thread():
            with contextlib.suppress(Exception):
                fut.result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if not loop.is_running():
                loop.close()
        else:  # closing from the loop thread itself (e.g. __del__ there): don't wait on ourselves
            fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(loop.stop))
        self._loop = self._thread = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown ordering varies
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ async core

    async def _run_batch(self, requests: list[ChatRequest]) -> list[ChatResult]:
        if self.breaker.state == OPEN:  # fail the whole batch at once, no task started
            raise self._batch_error(self._refusal())
        if self._client is None:
            limits = httpx.Limits(
                max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
            )
            timeout = httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
            self._client = httpx.AsyncClient(
                timeout=timeout, limits=limits, transport=self._transport
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)
        tasks = [asyncio.ensure_future(self._one(r)) for r in requests]
        try:
            outcomes = await asyncio.gather(*tasks)
        except _Fatal as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise self._batch_error(str(e)) from None
        results = [r for r, _ in outcomes]
        if all(server_side for _, server_side in outcomes):
            raise self._batch_error(self._failed_everything(results))
        return results

    def _batch_error(self, message: str) -> LLMBackendError:
        """The error that fails a whole batch, with the breaker's remaining cool-down as its
        ``retry_after`` when the breaker is open: the message says "not trying again for N s",
        and a server answering 503 for it tells its clients the same wait."""
        return LLMBackendError.refusing(message, self.breaker.outage().retry_in_s)

    def _failed_everything(self, results: list[ChatResult]) -> str:
        """Open the breaker for a batch whose every request failed server-side after its
        retries, and say so: taking those failures as the model's answers would store the
        callers' fallbacks for good, and the next batches would pay the retries again."""
        tries = self.max_retries + 1
        n = len(results)
        what = (
            f"{'the one request' if n == 1 else f'all {n} requests'} of a batch failed, "
            f"{tries} {'try' if tries == 1 else 'tries'} each"
        )
        self.breaker.trip(what, results[-1].error or "")
        return self._failing()

    def style_for(self, stage: str) -> str:
        """The ``response_format`` style requests of ``stage`` are sent with now."""
        return self._stage_styles.get(stage, self.style)

    @property
    def styles(self) -> dict[str, str]:
        """The stages that stepped down, and their style now."""
        with self._style_lock:
            return dict(self._stage_styles)

    def _quirks(self) -> frozenset[str]:
        return _QUIRKS.get((self.base_url, self.model), frozenset())

    def _body(self, req: ChatRequest, style: str, quirks: frozenset[str]) -> dict[str, Any]:
        limit = "max_completion_tokens" if "max_completion_tokens" in quirks else "max_tokens"
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in req.messages],
            limit: req.max_tokens,
        }
        if "no_temperature" not in quirks:
            body["temperature"] = req.temperature
        rf = build_response_format(req, style, strict=req.stage not in self._loose)
        if rf is not None:
            body["response_format"] = rf
        body.update(self.extra_body)
        return body

    def _learn(self, err: ServerError, used: frozenset[str]) -> bool:
        """After a 400: learn what the model rejected; False if there is nothing new to try."""
        if rejects_max_tokens(err):
            quirk = "max_completion_tokens"
        elif rejects_temperature(err):
            quirk = "no_temperature"
        else:
            return False
        if quirk in used:  # the body already had it: the server objects to something else
            return False
        with _QUIRKS_LOCK:
            key = (self.base_url, self.model)
            _QUIRKS[key] = _QUIRKS.get(key, frozenset()) | {quirk}
        return True

    def _step_down_style(self, stage: str, used: str, used_strict: bool) -> bool:
        """After a response_format rejection of a ``stage`` request sent under ``used``: drop
        strict, else step that stage down; False when there is nothing lower to try."""
        with self._style_lock:
            if self.style_for(stage) != used or (used_strict and stage in self._loose):
                return True  # another request of this stage already stepped down
            if used_strict:
                self._loose.add(stage)
                return True
            lower = _LOWER_STYLE.get(used)
            if self.requested_style != "auto" or lower is None:
                return False
            self._stage_styles[stage] = lower
            return True

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_retry_after_s)
        cap = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        return cap / 2 + random.uniform(0, cap / 2)

    async def _attempt(self, body: dict[str, Any]) -> httpx.Response:
        """One POST through the connect gate (which holds it back while another request
        probes an unproven endpoint). Raises :class:`EndpointUnreachable` when the breaker is
        open or this attempt's connect failure opened it, :class:`_ConnectFailed` for a
        connect failure short of that, other errors as :meth:`_post` raises them."""
        attempt = await self._gate.enter()
        try:
            assert self._sem is not None
            async with self._sem:
                resp = await self._post(body, attempt.trace)
        except BaseException as e:
            kind = self._gate.settle(attempt, e)
            if kind is None:
                raise
            if attempt.tripped:
                raise EndpointUnreachable from None
            raise _ConnectFailed(kind, describe(e, self._gate.connect_limit_s)) from None
        self._gate.settle(attempt, None)
        return resp

    async def _post(self, body: dict[str, Any], trace: Any = None) -> httpx.Response:
        """One POST, body read, under an overall deadline of ``timeout_s`` (raises
        ``TimeoutError`` past it): httpx's timeout is per read, which a trickling server
        never trips. ``trace``: httpx's trace hook (tells the gate when the connect is done)."""
        assert self._client is not None
        ext = {"trace": trace} if trace is not None else None
        async with asyncio.timeout(self.timeout_s):
            return await self._client.post(
                self.url, json=body, headers=self._headers, extensions=ext
            )

    async def _one(self, req: ChatRequest) -> tuple[ChatResult, bool]:
        """One request with its retries and resends: its result, and whether it failed for a
        server-side reason (5xx, 429, a timeout, a dropped connection) after its retries."""
        assert self._client is not None and self._sem is not None
        attempt = 0  # retries used
        resends = 0  # immediate resends after a 400 that changed the body (bounded: a server
        # that rejects every variant must not keep a request looping)
        last_error = "no attempt made"
        while True:
            style = self.style_for(req.stage)
            quirks = self._quirks()
            body = self._body(req, style, quirks)
            retry_after: float | None = None
            connect_failed = False
            try:
                resp = await self._attempt(body)
                status, content, headers = resp.status_code, resp.content, resp.headers
            except EndpointUnreachable:
                raise _Fatal(self._refusal()) from None
            except _ConnectFailed as e:  # short of opening the breaker: retried
                last_error, status, connect_failed = str(e), None, True
                if attempt >= self.max_retries:  # this request's tries are spent all the same
                    raise _Fatal(self._unreachable(e, attempt + 1)) from None
            except (httpx.TimeoutException, TimeoutError) as e:
                last_error = f"timeout after {self.timeout_s:g}s ({type(e).__name__})"
                status = None
            except httpx.TransportError as e:
                last_error = f"connection error: {type(e).__name__}: {e}"
                status = None
            if status is not None:
                if status == 200:
                    try:
                        data = json.loads(content)
                    except (ValueError, RecursionError):  # not JSON, or nested too deep
                        last_error = f"HTTP 200 with a non-JSON body: {content[:200]!r}"
                        if attempt < self.max_retries:
                            attempt += 1
                            self.stats.add(retries=1)
                            await asyncio.sleep(self._backoff(attempt - 1, None))
                            continue
                        # the server's failure, not the model's answer: an HTML error page or
                        # a web UI at base_url answers every request so, and taken as answers
                        # the whole batch was stored as fallbacks for good
                        return ChatResult.failed(last_error), True
                    self._contacted = True
                    return self._result(req, data, content), False
                err = parse_error(content)
                last_error = f"HTTP {status}: {err.message}"
                if resends < _MAX_RESENDS and (
                    (status in (400, 422) and self._learn(err, quirks))
                    or (
                        req.json_schema is not None
                        and is_format_rejection(status, err, style)
                        and self._step_down_style(req.stage, style, _sent_strict(body))
                    )
                ):
                    resends += 1
                    continue  # resend at once with what the server takes (not a retry)
                if status in _FATAL_FIRST_CONTACT and not self._contacted:
                    hint = {
                        401: "check api_key",
                        403: "check api_key and its permissions",
                        404: f"check base_url ({self._shown_url}) and model name ({self.model!r})",
                    }[status]
                    url = redact_url(self.url)
                    raise _Fatal(f"LLM server at {url} answered {last_error} ({hint})")
                if status not in _RETRY_STATUS and status < 500:
                    return ChatResult.failed(last_error), False
                retry_after = _retry_after(headers)
            if attempt >= self.max_retries:  # server-side: 5xx, 429, a timeout, a dropped line
                gave_up = ChatResult.failed(f"{last_error} (gave up after {attempt} retries)")
                return gave_up, status is None or status >= 500 or status == 429
            # after a connect failure the gate paces the next try, shared by the whole batch
            delay = 0.0 if connect_failed else self._backoff(attempt, retry_after)
            attempt += 1
            self.stats.add(retries=1)
            await asyncio.sleep(delay)

    def _refusal(self) -> str:
        """Why a batch is refused while the breaker is open: unreachable, or failing."""
        return self._failing() if self.breaker.outage().failing else self._unreachable()

    def _failing(self) -> str:
        """The message of the LLMBackendError raised while the breaker is open because the
        server answered but failed every request of a batch (:meth:`_failed_everything`)."""
        out = self.breaker.outage()
        ago, wait = _since_and_until(out)
        return (
            f"the LLM server at {self._shown_url} answers but cannot serve ({out.what}{ago})"
            f"{wait}. Check the server and what is in front of it: a gateway answering 502/503, "
            "a crashed or overloaded model, a rate limit's 429, or a model slower than "
            f"timeout_s ({self.timeout_s:g} s). Last error: {out.detail}"
        )

    def _unreachable(self, failure: _ConnectFailed | None = None, tries: int = 1) -> str:
        """The message of the LLMBackendError raised when the server cannot be connected to:
        what happened, since when, until when nothing is tried, and what to check (never a
        header: the API key stays out). From the breaker's record unless ``failure`` (this
        request's own last try, ``tries`` of them) is given."""
        out = self.breaker.outage()
        what, detail = (out.what, out.detail) if failure is None else (failure.kind, failure.detail)
        tries = out.tries if failure is None else tries
        ago, wait = _since_and_until(out)
        before = "; it answered earlier: did it stop?" if self._contacted else ""
        return (
            f"cannot connect to the LLM server at {self._shown_url}: unreachable ({what} after "
            f"{tries} {'try' if tries == 1 else 'tries'}{ago}{before}){wait}. Is it running "
            "(e.g. `vllm serve MODEL` or `python -m llama_cpp.server --model FILE.gguf`), is "
            "base_url right, and can this host reach it (a firewall that drops packets makes "
            f"connects time out)? Last error: {detail}"
        )

    def _result(self, req: ChatRequest, data: Any, raw: bytes) -> ChatResult:
        """The result of a decoded 200 answer (``raw``: its body). Any shape but OpenAI's
        becomes this request's error, so one odd answer never fails its batch."""
        pt, ct = usage_counts(data)
        text = answer_text(data)
        if text is None:
            excerpt = raw[:300].decode("utf-8", "replace")
            return ChatResult("", None, pt, ct, error=f"malformed response: {excerpt}")
        parsed = None
        if req.json_schema is not None:
            try:
                parsed, repaired = parse_json_output(text, req.json_schema)
            except ValueError as e:  # the schema itself is invalid
                return ChatResult(text, None, pt, ct, error=str(e))
            if parsed is None:
                self.stats.add(invalid_json=1)
            elif repaired:
                self.stats.add(repaired_json=1)
        return ChatResult(text, parsed, pt, ct)


def _sent_strict(body: dict[str, Any]) -> bool:
    rf = body.get("response_format") or {}
    return bool((rf.get("json_schema") or {}).get("strict"))


def _retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        dt = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, dt.timestamp() - time.time())


def _since_and_until(out: Outage) -> tuple[str, str]:
    """The parts of a refusal that say since when the breaker is open and until when nothing
    is tried (each empty when it does not apply)."""
    ago = f", {out.ago_s:.0f} s ago" if out.ago_s >= 1 else ""
    wait = f"; not trying again for {out.retry_in_s:.3g} s" if out.retry_in_s > 0 else ""
    return ago, wait

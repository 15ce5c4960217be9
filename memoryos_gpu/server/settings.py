"""Server settings: batching, fair queues, queue bounds, limits, rate limits (all overridable
by keyword).

Every number is finite and has an upper bound no real deployment needs to pass (docs/server.md
lists them): a TOML ``inf`` or a typo'd ``1e12`` otherwise starts a server whose batching windows
never close, so it answers nothing and says nothing about why.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Upper bounds (the table under docs/server.md's `[server]` example). Gather windows longer
# than a minute only hold requests hostage; the size and count bounds sit far above any box's
# memory or any sane request.
MAX_WAIT_MS = 60_000.0  # every batching / gather window (ms)
MAX_BATCH = 1_000_000  # items per engine call, per chunk, per request
MAX_QUEUE = 100_000_000  # items admitted to a queue at once
MAX_REQUEST_BYTES = 2**30  # one request: body bytes, text characters, chunk characters
MAX_QUEUE_BYTES = 2**40  # bytes / characters held or allowed over time (queues, buckets)
MAX_RATE = 1e9  # requests / pages per second; 0 (not a huge number) disables a limit
MAX_BURST = 10**9  # requests / pages one key may send at once


class ServerSettings(BaseModel):
    """Tunables of the HTTP / MCP server. Defaults suit a small box serving LLM-free writes."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    # micro-batching
    max_batch: int = Field(
        64, ge=1, le=MAX_BATCH, description="Retrievals per engine.retrieve_many call."
    )
    max_wait_ms: float = Field(
        2.0,
        ge=0,
        le=MAX_WAIT_MS,
        description="How long the first queued retrieval waits for company.",
    )
    write_max_batch: int = Field(
        256, ge=1, le=MAX_BATCH, description="Pages per engine.add_many call."
    )
    write_max_wait_ms: float = Field(
        2.0, ge=0, le=MAX_WAIT_MS, description="Gather window of the write queue."
    )
    # fair writes: one queue per tenant, served round robin in chunks, on several lanes
    write_chunk_pages: int = Field(
        16,
        ge=1,
        le=MAX_BATCH,
        description="Pages per chunk of a large write request (the unit of turns).",
    )
    write_chunk_chars: int = Field(
        50_000,
        ge=1,
        le=MAX_REQUEST_BYTES,
        description="Text characters per chunk of a large write request (a chunk holds at "
        "least one page): other tenants' writes are served between two chunks.",
    )
    write_batch_chars: int = Field(
        200_000,
        ge=1,
        le=MAX_REQUEST_BYTES,
        description="Text characters per engine.add_many call (at least a chunk).",
    )
    write_lanes: int = Field(
        2,
        ge=1,
        le=1024,
        description="add_many calls run at once (each tenant in one at a time, so its pages "
        "keep their order): another tenant's write does not wait for a large chunk's "
        "embedding, which runs outside the engine lock.",
    )
    tenant_write_queue_limit: int = Field(
        4096,
        ge=1,
        le=MAX_QUEUE,
        description="Pages one tenant may have admitted to the write queue at once.",
    )
    tenant_write_queue_chars: int = Field(
        40_000_000,
        ge=1,
        le=MAX_QUEUE_BYTES,
        description="Text characters one tenant may have admitted to the write queue at once.",
    )
    respond_max_batch: int = Field(
        32, ge=1, le=MAX_BATCH, description="Queries per engine.respond_many call."
    )
    respond_max_wait_ms: float = Field(
        5.0, ge=0, le=MAX_WAIT_MS, description="Gather window of responses."
    )
    # bounded queues (admitted but unanswered items); past them requests get 503 + Retry-After
    read_queue_limit: int = Field(
        4096, ge=1, le=MAX_QUEUE, description="Retrievals admitted at once."
    )
    tenant_read_queue_limit: int = Field(
        1024,
        ge=1,
        le=MAX_QUEUE,
        description="Retrievals one tenant may have admitted at once (past it: 429 for that "
        "tenant, while the others' are still admitted).",
    )
    write_queue_limit: int = Field(16384, ge=1, le=MAX_QUEUE, description="Pages admitted at once.")
    respond_queue_limit: int = Field(
        256, ge=1, le=MAX_QUEUE, description="Responses admitted at once."
    )
    retry_after_s: int = Field(
        1, ge=1, le=3600, description="Retry-After sent with 503 overload answers."
    )
    # derived work (chain, MTM placement, promotion) in a background thread
    derived_max_wait_ms: float = Field(
        200.0,
        ge=0,
        le=MAX_WAIT_MS,
        description="How long pending pages wait for company before each derived-work round "
        "runs, so work coalesces into rounds of many users (per-page cost halves from 4 to 16+ "
        "pages a round); cut short when derived_max_batch items are pending or a reader waits "
        "on /wait. 0 = run at once.",
    )
    derived_max_batch: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        description="Pages per derived-work round (default: the engine's derived_max_batch, "
        "256); 1 = one page at a time.",
    )
    derived_enabled: bool = Field(True, description="Run the background derived-work worker.")
    # limits (413 past them)
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, le=MAX_REQUEST_BYTES, description="Request body limit."
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        le=2**24,
        description="Limit of a request's headers together (431 past it).",
    )
    max_text_chars: int = Field(
        100_000, ge=1, le=MAX_REQUEST_BYTES, description="Limit of each text field."
    )
    max_batch_items: int = Field(
        1000, ge=1, le=MAX_BATCH, description="Pages or queries in one request."
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds a request's whole body may take to arrive, counted from its "
        "headers (408 past it, nothing of the request stored, the connection closed): a "
        "client that stalls or trickles its upload holds no connection, request or shutdown "
        "longer. Bounds the whole body, not the gap between two of its chunks, so a byte a "
        "second cannot keep a request open either.",
    )
    forwarded_allow_ips: str | None = Field(
        None,
        description="The proxies (comma-separated addresses or networks, '*' for any) whose "
        "X-Forwarded-For / X-Forwarded-Proto headers give the client's address: set it behind "
        "a reverse proxy. Unset, those headers are ignored: uvicorn trusted them from "
        "127.0.0.1, so any local process could pose as any address and slip past the "
        "per-address throttle of unknown keys.",
    )
    header_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds a request's headers may take to arrive, counted from the "
        "connection (or, on a kept-alive one, from the request's first byte): past it the "
        "connection is closed (408 once a request has begun), so a client that sends nothing "
        "or trickles its headers (slowloris) holds no connection longer.",
    )
    max_user_id_chars: int = Field(200, ge=1, le=240, description="Limit of a user id.")
    max_wait_timeout_s: float = Field(60.0, gt=0, le=3600, description="Cap of /wait timeouts.")
    # rate limits per API key (token buckets); 0 disables one; open mode is not rate limited
    rate_limit_per_s: float = Field(
        500.0, ge=0, le=MAX_RATE, description="Sustained requests per second."
    )
    auth_failures_per_s: float = Field(
        1.0,
        ge=0,
        le=MAX_RATE,
        description="Unknown API keys accepted per client address per second.",
    )
    auth_failures_burst: int = Field(
        20, ge=1, le=MAX_BURST, description="Unknown keys an address may send at once before 429s."
    )
    metrics_public: bool = Field(
        False,
        description="Serve /metrics without a key on a server with API keys (a Prometheus "
        "scraper on a private network). Off, /metrics needs the admin key "
        "(Authorization: Bearer KEY): it shows every tenant's load (request counts and "
        "latencies, queue depths, engine counters), which a tenant's key never sees. "
        "A server without API keys serves /metrics to anyone either way.",
    )
    docs: bool = Field(
        True, description="Serve /docs and /redoc (from the package's files: no CDN)."
    )
    rate_limit_burst: int = Field(1000, ge=1, le=MAX_BURST, description="Bucket size (burst).")
    rate_limit_bytes_per_s: float = Field(
        4 * 1024 * 1024,
        ge=0,
        le=MAX_QUEUE_BYTES,
        description="Sustained request-body bytes per second.",
    )
    rate_limit_bytes_burst: int = Field(
        32 * 1024 * 1024,
        ge=1,
        le=MAX_QUEUE_BYTES,
        description="Body bytes one key may send at once (at least max_body_bytes).",
    )
    rate_limit_pages_per_s: float = Field(
        2000.0, ge=0, le=MAX_RATE, description="Sustained pages written per second."
    )
    rate_limit_pages_burst: int = Field(
        4000,
        ge=1,
        le=MAX_BURST,
        description="Pages one key may write at once (at least max_batch_items).",
    )
    # native kernels: OpenMP threads in the engine threads (None: leave the runtime default)
    native_threads: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="OpenMP threads of engine calls; None = 1 on machines with <= 2 cores "
        "(tiny per-request batches lose to OpenMP wake-up cost there), else the runtime default.",
    )
    switch_interval_ms: float | None = Field(
        1.0,
        gt=0,
        le=1000,
        description="The interpreter's thread switch interval while the server runs "
        "(sys.setswitchinterval, process-wide; Python's default is 5 ms): a small request "
        "waits for the interpreter lock behind a thread busy with another tenant's large pages "
        "about this long at each of its steps. None = leave it.",
    )
    gc_freeze: bool = Field(
        False,
        description="Once the engine has loaded, keep what the process holds then (its modules, "
        "the loaded users' state) out of the garbage collector's later full scans (gc.freeze, "
        "process-wide; memoryos_gpu.host_memory): 63 ms -> <1 ms a scan with 10,000 users "
        "loaded, a pause of every request in flight. `memoryos-gpu serve` turns it on in its "
        "processes; off by default, for processes that build many services (tests).",
    )
    direct_routes: bool = Field(
        True,
        description="Serve the two hot routes (add a page, retrieve) straight from the edge "
        "middleware instead of through FastAPI's routing (same validation, answers and errors; "
        "~12 % less server CPU under load).",
    )
    http_telemetry: bool = Field(
        False,
        description="FastAPI's own OpenTelemetry instrumentation (request spans, HTTP metrics, "
        "error logs) through the globally configured OpenTelemetry providers (an SDK set up in "
        "the process, or opentelemetry-instrument). Off, FastAPI still looks for configured "
        "providers on every request, ~9 % of an HTTP worker's CPU under load; this server's "
        "Prometheus metrics (/metrics) do not depend on it.",
    )
    close_engine: bool | None = Field(
        None, description="Close the engine on shutdown (default: only if the server built it)."
    )

    def proxy_headers(self) -> dict[str, Any]:
        """uvicorn's options for the X-Forwarded-* headers: trusted from
        ``forwarded_allow_ips`` only, else ignored (the setting says why)."""
        if self.forwarded_allow_ips:
            return {"proxy_headers": True, "forwarded_allow_ips": self.forwarded_allow_ips}
        return {"proxy_headers": False}

    @model_validator(mode="after")
    def _requests_within_limits_fit(self) -> ServerSettings:
        """A request the size limits allow must fit the rate-limit buckets and the tenant's
        queue share; otherwise it could never be served, only retried forever."""
        checks = [
            (
                "rate_limit_bytes_burst",
                self.rate_limit_bytes_burst,
                "max_body_bytes",
                self.max_body_bytes,
                self.rate_limit_bytes_per_s,
            ),
            (
                "rate_limit_pages_burst",
                self.rate_limit_pages_burst,
                "max_batch_items",
                self.max_batch_items,
                self.rate_limit_pages_per_s,
            ),
            (
                "tenant_write_queue_limit",
                self.tenant_write_queue_limit,
                "max_batch_items",
                self.max_batch_items,
                1,
            ),
            (
                "tenant_read_queue_limit",
                self.tenant_read_queue_limit,
                "max_batch_items",
                self.max_batch_items,
                1,
            ),
            (
                "tenant_write_queue_chars",
                self.tenant_write_queue_chars,
                "max_body_bytes",
                self.max_body_bytes,
                1,
            ),
        ]
        for name, value, bound, need, enabled in checks:
            if enabled and value < need:
                raise ValueError(f"{name} ({value}) must be at least {bound} ({need})")
        return self

"""Server settings: batching, queue bounds, limits, rate limits (all overridable by keyword)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServerSettings(BaseModel):
    """Tunables of the HTTP / MCP server. Defaults suit a small box serving LLM-free writes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # micro-batching
    max_batch: int = Field(64, ge=1, description="Retrievals per engine.retrieve_many call.")
    max_wait_ms: float = Field(
        2.0, ge=0, description="How long the first queued retrieval waits for company."
    )
    write_max_batch: int = Field(256, ge=1, description="Pages per engine.add_many call.")
    write_max_wait_ms: float = Field(2.0, ge=0, description="Gather window of the write queue.")
    respond_max_batch: int = Field(32, ge=1, description="Queries per engine.respond_many call.")
    respond_max_wait_ms: float = Field(5.0, ge=0, description="Gather window of responses.")
    # bounded queues (admitted but unanswered items); past them requests get 503 + Retry-After
    read_queue_limit: int = Field(4096, ge=1, description="Retrievals admitted at once.")
    write_queue_limit: int = Field(16384, ge=1, description="Pages admitted at once.")
    respond_queue_limit: int = Field(256, ge=1, description="Responses admitted at once.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 503 overload answers.")
    # derived work (chain, MTM placement, promotion) in a background thread
    derived_max_wait_ms: float = Field(
        200.0,
        ge=0,
        description="How long the first pending page waits for company before its derived-work "
        "round runs, so work coalesces into rounds of many users (per-page cost halves from 4 "
        "to 16+ pages a round); cut short when derived_max_batch pages wait or a reader waits "
        "on /wait. 0 = run at once.",
    )
    derived_max_batch: int | None = Field(
        None,
        ge=1,
        description="Pages per derived-work round (default: the engine's derived_max_batch, "
        "256); 1 = one page at a time.",
    )
    derived_enabled: bool = Field(True, description="Run the background derived-work worker.")
    # limits (413 past them)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Request body limit.")
    max_text_chars: int = Field(100_000, ge=1, description="Limit of each text field.")
    max_batch_items: int = Field(1000, ge=1, description="Pages or queries in one request.")
    max_user_id_chars: int = Field(200, ge=1, le=240, description="Limit of a user id.")
    max_wait_timeout_s: float = Field(60.0, gt=0, description="Cap of /wait timeouts.")
    # rate limit per API key (token bucket); 0 disables; open mode is not rate limited
    rate_limit_per_s: float = Field(500.0, ge=0, description="Sustained requests per second.")
    rate_limit_burst: int = Field(1000, ge=1, description="Bucket size (burst).")
    # native kernels: OpenMP threads in the engine threads (None: leave the runtime default)
    native_threads: int | None = Field(
        None,
        ge=1,
        description="OpenMP threads of engine calls; None = 1 on machines with <= 2 cores "
        "(tiny per-request batches lose to OpenMP wake-up cost there), else the runtime default.",
    )
    direct_routes: bool = Field(
        True,
        description="Serve the two hot routes (add a page, retrieve) straight from the edge "
        "middleware instead of through FastAPI's routing (same validation, answers and errors; "
        "~12 % less server CPU under load).",
    )
    close_engine: bool | None = Field(
        None, description="Close the engine on shutdown (default: only if the server built it)."
    )

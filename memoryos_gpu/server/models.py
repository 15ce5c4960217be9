"""Request and response bodies of the HTTP API (pydantic; documented in the OpenAPI schema).

Every request body derives from :class:`_Strict`, which reads JSON types as they are written.
Text length and batch size limits are checked by the handlers (413 with a message), not by
these models, because they come from :class:`~memoryos_gpu.server.settings.ServerSettings`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from memoryos_gpu.engine.validation import check_meta_depth
from memoryos_gpu.mem0.filters import entity_id


class _Strict(BaseModel):
    """The base of every request body, so that one rule holds on every route (the direct ones
    too: they validate with the same models).

    ``extra="forbid"``: an unknown (misspelt) field is a 422, not silently ignored.
    ``strict=True``: a value must have the JSON type its field documents, or it is a 422
    naming the field: pydantic's lax mode read ``"top_pages": "3"`` as 3, ``true`` as 1 and
    ``"true"`` as a boolean, so a client's typing mistake was served rather than reported. A
    JSON integer still fills a number field (``"threshold": 1``). Query and path parameters
    are not bodies: they arrive as text and are read by their declared types."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _printable_id(value: str | None, what: str) -> str | None:
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"{what} must not be blank")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what} must not contain control characters")
    return value


def _written_name(value: str | None, what: str) -> str | None:
    """A ``source`` or ``assistant_id`` (mem0's ``agent_id``) a page is written with:
    :func:`_printable_id`, and no '/', in open mode too, for the reason a written user id may
    not hold one (docs/server.md, *User ids in paths*): ids get the tenant prefix
    (``tenant/SOURCE``), so an open server's ``acme/s1`` would be tenant ``acme``'s source
    ``s1`` once the server has keys, refusing that tenant's own ``s1`` (or sharing its
    default assistant's knowledge, for ``acme/default``)."""
    value = _printable_id(value, what)
    if value is not None and "/" in value:
        raise ValueError(
            f"{what} must not contain '/': it would collide with a tenant's ids once the "
            "server has API keys"
        )
    return value


def _shallow_meta(value: dict[str, Any] | None, what: str) -> dict[str, Any] | None:
    """``value`` if it nests at most the engine's ``MAX_META_DEPTH`` levels, else ValueError
    (a 422 naming the field and the limit). Why here and not only in the engine, which refuses
    it too: under ``serve --workers`` the meta is pickled to the engine process first, and
    pickling recurses per level (a meta ~490 deep failed the send and, with it, every request
    of other tenants sent in the same message); a model checks it in the worker, for the
    FastAPI and the direct routes alike."""
    if value is not None:
        check_meta_depth(value, what)  # InvalidInputError is a ValueError: pydantic's 422
    return value


def _not_bool(value: Any) -> Any:
    """Refuse a boolean timestamp with a message that says so: strict mode refuses it too, but
    as "not a valid number" and "not a valid string" of the union's two arms."""
    if isinstance(value, bool):
        raise ValueError("timestamp must be epoch seconds or an ISO-8601 string, not a boolean")
    return value


Timestamp = Annotated[float | str | None, BeforeValidator(_not_bool)]


class PageIn(_Strict):
    """One exchange to remember."""

    user_input: str = Field(..., description="What the user said.")
    agent_response: str = Field("", description="What the agent answered.")
    timestamp: Timestamp = Field(
        None, description="Epoch seconds or an ISO-8601 string (default: now)."
    )
    assistant_id: str | None = Field(
        None, max_length=128, description="The assistant whose knowledge this user shares."
    )
    source: str | None = Field(
        None,
        max_length=128,
        description="Idempotency key: a page whose source was accepted before is not added again.",
    )
    meta: dict[str, Any] = Field(default_factory=dict, description="Free JSON metadata.")

    @field_validator("assistant_id")
    @classmethod
    def _aid(cls, v: str | None) -> str | None:
        return _written_name(v, "assistant_id")

    @field_validator("source")
    @classmethod
    def _src(cls, v: str | None) -> str | None:
        return _written_name(v, "source")

    @field_validator("meta")
    @classmethod
    def _meta(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _shallow_meta(v, "meta")  # type: ignore[return-value]


class UserPageIn(PageIn):
    """One exchange of a named user (batch form)."""

    user_id: str = Field(..., min_length=1, description="The user the page belongs to.")

    @field_validator("user_id")
    @classmethod
    def _uid(cls, v: str) -> str:
        return _printable_id(v, "user_id")  # type: ignore[return-value]


class PagesIn(_Strict):
    """Many exchanges, possibly of many users; applied in order per user."""

    pages: list[UserPageIn] = Field(..., min_length=1)


class AddResult(BaseModel):
    page_id: int = Field(..., description="Id of the stored page.")
    user_id: str
    duplicate: bool = Field(False, description="The source was accepted before; nothing added.")


class AddResults(BaseModel):
    results: list[AddResult]


class RetrieveIn(_Strict):
    """A memory query."""

    query: str = Field(..., description="What to look for.")
    top_pages: int | None = Field(
        None,
        ge=1,
        le=100,
        description="MTM pages to return (k): 1 to 100; default memory.top_pages.",
    )
    top_segments: int | None = Field(
        None, ge=1, le=50, description="Segments to open (m): 1 to 50; default memory.top_segments."
    )
    sources: bool = Field(
        False, description="Name the pages each returned knowledge entry was derived from."
    )


class UserQueryIn(RetrieveIn):
    user_id: str = Field(..., min_length=1)

    @field_validator("user_id")
    @classmethod
    def _uid(cls, v: str) -> str:
        return _printable_id(v, "user_id")  # type: ignore[return-value]


class RetrieveManyIn(_Strict):
    """Many users' queries in one request (they join the same micro-batch)."""

    queries: list[UserQueryIn] = Field(..., min_length=1)


class Page(BaseModel):
    page_id: int
    user_input: str
    agent_response: str
    timestamp: float
    tier: str = Field(..., description="'stm' or 'mtm'.")
    score: float | None = None
    meta: str | None = Field(None, description="The dialogue chain's meta summary.")
    extra: dict[str, Any] = Field(default_factory=dict)


class Knowledge(BaseModel):
    entry_id: int
    text: str
    score: float | None = None
    sources: list[int] | None = Field(
        None, description="Page ids the entry was derived from (when asked for)."
    )


class RetrievalOut(BaseModel):
    """STM whole, the top MTM pages, the profile and the top knowledge entries."""

    user_id: str
    query: str
    stm: list[Page]
    pages: list[Page]
    profile: dict[str, str]
    user_knowledge: list[Knowledge]
    assistant_knowledge: list[Knowledge]
    retrieval_tokens: int = 0
    known_user: bool = Field(True, description="False when the user has no memory yet.")


class RetrievalsOut(BaseModel):
    results: list[RetrievalOut]


class RespondIn(_Strict):
    query: str = Field(..., description="The user's message.")
    timestamp: Timestamp = Field(None, description="Timestamp of the stored exchange.")


class RespondOut(BaseModel):
    user_id: str
    query: str
    text: str = Field(..., description="The LLM's answer.")
    page_id: int = Field(..., description="The stored exchange.")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: None = Field(
        None,
        description="Always null: a failed LLM call answers 502 `llm_error` (503 "
        "`unavailable` when the LLM cannot be used now), not 200 (kept for older clients).",
    )
    retrieval: RetrievalOut


class ProfileOut(BaseModel):
    user_id: str
    profile: dict[str, str]


class KnowledgeOut(BaseModel):
    user_id: str
    user: list[dict[str, Any]] = Field(..., description="The user's knowledge, oldest first.")
    assistant: list[dict[str, Any]] = Field(..., description="The user's assistant's knowledge.")


class KnowledgeEntryOut(BaseModel):
    """One knowledge entry with its provenance and validity."""

    entry_id: int
    owner_kind: str
    owner_id: str
    seq: int
    text: str
    live: bool = Field(
        ..., description="Retrieved and shown in prompts (not superseded or dropped)."
    )
    mode: str
    created: float
    strength: int = Field(..., description="Times the fact was said (duplicates merged).")
    valid_from: float = Field(..., description="When it became true (its newest source page).")
    valid_to: float | None = Field(None, description="When a newer fact superseded it.")
    superseded_by: int | None = Field(None, description="The entry that superseded it.")
    source_user: str | None = Field(None, description="Whose pages it was derived from.")
    sources: list[int] = Field(..., description="Page ids it was derived from.")


class KnowledgeUpdateIn(_Strict):
    text: str


class PageUpdateIn(_Strict):
    user_input: str | None = None
    agent_response: str | None = None


class DeletedOut(BaseModel):
    deleted: bool


class WaitOut(BaseModel):
    user_id: str
    done: bool = Field(..., description="True when no write or derived work of the user is left.")
    pending: int = Field(..., description="Derived items still owed (0 when done).")
    queued_writes: int = Field(..., description="Pages of the user still in the write queue.")
    waited_s: float


class UsersOut(BaseModel):
    users: list[str]


class ErrorOut(BaseModel):
    error: str = Field(..., description="Machine-readable code.")
    detail: Any = Field(..., description="Human-readable message (or validation details).")


class HealthOut(BaseModel):
    status: str


class ReadyOut(BaseModel):
    ready: bool
    status: str
    degraded: list[str] | None = Field(
        None,
        description="While ready: what does not work (store_full: writes answer 507; "
        "llm_unavailable: the LLM cannot be used); absent where the service cannot tell.",
    )


class PageListOut(BaseModel):
    user_id: str
    pages: list[dict[str, Any]] = Field(
        ..., description="The user's pages in the order they were written."
    )
    total: int = Field(..., description="How many pages the user has.")
    offset: int
    limit: int


# ---------------------------------------------------------------------- mem0-shaped (/v1/mem0)
def _mem0_id(value: str | int | None, what: str) -> str | None:
    """A mem0 ``user_id`` / ``agent_id`` / ``run_id`` read as mem0 reads it (a JSON integer as
    its text, surrounding whitespace trimmed, whitespace inside refused: the rule of the Python
    :class:`~memoryos_gpu.mem0.Memory`, :func:`~memoryos_gpu.mem0.filters.entity_id`), then
    printable (:func:`_printable_id`)."""
    return _printable_id(entity_id(value, what), what)


#: A mem0 scope id in a body: a string or, as mem0 clients send a database key, an integer.
Mem0Id = str | int


class Mem0Message(_Strict):
    """An OpenAI-style chat message (``content``: text, or a list of text parts)."""

    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: accepted, not stored
    role: str = Field(..., description="'user' or 'assistant' (system and tool are skipped).")
    content: str | list[dict[str, Any]]


class Mem0AddIn(_Strict):
    """mem0's ``MemoryCreate`` (its every field) and ``timestamp``. Scope ids as mem0 reads
    them (:func:`_mem0_id`)."""

    messages: list[Mem0Message] | str = Field(
        ..., description="Messages to remember: each user message with its answer is a page."
    )
    user_id: Mem0Id = Field(
        ..., description="Whose memory (required here); an integer is read as its text."
    )
    agent_id: Mem0Id | None = Field(None, description="The assistant's id (at most 128).")
    run_id: Mem0Id | None = Field(None, description="A session id, kept in the metadata.")
    metadata: dict[str, Any] | None = Field(None, description="Free JSON metadata.")
    timestamp: Timestamp = Field(None, description="Epoch seconds or ISO-8601.")
    expiration_date: str | None = Field(
        None, description="mem0's; only null: memories are kept until deleted, none expires."
    )
    infer: bool | None = Field(
        None, description="Accepted for mem0 clients: exchanges are always kept verbatim."
    )
    memory_type: str | None = Field(
        None, description="mem0's; only null: memories are derived by memoryos-gpu's stages."
    )
    prompt: str | None = Field(
        None, description="mem0's extraction prompt; only null (see memory_type)."
    )

    @field_validator("user_id")
    @classmethod
    def _uid(cls, v: str | int) -> str:
        return _mem0_id(v, "user_id")  # type: ignore[return-value]

    @field_validator("agent_id")
    @classmethod
    def _aid(cls, v: str | int | None) -> str | None:
        v = _written_name(_mem0_id(v, "agent_id"), "agent_id")
        if v is not None and len(v) > 128:
            raise ValueError(f"agent_id is {len(v)} characters; the limit is 128")
        return v

    @field_validator("run_id")
    @classmethod
    def _rid(cls, v: str | int | None) -> str | None:
        return _mem0_id(v, "run_id")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return _shallow_meta(v, "metadata")  # stored as the page's meta


class Mem0SearchIn(_Strict):
    """mem0's ``SearchRequest`` (its every field) and ``limit``. Scope ids as mem0 reads them
    (:func:`_mem0_id`)."""

    query: str = Field(..., min_length=1, description="What to look for.")
    user_id: Mem0Id | None = Field(None, description="mem0's older spelling of filters.user_id.")
    agent_id: Mem0Id | None = Field(None, description="Narrow to this assistant's memories.")
    run_id: Mem0Id | None = Field(None, description="Narrow to this session's memories.")
    filters: dict[str, Any] | None = Field(None, description="mem0 filters (user_id inside).")
    top_k: int | None = Field(None, ge=1, le=1000, description="Results at most (default 20).")
    limit: int | None = Field(None, ge=1, le=1000, description="mem0's older name of top_k.")
    threshold: float | None = Field(
        None, description="Minimum cosine score, 0 to 1 (as mem0's; default: none)."
    )
    explain: bool | None = Field(None, description="Add mem0's score_details to each result.")
    show_expired: bool | None = Field(
        None, description="mem0's; changes nothing: no memory expires here."
    )

    @field_validator("user_id", "agent_id", "run_id")
    @classmethod
    def _ids(cls, v: str | int | None, info: Any) -> str | None:
        return _mem0_id(v, info.field_name)


class Mem0UpdateIn(_Strict):
    """mem0's ``MemoryUpdate`` (its every field), ``data`` and ``agent_response``."""

    text: str | None = Field(None, description="The new text (a page: the user's side).")
    data: str | None = Field(None, description="mem0's older name of text.")
    agent_response: str | None = Field(None, description="A page's new assistant side.")
    metadata: dict[str, Any] | None = Field(
        None, description="mem0's; only null: a memory keeps the metadata it was added with."
    )
    expiration_date: str | None = Field(
        None, description="mem0's; only null (no memory expires here: nothing to clear)."
    )


class Mem0Results(BaseModel):
    results: list[dict[str, Any]]


class Mem0Listing(Mem0Results):
    count: int = Field(..., description="How many memories match, over all pages.")
    page: int
    page_size: int
    has_more: bool


class Mem0MessageOut(BaseModel):
    message: str

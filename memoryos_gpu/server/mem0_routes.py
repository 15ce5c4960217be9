"""mem0's REST API under ``/v1/mem0``: a mem0 client points its base URL there.

``POST /memories`` (add), ``GET /memories`` (list, paged), ``DELETE /memories`` (a user's
all), ``GET|PUT|DELETE /memories/{memory_id}``, ``GET /memories/{memory_id}/history``,
``POST /search``, ``POST /reset`` (the caller's tenant's users). Same keys, tenancy, limits,
error bodies and batching as the native routes: adds join the write queue, searches the
retrieval micro-batch; the verbs themselves are :class:`~memoryos_gpu.mem0.ops.Mem0Ops`, the
ones the Python :class:`~memoryos_gpu.mem0.Memory` uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam

from memoryos_gpu.engine.validation import validate_pages
from memoryos_gpu.mem0.filters import Predicate, compile_filter
from memoryos_gpu.mem0.memory import (
    SEARCH_DEFAULT,
    add_results,
    check_threshold,
    listing_size,
    refuse_expiration,
    refuse_mem0_extraction,
    refuse_metadata_edit,
    resolve_user,
    result_count,
)
from memoryos_gpu.mem0.ops import Mem0Ops, MemoryNotFound, check_paging
from memoryos_gpu.mem0.shapes import messages_to_pages, parse_memory_id
from memoryos_gpu.server import models as m
from memoryos_gpu.server.memory_routes import check_meta
from memoryos_gpu.server.page_routes import BLANKED_PAGE
from memoryos_gpu.server.scope import (
    ApiError,
    Scope,
    check_count,
    check_text,
    is_blank,
    json_response,
)
from memoryos_gpu.server.scope import tenancy as _tenancy
from memoryos_gpu.server.settings import ServerSettings

__all__ = ["add_mem0_routes"]

MemoryIdPath = Annotated[
    str, PathParam(description="A memory id: 'page-<n>' or 'knowledge-<n>'.", max_length=64)
]
_TAG = ["mem0"]


def add_mem0_routes(
    app: FastAPI,
    service: Any,
    settings: ServerSettings,
    charge_pages: Callable[[Scope, int], None],
) -> None:
    """Declare the ``/v1/mem0`` routes on ``app``."""

    def ops() -> Mem0Ops:
        """The mem0 verbs over the one engine: 503 first while it is not loaded (it is None
        then, which is not "several engines"), 501 under a sharded server."""
        service.check_ready()
        engine = getattr(service, "engine", None)
        if engine is None or not hasattr(engine, "store"):
            raise ApiError(  # memory ids are page ids: unique in one engine, not across shards
                501,
                "not_supported",
                "the mem0 routes need one engine (not serve --ray or --engines > 1)",
            )
        return Mem0Ops(engine)

    def invalid(exc: ValueError, scope: Scope | None = None) -> ApiError:
        """422 ``invalid_input`` with ``exc``'s message, stored ids in it shown as the caller
        sent them (``scope``: the tenant prefix taken off)."""
        return ApiError(422, "invalid_input", scope.unprefixed(str(exc)) if scope else str(exc))

    async def owned(scope: Scope, memory_id: str) -> Mem0Ops:
        """The ops, once the memory is known to exist and be the caller's tenant's (404
        otherwise: another tenant's memory is not even confirmed to exist)."""
        o = ops()
        owner = await service.call(o.owner, memory_id)
        if owner is None or not scope.owns(owner.removeprefix("assistant:")):
            raise ApiError(404, "not_found", f"Memory with id {memory_id} not found")
        return o

    def out(scope: Scope, data: Any) -> Any:
        return json_response(scope.strip_ids(data))

    @app.post(
        "/v1/mem0/memories",
        tags=_TAG,
        summary="Add memories (mem0)",
        description="Remember OpenAI-style messages: each user message with the assistant's "
        "answer becomes one page, committed before the answer. mem0's `infer` is accepted "
        "(exchanges are always kept verbatim); `prompt`, `memory_type` and `expiration_date` "
        "only as null (a value is a 422 saying why).",
        response_model=m.Mem0Results,
    )
    async def mem0_add(body: m.Mem0AddIn, request: Request) -> Any:
        scope = _tenancy(request)
        ops()  # refused where the other verbs are: they could not read these memories back
        try:
            refuse_mem0_extraction(prompt=body.prompt, memory_type=body.memory_type)
            refuse_expiration(body.expiration_date)
            pages = messages_to_pages(
                body.messages if isinstance(body.messages, str) else _dumped(body.messages),
                user_id=scope.user(body.user_id),
                assistant_id=scope.name(body.agent_id),
                default_assistant=scope.default_assistant(),
                metadata=body.metadata,
                run_id=body.run_id,
                timestamp=body.timestamp,
            )
        except ValueError as exc:
            raise invalid(exc, scope) from None
        check_count(settings, len(pages), "pages")
        for p in pages:
            check_text(settings, user_input=p.user_input, agent_response=p.agent_response)
            check_meta(p.meta, settings.max_text_chars)  # `metadata` as the pages routes' meta
        pages = validate_pages(pages)  # as stored: what the answer shows (refusals: 422)
        charge_pages(scope, len(pages))
        results = await service.add_pages(pages)
        return out(scope, {"results": add_results(pages, results)})

    @app.post(
        "/v1/mem0/search",
        tags=_TAG,
        summary="Search memories (mem0)",
        description="The user's memories for a query, best first, scored by cosine "
        "similarity; candidates are what MemoryOS retrieves, narrowed by `filters`. "
        "`explain` adds mem0's `score_details` to each result; `show_expired` changes nothing "
        "(no memory expires here).",
        response_model=m.Mem0Results,
    )
    async def mem0_search(body: m.Mem0SearchIn, request: Request) -> Any:
        scope = _tenancy(request)
        check_text(settings, query=body.query)
        try:
            user, rest = resolve_user(
                body.user_id, body.filters, agent_id=body.agent_id, run_id=body.run_id
            )
            keep = compile_filter(_scoped_filter(scope, rest))
            k = result_count(body.top_k, body.limit, SEARCH_DEFAULT)
            check_threshold(body.threshold)
        except ValueError as exc:
            raise invalid(exc) from None
        uid = scope.named_user(user)
        o = ops()
        if not await service.known(uid):
            return {"results": []}
        top_pages = max(k, service.engine.memory.top_pages)
        r = await service.retrieve(uid, body.query, top_pages=min(top_pages, 100))
        ranked = await service.call(
            o.rank, r, keep=keep, threshold=body.threshold, top_k=k, explain=bool(body.explain)
        )
        return out(scope, {"results": ranked})

    @app.get(
        "/v1/mem0/memories",
        tags=_TAG,
        summary="List memories (mem0)",
        description="The user's memories in the order they were written (pages, then "
        "knowledge; not sorted by timestamp), paged. `show_expired` (mem0's) changes nothing: "
        "no memory expires here.",
        response_model=m.Mem0Listing,
    )
    async def mem0_get_all(
        request: Request,
        user_id: Annotated[str, Query(min_length=1, description="Whose memories.")],
        agent_id: Annotated[str | None, Query(description="Only this assistant's.")] = None,
        run_id: Annotated[str | None, Query(description="Only this session's.")] = None,
        page: Annotated[int, Query(ge=1)] = 1,
        page_size: Annotated[int | None, Query(ge=1, le=1000)] = None,
        limit: Annotated[
            int | None, Query(ge=1, le=1000, description="mem0's name for page_size.")
        ] = None,
        top_k: Annotated[int | None, Query(ge=1, le=1000, description="Also page_size.")] = None,
        show_expired: Annotated[
            bool, Query(description="mem0's; changes nothing: no memory expires here.")
        ] = False,
    ) -> Any:
        del show_expired
        scope = _tenancy(request)
        try:  # the page's offset must fit the store's 64-bit integers (else a driver 500)
            page_size = listing_size(page_size, limit, top_k)
            check_paging(page, page_size)
        except ValueError as exc:
            raise ApiError(422, "invalid_input", str(exc)) from None
        uid, keep = _narrowed(scope, user_id, agent_id, run_id)
        listing = await service.call(ops().list, uid, page=page, page_size=page_size, keep=keep)
        return out(scope, listing)

    @app.delete(
        "/v1/mem0/memories",
        tags=_TAG,
        summary="Delete a user's memories (mem0)",
        description="Delete the user and everything held about them; with `agent_id` / "
        "`run_id` only the user's memories those select (the user stays).",
        response_model=m.Mem0MessageOut,
    )
    async def mem0_delete_all(
        request: Request,
        user_id: Annotated[str, Query(min_length=1, description="Whose memories.")],
        agent_id: Annotated[str | None, Query(description="Only this assistant's.")] = None,
        run_id: Annotated[str | None, Query(description="Only this session's.")] = None,
    ) -> Any:
        uid, keep = _narrowed(_tenancy(request), user_id, agent_id, run_id)
        o = ops()
        if keep is None:
            await service.delete_user(uid)
        else:
            await service.call(o.delete_matching, uid, keep)
        return {"message": "Memories deleted successfully!"}

    @app.get(
        "/v1/mem0/memories/{memory_id}",
        tags=_TAG,
        summary="Get a memory (mem0)",
        description="One memory by id; 404 when none (or another tenant's).",
    )
    async def mem0_get(memory_id: MemoryIdPath, request: Request) -> Any:
        scope = _tenancy(request)
        o = await owned(scope, memory_id)
        item = await service.call(o.get, memory_id)
        if item is None:  # deleted since the ownership check
            raise ApiError(404, "not_found", f"Memory with id {memory_id} not found")
        return out(scope, item)

    @app.put(
        "/v1/mem0/memories/{memory_id}",
        tags=_TAG,
        summary="Update a memory (mem0)",
        description="Replace a memory's text (a page: `text` is the user's side, "
        "`agent_response` the assistant's); its embedding follows. A blank text of a knowledge "
        "entry, or an edit that leaves both sides of a page blank, is a 422: delete the memory "
        "instead. mem0's `metadata` and `expiration_date` only as null: a memory keeps the "
        "metadata it was added with and none expires (a value is a 422 saying why).",
        response_model=m.Mem0MessageOut,
    )
    async def mem0_update(memory_id: MemoryIdPath, body: m.Mem0UpdateIn, request: Request) -> Any:
        scope = _tenancy(request)
        if body.text is not None and body.data is not None:
            raise ApiError(422, "invalid_input", "give text or data, not both")
        try:
            refuse_metadata_edit(body.metadata)
            refuse_expiration(body.expiration_date)
        except ValueError as exc:
            raise invalid(exc) from None
        text = body.text if body.text is not None else body.data
        check_text(settings, text=text, agent_response=body.agent_response)
        o = await owned(scope, memory_id)
        clears_expiry = "expiration_date" in body.model_fields_set  # mem0: clear it (none here)
        if text is None and body.agent_response is None and clears_expiry:
            return {"message": "Memory updated successfully!"}
        mid = parse_memory_id(memory_id)
        if mid is not None and mid.kind == "page":  # a knowledge entry: the engine refuses it
            row = await service.call(service.engine.get_page, mid.number)
            if row is None:  # deleted since the ownership check
                raise ApiError(404, "not_found", f"Memory with id {memory_id} not found")
            user_side = row["user_input"] if text is None else text
            agent_side = (
                row["agent_response"] if body.agent_response is None else body.agent_response
            )
            if is_blank(user_side) and is_blank(agent_side):  # as the pages routes refuse it
                raise ApiError(422, "invalid_input", BLANKED_PAGE)
        try:
            return await service.call(o.update, memory_id, text, body.agent_response)
        except MemoryNotFound as exc:
            raise ApiError(404, "not_found", str(exc)) from None
        except ValueError as exc:
            raise invalid(exc, scope) from None

    @app.delete(
        "/v1/mem0/memories/{memory_id}",
        tags=_TAG,
        summary="Delete a memory (mem0)",
        description="Remove one page or knowledge entry; its history stays.",
        response_model=m.Mem0MessageOut,
    )
    async def mem0_delete(memory_id: MemoryIdPath, request: Request) -> Any:
        o = await owned(_tenancy(request), memory_id)
        try:
            return await service.call(o.delete, memory_id)
        except MemoryNotFound as exc:
            raise ApiError(404, "not_found", str(exc)) from None

    @app.get(
        "/v1/mem0/memories/{memory_id}/history",
        tags=_TAG,
        summary="History of a memory (mem0)",
        description="ADD, each UPDATE and DELETE of the memory, oldest first.",
    )
    async def mem0_history(memory_id: MemoryIdPath, request: Request) -> Any:
        scope = _tenancy(request)
        o = ops()
        events = await service.call(o.history, memory_id)
        owners = await service.call(o.history_owners, memory_id)
        if not events or not all(scope.owns(w.removeprefix("assistant:")) for w in owners):
            raise ApiError(404, "not_found", f"Memory with id {memory_id} not found")
        return json_response(events)

    @app.post(
        "/v1/mem0/reset",
        tags=_TAG,
        summary="Reset (mem0)",
        description="Delete every user of the caller's tenant with all their memory.",
        response_model=m.Mem0MessageOut,
    )
    async def mem0_reset(request: Request) -> Any:
        scope = _tenancy(request)
        ops()
        for uid in [u for u in await service.users() if scope.owns(u)]:
            await service.delete_user(uid)
        return {"message": "Memories reset successfully!"}


def _narrowed(
    scope: Scope, user_id: str, agent_id: str | None, run_id: str | None
) -> tuple[str, Predicate | None]:
    """The stored user id and the predicate ``agent_id`` / ``run_id`` make (None: the user's
    whole memory), by the facade's rule (:func:`resolve_user`); 422 for a blank id."""
    try:
        user, rest = resolve_user(user_id, None, agent_id=agent_id, run_id=run_id)
    except ValueError as exc:
        raise ApiError(422, "invalid_input", str(exc)) from None
    return scope.named_user(user), compile_filter(_scoped_filter(scope, rest)) if rest else None


def _scoped_filter(scope: Scope, flt: dict[str, Any]) -> dict[str, Any]:
    """A filter's ``agent_id`` as stored (tenant-prefixed), like the items it is tested on."""
    if "agent_id" in flt and isinstance(flt["agent_id"], str):
        return {**flt, "agent_id": scope.name(flt["agent_id"])}
    return flt


def _dumped(messages: list[m.Mem0Message]) -> list[dict[str, Any]]:
    return [msg.model_dump() for msg in messages]

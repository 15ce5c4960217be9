"""The item-level page routes: list a user's pages, and get, edit or delete one page (adding
pages is a memory route: :mod:`.memory_routes`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query, Request

from memoryos_gpu.engine.validation import MAX_ITEM_ID, clean_item_id
from memoryos_gpu.errors import UnknownUserError
from memoryos_gpu.server import models as m
from memoryos_gpu.server.scope import (
    ApiError,
    Scope,
    UserId,
    check_text,
    is_blank,
    json_response,
    tenancy,
)
from memoryos_gpu.server.settings import ServerSettings

__all__ = ["BLANKED_PAGE", "add_page_routes"]

#: Why an edit that leaves a page of no words is refused (the page routes' PATCH and mem0's
#: PUT): an add of such a page is refused too (:data:`.memory_routes.BLANK_PAGE`).
BLANKED_PAGE = (
    "the edit leaves user_input and agent_response both blank (empty or only whitespace once "
    "control characters are dropped): delete the page instead"
)


def add_page_routes(app: FastAPI, service: Any, settings: ServerSettings) -> None:
    """Declare the ``/v1/users/{user_id}/pages`` list and item routes on ``app``."""

    async def _owned_page(scope: Scope, user_id: str, page_id: int) -> dict[str, Any]:
        uid = scope.named_user(user_id)
        # an id outside the store's 64-bit keys is a 422, as the engine answers for 0 or -1
        # (not a 404 above the range and a 422 below it)
        page_id = clean_item_id(page_id, "page_id")
        row = await service.call(service.engine_for(uid).get_page, page_id)
        # another tenant's page is not found either: a 403 confirmed that the id exists, and
        # probing ids counted the other tenants' pages (the mem0 routes answered 404 already)
        if row is None or not scope.owns(row["user_id"]):
            raise ApiError(404, "not_found", f"no page {page_id}")
        if row["user_id"] != uid:
            raise ApiError(404, "not_found", f"user {user_id!r} has no page {page_id}")
        return row

    @app.get(
        "/v1/users/{user_id}/pages",
        tags=["pages"],
        summary="List pages",
        description="The user's pages (every tier) in the order they were written (not "
        "sorted by their timestamps), `limit` from `offset`; `total` says how many there are. "
        "404 for an unknown user.",
        response_model=m.PageListOut,
    )
    async def list_pages(
        user_id: UserId,
        request: Request,
        offset: Annotated[
            int, Query(ge=0, le=MAX_ITEM_ID, description="Pages to skip.")  # SQLite's int64
        ] = 0,
        limit: Annotated[int, Query(ge=1, le=1000, description="Pages at most.")] = 100,
    ) -> Any:
        scope = tenancy(request)
        uid = scope.named_user(user_id)
        if not await service.known(uid):
            raise UnknownUserError(f"unknown user {uid!r}")
        engine = service.engine_for(uid)
        pages, total = await service.call(engine.list_pages, uid, offset, limit)
        body = {"user_id": user_id, "pages": pages, "total": total, "offset": offset}
        return json_response(scope.strip_ids({**body, "limit": limit}))

    @app.get(
        "/v1/users/{user_id}/pages/{page_id}",
        tags=["pages"],
        summary="Get a page",
        description="One stored page of the user (any tier).",
    )
    async def get_page(page_id: int, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        return json_response(scope.strip_ids(await _owned_page(scope, user_id, page_id)))

    @app.patch(
        "/v1/users/{user_id}/pages/{page_id}",
        tags=["pages"],
        summary="Edit a page",
        description=(
            "Replace a page's user input and/or agent response; its embedding follows, and the "
            "facts and profile values derived from its old text are re-derived from the new. "
            "An edit that leaves both blank is a 422: delete the page instead."
        ),
    )
    async def update_page(
        body: m.PageUpdateIn, page_id: int, user_id: UserId, request: Request
    ) -> Any:
        scope = tenancy(request)
        if body.user_input is None and body.agent_response is None:
            raise ApiError(422, "invalid_input", "give user_input and/or agent_response")
        check_text(settings, user_input=body.user_input, agent_response=body.agent_response)
        page = await _owned_page(scope, user_id, page_id)
        user_side = page["user_input"] if body.user_input is None else body.user_input
        agent_side = page["agent_response"] if body.agent_response is None else body.agent_response
        if is_blank(user_side) and is_blank(agent_side):  # as an add of such a page is refused
            raise ApiError(422, "invalid_input", BLANKED_PAGE)
        row = await service.call(
            service.engine_for(scope.named_user(user_id)).update_page,
            page_id,
            user_input=body.user_input,
            agent_response=body.agent_response,
        )
        return json_response(scope.strip_ids(row))

    @app.delete(
        "/v1/users/{user_id}/pages/{page_id}",
        tags=["pages"],
        summary="Delete a page",
        description="Remove one page of the user (from whichever tier holds it).",
        response_model=m.DeletedOut,
    )
    async def delete_page(page_id: int, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        await _owned_page(scope, user_id, page_id)
        engine = service.engine_for(scope.named_user(user_id))
        return {"deleted": await service.call(engine.delete_page, page_id)}

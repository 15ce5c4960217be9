"""The user routes: list the tenant's users; a user's profile, knowledge (list, one entry,
edit, delete), audit history and export; delete a user; the read-your-writes barrier."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query, Request

from memoryos_gpu.engine.validation import clean_item_id
from memoryos_gpu.errors import UnknownUserError
from memoryos_gpu.server import models as m
from memoryos_gpu.server.scope import (
    ApiError,
    Scope,
    UserId,
    check_text,
    json_response,
    tenancy,
)
from memoryos_gpu.server.settings import ServerSettings

__all__ = ["add_user_routes"]


def add_user_routes(app: FastAPI, service: Any, settings: ServerSettings) -> None:
    """Declare the ``/v1/users`` routes (but a user's pages: :mod:`.page_routes`) on ``app``."""

    async def _owned_entry(scope: Scope, user_id: str, entry_id: int) -> dict[str, Any]:
        uid = scope.named_user(user_id)
        entry_id = clean_item_id(entry_id, "entry_id")  # outside the 64-bit keys: a 422
        rows = await service.call(service.engine_for(uid).store.knowledge_rows, [entry_id])
        row = rows.get(entry_id)
        # another tenant's entry is not found either (as its page: _owned_page)
        if row is None or not scope.owns(row["owner_id"]):
            raise ApiError(404, "not_found", f"no knowledge entry {entry_id}")
        if row["owner_kind"] != "user" or row["owner_id"] != uid:
            raise ApiError(404, "not_found", f"user {user_id!r} has no knowledge entry {entry_id}")
        return row

    async def _readable_entry(scope: Scope, user_id: str, entry_id: int) -> dict[str, Any]:
        """A user's own entry, or one of the user's assistant's (what the user is served)."""
        uid = scope.named_user(user_id)
        engine = service.engine_for(uid)
        row = await service.call(engine.get_knowledge, clean_item_id(entry_id, "entry_id"))
        if row is not None and not scope.owns(row["owner_id"]):  # as PATCH and DELETE answer
            row = None
        if row is not None and row["owner_kind"] == "assistant":
            user = await service.call(engine.store.user_row, uid)
            if user is not None and user["assistant_id"] == row["owner_id"]:
                return row
        if row is None or row["owner_kind"] != "user" or row["owner_id"] != uid:
            raise ApiError(404, "not_found", f"user {user_id!r} has no knowledge entry {entry_id}")
        return row

    @app.get(
        "/v1/users",
        tags=["users"],
        summary="List users",
        description="The caller's tenant's users.",
        response_model=m.UsersOut,
    )
    async def list_users(request: Request) -> Any:
        scope = tenancy(request)
        service.check_ready()
        return {"users": [scope.strip(u) for u in await service.users() if scope.owns(u)]}

    @app.get(
        "/v1/users/{user_id}/profile",
        tags=["users"],
        summary="User profile",
        description="The user's long-term profile (trait -> value).",
        response_model=m.ProfileOut,
    )
    async def profile(user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        uid = scope.named_user(user_id)
        prof = await service.call(service.engine_for(uid).profile, uid)
        return {"user_id": user_id, "profile": prof}

    @app.get(
        "/v1/users/{user_id}/knowledge",
        tags=["users"],
        summary="User and assistant knowledge",
        description="Live user-knowledge entries and the user's assistant's knowledge, oldest "
        "first, each with the pages it was derived from (`sources`), its validity and strength; "
        "`history=true` adds the superseded and dropped entries.",
        response_model=m.KnowledgeOut,
    )
    async def knowledge(
        user_id: UserId,
        request: Request,
        history: Annotated[bool, Query(description="Superseded and dropped entries too.")] = False,
    ) -> Any:
        scope = tenancy(request)
        uid = scope.named_user(user_id)
        kn = await service.call(service.engine_for(uid).knowledge, uid, history=history)
        return json_response(scope.strip_ids({"user_id": user_id, **kn}))

    @app.get(
        "/v1/users/{user_id}/knowledge/{entry_id}",
        tags=["users"],
        summary="One knowledge entry",
        description="One of the user's knowledge entries, or of the user's assistant's, live or "
        "not: its text, the pages it was derived from (`sources`), validity "
        "(`valid_from`, `valid_to`, `superseded_by`) and `strength`.",
        response_model=m.KnowledgeEntryOut,
    )
    async def get_knowledge(entry_id: int, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        row = await _readable_entry(scope, user_id, entry_id)
        return json_response(scope.strip_ids(row))

    @app.patch(
        "/v1/users/{user_id}/knowledge/{entry_id}",
        tags=["users"],
        summary="Edit a knowledge entry",
        description="Replace the text (and embedding) of one of the user's knowledge entries.",
    )
    async def update_knowledge(
        body: m.KnowledgeUpdateIn, entry_id: int, user_id: UserId, request: Request
    ) -> Any:
        scope = tenancy(request)
        check_text(settings, text=body.text)
        await _owned_entry(scope, user_id, entry_id)
        uid = scope.named_user(user_id)
        row = await service.call(service.engine_for(uid).update_knowledge, entry_id, body.text)
        return json_response(scope.strip_ids(row))

    @app.delete(
        "/v1/users/{user_id}/knowledge/{entry_id}",
        tags=["users"],
        summary="Delete a knowledge entry",
        description="Remove one of the user's knowledge entries.",
        response_model=m.DeletedOut,
    )
    async def delete_knowledge(entry_id: int, user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        await _owned_entry(scope, user_id, entry_id)
        engine = service.engine_for(scope.named_user(user_id))
        return {"deleted": await service.call(engine.delete_knowledge, entry_id)}

    @app.get(
        "/v1/users/{user_id}/history",
        tags=["users"],
        summary="Audit history",
        description="Append-only log of changes to the user's memory.",
    )
    async def history(user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        uid = scope.named_user(user_id)
        if not await service.known(uid):
            raise UnknownUserError(f"unknown user {uid!r}")
        return json_response(
            scope.strip_ids(await service.call(service.engine_for(uid).history, uid))
        )

    @app.get(
        "/v1/users/{user_id}/export",
        tags=["users"],
        summary="Export a user",
        description="Everything held about the user: pages, segments, profile, knowledge, "
        "pending work and history (JSON).",
    )
    async def export_user(user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        uid = scope.named_user(user_id)
        data = await service.call(service.engine_for(uid).export_user, uid)
        return json_response(scope.strip_ids(data))

    @app.delete(
        "/v1/users/{user_id}",
        tags=["users"],
        summary="Delete a user",
        description="Remove every row and arena slot held about the user (after the user's "
        "queued writes). 404 if the user is unknown.",
        response_model=m.DeletedOut,
    )
    async def delete_user(user_id: UserId, request: Request) -> Any:
        scope = tenancy(request)
        uid = scope.named_user(user_id)
        service.check_ready()
        if not service._user_writes.get(uid) and not await service.known(uid):
            raise UnknownUserError(f"unknown user {uid!r}")
        return {"deleted": await service.delete_user(uid)}

    @app.post(
        "/v1/users/{user_id}/wait",
        tags=["users"],
        summary="Read-your-writes barrier",
        description="Wait until the user's queued writes are committed and their derived work "
        "(chain, mid-term placement, promotion) is done, or the timeout passes (`done: false`).",
        response_model=m.WaitOut,
    )
    async def wait_user(
        user_id: UserId,
        request: Request,
        timeout: Annotated[float, Query(gt=0, description="Seconds to wait at most.")] = 10.0,
    ) -> Any:
        scope = tenancy(request)
        uid = scope.named_user(user_id)
        res = await service.wait_for_user(uid, min(timeout, settings.max_wait_timeout_s))
        res["user_id"] = user_id
        return res

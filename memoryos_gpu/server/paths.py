"""How a request's path names its ids: split on ``/`` first, then each segment percent-decoded
on its own (RFC 3986: an encoded slash, ``%2F``, inside a segment is data, not a separator).

Why: a user id may hold a ``/`` (the library and ``memoryos-gpu ingest`` store such ids as
given, and an open server serves their store), so ``/v1/users/{user_id}/...`` must address
``team/alice``: as ``/v1/users/team%2Falice/pages``. Starlette routes on the whole decoded
path, where that reads as ``/v1/users/team/alice/pages`` and matches no route, and where
``/v1/users/a%2Fpages`` (user ``a/pages``) would read as ``a``'s page list. Split first, a
literal ``/`` always separates: ``/v1/users/a/pages`` is user ``a``'s pages whatever users
exist, and no route's meaning depends on the order routes are declared in.
"""

from __future__ import annotations

from urllib.parse import unquote

from starlette.routing import Match
from starlette.types import Scope

from memoryos_gpu.server.bodies import JsonBodyRoute

__all__ = ["ApiRoute", "path_segments"]


def path_segments(scope: Scope) -> list[str]:
    """The request path's segments (``""`` first, for the leading ``/``), each percent-decoded
    on its own. A path without escapes splits its decoded form (the same, and free)."""
    raw = scope.get("raw_path")
    if not raw or b"%" not in raw:
        return scope["path"].split("/")
    # the edge refused escapes that are not UTF-8 (edge._malformed) before any route is matched
    return [unquote(part) for part in raw.decode("latin-1").split("/")]


def _escaped(segment: str) -> str:
    """A decoded segment as a route pattern can match it: ``%`` and ``/`` re-encoded, so that
    it stays one segment and a value that holds ``%2F`` is told from one that holds ``/``."""
    return segment.replace("%", "%25").replace("/", "%2F")


class ApiRoute(JsonBodyRoute):
    """The app's route class: bodies read as :class:`JsonBodyRoute` reads them, and paths
    matched segment by segment (:func:`path_segments`), so a path parameter may hold ``/``."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        raw = scope.get("raw_path")
        if not raw or b"%" not in raw:
            return super().matches(scope)
        path = "/".join(_escaped(part) for part in path_segments(scope))
        match, child = super().matches({**scope, "path": path})
        if match is not Match.NONE:
            child["path_params"] = {
                k: unquote(v) if k in self.param_convertors and isinstance(v, str) else v
                for k, v in child["path_params"].items()
            }
        return match, child

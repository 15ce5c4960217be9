"""What the router's HTTP routes take for an engine: engine methods called by name on a user's
shard or on every shard (:class:`_Remote`, :class:`_Namespace`), page deletes and edits the
router runs across shards (:class:`_AcrossShards`), a user's shard engine
(:class:`_ShardEngineProxy`), the router's whole engine (:class:`_RouterEngine`), and a batch
of pages split by shard (:func:`add_by_shard`).

Why apart from :class:`~memoryos_gpu.distributed.ray_router.RouterService`: these are the thin
stand-ins through which the single-box app calls the router as if it were an engine;
``serve --engines`` (:mod:`memoryos_gpu.server.shard_router`) uses them too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from memoryos_gpu.distributed.layout import ShardMap
from memoryos_gpu.types import AddResult, PageInput

if TYPE_CHECKING:
    from memoryos_gpu.distributed.ray_router import RouterService


# ============================================================================ router
async def add_by_shard(
    shard_map: ShardMap,
    pages: Sequence[PageInput],
    send: Callable[[int, list[PageInput]], Awaitable[list[AddResult]]],
) -> list[AddResult]:
    """``pages`` split by their users' shards, each part sent at once (``send(shard,
    part)``), the results in the pages' order."""
    groups = shard_map.group(p.user_id for p in pages)
    parts = await asyncio.gather(*(send(s, [pages[i] for i in idx]) for s, idx in groups.items()))
    out: list[AddResult | None] = [None] * len(pages)
    for idx, part in zip(groups.values(), parts, strict=True):
        for i, r in zip(idx, part, strict=True):
            out[i] = r
    return [r for r in out if r is not None]


class _Remote:
    """An engine method on a shard replica (or, ``fan_out``, on all of them)."""

    def __init__(self, router: RouterService, name: str, shard: int | None) -> None:
        self.router, self.name, self.shard = router, name, shard

    async def acall(self, *args: Any, **kw: Any) -> Any:
        if self.shard is None:
            return await self.router.fan_out(self.name, args, kw)
        return await self.router.ask(self.shard, "call", self.name, args, kw)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        raise RuntimeError(f"{self.name}: await it through RouterService.call")


class _Namespace:
    def __init__(self, router: RouterService, prefix: str, shard: int | None) -> None:
        self._router, self._prefix, self._shard = router, prefix, shard

    def __getattr__(self, name: str) -> _Remote:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Remote(self._router, f"{self._prefix}{name}", self._shard)


class _AcrossShards(_Remote):
    """A page change the router runs over every shard itself (``sharded_forget.py``)."""

    def __init__(self, router: RouterService, name: str, fn: Callable[..., Awaitable[Any]]) -> None:
        super().__init__(router, name, None)
        self._fn = fn

    async def acall(self, *args: Any, **kw: Any) -> Any:
        return await self._fn(*args, **kw)


class _ShardEngineProxy(_Namespace):
    """What the HTTP routes call as ``service.engine_for(uid)``: the user's shard engine;
    deleting or editing a page goes through the router (it reaches every shard)."""

    def __init__(self, router: RouterService, shard: int, user_id: str) -> None:
        super().__init__(router, "", shard)
        self.store = _Namespace(router, "store.", shard)
        self.delete_page = _AcrossShards(
            router, "delete_page", partial(router.delete_page, user_id)
        )
        self.update_page = _AcrossShards(
            router, "update_page", partial(router.update_page, user_id)
        )


class _RouterEngine:
    """``service.engine`` of the router: whole-engine calls (stats), cached counts (metrics)."""

    def __init__(self, router: RouterService) -> None:
        self._router = router
        self.stats = _Remote(router, "stats", None)
        self.config = router.config

    def pending_count(self, user_id: str | None = None) -> int:
        return self._router.pending

    def users(self) -> list[str]:
        return self._router.known_users()

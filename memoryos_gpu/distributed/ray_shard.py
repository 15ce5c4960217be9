"""A shard's Serve deployment (``shard-I`` of ``serve --ray``): :class:`ShardReplica` holds the
single-box serving core (:class:`~memoryos_gpu.server.service.MemoryService`) over the shard's
:class:`~memoryos_gpu.distributed.sharding.ShardEngine`, answers the router's calls with their
errors returned as data, and closes in two steps so that the router's last exchange of keyword
statistics and facts fits between them (:meth:`ShardReplica.finish`, then
:meth:`ShardReplica.close`).

The application around it: :mod:`memoryos_gpu.distributed.ray_serve`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.ray_common import BoxedError
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval

log = logging.getLogger("memoryos_gpu.server")


# ============================================================================ shard replica
class ShardReplica:
    """One shard: the single-box serving core over the shard's engine (a Serve deployment)."""

    def __init__(
        self, config: dict[str, Any], shard: int, count: int, settings: dict[str, Any]
    ) -> None:
        from memoryos_gpu.distributed.sharding import ShardEngine
        from memoryos_gpu.server.service import MemoryService

        cfg = EngineConfig.model_validate({**config, "auto_process": False})
        self.shard, self.count = shard, count
        # the replica closes the engine itself (close()): the router's last exchange of keyword
        # statistics and facts comes between the service's end and the engine's
        self.service = MemoryService(
            lambda: ShardEngine(cfg, shard=shard, count=count),
            ServerSettings(**{**settings, "close_engine": False}),
        )
        self._starting: asyncio.Lock | None = None
        self._finishing: asyncio.Future | None = None
        self._closing: asyncio.Future | None = None

    async def _ready(self) -> Any:
        if self.service.state == "created":
            self._starting = self._starting or asyncio.Lock()
            async with self._starting:
                await self.service.start(wait=True)
        self.service.check_ready()
        return self.service

    async def _boxed(self, fn: Any, *args: Any) -> Any:
        """``await fn(*args)`` once the service is up; an exception is returned as data."""
        try:
            await self._ready()
            return await fn(*args)
        except Exception as exc:  # re-raised by the router as the same type
            return BoxedError.of(exc)

    def check_health(self) -> None:
        if self.service.state == "failed":
            raise RuntimeError(f"shard {self.shard}: {self.service.error}")

    # ------------------------------------------------------------------ shutdown
    async def finish(self) -> None:
        """Stop taking requests, drain the queues and finish derived work (the service's
        close); the engine stays open for the router's last exchange
        (:meth:`RouterService.finish_shards`), then :meth:`close` closes it. Idempotent:
        a second caller waits for the first."""
        if self._finishing is None:
            self._finishing = asyncio.ensure_future(self.service.close())
        await asyncio.shield(self._finishing)

    async def close(self) -> None:
        """:meth:`finish`, then close the engine: buffered heat written, keyword statistics
        saved (without that, a reopened shard would lack the other shards' pages of the run),
        the store closed. Idempotent."""
        await self.finish()
        if self._closing is None:
            engine = self.service.engine
            done = asyncio.sleep(0) if engine is None else asyncio.to_thread(engine.close)
            self._closing = asyncio.ensure_future(done)
        await asyncio.shield(self._closing)

    async def __del__(self) -> None:
        """Serve's shutdown hook (awaited once, when the replica stops): :meth:`close`. Under
        ``serve --ray`` the router has done it already, with a last exchange before it
        (:func:`finish_app`); under ``serve run`` / ``serve delete`` this is the only close,
        and the statistics saved are those of the last periodic sync."""
        try:
            await self.close()
        except Exception:
            log.exception("shard %d did not close cleanly", self.shard)

    async def _final_call(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """An engine method by name once :meth:`finish` ran (the router's last exchange): on a
        thread of its own, the service's executors being gone."""
        try:
            return await asyncio.to_thread(self._target(name), *args, **kwargs)
        except Exception as exc:
            return BoxedError.of(exc)

    def _target(self, name: str) -> Any:
        """The engine's method ``name`` (``store.x``: the store's)."""
        target = self.service.engine
        for part in name.split("."):
            target = getattr(target, part)
        return target

    async def add_pages(self, pages: list[PageInput]) -> list[AddResult] | BoxedError:
        return await self._boxed(self.service.add_pages, pages)

    async def retrieve(
        self, user_id: str, query: str, top_pages: int | None, top_segments: int | None
    ) -> tuple[Retrieval, bool] | BoxedError:
        """The retrieval, and whether the user is known here (for ``known_user``)."""

        async def go() -> tuple[Retrieval, bool]:
            r = await self.service.retrieve(
                user_id, query, top_pages=top_pages, top_segments=top_segments
            )
            return r, self.service.is_known(user_id)

        return await self._boxed(go)

    async def respond(self, user_id: str, query: str, timestamp: Any) -> Response | BoxedError:
        async def go() -> Response:
            return await self.service.respond(user_id, query, timestamp=timestamp)

        return await self._boxed(go)

    async def call(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """An engine method by name (``store.x`` for the store), on the service's executor
        (on a thread of its own after :meth:`finish`: the router's last exchange)."""
        if self._finishing is not None:
            await asyncio.shield(self._finishing)
            return await self._final_call(name, args, kwargs)

        async def go() -> Any:
            return await self.service.call(self._target(name), *args, **kwargs)

        return await self._boxed(go)

    async def delete_user(self, user_id: str) -> Any:
        return await self._boxed(self.service.delete_user, user_id)

    async def wait_for_user(self, user_id: str, timeout: float) -> Any:
        return await self._boxed(self.service.wait_for_user, user_id, timeout)

    async def status(self) -> Any:
        """Users, queue statistics, pending work, health and the engine's counters (the
        router's cached view, which its ``/metrics`` reads: ``MemoryService.status``)."""
        return await self._boxed(self._status)

    async def _status(self) -> dict[str, Any]:
        svc = self.service
        out = {**await svc.status(), "shard": self.shard, "users": svc.known_users()}
        if "pending" not in out:  # not loaded yet: refused, as the router expects
            out["pending"] = await svc.call(svc.engine.pending_count)
        return out

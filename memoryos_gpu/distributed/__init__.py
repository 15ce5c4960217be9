"""Scale-out: users sharded over engines, in one process or over a Ray cluster.

* :mod:`~memoryos_gpu.distributed.sharding`: the shard engine (:class:`ShardEngine`) and an
  in-process router with the engine's API (:class:`ShardedEngine`). No Ray needed.
* :mod:`~memoryos_gpu.distributed.layout`: the user -> shard map (:class:`ShardMap`), the shard
  store layout (:func:`shard_store`) and the checks that a store keeps its shard count.
* :mod:`~memoryos_gpu.distributed.exchange`: the keyword statistics exchanged between shards
  (by deltas, and by marks after an interruption).
* :mod:`~memoryos_gpu.distributed.replicas`: assistant knowledge, one writer per assistant and
  read replicas on every shard.
* :mod:`~memoryos_gpu.distributed.sharded_forget`: deleting a user or a page across shards.
* :mod:`~memoryos_gpu.distributed.ray_ingest`: bulk ingestion on Ray Data and shard actors
  (``memoryos-gpu ingest --ray``).
* :mod:`~memoryos_gpu.distributed.ray_serve`: the HTTP API on Ray Serve, one replica per shard
  (``memoryos-gpu serve --ray``).

Imports are lazy: ``import memoryos_gpu.distributed`` needs no Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ShardEngine", "ShardMap", "ShardedEngine", "require_ray", "shard_store"]


def __getattr__(name: str) -> Any:
    if name in ("ShardEngine", "ShardedEngine"):
        from memoryos_gpu.distributed import sharding

        return getattr(sharding, name)
    if name in ("ShardMap", "shard_store"):
        from memoryos_gpu.distributed import layout

        return getattr(layout, name)
    if name == "require_ray":
        from memoryos_gpu.distributed.ray_common import require_ray

        return require_ray
    raise AttributeError(name)

"""What the Ray paths share: the import check, connecting, resources, errors across processes."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any

INSTALL_HINT = (
    "the --ray paths need Ray (ray[serve,data]); install it with "
    "`pip install 'memoryos-gpu[ray]'` (or `pip install 'ray[serve,data]'`)"
)
ENV_RAY_ADDRESS = "RAY_ADDRESS"


class RayUnavailableError(RuntimeError):
    """Ray is not installed (the message says how to install it)."""


def require_ray(*parts: str) -> Any:
    """Import ``ray`` (and ``ray.<part>`` for each of ``parts``), or say how to install it."""
    try:
        ray = importlib.import_module("ray")
        for part in parts:
            importlib.import_module(f"ray.{part}")
    except ImportError as exc:
        raise RayUnavailableError(f"{INSTALL_HINT} ({exc})") from None
    return ray


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> Any:
    """Connect to Ray once: ``address`` (or $RAY_ADDRESS) joins a running cluster, otherwise a
    local one is started (``num_cpus`` caps it). A driver that already called ``ray.init``
    keeps its connection."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    address = address or os.environ.get(ENV_RAY_ADDRESS) or None
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address:
        ray.init(address=address, **kw)
    else:
        ray.init(num_cpus=num_cpus, **kw)
    return ray


@dataclass(frozen=True)
class ShardResources:
    """What one shard (an actor or a Serve replica) asks Ray for: a whole GPU each when the
    cluster has GPUs (one shard per GPU), else ``cpus`` CPUs."""

    gpus: float = 0.0
    cpus: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_cpus": self.cpus, **self.extra}
        if self.gpus:
            out["num_gpus"] = self.gpus
        return out


def shard_resources(
    shards: int, *, cpus: float | None = None, gpus: float | None = None
) -> ShardResources:
    """GPUs when the connected cluster has at least one per shard (unless ``gpus`` says
    otherwise), else CPU shards of ``cpus``. Default CPU reservation: all shards together take
    at most half of the cluster's CPUs less one (<= 1 each), so Ray Data's tasks (1 CPU each)
    and Serve's proxies always fit - measured: a 2-CPU local Ray deadlocks with 2 shards at
    0.5 CPU each. The reservation is logical: an engine still uses the threads it needs."""
    ray = require_ray()
    total = ray.cluster_resources()
    if gpus is None:
        gpus = 1.0 if total.get("GPU", 0) >= shards else 0.0
    if cpus is None:
        free = max(0.0, float(total.get("CPU", 1)) - 1.0)
        cpus = 1.0 if gpus else max(0.05, min(1.0, free / (2 * shards)))
    return ShardResources(gpus=float(gpus), cpus=float(cpus))


# ============================================================================ errors
@dataclass(frozen=True)
class BoxedError:
    """An exception carried across a Ray call as data, re-raised as itself by the caller.

    Raising through Ray wraps the exception in a RayTaskError whose message carries the remote
    traceback; the HTTP error handlers match the engine's exception types and show their
    message, so the type, message and attributes travel instead."""

    module: str
    name: str
    message: str
    attrs: dict[str, Any]

    @classmethod
    def of(cls, exc: BaseException) -> BoxedError:
        attrs = {
            k: v for k, v in vars(exc).items() if isinstance(v, str | int | float | bool | None)
        }
        return cls(type(exc).__module__, type(exc).__qualname__, _message(exc), attrs)

    def exception(self) -> BaseException:
        try:
            cls = getattr(importlib.import_module(self.module), self.name)
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise TypeError(self.name)
            exc = cls.__new__(cls)
            BaseException.__init__(exc, self.message)
            exc.__dict__.update(self.attrs)
            return exc
        except Exception:
            from memoryos_gpu.errors import MemoryOSError

            return MemoryOSError(f"{self.name}: {self.message}")


def _message(exc: BaseException) -> str:
    return str(exc.args[0]) if len(exc.args) == 1 else str(exc)


def unbox(value: Any) -> Any:
    """``value``, or raise the exception a :class:`BoxedError` carries."""
    if isinstance(value, BoxedError):
        raise value.exception()
    return value

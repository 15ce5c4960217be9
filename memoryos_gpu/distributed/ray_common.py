"""What the Ray paths share: the import check, connecting, resources, errors across processes."""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass, field
from typing import Any

INSTALL_HINT = (
    "the --ray paths need Ray (ray[serve,data]); install it with "
    "`pip install 'memoryos-gpu[ray]'` (or `pip install 'ray[serve,data]'`)"
)
ENV_RAY_ADDRESS = "RAY_ADDRESS"


#: How long the driver waits for the TCP connection to a cluster's address before saying it
#: cannot be reached (``ray.init`` itself retries an unreachable GCS for minutes).
CONNECT_TIMEOUT_S = 5.0


class RayUnavailableError(RuntimeError):
    """Ray cannot be used: not installed, or the cluster named cannot be reached (the message
    says what to do)."""


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
    keeps its connection. A cluster that cannot be reached is a :class:`RayUnavailableError`
    within seconds (:func:`check_address`), not minutes of Ray's retries."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    named = "the address given" if address else f"${ENV_RAY_ADDRESS}"
    address = address or os.environ.get(ENV_RAY_ADDRESS) or None
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if not address or address == "local":  # "local": Ray's word for a new local instance
        ray.init(address=address, num_cpus=num_cpus, **kw)
        return ray
    check_address(address, named)
    try:
        ray.init(address=address, **kw)
    except (ConnectionError, TimeoutError) as exc:
        raise RayUnavailableError(_unreachable(address, named, exc)) from None
    return ray


def check_address(address: str, named: str = f"${ENV_RAY_ADDRESS}") -> None:
    """Refuse, with a :class:`RayUnavailableError` naming ``address`` and what to check, a
    cluster address that leads nowhere: ``auto`` with no Ray running on this machine, or a
    ``host:port`` (``ray://host:port``) that takes no TCP connection within
    :data:`CONNECT_TIMEOUT_S`. Why before ``ray.init``: it retries an unreachable GCS for
    minutes ("Failed to connect to GCS") and has no timeout argument."""
    try:
        resolved = _resolve(address)
        if resolved is None:  # this Ray has no lookup we know: ray.init says what it finds
            return
        host, port = _host_port(resolved)
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:  # ConnectionError (auto: none found) is an OSError
        raise RayUnavailableError(_unreachable(address, named, exc)) from None


def _resolve(address: str) -> str | None:
    """``address`` as ``host:port``: ``auto`` becomes the Ray cluster running on this machine
    (Ray's own lookup, a private function: ConnectionError when there is none, None when this
    Ray version lacks it)."""
    if address != "auto":
        return address.removeprefix("ray://")
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die
    except ImportError:
        return None
    return canonicalize_bootstrap_address_or_die(address)


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _unreachable(address: str, named: str, exc: BaseException) -> str:
    why = str(exc).split(". ")[0] or type(exc).__name__
    return (
        f"cannot reach the Ray cluster at {address} ({named}): {why}. Check that its head node "
        f"runs (`ray status --address {address}`; start one with `ray start --head`) and that "
        f"its port is reachable from here, or unset {ENV_RAY_ADDRESS} to start a local Ray"
    )


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


def ray_error_cause(exc: BaseException) -> BaseException:
    """What a driver raises for an exception out of a Ray call: the project's own error that a
    task or actor raised (followed down ``RayTaskError.cause`` and ``__cause__``, through Ray
    Data's wrappers too), e.g. a StoreLockedError naming the store's holder; else a one-line
    MemoryOSError naming the innermost failure. Raise it ``from exc``: the CLI prints
    ``error: ...`` for it, as for the single-process path's errors, instead of pages of remote
    tracebacks, and a traceback still shows the Ray error."""
    from memoryos_gpu.errors import MemoryOSError

    seen = exc
    for _ in range(16):  # a chain is a few links; a cycle must not loop
        # first down Ray's wrapper: what ray.get raises is also an instance of the cause's
        # class (``RayTaskError(StoreLockedError)``), but its message is the remote traceback
        cause = getattr(seen, "cause", None)
        if isinstance(cause, BaseException):
            seen = cause
        elif isinstance(seen, MemoryOSError):
            return seen
        elif seen.__cause__ is not None:
            seen = seen.__cause__
        else:
            break
    lines = str(seen).strip().splitlines()
    return MemoryOSError(
        f"a Ray shard task failed: {type(seen).__name__}: {lines[0] if lines else ''}"
    )

"""``serve --workers N``: N HTTP worker processes in front of one engine process.

Why: in one process the HTTP stack (parsing, auth, validation, JSON) and the engine share one
interpreter lock, so the server runs on one core whatever the box has. Here the supervisor
(this module, the process the CLI started) runs

* one **engine process** (:mod:`memoryos_gpu.server.engine_process`): the engine, the
  micro-batching queues and the derived-work thread, behind a ZeroMQ socket;
* ``N`` **HTTP workers**: the same FastAPI app (routes, keys, tenancy, limits, metrics) over a
  :class:`~memoryos_gpu.server.remote_service.RemoteService`, all accepting on one listening
  socket the supervisor bound (one accept queue: a restarted worker loses no queued
  connection, and no port is ever half-served);

and the shared state: the engine's pid (the workers' liveness signal), the rate-limit buckets
(:mod:`memoryos_gpu.server.shared_limits`) and Prometheus's multiprocess directory, all in a
private runtime directory (mode 0700) removed at exit.

Failures: a worker that dies is started again (its clients' connections break: they retry; an
add it had sent still commits in the engine, an add it had acknowledged is committed). An engine
process that dies is started again; meanwhile, and until it has reopened the store, every
worker answers 503 + Retry-After (``/ready`` too) and the requests in flight fail the same way.
Shutdown (SIGTERM / Ctrl-C): the workers stop first (uvicorn answers what it has), then the
engine process drains its queues, finishes the derived work and closes the store.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.server.settings import ServerSettings

__all__ = [
    "Supervisor",
    "available_cpus",
    "default_workers",
    "engine_config",
    "run_workers",
    "serve_worker",
]

log = logging.getLogger("memoryos_gpu.server")
QUICK_DEATH_S = 5.0  # a process that dies sooner than this after starting is restarted slowly
RESTART_PAUSE_S = 1.0


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_workers(engines: int = 1) -> int:
    """The CLI's default: the cores available, minus one per engine process (0 on a one-core
    box: the single-process server)."""
    return max(0, available_cpus() - engines)


def engine_config(config: EngineConfig, workers: int) -> EngineConfig:
    """The engine process's config: unless ``cpu_threads`` is set, its CPU kernels get the
    cores the ``workers`` HTTP processes leave (at least one), not a team as wide as the
    machine whose members the workers would keep parking (ops.set_cpu_threads)."""
    if config.cpu_threads is not None:
        return config
    return config.model_copy(update={"cpu_threads": max(1, available_cpus() - workers)})


def _listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


# ============================================================================ worker process
def serve_worker(spec: dict[str, Any], sock: socket.socket, engine_pid: Any) -> None:
    """Worker process entry point: the HTTP app over the engine process, on ``sock``."""
    import uvicorn

    from memoryos_gpu.server.app import create_app
    from memoryos_gpu.server.auth import KeyRing
    from memoryos_gpu.server.remote_service import RemoteService
    from memoryos_gpu.server.shared_limits import SharedKeyLimits

    logging.basicConfig(
        level=getattr(logging, spec["log_level"].upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s %(name)s[worker {spec['index']}]: %(message)s",
    )
    settings = ServerSettings(**spec["settings"])
    keys = spec["api_keys"]
    service = RemoteService(spec["address"], lambda: int(engine_pid.value), settings)
    limits = SharedKeyLimits(settings, spec["limits_path"], KeyRing(keys).key_ids if keys else [])
    app = create_app(
        service=service, api_keys=keys, settings=settings, use_env_keys=False, limits=limits
    )
    config = uvicorn.Config(
        app,
        log_level=spec["log_level"].lower(),
        timeout_graceful_shutdown=spec["graceful_timeout_s"],
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
    uvicorn.Server(config).run(sockets=[sock])


# ============================================================================ supervisor
class Supervisor:
    """Starts, watches and restarts the engine process and the workers; stops them in order."""

    def __init__(
        self,
        config: EngineConfig,
        settings: ServerSettings,
        *,
        workers: int,
        host: str,
        port: int,
        api_keys: dict[str, str] | None,
        log_level: str = "info",
        graceful_timeout_s: float | None = 30.0,
    ) -> None:
        if workers < 1:
            raise ValueError(
                f"workers must be >= 1 (0 is the single-process server), got {workers}"
            )
        from memoryos_gpu.server.shared_limits import create_bucket_file

        self.sock = _listen(host, port)  # first: a port in use fails before anything exists
        self.ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self.dir = Path(tempfile.mkdtemp(prefix="memoryos-serve-"))  # mode 0700
        metrics_dir = self.dir / "metrics"
        metrics_dir.mkdir()
        # read by prometheus_client when a child imports it: every process records to files
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        limits_path = self.dir / "limits"
        create_bucket_file(limits_path, len(api_keys or {}))
        self.address = f"ipc://{self.dir / 'engine.sock'}"
        self.engine_pid = self.ctx.RawValue("i", 0)  # no lock: a killed reader holds none
        self.engine_spec = {
            "config": engine_config(config, workers).model_dump(mode="json"),
            "settings": settings.model_dump(),
            "address": self.address,
            "log_level": log_level,
            "argv": [*sys.argv, f"[engine process of pid {os.getpid()}]"],
        }
        self.worker_spec = {
            "settings": settings.model_dump(),
            "api_keys": dict(api_keys) if api_keys else None,
            "address": self.address,
            "limits_path": str(limits_path),
            "log_level": log_level,
            "graceful_timeout_s": graceful_timeout_s,
        }
        self.n_workers = workers
        self.graceful_timeout_s = graceful_timeout_s
        self.engine: Any = None
        self.workers: list[Any] = [None] * workers
        self.started: dict[int, float] = {}
        self.stopping = False
        self.restarts = {"engine": 0, "worker": 0}

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _start_engine(self) -> None:
        from memoryos_gpu.server.engine_process import serve_engine

        self.engine = self.ctx.Process(
            target=serve_engine, args=(self.engine_spec,), name="memoryos-engine", daemon=False
        )
        self.engine.start()
        self.started[self.engine.pid] = time.monotonic()
        self.engine_pid.value = self.engine.pid
        log.warning("memoryos-gpu: engine process started (pid %d)", self.engine.pid)

    def _start_worker(self, i: int) -> None:
        spec = {**self.worker_spec, "index": i}
        p = self.ctx.Process(
            target=serve_worker,
            args=(spec, self.sock, self.engine_pid),
            name=f"memoryos-worker-{i}",
            daemon=False,
        )
        p.start()
        self.started[p.pid] = time.monotonic()
        self.workers[i] = p
        log.warning("memoryos-gpu: HTTP worker %d started (pid %d)", i, p.pid)

    def start(self) -> None:
        self._start_engine()
        for i in range(self.n_workers):
            self._start_worker(i)
        log.warning(
            "memoryos-gpu: %d HTTP worker(s) in front of 1 engine process on port %d",
            self.n_workers,
            self.port,
        )

    def watch(self) -> None:
        """Until :attr:`stopping`: restart what dies."""
        while not self.stopping:
            procs = [p for p in [self.engine, *self.workers] if p is not None]
            ready = multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.2)
            for p in procs:
                if p.sentinel in ready and not self.stopping:
                    self._restart(p)

    def _restart(self, p: Any) -> None:
        p.join()
        quick = time.monotonic() - self.started.pop(p.pid, 0.0) < QUICK_DEATH_S
        if p is self.engine:
            self.engine_pid.value = 0  # the workers fail what is in flight, answer 503
            log.error("the engine process %d exited (%s); starting it again", p.pid, p.exitcode)
            self.restarts["engine"] += 1
            if quick:
                time.sleep(RESTART_PAUSE_S)
            self._start_engine()
            return
        i = self.workers.index(p)
        log.error("HTTP worker %d (pid %d) exited (%s); starting it again", i, p.pid, p.exitcode)
        self.restarts["worker"] += 1
        if quick:
            time.sleep(RESTART_PAUSE_S)
        self._start_worker(i)

    def stop(self) -> None:
        """Workers first (each answers its requests in flight), then the engine process
        (drains the queues, finishes derived work, closes the store)."""
        self.stopping = True
        for p in self.workers:
            if p is not None and p.is_alive():
                p.terminate()
        grace = (self.graceful_timeout_s or 30.0) + 10.0
        for p in self.workers:
            if p is not None:
                p.join(grace)
                if p.is_alive():
                    p.kill()
                    p.join()
        self.sock.close()
        if self.engine is not None and self.engine.is_alive():
            self.engine.terminate()
            self.engine.join()
        self.engine_pid.value = 0
        shutil.rmtree(self.dir, ignore_errors=True)


def run_workers(
    config: EngineConfig,
    settings: ServerSettings,
    *,
    workers: int,
    host: str,
    port: int,
    api_keys: dict[str, str] | None,
    log_level: str = "info",
    graceful_timeout_s: float | None = 30.0,
) -> None:
    """Serve with ``workers`` HTTP processes until SIGINT / SIGTERM, then stop in order."""
    sup = Supervisor(
        config,
        settings,
        workers=workers,
        host=host,
        port=port,
        api_keys=api_keys,
        log_level=log_level,
        graceful_timeout_s=graceful_timeout_s,
    )

    def stop(signum: int, frame: Any) -> None:
        sup.stopping = True

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sup.start()
        sup.watch()
    finally:
        sup.stop()
        for s, h in old.items():
            with contextlib.suppress(Exception):
                signal.signal(s, h)
        log.warning("memoryos-gpu: workers stopped, queues drained, store closed")

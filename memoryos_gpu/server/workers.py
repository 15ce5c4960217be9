"""``serve --workers N [--engines K]``: N HTTP worker processes in front of K engine processes.

Why: in one process the HTTP stack (parsing, auth, validation, JSON) and the engine share one
interpreter lock, so the server runs on one core whatever the box has. Here the supervisor
(this module, the process the CLI started) runs

* one **engine process** (:mod:`memoryos_gpu.server.engine_process`): the engine, the
  micro-batching queues and the derived-work thread, behind a ZeroMQ socket; with
  ``--engines K``, K of them, each owning one shard of the users (``STORE/shard-I``);
* ``N`` **HTTP workers**: the same FastAPI app (routes, keys, tenancy, limits, metrics) over a
  :class:`~memoryos_gpu.server.remote_service.RemoteService` (with K engines a
  :class:`~memoryos_gpu.server.shard_router.ShardedRemoteService`, which sends each request to
  its user's engine), all accepting on one listening socket the supervisor bound (one accept
  queue: a restarted worker loses no queued connection, and no port is ever half-served);

and the shared state: the engine's pid (the workers' liveness signal), the rate-limit buckets
(:mod:`memoryos_gpu.server.shared_limits`) and Prometheus's multiprocess directory, all in a
private runtime directory (mode 0700) removed at exit.

Failures: a worker that dies is started again (its clients' connections break: they retry; an
add it had sent still commits in the engine, an add it had acknowledged is committed). An engine
process that dies is started again; meanwhile, and until it has reopened the store, every
worker answers 503 + Retry-After (``/ready`` too) and the requests in flight fail the same way
(with K engines: the requests of that engine's users; the other shards' users are served).
Shutdown (SIGTERM, Ctrl-C, SIGHUP; to the supervisor or to the whole process group): the
listening socket is closed (new connections are refused), the workers stop first (uvicorn
answers what it has), then the engine process drains its queues, finishes the derived work and
closes the store. A second Ctrl-C forces the workers to quit (their requests in flight are
aborted) and the stop counts as failed. A supervisor
killed outright (SIGKILL, the OOM killer) runs no shutdown: each child is then sent SIGTERM by
the kernel (Linux, :mod:`memoryos_gpu.parent_death`) and stops as above on its own (a worker
answers what it has; the engine process drains, finishes and closes the store, giving up its
writer claim), so a restarted ``serve`` finds the port and the store free. The supervisor
exits 0 after a stop whose every process finished its shutdown; one that failed (an engine
process whose close raised, a worker killed past its grace) makes it :class:`ShutdownError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.server.header_timeout import header_timeout_protocol
from memoryos_gpu.server.runtime_dir import make_runtime_dir
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.stop_signals import STOP_SIGNALS, sighup_as_sigterm, sigterm_as_ctrl_c

__all__ = [
    "ShutdownError",
    "StartupError",
    "Supervisor",
    "available_cpus",
    "check_listen_address",
    "default_workers",
    "engine_config",
    "run_server",
    "run_workers",
    "serve_worker",
]

log = logging.getLogger("memoryos_gpu.server")
EXIT_FORCED_QUIT = 130  # a worker forced to quit by a second Ctrl-C (128 + SIGINT)
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


def engine_config(config: EngineConfig, workers: int, engines: int = 1) -> EngineConfig:
    """An engine process's config: unless ``cpu_threads`` is set, its CPU kernels get its share
    of the cores the ``workers`` HTTP processes leave (at least one), not a team as wide as
    the machine whose members the workers would keep parking (ops.set_cpu_threads)."""
    if config.cpu_threads is not None:
        return config
    return config.model_copy(
        update={"cpu_threads": max(1, (available_cpus() - workers) // max(1, engines))}
    )


class StartupError(OSError):
    """The HTTP server could not start serving its address (taken, not this machine's, not a
    host at all, ...): a runtime failure, said in one line naming the address and the cause
    (the CLI's ``error: ...``, exit 1) rather than a traceback or uvicorn's exit code 3."""


class ShutdownError(RuntimeError):
    """A stopped server's shutdown failed (its close raised, a process had to be killed):
    pending writes may be uncommitted or the store left unclosed, so the stop must not look
    like a clean one (the CLI's ``error: ...``, exit 1, where a clean stop exits 0)."""


def run_server(server: Any, sockets: list[socket.socket] | None = None) -> None:
    """Run the uvicorn ``server`` until SIGINT, SIGTERM or SIGHUP, then return once its
    graceful shutdown is done, as ``uvicorn.run`` does
    (:func:`~memoryos_gpu.stop_signals.sigterm_as_ctrl_c` says why SIGTERM needs this;
    :func:`sighup_as_sigterm` why SIGHUP). A stop before it
    started serving is re-raised (``KeyboardInterrupt``): nothing was served, nothing was
    shut down. A second Ctrl-C (uvicorn's force quit: ``server.force_exit``) aborts the
    requests in flight: one WARNING line each (:class:`_ForcedQuitLog`), and the caller says
    that the shutdown was cut short."""
    with _forced_quit_log(lambda: server.force_exit), sigterm_as_ctrl_c(), sighup_as_sigterm():
        try:
            server.run(sockets=sockets)
        except KeyboardInterrupt:  # uvicorn gives a stop it took back once it has shut down
            if not server.started:
                raise


class ServedSignals:
    """The stop signals a ``uvicorn.run`` took, in the order they came (:func:`served_signals`)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @property
    def forced(self) -> bool:
        """Whether a second Ctrl-C forced uvicorn to quit: a SIGINT after an earlier stop
        signal, uvicorn's own rule for ``force_exit``."""
        return signal.SIGINT in self.seen[1:]

    def handle(self, signum: int, frame: Any) -> None:
        # uvicorn gives back each signal it took once it has shut down, last first, from its
        # event loop: recorded. Outside a loop (the server not serving yet) a stop interrupts,
        # as Ctrl-C does (sigterm_as_ctrl_c)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise KeyboardInterrupt from None
        self.seen.insert(0, signum)


@contextlib.contextmanager
def served_signals() -> Iterator[ServedSignals]:
    """For ``uvicorn.run`` (the single-process server), which keeps its ``Server`` to itself:
    SIGINT, SIGTERM and SIGHUP stop it gracefully (SIGTERM and SIGHUP as Ctrl-C does, exit
    status 0: :func:`~memoryos_gpu.stop_signals.sigterm_as_ctrl_c`, :func:`sighup_as_sigterm`),
    and the yielded :class:`ServedSignals` says afterwards whether a second Ctrl-C forced it
    to quit, which then logs the aborted requests as :func:`run_server` does (main thread
    only; elsewhere it records nothing)."""
    signals = ServedSignals()
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return
    old = {s: signal.signal(s, signals.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with _forced_quit_log(lambda: signals.forced), sighup_as_sigterm():
            yield signals
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _forced_quit_log(forced: Any) -> Iterator[None]:
    """:class:`_ForcedQuitLog` on uvicorn's error log while in this block."""
    quiet = _ForcedQuitLog(forced)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    try:
        yield
    finally:
        uvicorn_log.removeFilter(quiet)


#: The line a server forced to quit by a second Ctrl-C ends with (every mode: ShutdownError).
FORCED_QUIT = (
    "a second Ctrl-C forced the server to quit: its requests in flight were aborted, "
    "its shutdown cut short"
)


class _ForcedQuitLog(logging.Filter):
    """After uvicorn's force quit (a second Ctrl-C), the tasks it leaves are cancelled: each
    request in flight raised ``CancelledError`` and uvicorn logged an ERROR "Exception in
    ASGI application" traceback, and the app's cut-short shutdown another (Starlette's
    "lifespan.shutdown.failed" message: the traceback as text), for an abort the user asked
    for. Each such record becomes one WARNING line without its traceback."""

    ABORTS = (asyncio.CancelledError, KeyboardInterrupt)

    def __init__(self, forced: Any) -> None:
        super().__init__()
        self.forced = forced  # () -> whether the server was forced to quit

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not self.forced():
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = str(record.msg)
        if isinstance(exc, self.ABORTS) and "ASGI application" in text:
            what = "a request in flight was aborted"
        elif isinstance(exc, self.ABORTS) or (
            text.startswith("Traceback (most recent call last)")
            and text.rstrip()
            .rsplit("\n", 1)[-1]
            .startswith(("asyncio.exceptions.CancelledError", "KeyboardInterrupt"))
        ):
            what = "the application's shutdown was cut short"
        else:
            return True
        record.msg, record.args = f"{what} (a second Ctrl-C forced the server to quit)", ()
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


def _address(host: str, port: int) -> str:
    """``host:port`` as a user would type it (``[::1]:8000`` for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_error(host: str, port: int, exc: OSError) -> StartupError:
    """``exc`` (from resolving or binding ``host:port``) as a :class:`StartupError` that says
    what to do about it."""
    if isinstance(exc, socket.gaierror):
        cause = f"--host {host!r} is not an address or a known host name ({exc.strerror})"
    elif exc.errno == errno.EADDRINUSE:
        cause = "address already in use (another server listens there: stop it or pick --port)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        cause = "no network interface of this machine has that address (check --host)"
    elif exc.errno == errno.EACCES:
        cause = "permission denied (ports below 1024 need privileges: pick a higher --port)"
    else:
        cause = (exc.strerror or str(exc)).lower()
    return StartupError(f"cannot listen on {_address(host, port)}: {cause}")


def _listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise _bind_error(host, port, exc) from None
    sock.set_inheritable(True)
    return sock


def check_listen_address(host: str, port: int) -> None:
    """Raise :class:`StartupError` unless ``host:port`` can be bound now, as uvicorn will bind it
    (every address the host resolves to, IPv6 ones v6-only, SO_REUSEADDR): the single-process
    server loads its engine before uvicorn binds, so without this a taken port is learnt only
    after the model has loaded. The sockets are closed again (never listened on, they leave
    no TIME_WAIT behind)."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        raise _bind_error(host, port, exc) from None
    with contextlib.ExitStack() as stack:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            try:
                sock = stack.enter_context(socket.socket(family, kind, proto))
            except OSError:  # a family this kernel lacks (no IPv6): asyncio skips it too
                continue
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                raise _bind_error(host, port, exc) from None


# ============================================================================ worker process
def serve_worker(spec: dict[str, Any], sock: socket.socket, engine_pids: list[Any]) -> None:
    """Worker process entry point: the HTTP app over the engine process, on ``sock``. Stopped
    by SIGTERM (uvicorn's graceful shutdown), also the one the kernel sends if the supervisor
    (``spec["parent"]``) dies."""
    from memoryos_gpu.parent_death import die_with_parent

    if spec.get("parent"):  # first: an orphan must not go on serving the old port
        die_with_parent(int(spec["parent"]))
    if hasattr(signal, "SIGHUP"):  # a closed terminal's SIGHUP to the process group: the
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # supervisor stops this one in order
    import uvicorn

    from memoryos_gpu.host_memory import freeze_long_lived
    from memoryos_gpu.log_setup import setup_logging, uvicorn_logging
    from memoryos_gpu.server.app import create_app, shutdown_failed
    from memoryos_gpu.server.auth import KeyRing
    from memoryos_gpu.server.shared_limits import SharedKeyLimits

    setup_logging(spec["log_level"], tag=f"worker {spec['index']}")
    settings = ServerSettings(**spec["settings"])
    keys = spec["api_keys"]
    service = _worker_service(spec, settings, engine_pids)
    limits = SharedKeyLimits(settings, spec["limits_path"], KeyRing(keys).key_ids if keys else [])
    app = create_app(
        service=service, api_keys=keys, settings=settings, use_env_keys=False, limits=limits
    )
    if settings.gc_freeze:  # a worker loads nothing more: its modules are what it keeps
        freeze_long_lived()
    config = uvicorn.Config(
        app,
        **uvicorn_logging(spec["log_level"]),
        timeout_graceful_shutdown=spec["graceful_timeout_s"],
        h11_max_incomplete_event_size=settings.max_header_bytes,
        http=header_timeout_protocol(settings.header_timeout_s),
        **settings.proxy_headers(),
    )
    server = uvicorn.Server(config)
    try:
        run_server(server, sockets=[sock])
    except KeyboardInterrupt:  # stopped before it served: nothing to finish
        return
    if server.force_exit:  # a second Ctrl-C aborted its requests: not a clean stop
        sys.exit(EXIT_FORCED_QUIT)
    if shutdown_failed(app):  # uvicorn logged why; the supervisor reads the exit code
        sys.exit(1)


def _worker_service(spec: dict[str, Any], settings: ServerSettings, pids: list[Any]) -> Any:
    """The worker's service: over the engine process, or over K of them by shard."""
    from memoryos_gpu.server.remote_service import RemoteService

    getters = [lambda v=v: int(v.value) for v in pids]
    if len(spec["addresses"]) == 1:
        return RemoteService(spec["addresses"][0], getters[0], settings)
    from memoryos_gpu.server.shard_router import ShardedRemoteService

    return ShardedRemoteService(
        spec["addresses"],
        getters,
        settings,
        lock_path=spec["lock_path"],
        sync=spec["index"] == 0,  # one worker syncs the shards
    )


# ============================================================================ supervisor
class Supervisor:
    """Starts, watches and restarts the engine processes and the workers; stops them in order."""

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
        engines: int = 1,
    ) -> None:
        if workers < 1:
            raise ValueError(
                f"workers must be >= 1 (0 is the single-process server), got {workers}"
            )
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        from memoryos_gpu.server.shared_limits import create_bucket_file

        self.sock = _listen(host, port)  # first: a port in use fails before anything exists
        self._port = int(self.sock.getsockname()[1])  # stop() closes the socket first
        if engines > 1:  # lays the shards out in the store: only once the port is ours
            try:
                _check_shardable(config.store, engines)
            except BaseException:
                self.sock.close()
                raise
        self.ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self.dir = make_runtime_dir()  # mode 0700
        metrics_dir = self.dir / "metrics"
        metrics_dir.mkdir()
        # read by prometheus_client when a child imports it: every process records to files;
        # put back by stop(), which deletes the directory (a later registry in this process,
        # a second run() or a test's, failed on "a nonexistent directory")
        self._env_before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        limits_path = self.dir / "limits"
        create_bucket_file(limits_path, len(api_keys or {}))
        addresses = [f"ipc://{self.dir / f'engine-{i}.sock'}" for i in range(engines)]
        # set by stop() once the workers have stopped: an engine process's SIGTERM is then
        # the supervisor's, and it stops at once (engine_process._on_sigterm says why)
        self.workers_gone = self.ctx.RawValue("b", 0)
        # no lock: a killed reader holds none
        self.engine_pids = [self.ctx.RawValue("i", 0) for _ in range(engines)]
        base = engine_config(config, workers, engines)
        self.engine_specs = [
            {
                # the config object itself, not a dump: see _start_engine
                "config": _shard_config(base, i, engines),
                "settings": settings.model_dump(),
                "address": address,
                "log_level": log_level,
                "argv": [*sys.argv, f"[engine process of pid {os.getpid()}]"],
                "parent": os.getpid(),  # SIGTERM to it when this supervisor dies
                "workers_gone": self.workers_gone,
                **({"shard": [i, engines]} if engines > 1 else {}),
            }
            for i, address in enumerate(addresses)
        ]
        self.worker_spec = {
            "settings": settings.model_dump(),
            "api_keys": dict(api_keys) if api_keys else None,
            "addresses": addresses,
            "lock_path": str(self.dir / "exchange.lock"),
            "limits_path": str(limits_path),
            "log_level": log_level,
            "graceful_timeout_s": graceful_timeout_s,
            "parent": os.getpid(),
        }
        self.n_workers = workers
        self.graceful_timeout_s = graceful_timeout_s
        self.engines: list[Any] = [None] * engines
        self.workers: list[Any] = [None] * workers
        self.started: dict[int, float] = {}
        self.stopping = False
        self.restarts = {"engine": 0, "worker": 0}

    @property
    def port(self) -> int:
        return self._port

    def _engine_name(self, i: int) -> str:
        return "engine process" if len(self.engines) == 1 else f"engine process {i}"

    def _start_engine(self, i: int) -> None:
        """Start engine process ``i``. Its spec travels pickled through the pipe that
        multiprocessing's spawn opens to the child (not its command line, not its environment),
        the :class:`EngineConfig` as itself: a JSON dump would write the store key as
        ``**********``, under which the engine would then encrypt a new store (or fail to open
        the user's)."""
        from memoryos_gpu.server.engine_process import serve_engine

        p = self.ctx.Process(
            target=serve_engine,
            args=(self.engine_specs[i],),
            name=f"memoryos-engine-{i}",
            daemon=False,
        )
        p.start()
        self.started[p.pid] = time.monotonic()
        self.engines[i] = p
        self.engine_pids[i].value = p.pid
        log.info("memoryos-gpu: %s started (pid %d)", self._engine_name(i), p.pid)

    def _start_worker(self, i: int) -> None:
        spec = {**self.worker_spec, "index": i}
        p = self.ctx.Process(
            target=serve_worker,
            args=(spec, self.sock, self.engine_pids),
            name=f"memoryos-worker-{i}",
            daemon=False,
        )
        p.start()
        self.started[p.pid] = time.monotonic()
        self.workers[i] = p
        log.info("memoryos-gpu: HTTP worker %d started (pid %d)", i, p.pid)

    def start(self) -> None:
        for i in range(len(self.engines)):
            self._start_engine(i)
        for i in range(self.n_workers):
            self._start_worker(i)
        log.info(
            "memoryos-gpu: %d HTTP worker(s) in front of %d engine process(es) on port %d",
            self.n_workers,
            len(self.engines),
            self.port,
        )

    def watch(self) -> None:
        """Until :attr:`stopping`: restart what dies."""
        while not self.stopping:
            procs = [p for p in [*self.engines, *self.workers] if p is not None]
            ready = multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.2)
            for p in procs:
                if p.sentinel in ready and not self.stopping:
                    self._restart(p)

    def force_quit(self) -> None:
        """A second Ctrl-C (SIGINT) during the stop, sent to this process alone (``kill -INT``
        twice): passed on to the workers, for uvicorn's force quit there, as a second Ctrl-C
        at the terminal does to the whole process group. The engine processes still drain."""
        for p in self.workers:
            if p is not None and p.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGINT)

    def _restart(self, p: Any) -> None:
        p.join()
        quick = time.monotonic() - self.started.pop(p.pid, 0.0) < QUICK_DEATH_S
        if p in self.engines:
            i = self.engines.index(p)
            self.engine_pids[i].value = 0  # the workers fail what is in flight, answer 503
            log.error(
                "%s (pid %d) %s; starting it again",
                self._engine_name(i),
                p.pid,
                _exit_phrase(p.exitcode),
            )
            self.restarts["engine"] += 1
            if quick:
                time.sleep(RESTART_PAUSE_S)
            self._start_engine(i)
            return
        i = self.workers.index(p)
        log.error("HTTP worker %d (pid %d) exited (%s); starting it again", i, p.pid, p.exitcode)
        self.restarts["worker"] += 1
        if quick:
            time.sleep(RESTART_PAUSE_S)
        self._start_worker(i)

    def stop(self) -> list[str]:
        """Workers first (each answers its requests in flight; worker 0 syncs the shards a
        last time), then the engine processes (each drains its queues, finishes derived work,
        closes its store). Returns what failed to stop cleanly, one phrase per process (empty:
        the stop was clean).

        The listening socket is closed first: while this process held its copy, the port
        stayed open through the whole stop, and the kernel queued new connections that no
        worker would accept (held until the stop ended, then reset), where the
        single-process server refuses them at once. Each worker closes its own copy as its
        shutdown begins; the connections they have are still answered."""
        self.stopping = True
        self.sock.close()
        for p in self.workers:
            if p is not None and p.is_alive():
                p.terminate()
        grace = (self.graceful_timeout_s or 30.0) + 10.0
        failures: list[str] = []
        for i, p in enumerate(self.workers):
            if p is not None:
                p.join(grace)
                if p.is_alive():
                    p.kill()
                    p.join()
                    failures.append(f"HTTP worker {i} (pid {p.pid}) did not stop in {grace:g} s")
                elif not _stopped_cleanly(p.exitcode):
                    failures.append(f"HTTP worker {i} (pid {p.pid}) {_exit_phrase(p.exitcode)}")
        self.workers_gone.value = 1  # the SIGTERM below is the supervisor's: stop now
        live = [p for p in self.engines if p is not None and p.is_alive()]
        for p in live:
            p.terminate()
        for p in live:
            p.join()
        failures += [
            f"the {self._engine_name(i)} (pid {p.pid}) {_exit_phrase(p.exitcode)}"
            for i, p in enumerate(self.engines)
            if p is not None and not _stopped_cleanly(p.exitcode)
        ]
        for v in self.engine_pids:
            v.value = 0
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._env_before is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = self._env_before
        return failures


def _stopped_cleanly(exitcode: int | None) -> bool:
    """Whether a child's exit code is a clean stop: 0 after its shutdown, or the SIGTERM it
    was sent ending it before it had installed its handler (still starting: nothing open)."""
    return exitcode in (0, -signal.SIGTERM)


def _exit_phrase(exitcode: int | None) -> str:
    """``exited with status 1`` / ``was killed by SIGKILL``, for the shutdown's error."""
    if exitcode == EXIT_FORCED_QUIT:
        return "was forced to quit by a second Ctrl-C (its requests in flight were aborted)"
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exited with status {exitcode}"


def _check_shardable(store: str, engines: int) -> None:
    """``--engines K`` shards the users over K stores (``STORE/shard-I``, or one PostgreSQL
    database): refused for an in-memory store (each engine would hold a private one) and for
    a store laid out for another count (layout.prepare_layout says why)."""
    from memoryos_gpu.distributed.layout import prepare_layout

    if store == ":memory:":
        raise ValueError(
            f"--engines {engines} needs --store DIR (one store per engine) or a PostgreSQL URL"
        )
    prepare_layout(store, engines)


def _shard_config(config: EngineConfig, index: int, count: int) -> EngineConfig:
    """Engine ``index``'s config: its shard's store (the same URL for PostgreSQL)."""
    if count == 1:
        return config
    from memoryos_gpu.distributed.layout import shard_store

    return config.model_copy(update={"store": shard_store(config.store, index, count)})


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
    engines: int = 1,
) -> None:
    """Serve with ``workers`` HTTP processes in front of ``engines`` engine processes until
    SIGINT, SIGTERM or SIGHUP (:data:`~memoryos_gpu.stop_signals.STOP_SIGNALS`, as every
    command: SIGHUP's default action killed the supervisor outright, leaving its runtime
    directory behind), then stop in order. A second SIGINT (Ctrl-C again) forces the workers
    to quit (:meth:`Supervisor.force_quit`), and the stop is then not a clean one
    (:class:`ShutdownError`); a repeated SIGTERM or SIGHUP changes nothing. The rule is
    :class:`~memoryos_gpu.stop_signals.StopSignals`', whose handler is not used here: it
    raises ``KeyboardInterrupt`` on the second Ctrl-C, which would cut this process's own
    ordered stop short (engine processes left unstopped, the runtime directory left)."""
    sup = Supervisor(
        config,
        settings,
        workers=workers,
        host=host,
        port=port,
        api_keys=api_keys,
        log_level=log_level,
        graceful_timeout_s=graceful_timeout_s,
        engines=engines,
    )

    def stop(signum: int, frame: Any) -> None:
        if sup.stopping and signum == signal.SIGINT:
            sup.force_quit()
        sup.stopping = True

    old = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    failures: list[str] = []
    try:
        sup.start()
        sup.watch()
    finally:
        failures = sup.stop()
        for s, h in old.items():
            with contextlib.suppress(Exception):
                signal.signal(s, h)
        if not failures:
            log.info("memoryos-gpu: workers stopped, queues drained, store closed")
    if failures:  # a stop signal, but not a clean stop: the exit status says so
        raise ShutdownError(
            f"the HTTP server's shutdown failed: {'; '.join(failures)} (the log above says why); "
            "writes may be uncommitted: start it again on the store to recover"
        )

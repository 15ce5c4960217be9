"""The serving core shared by the HTTP app and the MCP server: an engine behind batched queues.

* Retrievals from many requests are gathered into one ``engine.retrieve_many`` call
  (``max_batch`` / ``max_wait_ms``); responses likewise into ``engine.respond_many``.
* Writes go through a write queue with one FIFO per tenant (the stored ids' ``tenant/``
  prefix), served round robin (:class:`~memoryos_gpu.server.batching.FairBatcher`) into
  batched ``engine.add_many`` calls on ``write_lanes`` threads: a large request is split into
  chunks (``write_chunk_pages`` / ``write_chunk_chars``), so another tenant's page is served
  between two of its chunks instead of after all of them. One user's pages are applied in the
  order they were accepted, and an add is acknowledged only after its pages are committed.
* Derived work (dialogue chain, MTM placement, promotion) runs in a background thread
  (``engine.process_pending``); the engine is built with ``auto_process=False`` so request
  latency does not include it. :meth:`MemoryService.wait_for_user` is the read-your-writes
  barrier.
* Every engine call runs on a dedicated executor thread, never on the event loop.
* Shutdown (:meth:`MemoryService.close`) refuses new work, drains every queue, runs derived
  work until a deadline (``EngineConfig.shutdown_drain_s``) and closes the engine (when the
  service built it). What is left then stays pending in the store, where the next open
  resumes it; LLM requests in flight are cancelled, so a hung LLM server cannot hold the
  process past the deadline (an orchestrator would kill it, mid-write, soon after).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.embed.base import EmbeddingError
from memoryos_gpu.engine.assembly import retrieval_json
from memoryos_gpu.engine.validation import validate_pages
from memoryos_gpu.errors import EngineClosedError, MemoryOSError, UnknownUserError
from memoryos_gpu.host_memory import freeze_long_lived
from memoryos_gpu.llm.base import LLMBackendError
from memoryos_gpu.llm.breaker import OPEN, CircuitBreaker
from memoryos_gpu.server.batching import (
    ChunkFailed,
    FairBatcher,
    MicroBatcher,
    Overloaded,
    Unavailable,
    check_state,
)
from memoryos_gpu.server.scope import done_writing, with_known
from memoryos_gpu.server.settings import ServerSettings
from memoryos_gpu.store.errors import StoreError, StoreFullError, StoreUnavailableError
from memoryos_gpu.store.rounds import tenant_of
from memoryos_gpu.types import AddResult, PageInput, Response, Retrieval

__all__ = [
    "LLMUnavailableError",
    "MemoryService",
    "Overloaded",
    "PartialWriteError",
    "Unavailable",
    "tenant_of",
    "wait_until_processed",
]

log = logging.getLogger("memoryos_gpu.server")
T = TypeVar("T")
#: The longest wait between tries of a derived-work round that keeps failing (_derived_loop).
DERIVED_RETRY_MAX_S = 60.0
#: How long close() still waits, once the deadline passed and the LLM backend was closed, for
#: the derived round in flight to unwind (its requests are cancelled at once; the round then
#: fails like any round whose LLM failed, and its work stays pending).
ABORT_GRACE_S = 5.0
#: The longest wait between tries to load the engine while its store is unavailable (_load).
LOAD_RETRY_MAX_S = 30.0
LOAD_RETRY_FIRST_S = 1.0
#: What a failed load's error (``/ready``, every route's 503) adds: unlike a store that cannot
#: be reached yet, a wrong key or a corrupt or locked store is not tried again, and a client
#: retrying after Retry-After would wait for good without being told.
NOT_RETRIED = "not retried: fix it and restart the server"
#: how a service that does not wait for its store (:attr:`MemoryService.wait_for_store`) ends
NOT_WAITED = "the server stops without waiting for it: start it again once the store is free"
#: Failures of what every item of a batch needs (the LLM, unreachable or behind an open
#: breaker; the embedding server; the store's database server; the engine itself, closed):
#: the batch's error is every item's answer. Retrying items alone would fail each the same
#: way, after redoing its work: a respond item retrieves again, counting the retrieval and
#: crediting its pages' heat a second time. Any other failure may be one item's (a user
#: deleted meanwhile, one bad page, a disk with room for a smaller part), so the batch's
#: items are retried alone. A full disk is such a failure: one item may still fit.
BATCH_FAILURES: tuple[type[Exception], ...] = (
    LLMBackendError,
    EmbeddingError,
    StoreUnavailableError,
    EngineClosedError,
)


def doubling(first: float, cap: float) -> Iterator[float]:
    """Waits between tries of something that keeps failing: ``first``, twice that, ... up to
    ``cap``, then ``cap`` for good (the derived-work and load retries)."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, cap)


class LLMUnavailableError(MemoryOSError):
    """``respond`` needs an engine in LLM mode."""


class PartialWriteError(MemoryOSError):
    """A write split into chunks failed part way: the first ``committed`` pages (``results``)
    are stored, the rest are not (nothing after the failed chunk was run)."""

    def __init__(self, results: list[AddResult], total: int, cause: BaseException) -> None:
        ids = ", ".join(str(r.page_id) for r in results[:20]) + (
            ", ..." if len(results) > 20 else ""
        )
        super().__init__(
            f"{type(cause).__name__}: {cause}; the first {len(results)} of the request's {total} "
            f"pages were committed (page ids {ids}), the other {total - len(results)} were not: "
            "send those again"
        )
        self.results = results
        self.cause = cause


def split_pages(
    pages: Sequence[PageInput], max_pages: int, max_chars: int
) -> list[list[PageInput]]:
    """``pages`` in order, cut into chunks of at most ``max_pages`` pages and ``max_chars``
    characters of text (a chunk holds at least one page, however long)."""
    chunks: list[list[PageInput]] = []
    cur: list[PageInput] = []
    chars = 0
    for p in pages:
        n = page_chars(p)
        if cur and (len(cur) >= max_pages or chars + n > max_chars):
            chunks.append(cur)
            cur, chars = [], 0
        cur.append(p)
        chars += n
    if cur:
        chunks.append(cur)
    return chunks


def page_chars(p: PageInput) -> int:
    """A page's size as the write queue counts it: the characters of its texts."""
    return len(p.user_input) + len(p.agent_response or "")


def _limit_native_threads(n: int | None) -> None:
    """Cap OpenMP threads of the calling thread (per-thread ICV); a no-op without threadpoolctl."""
    if n is None:
        return
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(n, user_api="openmp")
    except Exception:  # pragma: no cover - optional dependency / no OpenMP runtime loaded
        log.debug("could not limit OpenMP threads", exc_info=True)


def wait_until_processed(engine: Any, user_id: str, timeout: float = 30.0) -> bool:
    """Library-level read-your-writes barrier for a bare engine: run derived work until the
    user has none pending (or ``timeout`` passes). True when nothing is pending."""
    deadline = time.monotonic() + timeout
    while engine.pending_count(user_id):
        if time.monotonic() >= deadline:
            return False
        engine.process_pending()
    return True


def _empty_retrieval(user_id: str, query: str) -> Retrieval:
    return Retrieval(user_id, query, [], [], {}, [], [])


class MemoryService:
    """An engine behind micro-batched queues and a derived-work thread.

    ``source`` is an :class:`EngineConfig` (the engine is built in a thread by :meth:`start`, so
    health checks answer while a large store loads), a ready ``MemoryEngine`` (used as is; not
    closed on shutdown unless ``settings.close_engine``), or a zero-argument factory.
    """

    #: what :meth:`close` did, for the server's last log line
    closed_message = "queues drained, derived work done, engine closed"

    def __init__(
        self,
        source: EngineConfig | Any | Callable[[], Any],
        settings: ServerSettings | None = None,
        *,
        metrics: Any = None,
    ) -> None:
        self.settings = settings or ServerSettings()
        self.metrics = metrics
        self._source = source
        self.engine: Any = None
        self.state = "created"  # created -> starting -> ready -> closing -> closed | failed
        self.error: str | None = None
        #: whether a store that cannot be opened yet (held by another writer, its database
        #: down) is waited for (the HTTP server) or fails the load at once (the MCP server,
        #: whose client shows what it says only once it has stopped)
        self.wait_for_store = True
        self._owns_engine = False
        self._held_pending = False  # the engine was opened holding its derived work back
        self._known: set[str] = set()
        self._known_lock = threading.Lock()
        self._user_writes: Counter[str] = Counter()
        self._derived_wake = threading.Event()
        self._derived_stop = threading.Event()
        self._derived_urgent = threading.Event()  # a reader waits: skip the coalescing pause
        self._derived_thread: threading.Thread | None = None
        self._derived_runs = 0  # rounds started, failed ones included
        # what the last batches said (:meth:`health`): writes fail for a full disk; the LLM
        # could not be used (its batch failed whole)
        self._store_full = False
        self._llm_failing = False
        self._derived_backlog = 0  # pages accepted since the last derived round started
        self._derived_max_batch = self.settings.derived_max_batch or 256  # engine's, once built
        self._loading: asyncio.Task | None = None
        self._stop_loading = asyncio.Event()  # close() ends a load waiting for the store
        self._batchers: dict[str, MicroBatcher] = {}
        n = self.settings.native_threads
        if n is None and (os.cpu_count() or 1) <= 2:
            n = 1
        self._native_threads = n
        self._read_exec: ThreadPoolExecutor | None = None
        self._write_exec: ThreadPoolExecutor | None = None
        self._misc_exec: ThreadPoolExecutor | None = None
        self._respond_exec: ThreadPoolExecutor | None = None

    # ================================================================== lifecycle
    def _executor(self, name: str, workers: int) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            workers,
            thread_name_prefix=f"memoryos-{name}",
            initializer=_limit_native_threads,
            initargs=(self._native_threads,),
        )

    async def start(self, *, wait: bool = True) -> None:
        """Build (or adopt) the engine and start the queues and the derived-work thread.
        ``wait=False`` returns at once and finishes loading in the background."""
        if self.state != "created":
            return
        self.state = "starting"
        if self.settings.switch_interval_ms is not None:
            sys.setswitchinterval(self.settings.switch_interval_ms / 1000)
        self._read_exec = self._executor("read", 1)
        self._write_exec = self._executor("write", self.settings.write_lanes)
        self._misc_exec = self._executor("misc", 2)
        self._respond_exec = self._executor("respond", 1)
        self._loading = asyncio.get_running_loop().create_task(self._load())
        if wait:
            await self._loading

    async def loaded(self) -> bool:
        """Wait for the load :meth:`start` began (``wait=False``) to end, however it ends;
        True when the engine is ready. Shielded: a caller that stops waiting does not cancel
        the load. A service that never started a load answers at once."""
        if self._loading is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._loading)
        return self.state == "ready" and self.engine is not None

    async def _load(self) -> None:
        engine = await self._build_when_store_answers()
        if engine is None:
            return
        self.engine = engine
        with self._known_lock:
            self._known = set(engine.users())
        s = self.settings
        config = getattr(engine, "config", None)
        self._derived_max_batch = s.derived_max_batch or getattr(config, "derived_max_batch", 256)
        self._batchers = {
            "retrieve": MicroBatcher(
                "retrieve",
                self._run_retrievals,
                executor=self._read_exec,  # type: ignore[arg-type]
                max_batch=s.max_batch,
                max_wait_s=s.max_wait_ms / 1000,
                limit=s.read_queue_limit,
                key_limit=s.tenant_read_queue_limit,
                retry_after=s.retry_after_s,
                on_batch=self._observer("retrieve", "retrieve_many"),
            ),
            "write": FairBatcher(
                "write",
                self._run_writes,
                executor=self._write_exec,  # type: ignore[arg-type]
                lanes=s.write_lanes,
                max_batch=s.write_max_batch,
                max_size=s.write_batch_chars,
                max_wait_s=s.write_max_wait_ms / 1000,
                limit=s.write_queue_limit,
                key_limit=s.tenant_write_queue_limit,
                key_size_limit=s.tenant_write_queue_chars,
                retry_after=s.retry_after_s,
                on_batch=self._observer("write", "add_many"),
            ),
            "respond": MicroBatcher(
                "respond",
                self._run_responses,
                # its own thread: LLM generation runs outside the engine lock, so retrievals
                # go on meanwhile
                executor=self._respond_exec,  # type: ignore[arg-type]
                max_batch=s.respond_max_batch,
                max_wait_s=s.respond_max_wait_ms / 1000,
                limit=s.respond_queue_limit,
                retry_after=s.retry_after_s,
                on_batch=self._observer("respond", "respond_many"),
            ),
        }
        for b in self._batchers.values():
            b.start()
        if s.derived_enabled:
            if self._held_pending:
                engine.release_pending()  # held by _build_engine: resumed below, in the thread
            self._derived_thread = threading.Thread(
                target=self._derived_loop, name="memoryos-derived", daemon=True
            )
            self._derived_thread.start()
            self._derived_wake.set()  # resume work a previous run left pending
        if s.gc_freeze:
            frozen = freeze_long_lived()
            log.info("%d loaded objects kept out of the garbage collector's scans", frozen)
        self.state, self.error = "ready", None

    def _build_engine(self) -> Any:
        _limit_native_threads(self._native_threads)
        src = self._source
        if isinstance(src, EngineConfig):
            from memoryos_gpu.engine import MemoryEngine

            self._owns_engine = True
            # the work a previous run left pending is resumed by the derived-work thread once
            # serving (:meth:`_load` releases it), not inside the open: /ready does not wait
            # for it, and a shutdown meanwhile is bounded by shutdown_drain_s as for any round
            self._held_pending = self.settings.derived_enabled
            config = src.model_copy(update={"auto_process": False})
            return MemoryEngine(config, hold_pending=self._held_pending)
        if callable(src) and not hasattr(src, "add_many"):
            self._owns_engine = True
            return src()
        return src

    def _observer(self, queue: str, op: str) -> Callable[[int, float], None]:
        def observe(size: int, seconds: float) -> None:
            if self.metrics is not None:
                self.metrics.observe_batch(queue, op, size, seconds)

        return observe

    async def _build_when_store_answers(self) -> Any:
        """The engine, built in the write executor; None once the load failed or close() ended
        it. A store that is unavailable (its database server down or restarting) is tried
        again after 1, 2, 4, ... up to :data:`LOAD_RETRY_MAX_S` seconds, ``/ready`` saying
        why meanwhile: a server started before its database would otherwise stay not-ready
        for good while looking alive (``/health`` 200), and no orchestrator would restart it.
        A store another writer holds is waited for the same way: the holder is often leaving
        (the engine process of a killed ``serve``, draining up to ``shutdown_drain_s``), and a
        load that gave up then would leave a restarted server failed for good. Unless
        :attr:`wait_for_store` is off: then such a store fails the load at once, in one line.
        Any other failure (another embedding model, a wrong key) is final: state failed."""
        from memoryos_gpu.store import StoreUnavailableError
        from memoryos_gpu.store.writer import StoreLockedError

        delays = doubling(LOAD_RETRY_FIRST_S, LOAD_RETRY_MAX_S)
        while True:
            delay = next(delays)
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    self._write_exec, self._build_engine
                )
            except (StoreUnavailableError, StoreLockedError) as exc:
                if not self.wait_for_store:
                    self.state = "failed"
                    self.error = f"the store cannot be opened now: {exc}; {NOT_WAITED}"
                    log.error("the engine failed to load: %s", self.error)
                    return None
                self.error = f"waiting for the store ({exc}); next try in {delay:g} s"
                log.warning("the engine cannot load yet: %s", self.error)
            except Exception as exc:
                self.state, self.error = "failed", f"{type(exc).__name__}: {exc}; {NOT_RETRIED}"
                # another embedder than the store's, a locked store: one line; a bug: traceback
                _log_failure("the engine failed to load", exc)
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_loading.wait(), delay)
                return None  # closed while waiting

    async def close(self) -> None:
        """Stop accepting, drain the queues, run derived work until the shutdown deadline,
        close the engine if owned.

        The deadline (``EngineConfig.shutdown_drain_s`` after the call) bounds the wait for
        the LLM: past it, an engine the service closes has its LLM backend closed, which fails
        the requests in flight (the round they belong to fails and its work stays pending, as
        for any LLM failure; a response waiting for them fails), and no new round starts.
        Pending work is durable: the next open resumes it. An engine the service does not
        close keeps its backend; a round in flight then finishes in the background."""
        if self.state in ("closing", "closed"):
            return
        if self._loading is not None and not self._loading.done():
            self._stop_loading.set()  # a load waiting for the store ends now
            await self._loading
        was_ready = self.state == "ready"
        self.state = "closing"
        deadline = time.monotonic() + self._shutdown_drain_s()
        if was_ready:
            await self._drain_queues(deadline)
        self._derived_stop.set()
        self._derived_wake.set()
        self._derived_urgent.set()
        if self.engine is not None:
            await self._finish_engine(deadline)
        for ex in (self._read_exec, self._write_exec, self._misc_exec, self._respond_exec):
            if ex is not None:
                ex.shutdown(wait=True)
        self.state = "closed"

    async def _drain_queues(self, deadline: float) -> None:
        """Writes first (they are the only thing that must not be lost), then the rest; a
        response still waiting for the LLM at the ``deadline`` gets its LLM closed."""
        await self._batchers["write"].drain()
        others = asyncio.gather(
            self._batchers["retrieve"].drain(), self._batchers["respond"].drain()
        )
        if not await _done_by(others, deadline):
            await self._abort_llm("responses")
        await others

    async def _finish_engine(self, deadline: float) -> None:
        """Derived work until the ``deadline``, then the engine closed (when owned);
        :attr:`closed_message` says what was left pending."""
        await self._drain_derived(deadline)
        loop = asyncio.get_running_loop()
        left = await loop.run_in_executor(self._write_exec, self._pending_left)
        closes = self._closes_engine()
        self.closed_message = f"queues drained, {left}" + (", engine closed" if closes else "")
        if closes:
            try:
                await loop.run_in_executor(self._write_exec, self.engine.close)
            except StoreError as exc:  # the store closed anyway; acknowledged writes are kept
                why = "the disk is full" if isinstance(exc, StoreFullError) else "store error"
                log.warning(
                    "engine closed, but its last writes (keyword statistics, heat) failed (%s): %s",
                    why,
                    exc,
                )
                self.closed_message += f" (last writes failed: {why})"

    def _pending_left(self) -> str:
        """What shutdown's derived work left, in words."""
        try:
            left = int(self.engine.pending_count())
        except Exception:  # a store that failed: the close goes on, the message says less
            return "derived work stopped"
        if left:
            return f"{left} derived item(s) left pending in the store for the next start"
        return "derived work done"

    def _closes_engine(self) -> bool:
        close = self.settings.close_engine
        return self._owns_engine if close is None else close

    def _shutdown_drain_s(self) -> float:
        """The engine's ``shutdown_drain_s`` (EngineConfig's default for an engine without)."""
        default = EngineConfig.model_fields["shutdown_drain_s"].default
        return float(getattr(getattr(self.engine, "config", None), "shutdown_drain_s", default))

    async def _drain_derived(self, deadline: float) -> None:
        """Let the round in flight finish, then run rounds until nothing is pending or the
        ``deadline`` passed (:meth:`_drain_rounds`, on a thread of its own so that waiting on
        it can stop at the deadline); past it, abort the LLM and give the round
        :data:`ABORT_GRACE_S` to unwind."""
        drain = threading.Thread(
            target=self._drain_rounds, args=(deadline,), name="memoryos-drain", daemon=True
        )
        drain.start()
        if await _joined_by(drain, deadline):
            return
        await self._abort_llm("derived work")
        if self._closes_engine():
            await _joined_by(drain, time.monotonic() + ABORT_GRACE_S)

    def _drain_rounds(self, deadline: float) -> None:
        """Shutdown's derived work: after the derived thread's round in flight, one round at a
        time while time is left and rounds take work; a failure ends it (the work stays
        pending in the store)."""
        _limit_native_threads(self._native_threads)
        if self._derived_thread is not None:
            self._derived_thread.join()
        while time.monotonic() < deadline:
            try:
                done = self.engine.process_pending(max_batch=self._derived_max_batch, max_rounds=1)
            except Exception as exc:
                self._derived_failed(exc)
                _log_failure("derived work failed at shutdown; it stays pending in the store", exc)
                return
            if not (sum(done.values()) if isinstance(done, dict) else 0):
                return

    async def _abort_llm(self, what: str) -> None:
        """The shutdown deadline passed with ``what`` still waiting: close the LLM backend of
        an engine the service closes anyway, cancelling its requests in flight."""
        llm = getattr(self.engine, "llm", None) if self._closes_engine() else None
        log.warning(
            "shutdown: %s still running after %g s (shutdown_drain_s)%s; unfinished derived "
            "work stays pending in the store for the next start",
            what,
            self._shutdown_drain_s(),
            "; cancelling the LLM requests in flight" if llm is not None else "",
        )
        if llm is not None:
            await asyncio.get_running_loop().run_in_executor(None, llm.close)

    # ================================================================== state
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def check_ready(self) -> None:
        check_state(self.state, self.error, "the engine", self.settings.retry_after_s)

    def queue_depths(self) -> dict[str, int]:
        return {name: b.admitted for name, b in self._batchers.items()}

    def batch_stats(self) -> dict[str, Any]:
        return {
            name: {
                "batches": b.batches,
                "items": b.items,
                "mean_batch": round(b.items / b.batches, 2) if b.batches else 0.0,
                "admitted": b.admitted,
                "limit": b.limit,
                "max_batch": b.max_batch,
            }
            for name, b in self._batchers.items()
        }

    def known_users(self) -> list[str]:
        with self._known_lock:
            return sorted(self._known)

    def is_known(self, user_id: str) -> bool:
        with self._known_lock:
            return user_id in self._known

    async def known(self, user_id: str) -> bool:
        """:meth:`is_known` for routes that must see every process's writes: under
        ``serve --workers`` a worker's own view may lag, the engine process's does not.

        :class:`Unavailable` (503) until the engine is loaded, as in a worker: the known set
        is empty until then, so "unknown user" (404) would be a wrong answer about a user
        the store may well hold."""
        self.check_ready()
        return self.is_known(user_id)

    async def users(self) -> list[str]:
        """:meth:`known_users`, as :meth:`known` is :meth:`is_known` (and refused, like it,
        until the engine is loaded: no users is not the answer then)."""
        self.check_ready()
        return self.known_users()

    def engine_for(self, user_id: str) -> Any:
        """The engine holding ``user_id`` (one engine here; a shard under the Ray router).

        :class:`Unavailable` (503, with the load error and Retry-After) until the engine is
        loaded: every route reaches the engine through here or through a method that checks
        the same, so none can get ``None`` (an ``AttributeError``, a bare 500) after a failed
        load or while the store is still being waited for."""
        self.check_ready()
        return self.engine

    @property
    def has_llm(self) -> bool:
        cfg = getattr(self.engine, "config", None)
        return getattr(getattr(cfg, "llm", None), "mode", None) == "llm"

    # ================================================================== writes
    async def add_pages(self, pages: Sequence[PageInput]) -> list[AddResult]:
        """Queue pages (many users allowed; one tenant, by their ids' prefix) for batched
        ``add_many`` calls; returns after commit.

        A request larger than one chunk is validated whole first (off the event loop, so bad
        input fails it before any chunk is committed), then committed chunk by chunk between
        other tenants' writes; if a chunk fails at run time, :class:`PartialWriteError` says
        which pages were committed."""
        self.check_ready()
        s = self.settings
        chunks = split_pages(pages, s.write_chunk_pages, s.write_chunk_chars)
        if len(chunks) > 1:
            pages = await asyncio.get_running_loop().run_in_executor(
                self._misc_exec, lambda: validate_pages(pages)
            )
            chunks = split_pages(pages, s.write_chunk_pages, s.write_chunk_chars)
        users = Counter(p.user_id for p in pages)
        key = tenant_of(pages[0].user_id) if pages else ""
        fut = self._batchers["write"].enqueue(  # type: ignore[call-arg]
            key, [(c, len(c), sum(map(page_chars, c))) for c in chunks] or [([], 1, 0)]
        )
        self._user_writes.update(users)
        fut.add_done_callback(lambda f: self._writes_done(f, users))
        try:
            # shielded: a client that goes away does not un-queue an accepted write
            done = await asyncio.shield(fut)
        except ChunkFailed as exc:
            committed = [r for chunk in exc.done for r in chunk]
            raise PartialWriteError(committed, len(pages), exc.cause) from exc.cause
        return [r for chunk in done for r in chunk]

    def _writes_done(self, fut: asyncio.Future, users: Counter[str]) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved here: no "never retrieved" warning if the client left
        done_writing(self._user_writes, users)

    def _run_writes(self, requests: list[list[PageInput]]) -> list[Any]:
        flat = [p for r in requests for p in r]
        try:
            results = self.engine.add_many(flat)
        except Exception as exc:
            if len(requests) == 1 or isinstance(exc, BATCH_FAILURES):
                self._note(exc)
                return [exc] * len(requests)
            # one bad request must not fail the others: nothing was committed, so retry each
            out: list[Any] = []
            for r in requests:
                try:
                    out.append(self.engine.add_many(r))
                except Exception as e:
                    out.append(e)
            done = [x for o in out if not isinstance(o, BaseException) for x in o]
            full = next((o for o in out if isinstance(o, StoreFullError)), None)
            self._note(full, wrote=bool(done))
            self._after_write(done)
            return out
        self._note(None, wrote=True)
        self._after_write(results)
        out, i = [], 0
        for r in requests:
            out.append(results[i : i + len(r)])
            i += len(r)
        return out

    def _after_write(self, results: Sequence[AddResult]) -> None:
        with self._known_lock:
            self._known.update(r.user_id for r in results)
        self._derived_backlog += len(results)
        if self._derived_backlog >= self._derived_max_batch:
            self._derived_urgent.set()  # a full round is waiting: no point gathering longer
        self._derived_wake.set()

    # ================================================================== reads
    async def retrieve(
        self,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
    ) -> Retrieval:
        """One query; joins the current retrieval micro-batch. An unknown user (no memory yet)
        gets an empty retrieval."""
        return await self.enqueue_retrieval(user_id, query, top_pages, top_segments)

    def enqueue_retrieval(
        self,
        user_id: str,
        query: str,
        top_pages: int | None,
        top_segments: int | None,
        as_json: bool = False,
    ) -> asyncio.Future:
        """:meth:`retrieve` as a future of the batch it joins (no coroutine: the engine process
        of ``serve --workers`` answers its workers' retrievals from the future's callback);
        ``as_json``: a future of the result's JSON bytes (``retrieval_json``, no known_user)."""
        self.check_ready()
        item = (user_id, query, top_pages, top_segments, as_json)
        # a tenant's share (keyed servers store tenant/user); an open server's ids take none
        return self._batchers["retrieve"].enqueue(item, key=tenant_of(user_id) or None)

    async def retrieve_body(
        self,
        user_id: str,
        query: str,
        *,
        top_pages: int | None = None,
        top_segments: int | None = None,
    ) -> bytes:
        """:meth:`retrieve` as its route's JSON (less user_id), written by the engine for the
        whole batch: no Python object per page."""
        raw = await self.enqueue_retrieval(user_id, query, top_pages, top_segments, True)
        return with_known(raw, self.is_known(user_id))

    def _run_retrievals(
        self, items: list[tuple[str, str, int | None, int | None, bool]]
    ) -> list[Any]:
        out: list[Any] = [None] * len(items)
        groups: dict[tuple[int | None, int | None, bool], list[int]] = {}
        for i, (uid, q, tp, ts, as_json) in enumerate(items):
            if self.is_known(uid):
                groups.setdefault((tp, ts, as_json), []).append(i)
            else:
                empty = _empty_retrieval(uid, q)
                out[i] = retrieval_json(empty) if as_json else empty
        for (tp, ts, as_json), idx in groups.items():
            queries = [(items[i][0], items[i][1]) for i in idx]
            kw = {"top_pages": tp, "top_segments": ts, "as_json": as_json}
            try:
                res = self.engine.retrieve_many(queries, **kw)
            except BATCH_FAILURES as exc:
                res = [exc] * len(queries)
            except Exception:
                res = []
                for q in queries:  # isolate the failing query (e.g. a user deleted meanwhile)
                    try:
                        res.append(self.engine.retrieve_many([q], **kw)[0])
                    except UnknownUserError:
                        empty = _empty_retrieval(*q)
                        res.append(retrieval_json(empty) if as_json else empty)
                    except Exception as e:
                        res.append(e)
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        if groups:
            self._derived_wake.set()  # heat changed: promotions may be due
        return out

    async def respond(
        self, user_id: str, query: str, *, timestamp: float | str | None = None
    ) -> Response:
        """Answer with memory (engine in LLM mode); joins the current respond micro-batch."""
        self.check_ready()
        if not self.has_llm:
            raise LLMUnavailableError(
                "respond needs an engine with an LLM (config llm.mode = 'llm'); this server runs "
                "LLM-free"
            )
        if not self.is_known(user_id):
            raise UnknownUserError(f"unknown user {user_id!r}: add a page before responding")
        return await self._batchers["respond"].submit((user_id, query, timestamp))

    def _run_responses(self, items: list[tuple[str, str, Any]]) -> list[Any]:
        out: list[Any] = [None] * len(items)
        groups: dict[Any, list[int]] = {}
        for i, (_, _, ts) in enumerate(items):
            groups.setdefault(ts, []).append(i)
        for ts, idx in groups.items():
            queries = [(items[i][0], items[i][1]) for i in idx]
            try:
                res: list[Any] = list(self.engine.respond_many(queries, timestamp=ts))
            except BATCH_FAILURES as exc:
                self._note(exc)
                res = [exc] * len(queries)
            except Exception:
                res = []
                for q in queries:
                    try:
                        res.append(self.engine.respond_many([q], timestamp=ts)[0])
                    except Exception as e:
                        res.append(e)
                        self._note(e)
            else:
                self._note(None, wrote=True, used_llm=True)
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        self._derived_wake.set()
        return out

    # ================================================================== other engine calls
    async def call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run an engine call on the service's executor (never on the event loop)."""
        self.check_ready()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._misc_exec, lambda: fn(*args, **kw))

    async def delete_user(self, user_id: str) -> bool:
        # queued writes of this user go first, so the delete is not undone by them
        await self._wait_writes(user_id, self.settings.max_wait_timeout_s)
        deleted = await self.call(self.engine.delete_user, user_id)
        with self._known_lock:
            self._known.discard(user_id)
        return bool(deleted)

    async def _wait_writes(self, user_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._user_writes.get(user_id, 0) > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    def derived_can_progress(self) -> bool:
        """False while derived work cannot progress: the engine's LLM backend has an open
        circuit breaker (unreachable, or failing every request), so every LLM call fails at
        once and a derived round only fails again until the cool-down ends. True otherwise,
        also when nothing says so (no LLM, a backend without a breaker, an engine in another
        process): a caller then waits as before."""
        breaker = _llm_breaker(self.engine)
        return breaker is None or breaker.state != OPEN

    async def wait_for_user(
        self, user_id: str, timeout: float = 10.0, *, while_progressing: bool = False
    ) -> dict[str, Any]:
        """Read-your-writes barrier: until the user's queued writes are committed and their
        derived work is done (``engine.pending_count(user) == 0``), or ``timeout``.

        ``while_progressing``: stop early (``done: false``) once the writes are committed but
        derived work cannot progress (:meth:`derived_can_progress`): the rest of the wait
        could not end in ``done`` (the MCP ``add_memory``'s wait; ``/wait`` waits its
        ``timeout``, which its caller chose)."""
        self.check_ready()
        t0 = time.monotonic()
        deadline = t0 + timeout
        delay = 0.002
        while True:
            queued = self._user_writes.get(user_id, 0)
            pending = await self.call(self.engine.pending_count, user_id) if queued == 0 else -1
            done = queued == 0 and pending == 0
            now = time.monotonic()
            stuck = while_progressing and queued == 0 and not done
            if done or now >= deadline or (stuck and not self.derived_can_progress()):
                return {
                    "user_id": user_id,
                    "done": done,
                    "pending": max(0, pending),
                    "queued_writes": queued,
                    "waited_s": round(now - t0, 4),
                }
            self._derived_wake.set()
            self._derived_urgent.set()
            await asyncio.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, 0.02)

    # ================================================================== derived work thread
    def _derived_loop(self) -> None:
        """The derived-work scheduler: while work is pending, wait until
        ``derived_max_batch`` items are pending, a reader waits on /wait, or
        ``derived_max_wait_ms`` passed; then run one round of at most ``derived_max_batch``
        pages (per-user order kept by the engine) and the promotions it queued, and gather
        again. Gathering before every round, not only the first of a backlog, is what keeps
        rounds large under a steady stream of writes: run back to back, rounds would carry the
        few pages that came during the previous one, each paying a round's fixed cost under
        the engine lock that retrievals and writes wait for.

        A round that fails (a full disk, say) leaves its work pending, and the next try waits
        1, 2, 4, ... up to :data:`DERIVED_RETRY_MAX_S` seconds: a failed round reloads the
        engine's memory from the store under that same lock (seconds with many users), so
        retrying every second would keep the retrievals, which need no disk, waiting."""
        _limit_native_threads(self._native_threads)
        delays = doubling(1.0, DERIVED_RETRY_MAX_S)
        while not self._derived_stop.is_set():
            self._derived_wake.wait(timeout=1.0)
            if self._derived_stop.is_set():
                break
            self._derived_wake.clear()
            try:
                self._derived_round()
            except Exception as exc:
                if self._derived_stop.is_set():  # e.g. the LLM closed at the shutdown deadline
                    _log_failure("derived work stopped by shutdown; it stays pending", exc)
                    break
                self._derived_failed(exc)
                delay = next(delays)
                _log_failure(f"derived work failed; it stays pending, next try in {delay:g} s", exc)
                self._derived_stop.wait(delay)
            else:
                delays = doubling(1.0, DERIVED_RETRY_MAX_S)

    def _derived_round(self) -> None:
        """Gather, then run one round (:meth:`_derived_loop`)."""
        # the heat retrievals credited, written behind (it queues the promotions they
        # earned, so it runs first); retrievals themselves write nothing
        self.engine.write_behind()
        pending = self.engine.pending_count()
        if pending == 0:
            return
        full = self._derived_max_batch
        max_wait = self.settings.derived_max_wait_ms / 1000
        if max_wait and max(pending, self._derived_backlog) < full:
            self._derived_urgent.wait(max_wait)  # gather company for the round
        self._derived_urgent.clear()
        self._derived_backlog = 0
        t0 = time.perf_counter()
        self._derived_runs += 1  # before the call: a round that fails was run too
        done = self.engine.process_pending(max_batch=full, max_rounds=1)
        dt = time.perf_counter() - t0
        n = sum(done.values()) if isinstance(done, dict) else 0
        if self.metrics is not None:
            self.metrics.observe_batch("derived", "process_pending", n, dt)
        if n:
            self._note(None, wrote=True, used_llm=True)
            self._derived_wake.set()  # the rest, and what came meanwhile, gather next

    def _derived_failed(self, exc: Exception) -> None:
        """Count a failed derived round where the engine counts its own
        (``counters["derived_failures"]`` and its kinds, shown by ``/metrics`` and
        ``/v1/stats``) and keep what it says about the store and the LLM (:meth:`health`)."""
        self._note(exc)
        count = getattr(self.engine, "count_derived_failure", None)
        if count is not None:  # an engine of another kind (a test's stand-in) counts nothing
            count(exc)

    def _note(
        self, exc: BaseException | None, *, wrote: bool = False, used_llm: bool = False
    ) -> None:
        """Keep what a batch said about the store and the LLM, for :meth:`health`: a full
        disk (``StoreFullError``) or an unusable LLM (``LLMBackendError``: unreachable,
        failing every request, its breaker open) is set by the failure that met it and
        cleared by the next batch that committed pages (``wrote``) or got the LLM's answers
        (``used_llm``). O(1): called once a batch, not per item."""
        if isinstance(exc, StoreFullError):
            self._store_full = True
        elif exc is None and wrote:
            self._store_full = False
        if isinstance(exc, LLMBackendError):
            self._llm_failing = True
        elif exc is None and used_llm:
            self._llm_failing = False

    def health(self) -> dict[str, Any]:
        """How the server serves beyond ready-or-not, for ``/ready``, ``/metrics`` and
        ``/v1/stats``. Why: a server whose every write fails (a full disk: 507) or whose LLM
        cannot be used still retrieves, so ``/ready`` stays 200 (a load balancer must not take
        retrievals away from it), and without this nothing but the log said it was degraded.

        * ``degraded``: ``store_full`` (the last write or derived round met a full disk, and
          none has committed since), ``llm_unavailable`` (the LLM backend's circuit breaker is
          open, or the last derived round or response batch failed because the LLM could not
          be used, and none has got its answers since); empty when serving fully;
        * ``llm``: the LLM backend's own counts (``calls``: requests given to it, ``retries``,
          ``errors``: requests that failed, batches failed whole included, ``invalid_json``,
          ...), its name and its breaker's state (``closed``, ``open``, ``half_open``; None
          for a backend without one) with ``retry_in_s`` while open; None without an LLM;
        * ``derived_runs``: derived rounds run, failed ones included.

        Read from any thread (a scrape's): reads counters under their own locks only."""
        llm = _llm_status(self.engine)
        degraded = ["store_full"] if self._store_full else []
        if self._llm_failing or (llm is not None and llm["breaker"] == OPEN):
            degraded.append("llm_unavailable")
        return {"degraded": degraded, "llm": llm, "derived_runs": self._derived_runs}

    async def status(self) -> dict[str, Any]:
        """What a process that serves no engine itself reads of this one, as a snapshot it
        refreshes (a ``--workers`` worker, ``--engines``' router, ``--ray``'s router):
        lifecycle state, queue statistics, health, and once loaded the gauges, counters and
        config that its routes and ``/metrics`` read (:mod:`~memoryos_gpu.server.metrics`)."""
        out: dict[str, Any] = {
            "state": self.state,
            "error": self.error,
            "batching": self.batch_stats(),
            "depths": self.queue_depths(),
            "derived_runs": self._derived_runs,
            "health": self.health(),
        }
        engine = self.engine
        if engine is None or not self.ready:
            return out
        stats = getattr(getattr(engine, "stages", None), "stats", None)
        with contextlib.suppress(Exception):  # the store may be closing
            out["pending"] = await self.call(engine.pending_count)
        out.update(
            has_llm=self.has_llm,
            config=getattr(engine, "config", None),
            memory=getattr(engine, "memory", None),
            embedder_dim=getattr(getattr(engine, "embedder", None), "dim", 0),
            counters=dict(getattr(engine, "counters", None) or {}),
            llm=stats.as_dict() if stats is not None else None,
        )
        return out


def _llm_backend(engine: Any) -> Any:
    """``engine``'s LLM backend; None in the extractive mode or for a proxy of a remote
    engine (whose stages are not the objects)."""
    return getattr(getattr(engine, "stages", None), "backend", None)


def _llm_breaker(engine: Any) -> CircuitBreaker | None:
    """The circuit breaker of ``engine``'s LLM backend, if it has one (the HTTP
    backends); None for the extractive mode, other backends, or a proxy of a remote engine
    (whose attributes are not the objects)."""
    breaker = getattr(_llm_backend(engine), "breaker", None)
    return breaker if isinstance(breaker, CircuitBreaker) else None


def _llm_status(engine: Any) -> dict[str, Any] | None:
    """The LLM backend's counts and breaker state (:meth:`MemoryService.health`'s ``llm``),
    or None without a backend."""
    backend = _llm_backend(engine)
    stats = getattr(backend, "stats", None)
    if stats is None:
        return None
    out: dict[str, Any] = {"backend": getattr(backend, "name", type(backend).__name__)}
    out.update((k, v) for k, v in stats.as_dict().items() if k != "by_stage")
    breaker = _llm_breaker(engine)
    out["breaker"] = None if breaker is None else breaker.state
    if out["breaker"] == OPEN:
        out["retry_in_s"] = round(breaker.outage().retry_in_s, 1)  # type: ignore[union-attr]
    return out


def _log_failure(what: str, exc: Exception) -> None:
    """Log a failure (a derived round, the engine's load): our own errors say what happened
    (no traceback needed; the MCP server's stderr, which clients show, stays one line), a
    bug gets its traceback."""
    if isinstance(exc, MemoryOSError):
        log.error("%s: %s", what, exc)
    else:
        log.error("%s", what, exc_info=exc)


async def _done_by(aw: Any, deadline: float) -> bool:
    """Whether ``aw`` finished by ``deadline`` (``time.monotonic()``); it is not cancelled
    when it did not."""
    done, _ = await asyncio.wait({asyncio.ensure_future(aw)}, timeout=_left(deadline))
    return bool(done)


async def _joined_by(thread: threading.Thread, deadline: float) -> bool:
    """Whether ``thread`` ended by ``deadline``, waited for off the event loop."""
    await asyncio.get_running_loop().run_in_executor(None, thread.join, _left(deadline))
    return not thread.is_alive()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())

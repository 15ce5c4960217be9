"""Bulk ingestion on Ray (``memoryos-gpu ingest --ray``): Ray Data in front of shard actors.

Flow, per window of ``window`` records (so the driver never holds the whole input):

1. the driver streams the logs through the same readers as the single-process path
   (:func:`memoryos_gpu.formats.read_records`), numbers every record (``seq``: input order), and
   gives it a bucket ``shard_of(user, N * B)``; bucket ``b`` belongs to shard ``b mod N``,
   which is ``shard_of(user, N)`` (a hash mod ``N*B`` mod ``N`` is the hash mod ``N``);
2. the records become a Ray dataset, partitioned by that user hash
   (``groupby("bucket").map_groups``: Ray Data's way to hand a function whole groups) onto a
   pool of writer actors (:class:`_BucketWriter`). A writer sorts its bucket by ``seq`` and sends
   it, in order and in ``batch_size`` chunks, to the bucket's shard actor. A bucket holds whole
   users, so a user's pages are applied in input order; buckets of one shard go in parallel;
3. a shard actor (:class:`ShardIngestActor`, one per shard, a GPU each when the cluster has
   them) owns the shard's engine: it validates each page with the engine's rules (a refused
   record is a reject, never a failed batch) and commits the chunk (``accept_many``); a chunk is
   acknowledged only after its commit.

After the last window, the derived work runs: the shards exchange the keyword statistics of the
pages they accepted, so every shard extracts keywords as one engine holding every page would
(each shard saves, with its statistics, through which page of every other shard they count:
a run stopped before its exchange, by Ctrl-C or a crash, leaves those marks behind, and the
next run sends the pages it committed as well), then each runs its pending work (chain,
mid-term placement, promotion) and the assistant facts go to their owner shards (see
:mod:`memoryos_gpu.distributed.sharding`). The result equals the single-process
``ingest --process defer`` followed by a flush of the same input, also when the run was
interrupted and run again (tests check).

Same report (``IngestReport``), rejects file and idempotence as the single-process path: every
record keeps its stable ``source``, so a re-run adds nothing. Same stop signals too, by the
same rule (SIGINT, SIGTERM, SIGHUP: :mod:`memoryos_gpu.stop_signals`, :class:`_Stop`): the
shard actors finish their chunks in flight, the run reports what it did and exits 128 + the
signal, and the re-run does the rest; only a second Ctrl-C aborts.

**Worker death.** Shard actors run with ``max_restarts=-1`` and ``max_task_retries=-1``: a dead
actor is restarted, reopens its shard from the store (everything acknowledged is there), and Ray
re-sends the chunk it was given. Pages committed before the death are recognised by their source
and counted once (as accepted by this run: their page id is above the run's starting watermark).
Writer actors are Ray Data's own (restarted the same way); a re-sent chunk is idempotent.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from datetime import UTC, tzinfo
from pathlib import Path
from typing import Any

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed.exchange import exchange_receipts, exchange_senders, sent_documents
from memoryos_gpu.distributed.layout import (
    ShardMap,
    check_layout,
    prepare_layout,
    shard_store,
)
from memoryos_gpu.distributed.ray_common import (
    BoxedError,
    ensure_ray,
    ray_error_cause,
    require_ray,
    shard_resources,
    unbox,
)
from memoryos_gpu.distributed.replicas import AssistantEntry, route_assistant_facts
from memoryos_gpu.distributed.shard_writers import check_shard_writers
from memoryos_gpu.formats import Reject
from memoryos_gpu.formats.timestamps import naive_zone
from memoryos_gpu.ingest import (
    DEFAULT_BATCH_SIZE,
    IngestReport,
    _generated_note,
    _peak_rss_mb,
    failure_kind,
    known_legacy_keys,
    read_files,
    record_refusal,
    resolve_formats,
    shard_of,
)
from memoryos_gpu.rejects import RejectRow, reason_kind, record_reject
from memoryos_gpu.stop_signals import StopSignals
from memoryos_gpu.store.errors import StoreFullError, StoreUnavailableError

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_WINDOW", "ShardIngestActor", "actor_name", "ingest_ray"]

UNSENT = "unsent"  # a row a stopped shard actor sent back undone
DEFAULT_WINDOW = 200_000  # records per Ray dataset (bounds the driver's memory)
BUCKETS_PER_SHARD = 4  # groups per shard: parallel writers per shard, smaller groups
_RAW_LIMIT = 2000


def actor_name(run: str, shard: int) -> str:
    """The Ray name of a run's shard actor (tests kill it by name)."""
    return f"memoryos-ingest-{run}-shard-{shard}"


# ============================================================================ shard actor
class ShardIngestActor:
    """Holds one shard's engine for an ingestion (a Ray actor: see :func:`_actor_class`).

    Derived work is held back (also when the actor restarts and reopens the store) until
    :meth:`process`, so it runs once, at the end, with the exchanged keyword statistics."""

    def __init__(self, config: dict[str, Any], shard: int, count: int) -> None:
        from memoryos_gpu.distributed.sharding import ShardEngine

        _quiet()
        self.batches = 0
        self._stopped = False
        self._engine: Any = None
        self._failed: BoxedError | None = None
        try:
            cfg = EngineConfig.model_validate({**config, "auto_process": False})
            self._engine = ShardEngine(cfg, shard=shard, count=count, hold_pending=True)
        except Exception as exc:
            # kept, not raised: Ray answers an exception in __init__ with the actor's death
            # (restarted forever under max_restarts=-1, crash dumps, an ActorDiedError that
            # has lost the exception); :meth:`info` hands it to the driver as itself
            self._failed = BoxedError.of(exc)

    @property
    def engine(self) -> Any:
        """The shard's engine; the error that kept it from opening, raised, when it did not."""
        if self._failed is not None:
            raise self._failed.exception()
        return self._engine

    def info(self) -> dict[str, Any] | BoxedError:
        """The shard's identity, or the open's error (the driver unboxes it)."""
        if self._failed is not None:
            return self._failed
        return {**self.engine.info(), "pid": os.getpid()}

    def page_watermark(self) -> int:
        return self.engine.page_watermark()

    def ingest(self, rows: list[dict[str, Any]], watermark: int) -> list[dict[str, Any]]:
        """Validate and commit one chunk (rows in input order); one outcome per row."""
        from memoryos_gpu.engine import InvalidInputError
        from memoryos_gpu.types import PageInput

        if self._stopped:
            return [_outcome(row, UNSENT) for row in rows]
        out: dict[int, dict[str, Any]] = {}
        valid: list[tuple[dict[str, Any], Any]] = []
        held = self._held_under_legacy_keys(rows)
        for row in rows:
            if row["seq"] in held:
                out[row["seq"]] = _outcome(row, "skipped")
                continue
            try:
                page = PageInput(**json.loads(row["page"]), meta=json.loads(row["meta"]))
                valid.append((row, self.engine.validate_page(page)))
            except InvalidInputError as exc:
                out[row["seq"]] = _outcome(row, "rejected", reason=str(exc))
        for row, res in self._accept(valid, InvalidInputError):
            if isinstance(res, str):
                out[row["seq"]] = _outcome(row, "rejected", reason=res)
            else:
                fresh = not res.duplicate or res.page_id > watermark
                out[row["seq"]] = _outcome(row, "accepted" if fresh else "skipped")
        self.batches += 1
        return [out[r["seq"]] for r in rows]

    def _held_under_legacy_keys(self, rows: list[dict[str, Any]]) -> set[int]:
        """The rows (by ``seq``) whose page the store holds under the key an earlier version
        gave it (:func:`~memoryos_gpu.ingest.known_legacy_keys`)."""
        known = known_legacy_keys(self.engine.store, (r.get("legacy_source") for r in rows))
        return {r["seq"] for r in rows if r.get("legacy_source") in known}

    def _accept(self, valid: list[tuple[dict, Any]], refused: type) -> list[tuple[dict, Any]]:
        """accept_many, splitting the chunk when the engine refuses one of its pages."""
        if not valid:
            return []
        try:
            res = self.engine.accept_many([p for _, p in valid])
            return [(row, r) for (row, _), r in zip(valid, res, strict=True)]
        except refused as exc:
            if len(valid) == 1:  # the rest of the chunk is retried: this record's reason
                return [(valid[0][0], record_refusal(exc))]
            mid = len(valid) // 2
            return self._accept(valid[:mid], refused) + self._accept(valid[mid:], refused)

    def exchange_marks(self, tops: list[int]) -> list[int]:
        """:meth:`ShardEngine.exchange_marks`: through which page of each shard this shard's
        keyword statistics count (saved now as ``tops`` when an engine saved them last)."""
        return self.engine.exchange_marks(tops)

    def keyword_deltas(self, since: list[int]) -> dict[str, Any]:
        """:meth:`ShardEngine.keyword_deltas` (the driver exchanges after the last window:
        nothing is accepted meanwhile)."""
        return self.engine.keyword_deltas(since)

    def apply_exchange(self, delta: dict[str, Any], through: list[int]) -> None:
        """:meth:`ShardEngine.apply_exchange`: the statistics and their new marks, one write."""
        self.engine.apply_exchange(delta, through)

    def stop(self) -> None:
        """The run was asked to stop: the chunks in flight finish, later ones are sent back
        undone (``unsent``), so the driver's window ends at once."""
        self._stopped = True

    def process(self) -> dict[str, int]:
        """The derived work held back, run now, a round at a time until it is done or the run
        is stopped (:meth:`stop`: what is left stays pending for the next run, as the docs
        say of a stopped run; one call for all of it ran to the end whatever the signal);
        what it did, by kind. A failure of the store (a full disk) or of the LLM (down,
        failing every request) leaves the work pending, as without Ray, and is counted, not
        raised (``derived_disk_full`` / ``derived_store_failures`` /
        ``derived_llm_failures``): the pages are committed, and the run's report says the
        work stays pending (``derived_failure``, exit 1)."""
        from memoryos_gpu.llm.base import LLMBackendError
        from memoryos_gpu.store import StoreError, StoreFullError

        self.engine.release_pending()
        try:
            return dict(self.engine.process_pending(until=lambda: self._stopped))
        except (StoreError, LLMBackendError) as exc:
            log.warning("shard derived work failed; it stays pending: %s", exc)
            if isinstance(exc, LLMBackendError):
                return {"derived_llm_failures": 1}
            kind = (
                "derived_disk_full" if isinstance(exc, StoreFullError) else "derived_store_failures"
            )
            return {kind: 1}

    def take_assistant_facts(self) -> list[Any]:
        return self.engine.take_assistant_facts()

    def append_assistant_facts(self, facts: list[Any]) -> list[AssistantEntry]:
        return self.engine.append_assistant_facts(facts)

    def ack_assistant_facts(self, upto: int) -> int:
        return self.engine.ack_assistant_facts(upto)

    def replicate_assistant_entries(self, entries: list[AssistantEntry]) -> None:
        self.engine.replicate_assistant_entries(entries)

    def summary(self) -> dict[str, Any]:
        from memoryos_gpu.ingest import _llm_calls

        return {
            "store_counts": dict(self.engine.store.counts()),
            "pending": int(self.engine.pending_count()),
            "llm_calls": _llm_calls(self.engine),
            "users": len(self.engine.users()),
            "batches": self.batches,
        }

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


def _outcome(row: dict[str, Any], status: str, reason: str = "") -> dict[str, Any]:
    return {
        "seq": row["seq"],
        "status": status,
        "user_id": row["user_id"],
        "shard": row["shard"],
        "reason": reason,
        "file": row["file"],
        "line": row["line"],
        "source": row["source"],
        "raw": row["page"][:_RAW_LIMIT] if status == "rejected" else "",
        "generated_user": bool(row["generated_user"]),
    }


def _quiet() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# ============================================================================ bucket writers
class _BucketWriter:
    """A Ray Data pool worker: sends whole buckets (whole users), in input order, to their shard
    actor, and returns one outcome row per record."""

    def __init__(self, run: str, count: int, batch_size: int, watermarks: list[int]) -> None:
        self.run, self.count, self.batch_size = run, count, batch_size
        self.watermarks = watermarks
        self._actors: dict[int, Any] = {}

    def _actor(self, shard: int) -> Any:
        import ray

        if shard not in self._actors:
            self._actors[shard] = ray.get_actor(actor_name(self.run, shard))
        return self._actors[shard]

    def __call__(self, group: Any) -> Any:
        import pandas as pd
        import ray

        rows = group.sort_values("seq").to_dict("records")
        if not rows:
            return pd.DataFrame([])
        shard = int(rows[0]["shard"])
        out: list[dict[str, Any]] = []
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i : i + self.batch_size]
            out += ray.get(self._actor(shard).ingest.remote(chunk, self.watermarks[shard]))
        return pd.DataFrame(out)


# ============================================================================ the driver
def _actor_class(ray: Any) -> Any:
    return ray.remote(ShardIngestActor)


def _records(
    files: dict[str, str], shards: int, buckets: int, zone: tzinfo | None = UTC
) -> Iterator[dict[str, Any] | RejectRow]:
    """Every record (as a dataset row) and read-stage reject, in input order; timestamps
    written without a zone read in ``zone`` (``--timezone``)."""
    seq = 0
    for path, item, last in read_files(files):
        seq += 1
        if isinstance(item, Reject):
            yield RejectRow(item.path, item.line, item.reason, item.raw, "read")
            continue
        try:
            page = item.to_page(zone)
        except ValueError as exc:  # a wall time its zone moves past the year 9999 (or 1)
            yield record_reject(path, item, f"timestamp: {exc}")
            continue
        bucket = shard_of(item.user_id, shards * buckets)
        yield {
            "seq": seq,
            "file": path,
            "line": last,
            "user_id": item.user_id,
            "source": item.source,
            "legacy_source": item.legacy_source or "",
            # the user id was derived from the conversation: counted in ``generated_users``
            "generated_user": item.generated_user,
            "bucket": bucket,
            "shard": bucket % shards,
            "page": json.dumps(page, ensure_ascii=False),
            "meta": json.dumps(item.meta, ensure_ascii=False),
        }


def _windows(
    items: Iterable[dict[str, Any] | RejectRow], size: int
) -> Iterator[tuple[list[dict[str, Any]], list[RejectRow]]]:
    rows: list[dict[str, Any]] = []
    rejects: list[RejectRow] = []
    for item in items:
        if isinstance(item, RejectRow):
            rejects.append(item)
        else:
            rows.append(item)
        if len(rows) >= size:
            yield rows, rejects
            rows, rejects = [], []
    if rows or rejects:
        yield rows, rejects


class _Tally:
    """The report's running counts, per shard and in total."""

    def __init__(self, shards: int) -> None:
        self.per: list[Counter[str]] = [Counter() for _ in range(shards)]
        self.users: list[set[str]] = [set() for _ in range(shards)]
        self.generated: set[str] = set()  # the conv-... user ids of accepted or skipped pages
        self.rejects: list[tuple[int, RejectRow]] = []

    def add(self, outcomes: Iterable[dict[str, Any]]) -> None:
        for o in outcomes:
            if o["status"] == UNSENT:  # a stopped actor's: not read, as in the plain path
                continue
            shard = int(o["shard"])
            self.per[shard][o["status"]] += 1
            if o["status"] == "rejected":
                row = RejectRow(
                    o["file"], int(o["line"]), o["reason"], o["raw"], "validate", o["source"]
                )
                self.rejects.append((int(o["seq"]), row))
            else:
                self.users[shard].add(o["user_id"])
                if o["generated_user"]:
                    self.generated.add(o["user_id"])

    def total(self, status: str) -> int:
        return sum(c[status] for c in self.per)


def ingest_ray(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    config: EngineConfig,
    shards: int,
    *,
    fmt: str = "auto",
    batch_size: int = DEFAULT_BATCH_SIZE,
    timezone: str = "UTC",
    rejects_path: str | os.PathLike[str] | None = None,
    window: int = DEFAULT_WINDOW,
    writers: int | None = None,
    shard_cpus: float | None = None,
    shard_gpus: float | None = None,
    address: str | None = None,
    num_cpus: int | None = None,
    run_id: str | None = None,
    on_window: Callable[[int, IngestReport], None] | None = None,
) -> dict[str, Any]:
    """Ingest chat logs over ``shards`` shard actors on Ray; returns the report as a dict
    (``IngestReport`` fields plus ``shards``: one summary per shard, and ``ray``).

    ``config.store``: a directory (``STORE/shard-I`` per shard, as ``ingest --workers``) or a
    PostgreSQL URL. ``window``: records per Ray dataset. ``writers``: writer actors (default:
    one per shard). ``shard_cpus`` / ``shard_gpus``: what each shard actor reserves (default: a
    GPU each when the cluster has one per shard). ``address``: a Ray cluster to join (default:
    $RAY_ADDRESS, else a local Ray with ``num_cpus``). ``on_window``: called after each window.
    ``timezone``: the zone of timestamps written without one, as :func:`memoryos_gpu.ingest.ingest`
    takes it.

    Everything that can be refused without Ray is refused before Ray starts (~15 s): the
    arguments, the store layout (:func:`check_layout`) and a shard held by another writer
    (:func:`check_shard_writers`). An error a shard actor raises comes out as itself (e.g. a
    StoreLockedError), not as Ray's wrapper (:func:`ray_error_cause`). Called from the main
    thread, SIGINT, SIGTERM and SIGHUP stop the run with its report (:class:`_Stop`).
    """
    require_ray("data")
    path_list = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if batch_size < 1 or window < 1:
        raise ValueError("batch_size and window must be >= 1")
    zone = naive_zone(timezone)
    files = resolve_formats(path_list, fmt)
    if config.store == ":memory:":
        raise ValueError("ingest --ray needs a durable store: --store DIR or a PostgreSQL URL")
    check_layout(config.store, shards)
    check_shard_writers(config.store, shards)
    report = IngestReport(
        batch_size=batch_size,
        files=list(files),
        formats=dict(files),
        store=config.store,
        rejects_path=os.fspath(rejects_path) if rejects_path is not None else None,
    )
    stop = _Stop()
    try:
        stop.install()
        ray = ensure_ray(address, num_cpus)
        stop.install()  # again: ray.init gives the driver its own SIGTERM handler (exit 15)
        prepare_layout(config.store, shards)
        run = _Run(ray, run_id or uuid.uuid4().hex[:8], shards, batch_size, writers, stop, zone)
        try:
            out = _ingest(run, config, files, report, shard_cpus, shard_gpus, window, on_window)
        except ray.exceptions.RayError as exc:
            raise ray_error_cause(exc) from exc
    finally:
        stop.restore()
    _write_rejects(report, run.tally, rejects_path)
    if report.generated_users:  # the single-process path's one line
        print(_generated_note(report.generated_users), file=sys.stderr, flush=True)
    return out


class _Stop(StopSignals):
    """The driver's stop signals (:class:`~memoryos_gpu.stop_signals.StopSignals`: SIGINT,
    SIGTERM, SIGHUP; the first stops gracefully, a second Ctrl-C aborts, a repeated SIGTERM
    or SIGHUP changes nothing), as in the single-process path. The first one asks the shard
    actors to finish their chunk in flight and send the rest back undone, and the run ends
    with its report (``interrupted``, exit 128 + the signal), leaving the derived work to the
    next run. Installed in the driver only (signals reach the main thread alone), and again
    after ``ray.init``: without it Ray's own SIGTERM handler exits 15 with a stack dump, and
    SIGHUP kills the driver while the actors go on writing."""

    def __init__(self) -> None:
        super().__init__(self._stopping)
        self._actors: list[Any] = []

    def attach(self, actors: list[Any]) -> None:
        """The shard actors to stop (at once when the stop came first)."""
        self._actors = actors
        if self.stopped:
            self._stop_actors()

    def _stopping(self, signum: int) -> None:
        print(
            self.notice("finishing the chunks in flight, then stopping"),
            file=sys.stderr,
            flush=True,
        )
        # not from the handler itself: it interrupts the main thread inside Ray's own calls
        threading.Thread(target=self._stop_actors, name="ingest-stop", daemon=True).start()

    def _stop_actors(self) -> None:
        for a in self._actors:
            a.stop.remote()


class _Run:
    """One ``ingest_ray`` call's Ray handles and running state."""

    def __init__(
        self,
        ray: Any,
        name: str,
        shards: int,
        batch_size: int,
        writers: int | None,
        stop: _Stop,
        zone: tzinfo | None = UTC,
    ) -> None:
        self.ray, self.name, self.shards = ray, name, shards
        self.batch_size, self.writers = batch_size, writers
        self.zone = zone  # of timestamps written without one (ingest --timezone)
        self.stop = stop
        self.tally = _Tally(shards)
        self.timings: Counter[str] = Counter()


def _ingest(
    run: _Run,
    config: EngineConfig,
    files: dict[str, str],
    report: IngestReport,
    shard_cpus: float | None,
    shard_gpus: float | None,
    window: int,
    on_window: Callable[[int, IngestReport], None] | None,
) -> dict[str, Any]:
    """Start the shard actors, accept every window, derive; the actors go however it ends.
    A stopped run (:class:`_Stop`) accepts no further window and derives nothing (after a
    keyword exchange in flight, it stops before the derived work), and its actors are not
    closed: closing saves keyword statistics without exchange marks, as after an exchange,
    and the next run would then not send the pages this one committed."""
    ray, shards, tally, stop = run.ray, run.shards, run.tally, run.stop
    t0 = time.perf_counter()
    res = shard_resources(shards, cpus=shard_cpus, gpus=shard_gpus)
    actors = _start_actors(ray, config, shards, run.name, res)
    stop.attach(actors)
    derived: dict[str, Any] | None = None
    try:
        tops = ray.get([a.page_watermark.remote() for a in actors])
        marks = ray.get([a.exchange_marks.remote(tops) for a in actors])
        t1 = time.perf_counter()
        records = _records(files, shards, BUCKETS_PER_SHARD, run.zone)
        try:
            for n, (rows, rejects) in enumerate(_windows(records, window)):
                if stop.stopped:
                    break
                tally.rejects += [(0, r) for r in rejects]  # read-stage rejects
                if rows:
                    tally.add(
                        _run_window(ray, rows, run.name, shards, run.batch_size, tops, run.writers)
                    )
                _fill(report, tally, t0)
                if on_window is not None:
                    on_window(n, report)
        except ray.exceptions.RayError as exc:
            if not store_ended(report, ray_error_cause(exc)):
                raise
        ended = bool(report.store_full or report.store_unavailable)
        run.timings["accept"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        if not (stop.stopped or ended):
            derived = _derive(ray, actors, marks, shards, stop)
        run.timings["derive"] = time.perf_counter() - t1
        summaries = _summaries(ray, actors, ended)
        if derived is not None:
            ray.get([a.close.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a)
    _fill(report, tally, t0)
    report.interrupted = stop.stopped
    report.stop_signal = stop.signum
    return _report(report, run, config.store, summaries, res, derived or {})


def store_ended(report: IngestReport, exc: BaseException) -> bool:
    """Whether a shard actor's error (``exc``, unwrapped from Ray's) is the store's full disk
    or its outage, which end the run with its report as they end a single process's
    ingestion (``store_full`` / ``store_unavailable``, exit 1: the CLI's line says what was
    committed and that a rerun resumes): noted in ``report``. Any other error is raised.
    ``accepted`` counts the windows that completed; the pages the failing window committed
    before the failure are in the store, and a rerun skips them."""
    if isinstance(exc, StoreFullError):
        report.store_full = str(exc)
    elif isinstance(exc, StoreUnavailableError):
        report.store_unavailable = str(exc)
    else:
        return False
    return True


#: A shard's summary when its store could not be read after the run ended on it.
_NO_SUMMARY: dict[str, Any] = {
    "store_counts": {},
    "pending": 0,
    "llm_calls": 0,
    "users": 0,
    "batches": 0,
}


def _summaries(ray: Any, actors: list[Any], ended: bool) -> list[dict[str, Any]]:
    """Each shard's summary; after a run the store ended (``ended``), a shard whose store
    cannot be read (down) gives :data:`_NO_SUMMARY` rather than losing the run's report."""
    if not ended:
        return list(ray.get([a.summary.remote() for a in actors]))
    out = []
    for a in actors:
        try:
            out.append(ray.get(a.summary.remote()))
        except ray.exceptions.RayError:
            out.append(dict(_NO_SUMMARY))
    return out


def _report(
    report: IngestReport,
    run: _Run,
    store: str,
    summaries: list[dict[str, Any]],
    res: Any,
    derived: dict[str, Any],
) -> dict[str, Any]:
    tally, shards = run.tally, run.shards
    report.batches = sum(s["batches"] for s in summaries)
    report.llm_calls = sum(s["llm_calls"] for s in summaries)
    report.pending = sum(s["pending"] for s in summaries)
    report.store_counts = _sum_counts(store, summaries)
    report.timings = {k: round(v, 4) for k, v in run.timings.items()}
    report.peak_rss_mb = round(_peak_rss_mb(), 1)
    report.derived_failure = derived_failure_of(derived)
    out = report.to_dict()
    out["shards"] = [
        {
            "shard": f"{i}/{shards}",
            "accepted": tally.per[i]["accepted"],
            "skipped": tally.per[i]["skipped"],
            "rejected": tally.per[i]["rejected"],
            "users": len(tally.users[i]),
            "pages_per_s": tally.per[i]["accepted"] / report.elapsed_s if report.elapsed_s else 0,
            "store": shard_store(store, i, shards),
            "exit_code": 0,
            **summaries[i],
        }
        for i in range(shards)
    ]
    out["ray"] = {
        "run": run.name,
        "shards": shards,
        "shard_gpus": res.gpus,
        "shard_cpus": res.cpus,
        "derived": derived,
    }
    return out


def derived_failure_of(derived: dict[str, Any]) -> str | None:
    """The report's ``derived_failure`` from the shards' derived-work counts (their
    :meth:`ShardIngestActor.process`), as a single process's ingestion names it."""
    return failure_kind(derived)


def _start_actors(ray: Any, config: EngineConfig, shards: int, run: str, res: Any) -> list[Any]:
    """One actor per shard, each with its store open; an actor's open error is raised here as
    itself (the actors are killed first)."""
    cls = _actor_class(ray)
    actors = [
        cls.options(
            name=actor_name(run, i),
            max_restarts=-1,
            max_task_retries=-1,
            max_concurrency=4,  # status calls answer while a chunk commits (engine-locked)
            **res.options(),
        ).remote(
            config.model_copy(update={"store": shard_store(config.store, i, shards)}).model_dump(),
            i,
            shards,
        )
        for i in range(shards)
    ]
    try:
        for info in ray.get([a.info.remote() for a in actors]):
            unbox(info)  # fail early when a store cannot be opened
    except BaseException:
        for a in actors:
            ray.kill(a)
        raise
    return actors


def _run_window(
    ray: Any,
    rows: list[dict[str, Any]],
    run: str,
    shards: int,
    batch_size: int,
    watermarks: list[int],
    writers: int | None,
) -> list[dict[str, Any]]:
    import ray.data as rd

    buckets = len({r["bucket"] for r in rows})
    blocks = max(1, min(shards * 2, len(rows) // 1000 + 1))
    ds = rd.from_items(rows, override_num_blocks=blocks)
    # the sort-based shuffle: plain tasks. The hash shuffle's aggregator actors reserve memory
    # and CPUs that a small cluster busy with shard actors may never grant (measured: stuck)
    ds.context.shuffle_strategy = rd.context.ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    pool = max(1, min(writers or shards, buckets, blocks))  # one group block per writer task
    out = ds.groupby("bucket", num_partitions=max(1, min(buckets, shards * 2))).map_groups(
        _BucketWriter,
        batch_format="pandas",
        compute=rd.ActorPoolStrategy(size=pool),
        fn_constructor_args=(run, shards, batch_size, watermarks),
        num_cpus=0.1,  # writers wait on shard actors; they must not starve the shuffle
    )
    return list(out.iter_rows())


def _derive(
    ray: Any, actors: list[Any], marks: list[list[int]], shards: int, stop: _Stop
) -> dict[str, Any] | None:
    """Keyword exchange, each shard's derived work, assistant facts to their owners; None
    when a stop came during the exchange (the work stays pending for the next run)."""
    docs = _exchange_keywords(ray, actors, marks)
    if stop.stopped:
        return None
    done: Counter[str] = Counter()
    for d in ray.get([a.process.remote() for a in actors]):
        done.update(d)
    facts = [f for part in ray.get([a.take_assistant_facts.remote() for a in actors]) for f in part]
    written = route_assistant_facts(
        facts,
        ShardMap(shards),
        lambda s, f: ray.get(actors[s].append_assistant_facts.remote(f)),
        lambda s, e: ray.get(actors[s].replicate_assistant_entries.remote(e)),
        lambda s, upto: ray.get(actors[s].ack_assistant_facts.remote(upto)),
    )
    return {"keyword_docs_exchanged": docs, **done, "assistant_facts": written}


def _exchange_keywords(ray: Any, actors: list[Any], marks: list[list[int]]) -> int:
    """Give every shard the keyword statistics of the other shards' pages it has not counted
    yet: receiver ``j`` gets shard ``i``'s pages above ``marks[j][i]`` (saved with its
    statistics, :meth:`ShardEngine.exchange_marks`), so pages committed by an earlier run
    that stopped before its exchange are counted too, and none twice. Returns the documents
    sent (each shard's pages above its lowest mark)."""
    since = exchange_senders(marks)
    sent = ray.get([a.keyword_deltas.remote(since[i]) for i, a in enumerate(actors)])
    through = [int(part["top"]) for part in sent]
    receipts = exchange_receipts(marks, sent)
    ray.get([a.apply_exchange.remote(receipts[j], through) for j, a in enumerate(actors)])
    return sent_documents(marks, sent)


def _fill(report: IngestReport, tally: _Tally, t0: float) -> None:
    report.accepted = tally.total("accepted")
    report.skipped = tally.total("skipped")
    report.rejected = len(tally.rejects)
    report.records = report.accepted + report.skipped
    report.users = len(set().union(*tally.users))
    report.generated_users = len(tally.generated)
    report.elapsed_s = time.perf_counter() - t0
    report.pages_per_s = report.accepted / report.elapsed_s if report.elapsed_s else 0.0
    reasons = Counter(reason_kind(r.reason) for _, r in tally.rejects)
    report.reject_reasons = dict(reasons.most_common())


def _write_rejects(
    report: IngestReport, tally: _Tally, rejects_path: str | os.PathLike[str] | None
) -> None:
    if rejects_path is None:
        return
    Path(rejects_path).parent.mkdir(parents=True, exist_ok=True)
    order = sorted(tally.rejects, key=lambda sr: (report.files.index(sr[1].file), sr[1].line))
    with open(rejects_path, "w", encoding="utf-8") as f:
        for _, row in order:
            f.write(json.dumps(asdict(row), ensure_ascii=False) + "\n")


def _sum_counts(store: str, summaries: list[dict[str, Any]]) -> dict[str, int]:
    if "://" in store:  # one shared store: every shard reports the same totals
        return dict(summaries[0]["store_counts"]) if summaries else {}
    total: Counter[str] = Counter()
    for s in summaries:
        total.update(s["store_counts"])
    return dict(total)

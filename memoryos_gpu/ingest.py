"""Offline bulk ingestion: chat logs -> a MemoryOS store, streamed, batched and resumable.

:func:`ingest` is the library form of ``memoryos-gpu ingest`` (the CLI and the benchmarks call
it). Three stages run concurrently, connected by bounded queues so memory stays flat whatever
the input size (but for the 16-32 bytes a page that number identical pages of a file,
:class:`~memoryos_gpu.formats.PageCounter`):

1. **reader** thread: :func:`memoryos_gpu.formats.read_records` streams every file in order
   (one user's records therefore stay in file order), drops the records of other shards;
2. **prepare** thread: turns records into :class:`~memoryos_gpu.types.PageInput`, validates each
   one with the engine's own rules (a refused record becomes a reject, never a failed batch),
   groups them into batches of ``batch_size`` pages *across users*, and - when the embedder
   caches - embeds the pages of the next batch ahead of time (``prefetch``), so the embedding
   of batch *k+1* overlaps the store writes, kernels and LLM stages of batch *k*;
3. **main** thread: ``engine.add_many(batch)`` (pages committed to the store before it returns;
   a page whose ``source`` was accepted before is skipped), then the derived work (chain, MTM,
   promotion: the engine's LLM stages, batched across the users of the batch).

Idempotent: every record carries a stable ``source`` key made from its content (not from its
file or line: :func:`memoryos_gpu.formats.page_source`), so re-running the same input adds
nothing twice - also after lines were removed or added, or the file was renamed, moved or
compressed - and an interrupted run resumes where it stopped. Pages stored by versions whose
keys named the line are recognised by that key too (:func:`_held_under_legacy_keys`). A stop
request (``stop_event``, or SIGINT, SIGTERM or SIGHUP with ``handle_sigint=True``) finishes the
batch in flight, then returns a report with ``interrupted=True``; what was accepted is committed.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import queue
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import tzinfo
from pathlib import Path
from typing import IO, Any, Literal

from memoryos_gpu.formats import (
    FORMATS,
    FormatError,
    Record,
    Reject,
    detect_format,
    open_binary,
    read_records,
)
from memoryos_gpu.formats.opening import CorruptInputError, is_stream, open_head
from memoryos_gpu.formats.readers import LongLine, iter_capped_lines
from memoryos_gpu.formats.timestamps import naive_zone
from memoryos_gpu.rejects import RejectRow, reason_kind, record_reject, refuse_rejects_path
from memoryos_gpu.stop_signals import StopSignals
from memoryos_gpu.store import is_url
from memoryos_gpu.store.errors import StoreError, StoreFullError, StoreUnavailableError

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "EXIT_DERIVED_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_STORE_UNAVAILABLE",
    "IngestReport",
    "Shard",
    "ingest",
    "record_refusal",
    "resolve_formats",
    "shard_of",
]

DEFAULT_BATCH_SIZE = 512
EXIT_OK, EXIT_REJECTED, EXIT_INTERRUPTED = 0, 3, 130
#: The run's derived work failed for the store (a full disk) and stays pending: as the CLI's
#: runtime error.
EXIT_DERIVED_FAILED = 1
#: The store became unavailable (PostgreSQL down or unreachable) during the run: the run ended
#: there, with its report; what was committed before stays, a run again resumes after it.
EXIT_STORE_UNAVAILABLE = 1
_READ_CHUNK = 256  # records per reader -> prepare hand-off
_PREFETCH_CHUNK = 64  # texts per embedder call when embedding ahead (keeps its lock short)
_POLL_S = 0.2


# ============================================================================ sharding
def read_files(files: dict[str, str]) -> Iterator[tuple[str, Record | Reject, int]]:
    """``(path, record or read-stage reject, line)`` for every item of ``files`` (path ->
    format), in input order. A corrupt or truncated gzip file is refused as a whole, before
    any of its records is read (:func:`~memoryos_gpu.formats.opening.check_integrity`): one
    reject at line 0 (the file), and reading goes on with the next file. A pipe cannot be
    checked ahead (it is read once): one that cannot be read further (a corrupt gzip stream)
    ends in one reject where it breaks, and what was read before is kept. The one reading
    loop of every ingestion path."""
    for path, fmt in files.items():
        if fmt == "empty":
            continue
        last = 0
        try:
            items = read_records(path, fmt)
        except CorruptInputError as exc:
            yield path, Reject(path, 0, str(exc), ""), 0
            continue
        while True:
            try:
                item = next(items, None)
            except (OSError, EOFError, zlib.error) as exc:
                item = Reject(path, last + 1, _unreadable(path, exc), "")
                items = iter(())
            if item is None:
                break
            last = item.line
            yield path, item, last


def record_refusal(exc: BaseException) -> str:
    """The reject reason of a page the engine refused in a batch: the page's own reason and
    "this record was not stored". Why: ingestion retries a refused batch without the refused
    page (the rest of it is stored), so the engine's word for the batch it was given
    (:class:`~memoryos_gpu.engine.validation.PageRefusedError`) is wrong for the ingestion's
    batch; any other refusal is the record's own already."""
    from memoryos_gpu.engine.validation import PageRefusedError

    if isinstance(exc, PageRefusedError):
        return f"{exc.reason} (this record was not stored)"
    return str(exc)


def _unreadable(path: str, exc: BaseException) -> str:
    """The reason of an input that could not be read further. A gzip pipe's says that its
    records before the break were read: a pipe is not checked ahead (it is read once)."""
    reason = f"cannot read further: {exc}"
    if is_stream(path) and isinstance(exc, EOFError | zlib.error | gzip.BadGzipFile):
        reason += (
            " (a corrupt or truncated gzip pipe: a pipe cannot be checked before it is read, so "
            "its records before this point were read; give the file itself to have a corrupt "
            "file refused as a whole)"
        )
    return reason


def shard_of(key: str, count: int) -> int:
    """The shard (``0 .. count-1``) of ``key``: blake2b-64 of its UTF-8 bytes, mod ``count``.

    Stable across processes, hosts and Python versions (unlike ``hash()``).
    """
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: the users whose :func:`shard_of` is ``index``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: need 0 <= I < N and N >= 1")

    @classmethod
    def parse(cls, spec: str | Shard | tuple[int, int]) -> Shard:
        """``"I/N"`` (0-based I), a ``(I, N)`` tuple or a :class:`Shard`."""
        if isinstance(spec, Shard):
            return spec
        if isinstance(spec, tuple):
            return cls(int(spec[0]), int(spec[1]))
        try:
            i, n = (int(x) for x in str(spec).split("/"))
        except ValueError:
            raise ValueError(f"shard {spec!r}: expected I/N, e.g. 0/4 (I from 0 to N-1)") from None
        return cls(i, n)

    def owns(self, key: str) -> bool:
        return shard_of(key, self.count) == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


# ============================================================================ report
@dataclass
class IngestReport:
    """What one ingestion did. ``pages_per_s`` = accepted pages / ``elapsed_s``."""

    accepted: int = 0  # pages added to the store by this run
    rejected: int = 0  # input items refused (bad line, bad record, engine validation)
    skipped: int = 0  # pages already in the store (their source was accepted before)
    users: int = 0  # distinct users among this run's accepted + skipped pages
    # conversations that named no user (no user_id, no id): their user id was derived from the
    # conversation's content (``conv-...``, docs/formats.md); counted once per id
    generated_users: int = 0
    pages_per_s: float = 0.0
    records: int = 0  # records read for this shard (accepted + skipped + engine-refused)
    other_shards: int = 0  # records left to other shards
    elapsed_s: float = 0.0
    interrupted: bool = False
    llm_calls: int = 0  # LLM requests since the run opened its engine (resumed work included)
    pending: int = 0  # derived work still queued in the store at the end
    batches: int = 0
    batch_size: int = DEFAULT_BATCH_SIZE
    files: list[str] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)
    shard: str | None = None
    store: str | None = None
    rejects_path: str | None = None
    rejects_raw: bool = True  # the rejects file holds each record's content (False: where, why)
    reject_reasons: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    store_counts: dict[str, int] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    stop_signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM, SIGHUP)
    # why this run's derived work failed and stayed pending (``pending`` > 0): "disk_full" (the
    # store's disk is full), "store_error" (another store failure), "llm_unavailable" (the LLM
    # server down, failing every request or its breaker open), else None. The pages are
    # committed; the work resumes when the store is next opened once the cause is gone.
    derived_failure: str | None = None
    # why the run ended before its input did because the store could not be reached (the
    # server down or restarting, a network cut: StoreUnavailableError's words), else None.
    # ``accepted`` counts what was committed before; the batch in flight was not. Running the
    # same command again once the store answers resumes after what was committed.
    store_unavailable: str | None = None
    # why the run ended before its input did because the store's disk is full (StoreFullError's
    # words), else None; as for ``store_unavailable``, ``accepted`` counts what was committed
    # and running the same command again once there is room resumes after it.
    store_full: str | None = None

    @property
    def exit_code(self) -> int:
        """128 + the stopping signal when interrupted (130 for Ctrl-C or a ``stop_event``, 143
        SIGTERM, 129 SIGHUP), else 1 when derived work failed (the store, or an LLM that could
        not be used) and stays pending (:attr:`derived_failure`) or the store became
        unavailable (:attr:`store_unavailable`) or its disk full (:attr:`store_full`), else 3
        when anything was rejected, else 0."""
        if self.interrupted:
            return 128 + self.stop_signal if self.stop_signal else EXIT_INTERRUPTED
        if self.store_unavailable or self.store_full:
            return EXIT_STORE_UNAVAILABLE
        if self.derived_failure:
            return EXIT_DERIVED_FAILED
        return EXIT_REJECTED if self.rejected else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["exit_code"] = self.exit_code
        return out


# ============================================================================ helpers


def _blank(path: str | os.PathLike[str]) -> bool:
    """Whether the input holds nothing but whitespace (and a BOM). A pipe is judged from its
    read-ahead (:func:`~memoryos_gpu.formats.opening.open_head`): it can be read only once."""
    try:
        f, complete = open_head(path)
    except CorruptInputError:
        return False  # a corrupt gzip pipe: not blank; detection or the reader reports it
    with f:
        while True:
            try:
                chunk = f.read(1 << 12)
            except (EOFError, zlib.error, OSError):
                return False  # corrupt: not blank; the reader reports where it breaks
            if not chunk:
                return complete  # blank so far; more of a pipe may follow
            if chunk.replace(b"\xef\xbb\xbf", b"").strip():
                return False


def resolve_formats(paths: Sequence[str | os.PathLike[str]], fmt: str = "auto") -> dict[str, str]:
    """``{path: format}``; ``"empty"`` for blank inputs. Raises :class:`FormatError` (with the
    path and a hint) when a format cannot be detected or ``fmt`` is unknown, and
    ``FileNotFoundError`` / ``IsADirectoryError`` for missing inputs - before anything is read.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise FormatError(f"unknown format {fmt!r}; expected 'auto' or one of {', '.join(FORMATS)}")
    out: dict[str, str] = {}
    streams: set[tuple[int, int]] = set()
    for p in paths:
        sp = os.fspath(p)
        if not os.path.exists(sp):
            raise FileNotFoundError(f"no such file: {sp}")
        if os.path.isdir(sp):
            raise IsADirectoryError(f"{sp} is a directory; give the chat-log files")
        if is_stream(sp):
            st = os.stat(sp)
            if (st.st_dev, st.st_ino) in streams:
                raise FormatError(f"{sp} is a pipe given twice: a pipe can be read only once")
            streams.add((st.st_dev, st.st_ino))
        if _blank(sp):
            out[sp] = "empty"
        elif fmt == "auto":
            try:
                out[sp] = detect_format(sp)
            except CorruptInputError as exc:  # a gzip pipe whose read-ahead is corrupt
                raise FormatError(f"cannot detect the format of {sp!r}: {exc}") from None
            except (EOFError, zlib.error, OSError) as exc:
                # damaged where the format is sniffed: as any input whose format is unknown,
                # the run is refused before anything is read
                gz = isinstance(exc, EOFError | zlib.error | gzip.BadGzipFile)
                why = f"corrupt gzip {'pipe' if is_stream(sp) else 'file'}" if gz else "unreadable"
                raise FormatError(f"cannot detect the format of {sp!r}: {why} ({exc})") from None
        else:
            out[sp] = fmt
    return out


_COUNT_LINE_BYTES = 1 << 16  # the counting pass holds at most this much of a line


def _count_records(files: dict[str, str]) -> int | None:
    """Records in the inputs when knowable cheaply: JSONL pages are one per non-blank line
    (a line too long for the reader counts too: it is one reject). None for other formats and
    for pipes, which the reader alone may read (no ETA for a pipe)."""
    total = 0
    for path, fmt in files.items():
        if fmt == "empty":
            continue
        if fmt != "jsonl" or is_stream(path):
            return None
        with open_binary(path) as f:
            n = 0
            for item in iter_capped_lines(f, _COUNT_LINE_BYTES):
                line = item.prefix if isinstance(item, LongLine) else item
                stripped = line.strip()
                if not stripped:
                    continue
                if n == 0 and stripped.lstrip(b"\xef\xbb\xbf").startswith(b"["):
                    return None  # a JSON array of pages: unknown without parsing
                n += 1
            total += n
    return total


def _peak_rss_mb() -> float:
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb / 1024.0 if sys.platform != "darwin" else kb / 2**20
    except (ImportError, OSError):  # pragma: no cover - non-POSIX
        return 0.0


#: the engine's counters of failed derived work (``MemoryEngine._process_owed``), most telling
#: first, and the report's name for each (:attr:`IngestReport.derived_failure`)
_FAILURE_KINDS = {
    "derived_disk_full": "disk_full",
    "derived_store_failures": "store_error",
    "derived_llm_failures": "llm_unavailable",
}


def _failure_counts(engine: Any) -> dict[str, int]:
    """The engine's counts of derived work the store or the LLM failed."""
    with contextlib.suppress(Exception):
        c = dict(engine.counters)
        return {k: int(c.get(k, 0)) for k in _FAILURE_KINDS}
    return {}


def _derived_failure(engine: Any, before: dict[str, int]) -> str | None:
    """``"disk_full"`` / ``"store_error"`` / ``"llm_unavailable"`` when derived work failed
    for the store or the LLM since ``before`` (this run: its engine's open included), else
    None: the work stays pending, and a run that exited 0 would read as done."""
    return failure_kind(_failure_counts(engine), before)


def failure_kind(now: Mapping[str, int], before: Mapping[str, int] | None = None) -> str | None:
    """The report's name for the most telling failure counter (``_FAILURE_KINDS``) that rose
    from ``before`` (none: from 0) to ``now``; one rule for a single process and the
    ``--ray`` shards' counts."""
    before = before or {}
    for counter, kind in _FAILURE_KINDS.items():
        if now.get(counter, 0) > before.get(counter, 0):
            return kind
    return None


def _llm_calls(engine: Any) -> int:
    stats = getattr(getattr(engine, "stages", None), "stats", None)
    if stats is None:
        return 0
    try:
        return int(stats.as_dict().get("llm_calls", 0))
    except Exception:  # pragma: no cover - defensive: statistics never fail an ingestion
        return 0


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


@dataclass
class _Item:
    path: str
    line: int
    record: Record
    page: Any  # PageInput


@dataclass(frozen=True)
class _Held:
    """What ``add_many`` would answer for a page the store holds under its legacy key."""

    duplicate: bool = True


def known_legacy_keys(store: Any, keys: Iterable[str | None]) -> set[str]:
    """Those of ``keys`` (the keys earlier versions gave records:
    :attr:`~memoryos_gpu.formats.Record.legacy_source`, position-based; None for none) under
    which the store holds a page. Such a page is counted as skipped, not added again: a store
    filled before the keys became position-free is not filled twice by a re-run of the same
    input. Stores filled since hold no such keys: one indexed lookup a batch, finding none.
    Every ingestion path asks this (one process, ``--workers``' shards, ``--ray``'s actors)."""
    olds = [k for k in keys if k]
    return set(store.known_sources(olds)) if olds else set()


def _held_under_legacy_keys(
    store: Any, items: list[_Item]
) -> tuple[list[_Item], list[tuple[_Item, _Held]]]:
    """``(to add, held)``: the batch split by :func:`known_legacy_keys`."""
    known = known_legacy_keys(store, (i.record.legacy_source for i in items))
    if not known:
        return items, []
    fresh = [i for i in items if i.record.legacy_source not in known]
    return fresh, [(i, _Held()) for i in items if i.record.legacy_source in known]


def _generated_note(count: int) -> str:
    """The one stderr line saying how many conversations got a generated user id."""
    what = "conversation" if count == 1 else "conversations"
    return (
        f"{count} {what} named no user (no user_id or id) and got a generated user id "
        "conv-<hash of the conversation>, the same wherever it is read (docs/formats.md)"
    )


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Blocking put that gives up when ``stop`` is set (returns False then)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _get(q: queue.Queue, stop: threading.Event | None = None) -> Any:
    while True:
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            if stop is not None and stop.is_set():
                return None


# ============================================================================ the pipeline
class _Pipeline:
    def __init__(
        self,
        engine: Any,
        files: dict[str, str],
        *,
        batch_size: int,
        shard: Shard | None,
        prefetch: bool,
        stop: threading.Event,
        queue_batches: int,
        zone: tzinfo | None,
    ) -> None:
        from memoryos_gpu.engine import InvalidInputError
        from memoryos_gpu.types import PageInput

        self.engine = engine
        self.files = files
        self.batch_size = batch_size
        self.shard = shard
        self.prefetch = prefetch
        self.zone = zone  # timestamps without a zone are read in it (None: local time)
        self.stop = stop  # set: stop reading; the main loop finishes its batch
        self.halt = threading.Event()  # set: worker threads exit now
        self.records_q: queue.Queue = queue.Queue(maxsize=8)
        self.batches_q: queue.Queue = queue.Queue(maxsize=max(1, queue_batches))
        self.InvalidInputError = InvalidInputError
        self.PageInput = PageInput
        self.validate: Callable[[Any], Any] = engine.validate_page
        self.page_text: Callable[[Any], str] = engine.page_text
        self.other_shards = 0
        self.timings = Counter()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ threads
    def start(self) -> None:
        for target, name in ((self._read, "ingest-reader"), (self._prepare, "ingest-prepare")):
            t = threading.Thread(target=self._guard(target), name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        self.halt.set()
        for t in self._threads:
            t.join(timeout=5)

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # forwarded to the main thread, raised there
                out = self.batches_q if fn == self._prepare else self.records_q
                _put(out, _Failure(exc), self.halt)

        return run

    def _read(self) -> None:
        t0 = time.perf_counter()
        stopping = self._stopping
        buf: list[tuple[str, Record | Reject]] = []
        for path, item, _line in read_files(self.files):
            if stopping():
                return
            if self.shard is not None:
                # a record belongs to its user's shard; a reject (no trusted user id) to
                # the shard of its position, so that exactly one shard reports it
                key = (
                    item.user_id
                    if isinstance(item, Record)
                    else f"{item.path}:{item.line}:{item.reason}"
                )
                if not self.shard.owns(key):
                    self.other_shards += isinstance(item, Record)
                    continue
            buf.append((path, item))
            if len(buf) >= _READ_CHUNK:
                self.timings["read"] += time.perf_counter() - t0
                if not _put(self.records_q, buf, self.halt):
                    return
                t0 = time.perf_counter()
                buf = []
        self.timings["read"] += time.perf_counter() - t0
        if buf:
            _put(self.records_q, buf, self.halt)
        _put(self.records_q, _END, self.halt)

    def _stopping(self) -> bool:
        return self.stop.is_set() or self.halt.is_set()

    def _prepare(self) -> None:
        batch: list[_Item] = []
        rejects: list[RejectRow] = []
        while True:
            chunk = _get(self.records_q, self.halt)
            if chunk is None:
                return
            if isinstance(chunk, _Failure):
                _put(self.batches_q, chunk, self.halt)
                return
            if chunk is _END:
                break
            t0 = time.perf_counter()
            for path, item in chunk:
                if isinstance(item, Reject):
                    rejects.append(RejectRow(item.path, item.line, item.reason, item.raw, "read"))
                    continue
                row = self._page(path, item)
                if isinstance(row, RejectRow):
                    rejects.append(row)
                else:
                    batch.append(row)
                if len(batch) >= self.batch_size:
                    self.timings["prepare"] += time.perf_counter() - t0
                    if not self._emit(batch, rejects):
                        return
                    batch, rejects = [], []
                    t0 = time.perf_counter()
            self.timings["prepare"] += time.perf_counter() - t0
            if len(rejects) >= self.batch_size and not batch:
                if not self._emit(batch, rejects):
                    return
                rejects = []
        if (batch or rejects) and not self._emit(batch, rejects):
            return
        _put(self.batches_q, _END, self.halt)

    def _page(self, path: str, rec: Record) -> _Item | RejectRow:
        line = rec.line
        try:
            fields = rec.to_page(self.zone)
        except ValueError as exc:  # a wall time its zone moves past the year 9999 (or 1)
            return record_reject(path, rec, f"timestamp: {exc}")
        page = self.PageInput(**fields, meta=dict(rec.meta))
        try:
            page = self.validate(page)
        except self.InvalidInputError as exc:
            return record_reject(path, rec, str(exc))
        return _Item(path, line, rec, page)

    def _emit(self, batch: list[_Item], rejects: list[RejectRow]) -> bool:
        if batch and self.prefetch and not self._stopping():
            self._embed_ahead(batch)
        return _put(self.batches_q, (batch, rejects), self.halt)

    def _embed_ahead(self, batch: list[_Item]) -> None:
        """Warm the embedder's cache with the batch's new pages (skipping known sources)."""
        t0 = time.perf_counter()
        try:
            keys = [k for i in batch for k in (i.page.source, i.record.legacy_source) if k]
            known = self.engine.store.known_sources(keys)
            texts = [
                self.page_text(i.page)
                for i in batch
                if i.page.source not in known and i.record.legacy_source not in known
            ]
            for j in range(0, len(texts), _PREFETCH_CHUNK):
                if self._stopping():
                    break
                self.engine.embedder.encode(texts[j : j + _PREFETCH_CHUNK])
        except Exception:  # a failed prefetch costs only time: add_many embeds for real
            pass
        self.timings["embed_ahead"] += time.perf_counter() - t0


def ingest(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    engine_or_config: Any = None,
    *,
    fmt: str = "auto",
    batch_size: int = DEFAULT_BATCH_SIZE,
    rejects_path: str | os.PathLike[str] | None = None,
    rejects_raw: bool = True,
    shard: Shard | str | tuple[int, int] | None = None,
    progress: bool = True,
    process: Literal["auto", "batch", "defer"] = "auto",
    prefetch: bool | None = None,
    stop_event: threading.Event | None = None,
    handle_sigint: bool = False,
    reject_log: IO[str] | None = None,
    reject_log_limit: int = 100,
    on_batch: Callable[[IngestReport], None] | None = None,
    queue_batches: int = 2,
    timezone: str = "UTC",
) -> IngestReport:
    """Ingest chat logs into an engine's store; return an :class:`IngestReport`.

    Parameters
    ----------
    paths:
        Input files (JSONL, LoCoMo, ShareGPT, OpenAI; gzip transparently), read in order. A
        corrupt or truncated gzip file is refused as a whole (one reject, at line 0; nothing
        of it is stored) and the next file is read: :func:`read_files`.
    engine_or_config:
        A :class:`~memoryos_gpu.engine.MemoryEngine` (used as is, not closed), an
        :class:`~memoryos_gpu.config.EngineConfig` (an engine is built and closed), or ``None``
        (default config: an in-memory store).
    fmt:
        ``"auto"`` (detected per file) or one of ``jsonl``, ``locomo``, ``sharegpt``,
        ``openai``, ``export`` (what ``memoryos-gpu export`` wrote) for every file.
    batch_size:
        Pages per ``add_many`` call, across users.
    rejects_path:
        JSONL file of rejected items (``file``, ``line``, ``reason``, ``raw``, ``stage``,
        ``source``); truncated at the start of the run, each row flushed as it is rejected
        (a killed run's file lists what it rejected). ``None``: not written. ``ValueError``,
        before anything is opened, for a directory, a file of the store (its database, log,
        lock, a shard's) or one of ``paths``: truncating it would erase it.
    rejects_raw:
        Whether each rejects-file row holds the record's content (``raw``). False: where
        (``file``, ``line``, ``source``) and why only; ``memoryos-gpu ingest`` passes it for
        its default rejects file of an encrypted store, which that plain-text file must not
        leak.
    shard:
        ``"I/N"``: only users with ``shard_of(user_id, N) == I`` (see :class:`Shard`).
    progress:
        A live progress display on stderr (rich).
    process:
        When the derived work (chain, MTM, promotion) runs. ``"auto"``: inside ``add_many``
        when the engine's ``auto_process`` is on, else after each batch; ``"batch"``: after
        each batch; ``"defer"``: not at all (left pending in the store; the next engine to open
        the store, or ``engine.flush()``, runs it). A deferred run on its own engine does not
        run the work an earlier run left pending either (it opens with ``hold_pending``).
    prefetch:
        Embed the next batch's pages (warming the embedder's cache) while the current one is
        processed. Default: only where that overlaps with other work - a caching embedder on a
        GPU, or LLM work done elsewhere (``openai``/``vllm`` backends); on CPU-only runs two
        concurrent forward passes just oversubscribe the cores.
    stop_event, handle_sigint:
        Setting ``stop_event`` (or SIGINT, SIGTERM, SIGHUP when ``handle_sigint`` and in the main
        thread) ends the run after the batch in flight; after such a signal a Ctrl-C aborts,
        a repeated SIGTERM or SIGHUP does not (:mod:`memoryos_gpu.stop_signals`).
    reject_log, reject_log_limit:
        Where each reject is reported as ``file:line: rejected: reason`` (default stderr) and
        how many such lines at most (the rejects file holds all of them).
    on_batch:
        Called with the running report after each batch.
    timezone:
        The zone of timestamps written without one (``2025-01-01 04:00:00``, LoCoMo's):
        ``"UTC"``, ``"local"`` (this machine's) or an IANA name (``"Asia/Tokyo"``); see
        :func:`~memoryos_gpu.formats.timestamps.naive_zone`. Timestamps with an offset and
        epoch seconds are unchanged. ``ValueError`` for an unknown zone, before anything is read.
    """
    from memoryos_gpu.config import EngineConfig
    from memoryos_gpu.engine import InvalidInputError, MemoryEngine

    path_list = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if process not in ("auto", "batch", "defer"):
        raise ValueError(f"process must be 'auto', 'batch' or 'defer', got {process!r}")
    shard_obj = Shard.parse(shard) if shard is not None else None
    zone = naive_zone(timezone)
    if rejects_path is not None:  # before anything is opened: it is truncated at once
        refuse_rejects_path(rejects_path, _store_spec(engine_or_config), path_list)
    files = resolve_formats(path_list, fmt)

    own_engine = not isinstance(engine_or_config, MemoryEngine)
    if own_engine:
        cfg = engine_or_config if engine_or_config is not None else EngineConfig()
        if not isinstance(cfg, EngineConfig):
            raise TypeError("engine_or_config must be a MemoryEngine, an EngineConfig or None")
        if process != "auto" and cfg.auto_process:
            cfg = cfg.model_copy(update={"auto_process": False})
        # deferred: the work an earlier (interrupted) run left stays pending too, not run at open
        engine = MemoryEngine(cfg, hold_pending=process == "defer")
    else:
        engine = engine_or_config
    inline = bool(engine.config.auto_process)
    if process == "defer" and inline:
        raise ValueError(
            "process='defer' needs an engine that does not process inside add_many: open it "
            "with EngineConfig(auto_process=False), or pass the config instead of the engine"
        )
    # an engine processing inside add_many has done a batch's derived work when it returns
    process_after_batch = not inline and process != "defer"
    if prefetch is None:
        prefetch = _default_prefetch(engine)

    report = IngestReport(
        batch_size=batch_size,
        files=list(files),
        formats=dict(files),
        shard=str(shard_obj) if shard_obj else None,
        # a PostgreSQL URL is reported as the store names it: password masked
        store=engine.store.path if is_url(engine.config.store) else engine.config.store,
        rejects_path=os.fspath(rejects_path) if rejects_path is not None else None,
        rejects_raw=rejects_raw,
    )
    stop = stop_event or threading.Event()
    log = reject_log if reject_log is not None else sys.stderr
    users: set[str] = set()
    generated: set[str] = set()  # the conv-... user ids this run derived
    reasons: Counter = Counter()
    timings: Counter = Counter()
    # an engine this run opened counts from its open: resuming the store's pending work (an
    # interrupted run's) is this run's work too, and took place before this line
    llm_before = 0 if own_engine else _llm_calls(engine)
    failures_before = {} if own_engine else _failure_counts(engine)

    rejects_file: IO[str] | None = None
    if rejects_path is not None:
        Path(rejects_path).parent.mkdir(parents=True, exist_ok=True)
        rejects_file = open(rejects_path, "w", encoding="utf-8")  # noqa: SIM115

    display = _Progress(progress, files, shard_obj)
    logged = 0

    def reject(row: RejectRow) -> None:
        nonlocal logged
        report.rejected += 1
        reasons[reason_kind(row.reason)] += 1
        if rejects_file is not None:
            rejects_file.write(row.as_json(raw=rejects_raw))
            # in the file (the OS's) at once: a run killed outright (SIGKILL, OOM) after a
            # batch was acknowledged lists that batch's rejects; buffered, they were lost
            rejects_file.flush()
        if logged < reject_log_limit:
            display.log(log, row.message())
        elif logged == reject_log_limit:
            where = f" (all in {report.rejects_path})" if report.rejects_path else ""
            display.log(log, f"... further rejects not shown{where}")
        logged += 1

    def add(items: list[_Item]) -> list[tuple[_Item, Any]]:
        """add_many, splitting the batch when the engine refuses one of its pages."""
        try:
            return list(zip(items, engine.add_many([i.page for i in items]), strict=True))
        except InvalidInputError as exc:
            if len(items) == 1:
                reject(record_reject(items[0].path, items[0].record, record_refusal(exc)))
                return []
            mid = len(items) // 2
            return add(items[:mid]) + add(items[mid:])

    def on_stop(signum: int) -> None:
        """The first stop signal: finish the batch in flight, then stop (the rule, repeats
        included: :mod:`memoryos_gpu.stop_signals`)."""
        report.stop_signal = signum
        stop.set()
        display.log(sys.stderr, signals.notice("finishing the batch in flight, then stopping"))

    signals = StopSignals(on_stop)
    if handle_sigint:  # `timeout`, systemd and CI stop with SIGTERM: as Ctrl-C
        signals.install()

    pipe = _Pipeline(
        engine,
        files,
        batch_size=batch_size,
        shard=shard_obj,
        prefetch=prefetch,
        stop=stop,
        queue_batches=queue_batches,
        zone=zone,
    )
    t_start = time.perf_counter()
    try:
        display.start()
        pipe.start()
        try:
            while True:
                if stop.is_set():
                    report.interrupted = True
                    break
                t0 = time.perf_counter()
                msg = _get(pipe.batches_q, stop)
                timings["wait_input"] += time.perf_counter() - t0
                if msg is None or msg is _END:
                    report.interrupted = msg is None
                    break
                if isinstance(msg, _Failure):
                    raise msg.exc
                items, rejects = msg
                for row in rejects:
                    reject(row)
                if items:
                    t0 = time.perf_counter()
                    fresh, done = _held_under_legacy_keys(engine.store, items)
                    done += add(fresh) if fresh else []
                    timings["add"] += time.perf_counter() - t0
                    if process_after_batch:
                        t0 = time.perf_counter()
                        engine.process_pending()
                        timings["process"] += time.perf_counter() - t0
                    report.batches += 1
                    for item, res in done:
                        users.add(item.page.user_id)
                        if item.record.generated_user:
                            generated.add(item.page.user_id)
                        if res.duplicate:
                            report.skipped += 1
                        else:
                            report.accepted += 1
                    report.records += len(items)
                report.users = len(users)
                report.elapsed_s = time.perf_counter() - t_start
                report.pages_per_s = report.accepted / report.elapsed_s if report.elapsed_s else 0.0
                report.llm_calls = _llm_calls(engine) - llm_before
                display.update(report)
                if on_batch is not None:
                    on_batch(report)
                if stop.is_set():
                    report.interrupted = True
                    break
        except StoreUnavailableError as exc:
            # the server went away (down, restarting, a network cut): the batch in flight
            # was not committed, what came before was; the run ends here, with its report
            report.store_unavailable = str(exc)
        except StoreFullError as exc:  # the same, for a full disk: `--json` gets its report
            report.store_full = str(exc)
    finally:
        pipe.close()
        display.stop()
        signals.restore()
        if rejects_file is not None:
            rejects_file.close()
        report.elapsed_s = time.perf_counter() - t_start
        report.pages_per_s = report.accepted / report.elapsed_s if report.elapsed_s else 0.0
        report.users = len(users)
        report.generated_users = len(generated)
        report.other_shards = pipe.other_shards
        report.llm_calls = _llm_calls(engine) - llm_before
        report.reject_reasons = dict(reasons.most_common())
        report.timings = {k: round(v, 4) for k, v in sorted({**pipe.timings, **timings}.items())}
        report.peak_rss_mb = round(_peak_rss_mb(), 1)
        with contextlib.suppress(Exception):
            report.store_counts = dict(engine.store.counts())
            report.pending = int(engine.store.count_pending())
        if report.pending and process != "defer":
            report.derived_failure = _derived_failure(engine, failures_before)
        if own_engine:
            try:
                engine.close()
            except StoreError:
                if not (report.store_unavailable or report.store_full):
                    raise
                # closing after the outage (or on the full disk) fails too: the report says
                # why; nothing to keep
    if report.generated_users:
        display.log(log, _generated_note(report.generated_users))
    return report


def _store_spec(engine_or_config: Any) -> str:
    """The store an :func:`ingest` run writes (an engine's, a config's, else the default
    config's), known before any engine is opened: what its rejects file must not be."""
    from memoryos_gpu.config import EngineConfig

    cfg = getattr(engine_or_config, "config", engine_or_config)
    if not isinstance(cfg, EngineConfig):
        cfg = EngineConfig()  # None (the default config); another type is refused below
    return str(cfg.store)


def _default_prefetch(engine: Any) -> bool:
    """Embed ahead only where it overlaps with something: an embedder on a GPU, or LLM work
    done elsewhere (a server, or vLLM on the GPU). On a CPU-only run the embedder already uses
    every core; a second concurrent forward pass only oversubscribes them (measured: 2x
    slower on 2 cores, see benchmarks/ingest.py)."""
    emb = engine.embedder
    if not getattr(emb, "cache_size", 0):
        return False
    if getattr(getattr(emb, "device", None), "type", "cpu") == "cuda":
        return True
    llm = engine.config.llm
    return llm.mode == "llm" and llm.backend in ("openai", "vllm")


# ============================================================================ progress display
class _Progress:
    """A rich progress line on stderr: pages, users, pages/s, LLM calls, ETA (when known).

    The total (JSONL page files: one record per non-blank line) is counted in a background
    thread, so a large input starts ingesting at once; the bar and ETA appear when it is known.
    """

    def __init__(self, enabled: bool, files: dict[str, str], shard: Shard | None) -> None:
        self.enabled = enabled
        self.files = files
        self.shard = shard
        self._progress: Any = None
        self._task: Any = None
        self._lock = threading.Lock()

    def _count(self) -> None:
        try:
            total = _count_records(self.files)
        except (OSError, EOFError, zlib.error):  # a corrupt gzip: the reader reports it
            return
        if total is None:
            return
        if self.shard is not None:
            total = max(1, total // self.shard.count)  # estimate: users spread evenly
        with self._lock:
            if self._progress is not None:
                self._progress.update(self._task, total=total)

    def start(self) -> None:
        if not self.enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
        except ImportError:  # pragma: no cover - rich is a dependency
            self.enabled = False
            return
        columns: list[Any] = [
            SpinnerColumn(),
            BarColumn(bar_width=12),
            TextColumn("{task.fields[counts]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        ]
        self._progress = Progress(
            *columns, console=Console(stderr=True), transient=False, refresh_per_second=4
        )
        self._task = self._progress.add_task(
            "ingest", total=None, counts=_progress_counts(IngestReport())
        )
        self._progress.start()
        threading.Thread(target=self._count, name="ingest-count", daemon=True).start()

    def update(self, r: IngestReport) -> None:
        with self._lock:
            if self._progress is None:
                return
            self._progress.update(
                self._task,
                completed=r.records + r.rejected,
                counts=_progress_counts(r),
            )

    def log(self, stream: IO[str], message: str) -> None:
        if self._progress is not None and stream is sys.stderr:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=stream, flush=True)

    def stop(self) -> None:
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None


def _progress_counts(r: IngestReport) -> str:
    """The progress line's counts, the ones still 0 (pages present, rejected, LLM calls: most
    runs have none) left out: with all of them the line was wider than an 80-column terminal,
    and rich cut its elapsed time and ETA to ``0:00:…``."""
    counts = [(r.accepted, "pages"), (r.skipped, "present"), (r.rejected, "rejected")]
    parts = [f"{n:,} {what}" for n, what in counts if n or what == "pages"]
    parts += [f"{r.users:,} users", f"{r.pages_per_s:,.0f}/s"]
    if r.llm_calls:
        parts.append(f"{r.llm_calls:,} LLM")
    return " ".join(parts)

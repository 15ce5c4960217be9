"""``memoryos-gpu ingest``: one process, ``--workers N`` local shard processes, or ``--ray``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import click

from memoryos_gpu.stop_signals import StopSignals

from .options import (
    ENV_LLM_API_KEY,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    FORMAT_CHOICES,
    CLIError,
    EngineOptions,
    UsageFailure,
    build_config,
    check_engine_settings,
    engine_options,
    handle_errors,
    options_of,
    quiet_model_loading,
    refuse_undecodable,
)
from .output import (
    echo_json,
    print_ingest_summary,
)
from .stores import (
    is_url,
    ray_shards,
    store_file,
)


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMAT_CHOICES),
    default="auto",
    show_default=True,
    help="Input format (auto: detected per file from its first records).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the report as one JSON object "
    "(the last line of stdout); the summary table goes to stderr.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1),
    default=512,
    show_default=True,
    help="Pages per engine batch (across users). It shapes the derived memory, not only the "
    "speed: a batch's pages all enter the keyword statistics before its derived rounds pick "
    "their keywords, and hot segments are promoted after each batch's rounds, so segments "
    "and facts differ between batch sizes (deterministic for one size; --batch-size 1 "
    "matches pages added one at a time, each processed before the next).",
)
@click.option(
    "--timezone",
    metavar="ZONE",
    default="UTC",
    show_default=True,
    help='The zone of timestamps written without one ("2025-01-01 04:00:00", LoCoMo\'s): '
    "UTC, local (this machine's) or an IANA name such as Asia/Tokyo. BAI-LAB MemoryOS wrote "
    "its local time: give the zone it ran in. Timestamps with an offset and epoch seconds "
    "are unchanged.",
)
@click.option(
    "--rejects",
    "rejects_path",
    metavar="FILE",
    help="Where rejected records go, one JSON per line, in plain text [default: "
    "STORE/rejects.jsonl; for an encrypted store that file says where each rejected record is "
    "and why, without its content: give --rejects to get the content].",
)
@click.option(
    "--shard",
    metavar="I/N",
    help="Only ingest the users of shard I of N (stable blake2b hash of the user id; "
    "I from 0). Give every shard its own --store.",
)
@click.option(
    "--workers",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Run N processes on this machine, shard i into STORE/shard-i; reports merged.",
)
@click.option(
    "--process",
    type=click.Choice(["auto", "batch", "defer"]),
    default="auto",
    show_default=True,
    help="When derived work (chain, segments, promotion) runs: auto/batch: with each "
    "batch; defer: later (pending in the store, run when the store is next opened, except "
    "by another --process defer run).",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Live progress on stderr [default: when stderr is a terminal].",
)
@click.option(
    "--prefetch/--no-prefetch",
    default=None,
    hidden=True,
    help="Embed the next batch while the current one is processed.",
)
@click.option(
    "--ray",
    "use_ray",
    is_flag=True,
    help="Run on Ray: Ray Data reads and partitions the logs by user hash onto one shard actor "
    "per shard (a GPU each when the cluster has them); local Ray unless $RAY_ADDRESS is set. "
    "Needs `pip install 'memoryos-gpu[ray]'`.",
)
@click.option(
    "--shards",
    type=click.IntRange(1),
    help="Shards for --ray (STORE/shard-I each, or one PostgreSQL URL) [default: the store's "
    "shard count, else 2]; only with --ray (without Ray: --workers N).",
)
@click.option("--summary/--no-summary", default=True, hidden=True)
@engine_options
@click.pass_context
@handle_errors
def ingest(
    ctx: click.Context,
    files: tuple[str, ...],
    fmt: str,
    as_json: bool,
    batch_size: int,
    timezone: str,
    rejects_path: str | None,
    shard: str | None,
    workers: int,
    process: str,
    progress: bool | None,
    prefetch: bool | None,
    use_ray: bool,
    shards: int | None,
    summary: bool,
    **kwargs: Any,
) -> None:
    """Load chat logs into the store: streamed, batched across users, resumable.

    Re-running the same input skips what was already accepted (each record has a stable
    source key), so an interrupted run (Ctrl-C, SIGTERM or SIGHUP: finishes the batch in
    flight, exit 130, 143 or 129) is resumed by running it again. Malformed records are
    reported (file:line: reason) and written to the rejects file; the run continues and exits
    with 3. The rejects file is plain text: into an encrypted store its default one leaves the
    records' content out.

    One process writes a store at a time: ingesting into a store that a running engine
    holds (e.g. `serve`) is refused, naming that process (exit 1); send the pages to its
    server instead (POST /v1/pages) or stop it first.

    \b
    Exit codes: 0 all accepted or already present, 3 some records rejected,
    128 + the signal when stopped (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), 2 usage error,
    1 runtime error.
    """
    _die_with_parent()
    from memoryos_gpu.formats import FormatError
    from memoryos_gpu.formats.opening import is_stream
    from memoryos_gpu.ingest import Shard, resolve_formats
    from memoryos_gpu.ingest import ingest as run_ingest
    from memoryos_gpu.rejects import default_rejects_path

    o = options_of(ctx, kwargs)
    if shards is not None and not use_ray:  # it would be ignored: one unsharded store
        raise UsageFailure(
            f"--shards is for --ray: give --ray --shards {shards}, or, without Ray, "
            f"--workers {shards} (local processes, shard i into STORE/shard-i)"
        )
    for f in files:  # a source key holds the file's name: SQL cannot carry a lone surrogate
        refuse_undecodable(f, "input file")
    cfg = build_config(o)
    # found at the engine's open, after the store was made (Ray's machines: their own GPUs)
    check_engine_settings(cfg, device=not use_ray)
    _check_rejects(rejects_path, cfg.store, files)
    _check_timezone(timezone)
    if (use_ray or workers > 1) and any(is_stream(f) for f in files):
        raise UsageFailure(
            "--workers and --ray read the input once per shard: a pipe can be read only once; "
            "write it to a file first"
        )
    try:
        formats = resolve_formats(files, fmt)
    except FormatError as exc:
        raise UsageFailure(str(exc)) from None
    try:
        shard_obj = Shard.parse(shard) if shard else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shard") from None
    if shard_obj is not None and workers > 1:
        raise UsageFailure("give --shard or --workers, not both")
    _check_sharded_store(cfg.store, shard_obj, workers=workers, use_ray=use_ray)
    if progress is None:
        progress = sys.stderr.isatty()
    raw = _raw_rejects(cfg, rejects_path)
    if use_ray:
        if shard_obj is not None or workers > 1:
            raise UsageFailure("--ray shards by itself: give --shards N, not --shard/--workers")
        report = _ingest_ray(
            list(formats),
            cfg,
            shards,
            fmt=fmt,
            batch_size=batch_size,
            timezone=timezone,
            rejects_path=rejects_path,
            raw=raw,
        )
    elif workers > 1:
        report = _ingest_workers(
            list(files),
            o,
            cfg.store,
            workers,
            fmt=fmt,
            batch_size=batch_size,
            timezone=timezone,
            rejects_path=rejects_path,
            process=process,
            progress=progress,
        )
    else:
        rejects = rejects_path or default_rejects_path(cfg.store)
        quiet_model_loading()
        with _PoolLog() as pool_log:
            report = run_ingest(  # given the config, it opens (and closes) an engine for `process`
                list(formats),
                cfg,
                fmt=fmt,
                batch_size=batch_size,
                rejects_path=rejects,
                rejects_raw=raw,
                shard=shard_obj,
                progress=progress,
                process=process,
                prefetch=prefetch,
                handle_sigint=True,
                timezone=timezone,
            ).to_dict()
        if report.get("store_unavailable"):
            report["store_unavailable"] = pool_log.with_cause(report["store_unavailable"])
    if summary:
        # a run the store's outage ended is, to its reader, one that stopped early and resumes
        # by running it again (output.py's status for an interrupted run); the line below says why
        ended = report.get("store_unavailable") or report.get("store_full")
        shown = {**report, "interrupted": True} if ended else report
        print_ingest_summary(shown, err=as_json)
        note = _withheld_note(report)
        if note:
            click.echo(note, err=True)
    if as_json:
        echo_json(report)
    failed = (
        _store_unavailable_line(report) or _store_full_line(report) or _derived_failed_line(report)
    )
    if failed:
        click.echo(failed, err=True)
    ctx.exit(int(report["exit_code"]))


#: per ``derived_failure``: what failed, when the work resumes, and how to resume it
_DERIVED_FAILED = {
    "disk_full": ("the disk is full", "space is freed", "open the store"),
    "store_error": ("the store failed", "the store works again", "open the store"),
    "llm_unavailable": (
        "the LLM could not be used",
        "the LLM answers",
        "open the store with the LLM settings",
    ),
}


def _derived_failed_line(report: dict[str, Any]) -> str | None:
    """The one line for a run whose derived work failed (the store, a full disk, an LLM that
    could not be used) and stays pending (``derived_failure``), else None; the pages
    themselves are committed. The log's warnings say the cause in detail, once per batch."""
    kind = report.get("derived_failure")
    if not kind or report.get("interrupted"):
        return None
    why, once, how = _DERIVED_FAILED.get(kind, _DERIVED_FAILED["store_error"])
    return (
        f"error: store {report.get('store')}: {why}: the pages are committed, but the derived "
        f"work of {int(report.get('pending', 0)):,} item(s) stays pending; it resumes once "
        f"{once} (run ingest again, or {how})"
    )


def _store_full_line(report: dict[str, Any]) -> str | None:
    """The one line for a run that the store's full disk ended (``store_full``), else None:
    the store's own words (which name it and the full disk), what was committed, and how to
    resume."""
    cause = report.get("store_full")
    if not cause:
        return None
    return (
        f"error: {cause}; {int(report.get('accepted', 0)):,} page(s) accepted before it are "
        "committed: run the same command again once there is room (it resumes after them)"
    )


def _store_unavailable_line(report: dict[str, Any]) -> str | None:
    """The one line for a run that the store's outage ended (``store_unavailable``), else
    None: the cause, what was committed before it, and how to resume."""
    cause = report.get("store_unavailable")
    if not cause:
        return None
    return (
        f"error: the store became unavailable: {cause}; {int(report.get('accepted', 0)):,} "
        "page(s) accepted before it are committed, the batch in flight is not: run the same "
        "command again once the store answers (it resumes after what was committed)"
    )


class _PoolLog(logging.Filter):
    """While in this block, the PostgreSQL driver's pool logs nothing below ERROR on stderr
    (``psycopg.pool``: a line per failed reconnection attempt, per discarded connection;
    ``psycopg``: a broken pipeline's cleanup); the last reconnection error is kept, so that
    the run's one error line can name the cause (e.g. "Connection refused")."""

    _LOGGERS = ("psycopg.pool", "psycopg")

    def __init__(self) -> None:
        super().__init__()
        self.last_connect_error: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        with contextlib.suppress(Exception):
            msg = record.getMessage()
            if msg.startswith("error connecting") and ": " in msg:
                self.last_connect_error = " ".join(msg.split(": ", 1)[1].split())
        return False

    def with_cause(self, error: str) -> str:
        """``error`` with the last reconnection error appended where it does not say it."""
        cause = self.last_connect_error
        if not cause or cause in error:
            return error
        return f"{error}; the last attempt to connect: {cause}"

    def __enter__(self) -> _PoolLog:
        for name in self._LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._LOGGERS:
            logging.getLogger(name).removeFilter(self)


# Set by ``ingest --workers`` in each shard process's environment: the parent's pid.
_ENV_PARENT = "MEMORYOS_GPU_INGEST_PARENT"


def _die_with_parent() -> None:
    """In a shard process of ``ingest --workers``: be sent SIGTERM when the parent dies, even
    by SIGKILL (:func:`memoryos_gpu.parent_death.die_with_parent`; Linux only), so that no
    orphan keeps writing (and holding) its shard's store. The children run in their own
    session (see :func:`_ingest_workers`), so nothing else would stop them. The SIGTERM is
    the run's ordinary stop: the batch in flight finishes (the kernel may send it more than
    once; only a repeated Ctrl-C aborts, :mod:`memoryos_gpu.stop_signals`)."""
    from memoryos_gpu.parent_death import die_with_parent

    parent = os.environ.pop(_ENV_PARENT, None)
    if parent and parent.isdigit():
        die_with_parent(int(parent))


def _check_timezone(timezone: str) -> None:
    """Refuse an unknown ``--timezone`` (exit 2) before anything is read: a misspelt zone
    would store every page hours off."""
    from memoryos_gpu.formats.timestamps import naive_zone

    try:
        naive_zone(timezone)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--timezone") from None


def _check_rejects(rejects_path: str | None, store: str, files: tuple[str, ...]) -> None:
    """Refuse (exit 2), before anything is opened, a ``--rejects`` that the run would erase
    by writing it: a directory, a file of the store or of one of its shards (database, log,
    lock, layout) or an input file (:func:`memoryos_gpu.rejects.refuse_rejects_path`)."""
    from memoryos_gpu.rejects import refuse_rejects_path

    if rejects_path is None:
        return
    try:
        refuse_rejects_path(rejects_path, store, files)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--rejects") from None


def _check_sharded_store(store: str, shard: Any, *, workers: int, use_ray: bool) -> None:
    """Refuse an ingest that would misplace users in a sharded directory store: a plain one
    into its parent (exit 1, as the store's own refusal, which named no ingest option and
    offered "one shard's directory" without its --shard), and (exit 2) one into a shard's
    directory ``PARENT/shard-I`` that does not keep to that shard's users (no ``--shard
    I/N``, another one, or ``--workers``/``--ray``): every user of the input went there, the
    other shards' ones too, so their pages existed twice and a deletion routed by hash left
    the stray copies behind."""
    from memoryos_gpu.distributed.layout import manifest_count, shard_of_directory
    from memoryos_gpu.store import SHARDS_FILE

    if store == ":memory:" or is_url(store):
        return
    base = Path(store)
    plain = workers == 1 and not use_ray
    if plain and (base / SHARDS_FILE).is_file() and not store_file(base).exists():
        try:
            count = str(manifest_count(base / SHARDS_FILE))
        except ValueError:
            count = "N"
        raise CLIError(  # exit 1, as the store's own refusal of a plain open was
            f"{base} is a sharded store ({count} shards: {base}/shard-I, {SHARDS_FILE}): "
            f"ingest into it as it was written, with --workers {count} (or --ray --shards "
            f"{count}); to ingest one shard by itself, give --store {base}/shard-I "
            f"--shard I/{count}"
        )
    try:
        found = shard_of_directory(store)
    except ValueError as exc:
        raise UsageFailure(str(exc)) from None
    if found is None:
        return
    parent, index, count = found
    own = f"{index}/{count}"
    if plain and shard is not None and str(shard) == own:
        return
    if workers > 1 or use_ray:
        wrong = "--workers or --ray here would make a sharded store inside a shard"
    elif shard is not None:
        wrong = f"--shard {shard} would store another shard's users here"
    else:
        wrong = "without --shard, every user of the input would go here, other shards' ones too"
    raise UsageFailure(
        f"{store} is shard {own} of the sharded store {parent} (its {SHARDS_FILE}): {wrong}. "
        f"Ingest into the parent with --store {parent} --workers {count}, or into this shard "
        f"alone with --shard {own}"
    )


def _raw_rejects(cfg: Any, rejects_path: str | None) -> bool:
    """Whether the rejects file may hold the rejected records' content. Not the default one of
    an encrypted store (however its key was given: ``cfg.encryption_key`` is the config's,
    else $MEMORYOS_GPU_KEY): that plain-text file lies in the store's folder, which is backed
    up by copying, and would hold in clear what the store encrypts. A file the user named is
    their informed choice: it gets the content, as for a plain store."""
    return rejects_path is not None or cfg.encryption_key is None


def _withheld_note(report: dict[str, Any]) -> str | None:
    """The summary's line saying that the rejected records' content was left out (an
    encrypted store's default rejects file) and how to get it; None when nothing was."""
    if report.get("rejects_raw", True) or not report.get("rejected"):
        return None
    path = report.get("rejects_path")
    where = (
        f"{path} says where each rejected record is (file, line) and why, without its content"
        if path
        else "no rejects file was written (--ray writes the records' content)"
    )
    return (
        f"the store is encrypted, so {where}: the file would be plain text beside the store. "
        "To get the records themselves, re-run with --rejects FILE (plain text: keep it as "
        "safe as the store) or read them at those lines of the input."
    )


def _ingest_ray(
    files: list[str],
    cfg: Any,
    shards: int | None,
    *,
    fmt: str,
    batch_size: int,
    timezone: str,
    rejects_path: str | None,
    raw: bool = True,
) -> dict[str, Any]:
    """``ingest --ray``: memoryos_gpu.distributed.ray_ingest (Ray Data + shard actors).
    ``raw=False`` (an encrypted store, no --rejects): no rejects file, since Ray's holds
    every record's content. The package's own errors (a store another process holds, a path
    through a file; ray_ingest raises a shard actor's error as itself) are left to
    ``handle_errors`` (``error: ...``, exit 1): some are ValueErrors too, not usage errors."""
    from memoryos_gpu.distributed.ray_common import RayUnavailableError
    from memoryos_gpu.errors import MemoryOSError

    try:
        from memoryos_gpu.distributed.ray_ingest import ingest_ray
        from memoryos_gpu.rejects import default_rejects_path

        quiet_model_loading()
        report = ingest_ray(
            files,
            cfg,
            ray_shards(cfg.store, shards),
            fmt=fmt,
            batch_size=batch_size,
            timezone=timezone,
            rejects_path=rejects_path or (default_rejects_path(cfg.store) if raw else None),
        )
        return {**report, "rejects_raw": raw}
    except RayUnavailableError as exc:
        raise CLIError(str(exc)) from None
    except MemoryOSError:
        raise
    except ValueError as exc:  # store layout problems
        raise UsageFailure(str(exc)) from None


def _shard_rejects_args(rejects_path: str | None, i: int) -> list[str]:
    """The ``--rejects`` of shard process ``i``: none (its default, STORE/shard-i/rejects.jsonl)
    unless ``rejects_path`` is given, then a part file beside it (merged into it)."""
    return ["--rejects", f"{rejects_path}.shard-{i}"] if rejects_path else []


def _ingest_workers(
    files: list[str],
    o: EngineOptions,
    store: str,
    workers: int,
    *,
    fmt: str,
    batch_size: int,
    timezone: str,
    rejects_path: str | None,
    process: str,
    progress: bool,
) -> dict[str, Any]:
    """N processes, process i ingesting shard i/N into STORE/shard-i; their reports merged.

    With a ``rejects_path`` each process writes its rejects beside that file (content
    included, as asked), not into its shard's folder, and they are removed once merged;
    without one, each writes its shard's default file (an encrypted shard's leaves the
    content out itself: :func:`_raw_rejects`)."""
    from memoryos_gpu import ops
    from memoryos_gpu.store import SHARDS_FILE, STORE_FILE_SUFFIXES

    if is_url(store):
        raise UsageFailure(
            "--workers writes one SQLite store per worker; it does not take a PostgreSQL "
            "--store: shard into one PostgreSQL database with --ray --shards N, or run one "
            "ingest per shard with --shard I/N"
        )
    base = Path(store)
    if store == ":memory:" or base.suffix in STORE_FILE_SUFFIXES:
        raise UsageFailure("--workers needs --store DIR (a directory: one store per shard)")
    if store_file(base).exists():
        raise UsageFailure(f"{base} holds an unsharded store; use a new --store DIR for --workers")
    manifest = base / SHARDS_FILE
    if manifest.exists():
        try:
            count = int(json.loads(manifest.read_text())["count"])
        except (ValueError, KeyError, TypeError):
            count = -1
        if count != workers:
            raise UsageFailure(
                f"{base} was ingested with --workers {count}; users are sharded by count, so "
                f"re-run with --workers {count} (or use a new --store)"
            )
    base.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"count": workers, "hash": "blake2b-64(user_id) mod count"}))

    env = dict(os.environ)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, (cpus or 1) // workers))
    env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("MKL_NUM_THREADS", threads)
    try:
        gpus = int(ops.build_info().get("cuda_device_count", 0))
    except Exception:
        gpus = 0
    env[_ENV_PARENT] = str(os.getpid())
    procs: list[subprocess.Popen] = []
    t0 = time.perf_counter()
    with _supervisor_stop(procs) as stopper:
        run_args = ["--format", fmt, "--batch-size", str(batch_size), "--timezone", timezone]
        _spawn(procs, stopper, files, o, base, workers, env, gpus, run_args, process, rejects_path)
        outputs = _collect(procs, workers, progress, t0)
    return _merge(procs, outputs, stopper, files, base, workers, rejects_path, t0)


def _merge_rejects(parts: list[Path], files: list[str], out: IO[str]) -> None:
    """The shards' rejects rows into ``out`` in input order (file, then line; a row cut short
    by a killed shard last). Why sorted: a read-stage reject goes to the shard its path and
    line hash to, so the parts written one after the other ordered the file differently from
    run to run (and a part holds its rows in the order they were rejected)."""
    rank = {f: i for i, f in enumerate(files)}

    def key(line: str) -> tuple[int, int]:
        try:
            row = json.loads(line)
            return rank.get(row["file"], len(files)), int(row["line"])
        except (ValueError, TypeError, KeyError):
            return len(files) + 1, 0

    lines = [line for p in parts for line in p.read_text(encoding="utf-8").splitlines()]
    out.writelines(line + "\n" for line in sorted(lines, key=key))


def _supervisor_stop(procs: list[subprocess.Popen]) -> StopSignals:
    """The stop signals of ``ingest --workers`` (the rule: :mod:`memoryos_gpu.stop_signals`):
    the first one asks every shard process in ``procs`` to finish its batch in flight and
    stop (the same signal, forwarded: they run in their own session, so only this forwarding
    reaches them), and the merged report then exits with 128 + that signal; a second Ctrl-C
    kills them; a repeated SIGTERM or SIGHUP changes nothing."""

    def on_stop(signum: int) -> None:
        click.echo(
            stopper.notice("asking the shard processes to finish their batch", "kill them"),
            err=True,
        )
        for p in procs:
            _forward_stop(stopper, p)

    def on_abort() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()

    stopper = StopSignals(on_stop, on_abort)
    return stopper


def _forward_stop(stopper: StopSignals, p: subprocess.Popen) -> None:
    """Ask shard process ``p`` to stop (when a stop was asked and ``p`` still runs), with the
    signal the run got: the shard's report (``stop_signal``, ``exit_code``) and its notice
    then name what the user sent, not a Ctrl-C nobody pressed. Its handler follows the same
    rule (:mod:`memoryos_gpu.stop_signals`): the batch in flight finishes either way."""
    if stopper.signum is not None and p.poll() is None:
        p.send_signal(stopper.signum)


def _spawn(
    procs: list[subprocess.Popen],
    stopper: StopSignals,
    files: list[str],
    o: EngineOptions,
    base: Path,
    workers: int,
    env: dict[str, str],
    gpus: int,
    run_args: list[str],
    process: str,
    rejects_path: str | None,
) -> None:
    """Start shard process i of ``workers`` (into ``base/shard-i``) for every i; ``run_args``:
    the options each passes on as given (format, batch size, time zone). With a
    ``rejects_path`` each writes its rejects beside that file, not into its shard's folder (a
    plain store's shards kept their own copies there, which the user never asked for)."""
    for i in range(workers):
        cmd = [
            sys.executable,
            "-m",
            "memoryos_gpu",
            "ingest",
            *files,
            "--store",
            str(base / f"shard-{i}"),
            "--shard",
            f"{i}/{workers}",
            *run_args,
            "--process",
            process,
            "--json",
            "--no-progress",
            "--no-summary",
            *o.argv(),
            *_shard_rejects_args(rejects_path, i),
        ]
        child_env = dict(env)
        if o.llm_api_key:
            child_env[ENV_LLM_API_KEY] = o.llm_api_key
        if gpus > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
            child_env["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
        # own session: a terminal Ctrl-C reaches only this process, which forwards it once
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, env=child_env, start_new_session=True)
        )
        _forward_stop(stopper, procs[-1])  # a stop asked while the processes were started


def _collect(procs: list[subprocess.Popen], workers: int, progress: bool, t0: float) -> list[bytes]:
    """Wait for the shard processes (a status line when ``progress``); their stdout."""
    outputs: list[bytes] = [b""] * workers
    readers = []
    for i, p in enumerate(procs):

        def read(i: int = i, p: subprocess.Popen = p) -> None:
            outputs[i] = p.stdout.read() if p.stdout else b""

        t = threading.Thread(target=read, daemon=True)
        t.start()
        readers.append(t)
    status = None
    if progress:
        from rich.console import Console

        status = Console(stderr=True).status(f"ingesting with {workers} shard processes")
        status.start()
    try:
        while any(p.poll() is None for p in procs):
            if status is not None:
                done = sum(p.poll() is not None for p in procs)
                status.update(
                    f"ingesting with {workers} shard processes: {done} done, "
                    f"{time.perf_counter() - t0:.0f} s"
                )
            time.sleep(0.2)
    finally:
        if status is not None:
            status.stop()
    for t in readers:
        t.join()
    return outputs


def _shard_report(i: int, workers: int, p: subprocess.Popen, out: bytes, stopped: bool) -> dict:
    """Shard process ``i``'s report (the last line of its stdout). One stopped before it could
    report (a stop asked while it was starting) counts as interrupted with nothing done."""
    lines = [ln for ln in out.decode("utf-8", "replace").splitlines() if ln.strip()]
    try:
        return dict(json.loads(lines[-1]))
    except (IndexError, ValueError):
        if stopped:
            return {"shard": f"{i}/{workers}", "interrupted": True, "exit_code": p.returncode}
        raise CLIError(
            f"shard {i}/{workers} failed (exit {p.returncode}) without a report; "
            "see its messages above"
        ) from None


def _merge(
    procs: list[subprocess.Popen],
    outputs: list[bytes],
    stopper: StopSignals,
    files: list[str],
    base: Path,
    workers: int,
    rejects_path: str | None,
    t0: float,
) -> dict[str, Any]:
    """The merged report of the shard processes; their rejects concatenated into one file."""
    from memoryos_gpu.rejects import REJECTS_FILE

    stopped = stopper.signum is not None
    shards = [
        _shard_report(i, workers, p, out, stopped)
        for i, (p, out) in enumerate(zip(procs, outputs, strict=True))
    ]
    elapsed = time.perf_counter() - t0

    merged_rejects = Path(rejects_path) if rejects_path else base / REJECTS_FILE
    merged_rejects.parent.mkdir(parents=True, exist_ok=True)
    named = (rep.get("rejects_path") for rep in shards)
    parts = [Path(p) for p in named if p and Path(p).is_file()]
    with open(merged_rejects, "w", encoding="utf-8") as out_f:
        _merge_rejects(parts, files, out_f)
    if rejects_path:  # parts of the user's file, not the shards' own
        for part in parts:
            part.unlink()
    keys = (
        "accepted",
        "rejected",
        "skipped",
        "users",
        "records",
        "llm_calls",
        "pending",
        "batches",
        "generated_users",
    )
    merged: dict[str, Any] = {k: sum(int(r.get(k, 0)) for r in shards) for k in keys}
    reasons: dict[str, int] = {}
    for r in shards:
        for k, v in r.get("reject_reasons", {}).items():
            reasons[k] = reasons.get(k, 0) + v
    interrupted_any = stopped or any(r.get("interrupted") for r in shards)
    merged.update(
        pages_per_s=merged["accepted"] / elapsed if elapsed else 0.0,
        elapsed_s=elapsed,
        interrupted=interrupted_any,
        workers=workers,
        shard=None,  # the run covers every shard: no record is left to another
        other_shards=0,
        batch_size=shards[0].get("batch_size") if shards else None,
        store=str(base),
        rejects_path=str(merged_rejects),
        rejects_raw=all(r.get("rejects_raw", True) for r in shards),
        reject_reasons=dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        files=files,
        formats=shards[0].get("formats", {}) if shards else {},
        peak_rss_mb=max((r.get("peak_rss_mb", 0.0) for r in shards), default=0.0),
        store_counts=_sum_dicts(r.get("store_counts", {}) for r in shards),
        timings=_sum_dicts(r.get("timings", {}) for r in shards),
        stop_signal=None if stopper.signum is None else int(stopper.signum),
        derived_failure=next(
            (r["derived_failure"] for r in shards if r.get("derived_failure")), None
        ),
        store_unavailable=next(
            (r["store_unavailable"] for r in shards if r.get("store_unavailable")), None
        ),
        store_full=next((r["store_full"] for r in shards if r.get("store_full")), None),
        shards=shards,
    )
    if stopper.signum is not None:
        merged["exit_code"] = 128 + int(stopper.signum)  # 130 SIGINT, 143 SIGTERM, 129 SIGHUP
    elif interrupted_any:
        merged["exit_code"] = EXIT_INTERRUPTED
    elif any(r.get("exit_code") not in (EXIT_OK, EXIT_REJECTED) for r in shards):
        merged["exit_code"] = EXIT_ERROR
    else:
        merged["exit_code"] = EXIT_REJECTED if merged["rejected"] else EXIT_OK
    return merged


def _sum_dicts(dicts: Any) -> dict[str, Any]:
    """Key-wise sums of the shards' ``store_counts`` (rows per table) or ``timings`` (seconds
    per stage, added over the processes: CPU-like totals, not wall time)."""
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, int | float):
                out[k] = out.get(k, 0) + v
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(out.items())}

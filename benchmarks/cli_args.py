"""Small helpers the benchmark scripts share: argparse types, --quick/full defaults, early
output checks, strict (and atomic) JSON, the machine description, and the ``run`` wrapper every
script's ``__main__`` goes through (Ctrl-C / SIGTERM: one line, exit 130).

The scripts run as ``python benchmarks/X.py``, so this directory is on ``sys.path`` and they
import it as ``cli_args``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from memoryos_gpu.eval.locomo import Conversation


class Parser(argparse.ArgumentParser):
    """Every benchmark's parser: a bad option is one line on stderr (``prog: error: ...``),
    exit 2, before the run (argparse's usage block, many lines for these scripts, is left to
    ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (counts of users, pages, repeats, batches: 1;
    counts where 0 means "all" or "none": 0), with a one-line error otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"  # what argparse names in "invalid ... value"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def float_at_least(low: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low`` (``above``: > ``low``), with a one-line
    error otherwise (seconds, fractions, think times)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low or (above and value == low):
            word = "above" if above else "at least"
            raise argparse.ArgumentTypeError(f"must be {word} {low:g}, got {value:g}")
        return value

    parse.__name__ = f"number {'>' if above else '>='} {low:g}"
    return parse


nonnegative_float = float_at_least(0.0)
positive_float = float_at_least(0.0, above=True)


def fraction(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    value = nonnegative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {value:g}")
    return value


def apply_defaults(
    args: argparse.Namespace, full: Mapping[str, Any], quick: Mapping[str, Any] | None = None
) -> argparse.Namespace:
    """The one rule for ``--quick``: it sets the defaults of the options NOT given; an option
    given explicitly wins. The options named here have the argparse default None; ``full``
    holds every one's default for a full run, ``quick`` those that differ under ``--quick``."""
    chosen = dict(full)
    if getattr(args, "quick", False) and quick:
        chosen.update(quick)
    for name, value in chosen.items():
        if getattr(args, name, None) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    return args


def resolve_device(parser: argparse.ArgumentParser, device: str) -> str:
    """``--device auto|cpu|cuda`` (argparse ``choices=DEVICES``) resolved as ``memoryos-gpu
    bench`` does: auto is CUDA when usable; cuda without a usable device is a one-line error
    (exit 2), the CLI's own words, before the run."""
    from memoryos_gpu import ops

    usable = bool(ops.build_info()["cuda_usable"])
    if device == "auto":
        return "cuda" if usable else "cpu"
    if device.startswith("cuda") and not usable:
        parser.error(f"device {device!r} requested but torch sees no CUDA device")
    return device


#: ``--device``'s choices (``resolve_device``)
DEVICES = ("auto", "cpu", "cuda")


def check_output(parser: argparse.ArgumentParser, *paths: str | Path | None) -> None:
    """Before a long run: create each output file's folder and check it can be written, so a
    bad ``--json``/``--out``/``--plot`` fails at once (``parser.error``: one line, exit 2)."""
    for p in paths:
        if p is None:
            continue
        path = Path(p)
        if path.is_dir():
            parser.error(f"output {path} is a directory")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"cannot create the folder of {path}: {e.strerror or e}")
        target = path if path.exists() else path.parent
        if not os.access(target, os.W_OK):
            parser.error(f"cannot write {path}: permission denied")


def check_input(parser: argparse.ArgumentParser, *paths: str | Path | None) -> None:
    """A missing input file (``--data``) is a one-line error, not a traceback."""
    for p in paths:
        if p is not None and not Path(p).exists():
            parser.error(f"no such file: {p}")


def check_locomo_env(parser: argparse.ArgumentParser, path: str | Path) -> None:
    """The LoCoMo file a script reads from ``$MEMORYOS_GPU_LOCOMO`` (no ``--data``): missing,
    a one-line error naming the variable (exit 2), before the run."""
    if not Path(path).is_file():
        parser.error(f"LoCoMo data not found at {path} (set MEMORYOS_GPU_LOCOMO)")


def load_locomo_data(parser: argparse.ArgumentParser, path: str | Path) -> list[Conversation]:
    """``--data`` read as a LoCoMo file, or a one-line error (``parser.error``: exit 2) before
    the run, as ``memoryos-gpu eval`` gives: a missing file, one that cannot be read, or one that
    is not LoCoMo (``load_locomo``'s ``ValueError``, e.g. a JSONL chat log). One rule for every
    script taking ``--data``, so none of them ends in a traceback on a wrong file."""
    from memoryos_gpu.eval.locomo import load_locomo

    check_input(parser, path)
    try:
        return load_locomo(path)
    except ValueError as exc:  # UnicodeDecodeError included
        parser.error(f"not a LoCoMo file: {exc}")
    except OSError as exc:  # a directory, no permission, a broken gzip stream
        parser.error(f"cannot read {path}: {exc.strerror or exc}")


def check_locomo_work(
    parser: argparse.ArgumentParser,
    path: str | Path,
    convs: list[Conversation],
    *,
    scored: bool,
) -> None:
    """Refuse (one line, exit 2) the conversations a script would run on when they give it
    nothing to do, instead of a table of NaN reported as success (or a crash mid-run).
    ``convs``: what the script keeps of ``path`` (after --quick and the like). ``scored``: the
    script scores evidence recall, so it needs a category 1-4 question with evidence, as
    ``memoryos-gpu eval`` does; every script needs a question's text to query with and a
    conversation turn to ingest."""
    questions = [q for c in convs for q in c.questions]
    if scored and not any(q.scored for q in questions):
        parser.error(f"{path} has no question of categories 1-4 with evidence: nothing to score")
    if not any(q.question for q in questions):
        parser.error(f"{path} has no question: nothing to query with")
    if not any(c.pages for c in convs):
        parser.error(f"{path} has no conversation turn: nothing to ingest")


def strict(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (no NaN/Infinity tokens: those become null)."""
    return json.dumps(strict(obj), allow_nan=False, **kw)


#: The files ``write_json`` wrote in this process (``run`` names them when interrupted).
written: list[Path] = []


def write_json(path: str | Path, obj: Any, *, indent: int | None = 2, **kw: Any) -> Path:
    """Write ``obj`` as strict JSON (NaN/inf -> null) with a trailing newline, atomically: a
    temporary file in the same folder, then ``os.replace``, so a failed serialisation or an
    interrupt never leaves a partial file (an existing one stays as it was)."""
    path = Path(path)
    text = dumps(obj, indent=indent, **kw) + "\n"  # fails before any file is touched
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if path not in written:
        written.append(path)
    return path


_first_sigterm: list[float] = []


def _on_sigterm(signum: int, frame: Any) -> None:
    # as Ctrl-C: the finally blocks run (servers stopped, temporary stores removed)
    import time

    now = time.monotonic()
    if not _first_sigterm:
        _first_sigterm.append(now)
        raise KeyboardInterrupt(f"signal {signum}")
    # `timeout` signals the process and then its group: that echo must not cut the cleanup
    # short; a SIGTERM sent later, while cleanup hangs, ends the process outright
    if now - _first_sigterm[0] > 2.0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def handle_sigterm() -> None:
    """Turn SIGTERM (``kill``, ``timeout``) into KeyboardInterrupt in the main thread."""
    if sys.platform != "win32":
        signal.signal(signal.SIGTERM, _on_sigterm)


def today() -> str:
    """The run's date and time (UTC, ISO 8601), as every JSON report records it."""
    import datetime

    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model and count, platform, Python. The one
    machine description of every benchmark's JSON (``platform.processor()`` alone is empty on
    Linux; the model comes from /proc/cpuinfo there)."""
    import platform

    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def run_main(main: Callable[[], Any], child_flags: tuple[str, ...] = ("--child",)) -> NoReturn:
    """A script's ``__main__``: ``main()``'s int as the exit status (anything else: 0); Ctrl-C
    or SIGTERM ends it with one line on stderr, exit 130, instead of a traceback. The JSON is
    written atomically at the end, so an interrupted run leaves none (the line names what was
    written before, e.g. throughput.py's report after each size)."""
    handle_sigterm()
    try:
        rc = main()
    except KeyboardInterrupt:
        if any(a.split("=", 1)[0] in child_flags for a in sys.argv[1:]):
            sys.exit(130)  # a script's own child process: its parent says it
        done = ", ".join(map(str, written))
        print(
            f"\ninterrupted; {'wrote only ' + done if done else 'nothing written'}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)

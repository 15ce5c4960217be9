"""Small helpers the benchmark scripts share: argparse types, early output checks, strict JSON
and SIGTERM handling.

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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memoryos_gpu.eval.locomo import Conversation


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


def write_json(path: str | Path, obj: Any, *, indent: int | None = 2, **kw: Any) -> Path:
    """Write ``obj`` as strict JSON (NaN/inf -> null) with a trailing newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(obj, indent=indent, **kw) + "\n")
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
    """The run's date and time (UTC), as the JSON reports record it."""
    import time

    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model and count, platform, Python."""
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

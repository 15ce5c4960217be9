"""The one logging setup of every process memoryos-gpu serves from, and the log helpers they share.

Every entry point that configures logging calls :func:`setup_logging`: ``serve`` in one
process, each HTTP worker and engine process of ``serve --workers`` (spawned: nothing of the
parent's setup survives), the MCP server. It gives all of them

* one line format, timestamp and process tag included (``[worker 0]``, ``[engine]``), for
  uvicorn's lines too: uvicorn is told not to configure logging (:func:`uvicorn_logging`), so
  its records reach the same handler instead of its own untimed ``INFO:     ...`` one;
* a filter on the handlers that masks secrets in every record (:func:`redact`: a URL's
  ``user:password@``, bearer tokens, ``Authorization`` / ``api_key`` values, ``password=``
  parameters), whatever logger it comes from and at any level: a library's DEBUG line
  (httpx's, a driver's) cannot be reviewed here, so the mask is applied at the one place every
  line passes;
* httpx / httpcore at WARNING unless DEBUG is asked for: at INFO they log one line per LLM or
  embedding request (the full URL, a password in it included), a flood under load.

:class:`LogThrottle` is the one way a line that a persistent failure repeats per request (the
LLM down, the disk full, a stage falling back every wave) is logged: the first occurrence of
its kind at once, then at most one line per :data:`THROTTLE_S` seconds saying how many were
left out. Each site's owner holds one (a module of the server, an engine's stages), so a new
owner, say an engine opened again, logs its first failure at once. :func:`announce_loaded`
writes the one startup line that says what the server loaded.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "LOG_LEVELS",
    "THROTTLE_S",
    "LogThrottle",
    "RedactSecrets",
    "announce_loaded",
    "loaded_line",
    "redact",
    "setup_logging",
    "uvicorn_logging",
]

#: The levels ``--log-level`` takes (any case) in ``serve`` and ``mcp``.
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
#: Seconds between two lines of one kind under a :class:`LogThrottle`.
THROTTLE_S = 60.0
#: Libraries that log one INFO line per HTTP request they make (the URL in it).
CHATTY_LOGGERS = ("httpx", "httpcore")
#: uvicorn's loggers: their handlers go, their records propagate to the root's.
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
_FORMAT = "%(asctime)s %(levelname)s %(name)s{tag}: %(message)s"
_MASK = "***"
_SECRETS: tuple[tuple[re.Pattern[str], str], ...] = (
    # scheme://user:password@host: the password, up to the userinfo's last '@' (an unencoded
    # '@' in a password is common); a '/', '?', '#' or blank ends the authority
    (re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@]*):[^\s/?#]*@"), rf"\1:{_MASK}@"),
    # a header as a dict or a line: Authorization: Bearer KEY, {'authorization': 'Basic ...'}
    (re.compile(r"(?i)(\bauthorization[\"']?\s*[:=]\s*[\"']?)[^\"'\n,}]+"), rf"\1{_MASK}"),
    (re.compile(r"(?i)(\bbearer\s+)[A-Za-z0-9._~+/=\-]+"), rf"\1{_MASK}"),
    (re.compile(r"(?i)(\bapi[_\-]?key[\"']?\s*[:=]\s*[\"']?)[^\s\"',}&]+"), rf"\1{_MASK}"),
    (re.compile(r"(?i)([?&;\s](?:ssl)?password=)[^&\s\"']*"), rf"\1{_MASK}"),
)


def redact(text: str) -> str:
    """``text`` with the secrets a log line may carry masked (see the module's docstring)."""
    for pattern, repl in _SECRETS:
        text = pattern.sub(repl, text)
    return text


class RedactSecrets(logging.Filter):
    """A handler filter that masks secrets in a record's message, traceback and stack before
    any formatter sees them. The record is rewritten (not only its output) so that every
    handler after this one, a test's capture included, gets the masked text."""

    _exceptions = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if masked != message:  # unchanged: the args stay, for formatters that read them
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._exceptions.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


class _StderrHandler(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is at each line: one bound to the stream of
    its setup would write to a closed one once that was swapped (a test's capture)."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        """Ignored: the stream is always the current stderr."""


def level_number(level: str | int) -> int:
    """``"info"`` / ``"INFO"`` / ``logging.INFO`` as a number; ValueError for another name (a
    misspelt level taken for some default would hide every line the user asked for)."""
    if isinstance(level, int):
        return level
    name = str(level).upper()
    if name not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of: {', '.join(LOG_LEVELS)}")
    return int(getattr(logging, name))


def setup_logging(level: str | int = "INFO", *, tag: str = "") -> None:
    """Configure this process's logging: the root at ``level`` with one stderr handler in the
    shared format (``tag``: the process, e.g. ``worker 0``, shown after the logger's name), the
    secret filter on every root handler, the chatty HTTP clients quiet unless DEBUG, uvicorn's
    loggers sent to the root. Stderr only: the MCP server's stdout carries its protocol.

    A root that already has handlers of another setup (a program that embeds ``run()`` and
    configured logging itself; a test runner) keeps them and its level, as with
    ``logging.basicConfig``; they still get the secret filter. Calling it again (a second
    ``run()`` in one process) updates this setup, adding nothing."""
    number = level_number(level)
    root = logging.getLogger()
    ours = next((h for h in root.handlers if isinstance(h, _StderrHandler)), None)
    if ours is not None or not root.handlers:
        _install(root, ours, number, tag)
    for h in root.handlers:
        if not any(isinstance(f, RedactSecrets) for f in h.filters):
            h.addFilter(RedactSecrets())
    chatty = number if number <= logging.DEBUG else max(number, logging.WARNING)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(chatty)
    for name in UVICORN_LOGGERS:  # a configuration uvicorn made earlier in this process goes
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.propagate = True


def _install(root: logging.Logger, handler: logging.Handler | None, level: int, tag: str) -> None:
    """The root at ``level`` with ``handler`` (a new stderr one if None) in the format."""
    root.setLevel(level)
    if handler is None:
        handler = _StderrHandler()
        root.addHandler(handler)
    handler.setFormatter(logging.Formatter(_FORMAT.format(tag=f"[{tag}]" if tag else "")))


def uvicorn_logging(level: str | int) -> dict[str, Any]:
    """The logging keywords of every ``uvicorn.run`` / ``uvicorn.Config`` here: no
    ``log_config`` of uvicorn's own (its handlers would print its lines without timestamp nor
    process tag, and bypass the secret filter), its loggers at the server's level."""
    return {"log_config": None, "log_level": logging.getLevelName(level_number(level)).lower()}


class LogThrottle:
    """Rate-limits log lines by kind: the first of a kind is logged at once; later ones within
    ``interval_s`` of the last line logged are counted, not logged; the next one after that is
    logged with the count left out. O(1) per call (a dict lookup under a lock: engine threads
    and the event loop both log). Nothing is said once the failure stops: its last line stands,
    and the counters (metrics, ``/v1/stats``) keep the exact numbers."""

    def __init__(
        self, interval_s: float = THROTTLE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (last line's time, left out)

    def log(self, logger: logging.Logger, kind: str, level: int, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` on ``logger`` unless ``kind`` had a line within the interval;
        whether it was logged."""
        if not logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            last, left_out = self._last.get(kind, (None, 0))
            if last is not None and now - last < self.interval_s:
                self._last[kind] = (last, left_out + 1)
                return False
            self._last[kind] = (now, 0)
        if left_out:
            msg = f"{msg} [{left_out} more like this in the last {now - last:.0f} s not logged]"
        logger.log(level, msg, *args)
        return True


# ============================================================================ startup line
def loaded_line(engine: Any, seconds: float) -> str:
    """What the server loaded, in one line: the store (a URL password-masked), the embedder,
    the LLM (mode, backend, model, endpoint masked), the device, the users and pages loaded,
    and how long the load took. Read from the engine's config and ``stats()`` (one count of the
    store's rows, once)."""
    config = getattr(engine, "config", None)
    stats = engine.stats()
    counts = stats.get("store") or {}
    pages = sum(n for k, n in counts.items() if k.startswith("pages_") and k != "pages_evicted")
    from memoryos_gpu.cli.stores import shown  # the store as every message shows it

    parts = [
        f"store {shown(str(getattr(config, 'store', '?')))}",
        f"embedder {_embedder(config)}",
        f"LLM {_llm(config)}",
        f"device {stats.get('device', '?')}",
        f"{stats.get('users', '?')} user(s), {pages} page(s)",
    ]
    return f"memoryos-gpu: loaded in {seconds:.1f} s: " + "; ".join(parts)


def _embedder(config: Any) -> str:
    from memoryos_gpu.llm.openai_compat import redact_url

    kind = getattr(config, "embedder", "?")
    where = getattr(config, "embedding_base_url", None) if kind == "openai" else None
    model = getattr(config, "embedding_model", None)
    return " ".join(str(x) for x in (kind, model, where and redact_url(where)) if x)


def _llm(config: Any) -> str:
    from memoryos_gpu.llm.openai_compat import redact_url

    llm = getattr(config, "llm", None)
    if llm is None or llm.mode != "llm":
        return "extractive (no LLM)"
    return " ".join(
        str(x) for x in (llm.backend, llm.model, llm.base_url and redact_url(llm.base_url)) if x
    )


async def announce_loaded(service: Any, logger: logging.Logger, started: float) -> None:
    """Once ``service`` (a MemoryService started with ``wait=False``) has loaded its engine,
    log :func:`loaded_line` at INFO. A failed or abandoned load says nothing here (the service
    logged why); a service with no load of its own (a worker's remote one) neither."""
    loaded = getattr(service, "loaded", None)
    if loaded is None or not logger.isEnabledFor(logging.INFO):
        return
    if not await loaded():
        return
    seconds = time.monotonic() - started
    try:
        line = await asyncio.get_running_loop().run_in_executor(
            None, loaded_line, service.engine, seconds
        )
    except Exception as exc:  # a store that failed right after the load: the line is not worth one
        logger.info("memoryos-gpu: loaded in %.1f s (%s)", seconds, exc)
        return
    logger.info("%s", line)

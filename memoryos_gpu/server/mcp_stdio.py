"""The MCP server's stdio transport: the SDK's ``stdio_server`` with four differences.

* A line that is not a JSON-RPC message gets a JSON-RPC error reply (``id`` null), as the
  streamable HTTP transport answers one, and the next lines are served: ``-32700`` ("Parse
  error: ...") for a line that is not JSON (``{not json``, a lone surrogate escape such as
  ``"\\ud83d"``, which the SDK's JSON parser refuses, like any invalid JSON), ``-32600``
  ("Invalid Request: ...") for JSON that is no message (a batch array, say). The SDK's
  reader hands the session an exception that it drops, so the client waits for ever.
* A client gone away (its end of stdout closed: ``BrokenPipeError``) is one INFO line and
  the end of the session, not an ``ExceptionGroup`` traceback and exit status 1.
* stdin is read by a daemon thread, so that the session can end while it waits for a line
  (a signal's stop), where the SDK's worker thread held the process until stdin closed.
* At the end of stdin the requests read are answered before the session ends: a client that
  writes its calls and closes its end (a pipe) got ``Connection closed`` for the calls in
  flight, a write among them committed all the same (a retry stored it twice).

Like the SDK's, it serves fd 0 and 1 from private duplicates while fd 0 reads the null
device and fd 1 writes to stderr (a stray print cannot corrupt the wire), where the SDK's
helpers for it are there (they are private: without them, the std streams as they are).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any, BinaryIO

import anyio
import anyio.from_thread
import anyio.lowlevel
import mcp_types as types
import pydantic_core
from mcp.shared._context_streams import create_context_streams
from mcp.shared.message import SessionMessage

log = logging.getLogger(__name__)

__all__ = ["EOF_ANSWER_S", "error_reply", "stdio_transport"]

#: How long the session waits, once stdin closed, for the answers to the requests it read.
EOF_ANSWER_S = 30.0


def error_reply(line: bytes | str) -> tuple[SessionMessage | None, dict[str, Any] | None]:
    """The message on ``line``, or the JSON-RPC error to answer it with (``id``: the line's
    when it is an object with a usable id, else null)."""
    try:
        raw = pydantic_core.from_json(line)
    except ValueError as exc:
        return None, _error(None, types.PARSE_ERROR, f"Parse error: {exc}")
    try:
        return SessionMessage(
            types.jsonrpc_message_adapter.validate_python(raw, by_name=False)
        ), None
    except pydantic_core.ValidationError as exc:
        rid = raw.get("id") if isinstance(raw, dict) else None
        if isinstance(rid, bool) or not isinstance(rid, (int, str)):
            rid = None
        what = "a batch (arrays are not served)" if isinstance(raw, list) else _first(exc)
        return None, _error(rid, types.INVALID_REQUEST, f"Invalid Request: {what}")


def _note_request(message: Any, pending: set[int | str]) -> None:
    """Keep ``pending`` (the ids of the client's requests not answered yet) current with a
    message from the client: a request joins it, a cancellation takes its request out (the
    server sends no answer to a request the client cancelled)."""
    if isinstance(message, types.JSONRPCRequest):
        pending.add(message.id)
    elif isinstance(message, types.JSONRPCNotification) and message.method == (
        "notifications/cancelled"
    ):
        pending.discard((message.params or {}).get("requestId"))


def _first(exc: pydantic_core.ValidationError) -> str:
    """One line from a union's validation error (the first of its errors, with its place)."""
    errors = exc.errors(include_url=False)
    if not errors:
        return "not a JSON-RPC message"
    e = errors[0]
    where = ".".join(str(p) for p in e.get("loc", ())[1:])
    return f"{where}: {e['msg']}" if where else str(e["msg"])


def _error(rid: int | str | None, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}


def _std_streams() -> tuple[BinaryIO, BinaryIO, Callable[[], None]]:
    """stdin's and stdout's byte streams (claimed as the SDK claims them, when it can) and
    what gives the descriptors back."""
    try:
        from mcp.server.stdio import _claim_fd, _open_stdin_diversion, _open_stdout_diversion
    except ImportError:  # the SDK's private helpers moved: serve the std streams in place
        return sys.stdin.buffer, sys.stdout.buffer, lambda: None
    stdin, restore_in = _claim_fd(0, sys.stdin, "rb", _open_stdin_diversion)
    try:
        stdout, restore_out = _claim_fd(1, sys.stdout, "wb", _open_stdout_diversion)
    except BaseException:
        if restore_in is not None:
            restore_in()
        raise

    def restore() -> None:
        for undo in (restore_out, restore_in):
            if undo is not None:
                undo()

    return stdin, stdout, restore


@asynccontextmanager
async def stdio_transport(
    stdin: BinaryIO | None = None,
    stdout: BinaryIO | None = None,
    on_gone: Callable[[], None] | None = None,
) -> AsyncIterator[tuple[Any, Any]]:
    """``(read_stream, write_stream)`` for ``Server.run`` over the process's stdin and stdout
    (or the byte streams given). The read stream ends at EOF, once the requests read are
    answered (at most :data:`EOF_ANSWER_S`); ``on_gone()`` is called once when stdout is
    found closed (the client went away), after which replies are dropped."""
    restore: Callable[[], None] = lambda: None  # noqa: E731
    if stdin is None or stdout is None:
        std_in, std_out, restore = _std_streams()
        stdin = stdin or std_in
        stdout = stdout or std_out
    try:
        read_writer, read_stream = create_context_streams[SessionMessage | Exception](0)
        write_stream, write_reader = create_context_streams[SessionMessage](0)
        lines_send, lines_recv = anyio.create_memory_object_stream[bytes](0)
        out_lock = anyio.Lock()
        gone = False
        pending: set[int | str] = set()  # the ids of the client's requests not answered yet

        async def emit(text: str) -> None:
            nonlocal gone
            if gone:
                return
            data = (text + "\n").encode("utf-8", "surrogateescape")

            def write() -> None:
                stdout.write(data)
                stdout.flush()

            async with out_lock:
                try:
                    await anyio.to_thread.run_sync(write, abandon_on_cancel=True)
                except (BrokenPipeError, ConnectionResetError, ValueError, OSError) as exc:
                    gone = True
                    log.info("the MCP client went away (stdout: %s); ending the session", exc)
                    if on_gone is not None:
                        on_gone()

        token = anyio.lowlevel.current_token()

        def read_lines() -> None:  # a daemon thread: it never holds the process
            try:
                for line in iter(stdin.readline, b""):
                    anyio.from_thread.run(lines_send.send, line, token=token)
            except Exception:  # the loop is gone or the stream closed: nothing to read for
                pass
            finally:
                with suppress(Exception):
                    anyio.from_thread.run_sync(lines_send.close, token=token)

        async def reader() -> None:
            async with read_writer, lines_recv:
                async for line in lines_recv:
                    if not line.strip():
                        continue
                    message, error = error_reply(line)
                    if message is not None:
                        _note_request(message.message, pending)
                        await read_writer.send(message)
                    elif error is not None:
                        await emit(json.dumps(error, separators=(",", ":"), ensure_ascii=False))
                # stdin closed: the requests read are answered first (the session would end
                # them with "Connection closed", a write among them committed all the same)
                with anyio.move_on_after(EOF_ANSWER_S):
                    while pending and not gone:
                        await anyio.sleep(0.01)

        written = anyio.Event()

        async def writer() -> None:
            try:
                async with write_reader:
                    async for session_message in write_reader:
                        message = session_message.message
                        await emit(message.model_dump_json(by_alias=True, exclude_unset=True))
                        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError):
                            pending.discard(message.id)
            finally:
                written.set()

        threading.Thread(target=read_lines, name="mcp-stdin", daemon=True).start()
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(writer)
            try:
                yield read_stream, write_stream
            finally:
                # the replies sent so far go out (the server has stopped sending); then stop
                write_stream.close()
                with anyio.move_on_after(5, shield=True):
                    await written.wait()
                tg.cancel_scope.cancel()
    finally:
        restore()

"""A deadline for a request's headers, which uvicorn reads with none of its own.

Why: a client that opens connections and sends nothing, or its headers a byte at a time (the
"slowloris" attack), held each connection, and the memory and file descriptor behind it, for
as long as it liked; the body already had its deadline (``body_timeout_s``, the edge's 408),
the headers had none. This is uvicorn's httptools protocol with a timer per request: armed
when the connection opens and when a request's first byte arrives on a kept-alive one,
disarmed when its headers are complete. Past ``header_timeout_s`` the connection is closed,
with a 408 when a request had begun. The timer is one ``call_later`` per request: no work
per byte.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("memoryos_gpu.server")

_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-type: text/plain; "
    b"charset=utf-8\r\ncontent-length: 29\r\n\r\nthe request headers timed out"
)


def header_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools HTTP protocol whose requests must send their whole headers within
    ``seconds`` (for ``uvicorn.run(..., http=...)``)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    if not seconds > 0:
        raise ValueError("the header timeout must be > 0 seconds")

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _begun = False  # a request's first byte arrived and its headers are not complete

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._begun = True
            self._arm()

        def on_headers_complete(self) -> None:
            self._begun = False
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            log.debug(
                "%s: closed a connection whose request headers took over %s s", self.client, seconds
            )
            if self._begun:
                self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()

    return HeaderDeadlineProtocol

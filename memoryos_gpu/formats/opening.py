"""Opening an input for reading: gzip found by content, and pipes that can be read only once.

:func:`open_binary` gunzips transparently when the input starts with the gzip magic bytes (not by
file extension). A stream input (:func:`is_stream`: ``/dev/stdin`` fed by a pipe, a process
substitution) cannot be read twice, yet its format is sniffed before it is read: it is read
ahead once into memory (:func:`open_head` serves the sniffing from that read-ahead) and
:func:`open_binary` then hands out the read-ahead followed by the rest of the pipe, once.

A gzip file is checked whole before it is read (:func:`check_integrity`): gzip's CRC and length
are checked only at the end of each member, so a damaged byte used to reach the readers as
garbled records (some stored under real users) before the error. A pipe cannot be read twice,
so it is not checked ahead: its corruption is found where the read reaches it (see
``docs/formats.md``). Other compressions (bzip2, xz, zstd) are not read; :func:`foreign_encoding`
names them, and byte-order marks of UTF-16 and UTF-32, so the format detection can say so.

Kept apart from the readers (:mod:`.readers`) because nothing here knows JSON or the formats:
it only turns a path into a byte stream.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import threading
import zlib
from dataclasses import dataclass
from typing import IO, Any

__all__ = [
    "CorruptInputError",
    "check_integrity",
    "foreign_encoding",
    "is_stream",
    "open_binary",
    "open_head",
]

_GZIP_MAGIC = b"\x1f\x8b"
# Read ahead from a pipe to detect its format (it cannot be read twice), and the most that the
# read-ahead of a gzip pipe may decompress to.
_HEAD_BYTES = 4 << 20
_HEAD_PLAIN_BYTES = 16 << 20
# The read-ahead of a plain pipe goes on past ``_HEAD_BYTES`` to the end of its first non-blank
# line, up to this many bytes of it: at least the longest line a reader takes
# (``readers.MAX_LINE_BYTES``), so a JSONL pipe whose first page is long is still recognised.
_FIRST_LINE_BYTES = 24 << 20
_NON_BLANK = re.compile(rb"\S")
_EXTEND_CHUNK = 1 << 20
_CHECK_CHUNK = 1 << 20  # decompressed bytes per read of the integrity check
#: What an input that is not UTF-8 text nor gzip starts with, and what it is: checked in order
#: (a UTF-32 LE BOM starts with the UTF-16 LE one). None of these can start UTF-8 JSON text.
_FOREIGN_STARTS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
)
_BZIP2 = re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)")


class CorruptInputError(OSError):
    """A compressed input that does not decompress intact to its end (a CRC or length that does
    not match, a damaged or truncated stream): refused as a whole (:func:`check_integrity`)."""


def check_integrity(path: str | os.PathLike[str]) -> None:
    """Decompress a gzip file once to its end, every member's CRC and length checked, before
    any of its records is read; :class:`CorruptInputError` naming what is wrong when it does
    not decompress intact. Nothing for a file that is not gzip, and for a stream input
    (:func:`is_stream`), which can be read only once: its corruption is found by the read.

    Why: gzip checks a member's CRC only at its end, so the records decompressed from a damaged
    byte on (garbled text, under real user ids) were stored before the error. Decompressing
    costs a few seconds a GB of text (about 400 MB/s), little next to embedding the pages."""
    if is_stream(path):
        return
    with open(path, "rb") as raw:
        if raw.read(2) != _GZIP_MAGIC:
            return
        raw.seek(0)
        try:
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                while gz.read(_CHECK_CHUNK):
                    pass
        except (OSError, EOFError, zlib.error) as exc:
            raise CorruptInputError(_corrupt("gzip file", exc)) from None


def _corrupt(what: str, exc: BaseException) -> str:
    """The message of a corrupt compressed input, refused before any of its records is read."""
    return (
        f"corrupt {what}, refused as a whole: none of its records was read "
        f"(cannot read further: {exc})"
    )


def foreign_encoding(head: bytes) -> str | None:
    """What an input starting with ``head`` (its first bytes, gunzipped) is, when it is
    certainly neither UTF-8 text nor gzip: a UTF-16 or UTF-32 byte-order mark, a bzip2, xz or
    zstd stream. None otherwise."""
    found = next((what for magic, what in _FOREIGN_STARTS if head.startswith(magic)), None)
    if found is None and _BZIP2.match(head):
        found = "bzip2"
    if found is None:
        return None
    if found.startswith("UTF"):
        return (
            f"not UTF-8 ({found} BOM found): convert it to UTF-8 first "
            f"(e.g. iconv -f {found} -t UTF-8)"
        )
    return f"{found}-compressed, which is not read (only gzip is): decompress it first"


def is_stream(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a pipe, socket or terminal (``/dev/stdin`` fed by a pipe, a process
    substitution ``<(...)``): readable once, not seekable. Such an input is sniffed from a
    read-ahead kept in memory (:func:`open_head`) and read in full only once (:func:`open_binary`).
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISBLK(mode) or stat.S_ISDIR(mode))


class _Chain(io.RawIOBase):
    """The bytes already read ahead from a pipe, then the rest of the pipe."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head = memoryview(head)
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self._head:
            n = min(len(buf), len(self._head))
            buf[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._rest.readinto(buf)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._head = memoryview(b"")
        self._rest.close()
        super().close()


@dataclass
class _Pipe:
    """A stream input: its read-ahead (raw and, for gzip, decompressed), the open stream."""

    head: bytes
    plain: bytes  # ``head`` decompressed when gzip (a prefix of the content), else ``head``
    eof: bool  # the read-ahead holds the whole input
    rest: IO[bytes] | None  # None once handed to the full read
    # why the read-ahead of a gzip pipe does not decompress (corrupt), else None
    error: str | None = None


_PIPES: dict[tuple[int, int], _Pipe] = {}
_PIPES_LOCK = threading.Lock()


def _pipe(path: str | os.PathLike[str]) -> _Pipe:
    """The one :class:`_Pipe` of a stream input (keyed by device and inode, so ``/dev/stdin``
    and ``/dev/fd/0`` are the same), opened and read ahead on first use."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino)
    with _PIPES_LOCK:
        got = _PIPES.get(key)
        if got is None:
            f = open(path, "rb")  # noqa: SIM115 - kept until the full read takes it
            head = f.read(_HEAD_BYTES)
            eof = len(head) < _HEAD_BYTES
            if not eof and head[:2] != _GZIP_MAGIC:
                head, eof = _to_end_of_first_line(f, head)
            plain, error = head, None
            if head[:2] == _GZIP_MAGIC:
                try:
                    plain = zlib.decompressobj(31).decompress(head, _HEAD_PLAIN_BYTES)
                except zlib.error as exc:
                    # corrupt within the read-ahead: refused before anything is read (an
                    # empty read-ahead would have passed for an empty input)
                    plain, error = b"", _corrupt("gzip pipe", exc)
            got = _PIPES[key] = _Pipe(head, plain, eof, f, error)
        return got


def _to_end_of_first_line(f: IO[bytes], head: bytes) -> tuple[bytes, bool]:
    """``(head, eof)``: ``head`` read on from ``f`` until it holds the end of its first
    non-blank line, or that line's first ``_FIRST_LINE_BYTES`` (a longer one is no page anyway).

    Why: the format is sniffed from the read-ahead, and a JSONL line cut at its end would not
    parse, so a pipe whose first page is longer than ``_HEAD_BYTES`` would be refused."""
    start = m.start() if (m := _NON_BLANK.search(head)) else len(head)
    if head.find(b"\n", start) >= 0:
        return head, False
    parts = [head]
    size = len(head)
    while size - start < _FIRST_LINE_BYTES:
        chunk = f.read(_EXTEND_CHUNK)
        parts.append(chunk)
        size += len(chunk)
        if len(chunk) < _EXTEND_CHUNK:
            return b"".join(parts), True
        if b"\n" in chunk:
            break
    return b"".join(parts), False


def open_head(path: str | os.PathLike[str]) -> tuple[IO[bytes], bool]:
    """``(stream, complete)`` to sniff ``path`` from: the file itself (``complete``), or for a
    stream input (:func:`is_stream`) its read-ahead, decompressed (``complete`` when it holds
    the whole input). Reading it does not consume the input. :class:`CorruptInputError` for a
    gzip pipe whose read-ahead does not decompress."""
    if not is_stream(path):
        return open_binary(path), True
    p = _pipe(path)
    if p.error is not None:
        raise CorruptInputError(p.error)
    return io.BytesIO(p.plain), p.eof


def open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open ``path`` for binary reading, gunzipping transparently when it starts with gzip magic.

    Detection is by content (the two magic bytes), not by file extension. A stream input
    (:func:`is_stream`) can be opened so only once: ``OSError`` the second time.
    """
    if is_stream(path):
        return _open_stream(path)
    f = open(path, "rb")  # noqa: SIM115 - returned to the caller
    try:
        magic = f.read(2)
    except BaseException:
        f.close()
        raise
    if magic == _GZIP_MAGIC:
        f.close()
        return gzip.open(path, "rb")  # type: ignore[return-value]
    f.seek(0)
    return f


def _open_stream(path: str | os.PathLike[str]) -> IO[bytes]:
    """The whole of a stream input: its read-ahead, then the rest (gunzipped when gzip)."""
    p = _pipe(path)
    with _PIPES_LOCK:
        rest, p.rest = p.rest, None
    if rest is None:
        raise OSError(f"{os.fspath(path)} is a pipe and was read already: it can be read once")
    gz = p.head[:2] == _GZIP_MAGIC
    raw = io.BufferedReader(_Chain(p.head, rest), 1 << 16)
    p.head = b""  # the chain holds it now; ``plain`` stays for later sniffing
    return gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw  # type: ignore[return-value]


class _Opened:
    """``with _Opened(path) as f``: :func:`open_binary` (``sniff``: :func:`open_head`) as a
    context manager."""

    def __init__(self, path: str | os.PathLike[str], sniff: bool = False) -> None:
        self.f = open_head(path)[0] if sniff else open_binary(path)

    def __enter__(self) -> IO[bytes]:
        return self.f

    def __exit__(self, *exc: object) -> None:
        self.f.close()

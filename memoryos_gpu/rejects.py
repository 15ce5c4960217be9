"""The rejects file of ``memoryos-gpu ingest``: its rows, the kinds the report counts them
under, and the removal of a deleted user's rows.

Why a module of its own: every ingestion path writes these rows (one process, ``--workers``'
shard processes, ``--ray``'s driver), ``delete`` and the engine's user deletion scrub them (a
deleted user's refused records are still their words, in plain text beside the store), and
none of that is the ingestion pipeline's business.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from memoryos_gpu.formats import Record, normalise_text
from memoryos_gpu.formats.timestamps import refusal_kind
from memoryos_gpu.store import SHARDS_FILE, STORE_FILE, STORE_FILE_SUFFIXES, is_url

__all__ = [
    "REJECTS_FILE",
    "RejectRow",
    "count_rejects",
    "default_rejects_files",
    "default_rejects_path",
    "encrypt_rejects",
    "forget_rejects",
    "reason_kind",
    "record_reject",
    "refuse_rejects_path",
    "store_dir",
]


@dataclass
class RejectRow:
    """One rejected input item: where it was, why, and what it was (truncated)."""

    file: str
    line: int
    reason: str
    raw: str = ""
    stage: str = "read"  # "read" (the reader refused it) or "validate" (the engine did)
    source: str | None = None
    # the record's user (validate stage; the reader trusts no user id of what it refused):
    # what `delete --user` finds the user's rows by (forget_rejects)
    user_id: str | None = None

    def message(self) -> str:
        return f"{self.file}:{self.line}: rejected: {self.reason}"

    def as_json(self, *, raw: bool = True) -> str:
        """The row as one line of the rejects file. ``raw=False`` leaves the record's content
        and user out (where and why stay): the file is plain text, so beside an encrypted store
        it must not hold what the store encrypts. The why is then the reason's kind without any
        value (:func:`reason_kind`): a reason quotes the record (``unparseable timestamp
        '...'``, ``user '...' belongs to assistant '...'``)."""
        row = asdict(self)
        if not raw:
            del row["raw"], row["user_id"]
            row["reason"] = reason_kind(self.reason)
        return json.dumps(row, ensure_ascii=False) + "\n"


def store_dir(store: str | os.PathLike[str]) -> Path:
    """The directory of a store given as a directory or as a ``.sqlite3``/``.db`` file."""
    p = Path(store)
    return p.parent if p.suffix in STORE_FILE_SUFFIXES else p


REJECTS_FILE = "rejects.jsonl"  # `memoryos-gpu ingest`'s default rejects file, in the store dir
# One scrub at a time in a process: two deletions rewriting one file at once would each rename
# a copy holding the other's user over it. Across processes the store's writer claim, which
# every deleting process holds, keeps them apart.
_SCRUBBING = threading.Lock()


def default_rejects_path(store: str) -> str | None:
    """Where ``memoryos-gpu ingest`` writes rejects by default: ``STORE/rejects.jsonl`` for a
    store in a folder; None for a PostgreSQL URL or ``:memory:`` (no folder)."""
    if store == ":memory:" or is_url(store):
        return None
    return str(store_dir(store) / REJECTS_FILE)


def default_rejects_files(store: str | os.PathLike[str]) -> list[Path]:
    """The rejects files ``memoryos-gpu ingest`` leaves in a store's folder by default and
    that exist: ``STORE/rejects.jsonl`` (a plain run; ``--workers``' merged file; ``--ray``'s)
    and ``STORE/shard-*/rejects.jsonl`` (each ``--workers`` shard process's). None for a
    PostgreSQL URL or ``:memory:``: no folder (only ``--rejects FILE`` writes one there)."""
    spec = os.fspath(store)
    if spec == ":memory:" or is_url(spec):
        return []
    base = store_dir(spec)
    found = [base / REJECTS_FILE, *sorted(base.glob(f"shard-*/{REJECTS_FILE}"))]
    return [f for f in found if f.is_file()]


#: A SQLite store's own files, by their suffix after the database's name: the database, its
#: logs and its writer lock (:func:`memoryos_gpu.store.writer`'s ``<database>.lock``).
_STORE_SIDECARS = {
    "": "",
    "-wal": "write-ahead log ",
    "-shm": "shared-memory index ",
    "-journal": "journal ",
    ".lock": "writer lock ",
}
_SHARD_DIR = re.compile(r"shard-\d+")


def refuse_rejects_path(
    rejects: str | os.PathLike[str],
    store: str,
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """``ValueError`` when ``rejects`` cannot be the rejects file of a run into ``store`` that
    reads ``inputs``; nothing when it can. Why: the rejects file is opened for writing
    (truncated) before anything is read, so a path naming the store's database (or its log,
    its lock, a shard's database, the shard manifest) wiped the store, and one naming an
    input file erased the input before it was read (the run then "succeeded" with nothing).
    A directory is refused too, in words rather than as ``[Errno 21]``. Paths are compared
    resolved (a symlink, ``./`` or ``..`` variant is the same path) and, for files that
    exist, by identity (a hard link is the same file). Call it before opening anything."""
    spec = os.fspath(rejects)
    if os.path.isdir(spec):
        raise ValueError(
            f"{spec} is a directory: give a file path, e.g. {os.path.join(spec, REJECTS_FILE)}"
        )
    what = _store_file_named(spec, store) or _input_named(spec, inputs)
    if what is not None:
        raise ValueError(
            f"{spec} is {what}: the rejects file is overwritten, so that would erase it; "
            f"give another file (default: {REJECTS_FILE} in the store's folder)"
        )


def _same(a: str, b: str | os.PathLike[str]) -> bool:
    """Whether paths ``a`` and ``b`` name the same file: resolved alike, or (both existing)
    the same inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _store_file_named(spec: str, store: str) -> str | None:
    """What of ``store``'s own files ``spec`` names, in words; None when none."""
    if store == ":memory:" or is_url(store):
        return None
    base = Path(store)
    if base.suffix in STORE_FILE_SUFFIXES:
        return _database_file(spec, base, "the store's")
    named = _database_file(spec, base / STORE_FILE, "the store's")
    if named is not None:
        return named
    if _same(spec, base / SHARDS_FILE):
        return f"the sharded store's layout file {base / SHARDS_FILE}"
    # a shard's files, also of a shard not written yet (--workers N creates them)
    real = Path(os.path.realpath(spec))
    if real.parent.parent == Path(os.path.realpath(base)) and _SHARD_DIR.fullmatch(
        real.parent.name
    ):
        named = _database_file(spec, base / real.parent.name / STORE_FILE, "a shard's")
        if named is not None:
            return named
    for shard in sorted(base.glob("shard-*")):
        named = _database_file(spec, shard / STORE_FILE, "a shard's")
        if named is not None:
            return named
    return None


def _database_file(spec: str, database: Path, whose: str) -> str | None:
    """Which file of the SQLite database ``database`` (itself, a log, its lock) ``spec``
    names, in words; None when none."""
    for side, kind in _STORE_SIDECARS.items():
        path = Path(f"{database}{side}")
        if _same(spec, path):
            return f"{whose} database {path}" if not side else f"{whose} database {kind}{path}"
    return None


def _input_named(spec: str, inputs: Iterable[str | os.PathLike[str]]) -> str | None:
    """Which of ``inputs`` ``spec`` names, in words; None when none."""
    for path in inputs:
        if _same(spec, path):
            return f"an input file of this run ({os.fspath(path)})"
    return None


def forget_rejects(store: str | os.PathLike[str], user_id: str) -> int:
    """Remove ``user_id``'s rows from the store's default rejects files
    (:func:`default_rejects_files`); the number of rows removed. Why: those rows hold the
    user's rejected records in plain text, and a deletion must leave nothing of the user (a
    ``--rejects FILE`` elsewhere is the user's to delete). Each file changed is replaced
    atomically (a copy fsynced, then renamed over it): a crash leaves the old file or the new."""
    with _SCRUBBING:
        return sum(_scrub_rejects(f, user_id) for f in default_rejects_files(store))


def count_rejects(store: str | os.PathLike[str], user_id: str) -> int:
    """How many rows of the store's default rejects files are ``user_id``'s (what
    :func:`forget_rejects` would remove): ``delete`` names them before it asks, and deletes
    them even for a user none of whose records was accepted."""
    total = 0
    for f in default_rejects_files(store):
        with open(f, encoding="utf-8", errors="surrogateescape") as src:
            total += sum(_names_user(line, user_id) for line in src)
    return total


def _scrub_rejects(path: Path, user_id: str) -> int:
    """Rewrite the rejects file ``path`` without ``user_id``'s rows (streamed: the file may be
    large); the rows removed. Left as it is when none names the user."""
    return _rewrite(path, lambda line: None if _names_user(line, user_id) else line)


def _rewrite(path: Path, edit: Callable[[str], str | None], *, always: bool = False) -> int:
    """Rewrite the file ``path`` line by line through ``edit`` (its new line, or None to drop
    it), atomically: a copy, fsynced, renamed over it (a crash leaves the old file or the
    new); the lines dropped or changed. Left as it is when none was, unless ``always``. An
    exception of ``edit`` leaves the file as it was (the copy is removed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    changed = 0
    try:
        with (
            open(path, encoding="utf-8", errors="surrogateescape") as src,
            open(tmp, "w", encoding="utf-8", errors="surrogateescape") as out,
        ):
            for line in src:
                new = edit(line)
                changed += new != line
                if new is not None:
                    out.write(new)
            out.flush()
            os.fsync(out.fileno())
        if changed or always:
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)  # the file keeps who may read it
            os.replace(tmp, path)
            _fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return changed


def encrypt_rejects(
    store: str | os.PathLike[str], *, always: bool = True
) -> list[tuple[Path, int | None]]:
    """After ``rekey --encrypt``: rewrite each default rejects file of the store
    (:func:`default_rejects_files`) as an encrypted store's ingest writes it (each row as
    ``RejectRow.as_json(raw=False)``: where and why, no content, no user), atomically. A file
    that is not rejects rows throughout (a line that does not parse as one) is removed: it
    could hold the records in plain text beside the encrypted store. Each file's path and its
    lines changed (None: removed). ``always=False`` leaves a file that is content-free already
    as it is (and says 0 for it): the re-run of an ``--encrypt`` interrupted before this step."""
    done: list[tuple[Path, int | None]] = []
    with _SCRUBBING:
        for f in default_rejects_files(store):
            try:
                rows = _rewrite(f, _content_free_row, always=always)
            except ValueError:
                f.unlink()
                _fsync_dir(f.parent)
                done.append((f, None))
            else:
                done.append((f, rows))
    return done


def _content_free_row(line: str) -> str:
    """A rejects-file line as an encrypted store's file has it; ValueError if it is no row."""
    row = json.loads(line)  # a JSONDecodeError is a ValueError
    if not isinstance(row, dict):
        raise ValueError("not a rejects row")
    file, num, reason = row.get("file"), row.get("line"), row.get("reason")
    stage, source = row.get("stage", "read"), row.get("source")
    if not (
        isinstance(file, str)
        and isinstance(num, int)
        and not isinstance(num, bool)
        and isinstance(reason, str)
        and stage in ("read", "validate")
        and (source is None or isinstance(source, str))
    ):
        raise ValueError("not a rejects row")
    return RejectRow(file, num, reason, stage=stage, source=source).as_json(raw=False)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where directories can be opened: POSIX)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _names_user(line: str, user_id: str) -> bool:
    """Whether a rejects-file row is ``user_id``'s: its ``user_id`` (a record the engine
    refused), else the user its ``raw`` record names (the reader refused it: no user was
    trusted, but the record still holds the user's words). A row of an encrypted store's
    default file has neither: it holds no content."""
    try:
        row = json.loads(line)
    except ValueError:
        return False
    if not isinstance(row, dict):
        return False
    if row.get("user_id") is not None:
        return row["user_id"] == user_id
    raw = row.get("raw")
    return isinstance(raw, str) and _raw_names(raw, user_id)


def _raw_names(raw: str, user_id: str) -> bool:
    """Whether a rejected record's raw text names ``user_id``: its ``user_id`` field (a
    conversation's ``id`` when it has none, as the readers take it), found in the text when
    it was cut short (``RAW_LIMIT``) and no longer parses."""
    try:
        obj = json.loads(raw)
    except ValueError:
        keys = {json.dumps(user_id), json.dumps(user_id, ensure_ascii=False)}
        return any(re.search(r'"user_id"\s*:\s*' + re.escape(k), raw) for k in keys)
    if not isinstance(obj, dict):
        return False
    named = obj.get("user_id", obj.get("id"))
    if isinstance(named, int) and not isinstance(named, bool):
        named = str(named)  # a conversation's numeric id, as the readers take it
    return isinstance(named, str) and normalise_text(named) == user_id


_DETAILS = re.compile(r"\s*\([^()]*\)")  # "(column 5)", "(2,000,000 bytes)"
_QUOTED_VALUE = re.compile(r"\s*('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")
_INDEX = re.compile(r"\[\d+\]")  # conversations[3] -> conversations[i]
_VALUE_NUMBER = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?(?![\w.])")
_KIND_CHARS = 80


# the record fields a reason may quote by name ("missing field 'user_id'"): the only quoted
# words a reason's kind keeps (a quoted user id or role looks like a field name too)
_RECORD_FIELDS = frozenset(
    [
        "user_id",
        "assistant_id",
        "user_input",
        "agent_response",
        "timestamp",
        "id",
        "meta",
        "source",
        "from",
        "value",
        "role",
        "content",
        "text",
        "messages",
        "conversations",
        "conversation",
        "speaker",
    ]
)


def reason_kind(reason: str) -> str:
    """The kind of a reject: what the report counts it under (``reject_reasons``) and all an
    encrypted store's rejects file says of why (it holds nothing of the records). Short, and
    the same for every record broken the same way, or the counts scatter over as many kinds as
    there are values. A timestamp refusal is named by its rule (:func:`refusal_kind`); another
    reason loses what differs from record to record - quoted values (a quoted record field's
    name stays), numbers standing alone, item indices, parenthesised details - and is
    shortened to its first clause (up to a ``;``: the rule broken, before what to do about it)
    or else at a word boundary, never inside a word."""
    kind = refusal_kind(reason)
    if kind is not None:
        return kind
    text = _DETAILS.sub("", reason)
    text = _QUOTED_VALUE.sub(lambda m: m[0] if m[1][1:-1] in _RECORD_FIELDS else "", text)
    text = _VALUE_NUMBER.sub("N", _INDEX.sub("[i]", text))
    text = " ".join(text.split()).strip(" :;,")
    if len(text) <= _KIND_CHARS:
        return text
    clause = text.split("; ", 1)[0]
    if len(clause) < len(text) and len(clause) <= _KIND_CHARS:
        return clause
    return text[: _KIND_CHARS - 1].rsplit(" ", 1)[0].rstrip(" :;,") + "\u2026"


def record_reject(path: str, rec: Record, reason: str) -> RejectRow:
    """A record the engine refused, as a rejects-file row: its page (as the engine would have
    taken it, truncated) and its user."""
    raw = json.dumps(rec.to_page(), ensure_ascii=False)[:2000]
    return RejectRow(path, rec.line, reason, raw, "validate", rec.source, rec.user_id)

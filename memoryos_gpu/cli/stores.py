"""Where a command's store is: a SQLite directory or file, a sharded directory (``ingest
--workers``), or a PostgreSQL URL; which shard holds a user."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .options import (
    STORE_FILE,
    CLIError,
    check_user_id,
)

if TYPE_CHECKING:
    from pydantic import SecretStr


def is_url(store: str | os.PathLike[str]) -> bool:
    """A PostgreSQL store (``postgresql://...``): no file, no shard directories."""
    from memoryos_gpu.store import is_url as _is_url

    return _is_url(os.fspath(store))


def shown(store: str) -> str:
    """``store`` as output shows it: a PostgreSQL URL with its password masked (messages and
    JSON end up in logs and files)."""
    if not is_url(store):
        return store
    from memoryos_gpu.store.pg_urls import redact

    return redact(store)


def store_file(store: str | os.PathLike[str]) -> Path:
    p = Path(store)
    return p if p.suffix in (".sqlite", ".sqlite3", ".db") else p / STORE_FILE


def shard_dirs(store: str | os.PathLike[str]) -> list[Path] | None:
    """The shard stores of a sharded store directory (``--workers``), in shard order."""
    from memoryos_gpu.store import SHARDS_FILE

    if is_url(store):
        return None
    base = Path(store)
    manifest = base / SHARDS_FILE
    if manifest.is_file():
        try:
            count = int(json.loads(manifest.read_text())["count"])
        except (ValueError, KeyError, TypeError, OSError):
            return None
        return [base / f"shard-{i}" for i in range(count)]
    found = sorted(base.glob("shard-*"), key=lambda p: p.name)
    idx = sorted(int(p.name[6:]) for p in found if p.name[6:].isdigit())
    if idx and idx == list(range(len(idx))) and not store_file(base).exists():
        return [base / f"shard-{i}" for i in idx]
    return None


def user_store(store: str, user_id: str) -> str:
    """The store holding ``user_id``: ``store`` itself, or its shard for a sharded store.
    ``user_id`` is checked first (:func:`~memoryos_gpu.cli.options.check_user_id`): every
    command that names a user comes here before it opens anything, so all refuse a bad
    ``--user`` alike (exit 2), and none sends one SQL cannot carry to the store."""
    from memoryos_gpu.ingest import shard_of

    check_user_id(user_id)
    if is_url(store):
        return store
    dirs = shard_dirs(store) if not store_file(store).exists() else None
    if dirs:
        return str(dirs[shard_of(user_id, len(dirs))])
    return store


def require_store(store: str) -> None:
    """Refuse, with what to do, a store that is not there (or a file that cannot be one),
    before a command that does not create stores opens it: opening would create it."""
    if is_url(store):
        _require_pg_store(store)
        return
    from memoryos_gpu.store import check_store_dir

    found = store_file(store)
    if found.is_file() and found.stat().st_size == 0:
        # SQLite would take it for a new database, and a command that only reads would write
        # a fresh schema into it and answer from an empty memory: a store's file is never
        # empty (its header is written when the store is made, before any page)
        raise CLIError(
            f"{found} is empty (0 bytes), not a store: its creation was cut short or the file "
            f"was truncated; remove it, or create the store with: "
            f"memoryos-gpu ingest FILE --store {store}"
        )
    if found.exists():
        return
    if found.parent == Path(store):  # a directory store: a file in its path?
        check_store_dir(Path(store))
    if store == ":memory:":  # gone when the ingest that would create it exits
        raise CLIError(
            "no store at :memory: (an in-memory store lives only as long as the command that "
            "opens it): give a store directory, made by: memoryos-gpu ingest FILE --store DIR"
        )
    where = _as_given(store)
    raise CLIError(
        f"no store at {where} (create one with: memoryos-gpu ingest FILE --store {where})"
    )


def _as_given(store: str) -> str:
    """``store`` as the user gave it: a directory's store file (``rekey`` checks each
    ``DIR/memory.sqlite3``) named by its directory, as every other command names it."""
    p = Path(store)
    return str(p.parent) if p.name == STORE_FILE else store


def _require_pg_store(url: str) -> None:
    """Refuse a PostgreSQL database (or schema, by its ``search_path``) without the store's
    tables, as a missing SQLite store is refused: an engine would create them there, and a URL
    missing its schema option answered "unknown user" from an empty store made in ``public``.
    Opened as a reader, which says so; a server that cannot be reached says that instead."""
    from memoryos_gpu.store import open_store
    from memoryos_gpu.store.errors import NoStoreError

    try:
        open_store(url, writer=False).close()
    except NoStoreError as exc:
        raise CLIError(str(exc)) from None


def open_store_at(store: str, *, writer: bool, key: SecretStr | None) -> Any:
    """The store itself, no engine. ``writer=False`` for the commands that only read: they do
    not claim the store, so they work beside a running engine (``serve``, ``ingest``).
    ``key``: :func:`~memoryos_gpu.cli.options.store_key`'s, required so that no caller opens
    an encrypted store without the config file's key (the engine commands have it)."""
    from memoryos_gpu.store import open_store

    require_store(store)
    if writer:
        refuse_non_store(store, key)
    return open_store(store, writer=writer, key=key)


def refuse_non_store(store: str, key: SecretStr | None) -> None:
    """Open an existing SQLite store file as a reader and close it, before a writer opens it:
    a file that is not a store (or not under ``key``) is refused here, as the read-only
    commands refuse it. Why: a writer takes its lock first, so ``retrieve``/``delete
    --store notes.db`` were refused but left ``notes.db.lock`` beside the user's file. Only
    while no lock file is there: a store a writer opened before keeps its own, and is not
    opened twice (an encrypted one would derive its key twice)."""
    from memoryos_gpu.store import open_store
    from memoryos_gpu.store.writer import lock_path

    if is_url(store) or store == ":memory:" or not store_file(store).is_file():
        return
    if lock_path(store_file(store)).exists():
        return
    open_store(store, writer=False, key=key).close()


def store_shards(store: str) -> int:
    """The shard count a store was written with (a directory by ``ingest --workers`` or
    ``--ray``, a PostgreSQL store by ``ingest --ray`` or a sharded server), else 1."""
    return _sharded_count(store) or 1


def ray_shards(store: str, shards: int | None) -> int:
    """--shards, else the count the store was sharded with, else 2."""
    return shards or _sharded_count(store) or 2


def _sharded_count(store: str) -> int | None:
    """The count of a sharded store: its directory's shards, or the count a PostgreSQL store
    records (``layout.shared_shards``; opening it says when the server is not there)."""
    if is_url(store):
        from memoryos_gpu.distributed.layout import shared_shards

        return shared_shards(store)
    dirs = shard_dirs(store)
    return len(dirs) if dirs else None

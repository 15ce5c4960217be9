"""Durable storage. SQLite is the embedded default; PostgreSQL (``postgresql://`` URLs) is the
store several engine processes share. The arena is rebuilt from the store on open."""

from pathlib import Path

from pydantic import SecretStr

from memoryos_gpu.store.errors import StoreError, StoreFullError, StoreUnavailableError
from memoryos_gpu.store.sqlite import DEFAULT_CACHE_MB, SQLiteStore
from memoryos_gpu.store.sqlite_schema import SCHEMA_VERSION
from memoryos_gpu.store.writer import StoreLockedError

#: The manifest a sharded store directory holds (``STORE/shards.json``, beside ``STORE/shard-I``):
#: written by ``ingest --workers`` and the shard engines, read by every command.
SHARDS_FILE = "shards.json"
#: A directory store's database file (``STORE/memory.sqlite3``).
STORE_FILE = "memory.sqlite3"
#: The endings that make a store path a database file itself rather than a directory.
STORE_FILE_SUFFIXES = (".sqlite", ".sqlite3", ".db")

__all__ = [
    "SCHEMA_VERSION",
    "SHARDS_FILE",
    "STORE_FILE",
    "STORE_FILE_SUFFIXES",
    "SQLiteStore",
    "StoreError",
    "StoreFullError",
    "StoreLockedError",
    "StoreUnavailableError",
    "check_store_dir",
    "is_url",
    "open_store",
]


def is_url(spec: str) -> bool:
    """Whether ``spec`` names a PostgreSQL server (``postgresql://`` or ``postgres://``) rather
    than a SQLite file or directory."""
    return spec.startswith(("postgresql://", "postgres://"))


def open_store(
    spec: str,
    *,
    writer: bool = True,
    shard: tuple[int, int] | None = None,
    key: str | SecretStr | None = None,
    cache_mb: int = DEFAULT_CACHE_MB,
) -> SQLiteStore:
    """Open (creating if needed) the store ``spec``: a ``postgresql://user@host/db`` URL (a
    :class:`~memoryos_gpu.store.postgres.PostgresStore`), a SQLite file, a directory (the file
    ``memory.sqlite3`` inside it), or ``:memory:``. Every backend is a :class:`SQLiteStore`
    (the base that holds their shared SQL).

    ``writer``: claim the store (one writer per store, :mod:`memoryos_gpu.store.writer`;
    refused with :class:`StoreLockedError` while another writer holds it); ``False`` for tools
    that only read. ``shard=(i, n)``: on PostgreSQL, claim only shard ``i`` of ``n`` of the
    shared database (the shard engines of one layout write it side by side); SQLite stores are
    one per shard, so there it changes nothing.

    ``key``: open a SQLite store encrypted under it (:mod:`memoryos_gpu.store.encryption`);
    None takes ``$MEMORYOS_GPU_KEY`` when set, else the store is not encrypted. A PostgreSQL
    store refuses a key (the server encrypts at rest by its own means).

    ``cache_mb``: a SQLite file store's page cache in MiB (0: SQLite's own); a PostgreSQL
    server caches by its own settings."""
    from memoryos_gpu.store.encryption import ENV_KEY, resolve_key

    secret = resolve_key(key)
    if is_url(spec):
        if secret is not None:
            raise StoreError(
                "encryption_key applies to SQLite stores only; a PostgreSQL server encrypts at "
                f"rest by its own means (unset ${ENV_KEY} and encryption_key)"
            )
        from memoryos_gpu.store.postgres import PostgresStore

        return PostgresStore(spec, writer=writer, shard=shard)
    if spec == ":memory:":
        return SQLiteStore(spec, key=secret)
    p = Path(spec)
    if p.suffix not in STORE_FILE_SUFFIXES:
        check_store_dir(p)
        p = p / STORE_FILE
    return SQLiteStore(p, writer=writer, key=secret, cache_mb=cache_mb)


def check_store_dir(base: Path) -> None:
    """Refuse a directory store that cannot be one: a path through a file, or a sharded store
    directory (its users live in ``shard-I``; a store file beside them would hide them from
    every command that looks for the shards)."""
    for at in (base, *base.parents):
        if at.exists():
            if not at.is_dir():
                raise StoreError(
                    f"store {base}: {at} is a file, not a directory (give a directory, where "
                    "memory.sqlite3 is created, or a file path ending in .sqlite3 or .db)"
                )
            break
    manifest = base / SHARDS_FILE
    if manifest.is_file() and not (base / STORE_FILE).exists():
        raise StoreError(
            f"{base} is a sharded store (its users are in {base}/shard-I, {manifest.name}): "
            "write it as it was written, with `ingest --workers N`, `ingest --ray --shards N` "
            f"or `serve --engines N` (N: the count in its {manifest.name}), or open one "
            "shard's directory"
        )

"""Durable storage. SQLite is the embedded default; the arena is rebuilt from it on open."""

from memoryos_gpu.store.sqlite import SCHEMA_VERSION, SQLiteStore, StoreError

__all__ = ["SCHEMA_VERSION", "SQLiteStore", "StoreError", "open_store"]


def open_store(path: str) -> SQLiteStore:
    """Open (creating if needed) the store at ``path``: a SQLite file, a directory (the file
    ``memory.sqlite3`` inside it), or ``:memory:``."""
    from pathlib import Path

    if path == ":memory:":
        return SQLiteStore(path)
    p = Path(path)
    if p.suffix not in (".sqlite", ".sqlite3", ".db"):
        p = p / "memory.sqlite3"
    return SQLiteStore(p)

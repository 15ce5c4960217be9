"""Checkpoints of a SQLite store's write-ahead log, on a thread of their own.

Why: SQLite folds the log back into the database file (a *checkpoint*: copy the logged pages,
fsync the file) inside whichever commit pushes the log past ``wal_autocheckpoint`` pages. The
engine commits under its lock, so that commit, and every retrieval and write waiting for the
lock, paid the checkpoint: under a steady write load one commit in ~50 took 50-260 ms instead
of 1-3. Here a second connection checkpoints once the log passes :data:`CHECKPOINT_BYTES`, on
its own thread: SQLite's C code holds neither the engine lock nor the interpreter lock while it
copies, and a ``PASSIVE`` checkpoint never waits for, nor blocks, the writer. SQLite's own
autocheckpoint stays as a backstop at :data:`BACKSTOP_PAGES`, in case this thread falls behind.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from memoryos_gpu.store.errors import StoreError, disk_full

__all__ = ["BACKSTOP_PAGES", "CHECKPOINT_BYTES", "WalCheckpointer"]

log = logging.getLogger("memoryos_gpu.store")

#: Log size past which the thread checkpoints: SQLite's default autocheckpoint (1,000 pages
#: of 4 KiB).
CHECKPOINT_BYTES = 4 * 1024 * 1024
#: The committing connection's autocheckpoint (pages): only reached if the thread falls behind.
BACKSTOP_PAGES = 16_000
INTERVAL_S = 0.2


class WalCheckpointer:
    """Checkpoints ``wal_path``'s log through ``db`` (a connection of its own to the store)
    whenever it has grown past :data:`CHECKPOINT_BYTES`; :meth:`close` stops the thread and
    closes the connection."""

    def __init__(self, db: Any, wal_path: str, interval_s: float | None = None) -> None:
        self._db = db
        self._wal = wal_path
        self._interval = INTERVAL_S if interval_s is None else interval_s
        self._stop = threading.Event()
        self.checkpoints = 0
        self._thread = threading.Thread(target=self._run, name="memoryos-wal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if os.path.getsize(self._wal) >= CHECKPOINT_BYTES:
                    self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.checkpoints += 1
            except FileNotFoundError:  # no log yet, or the store is closing
                continue
            except Exception as exc:  # the backstop autocheckpoint still runs; say why not
                full = disk_full(exc, self._wal)
                if full or isinstance(exc, StoreError):
                    # the machine's doing (a full disk), not a bug: one line, no traceback
                    why = "the disk is full" if full else "a store error"
                    log.warning(
                        "background checkpoint of %s failed (%s): %s; retried in 5 s",
                        self._wal,
                        why,
                        exc,
                    )
                else:
                    log.exception("background checkpoint of %s failed", self._wal)
                self._stop.wait(5.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._db.close()

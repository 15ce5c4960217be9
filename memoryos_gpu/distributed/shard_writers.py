"""Shard stores another process holds for writing, refused before Ray starts.

Why before: starting Ray (``ray.init``, Ray Serve's controller, Ray Data) takes 15-25 s on a
small box, and a shard actor's own claim of its store comes after that. ``ingest --ray`` and
``serve --ray`` on a store that a ``serve`` (or another ``ingest``) holds were refused only
then, with the refusal buried in Ray's log. Taking each shard's writer claim and giving it back
at once says the same (the holder, what to do) in well under a second. A writer that comes in
between is still refused by the shard actor's own claim. PostgreSQL shards are claimed by the
actors only (their claims are advisory locks of the database sessions).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from memoryos_gpu.distributed.layout import is_shared_store, shard_store
from memoryos_gpu.store import STORE_FILE
from memoryos_gpu.store.writer import SQLiteWriterLock, StoreLockedError, holder_kind

__all__ = ["ACTOR_POLL_S", "ACTOR_WAIT_S", "check_shard_writers", "claim_and_give_back"]

log = logging.getLogger(__name__)

#: How long a run waits for the shard actors of a stopped earlier run to let a store go.
ACTOR_WAIT_S, ACTOR_POLL_S = 30.0, 0.25


def check_shard_writers(store: str, shards: int) -> None:
    """Refuse a shard store of ``store`` (``shards`` of them) that another process holds for
    writing: its StoreLockedError names the holder, as the single-process path's refusal does
    (:func:`claim_and_give_back`). Shards not written yet, and PostgreSQL stores, pass."""
    if is_shared_store(store):
        return
    for i in range(shards):
        db = Path(shard_store(store, i, shards)) / STORE_FILE
        if db.is_file():
            claim_and_give_back(db)


def claim_and_give_back(db: Path, wait_s: float | None = None) -> None:
    """Take the writer claim of shard store ``db`` and give it back. A holder that is a Ray
    worker is waited for, up to ``wait_s`` (:data:`ACTOR_WAIT_S`): the shard actor of an
    earlier ``ingest --ray`` whose driver was killed finishes its chunk in flight first (a
    few seconds), and a re-run started meanwhile was refused once, with the advice meant for a
    running server. One that does not let go is named as what it is."""
    deadline = time.monotonic() + (ACTOR_WAIT_S if wait_s is None else wait_s)
    said = False
    while True:
        lock = SQLiteWriterLock(db)
        try:
            lock.acquire()
        except StoreLockedError as exc:
            holder = exc.holder
            if holder is None or holder_kind(holder.command) != "ray":
                raise
            if time.monotonic() >= deadline:
                raise StoreLockedError(
                    f"store {db} is open for writing by a Ray worker, pid {holder.pid} on "
                    f"{holder.host}: a shard actor of an earlier `ingest --ray` still "
                    "finishing its chunk, or of a Ray cluster that still runs it; retry once "
                    "it has exited, or stop it (`ray stop`)",
                    holder,
                ) from None
            if not said:
                log.warning(
                    "waiting for a shard actor of an earlier run (pid %d) to finish its chunk "
                    "and give %s back",
                    holder.pid,
                    db,
                )
                said = True
            time.sleep(ACTOR_POLL_S)
            continue
        lock.release()
        return

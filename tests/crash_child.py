"""Child process of tests/test_crash.py: ingest one LoCoMo conversation page by page.

After each ``engine.add`` returns, the page's source is appended to the ``acked`` file with
flush + fsync: whatever is in that file was acknowledged to the caller and must survive a
crash. The parent SIGKILLs this process at random times, or asks it to kill itself at a precise
point with ``--kill-after FUNC:N`` (right after the N-th return of ``MemoryEngine.FUNC``:
``_accept`` = pages committed, derived work not yet done; ``_process_pages`` = pages applied,
promotions still pending; ``_process_promotions`` = a promotion committed, extractor state not
yet saved). Prints ``ready`` once the engine is open and ``done`` after a clean close.

    python tests/crash_child.py STORE ACKED CONVERSATION [--limit N] [--kill-after FUNC:N]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from memoryos_gpu.eval.locomo import default_locomo_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memoryos_gpu.config import EngineConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.formats import Record, read_records

LOCOMO = default_locomo_path()


def engine_config(store: str) -> EngineConfig:
    """The settings of the child, shared with the parent's checks: small tiers so eviction,
    segment eviction and promotion all happen within a conversation."""
    return EngineConfig(
        store=store,
        embedder="hashing",
        device="cpu",
        memory=preset("paper", stm_capacity=3, mtm_capacity=5, tau=2.0, knowledge_capacity=6),
    )


def conversation(conv: str, limit: int | None = None) -> list[Record]:
    recs = [r for r in read_records(LOCOMO) if isinstance(r, Record) and r.user_id == conv]
    return recs[:limit] if limit else recs


def _kill_after(func: str, n: int) -> None:
    original = getattr(MemoryEngine, func)
    seen = [0]

    def wrapped(self, *a, **k):
        out = original(self, *a, **k)
        if func != "_process_promotions" or out:
            seen[0] += 1
            if seen[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(MemoryEngine, func, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("acked")
    ap.add_argument("conversation")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--kill-after", help="FUNC:N")
    args = ap.parse_args()
    records = conversation(args.conversation, args.limit)
    engine = MemoryEngine(engine_config(args.store))
    if args.kill_after:  # armed after the reopen: only this run's own work counts
        func, n = args.kill_after.split(":")
        _kill_after(func, int(n))
    print("ready", flush=True)
    with open(args.acked, "a", encoding="utf-8") as acked:
        for r in records:
            p = r.to_page()
            engine.add(
                p["user_id"],
                p["user_input"],
                p["agent_response"],
                timestamp=p["timestamp"],
                assistant_id=p["assistant_id"],
                source=p["source"],
            )
            acked.write(p["source"] + "\n")
            acked.flush()
            os.fsync(acked.fileno())
    engine.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()

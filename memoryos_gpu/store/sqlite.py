"""SQLite store: the durable truth behind the arena.

Why SQLite: embedded, transactional, one file to back up, and fast enough for one box when
every accepted batch is one transaction (WAL mode, synchronous=NORMAL... FULL for
acknowledged pages, see :data:`SYNCHRONOUS`). The engine writes a page here before ``add``
returns; derived work (chain, MTM insertion, promotion) is recorded in ``pending`` in the same
transaction as the page, and each pending item is deleted in the same transaction as its
effects, so a crash at any point loses nothing and does nothing twice.

Embeddings are stored as little-endian float32 blobs with the model id and dimension recorded
in ``meta``; keyword ids as int32 blobs (the arena's hashed ids) beside the readable words.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from memoryos_gpu.errors import MemoryOSError

SCHEMA_VERSION = 1
SYNCHRONOUS = "FULL"  # an acknowledged page survives power loss, not only a process crash


class StoreError(MemoryOSError, RuntimeError):
    """The store cannot be opened or used (newer schema, corrupt file, ...)."""


_SCHEMA_V1 = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE assistants(
  assistant_id TEXT PRIMARY KEY,
  created REAL NOT NULL,
  knowledge_head INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE users(
  user_id TEXT PRIMARY KEY,
  assistant_id TEXT NOT NULL REFERENCES assistants(assistant_id),
  created REAL NOT NULL,
  clock REAL NOT NULL DEFAULT 0,
  next_seq INTEGER NOT NULL DEFAULT 0,
  chain_tail INTEGER,
  chain_meta TEXT,
  profile TEXT NOT NULL DEFAULT '{}',
  knowledge_head INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE segments(
  segment_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
  slot INTEGER NOT NULL,
  summary TEXT NOT NULL,
  keywords TEXT NOT NULL,
  kw_ids BLOB NOT NULL,
  embedding BLOB NOT NULL,
  n_visit INTEGER NOT NULL DEFAULT 0,
  l_interaction INTEGER NOT NULL DEFAULT 0,
  last_access REAL NOT NULL,
  created REAL NOT NULL,
  n_pages INTEGER NOT NULL DEFAULT 0,
  UNIQUE(user_id, slot)
);
CREATE TABLE pages(
  page_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
  seq INTEGER NOT NULL,
  user_input TEXT NOT NULL,
  agent_response TEXT NOT NULL,
  timestamp REAL NOT NULL,
  tier TEXT NOT NULL CHECK (tier IN ('stm', 'pending', 'mtm', 'evicted')),
  segment_id INTEGER REFERENCES segments(segment_id) ON DELETE SET NULL,
  seg_pos INTEGER,
  prev_page INTEGER,
  next_page INTEGER,
  chain_id INTEGER,
  meta TEXT,
  summary TEXT,
  keywords TEXT,
  analysed INTEGER NOT NULL DEFAULT 0,
  mode TEXT,
  embedding BLOB NOT NULL,
  source TEXT UNIQUE,
  extra TEXT NOT NULL DEFAULT '{}',
  created REAL NOT NULL,
  UNIQUE(user_id, seq)
);
CREATE INDEX pages_segment ON pages(segment_id, seg_pos);
CREATE INDEX pages_tier ON pages(user_id, tier, seq);
CREATE INDEX pages_chain ON pages(chain_id);
CREATE TABLE knowledge(
  entry_id INTEGER PRIMARY KEY,
  owner_kind TEXT NOT NULL CHECK (owner_kind IN ('user', 'assistant')),
  owner_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  text TEXT NOT NULL,
  embedding BLOB NOT NULL,
  live INTEGER NOT NULL DEFAULT 1,
  mode TEXT NOT NULL,
  source_user TEXT,
  created REAL NOT NULL,
  UNIQUE(owner_kind, owner_id, seq)
);
CREATE INDEX knowledge_live ON knowledge(owner_kind, owner_id, live);
CREATE TABLE pending(
  work_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
  kind TEXT NOT NULL CHECK (kind IN ('page', 'promote')),
  ref INTEGER NOT NULL,
  created REAL NOT NULL,
  UNIQUE(kind, ref)
);
CREATE TABLE audit(
  event_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL,
  ts REAL NOT NULL,
  action TEXT NOT NULL,
  item_kind TEXT NOT NULL,
  item_id INTEGER,
  detail TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_user ON audit(user_id, event_id);
"""

# Forward migrations: MIGRATIONS[v] upgrades a store at version v to v + 1.
MIGRATIONS: dict[int, str] = {}


def emb_blob(v: np.ndarray) -> bytes:
    return np.ascontiguousarray(v, dtype="<f4").tobytes()


def blob_matrix(blobs: Sequence[bytes], dim: int) -> np.ndarray:
    """Many float32 blobs to one ``[n, dim]`` array in a single copy (no per-row numpy)."""
    if not blobs:
        return np.zeros((0, dim), np.float32)
    return np.frombuffer(b"".join(blobs), dtype="<f4").reshape(len(blobs), dim).astype(np.float32)


class SQLiteStore:
    """One SQLite database. Thread-safe: one connection guarded by a re-entrant lock."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=30.0
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open store {self.path}: {exc}") from exc
        self._lock = threading.RLock()
        self._depth = 0
        db = self._db
        db.execute("PRAGMA foreign_keys = ON")
        if self.path != ":memory:":
            db.execute("PRAGMA journal_mode = WAL")
        db.execute(f"PRAGMA synchronous = {SYNCHRONOUS}")
        self._migrate()

    # ------------------------------------------------------------------ schema
    def _migrate(self) -> None:
        db = self._db
        try:
            has_meta = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'"
            ).fetchone()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is not a memoryos-gpu store: {exc}") from exc
        if not has_meta:
            with self.transaction():
                for stmt in _SCHEMA_V1.split(";"):
                    if stmt.strip():
                        db.execute(stmt)
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            return
        version = int(self.get_meta("schema_version", "0"))
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"store {self.path} has schema version {version}, newer than this memoryos-gpu "
                f"supports ({SCHEMA_VERSION}); upgrade memoryos-gpu to open it"
            )
        while version < SCHEMA_VERSION:
            with self.transaction():
                for stmt in MIGRATIONS[version].split(";"):
                    if stmt.strip():
                        db.execute(stmt)
                version += 1
                self.set_meta("schema_version", str(version))

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (re-entrant: nested calls join the outer one)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self._db
                finally:
                    self._depth -= 1
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")
            finally:
                self._depth = 0

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.query("SELECT value FROM meta WHERE key = ?", (key,))
        return row[0][0] if row else default

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                "excluded.value",
                (key, value),
            )

    def check_embedding_model(self, model_id: str, dim: int) -> None:
        """Record the embedding model on first use; refuse a store built with another one."""
        stored = self.get_meta("embedding_model")
        if stored is None:
            self.set_meta("embedding_model", model_id)
            self.set_meta("embedding_dim", str(dim))
        elif stored != model_id or int(self.get_meta("embedding_dim", "0")) != dim:
            raise StoreError(
                f"store {self.path} was built with embedding model {stored} "
                f"(dim {self.get_meta('embedding_dim')}); this engine uses {model_id} (dim {dim}). "
                "Open it with the same model, or re-ingest into a new store."
            )

    # ------------------------------------------------------------------ users
    def ensure_user(self, user_id: str, assistant_id: str, now: float) -> bool:
        """Create the user (and its assistant) if new; returns True when created."""
        with self.transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO assistants(assistant_id, created) VALUES (?, ?)",
                (assistant_id, now),
            )
            cur = db.execute(
                "INSERT OR IGNORE INTO users(user_id, assistant_id, created) VALUES (?, ?, ?)",
                (user_id, assistant_id, now),
            )
            return cur.rowcount > 0

    def user_row(self, user_id: str) -> dict[str, Any] | None:
        rows = self.query(
            "SELECT user_id, assistant_id, clock, next_seq, chain_tail, chain_meta, "
            "profile, knowledge_head FROM users WHERE user_id = ?",
            (user_id,),
        )
        if not rows:
            return None
        r = rows[0]
        return {
            "user_id": r[0],
            "assistant_id": r[1],
            "clock": r[2],
            "next_seq": r[3],
            "chain_tail": r[4],
            "chain_meta": r[5],
            "profile": json.loads(r[6]),
            "knowledge_head": r[7],
        }

    def all_users(self) -> list[tuple]:
        return self.query(
            "SELECT user_id, assistant_id, clock, next_seq, chain_tail, chain_meta, "
            "knowledge_head FROM users ORDER BY rowid"
        )

    def all_assistants(self) -> list[tuple]:
        return self.query("SELECT assistant_id, knowledge_head FROM assistants ORDER BY rowid")

    # ------------------------------------------------------------------ journal
    def known_sources(self, sources: Iterable[str]) -> dict[str, int]:
        """Which idempotency keys were already accepted, mapped to their page id."""
        out: dict[str, int] = {}
        keys = [s for s in sources if s]
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            marks = ",".join("?" * len(chunk))
            out.update(
                self.query(f"SELECT source, page_id FROM pages WHERE source IN ({marks})", chunk)
            )
        return out

    # ------------------------------------------------------------------ pages
    def page_rows(self, page_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Readable fields of pages by id (no embeddings)."""
        out: dict[int, dict[str, Any]] = {}
        ids = [int(p) for p in page_ids]
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            for r in self.query(
                "SELECT page_id, user_id, seq, user_input, agent_response, timestamp, tier, "
                "segment_id, prev_page, next_page, meta, summary, keywords, analysed, mode, "
                f"source, extra FROM pages WHERE page_id IN ({marks})",
                chunk,
            ):
                out[r[0]] = _page_dict(r)
        return out

    def user_pages(self, user_id: str, tier: str | None = None) -> list[dict[str, Any]]:
        sql = (
            "SELECT page_id, user_id, seq, user_input, agent_response, timestamp, tier, "
            "segment_id, prev_page, next_page, meta, summary, keywords, analysed, mode, source, "
            "extra FROM pages WHERE user_id = ?"
        )
        params: list[Any] = [user_id]
        if tier is not None:
            sql += " AND tier = ?"
            params.append(tier)
        return [_page_dict(r) for r in self.query(sql + " ORDER BY seq", params)]

    def page_embeddings(self, page_ids: Sequence[int], dim: int) -> np.ndarray:
        ids = [int(p) for p in page_ids]
        blobs: dict[int, bytes] = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            blobs.update(
                self.query(
                    f"SELECT page_id, embedding FROM pages WHERE page_id IN ({marks})", chunk
                )
            )
        return blob_matrix([blobs[i] for i in ids], dim)

    # ------------------------------------------------------------------ pending work
    def pending(self, kind: str) -> list[tuple[int, str, int]]:
        """(work_id, user_id, ref) of pending work of a kind, oldest first."""
        return [
            tuple(r)
            for r in self.query(
                "SELECT work_id, user_id, ref FROM pending WHERE kind = ? ORDER BY work_id", (kind,)
            )
        ]

    def count_pending(self, user_id: str | None = None) -> int:
        if user_id is None:
            return self.query("SELECT COUNT(*) FROM pending")[0][0]
        return self.query("SELECT COUNT(*) FROM pending WHERE user_id = ?", (user_id,))[0][0]

    # ------------------------------------------------------------------ bulk load (reopen)
    def load_segments(self, dim: int) -> dict[str, Any]:
        """Every live segment as column arrays (one query, blobs joined once)."""
        rows = self.query(
            "SELECT segment_id, user_id, slot, kw_ids, embedding, n_visit, "
            "l_interaction, last_access, n_pages FROM segments ORDER BY segment_id"
        )
        if not rows:
            return {
                "segment_id": np.zeros(0, np.int64),
                "user_id": [],
                "slot": np.zeros(0, np.int32),
                "kw_ids": [],
                "embedding": np.zeros((0, dim), np.float32),
                "n_visit": np.zeros(0, np.int32),
                "l_interaction": np.zeros(0, np.int32),
                "last_access": np.zeros(0),
                "n_pages": np.zeros(0, np.int32),
            }
        cols = list(zip(*rows, strict=True))
        return {
            "segment_id": np.asarray(cols[0], np.int64),
            "user_id": list(cols[1]),
            "slot": np.asarray(cols[2], np.int32),
            "kw_ids": list(cols[3]),
            "embedding": blob_matrix(cols[4], dim),
            "n_visit": np.asarray(cols[5], np.int32),
            "l_interaction": np.asarray(cols[6], np.int32),
            "last_access": np.asarray(cols[7], np.float64),
            "n_pages": np.asarray(cols[8], np.int32),
        }

    def load_mtm_pages(self, dim: int) -> dict[str, Any]:
        """Every page in MTM, ordered by (segment, position), as column arrays."""
        rows = self.query(
            "SELECT page_id, segment_id, embedding FROM pages WHERE tier = 'mtm' "
            "ORDER BY segment_id, seg_pos"
        )
        if not rows:
            return {
                "page_id": np.zeros(0, np.int64),
                "segment_id": np.zeros(0, np.int64),
                "embedding": np.zeros((0, dim), np.float32),
            }
        cols = list(zip(*rows, strict=True))
        return {
            "page_id": np.asarray(cols[0], np.int64),
            "segment_id": np.asarray(cols[1], np.int64),
            "embedding": blob_matrix(cols[2], dim),
        }

    def load_knowledge(self, dim: int) -> dict[str, Any]:
        rows = self.query(
            "SELECT entry_id, owner_kind, owner_id, seq, embedding FROM knowledge "
            "WHERE live = 1 ORDER BY entry_id"
        )
        cols = list(zip(*rows, strict=True)) if rows else [[], [], [], [], []]
        return {
            "entry_id": np.asarray(cols[0], np.int64),
            "owner_kind": list(cols[1]),
            "owner_id": list(cols[2]),
            "seq": np.asarray(cols[3], np.int64),
            "embedding": blob_matrix(list(cols[4]), dim),
        }

    # ------------------------------------------------------------------ knowledge
    def knowledge_rows(self, entry_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        ids = [int(e) for e in entry_ids]
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            for r in self.query(
                "SELECT entry_id, owner_kind, owner_id, seq, text, live, mode, "
                f"created FROM knowledge WHERE entry_id IN ({marks})",
                chunk,
            ):
                out[r[0]] = {
                    "entry_id": r[0],
                    "owner_kind": r[1],
                    "owner_id": r[2],
                    "seq": r[3],
                    "text": r[4],
                    "live": bool(r[5]),
                    "mode": r[6],
                    "created": r[7],
                }
        return out

    def owner_knowledge(self, kind: str, owner_id: str, live_only: bool = True) -> list[dict]:
        rows = self.query(
            "SELECT entry_id, seq, text, live, mode, created FROM knowledge WHERE "
            "owner_kind = ? AND owner_id = ?"
            + (" AND live = 1" if live_only else "")
            + " ORDER BY seq",
            (kind, owner_id),
        )
        return [
            {
                "entry_id": r[0],
                "seq": r[1],
                "text": r[2],
                "live": bool(r[3]),
                "mode": r[4],
                "created": r[5],
            }
            for r in rows
        ]

    # ------------------------------------------------------------------ audit
    def audit(
        self,
        db: sqlite3.Connection,
        user_id: str,
        action: str,
        item_kind: str,
        item_id: int | None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        db.execute(
            "INSERT INTO audit(user_id, ts, action, item_kind, item_id, detail) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                user_id,
                time.time(),
                action,
                item_kind,
                item_id,
                json.dumps(detail or {}, ensure_ascii=False),
            ),
        )

    def history(self, user_id: str) -> list[dict[str, Any]]:
        return [
            {
                "event_id": r[0],
                "ts": r[1],
                "action": r[2],
                "item_kind": r[3],
                "item_id": r[4],
                "detail": json.loads(r[5]),
            }
            for r in self.query(
                "SELECT event_id, ts, action, item_kind, item_id, detail FROM "
                "audit WHERE user_id = ? ORDER BY event_id",
                (user_id,),
            )
        ]

    # ------------------------------------------------------------------ export / delete
    def export_user(self, user_id: str) -> dict[str, Any] | None:
        user = self.user_row(user_id)
        if user is None:
            return None
        segs = self.query(
            "SELECT segment_id, slot, summary, keywords, n_visit, l_interaction, "
            "last_access, created, n_pages FROM segments WHERE user_id = ? "
            "ORDER BY slot",
            (user_id,),
        )
        return {
            "user": user,
            "pages": self.user_pages(user_id),
            "segments": [
                {
                    "segment_id": r[0],
                    "slot": r[1],
                    "summary": r[2],
                    "keywords": json.loads(r[3]),
                    "n_visit": r[4],
                    "l_interaction": r[5],
                    "last_access": r[6],
                    "created": r[7],
                    "n_pages": r[8],
                }
                for r in segs
            ],
            "user_knowledge": self.owner_knowledge("user", user_id, live_only=False),
            "pending": self.count_pending(user_id),
            "history": self.history(user_id),
        }

    def delete_user(self, user_id: str) -> bool:
        """Remove every row held about the user (pages, segments, knowledge, pending, audit)."""
        with self.transaction() as db:
            db.execute("DELETE FROM pending WHERE user_id = ?", (user_id,))
            db.execute("DELETE FROM pages WHERE user_id = ?", (user_id,))
            db.execute("DELETE FROM segments WHERE user_id = ?", (user_id,))
            db.execute(
                "DELETE FROM knowledge WHERE owner_kind = 'user' AND owner_id = ?", (user_id,)
            )
            db.execute("DELETE FROM audit WHERE user_id = ?", (user_id,))
            cur = db.execute("DELETE FROM users WHERE user_id = ?", (user_id,))
            return cur.rowcount > 0

    def rows_about(self, user_id: str) -> int:
        """Rows anywhere in the store that name the user (0 after delete_user)."""
        total = 0
        for table, col in (
            ("users", "user_id"),
            ("pages", "user_id"),
            ("segments", "user_id"),
            ("pending", "user_id"),
            ("audit", "user_id"),
            ("knowledge", "owner_id"),
        ):
            total += self.query(f"SELECT COUNT(*) FROM {table} WHERE {col} = ?", (user_id,))[0][0]
        return total

    def counts(self) -> dict[str, int]:
        out = {}
        for table in ("users", "assistants", "segments", "pending", "audit"):
            out[table] = self.query(f"SELECT COUNT(*) FROM {table}")[0][0]
        for tier, n in self.query("SELECT tier, COUNT(*) FROM pages GROUP BY tier"):
            out[f"pages_{tier}"] = n
        out["knowledge_live"] = self.query("SELECT COUNT(*) FROM knowledge WHERE live = 1")[0][0]
        return out


def _page_dict(r: tuple) -> dict[str, Any]:
    return {
        "page_id": r[0],
        "user_id": r[1],
        "seq": r[2],
        "user_input": r[3],
        "agent_response": r[4],
        "timestamp": r[5],
        "tier": r[6],
        "segment_id": r[7],
        "prev_page": r[8],
        "next_page": r[9],
        "meta": r[10],
        "summary": r[11],
        "keywords": json.loads(r[12]) if r[12] else [],
        "analysed": bool(r[13]),
        "mode": r[14],
        "source": r[15],
        "extra": json.loads(r[16]) if r[16] else {},
    }

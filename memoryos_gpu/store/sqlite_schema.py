"""The SQLite store's schema: the version-1 tables and the forward migrations to the current
:data:`SCHEMA_VERSION`.

Why a module of its own: the schema text is long and changes only by adding a migration, while
:class:`~memoryos_gpu.store.sqlite.SQLiteStore` runs it (``_migrate``, the version check) and
reads it at open from here (as module attributes, so tests can patch them). PostgreSQL's own
dialect of the same versions is :mod:`memoryos_gpu.store.postgres_schema`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

#: The version this code writes: a store at an older one is migrated up (:data:`MIGRATIONS`).
SCHEMA_VERSION = 14

SCHEMA_V1 = """
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

#: The tables a version added, from the outbox's on (a store opened at an older version, as
#: the tests of a migration do, lacks them: :func:`required_tables`).
TABLES_SINCE: dict[int, frozenset[str]] = {14: frozenset({"outbox", "outbox_marks"})}

# The tables every store at the current version has (checked on open).
REQUIRED_TABLES = frozenset().union(*TABLES_SINCE.values()) | frozenset(
    {
        "meta",
        "assistants",
        "users",
        "segments",
        "pages",
        "knowledge",
        "pending",
        "audit",
        "provenance",
        "chains",
        "page_vectors",
        "claims",
    }
)


def required_tables(version: int) -> frozenset[str]:
    """The tables a store at ``version`` has (read at the call: tests patch the module's)."""
    later = (tables for since, tables in TABLES_SINCE.items() if since > version)
    return REQUIRED_TABLES.difference(*later)


# Forward migrations: MIGRATIONS[v] upgrades a store at version v to v + 1. A value is either
# SQL text (statements separated by ";", no ";" inside literals) or a callable taking the open
# connection; each migration runs in one transaction together with its version bump, so a crash
# mid-migration leaves the store at the old version. A new store is created at version 1
# (``SCHEMA_V1``) and brought forward through the same chain, so every store of a version has
# the same schema however it was made.
Migration = str | Callable[[sqlite3.Connection], None]
MIGRATIONS: dict[int, Migration] = {
    # 1 -> 2: each page keeps its BM25 term row (memoryos_gpu.lexical.terms_to_blobs), so a
    # reopen loads the lexical index with the embeddings; rows of older pages are computed
    # from their text on the first open (MemoryEngine rebuild) and written back
    1: "ALTER TABLE pages ADD COLUMN terms BLOB",
    # 2 -> 3: provenance (which pages each knowledge entry and profile value was derived
    # from) and the validity of knowledge entries (a newer contradicting fact supersedes an
    # older one; both are kept). Entries of older stores have no provenance rows: they start
    # valid from when they were made (memoryos_gpu/store/derivations.py, docs/storage.md).
    2: """
CREATE TABLE provenance(
  item_kind TEXT NOT NULL CHECK (item_kind IN ('knowledge', 'profile')),
  item_id INTEGER NOT NULL,
  item_key TEXT NOT NULL DEFAULT '',
  page_id INTEGER NOT NULL,
  user_id TEXT NOT NULL,
  PRIMARY KEY (item_kind, item_id, item_key, page_id)
) WITHOUT ROWID;
CREATE INDEX provenance_page ON provenance(page_id);
CREATE INDEX provenance_user ON provenance(user_id, item_kind);
ALTER TABLE knowledge ADD COLUMN valid_from REAL;
ALTER TABLE knowledge ADD COLUMN valid_to REAL;
ALTER TABLE knowledge ADD COLUMN superseded_by INTEGER;
ALTER TABLE knowledge ADD COLUMN fact_key TEXT;
ALTER TABLE knowledge ADD COLUMN strength INTEGER NOT NULL DEFAULT 1;
CREATE INDEX knowledge_superseded ON knowledge(superseded_by) WHERE superseded_by IS NOT NULL;
CREATE INDEX knowledge_learned ON knowledge(source_user) WHERE owner_kind = 'assistant';
UPDATE knowledge SET valid_from = created, source_user = CASE WHEN owner_kind = 'user' THEN
  owner_id END
""",
    # 3 -> 4: a provenance row is keyed by its page's user too. Under per-shard stores an
    # assistant's owner shard records the pages of users on other shards, whose ids are
    # numbered by their own files: page 7 of one shard and page 7 of another are two sources.
    3: """
CREATE TABLE provenance_v4(
  item_kind TEXT NOT NULL CHECK (item_kind IN ('knowledge', 'profile')),
  item_id INTEGER NOT NULL,
  item_key TEXT NOT NULL DEFAULT '',
  page_id INTEGER NOT NULL,
  user_id TEXT NOT NULL,
  PRIMARY KEY (item_kind, item_id, item_key, page_id, user_id)
) WITHOUT ROWID;
INSERT INTO provenance_v4 SELECT item_kind, item_id, item_key, page_id, user_id FROM provenance;
DROP TABLE provenance;
ALTER TABLE provenance_v4 RENAME TO provenance;
CREATE INDEX provenance_page ON provenance(page_id);
CREATE INDEX provenance_user ON provenance(user_id, item_kind)
""",
    # 4 -> 5: a dialogue chain's meta summary is kept once, in its own row, instead of on
    # every page of the chain: it changes each time the chain grows, and rewriting it on
    # every page cost O(chain length) a page (O(n^2) over a long conversation). A chain's id
    # stays the id of its first page; its meta is the one its latest page carried. A user's
    # current chain meta is its tail's chain's (users.chain_meta, a copy, goes). And the
    # pages a promotion analyses are found without reading the segment's analysed ones.
    4: """
CREATE TABLE chains(
  chain_id INTEGER PRIMARY KEY,
  user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
  meta TEXT
);
CREATE INDEX chains_user ON chains(user_id);
CREATE INDEX pages_unanalysed ON pages(segment_id, seg_pos) WHERE analysed = 0;
INSERT INTO chains(chain_id, user_id, meta) SELECT chain_id, user_id, meta FROM (
  SELECT chain_id, user_id, meta, MAX(seq) FROM pages WHERE chain_id IS NOT NULL
  GROUP BY chain_id
);
ALTER TABLE pages DROP COLUMN meta;
ALTER TABLE users DROP COLUMN chain_meta
""",
    # 5 -> 6: a page's embedding and BM25 term row (~1.7 KB, written once) move to a table of
    # their own, so the page row that a page's passage through the tiers rewrites (stm ->
    # pending -> mtm: tier, segment, chain) is the narrow one: SQLite rewrites a whole row on
    # any update, and the wide row made each of those updates ~3x dearer (benchmarks/README.md).
    # The indexes by segment and by chain leave out the pages on none (STM, pending): an
    # accepted page no longer writes three index entries it has no use for (still used by
    # the lookups and the foreign key, whose terms imply IS NOT NULL)
    5: """
CREATE TABLE page_vectors(
  page_id INTEGER PRIMARY KEY REFERENCES pages(page_id) ON DELETE CASCADE,
  embedding BLOB NOT NULL,
  terms BLOB
);
INSERT INTO page_vectors(page_id, embedding, terms) SELECT page_id, embedding, terms FROM pages;
ALTER TABLE pages DROP COLUMN embedding;
ALTER TABLE pages DROP COLUMN terms;
DROP INDEX pages_segment;
CREATE INDEX pages_segment ON pages(segment_id, seg_pos) WHERE segment_id IS NOT NULL;
DROP INDEX pages_chain;
CREATE INDEX pages_chain ON pages(chain_id) WHERE chain_id IS NOT NULL;
DROP INDEX pages_unanalysed;
CREATE INDEX pages_unanalysed ON pages(segment_id, seg_pos)
  WHERE analysed = 0 AND segment_id IS NOT NULL
""",
    # 6 -> 7: promotion claims (memoryos_gpu/engine/heat.py) in the store: the wave that makes
    # a segment hot claims its pages up to its own (``upto``; NULL: every unanalysed page), in
    # the wave's transaction, and the promotion deletes them in its own. Held only in memory
    # before, a crash between the two made the resumed promotion take every unanalysed page,
    # later ones included, and merged a segment's queued promotions into one. Older stores
    # start without claims: their queued promotions take every page, as they did.
    6: """
CREATE TABLE claims(
  segment_id INTEGER NOT NULL REFERENCES segments(segment_id) ON DELETE CASCADE,
  claim_order INTEGER NOT NULL,
  upto INTEGER,
  PRIMARY KEY (segment_id, claim_order)
) WITHOUT ROWID
""",
    # 7 -> 8: the pages an LLM derived, indexed (an extractive store's pages are not in it):
    # an engine without an LLM asks, before it derives a store's pending work, whether an
    # LLM derived any of its pages (MemoryEngine._warn_of_another_mode), and without the
    # index that question read every page row of an extractive store, once an engine. And
    # audit events take their ids from ``new_ids`` (SQLiteStore.audit_many): its mark starts
    # above every event the store holds, or the first event after deleting a user whose
    # events were the newest (that deletion's own tombstone) would take one of their ids
    7: """
CREATE INDEX pages_llm ON pages(page_id) WHERE mode IN ('llm', 'llm-fallback');
INSERT OR IGNORE INTO meta(key, value)
  SELECT 'next_id.audit', CAST(COALESCE(MAX(event_id), 0) + 1 AS TEXT) FROM audit
""",
    # 8 -> 9: a page's pending row keeps its user's logical clock when the page left STM (the
    # time of the page that pushed it out), and the round that moves it into MTM stamps its
    # segment (recency, eviction and promotion heat) at that time. The round used the user's
    # clock when it ran: for a log added in one batch, the newest page's time for every
    # segment, so all heats tied and eviction could drop the newest segment. NULL (rows of
    # older versions, promotion rows): the user's clock, as before
    8: "ALTER TABLE pending ADD COLUMN clock REAL",
    # 9 -> 10: words of scripts written without spaces (Chinese, Japanese, Thai...) are split
    # into letter pairs, combining marks stay in their words, and Arabic and Hebrew vowel marks
    # and the dot of a Turkish capital I fold away (memoryos_gpu/text/words.py). The term rows
    # of pages with any text outside ASCII were split the old way: their rows go, and the open
    # computes them again from the text (rebuild._backfill_terms), so old pages match new
    # queries. ASCII text splits as before (length in characters = length in bytes). Speaker
    # names come from ``extra``.
    9: """
UPDATE page_vectors SET terms = NULL WHERE terms IS NOT NULL AND page_id IN (
  SELECT page_id FROM pages WHERE tier != 'evicted' AND (
    length(CAST(user_input AS BLOB)) != length(user_input)
    OR length(CAST(agent_response AS BLOB)) != length(agent_response)
    OR length(CAST(extra AS BLOB)) != length(extra)))
""",
    # 10 -> 11: a knowledge entry's audit events, indexed. Deleting an entry (or the pages it
    # was derived from) blanks the detail of its events (``item_kind = 'knowledge' AND
    # item_id = ?``), which scanned the whole audit table under the engine lock: 190 ms a
    # deletion at 2 million events, every retrieval waiting. Partial, so the page events
    # that bulk ingestion writes (one a page) add nothing to the index.
    10: "CREATE INDEX audit_knowledge ON audit(item_id) WHERE item_kind = 'knowledge'",
    # 11 -> 12: an elided French, Italian or Catalan article or pronoun is a word of its own
    # (``l'été`` is ``l`` and ``été``: memoryos_gpu/text/words.py), and a page in another
    # language gets its date in that language's words too (text/date_names.py). The term rows
    # of pages whose text holds an apostrophe or anything outside ASCII were split the old way
    # (one word ``lété``, English date words only): their rows go, and the open computes them
    # again from the text, as for 9 -> 10.
    11: """
UPDATE page_vectors SET terms = NULL WHERE terms IS NOT NULL AND page_id IN (
  SELECT page_id FROM pages WHERE tier != 'evicted' AND (
    instr(user_input, '''') > 0 OR instr(user_input, '’') > 0
    OR instr(agent_response, '''') > 0 OR instr(agent_response, '’') > 0
    OR instr(extra, '''') > 0 OR instr(extra, '’') > 0
    OR length(CAST(user_input AS BLOB)) != length(user_input)
    OR length(CAST(agent_response AS BLOB)) != length(agent_response)))
""",
    # 12 -> 13: a page or question written in another language than English loses that
    # language's stopwords from its BM25 terms too, as from its keywords (the language found
    # per text from the stopword lists, text/stopword_lists.py), and a page gets its date in
    # more languages' words, inflected forms too (text/date_names.py). Any page may be found to be
    # in another language, ASCII ones too (Spanish without accents), and no SQL can tell which:
    # every row goes, and the open computes them again from the text (~20 us a page, once).
    12: "UPDATE page_vectors SET terms = NULL WHERE terms IS NOT NULL AND page_id IN ("
    "SELECT page_id FROM pages WHERE tier != 'evicted')",
    # 13 -> 14: a shard engine's assistant facts wait for their owner shard in the store
    # (``outbox``, written in the promotion's transaction, deleted once the owner committed
    # them), not in the process's memory, where a shard or router that stopped lost them for
    # good (their pages were marked analysed); the owner keeps, per sender, the newest fact it
    # committed (``outbox_marks``), so a fact sent again (a lost reply) lands once
    # (memoryos_gpu/distributed/replicas.py). A single engine writes neither.
    13: """
CREATE TABLE outbox(
  fact_id INTEGER PRIMARY KEY,
  sender INTEGER NOT NULL,
  source_user TEXT,
  fact TEXT NOT NULL
);
CREATE INDEX outbox_sender ON outbox(sender, fact_id);
CREATE TABLE outbox_marks(
  owner INTEGER NOT NULL,
  sender INTEGER NOT NULL,
  upto INTEGER NOT NULL,
  PRIMARY KEY (owner, sender)
)
""",
}


def run_sql(db: sqlite3.Connection, script: str) -> None:
    for stmt in script.split(";"):
        if stmt.strip():
            db.execute(stmt)

"""How the store's rows are encoded and decoded: embeddings as float32 blobs, keyword ids as
int32 blobs, page and knowledge rows as dicts, retrieval views of pages, id lists in chunks small
enough for one ``IN (...)``.

Why a module of its own: the engine writes the same blobs (``emb_blob``) and reads them back in
bulk (``blob_matrix``) outside the store class, and the store's read side
(:mod:`memoryos_gpu.store.reads`) decodes rows with the same helpers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from memoryos_gpu.store.errors import StoreError


def emb_blob(v: np.ndarray) -> bytes:
    return np.ascontiguousarray(v, dtype="<f4").tobytes()


def emb_blobs(m: np.ndarray | Sequence[np.ndarray]) -> list[bytes]:
    """The rows of an ``[n, dim]`` embedding matrix as :func:`emb_blob` makes them, with one
    conversion for the matrix: slicing its bytes costs a fifth of a conversion a row."""
    if not len(m):
        return []
    raw = np.ascontiguousarray(m, dtype="<f4")
    step = raw.shape[1] * 4
    data = raw.tobytes()
    return [data[k : k + step] for k in range(0, len(data), step)]


def blob_matrix(blobs: Sequence[bytes], dim: int) -> np.ndarray:
    """Many float32 blobs to one ``[n, dim]`` array in a single copy (no per-row numpy)."""
    if not len(blobs):
        return np.zeros((0, dim), np.float32)
    joined = b"".join(blobs)
    if len(joined) != len(blobs) * dim * 4:
        raise StoreError(
            f"embedding blobs hold {len(joined)} bytes, expected {len(blobs)} x {dim} float32; "
            "the store is corrupt or was written with another dimension"
        )
    # frombuffer over a fresh bytes object is read-only; one copy makes it a writable float32.
    return np.frombuffer(joined, dtype="<f4").reshape(len(blobs), dim).astype(np.float32)


def kw_matrix(blobs: Sequence[bytes], width: int) -> np.ndarray:
    """Ragged int32 keyword-id blobs to a ``[n, width]`` matrix padded with -1 (ids past
    ``width`` dropped), vectorised: one join, one scatter (~5x faster than a per-row
    ``np.frombuffer`` loop on 2M rows)."""
    n = len(blobs)
    out = np.full((n, width), -1, np.int32)
    if not n:
        return out
    counts = np.fromiter(map(len, blobs), np.int64, n)
    if (counts & 3).any():
        raise StoreError("keyword-id blobs are not whole int32 arrays; the store is corrupt")
    counts >>= 2
    ids = np.frombuffer(b"".join(blobs), "<i4")
    starts = np.cumsum(counts) - counts
    if counts.max() > width:  # rare: drop the ids past the width
        col = np.arange(ids.size) - np.repeat(starts, counts)
        keep = col < width
        row = np.repeat(np.arange(n), counts)
        out[row[keep], col[keep]] = ids[keep]
        return out
    pos = np.repeat(np.arange(n, dtype=np.int64) * width - starts, counts)
    pos += np.arange(ids.size)
    out.reshape(-1)[pos] = ids
    return out


def page_dict(r: tuple) -> dict[str, Any]:
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
        "keywords": json.loads(r[12]) if r[12] and r[12] != "[]" else [],
        "analysed": bool(r[13]),
        "mode": r[14],
        "source": r[15],
        "extra": json_dict(r[16]),
    }


def knowledge_dict(r: tuple) -> dict[str, Any]:
    return {
        "entry_id": r[0],
        "owner_kind": r[1],
        "owner_id": r[2],
        "seq": r[3],
        "text": r[4],
        "live": bool(r[5]),
        "mode": r[6],
        "created": r[7],
        "strength": r[8],
        "valid_from": r[9] if r[9] is not None else r[7],
        "valid_to": r[10],
        "superseded_by": r[11],
        "source_user": r[12],
    }


def json_dict(text: str | None) -> dict[str, Any]:
    return json.loads(text) if text and text != "{}" else {}  # most pages: no decode


def select_in(
    run: Callable[[str, list[int]], list[tuple]], select: str, ids: Sequence[int]
) -> list[tuple]:
    """The rows of ``select`` (ending in ``IN``) over ``ids``, one statement per chunk of
    :func:`id_chunks`; ``run(sql, params)`` runs one (``store.query``, or a transaction's
    ``execute(...).fetchall()``)."""
    rows: list[tuple] = []
    for chunk in id_chunks(ids):
        rows += run(f"{select} ({','.join('?' * len(chunk))})", chunk)
    return rows


def id_chunks(ids: Sequence[int], size: int = 500) -> list[list[int]]:
    """Ids as ints, in chunks small enough for one ``IN (...)`` list."""
    ints = [int(i) for i in ids]
    return [ints[i : i + size] for i in range(0, len(ints), size)]


class PageView(NamedTuple):
    """The fields of a page that a retrieval returns."""

    user_input: str
    agent_response: str
    timestamp: float
    chain_id: int | None  # the dialogue chain the page is on (MTM pages)
    meta: str | None  # that chain's meta summary
    extra: dict[str, Any]


def audit_owner(owner_kind: str, owner_id: str) -> str:
    """The audit's owner of a knowledge entry: its user, or ``assistant:<id>`` for an
    assistant's entry (one name space with the users in the audit's ``user_id`` column)."""
    return owner_id if owner_kind == "user" else f"assistant:{owner_id}"

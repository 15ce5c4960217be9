"""Deleting a user or a page under sharding: what the pages taught the shared assistants goes too.

Why a step of its own: a user's pages, profile and own facts live on the user's shard, but the
facts those pages taught an assistant are written by the assistant's *owner* shard and copied to
every other shard (``replicas.py``, "one writer, read replicas everywhere"). Each such fact
travels to its owner with its provenance (the source user and page ids, ``Fact`` in the
shard's outbox), so the owner records it like a single engine does; deleting the user, or
deleting or editing one of its pages, must then reach every shard. The same steps serve both,
for "the user's pages" (every page: ``pages`` None) or "these pages of the user":

1. every shard removes the assistant entries *it owns* learned from those pages, and the
   entries they had superseded (``ShardEngine.forget_learned_from``:
   :func:`~memoryos_gpu.store.derivations.forget_learned`); it answers their (assistant, seq)
   and the other pages behind them that it does not hold;
2. every shard drops its replicas of those entries (``drop_assistant_entries``; a store shared
   by every shard re-reads its assistants' rings instead);
3. the user's shard makes the change itself (``delete_user``, ``delete_page`` or
   ``update_page``, each of which also drops its outbox's facts of those pages, not routed
   yet), and every other shard takes the document frequencies of the pages' old text, which
   the keyword exchange gave it, out of its keyword statistics and their saved copy, and adds
   those of their new text (an edit) (``user_keyword_delta`` / ``forget_keyword_delta`` /
   ``apply_keyword_delta``);
4. the other pages behind a removed fact are re-analysed on their users' shards
   (``reanalyse_pages``), so what they support on their own comes back at their next round
   (an edited page is re-analysed by its own ``update_page``, so what its new text says is
   derived again).

Steps 1 and 2 go first so that no shard serves a fact of those pages after the change returns
(and because step 1 reads provenance rows the user's shard deletes). :func:`forget_everywhere`
runs the steps through a ``call(shard, method, args)`` function, the same way in process
(:class:`~memoryos_gpu.distributed.sharding.ShardedEngine`) and, awaited, on Ray Serve replicas
(``ray_serve.RouterService``: :func:`forget_everywhere_async`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from memoryos_gpu.engine.forget import Forgetting
from memoryos_gpu.engine.validation import _clean_text
from memoryos_gpu.store.derivations import Forgotten, forget_learned, reanalyse
from memoryos_gpu.text.keywords import KeywordExtractor

from .exchange import EXCHANGE_MARKS
from .layout import EXTRACTOR_KEY

if TYPE_CHECKING:
    from .layout import ShardMap
    from .sharding import ShardEngine

Learned = dict[str, list[tuple[Any, Any]]]  # {"entries": [(aid, seq)], "elsewhere": [(p, u)]}

#: The saved keyword statistics' record of the users whose pages ``forget_in_stores`` took out
#: of them (user -> digest of the pages), the last ``UNCOUNTED_KEPT``: what makes a re-run of
#: a delete stopped part way un-count each shard once. A reopened engine's next save drops it.
UNCOUNTED = "uncounted_users"
UNCOUNTED_KEPT = 64


# ---------------------------------------------------------------------------- one shard's side
def forget_learned_from(
    e: ShardEngine, user_id: str, pages: Sequence[int] | None = None
) -> Learned:
    """Step 1 on one shard (see the module docstring)."""
    with e._state.locked():  # touches the store: the rewrite gate first (engine/state.py)
        e.store.begin_erasure()
        with e.store.transaction() as db:
            gone = forget_learned(
                db, user_id, lambda aid: e.shard_map.assistant_owner(aid) == e.shard_index, pages
            )
        e.store.checkpoint()
        Forgetting(e._state).drop(gone)
        return {"entries": gone.assistant, "elsewhere": gone.elsewhere}


def drop_assistant_entries(
    e: ShardEngine, entries: Sequence[tuple[str, int]], *, superseded: bool = False
) -> int:
    """Step 2 on one shard: its replica rows of the owners' removed entries (by assistant and
    ring ``seq``, the numbering every copy shares) out of the store and the arena; returns
    how many. ``superseded``: the owner superseded them instead, the rows stay as history (not
    live). A shared store holds one row per entry, already changed by its owner: the shard
    re-reads every assistant ring it holds."""
    with e._state.locked():
        if e.shared_store:
            e._reload_assistants(sorted(e._state.assistant_owner))
            return 0
        ids: list[int] = []
        with e.store.transaction() as db:
            for aid, seq in entries:
                found = db.execute(
                    "SELECT entry_id FROM knowledge WHERE owner_kind = 'assistant' AND "
                    "owner_id = ? AND seq = ?",
                    (aid, int(seq)),
                ).fetchall()
                ids += [int(r[0]) for r in found]
            change = "UPDATE knowledge SET live = 0" if superseded else "DELETE FROM knowledge"
            for eid in ids:
                db.execute(f"{change} WHERE entry_id = ?", (eid,))
        Forgetting(e._state).drop(Forgotten(entries=ids))
        return len(ids)


def user_keyword_delta(
    e: ShardEngine, user_id: str, pages: Sequence[int] | None = None
) -> dict[str, Any]:
    """Step 3, the user's shard: the document frequencies of the user's pages (``pages``:
    those of them) as held now (what the keyword exchange gave the other shards), read before
    the change and again after it (an edit's new text; nothing once deleted)."""
    sql = "SELECT user_input || ' ' || agent_response FROM pages WHERE user_id = ?"
    if pages is None:
        rows = e.store.query(sql, (user_id,))
    else:
        ids = sorted({int(p) for p in pages})
        rows = e.store.query(f"{sql} AND page_id IN ({','.join('?' * len(ids))})", (user_id, *ids))
    scratch = e._scratch_extractor().update(t for (t,) in rows)
    return {"n_docs": scratch.n_docs, "df": dict(scratch.df)}


def forget_keyword_delta(e: ShardEngine, delta: dict[str, Any]) -> None:
    """Step 3, every other shard: un-count those frequencies (a word no document holds any
    more is dropped) and rewrite the saved copy at once, so it does not keep them."""
    with e._state.locked():
        if e.extractor.n_docs <= _own_pages(e):
            return  # it counts no other shard's page (never exchanged): nothing of them to take
        df = e.extractor.df
        for tok, n in delta["df"].items():
            left = df.get(tok, 0) - int(n)
            if left > 0:
                df[tok] = left
            else:
                df.pop(tok, None)
        e.extractor.n_docs = max(0, e.extractor.n_docs - int(delta["n_docs"]))
        e._derived.save_extractor()


def _own_pages(e: ShardEngine) -> int:
    """How many pages of its own users the shard's store holds (its statistics count each)."""
    rows = e.store.query("SELECT user_id, COUNT(*) FROM pages GROUP BY user_id")
    return sum(int(n) for uid, n in rows if e.owns(uid))


def reanalyse_pages(e: ShardEngine, pages: Sequence[tuple[int, str]]) -> list[int]:
    """Step 4 on one shard: the pages it holds are marked unanalysed and their segments queued
    for promotion (the next ``process_pending`` derives their facts again)."""
    with e._state.locked(), e.store.transaction() as db:
        return reanalyse(db, pages)


# ---------------------------------------------------------------------------- the router's side
def removed_entries(learned: Sequence[Learned]) -> list[tuple[str, int]]:
    return sorted({(str(a), int(s)) for part in learned for a, s in part["entries"]})


def reanalysis_by_shard(
    learned: Sequence[Learned], shard_map: ShardMap
) -> dict[int, list[tuple[int, str]]]:
    """The pages behind removed facts, grouped by the shard of their user (step 1 left out
    the pages being changed)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for part in learned:
        for page, user in part["elsewhere"]:
            out.setdefault(shard_map.shard(user), []).append((int(page), str(user)))
    return out


def check_edit(user_input: str | None, agent_response: str | None) -> None:
    """An edit's text, checked before step 1 forgets anything (a refused edit loses nothing)."""
    for text, what in ((user_input, "user_input"), (agent_response, "agent_response")):
        if text is not None:
            _clean_text(text, what)


def forget_everywhere(
    call: Callable[[int, str, tuple], Any],
    change: Callable[[], Any],
    shard_map: ShardMap,
    user_id: str,
    pages: Sequence[int] | None = None,
) -> Any:
    """The module docstring's steps, in process: ``call(shard, method, args)`` runs a
    :class:`ShardEngine` method on that shard, ``change()`` is the user's shard's own change
    (step 3); returns what it returned."""
    shards = range(shard_map.count)
    learned = [call(j, "forget_learned_from", (user_id, pages)) for j in shards]
    removed = removed_entries(learned)
    for j in shards:
        call(j, "drop_assistant_entries", (removed,))
    home = shard_map.shard(user_id)
    old = call(home, "user_keyword_delta", (user_id, pages))
    result = change()
    new = call(home, "user_keyword_delta", (user_id, pages))
    for j in shards:
        if j != home and old["n_docs"]:
            call(j, "forget_keyword_delta", (old,))
        if j != home and new["n_docs"]:
            call(j, "apply_keyword_delta", (new,))
    for j, again in sorted(reanalysis_by_shard(learned, shard_map).items()):
        call(j, "reanalyse_pages", (again,))
    return result


async def forget_everywhere_async(
    call: Callable[[int, str, tuple], Awaitable[Any]],
    change: Callable[[], Awaitable[Any]],
    shard_map: ShardMap,
    user_id: str,
    pages: Sequence[int] | None = None,
) -> Any:
    """:func:`forget_everywhere` over awaited calls (Ray Serve), the shards of a step at once."""
    import asyncio

    shards = range(shard_map.count)
    learned = await asyncio.gather(
        *(call(j, "forget_learned_from", (user_id, pages)) for j in shards)
    )
    removed = removed_entries(learned)
    await asyncio.gather(*(call(j, "drop_assistant_entries", (removed,)) for j in shards))
    home = shard_map.shard(user_id)
    old = await call(home, "user_keyword_delta", (user_id, pages))
    result = await change()
    new = await call(home, "user_keyword_delta", (user_id, pages))
    others = [j for j in shards if j != home]
    for name, delta in (("forget_keyword_delta", old), ("apply_keyword_delta", new)):
        if delta["n_docs"]:
            await asyncio.gather(*(call(j, name, (delta,)) for j in others))
    plan = reanalysis_by_shard(learned, shard_map)
    await asyncio.gather(*(call(j, "reanalyse_pages", (p,)) for j, p in sorted(plan.items())))
    return result


def given_texts(
    st: Any,
    state: dict[str, Any],
    home: int,
    count: int,
    texts: Sequence[str],
    page_ids: Sequence[int] | None = None,
) -> list[str]:
    """Of the texts of shard ``home``'s pages (``page_ids``: theirs, ascending), those that
    another shard's saved keyword statistics ``state`` (in its store ``st``) count: the pages
    the keyword exchange gave it. Its statistics count its own pages through its page
    watermark (all, without one) and, beyond those, only what an exchange gave it: none
    (``ingest --workers`` / ``--shard``: shards never exchange) -> nothing. With exchange
    marks (``exchange.EXCHANGE_MARKS``: saved by an exchange by marks, nothing saved since),
    the home shard's pages through its mark; without (saved by an engine after its
    exchanges), every page. Never more than the documents of other shards it counts."""
    mark = state.get("page_watermark")
    sql, args = "SELECT COUNT(*) FROM pages", ()
    if mark is not None:
        sql, args = f"{sql} WHERE page_id <= ?", (int(mark),)
    others = int(state.get("n_docs", 0)) - int(st.query(sql, args)[0][0])
    if others <= 0:
        return []
    pairs = list(zip(page_ids, texts, strict=True)) if page_ids is not None else None
    marks = state.get(EXCHANGE_MARKS)
    if pairs is not None and isinstance(marks, dict) and marks.get("count") == count:
        top = int(marks["through"][home])
        texts = [t for p, t in pairs if int(p) <= top]
    return list(texts)[:others]


def forget_in_stores(
    stores: Sequence[Any],
    shard_map: ShardMap,
    user_id: str,
    texts: Sequence[str],
    page_ids: Sequence[int] | None = None,
) -> int:
    """The steps through the shards' stores alone (``memoryos-gpu delete`` on a sharded store
    directory, no engine open; the caller reads the ``texts`` of the user's pages, calls this,
    then deletes the user on its shard): the assistant facts go from every store, the other users'
    pages behind them are re-analysed, and every other shard's saved keyword statistics
    un-count those of the texts they were given (:func:`given_texts`; ``page_ids``: the
    texts' page ids, in the same order). The engines read the rows left when they open.
    Returns the assistant entries removed.

    Run before the user's own rows go, so a delete stopped part way is finished by running it
    again: each step but the un-counting finds nothing left to do the second time, and a
    shard's statistics record the users whose pages they un-counted (``UNCOUNTED``: user ->
    a digest of those page ids, written with the statistics) so a re-run skips them."""
    digest = _pages_digest(user_id, page_ids if page_ids is not None else texts)
    learned: list[Learned] = []
    for j, st in enumerate(stores):
        st.begin_erasure()
        with st.transaction() as db:
            gone = forget_learned(db, user_id, lambda aid, j=j: shard_map.assistant_owner(aid) == j)
        learned.append({"entries": gone.assistant, "elsewhere": gone.elsewhere})
    removed = removed_entries(learned)
    home = shard_map.shard(user_id)
    for j, st in enumerate(stores):
        with st.transaction() as db:
            db.executemany(
                "DELETE FROM knowledge WHERE owner_kind = 'assistant' AND owner_id = ? AND seq = ?",
                removed,
            )
        saved = st.get_meta(EXTRACTOR_KEY) if j != home else None
        state = json.loads(saved) if saved else {}
        done = state.get(UNCOUNTED, {})
        given = given_texts(st, state, home, shard_map.count, texts, page_ids) if saved else []
        if given and done.get(user_id) != digest:  # not by a delete stopped before the end
            ex = KeywordExtractor.from_dict(state).remove(given)
            # what the record says it counts stays with it: the page watermark the open refits
            # from and the exchange marks (exchange.EXCHANGE_MARKS) a resumed ingest --ray reads
            kept = {k: state[k] for k in ("page_watermark", EXCHANGE_MARKS) if k in state}
            done = {u: d for u, d in done.items() if u != user_id}
            done = dict(list(done.items())[-UNCOUNTED_KEPT + 1 :]) | {user_id: digest}
            st.set_meta(EXTRACTOR_KEY, json.dumps({**ex.to_dict(), **kept, UNCOUNTED: done}))
        st.checkpoint()
    for j, pages in sorted(reanalysis_by_shard(learned, shard_map).items()):
        with stores[j].transaction() as db:
            reanalyse(db, pages)
    return len(removed)


def _pages_digest(user_id: str, pages: Sequence[Any]) -> str:
    """A user's pages, as ``UNCOUNTED`` records them: the same pages give the same digest, so
    a user id deleted, written again and deleted again is un-counted again."""
    h = hashlib.sha256(user_id.encode())
    for p in pages:
        h.update(b"\0" + str(p).encode())
    return h.hexdigest()[:32]

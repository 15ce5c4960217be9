"""What retrievals show of every live page and knowledge entry, held in memory.

Why: a retrieval returns ~17 pages (its MTM top k and the whole STM) and up to 20 knowledge
entries. Reading their texts from the store cost SQL on every batch (~15 % of the serving CPU
with a warm cache, and the whole first query of a user after a reopen with a cold one), so the
engine keeps the texts of every page in STM or MTM, and of every live knowledge entry, here:
filled from the store on open, kept current wherever the engine writes a page or an entry, and
never read back from the store on the retrieval path. The store stays the source of truth; this
is its read copy.

The records live in native tables (``memoryos_gpu._C.TextTable``, ``csrc/bindings/
text_table.h``): one open-addressing slot per id and one block of its texts, not a dict of
tuples of str. At 1,000-10,000 users the objects of a dict were spread over the heap and
building a batch's results waited on a cache miss per text; a table slot is found from the id
alone, so the native assembler asks for a whole batch's records before it reads one, and it
copies each text into a fresh str. It also takes less memory: ~130 bytes per page besides
the texts (their CPython code units) instead of ~340 (200,000 pages of ~130 characters: 263
against 471 bytes a page of RSS; ``stats()["views"]["bytes"]``).

A page's dialogue-chain meta summary is a record of its own, by chain id, which the page's
record links to: a chain's meta changes each time the chain grows, and kept on every page it
cost a rewrite of every page of the chain per page added (O(n^2) over a long conversation).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from memoryos_gpu.json_codec import dumps_text
from memoryos_gpu.text.unicode_ranges import ONE_TOKEN_RANGES, class_body
from memoryos_gpu.types import JSON_LEAVES, ReadOnlyDict, frozen_meta


class PageView(NamedTuple):
    """The fields of a page a retrieval returns."""

    user_input: str
    agent_response: str
    timestamp: float
    meta: str | None  # the chain's meta summary
    extra: ReadOnlyDict  # the page's own metadata (read-only at every level), shared by every
    # retrieval of the page
    tokens: int  # what the page adds to a prompt (approx_tokens of its texts), counted once


#: The characters a tokenizer gives about one token each: CJK ideographs (with their radicals,
#: strokes and symbols), kana, bopomofo, hangul, and the fullwidth and CJK compatibility forms.
#: Generated (scripts/gen_unicode_table.py) with the native tables' copy, so both count alike.
_ONE_TOKEN = re.compile(f"[{class_body(ONE_TOKEN_RANGES)}]")


def approx_tokens(*texts: str | None) -> int:
    """Tokens a prompt would carry for ``texts``, no tokenizer: a CJK, kana or hangul character
    is one token, the rest ~4 characters a token (``(n + 3) // 4`` for ASCII text). Why not 4
    characters for all: a Chinese character is about one token (one for the bundled MiniLM
    tokenizer, 0.7 to 1.5 for Qwen's and Llama's), so "~140 tokens of context" was said of
    450 of them, and a prompt budgeted from it overflowed. Rounded up once over all
    ``texts``, as the native tables count a page (its texts and its chain's meta)."""
    return (token_quarters(*texts) + 3) // 4


def token_quarters(*texts: str | None) -> int:
    """``texts``' size in quarter tokens: a character each, four for one of :data:`_ONE_TOKEN`.
    The unit the native tables keep a record's size in (``TextTable``'s ``chars``), so that a
    page's texts and its chain's meta sum before rounding. ASCII text, the common case, is
    measured by its length alone."""
    quarters = 0
    for t in texts:
        if t:
            quarters += len(t) if t.isascii() else len(t) + 3 * _one_token_chars(t)
    return quarters


def _one_token_chars(text: str) -> int:
    """How many characters of ``text`` are one token each (:data:`_ONE_TOKEN`)."""
    return len(text) - len(_ONE_TOKEN.sub("", text))


def _table() -> Any:
    from memoryos_gpu import _C

    return _C.TextTable()


def _key(item_id: object) -> int:
    """An id as the tables key it (ints and NumPy ints; anything else is no id: -1 is none)."""
    try:
        return operator.index(item_id)  # type: ignore[arg-type]
    except TypeError:
        return -1


def _same_json(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two metas that compare equal also serialise alike: ``==`` takes ``True`` for
    ``1`` and ``1.0``, so a page whose meta said ``{"x": True}`` showed its user's previous
    page's ``{"x": 1}``. A flat meta (the common one) is checked value by value; a nested one
    through its JSON text."""
    if all(type(v) in JSON_LEAVES for v in a.values()):
        return all(type(v) is type(b[k]) for k, v in a.items())
    return dumps_text(a) == dumps_text(b)


def _frozen(extra: dict[str, Any]) -> ReadOnlyDict:
    """The view's copy of a page's metadata: a :class:`ReadOnlyDict` is taken as the engine's
    frozen copy already (:meth:`PageViews.shared_extra`); anything else is copied read-only at
    every level (:func:`frozen_meta`), so no caller's object is shared with the view."""
    if isinstance(extra, ReadOnlyDict):
        return extra
    return frozen_meta(extra) if extra else _EMPTY


class PageTable:
    """The views of live pages by page id (a native table; :class:`PageView` out) and the
    meta summaries of their chains by chain id (a second table, which pages link to)."""

    def __init__(self) -> None:
        self.table = _table()
        self.chains = _table()

    def put(
        self,
        page_id: int,
        user_input: str,
        agent_response: str,
        timestamp: float,
        extra: dict[str, Any],
        chain_id: int | None = None,
    ) -> None:
        """A page's view, new or replacing one. ``extra`` may be a :class:`ReadOnlyDict`
        already (the caller's shared copy of metadata several pages carry: see
        :meth:`PageViews.shared_extra`); ``chain_id``: the chain it is on (None: none yet)."""
        self.table.put(
            int(page_id),
            user_input,
            agent_response,
            float(timestamp),
            _frozen(extra),
            -1 if chain_id is None else int(chain_id),
        )

    def get(self, page_id: int) -> PageView | None:
        v = self.table.get(int(page_id))
        if v is None:
            return None
        ui, ar, ts, extra, link, chars = v
        chain = self.chains.get(link) if link >= 0 else None
        meta = None if chain is None else chain[0]
        tokens = (chars + (chain[5] if chain is not None else 0) + 3) // 4
        return PageView(ui, ar, ts, meta, extra, tokens)

    def __getitem__(self, page_id: int) -> PageView:
        v = self.get(page_id)
        if v is None:
            raise KeyError(page_id)
        return v

    def __contains__(self, page_id: object) -> bool:
        return _key(page_id) in self.table

    def __len__(self) -> int:
        return len(self.table)

    def pop(self, page_id: int) -> bool:
        return self.table.pop(int(page_id))


class KnowledgeTexts:
    """The texts of live knowledge entries by entry id: a native table with the parts of a
    dict's interface the engine uses."""

    def __init__(self) -> None:
        self.table = _table()

    def __setitem__(self, entry_id: int, text: str) -> None:
        self.table.put(int(entry_id), text, None, 0.0, None)

    def __getitem__(self, entry_id: int) -> str:
        return self.table.text(int(entry_id))

    def get(self, entry_id: int, default: str | None = None) -> str | None:
        return self.table.text(int(entry_id)) if int(entry_id) in self.table else default

    def __contains__(self, entry_id: object) -> bool:
        return _key(entry_id) in self.table

    def __len__(self) -> int:
        return len(self.table)

    def update(self, items: Mapping[int, str] | Iterable[tuple[int, str]]) -> None:
        for entry_id, text in items.items() if isinstance(items, Mapping) else items:
            self[entry_id] = text

    def pop(self, entry_id: int, default: Any = None) -> Any:
        text = self.get(entry_id)
        return default if text is None or not self.table.pop(int(entry_id)) else text

    def __iter__(self) -> Iterator[int]:
        raise TypeError("KnowledgeTexts is not iterable: look entries up by id")


class PageViews:
    """Views of live pages by page id, and texts of live knowledge entries by entry id."""

    def __init__(self) -> None:
        self.pages = PageTable()
        self.knowledge = KnowledgeTexts()
        self.store_reads = 0  # rows a retrieval had to read from the store (expected: none)

    def put_views(self, items: Iterable[tuple[int, str, Any]]) -> None:
        """Load ``(page_id, user_id, store view)`` rows (a reopen streams them in chunks; the
        store gives equal metadata of one chunk as one dict, and it stays one here) and the
        meta of the chains they are on."""
        frozen: dict[int, ReadOnlyDict] = {}
        ids, inputs, responses, stamps, extras, links = [], [], [], [], [], []
        chains = self.pages.chains
        for pid, _uid, v in items:
            extra = frozen.get(id(v.extra))
            if extra is None:
                extra = frozen[id(v.extra)] = _frozen(v.extra)
            ids.append(pid)
            inputs.append(v.user_input)
            responses.append(v.agent_response)
            stamps.append(float(v.timestamp))
            extras.append(extra)
            if v.chain_id is None:
                links.append(-1)
                continue
            links.append(v.chain_id)
            if v.chain_id not in chains:
                self.set_chain(v.chain_id, v.meta)
        self.pages.table.put_many(ids, inputs, responses, stamps, extras, links)

    def put_pages(self, pages: Sequence[tuple[int, Any]], users: dict[str, Any]) -> None:
        """The views of pages just accepted, ``(page_id, PageInput)``, in one native call;
        each page's metadata shared with its user's previous page's when equal
        (:meth:`shared_extra`, kept on the user state ``users[user_id].extra``)."""
        extras = []
        for _, p in pages:
            user = users[p.user_id]
            user.extra = extra = self.shared_extra(p.meta, user.extra)
            extras.append(extra)
        self.pages.table.put_many(
            [pid for pid, _ in pages],
            [p.user_input for _, p in pages],
            [p.agent_response for _, p in pages],
            [float(p.timestamp) for _, p in pages],
            extras,
            [-1] * len(pages),
        )

    def set_chain(self, chain_id: int, meta: str | None) -> None:
        """A chain's meta summary, new or rewritten: every page linked to it shows it."""
        self.pages.chains.put(int(chain_id), meta, None, 0.0, None)

    def link_pages(
        self, page_ids: Sequence[int], chain_ids: Sequence[int], metas: Sequence[str | None]
    ) -> None:
        """Pages ``page_ids`` joined chains ``chain_ids`` (a derived round's wave: one page a
        user, so one page a chain), whose metas are now ``metas``: the links and the chains'
        records in one native call each."""
        self.pages.table.set_links(page_ids, chain_ids)
        n = len(chain_ids)
        self.pages.chains.put_many(chain_ids, metas, [None] * n, [0.0] * n, [None] * n, [-1] * n)

    def edit_page(self, page_id: int, user_input: str, agent_response: str) -> None:
        table = self.pages.table
        if table.set_text(int(page_id), 0, user_input):
            table.set_text(int(page_id), 1, agent_response)

    def drop_pages(self, page_ids: Iterable[int]) -> set[int]:
        """Drop the pages' views; returns the chains they were on (whose records the caller
        drops with :meth:`drop_chains` once no live page is on them)."""
        table = self.pages.table
        chains: set[int] = set()
        for pid in page_ids:
            link = table.link(int(pid))
            if link is not None:
                if link >= 0:
                    chains.add(link)
                table.pop(int(pid))
        return chains

    def drop_chains(self, chain_ids: Iterable[int]) -> None:
        pop = self.pages.chains.pop
        for chain in chain_ids:
            pop(int(chain))

    @staticmethod
    def shared_extra(extra: dict[str, Any], previous: ReadOnlyDict | None) -> ReadOnlyDict:
        """``previous`` when it holds the same metadata (a user's pages usually carry the same
        speakers), else a new copy, read-only at every level (:func:`frozen_meta`): equal
        metadata is kept once in memory, and neither the caller who added it nor a retrieval
        result can change it (the copy is the engine's, even of a ReadOnlyDict given)."""
        if not extra:
            return _EMPTY
        if previous is not None and previous == extra and _same_json(previous, extra):
            return previous
        return frozen_meta(extra)

    def drop_knowledge(self, entry_ids: Iterable[int]) -> None:
        pop = self.knowledge.table.pop
        for eid in entry_ids:
            pop(int(eid))

    def stats(self) -> dict[str, int]:
        return {
            "pages": len(self.pages),
            "chains": len(self.pages.chains),
            "knowledge": len(self.knowledge),
            "store_reads": self.store_reads,
            "bytes": sum(
                t.nbytes() for t in (self.pages.table, self.pages.chains, self.knowledge.table)
            ),
        }


_EMPTY = ReadOnlyDict()

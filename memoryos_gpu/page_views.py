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
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from memoryos_gpu.types import ReadOnlyDict


class PageView(NamedTuple):
    """The fields of a page a retrieval returns."""

    user_input: str
    agent_response: str
    timestamp: float
    meta: str | None  # the chain's meta summary
    extra: ReadOnlyDict  # the page's own metadata, shared by every retrieval of the page
    tokens: int  # what the page adds to a prompt (approx_tokens of its texts), counted once


def approx_tokens(*texts: str | None) -> int:
    """Tokens a prompt would carry for ``texts``: ~4 characters per token, no tokenizer."""
    return (sum(len(t) for t in texts if t) + 3) // 4


def _table() -> Any:
    from memoryos_gpu import _C

    return _C.TextTable()


def _key(item_id: object) -> int:
    """An id as the tables key it (ints and NumPy ints; anything else is no id: -1 is none)."""
    try:
        return operator.index(item_id)  # type: ignore[arg-type]
    except TypeError:
        return -1


def _frozen(extra: dict[str, Any]) -> ReadOnlyDict:
    if isinstance(extra, ReadOnlyDict):
        return extra
    return ReadOnlyDict(extra) if extra else _EMPTY


class PageTable:
    """The views of live pages by page id (a native table; :class:`PageView` out)."""

    def __init__(self) -> None:
        self.table = _table()

    def put(
        self,
        page_id: int,
        user_input: str,
        agent_response: str,
        timestamp: float,
        meta: str | None,
        extra: dict[str, Any],
    ) -> None:
        """A page's view, new or replacing one. ``extra`` may be a :class:`ReadOnlyDict`
        already (the caller's shared copy of metadata several pages carry: see
        :meth:`PageViews.shared_extra`)."""
        self.table.put(
            int(page_id), user_input, agent_response, float(timestamp), meta, _frozen(extra)
        )

    def get(self, page_id: int) -> PageView | None:
        v = self.table.get(int(page_id))
        return None if v is None else PageView(*v)

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
        self.table.put(int(entry_id), text, None, 0.0, None, None)

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
        store gives equal metadata of one chunk as one dict, and it stays one here)."""
        frozen: dict[int, ReadOnlyDict] = {}
        ids, inputs, responses, stamps, metas, extras = [], [], [], [], [], []
        for pid, _uid, v in items:
            extra = frozen.get(id(v.extra))
            if extra is None:
                extra = frozen[id(v.extra)] = _frozen(v.extra)
            ids.append(pid)
            inputs.append(v.user_input)
            responses.append(v.agent_response)
            stamps.append(float(v.timestamp))
            metas.append(v.meta)
            extras.append(extra)
        self.pages.table.put_many(ids, inputs, responses, stamps, metas, extras)

    def set_meta(self, page_ids: Iterable[int], meta: str | None) -> None:
        """A chain's meta summary was rewritten for these pages."""
        table = self.pages.table
        for pid in page_ids:
            table.set_text(int(pid), 2, meta)

    def edit_page(self, page_id: int, user_input: str, agent_response: str) -> None:
        table = self.pages.table
        if table.set_text(int(page_id), 0, user_input):
            table.set_text(int(page_id), 1, agent_response)

    def drop_pages(self, page_ids: Iterable[int]) -> None:
        pop = self.pages.table.pop
        for pid in page_ids:
            pop(int(pid))

    @staticmethod
    def shared_extra(extra: dict[str, Any], previous: ReadOnlyDict | None) -> ReadOnlyDict:
        """``previous`` when it holds the same metadata (a user's pages usually carry the same
        speakers), else a new read-only copy: equal metadata is kept once in memory."""
        if not extra:
            return _EMPTY
        if previous is not None and previous == extra:
            return previous
        return ReadOnlyDict(extra)

    def drop_knowledge(self, entry_ids: Iterable[int]) -> None:
        pop = self.knowledge.table.pop
        for eid in entry_ids:
            pop(int(eid))

    def stats(self) -> dict[str, int]:
        return {
            "pages": len(self.pages),
            "knowledge": len(self.knowledge),
            "store_reads": self.store_reads,
            "bytes": self.pages.table.nbytes() + self.knowledge.table.nbytes(),
        }


_EMPTY = ReadOnlyDict()

"""What retrievals show of every live page and knowledge entry, held in memory.

Why: a retrieval returns ~17 pages (its MTM top k and the whole STM) and up to 20 knowledge
entries. Reading their texts from the store cost SQL on every batch (~15 % of the serving CPU
with a warm cache, and the whole first query of a user after a reopen with a cold one), so the
engine keeps the texts of every page in STM or MTM, and of every live knowledge entry, here:
filled from the store on open, kept current wherever the engine writes a page or an entry, and
never read back from the store on the retrieval path. The store stays the source of truth; this
is its read copy, and assembling a batch's results costs one dictionary lookup per item.

Memory: roughly the texts themselves plus ~150 bytes per page (``stats()["views"]``).
"""

from __future__ import annotations

from collections.abc import Iterable
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


def page_view(
    user_input: str, agent_response: str, timestamp: float, meta: str | None, extra: dict[str, Any]
) -> PageView:
    if not isinstance(extra, ReadOnlyDict):
        extra = ReadOnlyDict(extra) if extra else _EMPTY
    tokens = approx_tokens(user_input, agent_response, meta)
    return PageView(user_input, agent_response, timestamp, meta, extra, tokens)


class PageViews:
    """Views of live pages by page id, and texts of live knowledge entries by entry id."""

    def __init__(self) -> None:
        self.pages: dict[int, PageView] = {}
        self.knowledge: dict[int, str] = {}
        self.store_reads = 0  # rows a retrieval had to read from the store (expected: none)

    def put_page(
        self,
        page_id: int,
        user_input: str,
        agent_response: str,
        timestamp: float,
        meta: str | None,
        extra: dict[str, Any],
    ) -> None:
        """A new page's view. ``extra`` may be a :class:`ReadOnlyDict` already (the caller's
        shared copy of metadata several pages carry: see :meth:`shared_extra`)."""
        self.pages[int(page_id)] = page_view(
            user_input, agent_response, float(timestamp), meta, extra
        )

    def put_views(self, items: Iterable[tuple[int, str, Any]]) -> None:
        """Load ``(page_id, user_id, store view)`` rows (a reopen streams them in chunks; the
        store gives equal metadata of one chunk as one dict, and it stays one here)."""
        pages = self.pages
        frozen: dict[int, ReadOnlyDict] = {}
        for pid, _uid, v in items:
            extra = frozen.get(id(v.extra))
            if extra is None:
                extra = frozen[id(v.extra)] = ReadOnlyDict(v.extra) if v.extra else _EMPTY
            pages[pid] = page_view(v.user_input, v.agent_response, v.timestamp, v.meta, extra)

    def set_meta(self, page_ids: Iterable[int], meta: str | None) -> None:
        """A chain's meta summary was rewritten for these pages."""
        for pid in page_ids:
            v = self.pages.get(int(pid))
            if v is not None:
                self.pages[int(pid)] = page_view(
                    v.user_input, v.agent_response, v.timestamp, meta, v.extra
                )

    def edit_page(self, page_id: int, user_input: str, agent_response: str) -> None:
        v = self.pages.get(int(page_id))
        if v is not None:
            self.pages[int(page_id)] = page_view(
                user_input, agent_response, v.timestamp, v.meta, v.extra
            )

    def drop_pages(self, page_ids: Iterable[int]) -> None:
        pages = self.pages
        for pid in page_ids:
            pages.pop(int(pid), None)

    @staticmethod
    def shared_extra(extra: dict[str, Any], previous: ReadOnlyDict | None) -> ReadOnlyDict:
        """``previous`` when it holds the same metadata (a user's pages usually carry the same
        speakers), else a new read-only copy: equal metadata is kept once in memory."""
        if not extra:
            return _EMPTY
        if previous is not None and previous == extra:
            return previous
        return ReadOnlyDict(extra)

    def put_knowledge(self, entry_id: int, text: str) -> None:
        self.knowledge[int(entry_id)] = text

    def drop_knowledge(self, entry_ids: Iterable[int]) -> None:
        for eid in entry_ids:
            self.knowledge.pop(int(eid), None)

    def stats(self) -> dict[str, int]:
        return {
            "pages": len(self.pages),
            "knowledge": len(self.knowledge),
            "store_reads": self.store_reads,
        }


_EMPTY = ReadOnlyDict()

"""Plain data types of the public API."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PageInput:
    """One exchange to remember. ``source`` is an optional idempotency key: a page whose
    source was already accepted is skipped (re-running an ingestion adds nothing twice)."""

    user_id: str
    user_input: str
    agent_response: str = ""
    timestamp: float | str | None = None
    assistant_id: str | None = None
    source: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AddResult:
    page_id: int
    user_id: str
    duplicate: bool = False  # the source was already accepted; nothing was added


class ReadOnlyDict(dict):
    """A dict that refuses changes: a retrieved page's ``extra`` is the engine's own copy of the
    page's metadata, shared by every retrieval of the page (copy it with ``dict(page.extra)``
    to change it). Serialises and compares as a plain dict."""

    def _refuse(self, *args: Any, **kw: Any) -> None:
        raise TypeError("a retrieved page's extra is read-only; copy it with dict(page.extra)")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse
    __ior__ = _refuse

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        # rebuilt from a plain copy: pickle's default for a dict subclass sets the items one by
        # one, which this class refuses (a retrieval sent to an HTTP worker could not arrive)
        return (ReadOnlyDict, (dict(self),))


@dataclass(slots=True)  # slots: a retrieval makes ~17 of these per query
class RetrievedPage:
    page_id: int
    user_input: str
    agent_response: str
    timestamp: float
    tier: str  # "stm" or "mtm"
    score: float | None = None
    meta: str | None = None  # chain meta summary
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class KnowledgeEntry:
    entry_id: int
    text: str
    score: float | None = None
    sources: list[int] | None = None  # pages it was derived from (retrieve(..., sources=True))


@dataclass(slots=True)
class Retrieval:
    """What a query retrieved: STM whole, MTM pages, LPM profile and knowledge."""

    user_id: str
    query: str
    stm: list[RetrievedPage]
    pages: list[RetrievedPage]
    profile: dict[str, str]
    user_knowledge: list[KnowledgeEntry]
    assistant_knowledge: list[KnowledgeEntry]
    retrieval_tokens: int = 0

    def all_pages(self) -> list[RetrievedPage]:
        """MTM pages then STM pages (what a prompt carries)."""
        return [*self.pages, *self.stm]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Response:
    user_id: str
    query: str
    text: str
    retrieval: Retrieval
    page_id: int | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

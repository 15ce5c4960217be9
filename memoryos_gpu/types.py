"""Plain data types of the public API."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class PageInput:
    """One exchange to remember. ``source`` is an optional idempotency key: a page whose
    source was already accepted is skipped (re-running an ingestion adds nothing twice).

    ``timestamp``: epoch seconds (any real number, NumPy scalars included), an ISO-8601
    string, or a ``datetime`` (a naive one is read as UTC, like a naive ISO string); None is
    now. ``meta``: JSON-serialisable metadata; the engine keeps a frozen copy of it, so
    changing the dict after ``add`` changes nothing stored or retrieved.

    ``assistant_id``: the user's assistant; None is the user's own (a new user's is
    ``default_assistant``, else ``"default"``), another one than a known user's is refused.
    ``default_assistant`` is what a server with tenants passes (the tenant's ``default``), so
    that a page naming no assistant joins a new user to its tenant's default assistant and a
    known user's pages to that user's own, whichever it is."""

    user_id: str
    user_input: str
    agent_response: str = ""
    timestamp: float | str | datetime | None = None
    assistant_id: str | None = None
    source: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    default_assistant: str | None = None


@dataclass(frozen=True, slots=True)  # slots: one is made a page added, 0.4 us less each
class AddResult:
    page_id: int
    user_id: str
    duplicate: bool = False  # the source was already accepted; nothing was added


class ReadOnlyDict(dict):
    """A dict that refuses changes: a retrieved page's ``extra`` is the engine's own copy of the
    page's metadata, shared by every retrieval of the page (copy it with ``dict(page.extra)``
    to change it). Serialises and compares as a plain dict. The dicts and lists inside it are
    read-only too (:func:`frozen_meta`), so no retrieval result can change what later ones
    show."""

    def _refuse(self, *args: Any, **kw: Any) -> None:
        raise TypeError("a retrieved page's extra is read-only; copy it with dict(page.extra)")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse
    __ior__ = _refuse

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        # rebuilt from a plain copy: pickle's default for a dict subclass sets the items one by
        # one, which this class refuses (a retrieval sent to an HTTP worker could not arrive)
        return (ReadOnlyDict, (dict(self),))


class ReadOnlyList(list):
    """A list that refuses changes: a list inside a retrieved page's ``extra`` (see
    :class:`ReadOnlyDict`; copy it with ``list(...)`` to change it). A list subclass, not a
    tuple, so it still compares equal to the list the page was added with and serialises as a
    JSON array."""

    def _refuse(self, *args: Any, **kw: Any) -> None:
        raise TypeError("a list in a retrieved page's extra is read-only; copy it with list(...)")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse

    def __reduce__(self) -> tuple[type, tuple[list[Any]]]:
        # as ReadOnlyDict: pickle's default for a list subclass appends the items one by one
        return (ReadOnlyList, (list(self),))


#: Values :func:`frozen_meta` keeps as they are: immutable, and the only leaves JSON has.
JSON_LEAVES = frozenset({str, int, float, bool, type(None)})


def frozen_meta(meta: Mapping[str, Any]) -> ReadOnlyDict:
    """A read-only deep copy of a page's metadata: every dict in it a :class:`ReadOnlyDict`,
    every list (or tuple) a :class:`ReadOnlyList`.

    Why: the engine keeps this copy for the page's retrievals, which hand it out to every
    caller; a shallow copy left nested lists and dicts shared with the caller who added the
    page and with every retrieval result, so a change through either showed in all later
    retrievals (and not in the store). A flat meta of plain values, the common one, costs one
    dict copy and a type test per value."""
    for v in meta.values():
        if type(v) not in JSON_LEAVES:
            return _deep_frozen(meta)
    return ReadOnlyDict(meta)


def _deep_frozen(root: Mapping[str, Any]) -> ReadOnlyDict:
    """:func:`frozen_meta` of a nested meta, with a stack of its own, not recursion: a meta
    nested as deep as ``json.dumps`` accepts (what validation checks) must not overflow the
    interpreter's stack here, after the page was written."""
    # a frame: (container, its (key, value) pairs still to visit, the frozen pairs so far,
    # its key in the container above it)
    stack: list[tuple[Any, Iterator[tuple[Any, Any]], list[tuple[Any, Any]], Any]] = [
        (root, iter(root.items()), [], None)
    ]
    while True:
        src, pending, done, key_above = stack[-1]
        for key, value in pending:
            if type(value) in JSON_LEAVES:
                done.append((key, value))
                continue
            if isinstance(value, Mapping):
                stack.append((value, iter(value.items()), [], key))
                break
            if isinstance(value, list | tuple):
                stack.append((value, enumerate(value), [], key))
                break
            done.append((key, value))  # another JSON leaf (a str or float subclass): immutable
        else:
            stack.pop()
            if isinstance(src, Mapping):
                frozen: Any = ReadOnlyDict(done)
            else:
                frozen = ReadOnlyList([v for _, v in done])
            if not stack:
                return frozen
            stack[-1][2].append((key_above, frozen))


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
    """What a query retrieved: STM whole, MTM pages, LPM profile and knowledge.

    ``stm`` also holds the user's pending pages (pushed out of STM, not yet placed in MTM by
    the derived work: with the LLM down, for as long as it is down), oldest first before the
    STM pages, so no retrieval loses a page the user added (``engine.assembly.assemble``)."""

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

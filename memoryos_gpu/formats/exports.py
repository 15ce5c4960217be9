"""Exports as an input format: what ``memoryos-gpu export`` wrote -> the user's pages again.

``memoryos-gpu export --user U`` writes one JSON object with everything a store holds about a
user (``Store.export_user``: ``user``, ``pages``, ``chains``, ``segments``, ``user_knowledge``,
``profile_sources``, ``pending``, ``history``, plus ``assistant_knowledge``), and since the
``export`` format exists, a marker: ``"format": "memoryos-gpu-export", "version": 1``. The
server's ``GET /v1/users/{id}/export`` writes the same object without the marker, as did earlier
versions of ``export``: such an object is recognised by its shape (:func:`is_export`).

Only the **pages** are read, each as a page of the export's user (``user.user_id``), under its
assistant (``user.assistant_id``), in the order of the export (the user's page order), with its
timestamp (epoch seconds, as stored), its metadata (the page's ``extra``: the ``meta`` it was
ingested with) and its idempotency key (``source``). Keeping the key is what makes a migration
safe: ingesting the original chat logs into the new store afterwards finds every page it gave
there already (the keys match) and adds nothing. A page stored without a key (added through the
API without ``source``) gets the key a ``jsonl`` record of the same content would get
(:func:`~memoryos_gpu.formats.records.page_source` of its user, assistant, texts and epoch
timestamp), so the same export read twice adds nothing either.

What the old store **derived** from the pages (segments, chains and their meta summaries,
profile, knowledge, keywords, tiers, pending work) is not copied: the new store derives it again
from the pages, under its own settings. That is the point of a migration: the new store may use
another embedding model (whose vectors the old segments' and knowledge's were not), another
preset, or an LLM where the old one ran extractively. The audit ``history`` stays with the old
store: the new store's history starts with the pages' import.

See ``docs/formats.md`` (``export``).
"""

from __future__ import annotations

from dataclasses import replace

from .converters import (
    _Bad,
    _Ctx,
    _Invalid,
    _opt_str,
    _record,
    _source_key,
    _text,
    _timestamp,
)
from .records import Record

__all__ = ["EXPORT_FORMAT", "EXPORT_VERSION", "is_export"]

#: The marker ``memoryos-gpu export`` writes as its object's ``format``.
EXPORT_FORMAT = "memoryos-gpu-export"
#: The newest export layout this reader knows (the ``version`` written beside the marker).
EXPORT_VERSION = 1
#: Keys of an export besides ``user``: an object with a ``user`` object (holding ``user_id``)
#: and one of these is taken for an export without the marker (the server's, earlier ones).
_EXPORT_KEYS = ("pages", "segments", "chains", "user_knowledge", "profile_sources", "history")


def is_export(obj: dict) -> bool:
    """Whether ``obj`` is an export: it carries the marker, or it has an export's shape (a
    ``user`` object with a ``user_id``, and ``pages`` or another of an export's keys).

    A broken export (no ``pages``, say) is still recognised, so that reading it says what is
    wrong with it rather than that it is no format at all."""
    if obj.get("format") == EXPORT_FORMAT:
        return True
    user = obj.get("user")
    return isinstance(user, dict) and "user_id" in user and any(k in obj for k in _EXPORT_KEYS)


def _convert_export(obj: dict, ctx: _Ctx) -> list[Record | _Bad]:
    """An export's pages, each a :class:`Record` of its user; a :class:`_Bad` per unusable page
    (its reason names it: ``pages[i]``); :class:`_Invalid` for an export without a user or a
    page list."""
    _check_version(obj)
    user = obj.get("user")
    if not isinstance(user, dict):
        raise _Invalid("export: missing or non-object field 'user'")
    if "user_id" not in user:
        raise _Invalid("export: missing field 'user.user_id'")
    user_id = _text(user["user_id"], "export: user.user_id")
    if not user_id:
        raise _Invalid("export: user.user_id is empty")
    assistant_id = _opt_str(user, "assistant_id")
    pages = obj.get("pages")
    if not isinstance(pages, list):
        what = "missing" if pages is None else f"not a list ({type(pages).__name__})"
        raise _Invalid(f"export of user {user_id!r}: field 'pages' is {what}")
    if not pages:
        raise _Invalid(f"export of user {user_id!r} holds no page (pages is empty)")
    out: list[Record | _Bad] = []
    for i, page in enumerate(pages):
        try:
            out.append(_page(page, user_id, assistant_id, ctx))
        except _Invalid as exc:
            out.append(_Bad(f"{_where(i, page)}: {exc.args[0]}", page))
    return out


def _check_version(obj: dict) -> None:
    """Refuse an export of a newer layout than :data:`EXPORT_VERSION` (its pages may not mean
    what this reader takes them for)."""
    version = obj.get("version")
    if obj.get("format") != EXPORT_FORMAT or version is None:
        return
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _Invalid(f"export: version must be a positive integer, got {version!r}")
    if version > EXPORT_VERSION:
        raise _Invalid(
            f"export version {version} is newer than this memoryos-gpu reads "
            f"(up to {EXPORT_VERSION}): upgrade memoryos-gpu to import it"
        )


def _where(i: int, page: object) -> str:
    """``pages[i]``, with the page's id in the old store when it has one."""
    pid = page.get("page_id") if isinstance(page, dict) else None
    known = isinstance(pid, int) and not isinstance(pid, bool)
    return f"pages[{i}] (page_id {pid})" if known else f"pages[{i}]"


def _page(page: object, user_id: str, assistant_id: str | None, ctx: _Ctx) -> Record:
    if not isinstance(page, dict):
        raise _Invalid("not an object")
    for key in ("user_input", "agent_response"):
        if key not in page:
            raise _Invalid(f"missing field {key!r}")
    owner = page.get("user_id")
    if owner is not None and _text(owner, "user_id") != user_id:
        raise _Invalid(f"user_id {owner!r} is not the export's user {user_id!r}")
    user_input = _text(page["user_input"], "user_input")
    agent_response = _text(page["agent_response"], "agent_response")
    timestamp = _timestamp(page.get("timestamp"))
    extra = page.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise _Invalid(f"extra must be an object, got {type(extra).__name__}")
    # keyed as a jsonl record of the same content (every page counted, keyed or not: a
    # keyless page never takes the key an identical keyed one before it holds), or by its own
    record = _record(ctx, 0, user_id, assistant_id, user_input, agent_response, timestamp, {})
    source = page.get("source")
    return replace(
        record,
        source=record.source if source is None else _source_key(source),
        meta=dict(extra or {}),
        legacy_source=None,  # no earlier version read exports: no older key to look for
    )

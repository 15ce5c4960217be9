"""mem0's filter language, evaluated on memory items.

A filter is a dict. ``{"key": value}`` is an exact match, ``{"key": "*"}`` matches any item
that has the key, ``{"key": {op: value}}`` applies an operator (``eq ne in nin gt gte lt lte
contains icontains``), and ``{"AND": [...]}``, ``{"OR": [...]}``, ``{"NOT": [...]}`` combine
filters; several keys in one dict must all match. Keys are looked up on the item
(``user_id``, ``agent_id``, ``run_id``, ``kind``, ``tier``, ``memory``) and then in its
``metadata``; ``created_at`` / ``updated_at`` compare as times (ISO-8601 text, a zone-less
one read as UTC, or epoch seconds). An item without the key matches only ``ne`` and ``nin``.
So a metadata key named like an item field could never be filtered on: ``add`` refuses those
names (:data:`RESERVED_METADATA_KEYS`) rather than store a key its filter cannot reach.

Filters are checked when a search or listing is asked for (:func:`compile_filter`), so a typo
in an operator is an error, never a filter that silently matches nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "RESERVED_METADATA_KEYS",
    "SCOPE_KEYS",
    "compile_filter",
    "entity_id",
    "split_scope",
    "to_epoch",
]

SCOPE_KEYS = ("user_id", "agent_id", "run_id")
_TIME_KEYS = ("created_at", "updated_at")
_ITEM_KEYS = ("user_id", "agent_id", "run_id", "kind", "tier", "memory", "id", "hash")
#: Metadata keys a filter would test on the item instead (``run_id`` is not one: the item's
#: ``run_id`` is the one kept in its metadata).
RESERVED_METADATA_KEYS = tuple(sorted({*_ITEM_KEYS, *_TIME_KEYS} - {"run_id"}))
_LOGIC = ("AND", "OR", "NOT")
_MISSING = object()

Predicate = Callable[[Mapping[str, Any]], bool]


def entity_id(value: Any, name: str) -> str | None:
    """A ``user_id`` / ``agent_id`` / ``run_id`` as mem0 reads one: None stays None, any other
    value becomes its ``str()`` (an integer id is common: a database key), trimmed of
    surrounding whitespace; empty, or with whitespace inside, is a ``ValueError`` naming
    ``name``. So ``42`` and ``"42"``, ``" pad "`` and ``"pad"`` are one id each, as in mem0.

    A boolean, bytes or a container is refused rather than turned into text: its ``str()``
    (``"True"``, ``"b'x'"``, ``"[1]"``) is never the id a caller meant."""
    if value is None:
        return None
    if isinstance(value, bool | bytes | bytearray | Mapping | list | tuple | set | frozenset):
        raise ValueError(f"{name} must be a string or an integer id, got {type(value).__name__}")
    text = value if isinstance(value, str) else str(value)
    trimmed = text.strip()
    if not trimmed:
        raise ValueError(f"{name} must be a non-empty id, got {value!r}")
    if any(c.isspace() for c in trimmed):
        raise ValueError(f"{name} must not contain whitespace (mem0 refuses it too), got {value!r}")
    return trimmed


def _is_scope_value(value: Any) -> bool:
    """Whether a scope key's filter value names an id (``"bob"``, ``42``), not an operator
    dict or a list (those stay filters)."""
    return value is not None and not isinstance(value, Mapping | list | tuple | set)


def split_scope(filters: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``filters`` -> (the plain scope ids it names, read by :func:`entity_id`, everything
    else).

    mem0 2 code often names the user inside a top-level ``AND`` (``{"AND": [{"user_id":
    "bob"}, ...]}``): that plain id is the user too, since every clause of the ``AND``
    must hold. One inside ``OR`` / ``NOT`` does not pin a user: with no user named where it
    may be, that is refused saying where ``user_id`` goes."""
    filters = dict(filters or {})
    if not all(isinstance(k, str) for k in filters):
        raise ValueError("filter keys must be strings")
    scope = {k: entity_id(filters.pop(k), k) for k in SCOPE_KEYS if _is_scope_value(filters.get(k))}
    if "AND" in filters:
        filters["AND"], users = _lift_users(filters["AND"])
        for uid in users:
            named = scope.setdefault("user_id", uid)
            if named != uid:
                raise ValueError(f"filters name two users, {named!r} and {uid!r}: give one")
    if "user_id" not in scope and _names_user(filters):
        raise ValueError(
            "user_id must be a plain string at the top level of filters or in a top-level "
            "AND, not inside OR / NOT: memoryos-gpu keeps memory per user, so a call names one"
        )
    return scope, filters


def _lift_users(clauses: Any) -> tuple[Any, list[str]]:
    """An ``AND``'s clauses without their plain ``user_id`` ids, and those ids (a clause
    list of the wrong shape is left for :func:`compile_filter` to refuse)."""
    if not isinstance(clauses, list):
        return clauses, []
    kept, users = [], []
    for clause in clauses:
        if isinstance(clause, Mapping) and _is_scope_value(clause.get("user_id")):
            clause = dict(clause)
            users.append(entity_id(clause.pop("user_id"), "user_id"))
        kept.append(clause)
    return kept, users


def _names_user(filters: Any) -> bool:
    """Whether ``user_id`` is a key anywhere in ``filters``, at any depth."""
    if isinstance(filters, Mapping):
        return "user_id" in filters or any(_names_user(v) for v in filters.values())
    if isinstance(filters, list):
        return any(_names_user(v) for v in filters)
    return False


def _as_shown(ts: float) -> float:
    """An item's time as its ISO text shows it (to the microsecond, rounded as
    ``datetime.fromtimestamp`` rounds), so that a filter on a time an item showed matches that
    item: ``updated_at >= <its own updated_at>`` missed it when the ISO text rounded up."""
    return datetime.fromtimestamp(ts, UTC).timestamp()


def to_epoch(value: Any) -> float:
    """A time from a filter: epoch seconds, or ISO-8601 text (no zone: UTC)."""
    if isinstance(value, bool):
        raise ValueError(f"not a time: {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            dt = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"not an ISO-8601 time: {value!r}") from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return dt.timestamp()
    raise ValueError(f"not a time: {value!r}")


def compile_filter(filters: Mapping[str, Any] | None) -> Predicate:
    """A predicate over items for ``filters`` (None or empty: every item matches)."""
    if not filters:
        return lambda item: True
    if not isinstance(filters, Mapping):
        raise ValueError(f"a filter must be a dict, got {type(filters).__name__}")
    parts = [_compile_key(k, v) for k, v in filters.items()]
    return lambda item: all(p(item) for p in parts)


def _compile_key(key: str, value: Any) -> Predicate:
    if key in _LOGIC:
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            raise ValueError(f"{key} takes a list of filters")
        subs = [compile_filter(v) for v in value]
        if key == "AND":
            return lambda item: all(s(item) for s in subs)
        if key == "OR":
            return lambda item: any(s(item) for s in subs)
        return lambda item: not any(s(item) for s in subs)
    if not isinstance(key, str) or not key:
        raise ValueError(f"bad filter key {key!r}")
    get = _getter(key)
    if value == "*":
        return lambda item: get(item) is not _MISSING
    ops = value if isinstance(value, Mapping) else {"eq": value}
    tests = [_operator(key, op, arg) for op, arg in ops.items()]

    def check(item: Mapping[str, Any]) -> bool:
        found = get(item)
        return all(t(found) for t in tests)

    return check


def _getter(key: str) -> Callable[[Mapping[str, Any]], Any]:
    if key in _TIME_KEYS:  # items carry their times as epoch seconds beside the ISO text
        field = f"_{key}_ts"
        return lambda item: _MISSING if item.get(field) is None else _as_shown(item[field])
    if key in _ITEM_KEYS:
        return lambda item: _MISSING if item.get(key) is None else item[key]

    def from_meta(item: Mapping[str, Any]) -> Any:
        meta = item.get("metadata") or {}
        return meta.get(key, _MISSING)

    return from_meta


def _operator(key: str, op: str, arg: Any) -> Callable[[Any], bool]:
    """The test of one ``{op: arg}`` on a found value (``_MISSING`` when the item lacks it)."""
    if key in _TIME_KEYS and op in ("eq", "ne", "gt", "gte", "lt", "lte"):
        arg = to_epoch(arg)
    elif key in _TIME_KEYS and op in ("in", "nin"):
        arg = [to_epoch(a) for a in _listed(op, arg)]
    present: dict[str, Callable[[Any], bool]] = {
        "eq": lambda v: v == arg,
        "gt": lambda v: _compare(v, arg, lambda a, b: a > b),
        "gte": lambda v: _compare(v, arg, lambda a, b: a >= b),
        "lt": lambda v: _compare(v, arg, lambda a, b: a < b),
        "lte": lambda v: _compare(v, arg, lambda a, b: a <= b),
        "in": lambda v: v in _listed(op, arg),
        "contains": lambda v: isinstance(v, str) and str(arg) in v,
        "icontains": lambda v: isinstance(v, str) and str(arg).lower() in v.lower(),
    }
    if op == "ne":
        return lambda v: v is _MISSING or v != arg
    if op == "nin":
        listed = _listed(op, arg)
        return lambda v: v is _MISSING or v not in listed
    if op not in present:
        known = "eq, ne, in, nin, gt, gte, lt, lte, contains, icontains"
        raise ValueError(f"unknown filter operator {op!r} on {key!r}; known: {known}")
    if op == "in":
        _listed(op, arg)  # checked now, not at the first item
    test = present[op]
    return lambda v: v is not _MISSING and test(v)


def _listed(op: str, arg: Any) -> list[Any]:
    if not isinstance(arg, list | tuple):
        raise ValueError(f"{op} takes a list, got {arg!r}")
    return list(arg)


def _compare(a: Any, b: Any, cmp: Callable[[Any, Any], bool]) -> bool:
    """An order comparison that is False, not an error, between values of unlike types."""
    try:
        return bool(cmp(a, b))
    except TypeError:
        return False

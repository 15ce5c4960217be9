"""Timestamp parsing: ISO-8601, epoch seconds, and LoCoMo's ``"1:56 pm on 8 May, 2023"``.

A wall time without a zone (``2025-01-01 04:00:00``, LoCoMo's) names no instant until a zone
is chosen: UTC by default, or the zone the writer's clock ran in (:func:`naive_zone`): BAI-LAB
MemoryOS wrote its local time, so its logs are read in the zone it ran in.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, tzinfo
from decimal import Decimal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

__all__ = ["naive_zone", "parse_timestamp", "refusal_kind"]

_MONTHS = {
    name: i + 1
    for i, names in enumerate(
        [
            ("january", "jan"),
            ("february", "feb"),
            ("march", "mar"),
            ("april", "apr"),
            ("may",),
            ("june", "jun"),
            ("july", "jul"),
            ("august", "aug"),
            ("september", "sep", "sept"),
            ("october", "oct"),
            ("november", "nov"),
            ("december", "dec"),
        ]
    )
    for name in names
}

# "1:56 pm on 8 May, 2023" (LoCoMo session_N_date_time); comma optional, case-insensitive.
_LOCOMO_RE = re.compile(
    r"(?P<h>\d{1,2}):(?P<m>\d{2})\s*(?P<ampm>[ap])\.?\s*m\.?\s+on\s+"
    r"(?P<d>\d{1,2})\s+(?P<mon>[A-Za-z]+)\.?,?\s+(?P<y>\d{4})",
    re.IGNORECASE,
)
_NUMBER_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")

_EXPECTED = "expected ISO-8601, epoch seconds, or LoCoMo style '1:56 pm on 8 May, 2023'"


def naive_zone(name: str) -> tzinfo | None:
    """The zone ``name`` names for timestamps without one: ``UTC`` (any case), ``local`` (any
    case; ``None``: the system's local time, daylight saving included, as ``datetime`` reads a
    naive value), or an IANA name (``Asia/Tokyo``). Raises ``ValueError`` naming the choices
    otherwise: a misspelt zone must stop a run before it stores every page hours off."""
    key = name.strip()
    if key.lower() == "local":
        return None
    if key.upper() == "UTC":
        return UTC
    try:
        return ZoneInfo(key)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"unknown time zone {name!r}: give 'local', 'UTC' or an IANA name such as "
            "'Asia/Tokyo' or 'Europe/Berlin'"
        ) from None


# Epoch seconds of 0001-01-01 and of the last instant of 9999-12-31 UTC, the dates ISO-8601
# can name. A timestamp in milliseconds (today ~1.7e12) is past the upper bound: refused,
# rather than read as a date ~54,000 years ahead that would move the user's logical clock
# there for good. The upper bound is the largest float before 10000-01-01 (not the whole
# second 23:59:59): every instant of the year's last second is in the year 9999.
MIN_EPOCH_S = -62_135_596_800.0
_YEAR_10000_S = 253_402_300_800.0
MAX_EPOCH_S = math.nextafter(_YEAR_10000_S, 0.0)


def _epoch_seconds(out: float, value: object) -> float:
    if not math.isfinite(out):
        raise ValueError(f"unparseable timestamp {value!r}: not a finite number")
    if out > MAX_EPOCH_S:
        raise ValueError(
            f"timestamp {value!r} is after the year 9999 in epoch seconds: milliseconds? "
            "send seconds"
        )
    if out < MIN_EPOCH_S:
        raise ValueError(f"timestamp {value!r} is before the year 1 in epoch seconds")
    return out


def _epoch_of(dt: datetime, zone: tzinfo | None, value: object) -> float:
    """``dt`` as epoch seconds, a naive ``dt`` read in ``zone`` (``None``: local time). An
    offset or zone can carry a date of year 1 or 9999 past what a timestamp may hold."""
    try:
        if dt.tzinfo is None:
            out = dt.timestamp() if zone is None else dt.replace(tzinfo=zone).timestamp()
        else:
            out = dt.timestamp()
    except (OverflowError, OSError, ValueError):  # the local clock cannot place year 1
        out = math.inf
    if out == _YEAR_10000_S and _in_year_9999(dt, zone):
        out = MAX_EPOCH_S  # 23:59:59.999999 rounds to the float of 10000-01-01: still 9999
    if not MIN_EPOCH_S <= out <= MAX_EPOCH_S:
        raise ValueError(f"timestamp {value!r} is outside the years 1-9999 in UTC")
    return out


def _in_year_9999(dt: datetime, zone: tzinfo | None) -> bool:
    """Whether ``dt`` (a naive one read in ``zone``) is an instant of the year 9999 in UTC:
    its last microseconds round to the epoch float of 10000-01-01, which an offset past
    midnight reaches too."""
    try:
        if dt.tzinfo is None:
            dt = dt.astimezone(UTC) if zone is None else dt.replace(tzinfo=zone)
        return dt.astimezone(UTC).year == 9999
    except (OverflowError, OSError, ValueError):  # past datetime's range: the year 10000
        return False


def parse_timestamp(value: object, zone: tzinfo | None = UTC) -> float:
    """Return ``value`` as epoch seconds (UTC); a wall time without a zone is read in ``zone``
    (default UTC; ``None``: local time; see :func:`naive_zone`).

    Accepted:

    * ``int`` / ``float`` epoch seconds (finite, years 1-9999: milliseconds are refused;
      ``bool`` is refused);
    * a string holding a number (epoch seconds);
    * ISO-8601 dates and date-times (``2023-05-08``, ``2023-05-08T13:56:00Z``, with offsets);
      naive values are read in ``zone``;
    * LoCoMo's ``"1:56 pm on 8 May, 2023"`` (read in ``zone``).

    Raises ``ValueError`` with the offending value for anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"unparseable timestamp {value!r}: booleans are not timestamps")
    if isinstance(value, (int, float)):
        try:
            out = float(value)
        except OverflowError:  # an int beyond float range: not a date, and not a crash
            digits = len(str(abs(int(value))))
            raise ValueError(f"unparseable timestamp: an integer of {digits} digits") from None
        return _epoch_seconds(out, value)
    if not isinstance(value, str):
        raise ValueError(
            f"unparseable timestamp {value!r}: type {type(value).__name__}; {_EXPECTED}"
        )
    text = value.strip()
    if not text:
        raise ValueError(f"unparseable timestamp {value!r}: empty string")
    if _NUMBER_RE.fullmatch(text):
        out = float(text)
        if out == _YEAR_10000_S and Decimal(text) < _YEAR_10000_S:
            out = MAX_EPOCH_S  # "253402300799.99999" rounds to 10000-01-01: still 9999
        return _epoch_seconds(out, value)
    m = _LOCOMO_RE.fullmatch(text)
    if m:
        month = _MONTHS.get(m["mon"].lower())
        hour, minute = int(m["h"]), int(m["m"])
        if month is None or not (1 <= hour <= 12) or minute > 59:
            raise ValueError(f"unparseable timestamp {value!r}: bad month, hour or minute")
        hour = hour % 12 + (12 if m["ampm"].lower() == "p" else 0)
        try:
            wall = datetime(int(m["y"]), month, int(m["d"]), hour, minute)
        except ValueError as exc:
            raise ValueError(f"unparseable timestamp {value!r}: {exc}") from None
        return _epoch_of(wall, zone, value)
    iso = text
    if iso[-1:] in ("z", "Z"):
        iso = iso[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"unparseable timestamp {value!r}: {_EXPECTED}") from None
    return _epoch_of(parsed, zone, value)


# Each refusal above, by a phrase of its rule, and the short kind a report counts it under: the
# messages name the value (which differs from record to record), the kind only the rule.
_REFUSALS = (
    ("after the year 9999 in epoch", "after the year 9999 in epoch seconds (milliseconds?)"),
    ("before the year 1 in epoch seconds", "before the year 1 in epoch seconds"),
    ("outside the years 1-9999", "outside the years 1-9999"),
    ("not a finite number", "not a finite number"),
    ("booleans are not timestamps", "a boolean"),
    ("an integer of", "an integer too large for a date"),
    ("bad month, hour or minute", "bad month, hour or minute"),
    ("empty string", "an empty string"),
    ("; expected ISO-8601", "not a number or a string"),
    ("unparseable timestamp", "unparseable"),
)


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


def refusal_kind(message: str) -> str | None:
    """``"timestamp: <rule>"`` for a message holding a :func:`parse_timestamp` refusal (also
    wrapped: ``"turn 3 timestamp: ..."``, the engine's ``"timestamp ... does not parse: ..."``),
    else None. Why: ``ingest --json`` counts rejects by kind; a kind cut out of the message
    would split one rule into as many kinds as there are values."""
    rule = _QUOTED.sub("", message)  # a value may hold any phrase; the rule is outside quotes
    if "timestamp" not in rule:
        return None
    for phrase, kind in _REFUSALS:
        if phrase in rule:
            return f"timestamp: {kind}"
    return None

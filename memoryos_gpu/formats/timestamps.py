"""Timestamp parsing: ISO-8601, epoch seconds, and LoCoMo's ``"1:56 pm on 8 May, 2023"``."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime

__all__ = ["parse_timestamp"]

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


def _utc(dt: datetime) -> float:
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


# Epoch seconds of 0001-01-01 and 9999-12-31T23:59:59 UTC, the dates ISO-8601 can name. A
# timestamp in milliseconds (today ~1.7e12) is past the upper bound: refused, rather than read
# as a date ~54,000 years ahead that would move the user's logical clock there for good.
MIN_EPOCH_S = -62_135_596_800.0
MAX_EPOCH_S = 253_402_300_799.0


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


def parse_timestamp(value: object) -> float:
    """Return ``value`` as epoch seconds (UTC).

    Accepted:

    * ``int`` / ``float`` epoch seconds (finite, years 1-9999: milliseconds are refused;
      ``bool`` is refused);
    * a string holding a number (epoch seconds);
    * ISO-8601 dates and date-times (``2023-05-08``, ``2023-05-08T13:56:00Z``, with offsets);
      naive values are taken as UTC;
    * LoCoMo's ``"1:56 pm on 8 May, 2023"`` (taken as UTC).

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
        return _epoch_seconds(float(text), value)
    m = _LOCOMO_RE.fullmatch(text)
    if m:
        month = _MONTHS.get(m["mon"].lower())
        hour, minute = int(m["h"]), int(m["m"])
        if month is None or not (1 <= hour <= 12) or minute > 59:
            raise ValueError(f"unparseable timestamp {value!r}: bad month, hour or minute")
        hour = hour % 12 + (12 if m["ampm"].lower() == "p" else 0)
        try:
            return _utc(datetime(int(m["y"]), month, int(m["d"]), hour, minute))
        except ValueError as exc:
            raise ValueError(f"unparseable timestamp {value!r}: {exc}") from None
    iso = text
    if iso[-1:] in ("z", "Z"):
        iso = iso[:-1] + "+00:00"
    try:
        out = _utc(datetime.fromisoformat(iso))
    except ValueError:
        pass
    else:  # an offset can carry 9999-12-31 past the last second a timestamp may hold
        if not MIN_EPOCH_S <= out <= MAX_EPOCH_S:
            raise ValueError(f"timestamp {value!r} is outside the years 1-9999 in UTC")
        return out
    raise ValueError(f"unparseable timestamp {value!r}: {_EXPECTED}")

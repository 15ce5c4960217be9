"""Byte counts as a person reads them: the unit that keeps the number readable.

Why: a fixed unit hid small files (a 48 KiB file read "0.0 MiB", as if empty) and made big ones
long; every message that states a size says it through :func:`size_text`.
"""

from __future__ import annotations

__all__ = ["size_text"]

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")


def size_text(n_bytes: float) -> str:
    """``n_bytes`` in the largest binary unit that leaves at least 1 of it: ``"512 bytes"``,
    ``"48 KiB"``, ``"3.2 MiB"`` (one decimal below 10 of a unit above bytes, none from 10)."""
    value, unit = float(n_bytes), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value)} bytes"
    return f"{value:.1f} {_UNITS[unit]}" if abs(value) < 10 else f"{value:.0f} {_UNITS[unit]}"

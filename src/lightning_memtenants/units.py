"""Bytes in and out: parsing ``"24GiB"`` exactly, and writing MiB the one way every table and tag does."""

from __future__ import annotations

import math
import re
from fractions import Fraction

MiB = 1024**2

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str, name: str = "budget_bytes") -> int:
    """Bytes from an int or a human string such as ``"24GiB"``, ``"512 MiB"`` or ``"1.5GB"``.

    Strings and floats are read exactly (``"1.5GB"`` is 1,500,000,000), and a big int stays an int.

    Args:
        value: a number of bytes, or a number with a unit (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB; any case).
        name: the argument's name, for the error message.

    Returns:
        The whole number of bytes (a fraction of a byte is dropped), at least 1.

    Raises:
        ValueError: if ``value`` is not a number of at least 1 byte (a bool, an infinite or NaN float, a string
            that is not a plain decimal number with an optional unit), or names an unknown unit.
    """
    expected = f"{name} must be a positive number of bytes (at least 1) or a string like '24GiB', got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(expected)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else ""
        if match is None or (unit and unit not in _UNITS):
            units = ", ".join(sorted({u.upper().replace("I", "i") for u in _UNITS}))
            raise ValueError(f"{name} must be a number with an optional unit ({units}), got {value!r}")
        number = Fraction(match.group(1)) * _UNITS[unit or "b"]
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(expected)
        number = Fraction(value)
    else:
        number = Fraction(value)
    if number < 1:
        raise ValueError(expected)
    return int(number)


def mib(value: int | float | None, digits: int = 2, missing: str = "-") -> str:
    """``value`` bytes in MiB with thousands separators (``"1,024.00"``), or ``missing`` where not measured.

    Every table, tag and message writes MiB through this one function, so they all agree.

    Args:
        value: a number of bytes, or None where it was not measured.
        digits: how many decimals to show.
        missing: what to show for None.

    Returns:
        The text.
    """
    return missing if value is None else f"{value / MiB:,.{digits}f}"

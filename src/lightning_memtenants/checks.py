"""Argument checks shared by every public entry point, each raising one ``ValueError`` that names the argument."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def brief(value: Any) -> str:
    """``repr(value)`` on one line and cut short, for an error message, whatever the object (a numpy array's
    repr spans many lines; a user's object may fail to print itself)."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:77] + "..."


def flag(value: Any, name: str) -> bool:
    """``value`` as a bool, refusing 0, 1 and strings."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {brief(value)}")
    return value


def positive_int(value: Any, name: str, limit: int = 2**53) -> int:
    """``value`` as a count: an int from 1 to ``limit`` (not a bool, a float or a string).

    Raises:
        ValueError: naming ``name`` and what it accepts.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"{name} must be a positive integer up to {limit:,}, got {brief(value)}")
    return value


def world_size(value: Any, name: str = "world_size") -> int:
    """``value`` as a number of ranks: a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {brief(value)}")
    return value


def positive_number(value: Any, name: str) -> float:
    """``value`` as a finite number above 0 (an int or a float, not a bool).

    Raises:
        ValueError: naming ``name`` and what it accepts.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number above 0, got {brief(value)}")
    return float(value)


def one_of(value: Any, choices: Iterable[str], name: str) -> str:
    """``value`` as one of ``choices`` (strings)."""
    options = list(choices)
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {options}, got {brief(value)}")
    return value


def describe_error(error: BaseException) -> str:
    """``Type: message`` for any exception, even one whose ``__str__`` raises or whose args are not text."""
    try:
        text = str(error)
    except Exception:  # a user's exception may fail to print itself; its repr of args still tells something
        try:
            text = repr(error.args)
        except Exception:
            text = "<unprintable>"
    return f"{type(error).__name__}: {text}"

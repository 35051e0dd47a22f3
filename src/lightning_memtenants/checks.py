"""Argument checks shared by every public entry point, each raising one ``ValueError`` that names the argument."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def brief(value: Any) -> str:
    """``repr(value)`` on one line and cut short, for an error message, whatever the object.

    A numpy array's repr spans many lines, and a user's object may fail to print itself (its type name is
    shown then).

    Args:
        value: any object.

    Returns:
        The repr with its whitespace collapsed, at most 80 characters (cut ones end in ``...``).
    """
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:77] + "..."


def flag(value: Any, name: str) -> bool:
    """``value`` as a bool, refusing 0, 1 and strings, so that a flag passed by mistake is never read as truthy.

    Args:
        value: the argument to check.
        name: the argument's name, for the error message.

    Returns:
        ``value`` itself.

    Raises:
        ValueError: if ``value`` is not ``True`` or ``False``.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {brief(value)}")
    return value


def positive_int(value: Any, name: str, limit: int = 2**53) -> int:
    """``value`` as a count: an int from 1 to ``limit`` (not a bool, a float or a string).

    Args:
        value: the argument to check.
        name: the argument's name, for the error message.
        limit: the largest count accepted (by default 2**53, the largest a float holds exactly).

    Returns:
        ``value`` itself.

    Raises:
        ValueError: naming ``name`` and what it accepts.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"{name} must be a positive integer up to {limit:,}, got {brief(value)}")
    return value


def world_size(value: Any, name: str = "world_size") -> int:
    """``value`` as a number of ranks: a positive int (not a bool), with no upper bound.

    Args:
        value: the argument to check.
        name: the argument's name, for the error message.

    Returns:
        ``value`` itself.

    Raises:
        ValueError: if ``value`` is not an int of at least 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {brief(value)}")
    return value


def positive_number(value: Any, name: str) -> float:
    """``value`` as a finite number above 0 (an int or a float, not a bool).

    Args:
        value: the argument to check.
        name: the argument's name, for the error message.

    Returns:
        ``value`` as a float.

    Raises:
        ValueError: naming ``name`` and what it accepts.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number above 0, got {brief(value)}")
    return float(value)


def one_of(value: Any, choices: Iterable[str], name: str) -> str:
    """``value`` as one of ``choices`` (strings), so that a typo fails where it enters.

    Args:
        value: the argument to check.
        choices: the accepted strings.
        name: the argument's name, for the error message.

    Returns:
        ``value`` itself.

    Raises:
        ValueError: if ``value`` is not one of ``choices``; the message lists them.
    """
    options = list(choices)
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {options}, got {brief(value)}")
    return value


def describe_error(error: BaseException) -> str:
    """``Type: message`` for any exception, even one whose ``__str__`` raises or whose args are not text.

    The warnings and the postmortem name exceptions through this, so that describing one never fails too.

    Args:
        error: the exception.

    Returns:
        Its class name and message (the repr of its args, or ``<unprintable>``, where it cannot say).
    """
    try:
        text = str(error)
    except Exception:  # a user's exception may fail to print itself; its repr of args still tells something
        try:
            text = repr(error.args)
        except Exception:
            text = "<unprintable>"
    return f"{type(error).__name__}: {text}"

"""A guard for the parts of one component: a part that raises warns once and is disabled; the rest goes on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_memtenants.checks import describe_error


class Guard:
    """Runs each named part of one component (a measurement, a panel) so that its failure never fails training.

    Args:
        warn: how a failure is reported, once per part.
        doing: what the component does, for the warning ("measuring", "drawing").
        on_disable: called with the part's name when it is disabled, to release what it holds.

    Attributes:
        disabled: the names of the parts turned off so far.
    """

    def __init__(
        self,
        warn: Callable[[str], Any],
        doing: str = "measuring",
        on_disable: Callable[[str], Any] | None = None,
    ) -> None:
        self.disabled: set[str] = set()
        self._warn = warn
        self._doing = doing
        self._on_disable = on_disable

    def run(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None where ``part`` is disabled or ``fn`` raised (which disables it).

        Args:
            part: the part's name, for the warning and the disabled set.
            fn: what the part does.
            *args: passed to ``fn``.

        Returns:
            What ``fn`` returned, or None.
        """
        if part in self.disabled:
            return None
        try:
            return fn(*args)
        except Exception as error:  # a failure of ours must never fail the user's training
            self.disable(part, error)
            return None

    def disable(self, part: str, error: BaseException) -> None:
        """Turn ``part`` off for good and say why, once.

        Args:
            part: the part's name.
            error: what it raised, named in the warning.
        """
        if part in self.disabled:
            return
        self.disabled.add(part)
        if self._on_disable is not None:
            self._on_disable(part)
        self._warn(f"memtenants: {self._doing} {part} failed ({describe_error(error)}); {part} is disabled from now on")

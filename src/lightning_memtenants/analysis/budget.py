"""The memory budget: bytes the step may use, less a margin, and the one message that says a step passes it."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_memtenants.units import mib


class MemoryBudgetError(RuntimeError):
    """Raised with ``strict=True`` when a step is predicted not to fit the memory budget."""


@dataclass(frozen=True)
class Budget:
    """``total_bytes`` less a ``margin`` kept free for allocator rounding.

    Args:
        total_bytes: the memory the step may use, in bytes.
        margin: the fraction of ``total_bytes`` kept free.
    """

    total_bytes: int
    margin: float = 0.05

    @property
    def limit_bytes(self) -> int:
        """What a step may reach before a warning: the total less the margin."""
        return int(self.total_bytes * (1 - self.margin))

    def headroom_bytes(self, peak_bytes: int | None) -> int | None:
        """What is left of the total at ``peak_bytes``, or None where the peak was not measured.

        Args:
            peak_bytes: a step's peak, or None.

        Returns:
            The total less the peak (below 0 where the peak passed it; the margin is not taken off), or None.
        """
        return None if peak_bytes is None else self.total_bytes - peak_bytes

    def over(self, projected_bytes: int, what: str, fix: str) -> str | None:
        """The warning for a projection over the limit, or None where it fits.

        Args:
            projected_bytes: the projected peak.
            what: what was projected, in words; the warning reads "``what`` is N MiB".
            fix: what to do about it, in words.

        Returns:
            The warning, or None where ``projected_bytes`` is within :attr:`limit_bytes`.
        """
        if projected_bytes <= self.limit_bytes:
            return None
        return (
            f"memtenants: {what} is {mib(projected_bytes)} MiB, over the budget of {mib(self.limit_bytes)} MiB"
            f" ({mib(self.total_bytes)} MiB less a {self.margin:.0%} margin). Fix: {fix}."
        )

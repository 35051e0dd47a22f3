"""Forecasting: each window's peak as a fixed part plus a part that grows with the batch.

A step's peak is the highest of its phase windows, and each window grows with the batch at
its own rate: the forward window by the activations it builds, the optimizer step by hardly
anything. So the forecast keeps one line per window, ``peak = fixed + per_element * x``,
where ``x`` is the number of elements in the input batch (samples x sequence length, so
longer sequences count as well as more samples). From one observed size the slope is read
off that step (what the forward allocated, the activations, the batch); from two or more
sizes it is the secant through the two largest sizes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from lightning_memtenants.census import batch_tensors
from lightning_memtenants.report import StepReport

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
        value: a number of bytes, or a number with a unit (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB).
        name: the argument's name, for the error message.

    Returns:
        The whole number of bytes, at least 1.

    Raises:
        ValueError: if ``value`` is not a positive number of at least 1 byte, or names an unknown unit.
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


def brief(value: Any) -> str:
    """``repr(value)`` on one line and cut short, for an error message, whatever the object (a numpy array's
    repr spans many lines; a user's object may fail to print itself)."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:77] + "..."


def positive_int(value: Any, name: str, limit: int = 2**53) -> int:
    """``value`` as a batch size: an int from 1 to ``limit`` (not a bool, a float or a string).

    Raises:
        ValueError: naming ``name`` and what it accepts.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"{name} must be a positive integer up to {limit:,}, got {value!r}")
    return value


def positive_number(value: Any, name: str) -> float:
    """``value`` as a finite number above 0 (an int or a float, not a bool).

    Raises:
        ValueError: naming ``name`` and what it accepts.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number above 0, got {value!r}")
    return float(value)


def batch_elements(batch: Any) -> tuple[int, int]:
    """Elements and bytes of the tensors in ``batch``: the forecast's measure of its size."""
    tensors = batch_tensors(batch)
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def _slope_hints(report: StepReport, batch_bytes: int) -> dict[str, float]:
    """Bytes each window grows by, per batch, read off one step.

    The forward grows by everything it allocates: the activations it saves and the largest
    output in flight. Backward holds the activations and, at its peak, the gradients of the
    largest output and its input: about twice the forward's growth less the activations.
    Every window also holds the batch itself.
    """
    forward = report.phases.get("before_backward")
    start = report.phases.get("batch_start")
    activations = forward.tenants_bytes["activations"] if forward is not None else 0
    grown = activations
    if forward is not None and start is not None and forward.window_peak_bytes and start.allocated_bytes is not None:
        grown = max(forward.window_peak_bytes - start.allocated_bytes, activations)
    backward = max(2 * grown - activations, activations)
    return {"before_backward": batch_bytes + grown, "after_backward": batch_bytes + backward}


@dataclass
class _Line:
    points: dict[int, int] = field(default_factory=dict)  # batch elements -> window peak
    hint: float = 0.0  # bytes per element, from the tenants, for when one size was seen

    def fit(self) -> tuple[float, float]:
        """Intercept and slope: the secant through the two largest sizes, never below the hint.

        A window's peak is the highest of several moments (the largest gradient, the activations
        plus their gradients, ...), so it grows piecewise linearly and more steeply at larger
        batches; the secant at the top extrapolates best.
        """
        xs = sorted(self.points)
        top = xs[-1]
        slope = self.hint
        if len(xs) > 1:
            below = xs[-2]
            slope = max(slope, (self.points[top] - self.points[below]) / (top - below))
        return self.points[top] - slope * top, slope


class PeakForecast:
    """Predicts a step's peak for a batch size, and the largest batch that fits a budget.

    Example::

        forecast = PeakForecast()
        forecast.observe(report, batch)  # after each measured step
        forecast.predict_peak_bytes(256)
        forecast.max_batch_size(24 * 2**30)
    """

    def __init__(self) -> None:
        self._lines: dict[str, _Line] = {}
        self.samples_seen = 0
        self.elements_per_sample = 0.0
        self.largest_elements = 0

    @property
    def ready(self) -> bool:
        return bool(self._lines)

    @property
    def sizes_seen(self) -> int:
        """How many distinct batch sizes (in elements) the fit has seen."""
        return max((len(line.points) for line in self._lines.values()), default=0)

    def observe(self, report: StepReport, elements: int, batch_bytes: int, samples: int) -> None:
        """Add one measured step; the latest step at a given size replaces earlier ones."""
        if report.peak_bytes is None or elements <= 0:
            return
        self.samples_seen = max(self.samples_seen, samples)
        self.elements_per_sample = max(self.elements_per_sample, elements / max(samples, 1))
        self.largest_elements = max(self.largest_elements, elements)
        hints = _slope_hints(report, batch_bytes)
        for name, phase in report.phases.items():
            if phase.window_peak_bytes is None or name == "batch_start":
                continue
            line = self._lines.setdefault(name, _Line())
            line.points[elements] = phase.window_peak_bytes
            line.hint = hints.get(name, batch_bytes) / elements

    def predict_peak_bytes(self, batch_size: int, elements_per_sample: float | None = None) -> int | None:
        """The predicted step peak for ``batch_size`` samples (at the longest sample seen so far).

        Args:
            batch_size: samples in the batch, a positive integer.
            elements_per_sample: input elements per sample (the sequence length, say); ``None``
                uses the longest sample seen so far.

        Returns:
            The predicted peak in bytes, or ``None`` before any measured step.

        Raises:
            ValueError: if an argument is not a positive number.
        """
        batch_size = positive_int(batch_size, "batch_size")
        if elements_per_sample is not None:
            elements_per_sample = positive_number(elements_per_sample, "elements_per_sample")
        if not self._lines:
            return None
        x = batch_size * (elements_per_sample or self.elements_per_sample)
        return self.predict_for_elements(x)

    def predict_for_elements(self, elements: float, windows: tuple[str, ...] | None = None) -> int | None:
        """The predicted peak for a batch of ``elements`` input elements, over all or some windows."""
        lines = [line for name, line in self._lines.items() if windows is None or name in windows]
        if not lines:
            return None
        return int(max(a + s * elements for a, s in (line.fit() for line in lines)))

    def growth_bytes_per_sample(self) -> float | None:
        """How much the peak grows for one more sample, at the longest sample seen so far."""
        if not self._lines:
            return None
        return self.predict_peak_bytes(2) - self.predict_peak_bytes(1)  # type: ignore[operator]

    def max_batch_size(self, budget_bytes: int, elements_per_sample: float | None = None) -> int | None:
        """The largest batch whose predicted peak fits ``budget_bytes``.

        Args:
            budget_bytes: the memory the step may use, in bytes.
            elements_per_sample: input elements per sample; ``None`` uses the longest seen so far.

        Returns:
            The batch size (0 if none fits, ``2**31 - 1`` if the peak does not grow with the batch),
            or ``None`` before any measured step.

        Raises:
            ValueError: if an argument is not a positive number.
        """
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a whole number of bytes, 0 or more, got {budget_bytes!r}")
        if elements_per_sample is not None:
            elements_per_sample = positive_number(elements_per_sample, "elements_per_sample")
        if not self._lines:
            return None
        per_sample = elements_per_sample or self.elements_per_sample
        best = math.inf
        for a, s in (line.fit() for line in self._lines.values()):
            if a > budget_bytes:
                return 0
            if s > 0:
                best = min(best, (budget_bytes - a) / (s * per_sample))
        return 2**31 - 1 if best == math.inf else int(best)

    def state_dict(self) -> dict[str, Any]:
        return {
            "lines": {name: {"points": dict(line.points), "hint": line.hint} for name, line in self._lines.items()},
            "samples_seen": self.samples_seen,
            "elements_per_sample": self.elements_per_sample,
            "largest_elements": self.largest_elements,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved.

        Raises:
            ValueError: if ``state`` is not such a dict; nothing is changed then.
        """
        try:
            lines = {
                str(name): _Line({int(k): int(v) for k, v in line["points"].items()}, float(line["hint"]))
                for name, line in state.get("lines", {}).items()
            }
            samples = int(state.get("samples_seen", 0))
            per_sample = float(state.get("elements_per_sample", 0.0))
            largest = int(state.get("largest_elements", 0))
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"the forecast's state must be a dict saved by PeakForecast.state_dict(), got {state!r:.80} ({error})"
            ) from None
        self._lines, self.samples_seen, self.elements_per_sample, self.largest_elements = (
            lines,
            samples,
            per_sample,
            largest,
        )

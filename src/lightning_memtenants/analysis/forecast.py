"""Forecasting: each window's peak as a fixed part plus a part that grows with the batch.

A step's peak is the highest of its phase windows, and each window grows with the batch at
its own rate: the forward window by the activations it builds, the optimizer step by hardly
anything. So the forecast keeps one line per window, ``peak = fixed + per_element * x``,
where ``x`` is the number of elements in the input batch (samples x sequence length, so
longer sequences count as well as more samples). From one observed size the slope is read
off that step (what the forward allocated, the activations, the batch); from two or more
sizes it is the secant through the two largest sizes, never below the slope read off the
latest step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_memtenants.checks import positive_int, positive_number
from lightning_memtenants.core.record import StepReport


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
        forecast.observe(report, elements, batch_bytes, samples)  # after each measured step
        forecast.predict_peak_bytes(256)
        forecast.max_batch_size(24 * 2**30)

    Attributes:
        elements_per_sample: the most input elements per sample seen so far (the longest sample).
        largest_elements: the most input elements of any batch seen so far.
    """

    def __init__(self) -> None:
        self._lines: dict[str, _Line] = {}
        self.elements_per_sample = 0.0
        self.largest_elements = 0

    @property
    def ready(self) -> bool:
        """Whether a measured step has been observed, so that the forecast can predict."""
        return bool(self._lines)

    @property
    def sizes_seen(self) -> int:
        """How many distinct batch sizes (in elements) the fit has seen."""
        return max((len(line.points) for line in self._lines.values()), default=0)

    def observe(self, report: StepReport, elements: int, batch_bytes: int, samples: int) -> None:
        """Add one measured step; the latest step at a given size replaces earlier ones.

        A step whose peak was not measured, or a batch without elements, is ignored.

        Args:
            report: the step's report.
            elements: input elements in the step's batch.
            batch_bytes: the batch's bytes.
            samples: samples in the batch.
        """
        if report.peak_bytes is None or elements <= 0:
            return
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
        """The predicted peak for a batch of ``elements`` input elements, over all or some windows.

        Args:
            elements: input elements in the batch.
            windows: the phases whose windows count (``"before_backward"``, ...); ``None`` counts all.

        Returns:
            The highest of those windows' predicted peaks in bytes, or ``None`` where none has been observed.
        """
        lines = [line for name, line in self._lines.items() if windows is None or name in windows]
        if not lines:
            return None
        return int(max(a + s * elements for a, s in (line.fit() for line in lines)))

    def max_batch_size(self, budget_bytes: int, elements_per_sample: float | None = None) -> int | None:
        """The largest batch whose predicted peak fits ``budget_bytes``.

        Args:
            budget_bytes: the memory the step may use, in bytes.
            elements_per_sample: input elements per sample; ``None`` uses the longest seen so far.

        Returns:
            The batch size (0 if none fits, ``2**31 - 1`` if the peak does not grow with the batch),
            or ``None`` before any measured step.

        Raises:
            ValueError: if ``budget_bytes`` is not an int of 0 or more, or ``elements_per_sample`` is not a
                positive number.
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
        """What the forecast has learnt, as plain types, so that a resumed run goes on from it."""
        return {
            "lines": {name: {"points": dict(line.points), "hint": line.hint} for name, line in self._lines.items()},
            "elements_per_sample": self.elements_per_sample,
            "largest_elements": self.largest_elements,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved.

        Args:
            state: a dict returned by :meth:`state_dict`.

        Raises:
            ValueError: if ``state`` is not such a dict; nothing is changed then.
        """
        try:
            lines = {
                str(name): _Line({int(k): int(v) for k, v in line["points"].items()}, float(line["hint"]))
                for name, line in state.get("lines", {}).items()
            }
            per_sample = float(state.get("elements_per_sample", 0.0))
            largest = int(state.get("largest_elements", 0))
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"the forecast's state must be a dict saved by PeakForecast.state_dict(), got {state!r:.80} ({error})"
            ) from None
        self._lines, self.elements_per_sample, self.largest_elements = lines, per_sample, largest

"""Forecasting: each window's peak as a fixed part plus a part that grows with the batch.

A step's peak is the highest of its phase windows, and each window grows with the batch at
its own rate: the forward window by the activations it builds, the optimizer step by hardly
anything. So the forecast keeps one line per window, ``peak = fixed + per_element * x``,
where ``x`` is the number of elements in the input batch (samples x sequence length, so
longer sequences count as well as more samples). From one observed size the slope is read
off that step (what the forward allocated, the activations, the batch); from two or more
sizes it is the secant through the two largest sizes, never below the slope read off the
latest step.

A first optimizer step is projected to the steady state before it is fitted: it lacks the
optimizer state that its own ``step()`` creates, in every window before the optimizer step,
and in its forward the previous step's gradients, which a later step still holds there
(Lightning zeroes them after the forward). Both are read off the step's own per-phase
tenants.

A line is a guess: a window's peak is a maximum of linear pieces in the batch, and the piece
that leads at the measured size need not lead at the answer. Where better answers are at hand
(:attr:`PeakForecast.exact`), :meth:`PeakForecast.max_batch_size` and
:meth:`PeakForecast.predict_peak_bytes` give them, and the line only seeds the search. Two kinds
give them: dry runs of the step (``predict.dryrun.sweep``, and the callback's ``exact=True`` after
fit), and :class:`ScaledStep`, a measured step's own timeline with its batch-proportional bytes
scaled, which runs nothing (the callback's answers during a fit, on the CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from lightning_memtenants.analysis.budget import Budget
from lightning_memtenants.checks import positive_int, positive_number
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.timeline import StepTimeline, upper_envelope
from lightning_memtenants.units import parse_bytes

# The windows before the optimizer step, which a first step runs without the optimizer state its step creates.
_BEFORE_STEP = ("before_backward", "after_backward", "before_optimizer_step")
# The largest batch where the peak does not grow with the batch.
UNBOUNDED = 2**31 - 1


class ExactPeaks(Protocol):
    """Answers for one batch shape that a forecast gives before its lines: by dry runs of the step
    (``predict.dryrun``), or scaled from a measured step's timeline (:class:`ScaledStep`).

    Attributes:
        elements_per_sample: input elements per sample of the batch shape the answers are for.
    """

    elements_per_sample: float

    def peak_bytes(self, batch_size: int) -> int:
        """The steady-state step's peak at ``batch_size`` samples."""
        ...

    def largest(self, limit_bytes: int, guess: int | None) -> int:
        """The largest batch whose steady-state peak is at most ``limit_bytes`` (``guess``: where to start)."""
        ...


def first_step_shortfall(report: StepReport) -> dict[str, int]:
    """What each window of a first optimizer step lacked against a steady-state step, in bytes.

    The first step's ``step()`` creates the optimizer state (Adam's moments), so every window before it ran
    without that state; and its forward ran without the previous step's gradients, which a steady-state
    forward still holds (Lightning zeroes them after the forward, in its closure). Both are read off the
    step's own tenants: the state at ``batch_end`` less the state at each phase, and the gradients at their
    high less those at ``batch_start``.

    Args:
        report: a step.

    Returns:
        Bytes to add to each window's peak (``before_backward``, ...); empty for a steady-state step, one whose
        optimizer state did not grow and that is not the first (step 0).
    """
    phases = report.phases
    start = report.micro_batches[0].get("batch_start") if report.micro_batches else phases.get("batch_start")
    end = phases.get("batch_end")
    if start is None or end is None:
        return {}
    state = end.tenants_bytes["optimizer_state"]
    if state <= start.tenants_bytes["optimizer_state"] and report.step != 0:
        return {}
    gradients = max(p.tenants_bytes["gradients"] for p in phases.values())
    out = {n: max(state - phases[n].tenants_bytes["optimizer_state"], 0) for n in _BEFORE_STEP if n in phases}
    if "before_backward" in out:
        out["before_backward"] += max(gradients - start.tenants_bytes["gradients"], 0)
    return {name: extra for name, extra in out.items() if extra}


class ScaledStep:
    """A measured step's peak at any batch size, scaled from its own timeline: no dry run, nothing run again.

    At every event of the step's phase windows the timeline splits the live bytes into a fixed part ``F`` and a part
    ``S`` that grows in proportion to the batch (:attr:`~lightning_memtenants.core.timeline.StepTimeline.scaling`:
    the batch's own storages, the activations, the forward's and backward's temporaries). The peak at ``b``
    samples is then ``max(F + S * b / b0)`` over the events, ``b0`` the measured batch's samples; only the upper
    envelope of the ``(F, S)`` pairs is kept. A first optimizer step (no optimizer state before its ``step()``,
    no previous gradients in its forward) is projected to the steady state window by window
    (:func:`first_step_shortfall`). An allocation read as growing that does not (a parameter-sized temporary of
    backward) makes the projection higher above the measured batch than the truth, never lower: the largest batch
    it gives is never above the truth. Where the step's ops change with the batch size (a value read to pick a
    path), the scaled step knows only the path it measured.

    Args:
        envelope: per window, the ``(F, S)`` pairs (``StepTimeline.scaling``).
        samples: ``b0``, the measured batch's samples (its leading size), a positive integer.
        elements_per_sample: the measured batch's input elements per sample, the shape the answers are for.
        shortfall: bytes to add to each window's fixed part (:func:`first_step_shortfall`); ``batch_start``'s
            state takes ``before_backward``'s.

    Attributes:
        points: the upper envelope of the projected ``(F, S)`` pairs, by ``S`` ascending.
        samples: ``b0``.
        elements_per_sample: as given.

    Raises:
        ValueError: if ``samples`` is not a positive integer or ``envelope`` holds no pair.
    """

    def __init__(
        self,
        envelope: dict[str, list[tuple[int, int]]],
        samples: int,
        elements_per_sample: float,
        shortfall: dict[str, int] | None = None,
    ) -> None:
        self.samples = positive_int(samples, "samples")
        self.elements_per_sample = float(elements_per_sample)
        shortfall = shortfall or {}
        points: list[tuple[int, int]] = []
        for window, pairs in envelope.items():
            extra = shortfall.get("before_backward" if window == "batch_start" else window, 0)
            points.extend((fixed + extra, scaling) for fixed, scaling in pairs)
        self.points = upper_envelope(points)
        if not self.points:
            raise ValueError("envelope must hold at least one (fixed, scaling) pair of a phase window")

    @classmethod
    def from_step(cls, report: StepReport, timeline: StepTimeline, samples: int, elements_per_sample: float) -> Any:
        """The scaled step of a measured step, projected to the steady state where it is a first optimizer step.

        Args:
            report: the step's report (its per-phase tenants give the first step's shortfall).
            timeline: the step's timeline (``timeline_of(report)``).
            samples: the step's batch size (the last micro-batch's samples).
            elements_per_sample: the batch's input elements per sample.

        Returns:
            The :class:`ScaledStep`, or None where the timeline holds no window.
        """
        if not timeline.scaling:
            return None
        return cls(timeline.scaling, samples, elements_per_sample, first_step_shortfall(report))

    def peak_bytes(self, batch_size: int) -> int:
        """The steady-state step's peak at ``batch_size`` samples: ``max(F + S * b / b0)``, rounded up."""
        b = positive_int(batch_size, "batch_size")
        return max(fixed + -(-scaling * b // self.samples) for fixed, scaling in self.points)

    def largest(self, limit_bytes: int, guess: int | None = None) -> int:
        """The largest batch whose steady-state peak is at most ``limit_bytes``, in closed form.

        ``min(floor((limit - F) * b0 / S))`` over the points that grow; 0 where a fixed part alone passes the limit,
        ``2**31 - 1`` where nothing grows. ``guess`` is not needed and is ignored (the protocol's).
        """
        best = UNBOUNDED
        for fixed, scaling in self.points:
            if fixed > limit_bytes:
                return 0
            if scaling > 0:
                best = min(best, (limit_bytes - fixed) * self.samples // scaling)
        return max(best, 0)


def limit_bytes(budget_bytes: int | str | float, margin: float = 0.05) -> int:
    """The one margin rule of every largest-batch answer: ``Budget(budget_bytes, margin).limit_bytes``.

    Args:
        budget_bytes: bytes (an int of 0 or more), or a string like ``"24GiB"`` (``units.parse_bytes``).
        margin: the fraction of the budget kept free, in [0, 1).

    Returns:
        What a step may reach: the budget less the margin, in bytes.

    Raises:
        ValueError: naming ``budget_bytes`` or ``margin`` and what each accepts.
    """
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction of the budget in [0, 1), got {margin!r}")
    if isinstance(budget_bytes, int) and not isinstance(budget_bytes, bool) and budget_bytes >= 0:
        total = budget_bytes
    elif isinstance(budget_bytes, (str, float)) and not isinstance(budget_bytes, bool):
        total = parse_bytes(budget_bytes, "budget_bytes")
    else:
        raise ValueError(
            f"budget_bytes must be a whole number of bytes, 0 or more, or a string like '24GiB', got {budget_bytes!r}"
        )
    return Budget(total, float(margin)).limit_bytes


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
        batches. The secant at the top extrapolates best within a piece, but two small sizes often
        sit on a piece that a steeper one overtakes later (the seed model's backward from batches
        64 and 128 extrapolates 15% too far); the hint, read off the top size's tenants (the
        activations and their gradients), is the floor that keeps the line from answering too large.
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
        forecast.max_batch_size("24GiB")  # 24 GiB less a 5% margin

    Attributes:
        elements_per_sample: the most input elements per sample seen so far (the longest sample).
        largest_elements: the most input elements of any batch seen so far.
        exact: exact answers by dry runs, for one batch shape, or None (the lines answer). Set by
            ``predict.dryrun.sweep`` and by the callback; not saved by :meth:`state_dict`.
    """

    def __init__(self) -> None:
        self._lines: dict[str, _Line] = {}
        self.elements_per_sample = 0.0
        self.largest_elements = 0
        self.exact: ExactPeaks | None = None

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

        A first optimizer step is projected to the steady state (:func:`first_step_shortfall`) before it is
        fitted. A step whose peak was not measured, or a batch without elements, is ignored.

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
        shortfall = first_step_shortfall(report)
        for name, phase in report.phases.items():
            if phase.window_peak_bytes is None or name == "batch_start":
                continue
            line = self._lines.setdefault(name, _Line())
            line.points[elements] = phase.window_peak_bytes + shortfall.get(name, 0)
            line.hint = hints.get(name, batch_bytes) / elements

    def predict_peak_bytes(self, batch_size: int, elements_per_sample: float | None = None) -> int | None:
        """The predicted steady-state step peak for ``batch_size`` samples (at the longest sample seen so far).

        Exact where :attr:`exact` answers for that sample size; else the lines'.

        Args:
            batch_size: samples in the batch, a positive integer.
            elements_per_sample: input elements per sample (the sequence length, say); ``None`` uses the
                longest sample seen so far.

        Returns:
            The predicted peak in bytes, or ``None`` before any measured step.

        Raises:
            ValueError: if an argument is not a positive number.
        """
        batch_size = positive_int(batch_size, "batch_size")
        if elements_per_sample is not None:
            elements_per_sample = positive_number(elements_per_sample, "elements_per_sample")
        exact = self._exact_for(elements_per_sample)
        if exact is not None:
            return exact.peak_bytes(batch_size)
        if not self._lines:
            return None
        x = batch_size * (elements_per_sample or self.elements_per_sample)
        return self.predict_for_elements(x)

    def predict_for_elements(self, elements: float, windows: tuple[str, ...] | None = None) -> int | None:
        """The lines' predicted peak for a batch of ``elements`` input elements, over all or some windows.

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

    def max_batch_size(
        self, budget_bytes: int | str, elements_per_sample: float | None = None, *, margin: float = 0.05
    ) -> int | None:
        """The largest batch whose steady-state peak fits ``budget_bytes`` less the ``margin``.

        The one rule for every answer: ``Budget(budget_bytes, margin).limit_bytes``. Exact where
        :attr:`exact` answers for that sample size (the lines' answer seeds its search); else the lines'.

        Args:
            budget_bytes: the memory the step may use: bytes, or a string like ``"24GiB"``.
            elements_per_sample: input elements per sample; ``None`` uses the longest seen so far.
            margin: the fraction of the budget kept free, in [0, 1).

        Returns:
            The batch size (0 if none fits, ``2**31 - 1`` if the peak does not grow with the batch),
            or ``None`` before any measured step (and without an exact answer).

        Raises:
            ValueError: if ``budget_bytes`` is not a number of bytes (0 or more) or such a string, ``margin`` not
                in [0, 1), or ``elements_per_sample`` not a positive number.
        """
        limit = limit_bytes(budget_bytes, margin)
        if elements_per_sample is not None:
            elements_per_sample = positive_number(elements_per_sample, "elements_per_sample")
        exact = self._exact_for(elements_per_sample)
        guess = self.line_batch_size(limit, elements_per_sample, margin=0.0)
        if exact is not None:
            return exact.largest(limit, guess)
        return guess

    def line_batch_size(
        self, budget_bytes: int | str, elements_per_sample: float | None = None, *, margin: float = 0.05
    ) -> int | None:
        """The largest batch whose peak, as the lines predict it, fits ``budget_bytes`` less the ``margin``.

        What :meth:`max_batch_size` answers without an exact answer, and where its search starts.

        Args:
            budget_bytes: the memory the step may use: bytes, or a string like ``"24GiB"``.
            elements_per_sample: input elements per sample; ``None`` uses the longest seen so far.
            margin: the fraction of the budget kept free, in [0, 1).

        Returns:
            As :meth:`max_batch_size`; ``None`` before any measured step.

        Raises:
            ValueError: as :meth:`max_batch_size`.
        """
        limit = limit_bytes(budget_bytes, margin)
        if elements_per_sample is not None:
            elements_per_sample = positive_number(elements_per_sample, "elements_per_sample")
        if not self._lines:
            return None
        per_sample = elements_per_sample or self.elements_per_sample
        best = math.inf
        for a, s in (line.fit() for line in self._lines.values()):
            if a > limit:
                return 0
            if s > 0:
                best = min(best, (limit - a) / (s * per_sample))
        return UNBOUNDED if best == math.inf else int(min(best, UNBOUNDED))

    def _exact_for(self, elements_per_sample: float | None) -> ExactPeaks | None:
        """The exact answers, where they are for samples of ``elements_per_sample`` (None: the longest seen)."""
        exact = self.exact
        if exact is None:
            return None
        wanted = elements_per_sample or self.elements_per_sample or exact.elements_per_sample
        return exact if math.isclose(wanted, exact.elements_per_sample) else None

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

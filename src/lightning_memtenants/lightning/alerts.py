"""Warnings before an OOM: projections of the step's peak against the budget, the forecast, and leaks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_memtenants.analysis.budget import Budget, MemoryBudgetError
from lightning_memtenants.analysis.fixes import first_step_jump_bytes
from lightning_memtenants.analysis.forecast import PeakForecast
from lightning_memtenants.analysis.leaks import LeakDetector
from lightning_memtenants.checks import brief
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.storage import batch_tensors
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.units import MiB

# The two parts this component runs under its guard; each is disabled on its own.
FORECAST, LEAKS = "the forecast", "leak detection"
# (elements, bytes, samples) of a batch: the forecast's measure of its size
BatchSize = tuple[int, int, int]


class Alerts:
    """Projects each step's peak from what has been measured and warns, once per kind, before it passes the budget.

    Args:
        budget_bytes: the memory the step may use, or None (no projections, no warnings; the forecast still learns).
        margin: the fraction of a budget kept free for allocator rounding.
        strict: raise :class:`MemoryBudgetError` where the first optimizer step is projected not to fit.
        warn: how a warning is given (rank zero's).

    Attributes:
        budget: the run's budget, or None.
        forecast: the peak forecast fitted to the measured steps.
        leaks: the leak detector.
    """

    def __init__(self, budget_bytes: int | None, *, margin: float, strict: bool, warn: Callable[[str], Any]) -> None:
        self.margin = margin
        self.budget = None if budget_bytes is None else Budget(budget_bytes, margin)
        self.strict = strict
        self.forecast = PeakForecast()
        self.leaks = LeakDetector()
        self.guard = Guard(warn, "forecasting")
        self._warn = warn
        self._warned: set[str] = set()
        self._batch: BatchSize = (0, 0, 0)

    def set_budget(self, budget_bytes: int | None) -> None:
        """The run's budget (the argument, else the device's capacity); warnings start afresh.

        Args:
            budget_bytes: the memory the step may use, or None for no budget.
        """
        self.budget = None if budget_bytes is None else Budget(budget_bytes, self.margin)
        self._warned = set()

    def batch_start(self, batch: Any, batch_idx: int) -> None:
        """Size the batch; a batch larger than any seen gets its projected peak checked.

        Args:
            batch: what the dataloader gave.
            batch_idx: its index, named in the warning.
        """
        sized = self.guard.run(FORECAST, batch_size, batch)
        self._batch = sized or (0, 0, 0)
        elements, _, samples = self._batch
        forecast = self.forecast
        if sized is None or not forecast.ready or elements <= forecast.largest_elements:
            return
        projected = forecast.predict_for_elements(elements)
        if projected is not None:
            self._check(
                "larger batch",
                projected,
                f"batch {batch_idx} is the largest yet ({samples} samples, {elements:,} elements, was"
                f" {forecast.largest_elements:,}); its projected peak",
                "cap the batch size or the sequence length, or sort and bucket samples by length",
            )

    def before_backward(self, monitor: TenantMonitor) -> None:
        """Project the peak of this batch's backward and optimizer step, and warn where it passes the budget.

        Args:
            monitor: the run's monitor, just past ``before_backward``.
        """
        if self.budget is None:
            return
        projected = self.guard.run(FORECAST, self._project_backward, monitor)
        if projected is not None:
            self._check(
                "backward",
                projected,
                "the projected peak of this batch's backward and optimizer step",
                "lower the batch size, or use activation checkpointing or bf16-mixed",
            )

    def before_optimizer_step(self, monitor: TenantMonitor) -> None:
        """Before the first optimizer step: project the state and temporaries it will add.

        Args:
            monitor: the run's monitor, just past ``before_optimizer_step``.

        Raises:
            MemoryBudgetError: with ``strict``, if the projected peak passes the budget less the margin.
        """
        if self.budget is None or monitor.steps_done:
            return
        projected = self.guard.run(FORECAST, _project_first_step, monitor)
        if projected is not None:
            total, state, temporaries = projected
            self._check(
                "first step",
                total,
                f"the first optimizer step adds {state / MiB:.2f} MiB of optimizer state and about"
                f" {temporaries / MiB:.2f} MiB of temporaries; its projected peak",
                "shard the optimizer state (ZeRO or FSDP), use fused=True, or an optimizer with less state",
                strict=self.strict,
            )

    def step_end(self, report: StepReport) -> None:
        """Feed a measured step to the forecast and the leak detector, and warn once of a leak.

        Args:
            report: the step; one whose peak was not measured is ignored.
        """
        if report.peak_bytes is None:
            return
        elements, nbytes, samples = self._batch
        self.guard.run(FORECAST, self.forecast.observe, report, elements, nbytes, samples)
        start = report.micro_batches[0].get("batch_start")
        if start is not None and start.allocated_bytes is not None:
            leak = self.guard.run(LEAKS, self.leaks.observe, report.step, start)
            if leak and "leak" not in self._warned:
                self._warned.add("leak")
                self._warn(leak)

    def state_dict(self) -> dict[str, Any]:
        """The forecast and the leak baseline, for a checkpoint."""
        return {"forecast": self.forecast.state_dict(), "leaks": self.leaks.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; nothing changes where it is refused.

        Args:
            state_dict: a dict returned by :meth:`state_dict`.

        Raises:
            ValueError: if ``state_dict`` or one of its parts is not such a dict.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(
                f"state_dict must be a dict saved by MemoryTenantsCallback.state_dict(), got {brief(state_dict)}"
            )
        forecast, leaks = PeakForecast(), LeakDetector()
        for name, part in (("forecast", forecast), ("leaks", leaks)):
            value = state_dict.get(name, {})
            if not isinstance(value, dict):
                raise ValueError(f"state_dict[{name!r}] must be a dict, got {brief(value)}")
            part.load_state_dict(value)
        self.forecast, self.leaks = forecast, leaks

    def headroom_bytes(self, report: StepReport) -> int | None:
        """What the budget leaves above this step's peak, or None.

        Args:
            report: the step.

        Returns:
            The budget (before the margin) less the peak, or None without a budget or a measured peak.
        """
        return None if self.budget is None else self.budget.headroom_bytes(report.peak_bytes)

    def max_batch_size(self, budget_bytes: int | None = None, elements_per_sample: float | None = None) -> int | None:
        """The largest batch whose predicted peak fits ``budget_bytes`` (else the run's budget) less the margin.

        Args:
            budget_bytes: the budget in bytes; None uses the run's.
            elements_per_sample: input elements per sample; None uses the longest seen so far.

        Returns:
            The batch size, or None without a budget or before a step was measured.
        """
        total = budget_bytes if budget_bytes is not None else (self.budget.total_bytes if self.budget else None)
        if total is None or not self.forecast.ready:
            return None
        return self.forecast.max_batch_size(Budget(total, self.margin).limit_bytes, elements_per_sample)

    def _check(self, key: str, projected: int, what: str, fix: str, strict: bool = False) -> None:
        if self.budget is None or key in self._warned:
            return
        message = self.budget.over(projected, what, fix)
        if message is None:
            return
        self._warned.add(key)
        if strict:
            raise MemoryBudgetError(message)
        self._warn(message)

    def _project_backward(self, monitor: TenantMonitor) -> int | None:
        elements = self._batch[0]
        if self.forecast.ready and elements:
            return self.forecast.predict_for_elements(elements, windows=("after_backward", "batch_end"))
        phase = monitor.last_phase()
        if phase is None:
            return None
        gradients = max(monitor.trainable_bytes() - phase.tenants_bytes["gradients"], 0)
        state = temporaries = 0
        if monitor.steps_done == 0:
            state, temporaries = first_step_jump_bytes(
                monitor.module, monitor.optimizers, phase.tenants_bytes["optimizer_state"]
            )
        return _current_bytes(monitor) + gradients + state + temporaries


def _current_bytes(monitor: TenantMonitor) -> int:
    phase = monitor.last_phase()
    if phase is None:
        return 0
    return phase.allocated_bytes if phase.allocated_bytes is not None else phase.total_bytes


def _project_first_step(monitor: TenantMonitor) -> tuple[int, int, int]:
    phase = monitor.last_phase()
    state_now = phase.tenants_bytes["optimizer_state"] if phase is not None else 0
    state, temporaries = first_step_jump_bytes(monitor.module, monitor.optimizers, state_now)
    return _current_bytes(monitor) + state + temporaries, state, temporaries


def batch_size(batch: Any) -> BatchSize | None:
    """Elements, bytes and samples of a batch; None where it holds no tensor (the forecast then skips it).

    Samples are the leading size of the first tensor with a dimension (1 where every tensor is 0-d): no call
    to Lightning's ``extract_batch_size``, which warns about an ambiguous batch size to a user who never
    logged anything.

    Args:
        batch: what the dataloader gave.

    Returns:
        ``(elements, bytes, samples)``, or None.
    """
    tensors = batch_tensors(batch)
    elements = sum(t.numel() for t in tensors)
    if not elements:
        return None
    first = next((t for t in tensors if t.dim()), None)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return elements, nbytes, int(first.shape[0]) if first is not None else 1

"""Warnings before an OOM: projections of the step's peak against the budget, the forecast, and leaks.

And the answers to "what is the largest batch". During a fit they come from what the measured steps recorded and run
nothing of the user's: on the CPU, a measured step's timeline with its batch-proportional bytes scaled
(``analysis.forecast.ScaledStep``); elsewhere (CUDA: no timeline) the forecast's lines. Exact answers by dry runs of
the run's own step under fake tensors (``predict.dryrun``, :class:`StepSearch`) run only when asked for, outside the
fit (``exact=True``), on a meta copy of the model made then.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_memtenants.analysis.budget import Budget, MemoryBudgetError
from lightning_memtenants.analysis.engines import is_dtensor
from lightning_memtenants.analysis.fixes import first_step_jump_bytes
from lightning_memtenants.analysis.forecast import PeakForecast, ScaledStep, first_step_shortfall, limit_bytes
from lightning_memtenants.analysis.leaks import LeakDetector
from lightning_memtenants.checks import brief
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.storage import batch_tensors
from lightning_memtenants.core.timeline import timeline_of
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.predict.advise import Advice, advise
from lightning_memtenants.predict.cuda_model import resolve_target
from lightning_memtenants.predict.dryrun import sweep
from lightning_memtenants.predict.fake import PRECISIONS, copy_module
from lightning_memtenants.predict.values import KNOWN_ELEMENTS
from lightning_memtenants.units import MiB

# The parts this component runs under its guard; each is disabled on its own.
FORECAST, LEAKS = "the forecast", "leak detection"
SCALED = "the largest batch scaled from the measured step"
LARGEST = "the largest batch"
MEASURED = "the fixes by dry runs of the step"
# How the in-fit answers are found, in words (the summary's line).
HOW_SCALED = "scaled from a measured step's own allocations (no dry run)"
HOW_LINES = "from the forecast's lines"
# What an in-fit budget warning says of the measured fixes, with ``measure_fixes``.
ADVISE_HINT = (
    "these fixes are estimates; for fixes measured by dry runs of the step (under fake tensors, never inside the fit)"
    " call MemoryTenantsCallback.advise() after fit; an out-of-memory error's postmortem measures them after the fit"
    " has failed"
)
# (elements, bytes, samples) of a batch: the forecast's measure of its size
BatchSize = tuple[int, int, int]


class Alerts:
    """Projects each step's peak from what has been measured and warns, once per kind, before it passes the budget.

    Args:
        budget_bytes: the memory the step may use, or None (no projections, no warnings; the forecast still learns).
        margin: the fraction of a budget kept free for allocator rounding.
        strict: raise :class:`MemoryBudgetError` where the first optimizer step is projected not to fit.
        warn: how a warning is given (rank zero's).
        measure_fixes: measure the fixes for the run's step by dry runs (``predict.advise``) in an out-of-memory
            postmortem, after the fit has failed (never inside the fit: a budget warning says how to get them,
            :meth:`advise`); the batch under way is referenced until its step ends, for the postmortem.

    Attributes:
        budget: the run's budget, or None.
        forecast: the peak forecast fitted to the measured steps.
        leaks: the leak detector.
    """

    def __init__(
        self,
        budget_bytes: int | None,
        *,
        margin: float,
        strict: bool,
        warn: Callable[[str], Any],
        measure_fixes: bool = False,
    ) -> None:
        self.margin = margin
        self.measure_fixes = measure_fixes
        self.budget = None if budget_bytes is None else Budget(budget_bytes, margin)
        self.strict = strict
        self.forecast = PeakForecast()
        self.leaks = LeakDetector()
        self.guard = Guard(warn, "forecasting")
        self._warn = warn
        self._warned: set[str] = set()
        self._batch: BatchSize = (0, 0, 0)
        self._step: _StepSetup | None = None
        self._why: str | None = "no model attached"  # why no dry run can stand for the run's step, or None
        self._current: Any = None  # with measure_fixes: the batch of the step under way, until the step ends
        self._measured: MeasuredBatch | None = None  # the last measured batch, described: what exact=True runs
        self._search: StepSearch | None = None  # the exact answers for ``_measured``, made at the first exact=True
        # the last advice, by budget, batch size and shape
        self._advice: tuple[tuple[int, int, BatchShape], Advice] | None = None

    def attach(self, module: nn.Module, *, precision: str, device: torch.device, strategy: Any = None) -> str | None:
        """The run's module, whose step dry runs answer exactly when asked (``exact=True``, outside the fit).

        Nothing is copied and nothing runs here: only a weak reference and the settings are kept.

        Args:
            module: the LightningModule (a weak reference is kept: a finished run holds no model).
            precision: the trainer's precision (``trainer.precision``).
            device: where the module trains.
            strategy: the trainer's strategy, whose kind decides whether a dry run stands for a rank.

        Returns:
            Why dry runs cannot answer for this run (the lines answer then), or None where they can.
        """
        self._step, self.forecast.exact, self._measured, self._search = None, None, None, None
        why = _unsupported(module, precision, device, strategy)
        if why is None:
            self._step = _StepSetup(weakref.ref(module), precision, _target(device))
        self._why = why
        return why

    @property
    def batch_sized(self) -> BatchSize:
        """The last batch sized (``(elements, bytes, samples)``; zeros before one was)."""
        return self._batch

    def set_budget(self, budget_bytes: int | None) -> None:
        """The run's budget (the argument, else the device's capacity); warnings start afresh.

        Args:
            budget_bytes: the memory the step may use, or None for no budget.
        """
        self.budget = None if budget_bytes is None else Budget(budget_bytes, self.margin)
        self._warned = set()

    def batch_start(self, batch: Any, batch_idx: int, measured: bool = True) -> None:
        """Size the batch; a batch larger than any seen gets its projected peak checked.

        Args:
            batch: what the dataloader gave.
            batch_idx: its index, named in the warning.
            measured: whether the memory source measures this step; without a budget, the size of a batch
                it does not measure is never read, and is not taken.
        """
        if self.measure_fixes:  # the step holds its batch anyway; the reference goes when the step ends
            self._current = batch
        if not measured and self.budget is None:
            return
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

    def step_end(self, report: StepReport, batch: Any = None) -> None:
        """Feed a measured step to the forecast and the leak detector, and warn once of a leak.

        Nothing runs but arithmetic on what the step recorded: where its timeline was recorded (the live-tensor
        tracker, with a budget), it becomes the forecast's answers for its batch shape (:class:`ScaledStep`), where
        its samples are at least as long as any before.

        Args:
            report: the step; one whose peak was not measured is ignored.
            batch: the step's (last) batch, given on logging steps: described without a torch operator (shapes and
                dtypes, integer tensors' values) for the exact answers asked after fit; None keeps the last.
        """
        try:
            self._step_end(report, batch)
        finally:
            self._current = None

    def advice(self) -> Advice | None:
        """The fixes for the failed step, measured by dry runs after the fit has failed; None where that failed.

        For the out-of-memory postmortem (``on_exception``): the batch under way (referenced with
        ``measure_fixes``) at the trainer's precision and accumulation, for the run's device, against the run's
        budget. A failure warns once, and every later call answers None without trying again: the postmortem then
        holds the estimates.

        Returns:
            The advice, or None.
        """
        return self.guard.run(MEASURED, self._measure_current)

    def _measure_current(self) -> Advice:
        batch = self._current
        if batch is None or not any(t.dim() for t in batch_tensors(batch)):
            raise ValueError("no batch of the step under way to dry-run")
        if self.budget is None:
            raise ValueError("there is no budget to measure the fixes against")
        return self._measure(BatchTemplate(batch), self.budget)

    def advise(self, budget_bytes: int | None = None) -> Advice:
        """The fixes for the last measured step, measured now by dry runs of the step under fake tensors.

        Args:
            budget_bytes: the budget in bytes; None uses the run's.

        Returns:
            The advice (``predict.advise.Advice``).

        Raises:
            RuntimeError: where no dry run can stand for the run's step (a sharded strategy, an unknown precision,
                no measured batch, the model freed) or the dry runs failed.
            ValueError: without a budget (none given and none for the run).
        """
        total = budget_bytes if budget_bytes is not None else (self.budget.total_bytes if self.budget else None)
        if total is None:
            raise ValueError("advise needs a budget: pass budget_bytes, or give the callback one")
        measured = self._measured
        if measured is None:
            raise RuntimeError("advise dry-runs the last measured batch, and no step has been measured yet")
        try:
            return self._measure(measured.template, Budget(total, self.margin))
        except RuntimeError:
            raise
        except Exception as error:
            raise RuntimeError(f"advise: the dry runs of the step failed ({type(error).__name__}: {error})") from error

    def _measure(self, template: BatchTemplate, budget: Budget) -> Advice:
        """The fixes for a step of ``template``'s batch, measured by dry runs of a meta copy of the module made now.

        At the trainer's precision and accumulation, for the run's device. It counts the step's own memory: what
        else the process holds (the data set, another model) is not in it.

        Raises:
            RuntimeError: saying why no dry run can stand for the run's step (a sharded strategy, the model freed).
        """
        setup = self._step
        if setup is None:
            raise RuntimeError(f"the step cannot be dry-run: {self._why}")
        module = setup.module()
        if module is None:
            raise RuntimeError("the model was freed, so its step cannot be run again")
        key = (budget.total_bytes, template.samples, template.shape)
        if self._advice is not None and self._advice[0] == key:  # measured already
            return self._advice[1]
        trainer = getattr(module, "_trainer", None)  # the Trainer's accumulation, where one is attached
        accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
        found = advise(
            meta_copy(module),
            template.make(template.samples),
            budget.total_bytes,
            margin=budget.margin,
            make_batch=template.make,
            precision=setup.precision,
            target=setup.target,
            accumulate_grad_batches=accumulate,
        )
        self._advice = (key, found)
        return found

    def can_advise(self) -> bool:
        """Whether :meth:`advice` may be tried: ``measure_fixes``, a model a dry run can stand for, and a budget."""
        return self.measure_fixes and self._step is not None and self.budget is not None

    def _step_end(self, report: StepReport, batch: Any) -> None:
        if report.peak_bytes is None:
            return
        elements, nbytes, samples = self._batch
        self.guard.run(FORECAST, self.forecast.observe, report, elements, nbytes, samples)
        self.guard.run(SCALED, self._scale, report)
        if batch is not None:
            self.guard.run(FORECAST, self._describe, report, batch)
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
        """The largest batch whose steady-state peak fits ``budget_bytes`` (else the run's budget) less the margin.

        Scaled from a measured step's timeline where one was recorded (:class:`ScaledStep`: nothing runs), else the
        forecast's lines. Exact answers by dry runs are :meth:`exact_max_batch_size`'s, asked for after fit.

        Args:
            budget_bytes: the budget in bytes; None uses the run's.
            elements_per_sample: input elements per sample; None uses the longest seen so far.

        Returns:
            The batch size, or None without a budget or before a step was measured.
        """
        total = budget_bytes if budget_bytes is not None else (self.budget.total_bytes if self.budget else None)
        if total is None or not self.forecast.ready:
            return None
        return self.forecast.max_batch_size(total, elements_per_sample, margin=self.margin)

    def logged_max_batch_size(self) -> int | None:
        """:meth:`max_batch_size` for the run's budget, for a logging step: None where it failed (it warns once)."""
        return self.guard.run(LARGEST, self.max_batch_size)

    def how_found(self) -> str:
        """How :meth:`max_batch_size` answers now, in words: scaled from a measured step, or the forecast's lines."""
        if isinstance(self.forecast.exact, ScaledStep):
            return HOW_SCALED
        return HOW_LINES

    def predict_peak_bytes(self, batch_size: int, elements_per_sample: float | None = None) -> int | None:
        """The steady-state step's peak at ``batch_size`` samples: scaled from a measured step, else the lines'.

        Args:
            batch_size: samples in the batch.
            elements_per_sample: input elements per sample; None uses the longest seen so far.

        Returns:
            The peak in bytes, or None before a step was measured.
        """
        if not self.forecast.ready:
            return None
        return self.forecast.predict_peak_bytes(batch_size, elements_per_sample)

    def _scale(self, report: StepReport) -> None:
        """The step's :class:`ScaledStep` becomes the forecast's answers, where its samples are the longest yet."""
        timeline = timeline_of(report)
        elements, _, samples = self._batch
        if timeline is None or not elements or samples < 1:
            return
        per_sample = elements / samples
        current = self.forecast.exact
        if isinstance(current, ScaledStep) and per_sample < current.elements_per_sample:
            return
        scaled = ScaledStep.from_step(report, timeline, samples, per_sample)
        if scaled is not None:
            self.forecast.exact = scaled

    def _describe(self, report: StepReport, batch: Any) -> None:
        """Describe ``batch`` (no torch operator) for the exact answers after fit, where it is the longest yet."""
        if not any(t.dim() for t in batch_tensors(batch)):  # a batch the forecast cannot size
            return
        shape = batch_shape(batch)
        known = self._measured
        if known is not None and known.shape != shape and known.shape.elements_per_sample > shape.elements_per_sample:
            return
        first = bool(first_step_shortfall(report))
        if known is not None and known.shape == shape and known.template.samples == shape.samples:
            template = known.template  # the same shape and size: the values need not be read again
        else:
            template = BatchTemplate(batch)
        self._measured = MeasuredBatch(template, report.peak_bytes or 0, first)
        if self._search is not None and self._search.shape != shape:
            self._search = None

    # -- exact answers, by dry runs: only when asked, outside the fit ---------------------------------------------

    def exact_max_batch_size(self, budget_bytes: int | None = None, elements_per_sample: float | None = None) -> int:
        """The largest batch whose steady-state peak fits the budget less the margin, by dry runs of the step now.

        The step (``training_step`` and ``configure_optimizers``) runs under fake tensors on a meta copy of the
        model made at the first call, two steps per size, for the last measured batch's shape; its peak at the
        measured size is calibrated against the measured step's (the difference is what the process holds besides
        the step). Each size's dry run and each budget's answer are kept.

        Args:
            budget_bytes: the budget in bytes; None uses the run's.
            elements_per_sample: must be None or the measured batch's: the dry runs resize that batch only.

        Returns:
            The batch size.

        Raises:
            ValueError: without a budget, or for another ``elements_per_sample``.
            RuntimeError: where no dry run can stand for the step, or it failed.
        """
        total = budget_bytes if budget_bytes is not None else (self.budget.total_bytes if self.budget else None)
        if total is None:
            raise ValueError("exact=True needs a budget: pass budget_bytes, or give the callback one")
        search = self._exact_search(elements_per_sample)
        limit = limit_bytes(total, self.margin)
        guess = self.forecast.max_batch_size(total, margin=self.margin) if self.forecast.ready else None
        return self._exact_call(search.largest, limit, guess)

    def exact_peak_bytes(self, batch_size: int) -> int:
        """The steady-state step's peak at ``batch_size`` samples, by a dry run of the step now (as above).

        Raises:
            RuntimeError: where no dry run can stand for the step, or it failed.
        """
        return self._exact_call(self._exact_search(None).peak_bytes, batch_size)

    def _exact_search(self, elements_per_sample: float | None) -> StepSearch:
        if self._step is None:
            raise RuntimeError(f"exact=True: the step cannot be dry-run: {self._why}")
        measured = self._measured
        if measured is None:
            raise RuntimeError("exact=True dry-runs the last measured batch, and no step has been measured yet")
        wanted = measured.shape.elements_per_sample
        if elements_per_sample is not None and not math.isclose(elements_per_sample, wanted):
            raise ValueError(
                f"elements_per_sample must be None or the measured batch's ({wanted:g}) with exact=True: the dry"
                f" runs resize that batch; got {elements_per_sample!r}"
            )
        if self._search is None:
            self._search = StepSearch(self._step, measured)
        return self._search

    def _exact_call(self, call: Callable[..., int], *args: Any) -> int:
        try:
            return call(*args)
        except Exception as error:
            if isinstance(error, (RuntimeError, ValueError)) and str(error).startswith("exact=True"):
                raise
            raise RuntimeError(
                f"exact=True: the dry run of the step failed ({type(error).__name__}: {error})"
            ) from error

    def _check(self, key: str, projected: int, what: str, fix: str, strict: bool = False) -> None:
        if self.budget is None or key in self._warned:
            return
        message = self.budget.over(projected, what, fix)
        if message is None:
            return
        self._warned.add(key)
        if strict:
            raise MemoryBudgetError(message)
        if self.measure_fixes:  # never a dry run inside the fit: the estimates, and how to get measured fixes
            largest = self.guard.run(LARGEST, self.max_batch_size)
            if largest is not None:
                message += f"; the largest batch that fits, {self.how_found()}: {largest:,} samples"
            message += f"\n  {ADVISE_HINT}"
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


# -- the exact largest batch: dry runs of the run's own step ---------------------------------------------------------


class _StepSetup:
    """What every dry run of the run's step shares: the module (weakly held), the precision and the target."""

    def __init__(self, module: weakref.ref[nn.Module], precision: str, target: str) -> None:
        self.module, self.precision, self.target = module, precision, target


def _unsupported(module: nn.Module, precision: str, device: torch.device, strategy: Any) -> str | None:
    """Why a dry run of ``module`` on the CPU cannot stand for a step of this run, or None where it can."""
    if str(precision) not in PRECISIONS:
        return f"precision {precision!r} is not one a dry run knows"
    if device.type not in ("cpu", "cuda"):
        return f"a dry run predicts for the CPU and CUDA, not {device.type}"
    name = type(strategy).__name__.lower() if strategy is not None else ""
    if "deepspeed" in name or "fsdp" in name or any(is_dtensor(p) for p in module.parameters()):
        return "the parameters are sharded, which a single-process dry run does not model"
    return None


def _target(device: torch.device) -> str:
    """The dry run's target for ``device``: ``"cpu"``, or the CUDA device's compute capability."""
    if device.type != "cuda":
        return "cpu"
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except Exception:  # no capability to read: the default GPU (an A100)
        return "cuda"
    try:
        resolve_target(f"{major}.{minor}")
    except ValueError:  # a capability the model does not know: the default GPU
        return "cuda"
    return f"{major}.{minor}"


class BatchShape:
    """A batch's shape as far as its size goes: each tensor's shape past the batch dimension, and its dtype.

    Args:
        samples: the batch's samples (the leading size of its first tensor with a dimension).
        tensors: per tensor, whether it has the batch dimension, its shape without it (else all of it), its dtype.
        elements_per_sample: the batch's input elements per sample.
    """

    def __init__(self, samples: int, tensors: tuple[tuple[bool, tuple[int, ...], torch.dtype], ...], elements: int):
        self.samples, self.tensors = samples, tensors
        self.elements_per_sample = elements / max(samples, 1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchShape) and self.tensors == other.tensors

    def __hash__(self) -> int:
        return hash(self.tensors)


def batch_shape(batch: Any) -> BatchShape:
    """The shape of ``batch`` that its size leaves alone (see :class:`BatchShape`).

    Raises:
        ValueError: if the batch holds no tensor with a dimension.
    """
    tensors = batch_tensors(batch)
    first = next((t for t in tensors if t.dim()), None)
    if first is None:
        raise ValueError("the batch holds no tensor with a batch dimension")
    samples = int(first.shape[0])
    parts = []
    for t in tensors:
        rows = t.dim() > 0 and int(t.shape[0]) == samples
        parts.append((rows, tuple(t.shape[1:] if rows else t.shape), t.dtype))
    return BatchShape(samples, tuple(parts), sum(t.numel() for t in tensors))


class _Slot:
    """One tensor of a :class:`BatchTemplate`: its shape and dtype, and for integers and booleans its values."""

    def __init__(self, tensor: Tensor, samples: int) -> None:
        self.rows = tensor.dim() > 0 and int(tensor.shape[0]) == samples
        self.shape, self.dtype, self.samples = tuple(tensor.shape), tensor.dtype, samples
        self.values: np.ndarray | None = None
        if tensor.device.type == "cpu" and not (tensor.is_floating_point() or tensor.is_complex()):
            try:  # through DLPack, which dispatches no torch operator (``.numpy()`` and ``.detach()`` do: a user's
                # dispatch mode would see them); a host copy outside torch, not counted as a tensor in later steps
                self.values = np.from_dlpack(tensor).copy()
            except (TypeError, RuntimeError, BufferError, ValueError):  # a dtype numpy lacks: no values
                self.values = None

    def build(self, size: int) -> Tensor:
        """The tensor for a batch of ``size`` samples: its rows repeated (values), else a meta stand-in (shape)."""
        shape = (size, *self.shape[1:]) if self.rows else self.shape
        elements = 1
        for dim in shape:
            elements *= dim
        if self.values is None or elements > KNOWN_ELEMENTS:  # a dry run keeps no values past that size anyway
            return torch.empty(shape, dtype=self.dtype, device="meta")
        values = torch.from_numpy(self.values)
        if not self.rows:
            return values.clone()
        return values[torch.arange(size) % self.samples]


class BatchTemplate:
    """The measured batch at any batch size, as a dry run takes it; made without a torch operator.

    Floating tensors become meta stand-ins (shape and dtype: a dry run needs no more); integer and boolean
    CPU tensors keep their values (read through DLPack, no operator) and repeat their rows, so that token ids and
    attention masks stay real and the step takes the path it takes in training; on another device they are
    stand-ins too. Tensors without the batch dimension stay as they are.

    Args:
        batch: the measured batch, any nesting of tensors.

    Attributes:
        shape: the batch's :class:`BatchShape`.
        samples: the measured batch's samples.
    """

    def __init__(self, batch: Any) -> None:
        self.shape = batch_shape(batch)
        self.samples = self.shape.samples
        self._batch = apply_to_collection(batch, Tensor, lambda t: _Slot(t, self.samples))

    def make(self, size: int) -> Any:
        """The batch at ``size`` samples, for ``predict.dryrun``."""
        return apply_to_collection(self._batch, _Slot, lambda slot: slot.build(size))


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device: every parameter, buffer and tensor attribute a stand-in of its shape.

    A dry run copies what it is given; copying the training module itself would copy for real the tensors it
    holds besides its parameters (a data set kept as an attribute, say), and on a GPU keep its device. The copy
    is ``predict.fake.copy_module``'s, as a dry run's fake copy is: containers are copied, every other object (a
    numpy table, a Dataset) is shared, not copied. The Trainer and Fabric attached are left out, and a
    LightningModule's ``device`` is the CPU, where the dry run's fake tensors are.

    Args:
        module: the module.

    Returns:
        The copy, which holds no memory.
    """

    def meta(tensor: Tensor) -> Tensor:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")

    copied = copy_module(module, meta)  # containers copied, tensors on meta, every other object shared
    for sub in copied.modules():  # a LightningModule's ``device``: where a dry run's fakes live, as they are made
        if isinstance(sub.__dict__.get("_device"), torch.device):
            sub.__dict__["_device"] = torch.device("cpu")
    return copied


class MeasuredBatch:
    """The last measured batch, described for the exact answers after fit: its template and the measured step.

    Args:
        template: the batch (see :class:`BatchTemplate`).
        peak_bytes: the measured step's peak.
        first: whether the step was a first optimizer step (its dry run's first step is the one to compare).

    Attributes:
        shape: the batch's shape.
    """

    def __init__(self, template: BatchTemplate, peak_bytes: int, first: bool) -> None:
        self.template, self.peak_bytes, self.first = template, peak_bytes, first
        self.shape = template.shape


class StepSearch:
    """Exact answers for one batch shape: dry runs of the run's own step, calibrated by a measured step.

    Made only where exact answers are asked for (``exact=True``), outside the fit. A dry run (``predict.dryrun``)
    runs the LightningModule's own ``training_step`` and ``configure_optimizers`` under fake tensors, two steps, so
    that the steady state is what must fit: the first step holds no optimizer state in its forward and backward,
    and no previous gradients in its forward. What the process holds besides the step (the data set on the CPU,
    Lightning's constants, another model on the GPU) is the measured step's peak less the dry run's peak at the
    measured size; it is taken off the budget. The model is copied when this is made, on the meta device
    (``meta_copy``); each size's dry run and each budget's answer are kept.

    Args:
        setup: the module (weakly held), precision and target.
        measured: the measured batch and step.

    Raises:
        RuntimeError: if the model was freed.

    Attributes:
        shape: the measured batch's shape, the one the answers are for.
        elements_per_sample: its input elements per sample.
    """

    def __init__(self, setup: _StepSetup, measured: MeasuredBatch) -> None:
        self.shape = measured.shape
        self.elements_per_sample = self.shape.elements_per_sample
        self._setup = setup
        module = setup.module()
        if module is None:
            raise RuntimeError("exact=True: the model was freed, so its step cannot be run again")
        self._template = measured.template
        self._model = meta_copy(module)
        self._measured = measured.peak_bytes
        self._first = measured.first
        self._exact: Any = None
        self._other = 0
        self._largest: dict[int, int] = {}

    @property
    def other_bytes(self) -> int | None:
        """What the process held besides the step at the measured size (None before the first answer)."""
        return None if self._exact is None else self._other

    def peak_bytes(self, batch_size: int) -> int:
        """The steady-state step's peak at ``batch_size`` samples, with what the process holds besides it."""
        return self._peaks().peak_bytes(batch_size) + self._other

    def largest(self, limit_bytes: int, guess: int | None) -> int:
        """The largest batch whose steady-state peak, with what the process holds besides it, fits ``limit_bytes``."""
        if limit_bytes not in self._largest:
            peaks = self._peaks()
            self._largest[limit_bytes] = peaks.largest(limit_bytes - self._other, guess)
        return self._largest[limit_bytes]

    def _peaks(self) -> Any:
        """The dry runs' exact answers (``sweep``'s), calibrated at the measured size on first use."""
        if self._exact is None:
            size = self.shape.samples
            forecast, (prediction,) = sweep(
                self._model,
                self._template.make,
                (size,),
                steps=2,
                precision=self._setup.precision,
                target=self._setup.target,
            )
            dry = prediction.reports[0 if self._first else -1].peak_bytes
            self._other = (self._measured or 0) - (dry or 0)
            self._exact = forecast.exact
        return self._exact

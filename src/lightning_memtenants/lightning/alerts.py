"""Warnings before an OOM: projections of the step's peak against the budget, the forecast, and leaks.

And the one answer to "what is the largest batch": dry runs of the run's own step (``predict.dryrun``),
calibrated by a measured step, where they can run (:class:`StepSearch`); the forecast's lines elsewhere.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_memtenants.analysis.budget import Budget, MemoryBudgetError
from lightning_memtenants.analysis.engines import is_dtensor
from lightning_memtenants.analysis.fixes import first_step_jump_bytes
from lightning_memtenants.analysis.forecast import PeakForecast, first_step_shortfall
from lightning_memtenants.analysis.leaks import LeakDetector
from lightning_memtenants.checks import brief
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.storage import batch_tensors, tensors_in
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.predict.advise import Advice, advise
from lightning_memtenants.predict.cuda_model import resolve_target
from lightning_memtenants.predict.dryrun import sweep
from lightning_memtenants.predict.fake import PRECISIONS
from lightning_memtenants.predict.values import KNOWN_ELEMENTS
from lightning_memtenants.units import MiB, mib

# The parts this component runs under its guard; each is disabled on its own.
FORECAST, LEAKS = "the forecast", "leak detection"
EXACT = "the exact largest batch (dry runs of the step)"
LARGEST = "the largest batch"
MEASURED = "the fixes by dry runs of the step"
# (elements, bytes, samples) of a batch: the forecast's measure of its size
BatchSize = tuple[int, int, int]


class Alerts:
    """Projects each step's peak from what has been measured and warns, once per kind, before it passes the budget.

    Args:
        budget_bytes: the memory the step may use, or None (no projections, no warnings; the forecast still learns).
        margin: the fraction of a budget kept free for allocator rounding.
        strict: raise :class:`MemoryBudgetError` where the first optimizer step is projected not to fit.
        warn: how a warning is given (rank zero's).
        measure_fixes: at the first warning, measure the fixes for the run's step by dry runs
            (``predict.advise``) and warn with them once the step is over (the tracker paused); the batch under
            way is referenced until its step ends, for that and for the postmortem.

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
        self._advise = "none"  # "none", "pending" (at the next step end), "done"
        self._advice: tuple[tuple[int, BatchShape], Advice] | None = None  # the last advice, by batch size and shape

    def attach(self, module: nn.Module, *, precision: str, device: torch.device, strategy: Any = None) -> str | None:
        """The run's module, whose step dry runs answer the largest batch exactly; None detaches it.

        Args:
            module: the LightningModule (a weak reference is kept: a finished run holds no model).
            precision: the trainer's precision (``trainer.precision``).
            device: where the module trains.
            strategy: the trainer's strategy, whose kind decides whether a dry run stands for a rank.

        Returns:
            Why dry runs cannot answer for this run (the lines answer then), or None where they can.
        """
        self._step, self.forecast.exact = None, None
        why = _unsupported(module, precision, device, strategy)
        if why is None:
            self._step = _StepSetup(weakref.ref(module), precision, _target(device))
        self._why, self._advise = why, "none"
        return why

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

        Args:
            report: the step; one whose peak was not measured is ignored.
            batch: the step's (last) batch, given on logging steps: a batch of a new shape, with samples at
                least as long as any before, becomes the shape the exact answers are for (calibrated by this
                step); None keeps the shape.
        """
        try:
            if self._advise == "pending":  # the step is over and the tracker paused: dry runs may run now
                self._advise = "done"
                self._warn_measured()
            self._step_end(report, batch)
        finally:
            self._current = None

    def advice(self) -> Advice | None:
        """The fixes for the run's step, measured by dry runs (:meth:`_measure`); None where that failed.

        A failure warns once, and every later call answers None without trying again: the postmortem then holds
        the estimates.

        Returns:
            The advice, or None.
        """
        return self.guard.run(MEASURED, self._measure)

    def _measure(self) -> Advice:
        """The fixes for the run's step, measured by dry runs of a copy of the module on the meta device.

        The step is the batch under way (referenced with ``measure_fixes``) at the trainer's precision and
        accumulation, for the run's device; the budget is the run's. It counts the step's own memory: what else the
        process holds (the data set, another model) is not in it.

        Returns:
            The advice.

        Raises:
            ValueError: saying why no dry run can stand for the run's step (a sharded strategy, no budget, no batch).
        """
        setup, batch, budget = self._step, self._current, self.budget
        if setup is None:
            raise ValueError(f"the step cannot be dry-run: {self._why}")
        if budget is None:
            raise ValueError("there is no budget to measure the fixes against")
        if batch is None or not any(t.dim() for t in batch_tensors(batch)):
            raise ValueError("no batch of the step under way to dry-run")
        module = setup.module()
        if module is None:
            raise ValueError("the model was freed, so its step cannot be run again")
        template = BatchTemplate(batch)
        key = (template.samples, template.shape)
        if self._advice is not None and self._advice[0] == key:  # measured at the warning already
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

    def _warn_measured(self) -> None:
        advice = self.advice()
        if advice is None:
            return
        lines = [
            f"memtenants: the fixes for the warning above, measured by dry runs of this step (two steps each, the peak"
            f" against {mib(advice.limit_bytes)} MiB, the budget less the margin):"
        ]
        for fix in advice.fixes[:6]:
            verdict = "fits" if fix.fits else "does not fit"
            lines.append(f"  {fix.name}: peak {mib(fix.peak_bytes)} MiB, {verdict}; {fix.how}")
        self._warn("\n".join(lines))

    def _step_end(self, report: StepReport, batch: Any) -> None:
        if report.peak_bytes is None:
            return
        elements, nbytes, samples = self._batch
        self.guard.run(FORECAST, self.forecast.observe, report, elements, nbytes, samples)
        if batch is not None and self._step is not None:
            self.guard.run(EXACT, self._new_shape, report, batch)
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

        Exact by dry runs of the step where they can run (once per budget and batch shape; a failure warns once
        and the forecast's lines answer from then on), else the lines'.

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
        """How :meth:`max_batch_size` answers now, in words."""
        if isinstance(self.forecast.exact, StepSearch):
            return "exact, by dry runs of the step"
        return "from the forecast's lines"

    def predict_peak_bytes(self, batch_size: int, elements_per_sample: float | None = None) -> int | None:
        """The steady-state step's peak at ``batch_size`` samples: exact where dry runs can run, else the lines'.

        Args:
            batch_size: samples in the batch.
            elements_per_sample: input elements per sample; None uses the longest seen so far.

        Returns:
            The peak in bytes, or None before a step was measured.
        """
        if not self.forecast.ready:
            return None
        return self.forecast.predict_peak_bytes(batch_size, elements_per_sample)

    def _new_shape(self, report: StepReport, batch: Any) -> None:
        """A step search for ``batch``'s shape, where it is new and its samples are the longest yet."""
        setup = self._step
        if setup is None or not any(t.dim() for t in batch_tensors(batch)):  # a batch the forecast cannot size
            return
        shape = batch_shape(batch)
        current = self.forecast.exact
        if isinstance(current, StepSearch) and (
            current.shape == shape or current.elements_per_sample > shape.elements_per_sample
        ):
            return
        self.forecast.exact = StepSearch(setup, batch, report, self.forecast, self._exact_failed)

    def _exact_failed(self, error: BaseException) -> None:
        self._step, self.forecast.exact = None, None
        self.guard.disable(EXACT, error)

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
        if self._advise == "none" and self.can_advise():
            self._advise = "pending"

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
        self.values = None
        if not (tensor.is_meta or tensor.is_floating_point() or tensor.is_complex()):
            try:  # a host copy outside torch: a CPU tensor kept here would count in every later step's "other"
                self.values = tensor.detach().cpu().numpy().copy()
            except (TypeError, RuntimeError):  # a dtype numpy lacks: a stand-in without values
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
    """The measured batch at any batch size, as a dry run takes it.

    Floating tensors become meta stand-ins (shape and dtype: a dry run needs no more); integer and boolean
    tensors keep their values and repeat their rows, so that token ids and attention masks stay real and the
    step takes the path it takes in training. Tensors without the batch dimension stay as they are.

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
    holds besides its parameters (a data set kept as an attribute, say), and on a GPU keep its device. The
    Trainer and Fabric attached are left out, as ``predict.fake.fake_module`` leaves them out, and a
    LightningModule's ``device`` is the CPU, where the dry run's fake tensors are.

    Args:
        module: the module.

    Returns:
        The copy, which holds no memory.
    """
    memo: dict[int, Any] = {}

    def meta(tensor: Tensor) -> Tensor:
        plain = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        return nn.Parameter(plain, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else plain

    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in memo:
            memo[id(tensor)] = meta(tensor)
    for sub in module.modules():
        for name in ("_trainer", "_fabric"):
            attached = sub.__dict__.get(name)
            if attached is not None:
                memo[id(attached)] = None
        for value in list(sub.__dict__.values()):
            if not isinstance(value, nn.Module):
                for tensor in tensors_in(value):
                    if id(tensor) not in memo:
                        memo[id(tensor)] = meta(tensor)
    copied = copy.deepcopy(module, memo)
    for sub in copied.modules():  # a LightningModule's ``device``: where a dry run's fakes live, as they are made
        if isinstance(sub.__dict__.get("_device"), torch.device):
            sub.__dict__["_device"] = torch.device("cpu")
    return copied


class StepSearch:
    """Exact answers for one batch shape: dry runs of the run's own step, calibrated by a measured step.

    A dry run (``predict.dryrun``) runs the LightningModule's own ``training_step`` and ``configure_optimizers``
    under fake tensors, two steps, so that the steady state is what must fit: the first step holds no optimizer
    state in its forward and backward, and no previous gradients in its forward. What the process holds besides
    the step (the data set on the CPU, Lightning's constants, another model on the GPU) is the measured step's
    peak less the dry run's peak at the measured size; it is taken off the budget. The model is copied at once, on
    the meta device (no memory), so that an answer asked after fit needs nothing of the run; no dry run runs until
    an answer is asked for, and each size's dry run and each budget's answer are kept.

    The forecast's lines answer where this fails (it warns once, through ``failed``).

    Args:
        setup: the module, precision and target.
        batch: the measured batch (a resizable template of it is kept, see :class:`BatchTemplate`).
        report: the measured step, whose peak calibrates.
        forecast: the forecast whose lines answer after a failure.
        failed: called with the error where a dry run fails; it detaches this search.

    Attributes:
        shape: the measured batch's shape, the one the answers are for.
        elements_per_sample: its input elements per sample.
    """

    def __init__(
        self,
        setup: _StepSetup,
        batch: Any,
        report: StepReport,
        forecast: PeakForecast,
        failed: Callable[[BaseException], Any],
    ) -> None:
        self.shape = batch_shape(batch)
        self.elements_per_sample = self.shape.elements_per_sample
        self._setup, self._forecast, self._failed = setup, forecast, failed
        self._error: Exception | None = None  # what made the copies impossible, raised when an answer is asked for
        try:  # now, while training holds the model and the batch: an answer asked after fit needs neither
            module = setup.module()
            if module is None:
                raise RuntimeError("the model was freed, so its step cannot be run again")
            self._template = BatchTemplate(batch)
            self._model = meta_copy(module)
        except Exception as error:
            self._error = error
        self._measured = report.peak_bytes
        self._first = bool(first_step_shortfall(report))
        self._exact: Any = None
        self._other = 0
        self._largest: dict[int, int] = {}

    @property
    def other_bytes(self) -> int | None:
        """What the process held besides the step at the measured size (None before the first answer)."""
        return None if self._exact is None else self._other

    def peak_bytes(self, batch_size: int) -> int:
        """The steady-state step's peak at ``batch_size`` samples, with what the process holds besides it."""
        try:
            return self._peaks().peak_bytes(batch_size) + self._other
        except Exception as error:  # the user's step under fake tensors: the lines answer from now on
            self._failed(error)
            return self._forecast.predict_peak_bytes(batch_size) or 0

    def largest(self, limit_bytes: int, guess: int | None) -> int:
        """The largest batch whose steady-state peak, with what the process holds besides it, fits ``limit_bytes``."""
        if limit_bytes not in self._largest:
            try:
                self._largest[limit_bytes] = self._peaks().largest(limit_bytes - self._other, guess)
            except Exception as error:  # the lines answer from now on
                self._failed(error)
                return guess if guess is not None else 0
        return self._largest[limit_bytes]

    def _peaks(self) -> Any:
        """The dry runs' exact answers (``sweep``'s), calibrated at the measured size on first use."""
        if self._exact is None:
            if self._error is not None:
                raise self._error
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

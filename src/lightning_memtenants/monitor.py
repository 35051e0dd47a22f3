"""The core that the callback wires to Lightning, usable from a hand-written training loop."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants.census import (
    TENANTS,
    ActivationTracker,
    TenantCounter,
    batch_tensors,
    optimizer_state_tensors,
)
from lightning_memtenants.formulas import (
    expected_fixed_cost,
    explain_fixed_cost,
    fsdp_gathered_bytes,
    local_optimizer,
    optimizer_implementation,
    step_temporaries_bytes,
)
from lightning_memtenants.report import PHASES, PhaseReport, StepReport, explain_peak
from lightning_memtenants.sources import MemorySource, Reading, source_for

COMPILED_REASON = (
    "the model runs torch.compile'd code, whose kernels allocate outside PyTorch's dispatcher where the"
    " live-tensor tracker cannot see them, so the tracker does not measure the rest of this run (the tenants"
    " stay exact, counted from the tensors; on CUDA the allocator's counters see compiled code)"
)


class TenantMonitor:
    """Measures the four tenants and the memory source at named phases; builds a :class:`StepReport`.

    The activations are read at ``before_backward`` from the graph of the output handed to
    that phase (the loss): what its nodes saved for backward, with no hook installed. The
    input batch is not counted as activations: it is resident whether or not autograd saves it.

    ``source`` is ``"auto"`` (allocator counters on accelerators, the live-tensor tracker on
    CPU), a :class:`MemorySource`, or ``None`` for tenants only. Set ``measure = False``
    before a step's ``batch_start`` to skip a costly source for that step.

    Args:
        module: the model whose tenants are counted.
        optimizers: its optimizers, whose state is the optimizer-state tenant.
        track_activations: read the activations from the loss's graph.
        source: the memory source for totals and peaks (see above).
        device: the device trained on, for ``"auto"`` and for telling offloaded saved tensors
            apart; ``None`` reads it from the module's first parameter or buffer, else the CPU.
        warn: how a failed measurement is reported (once per part).

    Raises:
        ValueError: if ``source`` is none of the above, or ``device`` names no device.

    Example::

        monitor = TenantMonitor(model, [optimizer])
        for x, y in loader:
            monitor.phase("batch_start", batch=(x, y))
            loss = F.mse_loss(model(x), y)
            monitor.phase("before_backward", output=loss)
            loss.backward()
            monitor.phase("after_backward")
            monitor.phase("before_optimizer_step")
            optimizer.step()
            monitor.phase("batch_end")
            report = monitor.end_step()
            optimizer.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer] = (),
        *,
        track_activations: bool = True,
        source: MemorySource | str | None = "auto",
        device: torch.device | str | None = None,
        warn: Callable[[str], Any] = warnings.warn,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        if device is None:
            first = next(chain(module.parameters(), module.buffers()), None)
            device = first.device if first is not None else torch.device("cpu")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be None, a torch.device or a name like 'cuda:0', got {device!r}") from None
        self.tracker = ActivationTracker(self.device.type)
        if isinstance(source, str) and source == "auto":
            source = source_for(self.device)
        elif source is None:
            source = MemorySource()
        elif not isinstance(source, MemorySource):
            raise ValueError(f"source must be 'auto', None or a MemorySource, got {source!r}")
        self.source: MemorySource = source
        self.measure = True
        self.disabled: set[str] = set() if track_activations else {"activations"}
        self._warn = warn
        self._micro: list[dict[str, PhaseReport]] = []
        self.counter = TenantCounter(module, self.optimizers)
        self.tracker.params = frozenset(id(t) for t in self.counter.tensors)
        # named parts outside the tenants (report.PARTS): each a function returning its bytes now
        self.parts: dict[str, Callable[[], int]] = {}
        # sentences about this run that every step's report carries (the precision, say)
        self.notes: list[str] = []
        # why the memory source does not measure this run, where it cannot (compiled code on CPU)
        self.unmeasured_reason: str | None = None
        if not self.source.sees_compiled_code and holds_compiled_code(module):
            self.unmeasured_reason = COMPILED_REASON
            warn(f"memtenants: {COMPILED_REASON}")
        self._step_notes: list[str] = []
        self._state_bytes: int | None = None
        self._state_signature: tuple[int, ...] = ()
        self._fixed: tuple[tuple[int, ...], tuple[int, list[str]]] | None = None
        self._measuring = False
        self._last: PhaseReport | None = None
        self.steps_done = 0

    @property
    def measuring(self) -> bool:
        """Whether the memory source measures the step under way."""
        return self._measuring

    def last_phase(self) -> PhaseReport | None:
        """The most recent phase measured, in this step or the one before."""
        return self._last

    def phase(self, name: str, batch: Any = None, output: Any = None) -> PhaseReport | None:
        """Take the census at phase ``name``.

        Args:
            name: one of ``PHASES``; ``batch_start`` opens a new micro-batch.
            batch: at ``batch_start``, the input batch, which is not counted as activations.
            output: at ``before_backward``, the loss (or any output) whose graph holds what the
                forward saved for backward; without it the activations are not measured.

        Returns:
            The phase's report, or ``None`` where the census is disabled.

        Raises:
            ValueError: if ``name`` is not a phase.
        """
        if not isinstance(name, str) or name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        if name == "batch_start":
            self.tracker.clear()
            if not self._micro:
                self._begin_step(batch)
            self._micro.append({})
            if batch is not None:
                self.guard("activations", self.tracker.ignore, batch_tensors(batch))
        elif not self._micro:
            self._micro.append({})
        if name == "before_backward" and "activations" not in self.disabled:
            if output is None:
                self._step_note(
                    "activations not measured: phase('before_backward') was given no output whose graph to read"
                )
            else:
                self.observe_output(output)
        reading = Reading()
        if self._measuring:
            reading = self.guard("memory source", self.source.read) or Reading()
        report = None
        if "census" not in self.disabled:
            if name == "batch_start" and (self.measure or self.steps_done == 0):
                # the module's parameters are re-read on measured steps; a walk of the module
                # tree at every step would cost more than the rest of the census
                self.guard("census", self.counter.refresh)
                self.tracker.params = frozenset(id(t) for t in self.counter.tensors)
            # Optimizer state appears only inside optimizer.step() and is then updated in place,
            # so it is recounted when an optimizer's state gains entries, and on measured steps.
            signature = tuple(len(local_optimizer(optimizer).state) for optimizer in self.optimizers)
            recount = self._state_bytes is None or signature != self._state_signature
            recount = recount or (self.measure and name in ("batch_start", "batch_end"))
            tracker = None if "activations" in self.disabled else self.tracker
            state = None if recount else self._state_bytes
            tenants = self.guard("census", self.counter.count, tracker, state)
            if tenants is not None:
                self._state_bytes = tenants["optimizer_state"]
                self._state_signature = signature
                report = PhaseReport(name, tenants, *_fields(reading), parts_bytes=self._parts())
                self._micro[-1][name] = report
                self._last = report
        return report

    def observe_output(self, output: Any) -> None:
        """Read what the graph of ``output`` saved for backward into the activations tenant.

        ``phase("before_backward", output=loss)`` calls it; call it yourself for a second output
        whose graph is separate (an auxiliary loss backwarded on its own). Nothing is unpacked,
        so nothing is recomputed and the user's saved-tensor hooks are not called.
        """
        if "activations" in self.disabled:
            return
        self.tracker.observe(output)  # never raises: a failure is kept in ``error``
        if self.tracker.error is not None:
            self._disable("activations", self.tracker.error)
            return
        if self.tracker.compiled and not self.source.sees_compiled_code and self.unmeasured_reason is None:
            self.unmeasured_reason = COMPILED_REASON
            self._warn(f"memtenants: {COMPILED_REASON}")
            self._stop_source()
        if self._measuring:
            self.guard("memory source", self.source.adopt, self.tracker.storages())

    def observe_failure(self, error: BaseException) -> None:
        """Read the graphs still held by the frames of ``error``'s traceback (an OOM inside the forward).

        Before ``before_backward`` there is no loss to read; the frames from the training step down to
        the operator that failed hold the forward's intermediate tensors, and their graphs hold what was
        saved so far. Only a postmortem does this.
        """
        outputs: list[Any] = []
        tb = error.__traceback__
        while tb is not None:
            outputs.extend(tb.tb_frame.f_locals.values())
            tb = tb.tb_next
        self.observe_output(outputs)

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches begun since the last ``end_step``."""
        return len(self._micro)

    def abandon_step(self) -> None:
        """Drop a step that will never end (a batch Lightning skipped); its measurement stops here."""
        self._micro = []
        self._step_notes = []
        self.tracker.clear()
        self.tracker.reset_counts()
        if self._measuring and not self.source.every_step:
            self.guard("memory source", self.source.pause)
        self._measuring = False

    def _parts(self) -> dict[str, int]:
        parts = {}
        if "activations" not in self.disabled:
            casts = self.tracker.cast_bytes()
            if casts:
                parts["autocast_cache"] = casts
        for name, read in self.parts.items():
            value = self.guard(name, read)
            if value is not None:
                parts[name] = value
        return parts

    def end_step(self, step: int | None = None) -> StepReport | None:
        """Close the optimizer step that the phases since the last call belong to.

        Args:
            step: the number the report carries (the trainer's global step); ``None`` counts the
                steps this monitor has closed.

        Returns:
            The step's report, or ``None`` where no phase was measured.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be None or a step number (an int, 0 or more), got {step!r}")
        micro, self._micro = self._micro, []
        self.tracker.clear()
        if self._measuring and not self.source.every_step:
            self.guard("memory source", self.source.pause)
        self._measuring = False
        number = self.steps_done if step is None else step
        self.steps_done += 1
        step_notes = list(self.notes) + self._graph_notes() + self._step_notes
        self._step_notes = []
        phases: dict[str, PhaseReport] = {}
        for batch_phases in micro:
            phases.update(batch_phases)
        if not phases:
            return None
        if self.unmeasured_reason is not None:  # readings taken before we knew cannot be trusted either
            micro = [{name: _unmeasured(p) for name, p in mb.items()} for mb in micro]
            phases = {name: _unmeasured(p) for name, p in phases.items()}
        high = {t: max(p.tenants_bytes[t] for mb in micro for p in mb.values()) for t in TENANTS}
        last = phases.get("batch_end") or list(phases.values())[-1]
        measured = last.tenants_bytes
        expected = 0
        notes: list[str] = []
        if "fixed_cost" not in self.disabled:
            checked = self.guard("fixed_cost", self._check_fixed, measured)
            if checked is not None:
                expected, notes = checked
        peak, peak_phase = _step_peak(micro)
        explanation = self.guard("peak explanation", self._explain_peak, phases, peak_phase, peak)
        if peak is None and self.unmeasured_reason is not None:
            explanation = f"peak not measured: {self.unmeasured_reason}"
        return StepReport(
            step=number,
            phases=phases,
            micro_batches=micro,
            tenants_bytes=high,
            expected_fixed_bytes=expected,
            measured_fixed_bytes=measured["weights"] + measured["gradients"] + measured["optimizer_state"],
            fixed_cost_notes=notes,
            peak_bytes=peak,
            peak_phase=peak_phase,
            peak_explanation=explanation or "peak not measured",
            memory_source=self.source.status if peak is not None else "not measured",
            notes=step_notes,
        )

    def close(self) -> None:
        """Remove every hook and mode this monitor registered; safe to call more than once."""
        self.tracker.clear()
        self._micro = []
        self._step_notes = []
        self.tracker.reset_counts()
        self._state_bytes = None
        self._measuring = False
        self.guard("memory source", self.source.stop)

    def guard(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn``; if it raises, warn once, disable ``part`` and return None."""
        if part in self.disabled:
            return None
        try:
            return fn(*args)
        except Exception as error:  # a failed measurement must never fail training
            self._disable(part, error)
            return None

    def _begin_step(self, batch: Any) -> None:
        self._measuring = (
            "memory source" not in self.disabled
            and self.unmeasured_reason is None
            and (self.measure or self.source.every_step)
        )
        if self._measuring:
            self.guard("memory source", self.source.start, self._roots(batch))
            self._measuring = "memory source" not in self.disabled

    def _stop_source(self) -> None:
        """Stop the memory source for good, without calling it a failure (``unmeasured_reason`` says why)."""
        self._measuring = False
        with contextlib.suppress(Exception):
            self.source.stop()

    def _step_note(self, note: str) -> None:
        if note not in self._step_notes:
            self._step_notes.append(note)

    def _graph_notes(self) -> list[str]:
        """What the graph walks of the step found beside the tenants; the counts start again from here."""
        tracker = self.tracker
        notes = []
        if tracker.checkpointed:
            notes.append(
                f"activation checkpointing: {tracker.checkpointed} checkpointed region(s) keep only their inputs for"
                " backward and recompute the rest, so the activations tenant is smaller than the forward's"
            )
        if tracker.hooked:
            text = (
                f"saved-tensor hooks: your saved_tensors_hooks packed {tracker.hooked} saved tensor(s); the"
                " activations tenant counts what the hook keeps (its packed tensors), read without unpacking"
            )
            if tracker.offloaded_bytes:
                text += (
                    f"; {tracker.offloaded_bytes:,} bytes of them were moved off the {self.device.type} device (an"
                    " offload such as save_on_cpu) and are not in the tenant"
                )
            if tracker.opaque:
                text += (
                    f"; {tracker.opaque} were packed into objects that hold no tensor, whose bytes cannot be"
                    " counted and are not in the tenant"
                )
            notes.append(text)
        tracker.reset_counts()
        return notes

    def _roots(self, batch: Any) -> Iterator[Tensor]:
        params = list(self.module.parameters())
        yield from params
        yield from self.module.buffers()
        yield from (p.grad for p in params if p.grad is not None)
        yield from optimizer_state_tensors(self.optimizers)
        if batch is not None:
            yield from batch_tensors(batch)

    def _check_fixed(self, measured: dict[str, int]) -> tuple[int, list[str]]:
        """The formula and its sentences; recomputed on measured steps or when the census changes."""
        key = (measured["weights"], measured["gradients"], measured["optimizer_state"])
        if self._fixed is not None and self._fixed[0] == key and not self.measure:
            return self._fixed[1][0], list(self._fixed[1][1])
        expected = expected_fixed_cost(self.module, self.optimizers)
        result = (expected.total_bytes, explain_fixed_cost(expected, measured, self.module, self.optimizers))
        self._fixed = (key, result)
        return result[0], list(result[1])

    def _explain_peak(self, phases: dict[str, PhaseReport], peak_phase: str | None, peak: int | None) -> str:
        if peak is None:  # an unmeasured step: nothing to explain, and the per-optimizer work is skipped
            return explain_peak(phases, None, None, largest_parameter_bytes=0, optimizer="")
        sizes = [t.numel() * t.element_size() for t in self.counter.tensors if t.requires_grad]
        return explain_peak(
            phases,
            peak_phase,
            peak,
            largest_parameter_bytes=max(sizes, default=0),
            optimizer=describe_optimizers(self.optimizers),
            expected_temporaries_bytes=sum(step_temporaries_bytes(o) for o in self.optimizers),
            gathered_bytes=fsdp_gathered_bytes(self.module),
        )

    def _disable(self, part: str, error: BaseException) -> None:
        self.disabled.add(part)
        if part == "activations":
            self.tracker.clear()
        if part == "memory source":
            self._measuring = False
            with contextlib.suppress(Exception):
                self.source.stop()
        self._warn(
            f"memtenants: measuring {part} failed ({type(error).__name__}: {error}); {part} is disabled from now on"
        )


def holds_compiled_code(module: nn.Module) -> bool:
    """Whether ``module`` holds ``torch.compile``'d parts: an ``OptimizedModule``, ``Module.compile()``,
    or Lightning's record of a compiled LightningModule (``_compiler_ctx``)."""
    for sub in module.modules():
        if type(sub).__name__ == "OptimizedModule" or getattr(sub, "_compiler_ctx", None) is not None:
            return True
        if getattr(sub, "_compiled_call_impl", None) is not None:
            return True
    return False


def _unmeasured(phase: PhaseReport) -> PhaseReport:
    return dataclasses.replace(phase, allocated_bytes=None, window_peak_bytes=None, reserved_bytes=None)


def describe_optimizers(optimizers: Sequence[Optimizer]) -> str:
    """Each optimizer's class and the implementation its step runs: single-tensor, foreach or fused."""
    names = [f"{type(local_optimizer(o)).__name__} ({optimizer_implementation(o)})" for o in optimizers]
    return ", ".join(names) or "no optimizer"


def _fields(reading: Reading) -> tuple[int | None, int | None, int | None]:
    return reading.allocated_bytes, reading.window_peak_bytes, reading.reserved_bytes


def _step_peak(micro: list[dict[str, PhaseReport]]) -> tuple[int | None, str | None]:
    """The highest point of the step; the window before ``batch_start`` counts only at its end."""
    best: tuple[int | None, str | None] = (None, None)
    for batch_phases in micro:
        for name, phase in batch_phases.items():
            value = phase.allocated_bytes if name == "batch_start" else phase.window_peak_bytes
            if value is not None and (best[0] is None or value > best[0]):
                best = (value, name)
    return best

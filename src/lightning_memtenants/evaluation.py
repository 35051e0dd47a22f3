"""The evaluation monitor: one batch of a validation, test or predict loop, measured as the loop holds memory.

An evaluation batch has two boundaries, ``batch_start`` and ``batch_end``, and one window between them, the loop's
step. Its tenants are what the loop holds: the weights, the gradients and optimizer state training left resident, and
activations only where the step ran with grad enabled and its output keeps the graph. The memory source's window peak
is the step's working memory on top of that. A hand-written evaluation loop calls it as the callback does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants.analysis.evaluation import explain_evaluation_peak
from lightning_memtenants.checks import brief
from lightning_memtenants.core.census import ActivationTracker, TenantCounter
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import PhaseReport, StepReport, fixed_bytes
from lightning_memtenants.core.session import SourceSession
from lightning_memtenants.core.sources import MemorySource, Reading, TrackerSource
from lightning_memtenants.core.storage import HostState, batch_tensors, module_device, optimizer_state_tensors
from lightning_memtenants.names import EVALUATION_STAGES, LOOP_NAMES, TENANTS, Phase, Stage, Tenant


class EvaluationMonitor:
    """Measures evaluation batches: the tenants at ``batch_start`` and ``batch_end``, and the step's peak between.

    The memory source may be the training monitor's (``TenantMonitor.source``): a live-tensor tracker then goes on
    knowing what training left alive, and this monitor starts it at a measured batch's start and pauses it at its end;
    it stops a source only if it owns it (``owns_source``). Measuring a batch is asked for at its start; a batch not
    measured costs nothing.

    Args:
        module: the model.
        optimizers: its optimizers, whose state is resident through the loop.
        source: the memory source, or None for the tenants only.
        device: where the module runs; None reads its first parameter or buffer, else the CPU.
        warn: how a failed measurement is reported (once per part).
        host_state: the optimizer-state entries kept in host memory (see ``TenantMonitor``).
        owns_source: stop the source on :meth:`close`.
        guard: the guard of the parts (census, activations, memory source); pass the one of an earlier monitor so that
            a part that failed in one loop run stays disabled, and unwarned, in the next. None: a guard of its own,
            which reports with ``warn``.

    Raises:
        ValueError: if ``source`` is not None or a MemorySource, or ``device`` names no device.

    Example::

        monitor = EvaluationMonitor(model, source=TrackerSource("cpu", scan=False))
        with torch.no_grad():
            for index, (x, y) in enumerate(loader):
                monitor.batch_start("validate", (x, y), index)
                loss = F.mse_loss(model(x), y)
                report = monitor.batch_end(loss)
        monitor.close()
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer] = (),
        *,
        source: MemorySource | None = None,
        device: torch.device | str | None = None,
        warn: Callable[[str], Any] = warnings.warn,
        host_state: HostState | None = None,
        owns_source: bool = False,
        guard: Guard | None = None,
    ) -> None:
        if source is not None and not isinstance(source, MemorySource):
            raise ValueError(f"source must be None or a MemorySource, got {brief(source)}")
        if guard is not None and not isinstance(guard, Guard):
            raise ValueError(f"guard must be None or a Guard, got {brief(guard)}")
        self.device = module_device(module, device)
        self.module = module
        self.optimizers = list(optimizers)
        self.host_state = host_state
        self.owns_source = owns_source
        self._guard = guard if guard is not None else Guard(warn, "measuring the evaluation")
        self._session = SourceSession(source if source is not None else MemorySource(), self._guard)
        self._activations = ActivationTracker(self.device.type)
        if isinstance(source, TrackerSource):
            self._activations.host_memory = source.tracker.is_host
            self._activations.offloaded_memory = source.tracker.is_offloaded
        self._counter = TenantCounter(module, self.optimizers, host_state)
        self._open: tuple[Stage, int, int | None, int] | None = None
        self._last: PhaseReport | None = None

    @property
    def source(self) -> MemorySource:
        """The memory source."""
        return self._session.source

    @property
    def open_stage(self) -> Stage | None:
        """The loop of the batch under way, between its ``batch_start`` and ``batch_end``; else None."""
        return None if self._open is None else self._open[0]

    @property
    def open_batch_index(self) -> int | None:
        """The index of the batch under way, or None."""
        return None if self._open is None else self._open[1]

    def measures(self, part: str) -> bool:
        """Whether ``part`` (``"census"``, ``"activations"``, ``"memory source"``) is still measured.

        Args:
            part: the part.

        Returns:
            False once a failure has disabled it.
        """
        return part not in self._guard.disabled

    def batch_start(
        self, stage: Stage, batch: Any, batch_index: int, dataloader_index: int | None = None, *, step: int = 0
    ) -> PhaseReport | None:
        """Open a measured batch: the tenants now, and the memory source started with the batch among its roots.

        Args:
            stage: ``"validate"``, ``"test"`` or ``"predict"``.
            batch: the batch, on the device; it is not counted as activations.
            batch_index: its index in the loop.
            dataloader_index: its dataloader, or None.
            step: the trainer's global step, which the report carries.

        Returns:
            The ``batch_start`` phase, or None where the census is disabled.

        Raises:
            ValueError: if ``stage`` is not an evaluation stage.
        """
        if stage not in EVALUATION_STAGES:
            raise ValueError(f"stage must be one of {EVALUATION_STAGES}, got {brief(stage)}")
        self._activations.clear()
        self._open = (stage, batch_index, dataloader_index, step)
        tensors = batch_tensors(batch)
        self._guard.run("activations", self._activations.ignore, tensors)
        if self._session.begin(True):
            self._session.start(self._roots(tensors))
        return self._phase("batch_start")

    def batch_end(self, outputs: Any = None) -> StepReport | None:
        """Close the batch: what its output's graph keeps for backward, the tenants, and the step's peak.

        Args:
            outputs: what the step returned; its graph (where it ran with grad enabled) is the activations.

        Returns:
            The batch's report, or None where no batch is open or the census is disabled.
        """
        opened, self._open = self._open, None
        if opened is None:
            return None
        stage, batch_index, dataloader_index, step = opened
        start = self._last if self._last is not None and self._last.name == "batch_start" else None
        if outputs is not None and self.measures("activations"):
            self._activations.observe(outputs)
            if self._activations.error is not None:
                self._guard.disable("activations", self._activations.error)
            else:
                self._session.adopt(self._activations.storages())
        end = self._phase("batch_end")
        self._session.pause()
        self._activations.clear()
        if start is None or end is None:
            return None
        phases: dict[Phase, PhaseReport] = {"batch_start": start, "batch_end": end}
        high = {t: max(start.tenants_bytes[t], end.tenants_bytes[t]) for t in TENANTS}
        peak = None
        if end.window_peak_bytes is not None and start.allocated_bytes is not None:
            peak = max(end.window_peak_bytes, start.allocated_bytes, end.allocated_bytes or 0)
        why = "the memory source does not measure this device" if self.measures("memory source") else "it failed"
        explanation = explain_evaluation_peak(
            stage, start.allocated_bytes, end.allocated_bytes, peak, end.tenants_bytes["activations"], why
        )
        notes = []
        if end.tenants_bytes["activations"]:
            notes.append(
                f"the {LOOP_NAMES[stage]} step ran with grad enabled and its output keeps a graph: its saved tensors"
                " are activations until the output is dropped"
            )
        return StepReport(
            step=step,
            phases=phases,
            micro_batches=[phases],
            tenants_bytes=high,
            expected_fixed_bytes=None,
            measured_fixed_bytes=fixed_bytes(end.tenants_bytes),
            peak_bytes=peak,
            peak_phase="batch_end" if peak is not None else None,
            peak_explanation=explanation,
            memory_source=self.source.status if peak is not None else "not measured",
            notes=notes,
            stage=stage,
            batch_index=batch_index,
            dataloader_index=dataloader_index,
        )

    def abandon(self) -> None:
        """Drop the batch under way (its loop stopped inside it): the source pauses."""
        self._open = None
        self._activations.clear()
        self._session.pause()

    # -- what the postmortem asks, as it asks the training monitor -----------------------------------------------

    def last_phase(self) -> PhaseReport | None:
        """The last boundary measured: the open batch's ``batch_start`` during its step."""
        return self._last

    def census(self) -> dict[Tenant, int]:
        """The tenants now, the activations as the last graph read saw them."""
        return self._counter.count(self._activations if self.measures("activations") else None)

    def read_source(self) -> Reading:
        """What the memory source sees now, where it measures the batch under way."""
        return self._session.read()

    def observe_failure(self, error: BaseException) -> None:
        """Read the graphs held by the frames of ``error``'s traceback (a step that failed with grad enabled).

        Args:
            error: the exception the step failed with.
        """
        if not self.measures("activations"):
            return
        outputs: list[Any] = []
        tb = error.__traceback__
        while tb is not None:
            outputs.extend(tb.tb_frame.f_locals.values())
            tb = tb.tb_next
        self._activations.observe(outputs)

    def close(self) -> None:
        """Let go of the batch; stop the source where this monitor owns it. Safe to call more than once."""
        self._open = None
        self._activations.clear()
        if self.owns_source:
            self._session.close()
        else:
            self._session.pause()

    # -- inside ----------------------------------------------------------------------------------

    def _phase(self, name: Phase) -> PhaseReport | None:
        reading = self._session.read()
        tenants = self._guard.run("census", self.census)
        if tenants is None:
            return None
        report = PhaseReport(
            name,
            tenants,
            reading.allocated_bytes,
            reading.window_peak_bytes,
            reading.reserved_bytes,
            reserved_peak_bytes=reading.reserved_peak_bytes,
        )
        self._last = report
        return report

    def _roots(self, batch: list[Tensor]) -> Iterator[Tensor]:
        params = list(self.module.parameters())
        yield from params
        yield from self.module.buffers()
        yield from (p.grad for p in params if p.grad is not None)
        yield from optimizer_state_tensors(self.optimizers)
        yield from batch

"""MemoryTenantsCallback: thin Lightning wiring over :class:`TenantMonitor`."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.report import StepReport, format_table
from lightning_memtenants.sources import MemorySource, TrackerSource

_SOURCES = ("auto", "tracker", "none")


class MemoryTenantsCallback(Callback):
    r"""Tell what is using training memory: weights, gradients, optimizer state and activations.

    At every phase of every training batch (``batch_start``, ``before_backward``,
    ``after_backward``, ``before_optimizer_step``, ``batch_end``) the callback counts each
    tenant's bytes from the tensors themselves and checks the fixed cost against the formula
    for the optimizer and dtypes in use. A memory source adds allocated bytes and the peak of
    each phase window, so the step's true peak can be set against the sum of its tenants.
    Scalars go to the trainer's loggers on logging steps under ``memtenants/``; a table is
    printed at the end of fit.

    Args:
        track_activations: record what autograd saves for backward (``saved_tensors_hooks``).
        memory_source: ``"auto"`` uses the allocator's counters on CUDA and other accelerators
            (every step) and the live-tensor tracker on CPU (logging steps only); ``"tracker"``
            forces the tracker; ``"none"`` measures tenants only. A :class:`MemorySource` is
            used as given.
        track_every_step: run a costly source (the tracker) on every step, not only on
            logging steps.
        log_every_n_steps: log every this many optimizer steps; ``None`` follows the
            trainer's ``log_every_n_steps``.
        print_summary: print the table of the last step at the end of fit.

    Raises:
        ValueError: if an argument has the wrong type or value.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_memtenants import MemoryTenantsCallback
        >>> memtenants = MemoryTenantsCallback()
        >>> trainer = Trainer(callbacks=[memtenants])

    After ``trainer.fit(model)``, ``memtenants.latest.tenants_bytes`` holds the high-water mark
    of each tenant during the last optimizer step.
    """

    def __init__(
        self,
        *,
        track_activations: bool = True,
        memory_source: str | MemorySource = "auto",
        track_every_step: bool = False,
        log_every_n_steps: int | None = None,
        print_summary: bool = True,
    ) -> None:
        flags = {"track_activations": track_activations, "track_every_step": track_every_step}
        flags["print_summary"] = print_summary
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(f"log_every_n_steps must be None or a positive int, got {log_every_n_steps!r}")
        if not isinstance(memory_source, MemorySource) and memory_source not in _SOURCES:
            raise ValueError(f"memory_source must be one of {_SOURCES} or a MemorySource, got {memory_source!r}")
        self.track_activations = track_activations
        self.memory_source = memory_source
        self.track_every_step = track_every_step
        self.log_every_n_steps = log_every_n_steps
        self.print_summary = print_summary
        self.latest: StepReport | None = None
        self.latest_measured: StepReport | None = None
        self.first: StepReport | None = None
        self._monitor: TenantMonitor | None = None
        self._stepped = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()
        self.latest = self.latest_measured = self.first = None
        optimizers: list[Optimizer] = list(trainer.optimizers)
        source: str | MemorySource | None = self.memory_source
        if source == "tracker":
            source = TrackerSource(pl_module.device.type)
        elif source == "none":
            source = None
        self._monitor = TenantMonitor(
            pl_module, optimizers, track_activations=self.track_activations, source=source, warn=rank_zero_warn
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._stepped = False
        if self._monitor is not None:
            self._monitor.measure = self.track_every_step or self._logs_step(trainer, self._monitor.steps_done)
        self._phase("batch_start", batch)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._phase("before_backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase("after_backward")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._stepped = True
        self._phase("before_optimizer_step")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        self._phase("batch_end")
        if not self._stepped:
            monitor.tracker.stop()
            return
        report = monitor.end_step()
        if report is None:
            return
        self.latest = report
        if report.peak_bytes is not None:
            self.latest_measured = report
        if self.first is None:
            self.first = report
        if self._should_log(trainer, report):
            self._log(trainer, report)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()
        if self.print_summary and self.latest is not None:
            if self.first is not None and self.first is not self.latest:
                rank_zero_info(format_table(self.first))
            rank_zero_info(format_table(self.latest))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def _phase(self, name: str, batch: Any = None) -> None:
        if self._monitor is not None:
            self._monitor.phase(name, batch)

    def _close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()

    def _logs_step(self, trainer: pl.Trainer, step: int) -> bool:
        every = self.log_every_n_steps or trainer.log_every_n_steps
        return every > 0 and step % every == 0

    def _should_log(self, trainer: pl.Trainer, report: StepReport) -> bool:
        return bool(trainer.loggers) and self._logs_step(trainer, report.step)

    def _log(self, trainer: pl.Trainer, report: StepReport) -> None:
        monitor = self._monitor
        if monitor is None or "logging" in monitor.disabled:
            return
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        for logger in trainer.loggers:
            monitor.guard("logging", logger.log_metrics, report.metrics(), step)

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


class MemoryTenantsCallback(Callback):
    r"""Tell what is using training memory: weights, gradients, optimizer state and activations.

    At every phase of every training batch (``batch_start``, ``before_backward``,
    ``after_backward``, ``before_optimizer_step``, ``batch_end``) the callback counts each
    tenant's bytes from the tensors themselves and checks the fixed cost against the formula
    for the optimizer and dtypes in use. Scalars go to the trainer's loggers on logging steps
    under ``memtenants/``; a table is printed at the end of fit.

    Args:
        track_activations: record what autograd saves for backward (``saved_tensors_hooks``).
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
        log_every_n_steps: int | None = None,
        print_summary: bool = True,
    ) -> None:
        for name, value in (("track_activations", track_activations), ("print_summary", print_summary)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(f"log_every_n_steps must be None or a positive int, got {log_every_n_steps!r}")
        self.track_activations = track_activations
        self.log_every_n_steps = log_every_n_steps
        self.print_summary = print_summary
        self.latest: StepReport | None = None
        self.first: StepReport | None = None
        self._monitor: TenantMonitor | None = None
        self._stepped = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()
        self.latest = self.first = None
        optimizers: list[Optimizer] = list(trainer.optimizers)
        self._monitor = TenantMonitor(
            pl_module, optimizers, track_activations=self.track_activations, warn=rank_zero_warn
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._stepped = False
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

    def _should_log(self, trainer: pl.Trainer, report: StepReport) -> bool:
        if not trainer.loggers:
            return False
        every = self.log_every_n_steps or trainer.log_every_n_steps
        return every > 0 and report.step % every == 0

    def _log(self, trainer: pl.Trainer, report: StepReport) -> None:
        monitor = self._monitor
        if monitor is None or "logging" in monitor.disabled:
            return
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        for logger in trainer.loggers:
            monitor.guard("logging", logger.log_metrics, report.metrics(), step)

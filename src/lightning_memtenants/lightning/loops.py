"""The evaluation loops in a Lightning run: validation, test and predict batches measured, checked and logged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_memtenants._private import batches_that_stepped
from lightning_memtenants.analysis.budget import Budget
from lightning_memtenants.analysis.evaluation import EvaluationLine, evaluation_line, training_line
from lightning_memtenants.analysis.leaks import LeakDetector
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.sources import MemorySource
from lightning_memtenants.core.storage import batch_tensors
from lightning_memtenants.evaluation import EvaluationMonitor
from lightning_memtenants.names import LOOP_NAMES, Stage
from lightning_memtenants.render.tags import evaluation_metrics

# On a costly source (the live-tensor tracker) the first batches of each loop run are measured, one after another, so
# that the leak detector sees what outlives a step; then the last batch, and every batch with track_every_step.
MEASURED_FIRST = 4


class EvaluationLoops:
    """Measures the batches of validation, test and predict loops, warns before one would not fit, logs each run.

    Per loop run, an :class:`~lightning_memtenants.evaluation.EvaluationMonitor` measures its batches: on a source
    that reads every step (CUDA) every batch; on the live-tensor tracker the first ``MEASURED_FIRST`` batches and the
    last (where Lightning knows the loop's length), or every batch with ``every_batch``. Before a batch runs, its peak
    is projected from the loop's measured batches, else from the training forward (an upper bound), and checked
    against the budget. A leak detector watches allocated bytes at the start of consecutive measured batches.

    Args:
        warn: how a warning is given (rank zero's).
        every_batch: measure every batch also on a costly source.

    Attributes:
        latest: the last measured batch of each loop, by stage.
        peaks: the measured batch with the highest peak of each loop, by stage, over the trainer's run.
        peak_samples: the samples of each of those batches, by stage.
        budget: the budget, or None.
    """

    def __init__(self, warn: Callable[[str], Any], *, every_batch: bool = False) -> None:
        self.every_batch = every_batch
        self.latest: dict[Stage, StepReport] = {}
        self.peaks: dict[Stage, StepReport] = {}
        self.peak_samples: dict[Stage, int] = {}
        self.budget: Budget | None = None
        self.guard = Guard(warn, "the evaluation loops")
        self._measuring = Guard(warn, "measuring the evaluation")  # every run's monitor's: a failed part stays off
        self._warn = warn
        self._warned: set[str] = set()
        self._monitor: EvaluationMonitor | None = None
        self._lines: dict[Stage, EvaluationLine] = {}
        self._training: EvaluationLine | None = None
        self._leaks: LeakDetector | None = None
        self._run_peak: StepReport | None = None
        self._samples = 0
        self._sanity = False

    @property
    def open_stage(self) -> Stage | None:
        """The loop of the batch under way, or None between batches."""
        return None if self._monitor is None else self._monitor.open_stage

    @property
    def monitor(self) -> EvaluationMonitor | None:
        """The monitor of the loop run under way, or None."""
        return self._monitor

    @property
    def open_samples(self) -> int:
        """The samples of the batch under way (0 where unknown)."""
        return self._samples

    def reset(self, stages: tuple[Stage, ...]) -> None:
        """Forget the reports and lines of ``stages`` (a new ``fit``, ``validate``, ``test`` or ``predict``).

        Args:
            stages: the loops the trainer's entry point runs.
        """
        for stage in stages:
            self.latest.pop(stage, None)
            self.peaks.pop(stage, None)
            self.peak_samples.pop(stage, None)
            self._lines.pop(stage, None)
        if "validate" in stages:
            self._training = None
        self._warned = set()
        self._measuring = Guard(self._warn, "measuring the evaluation")

    def training_step(self, report: StepReport, samples: int, batch_bytes: int) -> None:
        """A measured training step, whose forward bounds an evaluation batch's peak before one was measured.

        Args:
            report: the training step.
            samples: its batch's samples.
            batch_bytes: its batch's bytes.
        """
        line = training_line(report, samples, batch_bytes)
        if line is not None:
            self._training = line

    def start(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        stage: Stage,
        source: MemorySource | None,
        *,
        owns_source: bool,
        budget_bytes: int | None,
        margin: float,
    ) -> None:
        """A loop run starts: its monitor, its leak detector.

        Args:
            trainer: the Trainer.
            module: the LightningModule.
            stage: the loop.
            source: the memory source (the training monitor's, where one runs), or None.
            owns_source: whether the loop's monitor stops the source at the end.
            budget_bytes: the budget, or None.
            margin: the fraction of it kept free.
        """
        self.close()
        self.budget = None if budget_bytes is None else Budget(budget_bytes, margin)
        self._sanity = bool(trainer.sanity_checking)
        self._run_peak = None
        self._leaks = LeakDetector(window=MEASURED_FIRST, skip=0, loop=LOOP_NAMES[stage])
        self._monitor = self.guard.run(
            "the evaluation monitor",
            lambda: EvaluationMonitor(
                module,
                list(trainer.optimizers),
                source=source,
                device=module.device,
                warn=self._warn,
                owns_source=owns_source,
                guard=self._measuring,
            ),
        )

    def batch_start(self, trainer: pl.Trainer, stage: Stage, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        """Measure the batch's start where it is measured, check its projected peak, and watch for a leak.

        Args:
            trainer: the Trainer.
            stage: the loop.
            batch: the batch, on the device.
            batch_idx: its index.
            dataloader_idx: its dataloader.
        """
        monitor = self._monitor
        if monitor is None:
            return
        self._samples = 0
        every = self.every_batch or monitor.source.every_step or not monitor.measures("memory source")
        if not (every or batch_idx < MEASURED_FIRST or _is_last(trainer, stage, batch_idx, dataloader_idx)):
            return
        start = monitor.batch_start(
            stage,
            batch,
            batch_idx,
            dataloader_idx if _dataloaders(trainer, stage) > 1 else None,
            step=trainer.global_step,
        )
        if start is None:
            return
        self._samples = _samples(batch)[0]
        if self._leaks is not None and start.allocated_bytes is not None:
            found = self._leaks.observe(batch_idx, start)
            if found is not None:
                self._once(f"leak {stage}", found)
        self.guard.run("the budget", self._check, stage, start.allocated_bytes, batch_idx)

    def batch_end(self, stage: Stage, outputs: Any, batch: Any) -> StepReport | None:
        """Close the batch under way, where it was measured.

        Args:
            stage: the loop.
            outputs: what the step returned.
            batch: the batch.

        Returns:
            The batch's report, or None where it was not measured.
        """
        monitor = self._monitor
        if monitor is None or monitor.open_stage is None:
            return None
        report = monitor.batch_end(outputs)
        if report is None:
            return None
        if self._sanity:
            report.notes.append(
                "a batch of the sanity check, which runs num_sanity_val_steps validation batches before training"
            )
        self.latest[stage] = report
        if report.peak_bytes is not None:
            samples, batch_bytes = _samples(batch)
            line = evaluation_line(report, samples, batch_bytes)
            known = self._lines.get(stage)
            if line is not None and (known is None or line.samples >= known.samples):
                self._lines[stage] = line
            if self._run_peak is None or report.peak_bytes > (self._run_peak.peak_bytes or 0):
                self._run_peak = report
            best = self.peaks.get(stage)
            if best is None or report.peak_bytes > (best.peak_bytes or 0):
                self.peaks[stage], self.peak_samples[stage] = report, samples
        return report

    def end(self, trainer: pl.Trainer, stage: Stage) -> None:
        """A loop run ends: its figures go to every logger (not the sanity check's), and its monitor goes.

        Args:
            trainer: the Trainer.
            stage: the loop.
        """
        report, self._run_peak = self._run_peak, None
        sanity = self._sanity
        self.close()
        if report is None or sanity or not trainer.loggers:
            return
        headroom = None if self.budget is None else self.budget.headroom_bytes(report.peak_bytes)
        largest = self.max_batch_size(stage)
        step = batches_that_stepped(trainer)
        for logger in trainer.loggers:
            separator = getattr(logger, "group_separator", "/")
            values = evaluation_metrics(report, separator, headroom_bytes=headroom, max_batch_size=largest)
            self.guard.run(f"to {type(logger).__name__}", logger.log_metrics, values, step)

    def close(self) -> None:
        """Drop the loop run's monitor (its source stops where it owns it)."""
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            self.guard.run("the evaluation monitor", monitor.close)

    def line(self, stage: Stage) -> EvaluationLine | None:
        """The line a batch of ``stage`` is projected from: its measured batches', else the training forward's.

        Args:
            stage: the loop.

        Returns:
            The line, or None before anything was measured.
        """
        return self._lines.get(stage) or self._training

    def max_batch_size(self, stage: Stage, budget_bytes: int | None = None) -> int | None:
        """The largest batch of ``stage`` whose peak fits the budget less the margin.

        Args:
            stage: the loop.
            budget_bytes: the budget; None uses the run's.

        Returns:
            The samples, or None without a budget or before anything was measured.
        """
        line = self.line(stage)
        margin = self.budget.margin if self.budget is not None else 0.05
        budget = Budget(budget_bytes, margin) if budget_bytes is not None else self.budget
        if line is None or budget is None:
            return None
        return line.max_batch_size(budget.limit_bytes)

    def predict_peak_bytes(self, stage: Stage, samples: int) -> int | None:
        """The projected peak of a batch of ``samples`` in ``stage``, from :meth:`line`; None before a measurement.

        Args:
            stage: the loop.
            samples: the batch's samples.

        Returns:
            The bytes, or None.
        """
        line = self.line(stage)
        return None if line is None else line.peak_for(samples)

    def _check(self, stage: Stage, start_bytes: int | None, batch_idx: int) -> None:
        budget, line = self.budget, self.line(stage)
        if budget is None or line is None or self._samples <= 0:
            return
        projected = line.peak_for(self._samples, start_bytes)
        loop = LOOP_NAMES[stage]
        found = budget.over(
            projected,
            f"{loop} batch {batch_idx} ({self._samples} samples) may not fit: its projected peak, from {line.source},",
            f"lower the {loop} batch size (largest that fits: {line.max_batch_size(budget.limit_bytes):,} samples),"
            f" or keep what the {loop} step returns on the CPU",
        )
        if found is not None:
            self._once(f"budget {stage}", found)

    def _once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._warn(message)


def _samples(batch: Any) -> tuple[int, int]:
    """The batch's samples (the first dimensioned tensor's leading size) and bytes."""
    tensors = batch_tensors(batch)
    first = next((t for t in tensors if t.dim()), None)
    return (int(first.shape[0]) if first is not None else 0), sum(t.numel() * t.element_size() for t in tensors)


def _counts(trainer: pl.Trainer, stage: Stage) -> list[int | float]:
    if stage == "validate":
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
    elif stage == "test":
        counts = trainer.num_test_batches
    else:
        counts = trainer.num_predict_batches
    return list(counts)


def _dataloaders(trainer: pl.Trainer, stage: Stage) -> int:
    try:
        return len(_counts(trainer, stage))
    except Exception:
        return 1


def _is_last(trainer: pl.Trainer, stage: Stage, batch_idx: int, dataloader_idx: int) -> bool:
    """Whether Lightning will run no batch after this one in this dataloader (False where it cannot tell)."""
    try:
        count = _counts(trainer, stage)[dataloader_idx]
    except Exception:
        return False
    return count != float("inf") and batch_idx + 1 >= count

"""Where the reports go in a Lightning run: the loggers on Lightning's own cadence, the panels and pictures, the bar."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_memtenants._private import batches_that_stepped, show_in_progress_bar
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.lightning.sinks import Sink, is_logger, sink_for
from lightning_memtenants.render.postmortem import postmortem_markdown, postmortem_text
from lightning_memtenants.render.table import (
    Summary,
    format_table,
    summary_markdown,
    summary_text,
    summary_to_markdown,
)
from lightning_memtenants.render.tags import DESK, budget_metrics, metrics, rank_metrics
from lightning_memtenants.render.tensorboard import SUMMARY_MD, TensorBoardPanels, desk_pixels, timeline_pixels
from lightning_memtenants.render.timeline import TIMELINE
from lightning_memtenants.units import MiB


class Logs:
    """Logs a step's scalars where Lightning logs the user's own, and gives each logger the pictures it can show.

    Lightning logs a training step when ``(batches_that_stepped + 1) % log_every_n_steps == 0``, at
    the step ``batches_that_stepped``; the same steps are measured and logged here, so that our scalars
    land beside the user's. The first optimizer step, where Adam's state appears, is always measured
    and logged as well.

    At the end of fit TensorBoard gets its panels, W&B and MLflow the desk and timeline pictures (rendered once
    for all of them) and the summary, a CSVLogger the summary beside its ``metrics.csv`` (:mod:`.sinks`).

    Args:
        every_n_steps: log every this many optimizer steps; ``None`` follows the trainer's ``log_every_n_steps``.
        desk_every_n_logs: with a TensorBoardLogger, draw the desk on every this-many-th logging step; ``0``:
            only at the end of fit. The pictures keep to a budget whatever the cadence (``TensorBoardPanels``):
            at most 2% of the fit's time, at most 50 of each in the event files, spread over the fit.
        warn: how a failure of ours is reported.

    Attributes:
        panels: the TensorBoard panels, on rank zero with a TensorBoardLogger; else None.
        sinks: the writers for the other loggers that show more than scalars, on rank zero; else empty.
    """

    def __init__(
        self,
        every_n_steps: int | None,
        *,
        desk_every_n_logs: int,
        warn: Callable[[str], Any],
    ) -> None:
        self.every_n_steps = every_n_steps
        self.desk_every_n_logs = desk_every_n_logs
        self.guard = Guard(warn, "logging")
        self.panels: TensorBoardPanels | None = None
        self.sinks: list[Sink] = []
        self._drawing = Guard(warn, "drawing")
        self._warn = warn

    def open(self, trainer: pl.Trainer) -> None:
        """Find the loggers that show more than scalars (rank zero writes) and write the custom-scalars layout.

        Args:
            trainer: the Trainer whose loggers get the reports.
        """
        self.panels = None
        self.sinks = []
        if not trainer.is_global_zero:
            return
        self.sinks = [sink for sink in map(sink_for, trainer.loggers) if sink is not None]
        boards = [logger for logger in trainer.loggers if is_tensorboard_logger(logger)]
        if not boards:
            return
        self.panels = self.guard.run(
            "the tensorboard panels",
            lambda: TensorBoardPanels(
                [logger.experiment for logger in boards],
                [logger.log_dir for logger in boards],
                desk_every_n_logs=self.desk_every_n_logs,
                separator=getattr(boards[0], "group_separator", "/"),
                warn=self._warn,
                planned_logs=self._planned_logs(trainer),
            ),
        )
        if self.panels is not None:
            self.panels.write_layout()

    @property
    def draws(self) -> bool:
        """Whether a logger shows the pictures (TensorBoard's panels, W&B, MLflow): the steps then record timelines."""
        return self.panels is not None or any(sink.shows_pictures for sink in self.sinks)

    def _planned_logs(self, trainer: pl.Trainer) -> int | None:
        """How many steps the fit will log, where Lightning knows how many it will step; else None."""
        every = self.every_n_steps or trainer.log_every_n_steps
        try:
            total = float(trainer.estimated_stepping_batches)
        except Exception:  # an iterable without a length, a strategy that cannot tell: the pictures are not spread
            return None
        if every <= 0 or not math.isfinite(total) or total <= 0:
            return None
        return int(total // every) + 1

    def logs_next_step(self, trainer: pl.Trainer) -> bool:
        """Whether Lightning logs the optimizer step about to run (asked at its first ``batch_start``).

        Args:
            trainer: the Trainer.

        Returns:
            True on the first step and on every ``every_n_steps``-th one (else the trainer's ``log_every_n_steps``).
            Lightning also logs where the trainer was told to stop; that flag can differ between ranks, and every
            rank must gather on the same steps, so it is not followed here.
        """
        step = batches_that_stepped(trainer)
        if step == 0:
            return True
        every = self.every_n_steps or trainer.log_every_n_steps
        return every > 0 and (step + 1) % every == 0

    def log(
        self,
        trainer: pl.Trainer,
        report: StepReport,
        *,
        headroom_bytes: int | None,
        max_batch_size: int | None,
        ranks: list[list[float]],
        budget_bytes: int | None,
    ) -> None:
        """Log ``report``, the budget's and the ranks' figures to every logger (its separator), at Lightning's step.

        Args:
            trainer: the Trainer whose loggers get the scalars.
            report: the step.
            headroom_bytes: the budget less the step's peak, or None.
            max_batch_size: the largest batch that fits the budget less the margin (under DDP the minimum over
                ranks), or None.
            ranks: every rank's figures (see ``gather_ranks``); empty in a single-process run.
            budget_bytes: the budget, drawn in the desk picture, or None.
        """
        step = batches_that_stepped(trainer)
        for logger in trainer.loggers:
            separator = getattr(logger, "group_separator", "/")  # a logger without one joins with "/"
            values = metrics(report, separator)
            values.update(budget_metrics(headroom_bytes, max_batch_size, separator))
            if ranks:
                values.update(rank_metrics(ranks, separator))
            self.guard.run(f"to {type(logger).__name__}", logger.log_metrics, dict(sorted(values.items())), step)
        if self.panels is not None:
            self.panels.on_log(report, step, budget_bytes)

    def show_headroom(self, trainer: pl.Trainer, headroom_bytes: int) -> None:
        """Put the headroom in the progress bar (not in the loggers: the scalars carry it), as a Python float.

        Not through ``LightningModule.log``: that makes a tensor of it, operators a user's dispatch mode would see.

        Args:
            trainer: the Trainer, whose progress bar metrics get ``headroom_MiB``.
            headroom_bytes: the budget less the step's peak.
        """
        self.guard.run("the progress bar", _show, trainer, headroom_bytes)

    def fit_end(
        self,
        trainer: pl.Trainer,
        summary: Summary,
        desk: StepReport,
        budget_bytes: int | None,
        *,
        print_summary: bool = True,
        say: Callable[[str], Any] | None = None,
    ) -> None:
        """The summary and the pictures to every logger that shows them, at the end of fit, and the summary printed.

        The printed summary and the markdown one (TensorBoard's text panel and ``memtenants_summary.md``) are
        rendered from the same :class:`Summary`, so they say the same things in the same order; the pictures are
        rendered once, by the TensorBoard panels where there are some, and shared with W&B and MLflow.

        Args:
            trainer: the Trainer.
            summary: what :func:`fit_summary` built.
            desk: the step to draw.
            budget_bytes: the budget, or None.
            print_summary: also print the summary, on rank zero, through ``say``.
            say: how it is printed; None: :func:`print` to standard output.
        """
        step = batches_that_stepped(trainer)
        markdown = summary_to_markdown(summary)
        text = summary_text(summary)
        if self.panels is not None:
            self.panels.on_fit_end(summary.reports, step, budget_bytes, desk, summary=markdown)
        images = self._pictures(desk, budget_bytes) if any(sink.shows_pictures for sink in self.sinks) else {}
        written: list[Path | None] = [d / SUMMARY_MD for d in (self.panels.log_dirs if self.panels is not None else [])]
        for sink in self.sinks:
            if sink.shows_pictures and images:
                self.guard.run(f"the pictures to {sink.name}", sink.pictures, images, step)
            written.append(self.guard.run(f"the summary to {sink.name}", sink.summary, markdown, text, step))
        if print_summary and trainer.is_global_zero:
            files = [path for path in written if path is not None and path.is_file()]
            if files:
                text += f"\nmemtenants: the same summary in markdown: {', '.join(str(p) for p in files)}"
            (say or _print)(text)

    def _pictures(self, desk: StepReport, budget_bytes: int | None) -> dict[str, np.ndarray]:
        """The end of fit's desk and timeline pixels by tag name: the panels' where they drew them, else drawn here.

        A picture the panels did not draw (it failed, and warned) is not drawn again here.
        """
        if self.panels is not None:
            return dict(self.panels.end_pictures)
        drawn = {
            DESK: self._drawing.run("the desk picture", desk_pixels, desk, budget_bytes),
            TIMELINE: self._drawing.run("the timeline", timeline_pixels, desk, budget_bytes),
        }
        return {name: pixels for name, pixels in drawn.items() if pixels is not None}

    def postmortem(self, trainer: pl.Trainer, record: dict[str, Any], latest: StepReport | None) -> None:
        """The postmortem, as text in TensorBoard, W&B and MLflow.

        Args:
            trainer: the Trainer.
            record: the postmortem record.
            latest: the last completed step, whose table goes with it, or None.
        """
        step = batches_that_stepped(trainer)
        if self.panels is not None:
            self.panels.on_postmortem(record, step, latest)
        for sink in self.sinks:
            self.guard.run(f"the postmortem to {sink.name}", _postmortem, sink, record, latest, step)


def is_tensorboard_logger(logger: Any) -> bool:
    """Whether ``logger`` is Lightning's TensorBoardLogger, from ``lightning.pytorch`` or ``pytorch_lightning``.

    The two packages ship the same class under two names; ``pytorch_lightning`` is not imported to ask.

    Args:
        logger: one of the trainer's loggers.

    Returns:
        True for either package's TensorBoardLogger or a subclass of it.
    """
    return is_logger(logger, TensorBoardLogger)


def _postmortem(sink: Sink, record: dict[str, Any], latest: StepReport | None, step: int) -> None:
    """The postmortem and the last completed step's table, in markdown and as text, to one logger's writer."""
    markdown, text = postmortem_markdown(record), postmortem_text(record)
    if latest is not None:
        markdown += "\n\nThe last completed step:\n\n" + summary_markdown(latest)
        text += "\n\nThe last completed step:\n\n" + format_table(latest)
    sink.postmortem(markdown, text, step)


def _print(text: str) -> None:
    """The end-of-fit summary on standard output, where Lightning prints ``validate``'s and ``test``'s results."""
    print(text, flush=True)


def _show(trainer: pl.Trainer, headroom_bytes: int) -> None:
    if not show_in_progress_bar(trainer, "headroom_MiB", headroom_bytes / MiB):
        raise RuntimeError("this Lightning keeps no progress bar metrics to add the headroom to")

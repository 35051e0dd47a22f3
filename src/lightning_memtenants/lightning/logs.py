"""Where the reports go in a Lightning run: the loggers on Lightning's own cadence, TensorBoard's panels, the bar."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_memtenants._private import batches_that_stepped, show_in_progress_bar
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.render.table import Summary, summary_text, summary_to_markdown
from lightning_memtenants.render.tags import budget_metrics, metrics, rank_metrics
from lightning_memtenants.render.tensorboard import SUMMARY_MD, TensorBoardPanels
from lightning_memtenants.units import MiB


class Logs:
    """Logs a step's scalars where Lightning logs the user's own, and draws the panels.

    Lightning logs a training step when ``(batches_that_stepped + 1) % log_every_n_steps == 0``, at
    the step ``batches_that_stepped``; the same steps are measured and logged here, so that our scalars
    land beside the user's. The first optimizer step, where Adam's state appears, is always measured
    and logged as well.

    Args:
        every_n_steps: log every this many optimizer steps; ``None`` follows the trainer's ``log_every_n_steps``.
        desk_every_n_logs: with a TensorBoardLogger, draw the desk on every this-many-th logging step; ``0``:
            only at the end of fit. The pictures keep to a budget whatever the cadence (``TensorBoardPanels``):
            at most 2% of the fit's time, at most 50 of each in the event files, spread over the fit.
        info: how a notice is given (rank zero's).
        warn: how a failure of ours is reported.

    Attributes:
        panels: the TensorBoard panels, on rank zero with a TensorBoardLogger; else None.
    """

    def __init__(
        self,
        every_n_steps: int | None,
        *,
        desk_every_n_logs: int,
        info: Callable[[str], Any],
        warn: Callable[[str], Any],
    ) -> None:
        self.every_n_steps = every_n_steps
        self.desk_every_n_logs = desk_every_n_logs
        self.guard = Guard(warn, "logging")
        self.panels: TensorBoardPanels | None = None
        self._info = info
        self._warn = warn

    def open(self, trainer: pl.Trainer) -> None:
        """Find the TensorBoard loggers (rank zero draws) and write the custom-scalars layout.

        Args:
            trainer: the Trainer whose loggers get the reports.
        """
        self.panels = None
        boards = [logger for logger in trainer.loggers if is_tensorboard_logger(logger)]
        if trainer.loggers and not boards:
            names = ", ".join(type(logger).__name__ for logger in trainer.loggers)
            self._info(
                f"memtenants: {names} gets the scalars; the layout, desk picture and summary need a TensorBoardLogger"
            )
        if not boards or not trainer.is_global_zero:
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
        """The summary and the desk picture, at the end of fit, and the summary printed.

        The printed summary and the markdown one (TensorBoard's text panel and ``memtenants_summary.md``) are
        rendered from the same :class:`Summary`, so they say the same things in the same order.

        Args:
            trainer: the Trainer.
            summary: what :func:`fit_summary` built.
            desk: the step to draw.
            budget_bytes: the budget, or None.
            print_summary: also print the summary, on rank zero, through ``say``.
            say: how it is printed; None: :func:`print` to standard output.
        """
        if self.panels is not None:
            self.panels.on_fit_end(
                summary.reports,
                batches_that_stepped(trainer),
                budget_bytes,
                desk,
                summary=summary_to_markdown(summary),
            )
        if print_summary and trainer.is_global_zero:
            text = summary_text(summary)
            written = [d / SUMMARY_MD for d in (self.panels.log_dirs if self.panels is not None else [])]
            written = [path for path in written if path.is_file()]
            if written:
                text += f"\nmemtenants: the same summary in markdown: {', '.join(str(p) for p in written)}"
            (say or _print)(text)

    def postmortem(self, trainer: pl.Trainer, record: dict[str, Any], latest: StepReport | None) -> None:
        """The postmortem, as text in TensorBoard.

        Args:
            trainer: the Trainer.
            record: the postmortem record.
            latest: the last completed step, whose table goes with it, or None.
        """
        if self.panels is not None:
            self.panels.on_postmortem(record, batches_that_stepped(trainer), latest)


def is_tensorboard_logger(logger: Any) -> bool:
    """Whether ``logger`` is Lightning's TensorBoardLogger, from ``lightning.pytorch`` or ``pytorch_lightning``.

    The two packages ship the same class under two names; ``pytorch_lightning`` is not imported to ask.

    Args:
        logger: one of the trainer's loggers.

    Returns:
        True for either package's TensorBoardLogger or a subclass of it.
    """
    if isinstance(logger, TensorBoardLogger):
        return True
    return any(
        cls.__name__ == "TensorBoardLogger" and cls.__module__.startswith("pytorch_lightning.")
        for cls in type(logger).__mro__
    )


def _print(text: str) -> None:
    """The end-of-fit summary on standard output, where Lightning prints ``validate``'s and ``test``'s results."""
    print(text, flush=True)


def _show(trainer: pl.Trainer, headroom_bytes: int) -> None:
    if not show_in_progress_bar(trainer, "headroom_MiB", headroom_bytes / MiB):
        raise RuntimeError("this Lightning keeps no progress bar metrics to add the headroom to")

"""The end of fit's pictures and summary in the loggers other than TensorBoard: W&B, MLflow and CSV.

One small writer per logger kind, each showing what its logger can show; :class:`Logs` runs every call under its
guard on rank zero, so that a failing writer warns once and the fit goes on. wandb and mlflow are optional: the
loggers are recognised by Lightning's classes, which import without them, and only the W&B writer imports
``wandb``, when it writes (its logger has imported it by then).
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger

from lightning_memtenants.render.tags import DESK, POSTMORTEM, SUMMARY, tag
from lightning_memtenants.render.tensorboard import DESK_PNG, SUMMARY_MD
from lightning_memtenants.render.timeline import TIMELINE, TIMELINE_PNG

POSTMORTEM_MD = "memtenants_postmortem.md"
# the files the pictures are saved as, by their tag's name: the names TensorBoard's log dir gets
PICTURE_FILES = {DESK: DESK_PNG, TIMELINE: TIMELINE_PNG}


class Sink:
    """What a logger gets beyond the scalars; the base gets nothing, so an unknown logger stays as it was.

    Args:
        logger: the Lightning logger written to.

    Attributes:
        shows_pictures: whether it takes the desk and timeline pictures (the callback then records timelines).
        name: the logger's class name, for the guard's warning.
    """

    shows_pictures = False

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.name = type(logger).__name__

    def pictures(self, images: Mapping[str, np.ndarray], step: int) -> None:
        """The end of fit's pictures.

        Args:
            images: ``H x W x 3`` uint8 pixels by tag name (``desk``, ``timeline``), rendered once for every logger.
            step: the trainer's optimizer step.
        """

    def summary(self, markdown: str, text: str, step: int) -> Path | None:
        """The end-of-fit summary.

        Args:
            markdown: the summary in markdown (``summary_to_markdown``).
            text: the same summary as printed (``summary_text``).
            step: the trainer's optimizer step.

        Returns:
            The local file written, where one was; else None.
        """
        return None

    def postmortem(self, markdown: str, text: str, step: int) -> None:
        """The OOM postmortem, with the last completed step's table.

        Args:
            markdown: the postmortem in markdown.
            text: the same as plain text.
            step: the trainer's optimizer step.
        """


class WandbSink(Sink):
    """W&B: the pictures as ``wandb.Image`` media (``log_image``) and the summary as ``wandb.Html``.

    The summary is the printed text in a ``<pre>`` block, because W&B renders no markdown in a run's media and a
    ``log_text`` table would put the summary in one wrapped cell that loses the columns' alignment: preformatted,
    it reads in W&B's panel as it does in the terminal.
    """

    shows_pictures = True

    def _tag(self, name: str) -> str:
        return tag(name, separator=getattr(self.logger, "group_separator", "/"))

    def pictures(self, images: Mapping[str, np.ndarray], step: int) -> None:
        for name, pixels in images.items():
            self.logger.log_image(key=self._tag(name), images=[pixels], step=step)

    def summary(self, markdown: str, text: str, step: int) -> Path | None:
        self._html(SUMMARY, text, step)
        return None

    def postmortem(self, markdown: str, text: str, step: int) -> None:
        self._html(POSTMORTEM, text, step)

    def _html(self, name: str, text: str, step: int) -> None:
        import wandb  # the logger imported it already; this module must import without it

        self.logger.log_metrics({self._tag(name): wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step)


class MLFlowSink(Sink):
    """MLflow: the pictures and the summary as the run's artifacts, named as in TensorBoard's log dir."""

    shows_pictures = True

    def pictures(self, images: Mapping[str, np.ndarray], step: int) -> None:
        for name, pixels in images.items():
            self.logger.experiment.log_image(self.logger.run_id, pixels, artifact_file=PICTURE_FILES[name])

    def summary(self, markdown: str, text: str, step: int) -> Path | None:
        self.logger.experiment.log_text(self.logger.run_id, markdown + "\n", SUMMARY_MD)
        return None

    def postmortem(self, markdown: str, text: str, step: int) -> None:
        self.logger.experiment.log_text(self.logger.run_id, markdown + "\n", POSTMORTEM_MD)


class CSVSink(Sink):
    """CSV: the summary in markdown beside ``metrics.csv`` (the postmortem's files already go to the log dir)."""

    def summary(self, markdown: str, text: str, step: int) -> Path | None:
        directory = Path(self.logger.log_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / SUMMARY_MD
        path.write_text(markdown + "\n")
        return path


def sink_for(logger: Any) -> Sink | None:
    """The writer for ``logger``'s kind, or None for TensorBoard's (its panels) and loggers this package cannot show.

    Args:
        logger: one of the trainer's loggers.

    Returns:
        A :class:`WandbSink`, :class:`MLFlowSink` or :class:`CSVSink`, or None.
    """
    for cls, sink in ((WandbLogger, WandbSink), (MLFlowLogger, MLFlowSink), (CSVLogger, CSVSink)):
        if is_logger(logger, cls):
            return sink(logger)
    return None


def is_logger(logger: Any, cls: type) -> bool:
    """Whether ``logger`` is ``cls``, one of ``lightning.pytorch``'s loggers, or ``pytorch_lightning``'s same class.

    The two packages ship the same classes under two names; ``pytorch_lightning`` is not imported to ask.

    Args:
        logger: one of the trainer's loggers.
        cls: a logger class of ``lightning.pytorch.loggers``.

    Returns:
        True for either package's class or a subclass of it.
    """
    if isinstance(logger, cls):
        return True
    return any(
        base.__name__ == cls.__name__ and base.__module__.startswith("pytorch_lightning.")
        for base in type(logger).__mro__
    )

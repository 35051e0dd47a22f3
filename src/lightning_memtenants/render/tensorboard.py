"""TensorBoard panels: the custom-scalars layout, the desk picture and the markdown summary.

The builders take a :class:`StepReport` and return plain values (a layout dict, a matplotlib
figure, an RGB array, markdown), so a hand-written loop can log them with its own
``torch.utils.tensorboard.SummaryWriter``; :class:`TensorBoardPanels` writes them for the callback.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.names import PHASES, TENANTS
from lightning_memtenants.render.postmortem import postmortem_markdown
from lightning_memtenants.render.table import summary_markdown
from lightning_memtenants.render.tags import DESK, POSTMORTEM, SUMMARY, custom_scalars_layout, tag
from lightning_memtenants.units import MiB

DESK_PNG = "memtenants_desk.png"
SUMMARY_MD = "memtenants_summary.md"

# Matplotlib's default cycle, chosen so that the peak marker (black) and the budget (dark red) stand out.
_COLORS = {
    "weights": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer_state": "#2ca02c",
    "activations": "#9467bd",
    "other": "#8c8c8c",
    "fragmentation": "#d9d9d9",
}


def desk_figure(report: StepReport, budget_bytes: int | None = None) -> Figure:
    """One stacked bar per phase (tenants, other, fragmentation), each window's peak, the step's peak and the budget.

    The article's "desk": how much of the memory each tenant takes at each moment of the step,
    and how close the step comes to the edge. Drawn on a bare Agg figure, never through pyplot.

    Args:
        report: the step.
        budget_bytes: the budget, drawn as a line (or named in the title where it is far above the bars).

    Returns:
        The figure.
    """
    names = [name for name in PHASES if name in report.phases]
    phases = [report.phases[name] for name in names]
    layers: dict[str, list[float]] = {t: [p.tenants_bytes[t] / MiB for p in phases] for t in TENANTS}
    layers["other"] = [max(p.other_bytes or 0, 0) / MiB for p in phases]
    layers["fragmentation"] = [max(p.fragmentation_bytes or 0, 0) / MiB for p in phases]

    figure = Figure(figsize=(11, 5.6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    xs = np.arange(len(names))
    bottom = np.zeros(len(names))
    for label, heights in layers.items():
        if label in ("other", "fragmentation") and not any(heights):
            continue
        axes.bar(xs, heights, 0.6, bottom=bottom, label=label, color=_COLORS[label], edgecolor="white", linewidth=0.5)
        bottom += np.asarray(heights)
    windows = np.array([np.nan if p.window_peak_bytes is None else p.window_peak_bytes / MiB for p in phases])
    if not np.isnan(windows).all():
        axes.hlines(windows, xs - 0.4, xs + 0.4, colors="black", linestyles=":", linewidth=1.5, label="window peak")
    top = float(np.fmax(bottom, np.nan_to_num(windows)).max()) if len(bottom) else 0.0
    if report.peak_bytes is not None and report.peak_phase in names:
        x = names.index(report.peak_phase)
        peak = report.peak_bytes / MiB
        axes.plot([x], [peak], marker="*", markersize=16, color="black", linestyle="none", label="step peak")
        axes.annotate(
            f"peak {peak:,.2f} MiB", (x, peak), xytext=(-12, 10), textcoords="offset points", ha="right", fontsize=10
        )
        top = max(top, peak)
    budget_note = "no budget"
    if budget_bytes is not None:
        budget = budget_bytes / MiB
        if top == 0 or budget <= 3 * top:
            axes.axhline(budget, color="#8b0000", linestyle="--", linewidth=1.5, label=f"budget {budget:,.0f} MiB")
            top = max(top, budget)
            budget_note = ""
        else:
            budget_note = f"budget {budget:,.0f} MiB, above the chart"
    axes.set_ylim(0, top * 1.12 if top else 1)
    measured = [p.allocated_bytes is not None for p in phases]
    ticks = [f"{n}\n{t:,.1f} MiB" if m else n for n, t, m in zip(names, bottom, measured, strict=True)]
    axes.set_xticks(xs, ticks, fontsize=10)
    axes.set_ylabel("allocated (MiB)")
    axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)
    title = f"memtenants desk: optimizer step {report.step}, {report.memory_source}"
    axes.set_title(title + (f"; {budget_note}" if budget_note else ""), fontsize=12)
    handles, labels = axes.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] in layers)  # markers and lines first, then the stack
    stack = [i for i in order if labels[i] in layers][::-1]  # top of the stack first, as drawn
    order = [i for i in order if labels[i] not in layers] + stack
    axes.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left", bbox_to_anchor=(1.01, 1))
    return figure


def figure_rgb(figure: Figure) -> np.ndarray:
    """The figure rendered by Agg as an ``H x W x 3`` uint8 array (for ``SummaryWriter.add_image``).

    Args:
        figure: a matplotlib figure, such as :func:`desk_figure` draws.

    Returns:
        The RGB pixels.
    """
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


class TensorBoardPanels:
    """Writes the layout, the desk picture and the summary to a run's TensorBoard writers.

    ``writers`` are ``SummaryWriter``-like objects (``add_custom_scalars``, ``add_image``,
    ``add_text``, ``flush``); ``log_dirs`` receive the PNG and the markdown at the end. Each
    panel runs under this object's own guard, so a failing picture disables that picture
    only, never a measurement.

    Args:
        writers: the ``SummaryWriter``-like objects to write to.
        log_dirs: where the PNG and the markdown go at the end of fit.
        desk_every_n_logs: draw the desk on every this-many-th logging step (the first included); 0: only
            at the end of fit.
        separator: the logger's ``group_separator``.
        warn: how a failing panel is reported.
    """

    def __init__(
        self,
        writers: Sequence[Any],
        log_dirs: Sequence[str | Path] = (),
        *,
        desk_every_n_logs: int = 10,
        separator: str = "/",
        warn: Callable[[str], Any] = warnings.warn,
    ) -> None:
        self.writers = list(writers)
        self.log_dirs = [Path(d) for d in log_dirs]
        self.desk_every_n_logs = desk_every_n_logs
        self.separator = separator
        self.guard = Guard(warn, "drawing")
        self._logs = 0
        self._drawn: int | None = None  # the report step of the last picture, not to draw it twice
        self._last_log: tuple[int, int] | None = None  # (report step, logger step) of the last logged report

    def write_layout(self) -> None:
        """Write the custom-scalars layout (once per run)."""
        self.guard.run(
            "the tensorboard layout", self._each, "add_custom_scalars", custom_scalars_layout(self.separator)
        )

    def on_log(self, report: StepReport, step: int, budget_bytes: int | None = None) -> None:
        """On a logging step: the desk picture every ``desk_every_n_logs``-th logging step, the first included.

        Args:
            report: the step just logged.
            step: the logger's step, so that the picture lines up with the scalars.
            budget_bytes: the budget to draw, or None.
        """
        every, self._logs = self.desk_every_n_logs, self._logs + 1
        self._last_log = (report.step, step)
        if every and (self._logs - 1) % every == 0:
            self.guard.run("the desk picture", self._desk, report, step, budget_bytes, False)

    def on_fit_end(
        self, reports: Sequence[StepReport], step: int, budget_bytes: int | None = None, desk: StepReport | None = None
    ) -> None:
        """At the end of fit: the summary of ``reports`` as text, and the desk of ``desk`` as image and PNG.

        Args:
            reports: the steps to summarise (the first and the last).
            step: the logger's step, where a report was not logged.
            budget_bytes: the budget, or None.
            desk: the step to draw (the last measured one), or None.
        """
        if desk is not None:
            self.guard.run("the desk picture", self._desk, desk, self._logger_step(desk, step), budget_bytes, True)
        if reports:
            self.guard.run(
                "the text summary", self._summary, reports, self._logger_step(reports[-1], step), budget_bytes
            )

    def on_postmortem(self, record: dict[str, Any], step: int, latest: StepReport | None = None) -> None:
        """After an OOM: the postmortem record and the last completed step's table, as text.

        Args:
            record: the postmortem record.
            step: the logger's step.
            latest: the last completed step, or None.
        """
        self.guard.run("the text summary", self._postmortem, record, step, latest)

    def _logger_step(self, report: StepReport, default: int) -> int:
        """The step this report's scalars were logged at, so that its picture and table line up with them."""
        return self._last_log[1] if self._last_log is not None and self._last_log[0] == report.step else default

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        for writer in self.writers:
            getattr(writer, method)(*args, **kwargs)

    def _tag(self, name: str) -> str:
        return tag(name, separator=self.separator)

    def _desk(self, report: StepReport, step: int, budget_bytes: int | None, save: bool) -> None:
        figure = desk_figure(report, budget_bytes)
        if report.step != self._drawn:
            self._drawn = report.step
            self._each("add_image", self._tag(DESK), figure_rgb(figure), step, dataformats="HWC")
        if save:
            for directory in self.log_dirs:
                directory.mkdir(parents=True, exist_ok=True)
                figure.savefig(directory / DESK_PNG, format="png")

    def _summary(self, reports: Sequence[StepReport], step: int, budget_bytes: int | None) -> None:
        text = "\n\n".join(summary_markdown(report, budget_bytes) for report in reports)
        self._each("add_text", self._tag(SUMMARY), text, step)
        self._each("flush")
        for directory in self.log_dirs:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / SUMMARY_MD).write_text(text + "\n")

    def _postmortem(self, record: dict[str, Any], step: int, latest: StepReport | None) -> None:
        text = postmortem_markdown(record)
        if latest is not None:
            text += "\n\nThe last completed step:\n\n" + summary_markdown(latest)
        self._each("add_text", self._tag(POSTMORTEM), text, step)
        self._each("flush")

"""TensorBoard panels: the custom-scalars layout, the desk picture, the timeline and the markdown summary.

The builders take a :class:`StepReport` and return plain values (a layout dict, a matplotlib
figure, an RGB array, markdown), so a hand-written loop can log them with its own
``torch.utils.tensorboard.SummaryWriter``; :class:`TensorBoardPanels` writes them for the callback.
"""

from __future__ import annotations

import math
import textwrap
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.image import imsave

from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.timeline import timeline_of
from lightning_memtenants.names import PHASES, TENANTS
from lightning_memtenants.render.postmortem import postmortem_markdown
from lightning_memtenants.render.table import step_name, summary_markdown
from lightning_memtenants.render.tags import DESK, POSTMORTEM, SUMMARY, custom_scalars_layout, tag
from lightning_memtenants.render.timeline import TIMELINE, TIMELINE_PNG, timeline_figure
from lightning_memtenants.units import MiB

DESK_PNG = "memtenants_desk.png"
DESK_FIRST_PNG = "memtenants_desk_first.png"
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
WINDOW_PEAK = "window peak"
# The pictures' budget in a fit: the share of the fit's time spent drawing them, and how many of each are written.
MAX_DRAWING_SHARE = 0.02
MAX_PICTURES = 50
# What a desk and timeline pair costs to draw and write (matplotlib's Agg, 1100 x 560 pixels each, and the events'
# PNGs), before one has been drawn: about 0.65 s on one core of a 2-core machine, 0.3 s on a fast one.
FIRST_PAIR_S = 0.6
# A layer thinner than this share of the chart gets its value written on it.
_THIN = 0.04


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
    drawn: list[tuple[str, np.ndarray, np.ndarray]] = []
    for label, heights in layers.items():
        if label in ("other", "fragmentation") and not any(heights):
            continue
        axes.bar(xs, heights, 0.6, bottom=bottom, label=label, color=_COLORS[label], edgecolor="white", linewidth=0.5)
        drawn.append((label, bottom.copy(), np.asarray(heights)))
        bottom += np.asarray(heights)
    windows = np.array([np.nan if p.window_peak_bytes is None else p.window_peak_bytes / MiB for p in phases])
    if not np.isnan(windows).all():
        axes.hlines(windows, xs - 0.4, xs + 0.4, colors="black", linestyles=":", linewidth=1.5, label=WINDOW_PEAK)
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
    _label_thin_layers(axes, drawn, top)
    measured = [p.allocated_bytes is not None for p in phases]
    ticks = [f"{n}\n{t:,.1f} MiB" if m else n for n, t, m in zip(names, bottom, measured, strict=True)]
    axes.set_xticks(xs, ticks, fontsize=9)
    axes.set_ylabel("allocated (MiB)")
    axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)
    title = f"memtenants desk: {step_name(report)}, {report.memory_source}"
    axes.set_title(title + (f"; {budget_note}" if budget_note else ""), fontsize=12)
    handles, labels = axes.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] in layers)  # markers and lines first, then the stack
    stack = [i for i in order if labels[i] in layers][::-1]  # top of the stack first, as drawn
    order = [i for i in order if labels[i] not in layers] + stack
    axes.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left", bbox_to_anchor=(1.01, 1))
    caption = desk_caption(report)
    if caption:
        figure.supxlabel(caption, x=0.01, ha="left", fontsize=9, linespacing=1.3)
    return figure


def desk_caption(report: StepReport) -> str:
    """The words under the desk: why the star sits where it does (the peak's explanation), wrapped."""
    if report.peak_bytes is None:
        return textwrap.fill(report.peak_explanation, 150)
    lines = [
        f"Star: the step's true peak ({report.peak_bytes / MiB:,.2f} MiB, in the window ending at {report.peak_phase})."
        " Each bar is a snapshot at its phase; the peak can fall between snapshots."
        " Dotted: the window peak, the highest allocated since the phase before."
    ]
    lines.append("Why: " + report.peak_explanation.removeprefix("- "))
    return "\n".join(textwrap.fill(line, 150, subsequent_indent="    ") for line in lines)


def _label_thin_layers(axes: Any, drawn: list[tuple[str, np.ndarray, np.ndarray]], top: float) -> None:
    """Write the value on each layer too thin to read against the chart's height (9 MiB of activations)."""
    if top <= 0:
        return
    tops = sum(heights for _, _, heights in drawn)
    stacked = [0] * len(tops)  # labels already written above each bar
    for label, bottoms, heights in drawn:
        if label not in TENANTS:  # other and fragmentation: named in the legend, never thin enough to matter
            continue
        for x, (base, height) in enumerate(zip(bottoms, heights, strict=True)):
            if 0 < height < _THIN * top:
                stacked[x] += 1
                axes.annotate(
                    f"{label} {height:,.2f} MiB",
                    (x + 0.3, base + height / 2),
                    xytext=(x, tops[x] + (0.06 + 0.05 * stacked[x]) * top),
                    textcoords="data",
                    ha="center",
                    va="bottom",
                    fontsize=8.5,
                    color=_COLORS[label],
                    fontweight="bold",
                    arrowprops={"arrowstyle": "-", "color": _COLORS[label], "linewidth": 1, "shrinkB": 0},
                )


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


def desk_pixels(report: StepReport, budget_bytes: int | None = None) -> np.ndarray:
    """The desk of ``report`` rendered once as RGB pixels, for TensorBoard, the PNG and any other logger.

    Args:
        report: the step.
        budget_bytes: the budget, or None.

    Returns:
        The ``H x W x 3`` uint8 pixels of :func:`desk_figure`.
    """
    return figure_rgb(desk_figure(report, budget_bytes))


def timeline_pixels(report: StepReport, budget_bytes: int | None = None) -> np.ndarray | None:
    """The timeline of ``report`` rendered once as RGB pixels, or None where the step recorded none.

    Args:
        report: the step (a timeline is recorded on the steps the live-tensor tracker measures).
        budget_bytes: the budget, or None.

    Returns:
        The ``H x W x 3`` uint8 pixels of :func:`timeline_figure`, or None.
    """
    line = timeline_of(report)
    return None if line is None else figure_rgb(timeline_figure(line, budget_bytes))


class TensorBoardPanels:
    """Writes the layout, the desk picture and the summary to a run's TensorBoard writers.

    ``writers`` are ``SummaryWriter``-like objects (``add_custom_scalars``, ``add_image``,
    ``add_text``, ``flush``); ``log_dirs`` receive the PNG and the markdown at the end. Each
    panel runs under this object's own guard, so a failing picture disables that picture
    only, never a measurement.

    The pictures cost a bounded share of the fit whatever the cadence: a desk and timeline pair (some 0.3 to 0.65 s
    of matplotlib, some 130 KB of events) is drawn during the fit only while the time spent drawing, the next pair
    and the end of fit's included (each estimated as the last pair's cost), stays within ``max_drawing_share`` of
    the time since this object was made (the fit's start); and at most ``max_pictures`` desks (and as many
    timelines) go to the event files in a fit, the last at its end. Where the fit's length is known
    (``planned_logs``), the in-fit pictures are spread over it rather than spent at its start. The first pair is
    held to the same share, with ``first_pair_s`` as its estimated cost, so that a fit of seconds draws no picture
    until it has run long enough to pay for it and for the end of fit's pair, the summary's, which is always drawn:
    all the pictures of a fit longer than about a minute keep to the share, and a shorter fit spends on that one
    pair what it costs.

    Args:
        writers: the ``SummaryWriter``-like objects to write to.
        log_dirs: where the PNG and the markdown go at the end of fit.
        desk_every_n_logs: draw the desk on every this-many-th logging step (the first included); 0: only
            at the end of fit.
        separator: the logger's ``group_separator``.
        warn: how a failing panel is reported.
        max_drawing_share: the largest share of the fit's time (``time.perf_counter``) that drawing the in-fit
            pictures may take, in (0, 1].
        max_pictures: the most desk pictures (and timelines) written to the event files in a fit, the end of fit's
            included; at least 1.
        planned_logs: how many logging steps the fit will have, where known (the trainer's estimated steps over
            its logging cadence); None: unknown.
        clock: the clock the share is measured with (seconds).
        first_pair_s: the estimated cost of the first pair, in seconds, 0 or more (later pairs are estimated at the
            last pair's measured cost).

    Attributes:
        drawing_s: the seconds spent drawing pictures since this object was made, the end of fit's included.
        end_pictures: the end of fit's pixels by name (``desk``, ``timeline``), kept for the other loggers.
        pictures: the desk pictures drawn during the fit (not counting the end of fit's).
        skipped: the desk pictures the cadence asked for that the budget left out.

    Raises:
        ValueError: if ``max_drawing_share`` is not in (0, 1], ``max_pictures`` is not a positive int, or
            ``first_pair_s`` is not a number of seconds, 0 or more.
    """

    def __init__(
        self,
        writers: Sequence[Any],
        log_dirs: Sequence[str | Path] = (),
        *,
        desk_every_n_logs: int = 10,
        separator: str = "/",
        warn: Callable[[str], Any] = warnings.warn,
        max_drawing_share: float = MAX_DRAWING_SHARE,
        max_pictures: int = MAX_PICTURES,
        planned_logs: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        first_pair_s: float = FIRST_PAIR_S,
    ) -> None:
        if isinstance(max_drawing_share, bool) or not isinstance(max_drawing_share, (int, float)):
            raise ValueError(f"max_drawing_share must be a number in (0, 1], got {max_drawing_share!r}")
        if not 0 < max_drawing_share <= 1:
            raise ValueError(f"max_drawing_share must be a number in (0, 1], got {max_drawing_share!r}")
        if isinstance(max_pictures, bool) or not isinstance(max_pictures, int) or max_pictures < 1:
            raise ValueError(f"max_pictures must be a positive int, got {max_pictures!r}")
        if isinstance(first_pair_s, bool) or not isinstance(first_pair_s, (int, float)) or not first_pair_s >= 0:
            raise ValueError(f"first_pair_s must be a number of seconds, 0 or more, got {first_pair_s!r}")
        self.writers = list(writers)
        self.log_dirs = [Path(d) for d in log_dirs]
        self.desk_every_n_logs = desk_every_n_logs
        self.separator = separator
        self.guard = Guard(warn, "drawing")
        self._logs = 0
        self._drawn: int | None = None  # the report step of the last picture, not to draw it twice
        self._timeline_drawn: int | None = None
        self._last_log: tuple[int, int] | None = None  # (report step, logger step) of the last logged report
        self.max_drawing_share = float(max_drawing_share)
        self.max_pictures = max_pictures
        self._clock = clock
        self._started = clock()
        self.drawing_s = 0.0
        self.pictures = 0
        self.skipped = 0
        self.end_pictures: dict[str, np.ndarray] = {}
        self._cost_s = float(first_pair_s)  # what the last in-fit pair cost: the estimate of the next one's
        self._every = desk_every_n_logs
        if desk_every_n_logs and planned_logs is not None and max_pictures > 1:
            # spread the in-fit pictures (one is kept for the end) over the fit, rather than spend them at its start
            self._every = max(desk_every_n_logs, math.ceil(planned_logs / (max_pictures - 1)))

    def write_layout(self) -> None:
        """Write the custom-scalars layout (once per run)."""
        self.guard.run(
            "the tensorboard layout", self._each, "add_custom_scalars", custom_scalars_layout(self.separator)
        )

    def on_log(self, report: StepReport, step: int, budget_bytes: int | None = None) -> None:
        """On a logging step: the desk and timeline pictures every ``desk_every_n_logs``-th logging step, the first
        included, within the pictures' budget (see the class).

        Args:
            report: the step just logged.
            step: the logger's step, so that the picture lines up with the scalars.
            budget_bytes: the budget to draw, or None.
        """
        every, self._logs = self._every, self._logs + 1
        self._last_log = (report.step, step)
        if not every or (self._logs - 1) % every:
            return
        if not self._may_draw():
            self.skipped += 1
            return
        start = self._clock()
        self.guard.run("the desk picture", self._desk, report, step, budget_bytes, False)
        self.guard.run("the timeline", self._timeline, report, step, budget_bytes, False)
        self._cost_s = self._clock() - start
        self.drawing_s += self._cost_s
        self.pictures += 1

    def _may_draw(self) -> bool:
        """Whether an in-fit pair fits the budget: never the one kept for the end of fit; else while the time spent
        drawing, the next pair and the end of fit's included (each estimated at the last pair's cost), stays within
        the share of the time since the start."""
        if self.pictures >= self.max_pictures - 1:
            return False
        elapsed = self._clock() - self._started
        return self.drawing_s + 2 * self._cost_s <= self.max_drawing_share * elapsed

    def on_fit_end(
        self,
        reports: Sequence[StepReport],
        step: int,
        budget_bytes: int | None = None,
        desk: StepReport | None = None,
        summary: str | None = None,
    ) -> None:
        """At the end of fit: the summary of ``reports`` as text, and the desk of ``desk`` as image and PNG.

        Args:
            reports: the steps to summarise (the first and the last).
            step: the logger's step, where a report was not logged.
            budget_bytes: the budget, or None.
            desk: the step to draw (the last measured one), or None.
            summary: the summary's markdown as the callback prints it (``render.table.summary_to_markdown``);
                None: each report's table.
        """
        if desk is not None:
            start = self._clock()
            self.guard.run("the desk picture", self._desk, desk, self._logger_step(desk, step), budget_bytes, True)
            self.guard.run("the timeline", self._timeline, desk, self._logger_step(desk, step), budget_bytes, True)
            first = reports[0] if reports else None
            if first is not None and first.step != desk.step and first.peak_bytes is not None:
                self.guard.run("the desk picture", self._desk_first, first, budget_bytes)
            self.drawing_s += self._clock() - start
        if reports:
            self.guard.run(
                "the text summary", self._summary, reports, self._logger_step(reports[-1], step), budget_bytes, summary
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
        if report.step == self._drawn and not save:
            return
        pixels = desk_pixels(report, budget_bytes)  # rendered once, for the event, the PNG and the other loggers
        if report.step != self._drawn:
            self._drawn = report.step
            self._each("add_image", self._tag(DESK), pixels, step, dataformats="HWC")
        if save:
            self.end_pictures[DESK] = pixels
            self._save(pixels, DESK_PNG)

    def _timeline(self, report: StepReport, step: int, budget_bytes: int | None, save: bool) -> None:
        if report.step == self._timeline_drawn and not save:
            return
        pixels = timeline_pixels(report, budget_bytes)
        if pixels is None:  # a step the live-tensor tracker did not measure (or a CUDA run): no timeline
            return
        if report.step != self._timeline_drawn:
            self._timeline_drawn = report.step
            self._each("add_image", self._tag(TIMELINE), pixels, step, dataformats="HWC")
        if save:
            self.end_pictures[TIMELINE] = pixels
            self._save(pixels, TIMELINE_PNG)

    def _desk_first(self, report: StepReport, budget_bytes: int | None) -> None:
        """The first step's desk, where the optimizer state appears, saved beside the last step's."""
        self._save(desk_pixels(report, budget_bytes), DESK_FIRST_PNG)

    def _save(self, pixels: np.ndarray, name: str) -> None:
        """The rendered pixels as a PNG in each log dir (no second rendering, as ``savefig`` would do)."""
        for directory in self.log_dirs:
            directory.mkdir(parents=True, exist_ok=True)
            imsave(directory / name, pixels, format="png")

    def _summary(
        self, reports: Sequence[StepReport], step: int, budget_bytes: int | None, summary: str | None = None
    ) -> None:
        text = summary if summary is not None else "\n\n".join(summary_markdown(r, budget_bytes) for r in reports)
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

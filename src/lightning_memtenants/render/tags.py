"""Every logged tag, built in one place: the scalars of a report, the per-rank figures and the custom-scalars layout.

Tags are ``memtenants`` joined with the logger's ``group_separator`` (``/`` for Lightning's loggers), and
every scalar's name carries its unit.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_memtenants.core.record import StepReport
from lightning_memtenants.names import LOOP_NAMES, PHASES, TENANTS
from lightning_memtenants.units import MiB

ROOT = "memtenants"
DESK = "desk"
SUMMARY = "summary"
POSTMORTEM = "postmortem"
# The per-rank figures gathered on logging steps of a distributed run, in this order.
RANK_FIELDS: tuple[str, ...] = ("weights", "gradients", "optimizer_state", "activations", "fixed_measured", "peak")


def tag(*parts: str, separator: str = "/") -> str:
    """``memtenants`` and ``parts`` joined by the logger's separator.

    Args:
        *parts: the tag's parts after ``memtenants``.
        separator: the logger's ``group_separator``.

    Returns:
        The tag.
    """
    return separator.join((ROOT, *parts))


def metrics(report: StepReport, separator: str = "/") -> dict[str, float]:
    """The scalars logged for one step, keyed by tag, in MiB; figures that were not measured are left out.

    Args:
        report: the step.
        separator: the logger's ``group_separator``.

    Returns:
        Each tag and its value in MiB, sorted by tag.
    """
    values: dict[tuple[str, ...], int | None] = {(f"{name}_MiB",): v for name, v in report.tenants_bytes.items()}
    values[("tenant_sum_MiB",)] = report.tenant_sum_bytes
    values[("fixed_expected_MiB",)] = report.expected_fixed_bytes
    values[("fixed_measured_MiB",)] = report.measured_fixed_bytes
    values[("fixed_deviation_MiB",)] = report.fixed_deviation_bytes
    values[("peak_MiB",)] = report.peak_bytes
    values[("peak_minus_sum_MiB",)] = report.peak_minus_sum_bytes
    values[("peak_reserved_MiB",)] = report.peak_reserved_bytes
    values[("other_MiB",)] = report.other_bytes
    for name, phase in report.phases.items():
        values[("allocated", f"{name}_MiB")] = phase.allocated_bytes
        values[("window_peak", f"{name}_MiB")] = phase.window_peak_bytes
        if name == "batch_end":
            values[("reserved_MiB",)] = phase.reserved_bytes
            values[("fragmentation_MiB",)] = phase.fragmentation_bytes
    for name, value in report.parts_bytes.items():
        values[("part", f"{name}_MiB")] = value
    out = {tag(*key, separator=separator): v / MiB for key, v in values.items() if v is not None}
    return dict(sorted(out.items()))


def evaluation_metrics(
    report: StepReport,
    separator: str = "/",
    *,
    headroom_bytes: int | None = None,
    max_batch_size: int | None = None,
) -> dict[str, float]:
    """The scalars logged for an evaluation loop, under ``memtenants/<loop>/`` (``validation``, ``test``, ``predict``).

    They are the figures of the loop's measured batch with the highest peak: its tenants, the peak, ``other`` and
    what was allocated at its start; with a budget, the headroom and the largest batch of that loop.

    Args:
        report: the batch (``stage`` not ``"train"``).
        separator: the logger's ``group_separator``.
        headroom_bytes: the budget less the peak, or None.
        max_batch_size: the largest evaluation batch that fits the budget less the margin, or None.

    Returns:
        Each tag and its value (MiB, or samples for ``max_batch_size``); figures not measured are left out.
    """
    loop = LOOP_NAMES[report.stage]
    values: dict[str, int | None] = {f"{name}_MiB": v for name, v in report.tenants_bytes.items()}
    values["tenant_sum_MiB"] = report.tenant_sum_bytes
    values["peak_MiB"] = report.peak_bytes
    values["peak_minus_sum_MiB"] = report.peak_minus_sum_bytes
    values["peak_reserved_MiB"] = report.peak_reserved_bytes
    values["other_MiB"] = report.other_bytes
    start = report.phases.get("batch_start")
    values["allocated_at_start_MiB"] = start.allocated_bytes if start is not None else None
    values["headroom_MiB"] = headroom_bytes
    out = {tag(loop, key, separator=separator): v / MiB for key, v in values.items() if v is not None}
    if max_batch_size is not None:
        out[tag(loop, "max_batch_size", separator=separator)] = float(max_batch_size)
    return dict(sorted(out.items()))


def budget_metrics(headroom_bytes: int | None, max_batch_size: int | None, separator: str = "/") -> dict[str, float]:
    """The headroom under the budget (MiB) and the largest batch that fits (samples), where known.

    Args:
        headroom_bytes: the budget less the step's peak, or None.
        max_batch_size: the forecast's largest batch, or None.
        separator: the logger's ``group_separator``.

    Returns:
        The tags for the figures that are known.
    """
    out = {}
    if headroom_bytes is not None:
        out[tag("headroom_MiB", separator=separator)] = headroom_bytes / MiB
    if max_batch_size is not None:
        out[tag("max_batch_size", separator=separator)] = float(max_batch_size)
    return out


def rank_vector(report: StepReport | None) -> list[float]:
    """This rank's figures in MiB, in the order of ``RANK_FIELDS``; NaN where not measured (or no report).

    Every rank sends a vector of the same length, so the gather never waits on a rank that measured nothing.

    Args:
        report: this rank's step, or None.

    Returns:
        One float per ``RANK_FIELDS`` entry.
    """
    if report is None:
        return [math.nan] * len(RANK_FIELDS)
    known: dict[str, int | None] = {**report.tenants_bytes}
    known.update(fixed_measured=report.measured_fixed_bytes, peak=report.peak_bytes)
    return [math.nan if known.get(name) is None else known[name] / MiB for name in RANK_FIELDS]  # type: ignore[operator]


def rank_metrics(table: list[list[float]], separator: str = "/") -> dict[str, float]:
    """Tags for a (world size x fields) table: each rank's figures, and their max and min over ranks.

    Args:
        table: one :func:`rank_vector` per rank, in rank order.
        separator: the logger's ``group_separator``.

    Returns:
        The tags; NaN figures are left out.
    """
    out: dict[str, float] = {}
    for column, name in enumerate(RANK_FIELDS):
        values = [row[column] for row in table]
        for rank, value in enumerate(values):
            if not math.isnan(value):
                out[tag(f"rank_{rank}", f"{name}_MiB", separator=separator)] = value
        known = [v for v in values if not math.isnan(v)]
        if known:
            out[tag("ranks_max", f"{name}_MiB", separator=separator)] = max(known)
            out[tag("ranks_min", f"{name}_MiB", separator=separator)] = min(known)
    return out


def custom_scalars_layout(separator: str = "/") -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout, in ``SummaryWriter.add_custom_scalars`` form: one category, one chart per question.

    Every entry is a logged tag (TensorBoard reads them as regular expressions matched from the start).

    Args:
        separator: the logger's ``group_separator``.

    Returns:
        The layout.
    """

    def t(*parts: str) -> str:
        return tag(*parts, separator=separator)

    return {
        ROOT: {
            "tenants (MiB)": ["Multiline", [t(f"{name}_MiB") for name in (*TENANTS, "other")]],
            "peak vs sum of tenants (MiB)": ["Multiline", [t("peak_MiB"), t("tenant_sum_MiB")]],
            "peak: training vs validation (MiB)": ["Multiline", [t("peak_MiB"), t("validation", "peak_MiB")]],
            "fixed cost: expected vs measured (MiB)": ["Multiline", [t("fixed_expected_MiB"), t("fixed_measured_MiB")]],
            "headroom (MiB)": ["Multiline", [t("headroom_MiB"), t("validation", "headroom_MiB")]],
            "max batch size (samples)": ["Multiline", [t("max_batch_size")]],
            "allocated per phase (MiB)": ["Multiline", [t("allocated", f"{phase}_MiB") for phase in PHASES]],
            "window peak per phase (MiB)": ["Multiline", [t("window_peak", f"{phase}_MiB") for phase in PHASES]],
        }
    }

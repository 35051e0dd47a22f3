"""The step's table: one model of rows and lines, rendered as plain text and as markdown.

Both renderers print the same rows and the same lines in the same order; only the markup differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_memtenants.analysis.budget import Budget
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.names import PARTS, PHASES, TENANTS
from lightning_memtenants.units import mib

COLUMNS: tuple[str, ...] = (*TENANTS, "other", "allocated", "window peak")
HIGH_WATER = "high-water mark"


@dataclass(frozen=True)
class Table:
    """What a step's table shows: a title, rows of bytes (None: not measured) and the lines under it.

    Args:
        title: the table's heading.
        source: the memory source, in words.
        rows: one row per phase and the high-water marks: a label and one cell per ``COLUMNS`` entry.
        lines: the sentences under the table.
    """

    title: str
    source: str
    rows: list[tuple[str, list[int | None]]]
    lines: list[str]


def step_table(report: StepReport, budget_bytes: int | None = None) -> Table:
    """The table of ``report``: its phases, the high-water marks, then the peak, the notes and the fixed cost.

    Args:
        report: the step.
        budget_bytes: the run's budget, for a last line with the headroom; None leaves it out.

    Returns:
        The table, for :func:`to_text` or :func:`to_markdown`.
    """
    rows: list[tuple[str, list[int | None]]] = []
    for name in PHASES:
        phase = report.phases.get(name)
        if phase is not None:
            cells = [phase.tenants_bytes[t] for t in TENANTS]
            rows.append((name, [*cells, phase.other_bytes, phase.allocated_bytes, phase.window_peak_bytes]))
    high = [report.tenants_bytes[t] for t in TENANTS]
    rows.append((HIGH_WATER, [*high, report.other_bytes, None, report.peak_bytes]))
    largest = report.largest_tenant
    peak = "peak not measured" if report.peak_bytes is None else f"peak {mib(report.peak_bytes)} MiB"
    lines = [
        f"{peak}; largest tenant {largest} {mib(report.tenants_bytes[largest])} MiB;"
        f" sum of tenants {mib(report.tenant_sum_bytes)} MiB",
        report.peak_explanation,
    ]
    for name, value in report.parts_bytes.items():
        lines.append(f"{name}: {value:,} bytes at its high-water mark ({PARTS.get(name, 'a named part')})")
    lines.extend(report.notes)
    measured = f"measured {report.measured_fixed_bytes:,} bytes ({mib(report.measured_fixed_bytes)} MiB)"
    if report.expected_fixed_bytes is None:
        lines.append(f"fixed cost (weights + gradients + optimizer state): {measured}; the formula was not checked")
    else:
        expected = report.expected_fixed_bytes
        lines.append(
            f"fixed cost (weights + gradients + optimizer state): expected {expected:,} bytes"
            f" ({mib(expected)} MiB), {measured}"
        )
        if report.fixed_deviation_bytes == 0:
            lines.append("the measured fixed cost matches the formula to the byte")
    lines.extend(report.fixed_cost_notes)
    if budget_bytes is not None:
        headroom = "" if report.peak_bytes is None else f"; headroom {mib(budget_bytes - report.peak_bytes)} MiB"
        lines.append(f"budget {mib(budget_bytes)} MiB{headroom}")
    return Table(f"memtenants: optimizer step {report.step}", report.memory_source, rows, lines)


def to_text(table: Table) -> str:
    """The table in fixed-width columns, for a terminal or a log.

    Args:
        table: what :func:`step_table` built.

    Returns:
        The text, sizes in MiB.
    """
    width = max(len(name) for name in (*PHASES, HIGH_WATER))
    header = f"{'phase (MiB)':<{width}}" + "".join(f"{c:>16}" for c in COLUMNS)
    out = [f"{table.title} (memory source: {table.source})", header, "-" * len(header)]
    out += [f"{name:<{width}}" + "".join(f"{mib(c):>16}" for c in cells) for name, cells in table.rows]
    return "\n".join([*out, "", *(f"- {line}" for line in table.lines)])


def to_markdown(table: Table) -> str:
    """The table in markdown, for TensorBoard's text panel and ``memtenants_summary.md``.

    Args:
        table: what :func:`step_table` built.

    Returns:
        The markdown, sizes in MiB.
    """
    out = [
        f"### {table.title}",
        "",
        f"Memory source: {table.source}. Sizes in MiB (2^20 bytes).",
        "",
        "| phase | " + " | ".join(f"`{c}`" if c in TENANTS else c for c in COLUMNS) + " |",
        "|---" + "|---:" * len(COLUMNS) + "|",
    ]
    for name, cells in table.rows:
        label = f"**{name}**" if name == HIGH_WATER else f"`{name}`"
        out.append(f"| {label} | " + " | ".join(mib(c) for c in cells) + " |")
    return "\n".join([*out, "", *(f"- {line}" for line in table.lines)])


def format_table(report: StepReport, budget_bytes: int | None = None) -> str:
    """A plain-text table like the article's: tenants (MiB) at each phase, the peak, the fixed-cost check.

    Args:
        report: the step to print.
        budget_bytes: the run's budget, for a last line with the headroom; None leaves it out.

    Returns:
        The table and the lines under it, as text.
    """
    return to_text(step_table(report, budget_bytes))


def summary_markdown(report: StepReport, budget_bytes: int | None = None) -> str:
    """The same table as :func:`format_table`, in markdown.

    Args:
        report: the step to print.
        budget_bytes: the run's budget, for a last line with the headroom; None leaves it out.

    Returns:
        The table and the lines under it, as markdown.
    """
    return to_markdown(step_table(report, budget_bytes))


def fits_text(budget_bytes: int, margin: float) -> str:
    """What a largest batch fits, in the words every output that gives one uses.

    Args:
        budget_bytes: the budget, before the margin.
        margin: the fraction of it kept free.

    Returns:
        For example ``"fits 24 GiB less a 5% margin (23,347.20 MiB)"``.
    """
    gib = 2**30
    whole = f"{budget_bytes // gib:,} GiB" if budget_bytes >= gib and budget_bytes % gib == 0 else None
    if whole is None:
        whole = f"{budget_bytes / 2**20:,.0f} MiB" if budget_bytes % 2**20 == 0 else f"{mib(budget_bytes)} MiB"
    return f"fits {whole} less a {margin:.0%} margin ({mib(Budget(budget_bytes, margin).limit_bytes)} MiB)"

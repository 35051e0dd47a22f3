"""The step's table and the end-of-fit summary: one model of rows and lines, rendered as plain text and as markdown.

Both renderers print the same rows and the same lines in the same order; only the markup differs. The
columns of a phase add up: the tenants, the named parts and ``other`` sum to ``allocated``, and where the
allocator reserves (CUDA), ``allocated`` and ``fragmentation`` sum to ``reserved``; ``reserved peak`` is the highest
``reserved`` of the window, as ``window peak`` is of ``allocated``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lightning_memtenants.analysis.budget import Budget
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.timeline import OTHER_MODULES, OUTSIDE_MODULES
from lightning_memtenants.names import PARTS, PHASES, TENANTS
from lightning_memtenants.units import mib

# The columns every table has; the named parts present in a step come after the tenants, and on an allocator
# that reserves, ``fragmentation`` and ``reserved`` after ``allocated``, and ``reserved peak`` where the window's
# highest reserved bytes were read (see :func:`columns_for`).
COLUMNS: tuple[str, ...] = (*TENANTS, "other", "allocated", "window peak")
RESERVED_COLUMNS: tuple[str, ...] = ("fragmentation", "reserved")
RESERVED_PEAK = "reserved peak"
HIGH_WATER = "high-water mark"
CELL = 16  # the width of a column of the text table, wider where its name is longer
SUMMARY_HEADING = "memtenants: the fit"
NOT_MEASURED = "peak not measured: "


@dataclass(frozen=True)
class Table:
    """What a step's table shows: a title, rows of bytes (None: not measured) and the lines under it.

    Args:
        title: the table's heading.
        source: the memory source, in words.
        rows: one row per phase and the high-water marks: a label and one cell per ``columns`` entry.
        lines: the sentences under the table.
        columns: the columns' names (:func:`columns_for`).
    """

    title: str
    source: str
    rows: list[tuple[str, list[int | None]]]
    lines: list[str]
    columns: tuple[str, ...] = COLUMNS


def columns_for(report: StepReport) -> tuple[str, ...]:
    """The columns of ``report``'s table: the tenants, its named parts, ``other``, ``allocated`` and the peak.

    A named part (``names.PARTS``: the cuBLAS workspace, the autocast cache, ...) has a column where the step
    measured it, so that the tenants, the parts and ``other`` add up to ``allocated``; where the memory source
    read reserved bytes (CUDA, a ``--target`` GPU), ``fragmentation`` and ``reserved`` follow ``allocated``, and
    ``reserved peak`` (the window's highest reserved bytes) follows them where the source read it.

    Args:
        report: the step.

    Returns:
        The columns' names, in order.
    """
    phases = [p for mb in report.micro_batches for p in mb.values()] or list(report.phases.values())
    parts = tuple(name for name in PARTS if any(name in p.parts_bytes for p in phases))
    reserved = RESERVED_COLUMNS if any(p.reserved_bytes is not None for p in phases) else ()
    if any(p.reserved_peak_bytes is not None for p in phases):
        reserved = (*reserved, RESERVED_PEAK)
    return (*TENANTS, *parts, "other", "allocated", *reserved, "window peak")


def step_table(report: StepReport, budget_bytes: int | None = None, title: str | None = None) -> Table:
    """The table of ``report``: its phases, the high-water marks, then the peak, the notes and the fixed cost.

    A step whose tenants were carried rather than counted (``tenants_from_step``) says so in its heading, and its
    notes say from where.

    Args:
        report: the step.
        budget_bytes: the run's budget, for a last line with the headroom; None leaves it out.
        title: the heading; None: ``memtenants: optimizer step N``. Either way a carried step's heading ends with
            ``(tenants carried from step k, not counted)``.

    Returns:
        The table, for :func:`to_text` or :func:`to_markdown`.
    """
    columns = columns_for(report)
    parts = [c for c in columns if c in PARTS]
    reserved = RESERVED_COLUMNS[0] in columns
    reserved_peak = RESERVED_PEAK in columns
    rows: list[tuple[str, list[int | None]]] = []
    for name in PHASES:
        phase = report.phases.get(name)
        if phase is not None:
            cells: list[int | None] = [phase.tenants_bytes[t] for t in TENANTS]
            cells += [phase.parts_bytes.get(p, 0) for p in parts]  # type: ignore[call-overload]
            cells += [phase.other_bytes, phase.allocated_bytes]
            if reserved:
                cells += [phase.fragmentation_bytes, phase.reserved_bytes]
            if reserved_peak:
                cells.append(phase.reserved_peak_bytes)
            rows.append((name, [*cells, phase.window_peak_bytes]))
    high: list[int | None] = [report.tenants_bytes[t] for t in TENANTS]
    high += [report.parts_bytes.get(p, 0) for p in parts]  # type: ignore[call-overload]
    high += [report.other_bytes, None]
    if reserved:
        phases = [p for mb in report.micro_batches for p in mb.values()] or list(report.phases.values())
        high += [_highest(p.fragmentation_bytes for p in phases), _highest(p.reserved_bytes for p in phases)]
    if reserved_peak:
        high.append(report.peak_reserved_bytes)
    rows.append((HIGH_WATER, [*high, report.peak_bytes]))
    largest = report.largest_tenant
    tenants = (
        f"largest tenant {largest} {mib(report.tenants_bytes[largest])} MiB;"
        f" sum of tenants {mib(report.tenant_sum_bytes)} MiB"
    )
    if report.peak_bytes is None:  # the sentence says why, once; never a figure for what was not measured
        why = report.peak_explanation.removeprefix(NOT_MEASURED) or "no memory source measured this step"
        lines = [f"{NOT_MEASURED}{why}; {tenants}"]
    else:
        reserved_text = (
            "" if report.peak_reserved_bytes is None else f"; peak reserved {mib(report.peak_reserved_bytes)} MiB"
        )
        lines = [f"peak {mib(report.peak_bytes)} MiB{reserved_text}; {tenants}", report.peak_explanation]
        if report.activations_by_module_bytes:
            lines.append(activations_by_module_line(report))
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
        if report.peak_bytes is None:
            lines.append(f"budget {mib(budget_bytes)} MiB; no headroom: the peak was not measured")
        else:
            lines.append(f"budget {mib(budget_bytes)} MiB; headroom {mib(budget_bytes - report.peak_bytes)} MiB")
    heading = f"memtenants: optimizer step {report.step}" if title is None else title
    if report.tenants_from_step is not None:  # the notes say how; the heading says that they were
        heading += f" (tenants carried from step {report.tenants_from_step}, not counted)"
    return Table(heading, report.memory_source, rows, lines, columns)


def activations_by_module_line(report: StepReport) -> str:
    """The line on where the activations live: the largest modules' bytes at the moment the split was taken.

    Args:
        report: a step whose ``activations_by_module_bytes`` is filled (a step that recorded a timeline).

    Returns:
        For example ``"activations by module at the step's peak: blocks.1.act (1.00 MiB), head (0.06 MiB);
        1.06 MiB in all"``; a split taken at ``before_backward`` says that no activation was alive at the peak.
    """
    split = report.activations_by_module_bytes
    moment = (
        "at the step's peak"
        if report.activations_by_module_at == "peak"
        else f"at {report.activations_by_module_at or 'before_backward'} (none was alive at the step's peak)"
    )
    # the two entries that are no module path read without their parentheses: "other modules (4.54 MiB)"
    named = {OTHER_MODULES: OTHER_MODULES[1:-1], OUTSIDE_MODULES: OUTSIDE_MODULES[1:-1]}
    modules = ", ".join(f"{named.get(name, name)} ({mib(value)} MiB)" for name, value in split.items())
    return f"activations by module {moment}: {modules}; {mib(sum(split.values()))} MiB in all"


def _highest(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def to_text(table: Table) -> str:
    """The table in fixed-width columns, for a terminal or a log.

    Args:
        table: what :func:`step_table` built.

    Returns:
        The text, sizes in MiB.
    """
    width = max(len(name) for name in (*PHASES, HIGH_WATER))
    widths = [max(CELL, len(c) + 1) for c in table.columns]
    header = f"{'phase (MiB)':<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(table.columns, widths, strict=True))
    out = [f"{table.title} (memory source: {table.source})", header, "-" * len(header)]
    out += [
        f"{name:<{width}}" + "".join(f"{mib(c):>{w}}" for c, w in zip(cells, widths, strict=True))
        for name, cells in table.rows
    ]
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
        "| phase | " + " | ".join(f"`{c}`" if c in TENANTS or c in PARTS else c for c in table.columns) + " |",
        "|---" + "|---:" * len(table.columns) + "|",
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


@dataclass(frozen=True)
class Summary:
    """The end-of-fit summary: the tables of the steps shown, then the lines about the fit.

    Args:
        reports: the steps shown, in order (the first, and the last measured).
        tables: their tables.
        lines: the sentences about the fit under them: a last step left unmeasured, the largest batch.
    """

    reports: list[StepReport]
    tables: list[Table]
    lines: list[str] = field(default_factory=list)


def fit_summary(
    first: StepReport | None,
    latest: StepReport,
    latest_measured: StepReport | None = None,
    budget_bytes: int | None = None,
    *,
    max_batch_size: int | None = None,
    margin: float = 0.05,
    how: str = "",
    unmeasured_why: str | None = None,
) -> Summary:
    """The summary printed at the end of fit and written as markdown: one builder, so the two never differ.

    It shows the first step (where the optimizer state is born) and the last step whose peak was measured:
    on the CPU the tracker measures only the steps Lightning logs, so the last step of a fit is often not
    measured, and its table would have no allocated bytes and no peak. A line then says which step is shown
    instead, and why the last was not measured.

    Args:
        first: the fit's first step, or None.
        latest: its last step.
        latest_measured: its last step whose peak was measured, or None.
        budget_bytes: the run's budget, or None.
        max_batch_size: the largest batch that fits the budget less the margin, or None.
        margin: the margin it was found under.
        how: how it was found, in words (``"scaled from a measured step's own allocations (no dry run)"``).
        unmeasured_why: why the last step was not measured, in words, after the report's own reason; None: that alone.

    Returns:
        The summary, for :func:`summary_text` or :func:`summary_to_markdown`.
    """
    last = latest if latest.peak_bytes is not None or latest_measured is None else latest_measured
    shown = [last] if first is None or first is last or first.step == last.step else [first, last]
    lines: list[str] = []
    tables = []
    for report in shown:
        title = None
        if report is not latest and report is last:
            which = "the first and the last measured" if report is first else "the last measured"
            title = f"memtenants: optimizer step {report.step}, {which}"
        tables.append(step_table(report, budget_bytes, title))
    if last is not latest:
        why = latest.peak_explanation.removeprefix(NOT_MEASURED)
        why = why if unmeasured_why is None else f"{why}: {unmeasured_why}"
        lines.append(
            f"the last step, {latest.step}, was not measured ({why}); the table above is step {last.step}, the last"
            f" measured. At step {latest.step} the tenants' high-water marks summed to"
            f" {mib(latest.tenant_sum_bytes)} MiB (step {last.step}: {mib(last.tenant_sum_bytes)} MiB)"
        )
        if latest.tenants_from_step is not None:
            lines[-1] += (
                f"; step {latest.step}'s tenants were carried from step {latest.tenants_from_step}, not counted"
                " (track_every_step=True counts every step)"
            )
    if max_batch_size is not None and budget_bytes is not None:
        lines.append(
            f"the largest batch is {max_batch_size:,} samples: a steady-state step"
            f" {fits_text(budget_bytes, margin)}{f'; {how}' if how else ''}"
        )
    return Summary(shown, tables, lines)


def summary_text(summary: Summary) -> str:
    """The summary as plain text: each table (:func:`to_text`), then the lines about the fit.

    Args:
        summary: what :func:`fit_summary` built.

    Returns:
        The text.
    """
    out = [to_text(table) for table in summary.tables]
    if summary.lines:
        out.append("\n".join([SUMMARY_HEADING, *(f"- {line}" for line in summary.lines)]))
    return "\n\n".join(out)


def summary_to_markdown(summary: Summary) -> str:
    """The summary as markdown: each table (:func:`to_markdown`), then the lines about the fit.

    Args:
        summary: what :func:`fit_summary` built.

    Returns:
        The markdown: the same tables and lines as :func:`summary_text`, in the same order.
    """
    out = [to_markdown(table) for table in summary.tables]
    if summary.lines:
        out.append("\n".join([f"### {SUMMARY_HEADING}", "", *(f"- {line}" for line in summary.lines)]))
    return "\n\n".join(out)


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

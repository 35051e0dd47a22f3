"""The step's table and the end-of-fit summary: one model of rows and lines, rendered as plain text and as markdown.

Both renderers print the same rows and the same lines in the same order; only the markup differs. The
columns of a phase add up: the tenants, the named parts and ``other`` sum to ``allocated``, and where the
allocator reserves (CUDA), ``allocated`` and ``fragmentation`` sum to ``reserved``; ``reserved peak`` is the highest
``reserved`` of the window, as ``window peak`` is of ``allocated``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn
from torch.optim import Optimizer

from lightning_memtenants.analysis.budget import Budget
from lightning_memtenants.analysis.evaluation import evaluation_fixes
from lightning_memtenants.analysis.fixes import Fix, optimizer_step_temporaries_bytes, ranked_fixes
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.timeline import OTHER_MODULES, OUTSIDE_MODULES
from lightning_memtenants.names import EVALUATION_WINDOWS, LOOP_NAMES, PARTS, PHASES, TENANTS, WINDOWS, Phase, Tenant
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
HEADLINE_HEADING = "memtenants: at a glance"
NOT_MEASURED = "peak not measured: "
PEAK_ROW = "peak"
# At or under this share of the budget the headline says that nothing needs changing rather than name a fix.
COMFORTABLE_SHARE = 0.8


@dataclass(frozen=True)
class Table:
    """What a step's table shows: a title, rows of bytes (None: not measured) and the lines under it.

    Args:
        title: the table's heading.
        source: the memory source, in words.
        rows: one row per phase and the high-water marks: a label and one cell per ``columns`` entry.
        lines: the sentences under the table.
        columns: the columns' names (:func:`columns_for`).
        row_heading: what the rows are, the first column's heading (``phase``; ``tenant`` side by side).
    """

    title: str
    source: str
    rows: list[tuple[str, list[int | None]]]
    lines: list[str]
    columns: tuple[str, ...] = COLUMNS
    row_heading: str = "phase"


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
    notes say from where. An evaluation batch (``stage`` other than ``"train"``) has the rows ``batch_start`` and
    ``batch_end``, and a line that says what each of their windows holds (``names.EVALUATION_WINDOWS``).

    Args:
        report: the step, or an evaluation batch.
        budget_bytes: the run's budget, for a last line with the headroom; None leaves it out.
        title: the heading; None: ``memtenants: optimizer step N``, or for an evaluation batch
            ``memtenants: validation batch 7 (dataloader 0), at optimizer step 12``. Either way a carried step's
            heading ends with ``(tenants carried from step k, not counted)``.

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
        window = "" if report.stage == "train" else f" in {_window(report, report.peak_phase)}"
        lines = [f"peak {mib(report.peak_bytes)} MiB{window}{reserved_text}; {tenants}", report.peak_explanation]
        if report.activations_by_module_bytes:
            lines.append(activations_by_module_line(report))
    if report.stage != "train":
        lines.append("windows: " + "; ".join(f"{name} closes {_window(report, name)}" for name in report.phases))
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
    heading = f"memtenants: {step_name(report)}" if title is None else title
    if report.tenants_from_step is not None:  # the notes say how; the heading says that they were
        heading += f" (tenants carried from step {report.tenants_from_step}, not counted)"
    return Table(heading, report.memory_source, rows, lines, columns)


def step_name(report: StepReport) -> str:
    """What a report is, in words: ``optimizer step 3``, or ``validation batch 7 (dataloader 0), at optimizer step 12``.

    Args:
        report: an optimizer step or an evaluation batch.

    Returns:
        The words, for a heading.
    """
    return f"{'' if report.stage == 'train' else f'{LOOP_NAMES[report.stage]} '}{_which(report)}"


def _which(report: StepReport) -> str:
    """``optimizer step 3``, or ``batch 7 (dataloader 0), at optimizer step 12``: the report within its loop."""
    if report.stage == "train":
        return f"optimizer step {report.step}"
    batch = "" if report.batch_index is None else f" {report.batch_index}"
    loader = "" if report.dataloader_index is None else f" (dataloader {report.dataloader_index})"
    return f"batch{batch}{loader}, at optimizer step {report.step}"


def _window(report: StepReport, phase: Phase | None) -> str:
    """What ran in the window that ends at ``phase``, for the report's loop."""
    if phase is None:
        return "an unknown window"
    if report.stage == "train":
        return WINDOWS[phase]
    return EVALUATION_WINDOWS.get(phase, WINDOWS[phase]).format(loop=LOOP_NAMES[report.stage])


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
    width = max(len(name) for name in (*PHASES, HIGH_WATER, *(name for name, _ in table.rows)))
    widths = [max(CELL, len(c) + 1) for c in table.columns]
    cells = "".join(f"{c:>{w}}" for c, w in zip(table.columns, widths, strict=True))
    header = f"{f'{table.row_heading} (MiB)':<{width}}{cells}"
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
        f"| {table.row_heading} | "
        + " | ".join(f"`{c}`" if c in (*TENANTS, *PARTS) else c for c in table.columns)
        + " |",
        "|---" + "|---:" * len(table.columns) + "|",
    ]
    for name, cells in table.rows:
        label = f"**{name}**" if name in (HIGH_WATER, PEAK_ROW) else f"`{name}`"
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
    """The end-of-fit summary: a headline, the tables of the steps shown, then the lines about the fit.

    Args:
        reports: the steps shown, in order (the first, and the last measured).
        tables: the side-by-side table of training and the evaluation loops where one ran, then the steps' tables.
        lines: the sentences about the fit under them: a last step left unmeasured, the largest batch.
        headline: the few lines printed first: the peak, the largest tenant, the one change that would help most.
        evaluations: the peak batch of each evaluation loop that ran in the fit, in the side-by-side table.
    """

    reports: list[StepReport]
    tables: list[Table]
    lines: list[str] = field(default_factory=list)
    headline: list[str] = field(default_factory=list)
    evaluations: list[StepReport] = field(default_factory=list)


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
    evaluations: Sequence[StepReport] = (),
    module: nn.Module | None = None,
    optimizers: Sequence[Optimizer] = (),
    world_size: int = 1,
    evaluation_samples: Mapping[str, int] | None = None,
) -> Summary:
    """The summary printed at the end of fit and written as markdown: one builder, so the two never differ.

    It shows the first step (where the optimizer state is born) and the last step whose peak was measured:
    on the CPU the tracker measures only the steps Lightning logs, so the last step of a fit is often not
    measured, and its table would have no allocated bytes and no peak. A line then says which step is shown
    instead, and why the last was not measured. Above the tables a headline says where the peak was, which tenant
    was largest, and the one change that would lower the peak most (``analysis.fixes.ranked_fixes``, an estimate),
    or, where the peak is well under the budget, that nothing needs changing. Where an evaluation loop ran, a
    table under the headline puts its peak batch beside the last measured training step, and where that batch's
    peak is the highest, the fix is for it.

    Args:
        first: the fit's first step, or None.
        latest: its last step.
        latest_measured: its last step whose peak was measured, or None.
        budget_bytes: the run's budget, or None.
        max_batch_size: the largest batch that fits the budget less the margin, or None.
        margin: the margin it was found under.
        how: how it was found, in words (``"scaled from a measured step's own allocations (no dry run)"``).
        unmeasured_why: why the last step was not measured, in words, after the report's own reason; None: that alone.
        evaluations: the measured batch with the highest peak of each evaluation loop that ran in the fit
            (``stage`` ``"validate"``...).
        module: the model, for the headline's fix (fp32 parameters suggest bf16-mixed); None: no fix is named.
        optimizers: its optimizers, for the fix (the optimizer step's temporaries, Adam's state).
        world_size: the ranks the optimizer state could be sharded over.
        evaluation_samples: the samples of each evaluation loop's peak batch, by stage, for the fix that halves
            it; a loop not named gets no such fix.

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
    evaluations = list(evaluations)
    if evaluations:  # under the headline, whose first line it details
        tables.insert(0, side_by_side(last, evaluations))
    fix = None
    target = _peak_report([_peak_report(shown), *evaluations])
    if module is not None:
        samples = (evaluation_samples or {}).get(target.stage, 0)
        fix = top_fix(target, module, optimizers, world_size=world_size, samples=samples)
    headline = headline_lines(shown, evaluations, budget_bytes, margin=margin, fix=fix, fix_for=target)
    return Summary(shown, tables, lines, headline, evaluations)


def _peak_report(reports: Sequence[StepReport]) -> StepReport:
    """The report with the highest measured peak (the first to reach it), else the last."""
    measured = [r for r in reports if r.peak_bytes is not None]
    if not measured:
        return reports[-1]
    return max(measured, key=lambda r: r.peak_bytes or 0)


def top_fix(
    report: StepReport,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    world_size: int = 1,
    samples: int = 0,
) -> Fix | None:
    """The fix that would lower ``report``'s peak most, estimated from the tenants alive in the peak's window.

    A peak in the forward pass or in backward counts the activations' high-water mark; one in the optimizer step
    counts the tenants at ``batch_end`` and the step's temporaries; elsewhere the tenants at the peak's boundary.
    An evaluation batch's peak weighs the evaluation's own fixes (a smaller batch, no graph, what the step keeps)
    against those of the tenants the loop holds (the optimizer state training left).

    Args:
        report: the step or evaluation batch whose peak is to be lowered.
        module: the model.
        optimizers: its optimizers.
        world_size: the ranks the optimizer state could be sharded over.
        samples: an evaluation batch's samples; 1 or fewer leaves out halving it.

    Returns:
        The fix that saves most, or None where none applies.
    """
    phase = report.phases.get(report.peak_phase) if report.peak_phase is not None else None
    tenants: dict[str, int] = dict(report.tenants_bytes if phase is None else phase.tenants_bytes)
    if report.peak_phase in ("before_backward", "after_backward"):
        tenants["activations"] = report.tenants_bytes["activations"]
    in_step = report.stage == "train" and report.peak_phase == "batch_end"
    temporaries = optimizer_step_temporaries_bytes(optimizers) if in_step else 0
    if report.stage != "train":  # the batch and its graph: the evaluation's own fixes below
        tenants["activations"] = 0
    fixes = ranked_fixes(tenants, module, optimizers, world_size=world_size, temporaries_bytes=temporaries)
    if report.stage != "train":
        start, end = report.phases.get("batch_start"), report.phases.get("batch_end")
        begin = start.allocated_bytes if start is not None else None
        finish = end.allocated_bytes if end is not None else None
        working = report.peak_bytes - begin if report.peak_bytes is not None and begin is not None else 0
        kept = finish - begin if finish is not None and begin is not None else 0
        fixes += evaluation_fixes(
            report.stage, dict(report.tenants_bytes), working_bytes=working, kept_bytes=max(kept, 0), samples=samples
        )
    return max(fixes, key=lambda fix: fix.saves_bytes, default=None)


def headline_lines(
    reports: Sequence[StepReport],
    evaluations: Sequence[StepReport] = (),
    budget_bytes: int | None = None,
    *,
    margin: float = 0.05,
    fix: Fix | None = None,
    fix_for: StepReport | None = None,
) -> list[str]:
    """The first lines of the summary: where the peak was, the largest tenant, and what to change, if anything.

    Args:
        reports: the training steps shown (the highest measured peak among them is the fit's).
        evaluations: the peak batch of each evaluation loop, whose peaks are put beside training's.
        budget_bytes: the budget, or None.
        margin: the fraction of the budget kept free.
        fix: the change that would lower the peak most (:func:`top_fix`), or None.
        fix_for: the step or batch whose peak ``fix`` lowers; an evaluation batch is named in the fix's line.

    Returns:
        Up to three lines: the peaks (against the budget), the largest tenant's share of the peak, and the fix,
        or that nothing needs changing where the highest peak is at most ``COMFORTABLE_SHARE`` of the budget.
    """
    report = _peak_report(reports)
    peaks = [f"training {_peak_words(report)}"]
    peaks += [f"{LOOP_NAMES[e.stage]} {_peak_words(e)}" for e in evaluations]
    known = [r.peak_bytes for r in (report, *evaluations) if r.peak_bytes is not None]
    highest = max(known) if known else None
    first = "peak: " + " | ".join(peaks)
    if budget_bytes is not None and highest is not None:
        first += f"; {_percent(highest / budget_bytes)} of the budget ({mib(budget_bytes)} MiB)"
    largest: Tenant = report.largest_tenant
    second = f"largest tenant: {largest} {mib(report.tenants_bytes[largest])} MiB"
    if report.peak_bytes:
        second += f", {_percent(report.tenants_bytes[largest] / report.peak_bytes)} of the training peak"
    lines = [first, second]
    estimate = "" if fix is None else f"{fix.action} (saves about {mib(fix.saves_bytes)} MiB, an estimate)"
    if fix is not None and fix_for is not None and fix_for.stage != "train":
        estimate = f"for the {LOOP_NAMES[fix_for.stage]} peak, {estimate}"
    if budget_bytes is None or highest is None:
        if fix is not None:
            lines.append(f"to lower the peak most: {estimate}")
        return lines
    share = highest / budget_bytes
    limit = Budget(budget_bytes, margin).limit_bytes
    if share <= COMFORTABLE_SHARE:
        lines.append(f"nothing needs changing: the peak is {_percent(share)} of the budget")
    elif highest > limit:
        over = f"over the budget: {mib(highest - limit)} MiB above {mib(limit)} MiB"
        over += f" (the budget less a {margin:.0%} margin)"
        lines.append(f"{over}; the change that would help most: {estimate}" if fix is not None else over)
    else:
        close = f"it fits, {mib(budget_bytes - highest)} MiB under the budget"
        lines.append(f"{close}; to lower the peak most: {estimate}" if fix is not None else close)
    return lines


def _percent(share: float) -> str:
    """``37%``; ``under 1%`` rather than ``0%`` for a share that is not nothing."""
    return "under 1%" if 0 < share < 0.005 else f"{share:.0%}"


def _peak_words(report: StepReport) -> str:
    """``513.16 MiB (step 0, the optimizer step)``, ``120.40 MiB (batch 7)``, or ``not measured (why)``."""
    if report.peak_bytes is None:
        return f"not measured ({report.peak_explanation.removeprefix(NOT_MEASURED) or 'no memory source'})"
    if report.stage == "train":
        return f"{mib(report.peak_bytes)} MiB (step {report.step}, {_window(report, report.peak_phase)})"
    return f"{mib(report.peak_bytes)} MiB (batch {report.batch_index})"


def side_by_side(training: StepReport, evaluations: Sequence[StepReport]) -> Table:
    """Training's step beside each evaluation loop's peak batch: each tenant's high-water mark, other and the peak.

    Args:
        training: the training step shown (the last measured).
        evaluations: the peak batch of each evaluation loop.

    Returns:
        A table with one column per loop and the rows ``TENANTS``, ``other`` and ``peak``.
    """
    reports = [training, *evaluations]
    columns = tuple(LOOP_NAMES[r.stage] for r in reports)
    rows: list[tuple[str, list[int | None]]] = [(t, [r.tenants_bytes[t] for r in reports]) for t in TENANTS]
    rows += [("other", [r.other_bytes for r in reports]), (PEAK_ROW, [r.peak_bytes for r in reports])]
    title = f"memtenants: {', '.join(columns[:-1])} and {columns[-1]} side by side"
    columns_text = "; ".join(f"{LOOP_NAMES[r.stage]}: {_which(r)}" for r in reports)
    lines = [f"{columns_text}; each column holds the high-water marks and the peak over its step or batch"]
    return Table(title, training.memory_source, rows, lines, columns, row_heading="tenant")


def summary_text(summary: Summary) -> str:
    """The summary as plain text: the headline, each table (:func:`to_text`), then the lines about the fit.

    Args:
        summary: what :func:`fit_summary` built.

    Returns:
        The text.
    """
    out = [to_text(table) for table in summary.tables]
    if summary.headline:
        out.insert(0, "\n".join([HEADLINE_HEADING, *(f"- {line}" for line in summary.headline)]))
    if summary.lines:
        out.append("\n".join([SUMMARY_HEADING, *(f"- {line}" for line in summary.lines)]))
    return "\n\n".join(out)


def summary_to_markdown(summary: Summary) -> str:
    """The summary as markdown: the headline, each table (:func:`to_markdown`), then the lines about the fit.

    Args:
        summary: what :func:`fit_summary` built.

    Returns:
        The markdown: the same headline, tables and lines as :func:`summary_text`, in the same order.
    """
    out = [to_markdown(table) for table in summary.tables]
    if summary.headline:
        out.insert(0, "\n".join([f"### {HEADLINE_HEADING}", "", *(f"- {line}" for line in summary.headline)]))
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

"""Reports: what was measured at each phase of a step, and how to print and log it."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_memtenants.census import TENANTS

PHASES: tuple[str, ...] = ("batch_start", "before_backward", "after_backward", "before_optimizer_step", "batch_end")
MiB = 1024**2


@dataclass(frozen=True)
class PhaseReport:
    """The tenants at one phase boundary."""

    name: str
    tenants_bytes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.tenants_bytes.values())


@dataclass(frozen=True)
class StepReport:
    """One optimizer step: the tenants at each phase, their high-water marks, the fixed-cost check.

    ``phases`` holds the last occurrence of each phase in the step; ``micro_batches`` keeps
    every micro-batch's phases when gradients are accumulated.
    """

    step: int
    phases: dict[str, PhaseReport]
    micro_batches: list[dict[str, PhaseReport]]
    tenants_bytes: dict[str, int]
    expected_fixed_bytes: int
    measured_fixed_bytes: int
    fixed_cost_notes: list[str] = field(default_factory=list)
    peak_bytes: int | None = None

    @property
    def fixed_deviation_bytes(self) -> int:
        return self.measured_fixed_bytes - self.expected_fixed_bytes

    def metrics(self) -> dict[str, float]:
        """The scalars we log, keyed by tag; every tag carries its unit."""
        out = {f"memtenants/{name}_MiB": value / MiB for name, value in self.tenants_bytes.items()}
        out["memtenants/fixed_expected_MiB"] = self.expected_fixed_bytes / MiB
        out["memtenants/fixed_measured_MiB"] = self.measured_fixed_bytes / MiB
        out["memtenants/fixed_deviation_MiB"] = self.fixed_deviation_bytes / MiB
        if self.peak_bytes is not None:
            out["memtenants/peak_MiB"] = self.peak_bytes / MiB
        return dict(sorted(out.items()))


def _mib(value: int | None) -> str:
    return "not measured" if value is None else f"{value / MiB:.2f}"


def format_table(report: StepReport) -> str:
    """A plain-text table like the article's: tenants (MiB) at each phase, then the fixed-cost check."""
    width = max(len(name) for name in (*PHASES, "high-water mark"))
    header = f"{'phase (MiB)':<{width}}" + "".join(f"{t:>17}" for t in (*TENANTS, "sum"))
    lines = [f"memtenants: optimizer step {report.step}", header, "-" * len(header)]
    rows = [(name, report.phases[name].tenants_bytes) for name in PHASES if name in report.phases]
    rows.append(("high-water mark", report.tenants_bytes))
    for name, tenants in rows:
        cells = [tenants[t] for t in TENANTS] + [sum(tenants.values())]
        lines.append(f"{name:<{width}}" + "".join(f"{c / MiB:>17.2f}" for c in cells))
    lines.append("")
    lines.append(
        f"fixed cost (weights + gradients + optimizer state): expected {report.expected_fixed_bytes:,} bytes"
        f" ({report.expected_fixed_bytes / MiB:.2f} MiB), measured {report.measured_fixed_bytes:,} bytes"
        f" ({report.measured_fixed_bytes / MiB:.2f} MiB)"
    )
    if report.fixed_deviation_bytes == 0:
        lines.append("- the measured fixed cost matches the formula to the byte")
    lines.extend(f"- {note}" for note in report.fixed_cost_notes)
    lines.append(f"peak of the step (MiB): {_mib(report.peak_bytes)}")
    return "\n".join(lines)

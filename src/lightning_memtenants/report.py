"""Reports: what was measured at each phase of a step, and how to print and log it."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_memtenants.census import TENANTS

PHASES: tuple[str, ...] = ("batch_start", "before_backward", "after_backward", "before_optimizer_step", "batch_end")
# What runs in the window that ends at each phase boundary.
WINDOWS: dict[str, str] = {
    "batch_start": "before the batch (data loading, validation)",
    "before_backward": "the forward pass",
    "after_backward": "backward",
    "before_optimizer_step": "between backward and the optimizer step",
    "batch_end": "the optimizer step",
}
# Short names for the same windows, used where a phase is reported as "where it failed".
WINDOW_NAMES: dict[str, str] = {
    "batch_start": "between_batches",
    "before_backward": "forward",
    "after_backward": "backward",
    "before_optimizer_step": "gradient_processing",
    "batch_end": "optimizer_step",
}
MiB = 1024**2
# Named parts of the desk outside the four tenants, each measured, never guessed.
PARTS: dict[str, str] = {
    "autocast_cache": "half copies of weights made by autocast in forward and saved for backward",
    "grad_scaler": "the GradScaler's scale, growth tracker and found-inf flags",
    "ddp_buckets": "DDP's gradient buckets, where gradients are not views into them",
    "cublas_workspace": "cuBLAS workspaces in allocated memory, one per thread that multiplies (predicted)",
    "allocator_rounding": "the CUDA caching allocator's rounding of every block up to 512 bytes (predicted)",
}


@dataclass(frozen=True)
class PhaseReport:
    """The tenants at one phase boundary, and what the memory source saw there.

    ``window_peak_bytes`` is the peak of the window that ends at this boundary (see ``WINDOWS``).
    """

    name: str
    tenants_bytes: dict[str, int]
    allocated_bytes: int | None = None
    window_peak_bytes: int | None = None
    reserved_bytes: int | None = None
    parts_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """The four tenants together."""
        return sum(self.tenants_bytes.values())

    @property
    def other_bytes(self) -> int | None:
        """Allocated minus the four tenants and the named parts: the batch, temporaries; so the desk adds up."""
        if self.allocated_bytes is None:
            return None
        return self.allocated_bytes - self.total_bytes - sum(self.parts_bytes.values())

    @property
    def fragmentation_bytes(self) -> int | None:
        """Reserved by the allocator but not allocated (CUDA and accelerators only)."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes


@dataclass(frozen=True)
class StepReport:
    """One optimizer step: the tenants at each phase, their high-water marks, the fixed-cost check, the peak.

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
    peak_phase: str | None = None
    peak_explanation: str = "peak not measured"
    memory_source: str = "not measured"
    notes: list[str] = field(default_factory=list)

    @property
    def parts_bytes(self) -> dict[str, int]:
        """High-water mark of each named part outside the tenants (``PARTS``) over the step."""
        out: dict[str, int] = {}
        for phase in (p for mb in self.micro_batches for p in mb.values()):
            for name, value in phase.parts_bytes.items():
                out[name] = max(out.get(name, 0), value)
        return out

    @property
    def fixed_deviation_bytes(self) -> int:
        return self.measured_fixed_bytes - self.expected_fixed_bytes

    @property
    def tenant_sum_bytes(self) -> int:
        """The sum of the four tenants' high-water marks: an upper bound only if nothing else lives."""
        return sum(self.tenants_bytes.values())

    @property
    def peak_minus_sum_bytes(self) -> int | None:
        """The true peak minus the tenant sum: below 0 when tenants never coexist at their highs."""
        return None if self.peak_bytes is None else self.peak_bytes - self.tenant_sum_bytes

    @property
    def other_bytes(self) -> int | None:
        """High-water mark of ``other`` over the phases where it was measured."""
        values = [p.other_bytes for mb in self.micro_batches for p in mb.values() if p.other_bytes is not None]
        return max(values) if values else None

    def metrics(self) -> dict[str, float]:
        """The scalars we log, keyed by tag; every tag carries its unit."""
        out = {f"memtenants/{name}_MiB": value / MiB for name, value in self.tenants_bytes.items()}
        out["memtenants/tenant_sum_MiB"] = self.tenant_sum_bytes / MiB
        out["memtenants/fixed_expected_MiB"] = self.expected_fixed_bytes / MiB
        out["memtenants/fixed_measured_MiB"] = self.measured_fixed_bytes / MiB
        out["memtenants/fixed_deviation_MiB"] = self.fixed_deviation_bytes / MiB
        optional = {
            "memtenants/peak_MiB": self.peak_bytes,
            "memtenants/peak_minus_sum_MiB": self.peak_minus_sum_bytes,
            "memtenants/other_MiB": self.other_bytes,
        }
        for name, phase in self.phases.items():
            optional[f"memtenants/allocated/{name}_MiB"] = phase.allocated_bytes
            optional[f"memtenants/window_peak/{name}_MiB"] = phase.window_peak_bytes
            if name == "batch_end":
                optional["memtenants/reserved_MiB"] = phase.reserved_bytes
                optional["memtenants/fragmentation_MiB"] = phase.fragmentation_bytes
        for name, value in self.parts_bytes.items():
            optional[f"memtenants/part/{name}_MiB"] = value
        out.update({tag: value / MiB for tag, value in optional.items() if value is not None})
        return dict(sorted(out.items()))


def _mib(value: int | None) -> str:
    return "not measured" if value is None else f"{value / MiB:.2f}"


def format_table(report: StepReport) -> str:
    """A plain-text table like the article's: tenants (MiB) at each phase, the peak, the fixed-cost check."""
    columns = (*TENANTS, "other", "allocated", "window peak")
    width = max(len(name) for name in (*PHASES, "high-water mark"))
    header = f"{'phase (MiB)':<{width}}" + "".join(f"{c:>16}" for c in columns)
    lines = [f"memtenants: optimizer step {report.step} (memory source: {report.memory_source})", header]
    lines.append("-" * len(header))
    rows = [(name, report.phases[name]) for name in PHASES if name in report.phases]
    for name, phase in rows:
        cells = [phase.tenants_bytes[t] for t in TENANTS] + [
            phase.other_bytes,
            phase.allocated_bytes,
            phase.window_peak_bytes,
        ]
        lines.append(f"{name:<{width}}" + "".join(f"{_cell(c):>16}" for c in cells))
    high = [report.tenants_bytes[t] for t in TENANTS] + [report.other_bytes, None, report.peak_bytes]
    lines.append(f"{'high-water mark':<{width}}" + "".join(f"{_cell(c):>16}" for c in high))
    lines.append("")
    largest = max(TENANTS, key=lambda t: report.tenants_bytes[t])
    lines.append(
        f"peak {_mib(report.peak_bytes)} MiB; largest tenant {largest} {_mib(report.tenants_bytes[largest])} MiB;"
        f" sum of tenants {_mib(report.tenant_sum_bytes)} MiB"
    )
    lines.append(f"- {report.peak_explanation}")
    for name, value in report.parts_bytes.items():
        lines.append(f"- {name}: {value:,} bytes at its high-water mark ({PARTS.get(name, 'a named part')})")
    lines.extend(f"- {note}" for note in report.notes)
    lines.append(
        f"fixed cost (weights + gradients + optimizer state): expected {report.expected_fixed_bytes:,} bytes"
        f" ({report.expected_fixed_bytes / MiB:.2f} MiB), measured {report.measured_fixed_bytes:,} bytes"
        f" ({report.measured_fixed_bytes / MiB:.2f} MiB)"
    )
    if report.fixed_deviation_bytes == 0:
        lines.append("- the measured fixed cost matches the formula to the byte")
    lines.extend(f"- {note}" for note in report.fixed_cost_notes)
    return "\n".join(lines)


def _cell(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.2f}"


def _at_end(phase: PhaseReport) -> str:
    """The activations and gradients at a phase boundary, in words."""
    tenants = phase.tenants_bytes
    activations, gradients = tenants["activations"] / MiB, tenants["gradients"] / MiB
    return f"{activations:.3f} MiB of activations and {gradients:.3f} MiB of gradients at its end"


def explain_peak(
    phases: dict[str, PhaseReport],
    peak_phase: str | None,
    peak_bytes: int | None,
    *,
    largest_parameter_bytes: int,
    optimizer: str,
    expected_temporaries_bytes: int | None = None,
    gathered_bytes: int = 0,
) -> str:
    """One sentence on what held memory at the peak, from the phases around it.

    ``gathered_bytes`` is the largest FSDP unit's unsharded size, where parameters are sharded: then a peak
    inside forward or backward is mostly gathered parameters, not the activations or gradients.

    ``optimizer`` names each optimizer and the implementation that ran (single-tensor, foreach or
    fused), whose temporaries differ: ``expected_temporaries_bytes`` is the formula's figure for them.
    """
    if peak_bytes is None or peak_phase is None:
        return "peak not measured: no memory source measured this step"
    where = f"peak inside {WINDOWS[peak_phase]}"
    phase = phases[peak_phase]
    start = phases.get("before_optimizer_step")
    if peak_phase == "batch_end" and start is not None and start.allocated_bytes is not None:
        created = phase.tenants_bytes["optimizer_state"] - start.tenants_bytes["optimizer_state"]
        temporaries = peak_bytes - start.allocated_bytes - max(created, 0)
        ratio = temporaries / largest_parameter_bytes if largest_parameter_bytes else 0.0
        text = (
            f"{where}: {optimizer} temporaries of {temporaries / MiB:.2f} MiB"
            f" (about {ratio:.1f} x the largest parameter, {largest_parameter_bytes / MiB:.2f} MiB)"
        )
        if created > 0:
            text += f", on top of {created / MiB:.2f} MiB of optimizer state the step created"
        if expected_temporaries_bytes is not None:
            text += f"; the formula for this implementation expects {expected_temporaries_bytes / MiB:.2f} MiB"
        return text
    before = phases.get({"before_backward": "batch_start", "after_backward": "before_backward"}.get(peak_phase, ""))
    if gathered_bytes and before is not None and before.allocated_bytes is not None:
        return (
            f"{where}: {(peak_bytes - before.allocated_bytes) / MiB:.3f} MiB above the window's start, mostly FSDP's"
            f" gathered parameters: the largest unit is {gathered_bytes / MiB:.3f} MiB unsharded, held about twice"
            f" while gathered (all-gather buffer and parameters); {_at_end(phase)}"
        )
    if peak_phase == "before_backward":
        text = f"{where}: {phase.tenants_bytes['activations'] / MiB:.2f} MiB of activations on top of the fixed tenants"
        begin = phases.get("batch_start")
        if begin is not None and begin.tenants_bytes["gradients"] > 0:
            text += "; the previous step's gradients are still resident (Lightning zeroes them after the forward)"
        return text + f"; the optimizer step ({optimizer}) stayed below it"
    if peak_phase == "after_backward":
        gradients = phase.tenants_bytes["gradients"] / MiB
        return (
            f"{where}: gradients ({gradients:.2f} MiB) materialise while activations are still alive;"
            f" the optimizer step ({optimizer}) stayed below it"
        )
    return where

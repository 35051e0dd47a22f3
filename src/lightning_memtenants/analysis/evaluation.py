"""An evaluation batch's peak as a line in its samples: for the warnings before a batch, and the largest that fits.

An evaluation step (validation, test, predict) frees what it made when it returns, so its peak is what the loop holds
at its start plus the step's working memory, and the working memory grows with the batch. A measured batch gives
the line; before one was measured, a training step's forward stands in for it, from above: a forward that keeps its
graph for backward holds at least what one under ``no_grad`` holds, batch for batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_memtenants.analysis.fixes import Fix
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.names import LOOP_NAMES, Stage
from lightning_memtenants.units import mib


@dataclass(frozen=True)
class EvaluationLine:
    """A measured batch: ``start_bytes`` allocated at its start (its batch included), ``peak_bytes`` at its peak.

    What does not grow with the batch is the start less the batch; the rest of the peak (the batch, the working
    memory) is scaled with the samples. A fixed temporary inside the step is counted as growing, so a larger batch is
    predicted high and the largest batch low: the errors fall on the safe side.

    Args:
        samples: the measured batch's samples.
        start_bytes: allocated bytes at its start.
        batch_bytes: its batch's bytes.
        peak_bytes: its peak.
        source: what the line comes from, in words, for the warnings.
    """

    samples: int
    start_bytes: int
    batch_bytes: int
    peak_bytes: int
    source: str

    @property
    def fixed_bytes(self) -> int:
        """What the loop holds besides the batch: the weights, what training left resident, what the user keeps."""
        return self.start_bytes - self.batch_bytes

    @property
    def growing_bytes(self) -> int:
        """The part of the peak that grows with the batch: the batch and the step's working memory."""
        return max(self.peak_bytes - self.fixed_bytes, 0)

    def peak_for(self, samples: int, start_bytes: int | None = None) -> int:
        """The peak of a batch of ``samples``.

        Args:
            samples: the batch's samples.
            start_bytes: allocated bytes at that batch's start, where measured (what the loop holds now, its batch
                included); None takes the measured batch's fixed part and scales its batch.

        Returns:
            The predicted peak in bytes.
        """
        if start_bytes is None:
            return self.fixed_bytes + math.ceil(self.growing_bytes * samples / self.samples)
        working = max(self.peak_bytes - self.start_bytes, 0)
        return start_bytes + math.ceil(working * samples / self.samples)

    def max_batch_size(self, limit_bytes: int) -> int:
        """The largest batch whose peak stays within ``limit_bytes``; 0 where not even the fixed part fits.

        Args:
            limit_bytes: the budget less its margin.

        Returns:
            The number of samples.
        """
        room = limit_bytes - self.fixed_bytes
        if room <= 0:
            return 0
        if self.growing_bytes <= 0:
            return 2**53
        return room * self.samples // self.growing_bytes


def training_line(report: StepReport, samples: int, batch_bytes: int) -> EvaluationLine | None:
    """A training step's forward as an evaluation line from above, where its forward was measured.

    Args:
        report: a measured training step.
        samples: its batch's samples.
        batch_bytes: its batch's bytes.

    Returns:
        The line, or None where the step's ``batch_start`` or forward window was not measured.
    """
    start = report.phases.get("batch_start")
    forward = report.phases.get("before_backward")
    if start is None or forward is None or samples <= 0:
        return None
    if start.allocated_bytes is None or forward.window_peak_bytes is None:
        return None
    return EvaluationLine(
        samples,
        start.allocated_bytes,
        batch_bytes,
        max(forward.window_peak_bytes, start.allocated_bytes),
        f"the training forward of step {report.step} ({samples} samples), an upper bound: it keeps its graph",
    )


def evaluation_line(report: StepReport, samples: int, batch_bytes: int) -> EvaluationLine | None:
    """A measured evaluation batch as a line.

    Args:
        report: the batch's report (``stage`` not ``"train"``).
        samples: its samples.
        batch_bytes: its batch's bytes.

    Returns:
        The line, or None where its start or peak was not measured.
    """
    start = report.phases.get("batch_start")
    if start is None or start.allocated_bytes is None or report.peak_bytes is None or samples <= 0:
        return None
    where = f"{LOOP_NAMES[report.stage]} batch {report.batch_index}"
    return EvaluationLine(samples, start.allocated_bytes, batch_bytes, report.peak_bytes, f"the measured {where}")


def explain_evaluation_peak(
    report_stage: Stage,
    start_bytes: int | None,
    end_bytes: int | None,
    peak: int | None,
    activations_bytes: int,
    why_unmeasured: str,
) -> str:
    """One sentence on an evaluation batch's peak: the step's working memory on top of what the loop holds.

    Args:
        report_stage: the loop.
        start_bytes: allocated bytes at the batch's start, or None.
        end_bytes: allocated bytes at its end, or None.
        peak: its peak, or None.
        activations_bytes: what its output's graph saved for backward (0 under ``no_grad``).
        why_unmeasured: the reason given where the peak was not measured.

    Returns:
        The sentence.
    """
    loop = LOOP_NAMES[report_stage]
    if peak is None or start_bytes is None:
        return f"peak not measured: {why_unmeasured}"
    text = (
        f"peak inside the {loop} step: {mib(peak - start_bytes)} MiB of working memory above the"
        f" {mib(start_bytes)} MiB held at its start"
    )
    if activations_bytes:
        text += f"; its output keeps a graph: {mib(activations_bytes)} MiB saved for a backward that never runs"
    if end_bytes is not None and end_bytes > start_bytes:
        text += f"; {mib(end_bytes - start_bytes)} MiB outlive the step (its outputs, what it logged or kept)"
    return text


def evaluation_fixes(
    stage: Stage, tenants: dict[str, int], *, working_bytes: int, kept_bytes: int = 0, samples: int = 0
) -> list[Fix]:
    """Remedies for an evaluation batch that does not fit, most bytes saved first: estimates, never measured.

    Args:
        stage: the loop.
        tenants: each tenant's bytes (at the failure, or at the batch's end).
        working_bytes: what the step held above its start (at the failure, or at its peak).
        kept_bytes: what outlives the step (its outputs, what it logged or kept).
        samples: the batch's samples; 1 or fewer leaves out halving the batch.

    Returns:
        The fixes.
    """
    loop = LOOP_NAMES[stage]
    fixes = []
    if samples > 1 and working_bytes > 0:
        fixes.append(Fix(f"halve the {loop} batch size (the {loop} DataLoader's batch_size)", working_bytes // 2))
    activations = tenants.get("activations", 0)
    if activations:
        fixes.append(
            Fix(f"run the {loop} step without a graph (torch.no_grad(), or detach what it returns)", activations)
        )
    if kept_bytes > 0:
        fixes.append(Fix(f"keep what the {loop} step returns or appends on the CPU (.detach().cpu())", kept_bytes))
    gradients = tenants.get("gradients", 0)
    if gradients:
        fixes.append(
            Fix(
                f"free the gradients training left before the {loop} loop (optimizer.zero_grad(set_to_none=True) in"
                " on_validation_start: Lightning zeroes them before the next backward anyway, unless validation runs"
                " inside an accumulation)",
                gradients,
            )
        )
    return sorted(fixes, key=lambda f: -f.saves_bytes)

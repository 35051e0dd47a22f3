"""Sentences from numbers: what held memory at the peak, and what the graph walks found.

Each function reads a record (or counts) and returns words; nothing here measures.
"""

from __future__ import annotations

from lightning_memtenants.core.record import GraphCounts, PhaseReport
from lightning_memtenants.names import WINDOWS, Phase
from lightning_memtenants.units import MiB

COMPILED_REASON = (
    "the model runs torch.compile'd code, whose kernels allocate outside PyTorch's dispatcher where the"
    " live-tensor tracker cannot see them, so the tracker does not measure the rest of this run (the tenants"
    " stay exact, counted from the tensors; on CUDA the allocator's counters see compiled code)"
)
NO_OUTPUT = "activations not measured: phase('before_backward') was given no output whose graph to read"
DIVERGED = (
    "activations not read after a phase that the step carried from had not: this micro-batch's tenants were"
    " carried from an earlier step with the same batch shapes until then, and its graph was not walked"
)


def _at_end(phase: PhaseReport) -> str:
    """The activations and gradients at a phase boundary, in words."""
    tenants = phase.tenants_bytes
    activations, gradients = tenants["activations"] / MiB, tenants["gradients"] / MiB
    return f"{activations:.3f} MiB of activations and {gradients:.3f} MiB of gradients at its end"


def explain_peak(
    phases: dict[Phase, PhaseReport],
    peak_phase: Phase | None,
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

    Args:
        phases: the step's phases (the last occurrence of each).
        peak_phase: the phase whose window held the peak, or None where not measured.
        peak_bytes: the step's peak, or None where not measured.
        largest_parameter_bytes: the largest parameter's bytes, to size the optimizer's temporaries by.
        optimizer: the optimizers and their implementations, in words.
        expected_temporaries_bytes: the formula's temporaries for the optimizer step, or None.
        gathered_bytes: the largest FSDP unit's unsharded bytes; 0 where parameters are not sharded.

    Returns:
        The sentence; it says so where the peak was not measured.

    Raises:
        KeyError: if ``peak_phase`` is not in ``phases``.
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


def graph_notes(counts: GraphCounts, device_type: str) -> list[str]:
    """What the step's graph walks found beside the tenants: checkpointed regions, the user's saved-tensor hooks.

    Args:
        counts: the graph walks' counts.
        device_type: the device trained on, named where hooks moved tensors off it.

    Returns:
        One sentence per finding; none where the walks found nothing.
    """
    notes = []
    if counts.checkpointed_regions:
        notes.append(
            f"activation checkpointing: {counts.checkpointed_regions} checkpointed region(s) keep only their inputs"
            " for backward and recompute the rest, so the activations tenant is smaller than the forward's"
        )
    if counts.hooked:
        text = (
            f"saved-tensor hooks: your saved_tensors_hooks packed {counts.hooked} saved tensor(s); the"
            " activations tenant counts what the hook keeps (its packed tensors), read without unpacking"
        )
        if counts.offloaded_bytes:
            text += (
                f"; {counts.offloaded_bytes:,} bytes of them were moved off the {device_type} device (an"
                " offload such as save_on_cpu) and are not in the tenant"
            )
        if counts.opaque:
            text += (
                f"; {counts.opaque} were packed into objects that hold no tensor, whose bytes cannot be"
                " counted and are not in the tenant"
            )
        notes.append(text)
    return notes

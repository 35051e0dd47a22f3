"""Sentences from numbers: what held memory at the peak, and what the graph walks found.

Each function reads a record (or counts) and returns words; nothing here measures.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_memtenants.core.record import GraphCounts, PhaseReport
from lightning_memtenants.names import PHASES, WINDOWS, Phase
from lightning_memtenants.units import MiB

COMPILED_REASON = (
    "the model runs torch.compile'd code, whose kernels allocate outside PyTorch's dispatcher where the"
    " live-tensor tracker cannot see them, so the tracker does not measure the rest of this run (the tenants"
    " stay exact, counted from the tensors; on CUDA the allocator's counters see compiled code)"
)
NO_OUTPUT = "activations not measured: phase('before_backward') was given no output whose graph to read"
# The words every report whose tenants were carried rather than counted holds (``carried_note``, ``diverged_note``).
CARRIED = "tenants carried from step"


def _which(micro_batches: Sequence[int], of: int) -> str:
    """`` (micro-batches 0, 1 of 2)``; nothing for a step of one micro-batch."""
    if of <= 1:
        return ""
    plural = "es" if len(micro_batches) > 1 else ""
    return f" (micro-batch{plural} {', '.join(map(str, micro_batches))} of {of})"


def carried_note(step: int, micro_batches: Sequence[int] = (), of: int = 1) -> str:
    """The note of a step whose micro-batches carried the tenants counted on ``step``, phase by phase.

    Args:
        step: the step they were counted on.
        micro_batches: which of this step's micro-batches carried them (with ``of`` above 1).
        of: how many micro-batches the step had.

    Returns:
        ``"tenants carried from step k, not counted: ..."``.
    """
    return (
        f"{CARRIED} {step}, not counted{_which(micro_batches, of)}: this step repeats that step's batch shapes,"
        " parameters, optimizer state and gradients, phase by phase, and its graph was not walked; what a value"
        " decides (tokens routed by a gate) is not seen; track_every_step=True counts every step"
    )


def diverged_note(step: int, phase: Phase, why: str, micro_batch: int = 0, of: int = 1, *, banned: bool = True) -> str:
    """The note of a micro-batch that carried the tenants counted on ``step`` until ``phase``, where it differed.

    Args:
        step: the step its first phases were carried from.
        phase: the first phase counted.
        why: what differed there, in words (``"the parameters with a gradient"``).
        micro_batch: its place in the step.
        of: how many micro-batches the step had.
        banned: whether its batch shape is never carried again (a change of the module's parameters is not).

    Returns:
        ``"tenants carried from step k, not counted, before <phase>: ..."``; it names the activations where they
        were among the phases carried.
    """
    carried = PHASES[: PHASES.index(phase)] if phase in PHASES else ()
    text = (
        f"{CARRIED} {step}, not counted, before {phase}{_which([micro_batch], of)}: {why} differed from step"
        f" {step}'s there, so it was counted from {phase} on"
    )
    if "before_backward" in carried:
        text += f"; its activations, read at before_backward, are step {step}'s, and its graph was not walked"
    return text + ("; this batch shape is counted on every step from now on" if banned else "")


def readings_note(
    step: int, phase: Phase, read: tuple[int | None, int | None], then: tuple[int | None, int | None]
) -> str:
    """The note of a carried step whose memory source read other bytes than the step its tenants were carried from.

    Args:
        step: the step the tenants were carried from.
        phase: the first phase whose readings differ.
        read: ``(allocated, window peak)`` there on this step.
        then: the same on ``step``.

    Returns:
        The sentence: the tenants may differ, and the next step is counted.
    """
    return (
        f"the memory source read other bytes at {phase} than on step {step}, whose tenants this step carried"
        f" (allocated, window peak: {_bytes(read)} against {_bytes(then)}): its tenants may differ from counting's,"
        " and the next step is counted"
    )


def _bytes(reading: tuple[int | None, int | None]) -> str:
    return ", ".join("not read" if v is None else f"{v:,}" for v in reading)


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
    if counts.selective_regions:
        notes.append(
            f"activation checkpointing: {counts.checkpointed_regions} checkpointed region(s),"
            f" {counts.selective_regions} of them selective, keep their inputs and the outputs of the operators"
            " their policy saves (its cache, counted as activations) for backward and recompute the rest"
        )
    elif counts.checkpointed_regions:
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
                f"; {counts.offloaded_bytes:,} bytes of them were moved off the"
                f" {'device' if device_type == 'cpu' else device_type + ' device'} to host memory (an"
                " offload such as save_on_cpu) and are not in the tenant"
            )
        if counts.opaque:
            text += (
                f"; {counts.opaque} were packed into objects that hold no tensor, whose bytes cannot be"
                " counted and are not in the tenant"
            )
        notes.append(text)
    return notes

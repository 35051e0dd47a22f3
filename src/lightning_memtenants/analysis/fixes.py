"""Remedies for a step that does not fit: each fix and the bytes it would save, and what the first step adds.

These are estimates from the tenants of one step, for where no dry run can run (a sharded strategy, a
device a dry run does not know, a step that reads values); ``predict.advise`` measures each fix exactly by
dry runs, and the postmortem says which of the two it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_memtenants.analysis.formulas import expected_fixed_cost, optimizer_kind, step_temporaries_bytes


def optimizer_step_temporaries_bytes(optimizers: Sequence[Optimizer]) -> int:
    """A first estimate of what an optimizer step allocates and frees again.

    The single-tensor loop of Adam-like optimizers makes two temporaries the size of the
    parameter it works on, so its peak is set by the largest parameter; ``foreach`` makes
    one for every parameter at once; ``fused`` makes none (``formulas.step_temporaries_bytes``).

    Args:
        optimizers: the optimizers; one the package does not know adds 0.

    Returns:
        The temporaries' bytes, summed over the optimizers.
    """
    return sum(step_temporaries_bytes(optimizer) for optimizer in optimizers)


def first_step_jump_bytes(module: nn.Module, optimizers: Sequence[Optimizer], state_now: int) -> tuple[int, int]:
    """What the first optimizer step will add: (lazily created state, temporaries).

    Args:
        module: the model.
        optimizers: its optimizers.
        state_now: the optimizer state's bytes before the step.

    Returns:
        The state the formula expects less what exists already (at least 0), and the step's temporaries.
    """
    state = max(expected_fixed_cost(module, optimizers).optimizer_state_bytes - state_now, 0)
    return state, optimizer_step_temporaries_bytes(optimizers)


@dataclass(frozen=True)
class Fix:
    """One remedy for an OOM and the bytes it would save, estimated (``predict.advise.MeasuredFix`` is measured).

    Args:
        action: what to do, in words.
        saves_bytes: about how many bytes it would save, estimated from the tenants.
    """

    action: str
    saves_bytes: int


def ranked_fixes(
    tenants: dict[str, int],
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    world_size: int = 1,
    temporaries_bytes: int = 0,
    batch_temporaries_bytes: int = 0,
) -> list[Fix]:
    """The fixes for the tenants at hand, most bytes saved first: estimates, never measured.

    ``batch_temporaries_bytes`` is memory that grows with the batch but is not (yet) saved for
    backward: the forward's in-flight outputs when an OOM strikes there.

    Args:
        tenants: each tenant's bytes when the step failed.
        module: the model (fp32 parameters suggest bf16-mixed).
        optimizers: its optimizers (an Adam-like one suggests SGD without momentum).
        world_size: the ranks the optimizer state could be sharded over (at least 2 is suggested).
        temporaries_bytes: the optimizer step's temporaries, where the OOM struck in the optimizer step.
        batch_temporaries_bytes: memory that grows with the batch beside the activations.

    Returns:
        The fixes that apply, most bytes saved first.
    """
    fixes = []
    activations = tenants.get("activations", 0)
    grows = activations + batch_temporaries_bytes
    if grows:
        fixes.append(
            Fix("halve the batch size (use accumulate_grad_batches=2 to keep the effective batch)", grows // 2)
        )
    if activations:
        fixes.append(
            Fix("activation checkpointing of the largest blocks (torch.utils.checkpoint)", activations * 7 // 10)
        )
    if grows and any(p.dtype == torch.float32 for p in module.parameters()):
        fixes.append(Fix("precision='bf16-mixed': half-size activations", grows // 2))
    state = tenants.get("optimizer_state", 0)
    if state:
        n = max(world_size, 2)
        fixes.append(
            Fix(
                f"shard the optimizer state with ZeRO or FSDP across {n} devices: saves (N-1)/N of it",
                state * (n - 1) // n,
            )
        )
    if temporaries_bytes:
        fixes.append(
            Fix("use the optimizer's fused=True (no per-parameter temporaries) or foreach=False", temporaries_bytes)
        )
    if state and any((kind := optimizer_kind(o)) is not None and kind.adam_like for o in optimizers):
        fixes.append(Fix("SGD without momentum keeps no optimizer state", state))
    return sorted(fixes, key=lambda fix: fix.saves_bytes, reverse=True)

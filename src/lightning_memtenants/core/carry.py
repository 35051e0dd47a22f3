"""Counted micro-batches, kept so that a step which repeats one can carry its tenants instead of counting again.

Counting the activations means walking the loss's autograd graph: a Python step per node, which on a
model of small operators costs about as much as the rest of the measurement together. A training step
repeats the one before it: with the same batch shapes, the same optimizer state and the same gradients
present, the same code saves the same tensors. So a step that the memory source does not measure carries
the tenants of the last counted micro-batch whose :func:`batch_key` it shares, and its report says which
step they were counted on (``StepReport.tenants_from_step``). Measured steps always count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants.core.record import GraphCounts, PhaseReport
from lightning_memtenants.core.storage import local_optimizer
from lightning_memtenants.names import Phase

_GRAD = attrgetter("grad")
# What decides a micro-batch's tenants, as far as can be seen at its start without walking anything.
BatchKey = tuple[Any, ...]


def batch_key(
    index: int,
    batch: Sequence[Tensor] | None,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    tensors: Sequence[Tensor],
) -> BatchKey:
    """What must repeat for a micro-batch to save what an earlier one saved.

    Args:
        index: the micro-batch's place in its optimizer step (gradients accumulate over them).
        batch: the tensors of its input batch (``storage.batch_tensors``), or None; each one's shape, dtype and
            device count.
        module: the model: whether it is in training mode.
        optimizers: the optimizers: how many parameters each holds state for.
        tensors: the parameters and buffers: how many have a gradient.

    Returns:
        A hashable key.
    """
    shapes = tuple((t.shape, t.dtype, t.device) for t in batch) if batch is not None else None
    state = tuple(len(local_optimizer(o).state) for o in optimizers)
    gradients = sum(map(is_not, map(_GRAD, tensors), repeat(None)))  # in C: no Python step per tensor
    return (index, shapes, module.training, torch.is_grad_enabled(), state, gradients)


@dataclass(frozen=True)
class CountedBatch:
    """One micro-batch whose tenants were counted: its phases (tenants and parts, no readings) and graph counts.

    Args:
        step: the step it was counted on.
        phases: its phases, without the memory source's figures.
        counts: what its graph walk found (checkpointed regions, hooked saved tensors).
    """

    step: int
    phases: dict[Phase, PhaseReport]
    counts: GraphCounts


class CountedBatches:
    """The latest counted micro-batch for each key, the newest ``capacity`` keys.

    Args:
        capacity: how many keys are kept; a run whose batch shapes vary more counts its new shapes.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._kept: dict[BatchKey, CountedBatch] = {}

    def get(self, key: BatchKey) -> CountedBatch | None:
        """The counted micro-batch with this key, or None."""
        return self._kept.get(key)

    def keep(self, key: BatchKey, counted: CountedBatch) -> None:
        """Keep ``counted`` as the micro-batch to carry for ``key``, in place of any before it."""
        self._kept.pop(key, None)
        self._kept[key] = counted
        while len(self._kept) > self.capacity:
            del self._kept[next(iter(self._kept))]

    def clear(self) -> None:
        """Forget every counted micro-batch (the next steps count)."""
        self._kept.clear()


def graph_delta(before: GraphCounts, after: GraphCounts) -> GraphCounts:
    """What one micro-batch's walks added to the step's graph counts.

    Args:
        before: the counts when the micro-batch began.
        after: the counts when it ended.

    Returns:
        The additive counts' differences; the largest checkpointed regions and the compiled flag as they ended.
    """
    return GraphCounts(
        checkpointed_regions=after.checkpointed_regions,
        hooked=after.hooked - before.hooked,
        opaque=after.opaque - before.opaque,
        offloaded_bytes=after.offloaded_bytes - before.offloaded_bytes,
        compiled=after.compiled,
    )

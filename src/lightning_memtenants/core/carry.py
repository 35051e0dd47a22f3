"""Counted micro-batches, kept so that a step which repeats one can carry its tenants instead of counting again.

Counting the activations means walking the loss's autograd graph: a Python step per node, which on a
model of small operators costs about as much as the rest of the measurement together. A training step
repeats the one before it: with the same batch shapes, the same parameters, optimizer state and gradients
present, the same code saves the same tensors. So a step that the memory source does not measure carries
the tenants of the last counted micro-batch whose :func:`batch_key` it shares, phase by phase, as long as its
:func:`structure` at each phase is the counted one's there; where it differs, the micro-batch is counted from
that phase on, and its key is never carried again (:meth:`CountedBatches.ban`). Its report says which step the
tenants were counted on (``StepReport.tenants_from_step``), and its notes that they were carried. Measured steps
always count.

What a value decides (tokens routed by a gate, a block skipped at random with the same gradients present) is
not seen: such a step's tenants may differ from counting's, which is why every carried report says it carried.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, is_not, itemgetter
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module
from torch.optim import Optimizer

from lightning_memtenants.core.record import GraphCounts, PhaseReport
from lightning_memtenants.core.storage import local_optimizer
from lightning_memtenants.names import Phase

_GRAD = attrgetter("grad")
_TRAINABLE = attrgetter("requires_grad")
_PARAMS = itemgetter("params")
_STATE = attrgetter("state")
_GROUPS = attrgetter("param_groups")
# What decides a micro-batch's tenants, as far as can be seen at its start without walking anything.
BatchKey = tuple[Any, ...]
# What is cheap to see at every phase: parameters with a gradient (how many, their bytes), trainable parameters,
# each optimizer's state entries and parameter groups, and the optimizers that stepped in the micro-batch so far.
Structure = tuple[Any, ...]


def tensor_sizes(tensors: Sequence[Tensor]) -> list[int]:
    """Each tensor's bytes, read once where the tensors are (re)read, for :func:`structure`.

    Args:
        tensors: the parameters (and buffers).

    Returns:
        ``numel * element_size`` of each, in order.
    """
    return [t.numel() * t.element_size() for t in tensors]


def structure(
    params: Sequence[Tensor],
    sizes: Sequence[int],
    optimizers: Sequence[Optimizer],
    stepped: Sequence[int] = (),
    gradients: bool = True,
    optimizer_state: bool = True,
) -> Structure:
    """What a carried micro-batch must have at a phase to carry the counted one's tenants there, in a few C-level
    passes: no Python step per parameter (the gradients' pass costs about 0.2 us a parameter, the rest 2 us).

    Args:
        params: the parameters.
        sizes: their bytes (:func:`tensor_sizes`), in the same order.
        optimizers: the optimizers that hold state (``storage.local_optimizer`` of each).
        stepped: the indices of the optimizers that stepped in the micro-batch so far, in order.
        gradients: look at the gradients; False leaves them out (None), at phases where no backward came since the
            last look.
        optimizer_state: look at the optimizers' state entries and parameter groups; False leaves them out (None),
            at phases where no optimizer step came since the last look.

    Returns:
        ``(bytes of the parameters with a gradient, state entries per optimizer, parameters per group per optimizer,
        stepped)``, hashable.
    """
    grads = sum(compress(sizes, map(is_not, map(_GRAD, params), repeat(None)))) if gradients else None
    if not optimizer_state:
        return (grads, None, None, tuple(stepped))
    return (
        grads,
        tuple(map(len, map(_STATE, optimizers))),
        tuple(map(tuple, map(map, repeat(len), map(map, repeat(_PARAMS), map(_GROUPS, optimizers))))),
        tuple(stepped),
    )


def batch_key(
    index: int,
    batch: Sequence[Tensor] | None,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    tensors: Sequence[Tensor],
    sizes: Sequence[int] | None = None,
) -> BatchKey:
    """What must repeat for a micro-batch to save what an earlier one saved.

    Args:
        index: the micro-batch's place in its optimizer step (gradients accumulate over them).
        batch: the tensors of its input batch (``storage.batch_tensors``), or None; each one's shape, dtype and
            device count.
        module: the model: whether it is in training mode.
        optimizers: the optimizers: how many parameters each holds state for, and its parameter groups.
        tensors: the parameters and buffers: how many there are and their bytes, how many are trainable, and the
            bytes of those that have a gradient.
        sizes: their bytes (:func:`tensor_sizes`); None reads them.

    Returns:
        A hashable key.
    """
    shapes = tuple((t.shape, t.dtype, t.device) for t in batch) if batch is not None else None
    if sizes is None:
        sizes = tensor_sizes(tensors)
    layout = structure(tensors, sizes, list(map(local_optimizer, optimizers)))
    trainable = sum(map(_TRAINABLE, tensors))
    return (index, shapes, module.training, torch.is_grad_enabled(), len(tensors), sum(sizes), trainable, layout)


class CountedPhase(NamedTuple):
    """One phase of a counted micro-batch, in the order the phases came.

    Attributes:
        name: the phase.
        structure: what :func:`structure` saw there.
        report: its tenants and parts, without the memory source's figures.
        reading: ``(allocated, window peak)`` where the source measured it (on CUDA, to compare a carried step's
            with), else None.
    """

    name: Phase
    structure: Structure
    report: PhaseReport
    reading: tuple[int | None, int | None] | None


@dataclass(frozen=True)
class CountedBatch:
    """One micro-batch whose tenants were counted: its phases (tenants and parts, no readings) and graph counts.

    Args:
        step: the step it was counted on.
        phases: its phases, without the memory source's figures (the last occurrence of each).
        counts: what its graph walk found (checkpointed regions, hooked saved tensors).
        sequence: every phase in the order it came, with its structure and reading (:class:`CountedPhase`).
    """

    step: int
    phases: dict[Phase, PhaseReport]
    counts: GraphCounts
    sequence: tuple[CountedPhase, ...] = field(default=())


class CountedBatches:
    """The latest counted micro-batch for each key, the newest ``capacity`` keys, and the keys never to carry.

    Args:
        capacity: how many keys are kept; a run whose batch shapes vary more counts its new shapes.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._kept: dict[BatchKey, CountedBatch] = {}
        self._banned: set[BatchKey] = set()

    def get(self, key: BatchKey) -> CountedBatch | None:
        """The counted micro-batch with this key, or None (always for a banned key)."""
        return self._kept.get(key)

    def keep(self, key: BatchKey, counted: CountedBatch) -> None:
        """Keep ``counted`` as the micro-batch to carry for ``key``, in place of any before it (not a banned key)."""
        if key in self._banned:
            return
        self._kept.pop(key, None)
        self._kept[key] = counted
        while len(self._kept) > self.capacity:
            del self._kept[next(iter(self._kept))]

    def ban(self, key: BatchKey) -> None:
        """Never carry ``key`` again: a micro-batch that carried it diverged (its steps differ by more than the key)."""
        self._kept.pop(key, None)
        self._banned.add(key)

    def banned(self, key: BatchKey) -> bool:
        """Whether ``key`` is never carried again."""
        return key in self._banned

    def clear(self) -> None:
        """Forget every counted micro-batch and every ban (the next steps count)."""
        self._kept.clear()
        self._banned.clear()


_TREE = {"version": 0, "watchers": 0}
_TREE_HOOKS: list[Any] = []


def _tree_changed(*_: Any) -> None:
    """A parameter, buffer or submodule was registered on some module: what a monitor counts may have changed."""
    _TREE["version"] += 1


# One entry per watch collected without ``close``: its finalizer only appends here (C code, where no Ctrl+C can be
# swallowed), and the release itself runs at the next safe point (a watch made or read).
_COLLECTED: list[int] = []


def _unwatch() -> None:
    _TREE["watchers"] -= 1
    if _TREE["watchers"] == 0:
        while _TREE_HOOKS:
            _TREE_HOOKS.pop().remove()


def _release_collected() -> None:
    while _COLLECTED:
        _COLLECTED.pop()
        _unwatch()


class TreeWatch:
    """A count of the parameters, buffers and submodules registered on any module since the process began to watch.

    It is torch's global registration hooks (``register_module_parameter_registration_hook`` and its two kin):
    installed while any watch is open, removed with the last one (``close``, or when the watch is collected). A
    change of the count is the cue to read a module's parameters again; reading them at every step would cost a
    walk of the module tree.
    """

    def __init__(self) -> None:
        _release_collected()
        if _TREE["watchers"] == 0:
            _TREE_HOOKS.extend(
                register(_tree_changed)
                for register in (
                    _module.register_module_parameter_registration_hook,
                    _module.register_module_buffer_registration_hook,
                    _module.register_module_module_registration_hook,
                )
            )
        _TREE["watchers"] += 1
        self._release = weakref.finalize(self, _COLLECTED.append, 1)

    @property
    def version(self) -> int:
        """How many registrations have happened, process-wide (it only grows)."""
        if _COLLECTED:
            _release_collected()
        return _TREE["version"]

    @property
    def closed(self) -> bool:
        """Whether this watch was closed (its hooks may be gone)."""
        return not self._release.alive

    def close(self) -> None:
        """Stop watching; the hooks go with the last open watch. Safe to call more than once."""
        if self._release.detach() is not None:
            _unwatch()


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
        selective_regions=after.selective_regions,
    )

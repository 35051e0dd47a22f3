"""The micro-batches of the step under way: which are counted, which carry a counted one, and where a carry diverges.

A step that the memory source does not measure carries, micro-batch by micro-batch, the tenants of the last
counted micro-batch with the same :func:`~lightning_memtenants.core.carry.batch_key` (``core/carry.py`` holds the
keys, the structures and the records kept). Deciding that at each phase, and keeping what each micro-batch counted
for the steps after, is one bookkeeping of its own: :class:`MicroBatches` does it, and the monitor asks it which
phases to count and which to carry. It makes no sentence: the monitor turns what it records into the step's notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants.core.carry import (
    BatchKey,
    CountedBatch,
    CountedBatches,
    CountedPhase,
    Structure,
    batch_key,
    graph_delta,
    structure,
    tensor_sizes,
)
from lightning_memtenants.core.census import ActivationTracker
from lightning_memtenants.core.record import GraphCounts, PhaseReport
from lightning_memtenants.core.sources import Reading
from lightning_memtenants.core.storage import local_optimizer
from lightning_memtenants.names import Phase

# A micro-batch that carried until a phase: (micro-batch, the step carried from, the phase, why, whether its key was
# banned).
Diverged = tuple[int, int, Phase, str, bool]


class StepBatches(NamedTuple):
    """The micro-batches of one ended step, as :meth:`MicroBatches.end` hands them over.

    Attributes:
        phases: each micro-batch's phases, in order (the last occurrence of each).
        keys: each one's key; None where it had none or its carry diverged.
        carried: the counted micro-batch each one carried, or None where it was counted.
        deltas: what each one's graph walks found.
        sequences: each counted one's phases in the order they came, to keep.
        diverged: the micro-batches that carried until a phase (:data:`Diverged`).
    """

    phases: list[dict[Phase, PhaseReport]]
    keys: list[BatchKey | None]
    carried: list[CountedBatch | None]
    deltas: list[GraphCounts]
    sequences: list[list[CountedPhase]]
    diverged: list[Diverged]

    @property
    def tenants_from_step(self) -> int | None:
        """The latest step whose counted tenants this step carried (in full or until a phase), or None."""
        steps = [c.step for c in self.carried if c is not None] + [d[1] for d in self.diverged]
        return max(steps) if steps else None

    def readings(self) -> tuple[Any, ...]:
        """What the memory source read at each phase, to tell a step that read the same as the last."""
        return tuple(
            (name, p.allocated_bytes, p.window_peak_bytes, p.reserved_bytes)
            for mb in self.phases
            for name, p in mb.items()
        )

    def peak(self) -> tuple[int | None, Phase | None]:
        """The highest point of the step and its phase; the window before ``batch_start`` counts only at its end."""
        best: tuple[int | None, Phase | None] = (None, None)
        for batch_phases in self.phases:
            for name, phase in batch_phases.items():
                value = phase.allocated_bytes if name == "batch_start" else phase.window_peak_bytes
                if value is not None and (best[0] is None or value > best[0]):
                    best = (value, name)
        return best


class MicroBatches:
    """The micro-batches of the step under way, and the counted ones kept by key for later steps to carry.

    The monitor opens a micro-batch at each ``batch_start`` (:meth:`open`, :meth:`assign`); at each phase of one that
    carries, :meth:`follow` says whether its structure is still the counted one's there (carry) or not (count from
    this phase on, and never carry its key again); :meth:`end` hands the step's micro-batches over and :meth:`keep`
    keeps the counted ones.

    Args:
        tracker: the activation tracker, whose graph counts each micro-batch adds to (a carried one adds its counted
            one's).
        optimizers: the monitor's optimizers, in order: their state and groups are part of the key and the structure.
        capacity: how many keys are kept (:class:`~lightning_memtenants.core.carry.CountedBatches`).
    """

    def __init__(self, tracker: ActivationTracker, optimizers: Sequence[Optimizer], capacity: int = 32) -> None:
        self._tracker = tracker
        self.optimizers = optimizers  # the monitor's own list: the indices of those that step are into it
        self._local = [local_optimizer(o) for o in self.optimizers]  # the optimizers that hold state
        self.counted = CountedBatches(capacity)
        # the parameters and buffers' bytes, the parameters among them and their bytes: what has gradients
        self.sizes: list[int] = []
        self._params: Sequence[Tensor] = []
        self._param_sizes: list[int] = []
        # per micro-batch of the step under way: its phases, its key, the counted one it carries (None: counted now),
        # what its walks found once closed, and its phases in order (to keep with a counted one)
        self.phases: list[dict[Phase, PhaseReport]] = []
        self.keys: list[BatchKey | None] = []
        self.carried: list[CountedBatch | None] = []
        self.deltas: list[GraphCounts] = []
        self.sequences: list[list[CountedPhase]] = []
        self.diverged: list[Diverged] = []
        # the micro-batch under way: the optimizers that stepped in it, where a carried one is in its counted one's
        # sequence, and the tracker's counts when it began
        self.stepped: list[int] = []
        self._position = 0
        self._counts_at_start = GraphCounts()
        # a carried step whose readings differed from its source step's: the next step is counted
        self.count_next = False
        self.count_this_step = False

    def __len__(self) -> int:
        """Micro-batches begun since the last :meth:`end`."""
        return len(self.phases)

    def read_sizes(self, tensors: Sequence[Tensor], parameters: int) -> None:
        """Read the tensors' bytes once, where the tensors are (re)read, for the key and the structure.

        Args:
            tensors: the module's parameters and buffers, the parameters first.
            parameters: how many of them are parameters.
        """
        self.sizes = tensor_sizes(tensors)
        self._params, self._param_sizes = tensors[:parameters], self.sizes[:parameters]

    def optimizer_stepped(self, optimizer: Optimizer) -> None:
        """Note that ``optimizer`` stepped in the micro-batch under way; one not among the optimizers counts as -1."""
        self.stepped.append(next((i for i, o in enumerate(self.optimizers) if o is optimizer), -1))

    # -- a micro-batch ---------------------------------------------------------------------------

    def open(self) -> int:
        """Close the micro-batch under way, if any, and open the next; its index in the step."""
        self.close()
        self.phases.append({})
        self.sequences.append([])
        self.stepped, self._position = [], 0
        return len(self.phases) - 1

    def key(self, batch: list[Tensor] | None, module: nn.Module, tensors: Sequence[Tensor]) -> BatchKey:
        """The key of the micro-batch just opened (:func:`~lightning_memtenants.core.carry.batch_key`)."""
        return batch_key(len(self.phases) - 1, batch, module, self.optimizers, tensors, self.sizes)

    def assign(self, key: BatchKey | None, carry: bool) -> None:
        """Give the micro-batch just opened its key, and the counted micro-batch it carries where ``carry`` allows."""
        carried = self.counted.get(key) if carry and key is not None else None
        self.keys.append(key)
        self.carried.append(carried)
        if carried is None:
            self._counts_at_start = self._tracker.counts()

    def close(self) -> None:
        """Keep what the walks of the micro-batch ending now found, to carry with its tenants."""
        if len(self.deltas) < len(self.phases):
            carried = self.carried[-1]
            if carried is not None:  # what its counted one's walks found stands for its own
                self._tracker.add_counts(carried.counts)
            delta = graph_delta(self._counts_at_start, self._tracker.counts()) if carried is None else _NONE_FOUND
            self.deltas.append(delta)

    def follow(self, name: Phase, changed: bool) -> CountedPhase | None:
        """A phase of a carried micro-batch: the counted phase to carry, where its structure is the counted one's at the
        same place in the sequence of phases; else None, and the micro-batch is counted from this phase on.

        Args:
            name: the phase.
            changed: whether the module's parameters changed at this phase (one added or replaced).

        Returns:
            The counted phase, or None where the carry diverged (:attr:`diverged` says where and why).
        """
        carried = self.carried[-1]
        assert carried is not None
        position = self._position
        sequence = carried.sequence
        counted = sequence[position] if position < len(sequence) else None
        why = None
        if counted is None or counted.name != name:
            why = "the sequence of phases (another backward or optimizer step)"
        elif changed:
            why = "the module's parameters (one was added or replaced)"
        elif name != "batch_start":  # at batch_start the key holds the structure
            now = self._structure(name)
            if now != counted.structure:
                why = _what_differs(now, counted.structure)
        if why is None:
            self._position = position + 1
            return counted
        # count from here; the phases before were carried, and a key whose carry diverged is never carried again
        # (a parameter added is not the key's fault: the keys after it differ)
        key = self.keys[-1]
        if key is not None and not changed:
            self.counted.ban(key)
        if any(p.name == "before_backward" for p in sequence[:position]):  # its activations were carried
            self._tracker.add_counts(carried.counts)
        self.diverged.append((len(self.phases) - 1, carried.step, name, why, not changed))
        self.carried[-1] = self.keys[-1] = None
        return None

    def carried_phase(self, name: Phase, report: PhaseReport) -> None:
        """Record a carried phase of the micro-batch under way."""
        self.phases[-1][name] = report

    def counted_phase(self, name: Phase, report: PhaseReport, reading: Reading) -> None:
        """Record a counted phase of the micro-batch under way; where the micro-batch may be kept, also its place in
        the sequence of phases, its structure and what the source read (to compare a carried step's with)."""
        self.phases[-1][name] = report
        if self.keys[-1] is not None:
            read = None if reading.allocated_bytes is None else compared(name, reading)
            self.sequences[-1].append(CountedPhase(name, self._structure(name), report.unmeasured(), read))

    def _structure(self, name: Phase) -> Structure:
        return structure(self._params, self._param_sizes, self._local, self.stepped, *_LOOKS.get(name, _NONE))

    # -- a step ------------------------------------------------------------------------------------

    def end(self) -> StepBatches:
        """Close the step: its micro-batches, handed over, and none under way; the next step is counted where a
        carried one read otherwise than its counted one."""
        self.close()
        ended = StepBatches(self.phases, self.keys, self.carried, self.deltas, self.sequences, self.diverged)
        self.drop()
        self.count_this_step, self.count_next = self.count_next, False
        return ended

    def keep(self, step: int, ended: StepBatches) -> None:
        """Keep the micro-batches counted in ``ended``, by key, for later steps to carry.

        Args:
            step: the number of the step they were counted on.
            ended: what :meth:`end` handed over.
        """
        for phases, key, was_carried, counts, sequence in zip(
            ended.phases, ended.keys, ended.carried, ended.deltas, ended.sequences, strict=True
        ):
            if key is None or was_carried is not None or not phases:
                continue
            kept = CountedBatch(step, {n: p.unmeasured() for n, p in phases.items()}, counts, tuple(sequence))
            self.counted.keep(key, kept)

    def drop(self) -> None:
        """Forget the micro-batches of the step under way (a step that will never end)."""
        self.phases, self.keys, self.carried, self.deltas = [], [], [], []
        self.sequences, self.diverged, self.stepped = [], [], []

    def clear(self) -> None:
        """Forget everything: the step under way, every counted micro-batch and ban; the next steps count."""
        self.drop()
        self.count_next = self.count_this_step = False
        self.counted.clear()


_NONE_FOUND = GraphCounts()

# What a carried micro-batch compares with its counted one at each phase beside the phase itself and the optimizers
# that stepped so far: (the gradients, the optimizers' state entries and groups). The gradients at after_backward, where
# the backward decided which parameters have one (a block skipped at random has none); the optimizers at batch_end,
# after their steps. The key compares all of them at batch_start. Each look costs a pass over the parameters or the
# optimizers, a few microseconds in a training loop: the other phases skip them.
_LOOKS: dict[str, tuple[bool, bool]] = {"after_backward": (True, False), "batch_end": (False, True)}
_NONE = (False, False)
_DIFFERS = (
    "the parameters with a gradient",
    "the optimizer state",
    "the parameter groups",
    "the optimizers that stepped",
)


def _what_differs(now: Structure, then: Structure) -> str:
    """What differs between two structures, in words: the first part that does."""
    return next((what for what, a, b in zip(_DIFFERS, now, then, strict=True) if a != b), "the structure")


def compared(name: Phase, reading: Reading) -> tuple[int | None, int | None]:
    """What a carried phase's reading is compared on with its counted one's.

    At ``batch_start`` the window spans the time between steps, which is not the step's, so only the allocated bytes
    count there.

    Args:
        name: the phase.
        reading: what the memory source read there.

    Returns:
        ``(allocated bytes, the window's peak)``, the peak None at ``batch_start``.
    """
    return reading.allocated_bytes, None if name == "batch_start" else reading.window_peak_bytes

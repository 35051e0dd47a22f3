"""A step's memory timeline: every allocation and free the live-tensor tracker sees, operator by operator.

A :class:`TimelineRecorder` is fed by a :class:`~lightning_memtenants.core.tracker.LiveTensorTracker`
on the steps it tracks (and in dry runs), never on other steps. It keeps, per allocation, its
bytes, the operator that made it and the module that was running, and the phase boundaries
with the tensors of the known tenants at each; :meth:`TimelineRecorder.finish` turns that into
a :class:`StepTimeline`: allocated bytes after each event, stacked by tenant, subsampled to a few
thousand points that keep the peak to the byte.

Module paths come from a forward pre-hook and hook on each of the model's modules (a stack of the modules
whose forward runs), removed when the step ends, and,
for backward, from a pre-hook on each autograd node a module's forward made, stamped when that
forward returns. ``AccumulateGrad`` nodes are never hooked (a hook there could keep the gradient
from being stolen, and so change the memory measured).

The same per-allocation module paths split the activations tenant by module
(:meth:`StepTimeline.activations_by_module`): each storage autograd saved is owned by the innermost
module whose forward was running when the storage was allocated.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lightning_memtenants._private import hidden_from_function_modes
from lightning_memtenants.core.storage import storage_keys

# The layers of the stack, bottom first; the last is everything the tenants do not name.
LAYERS: tuple[str, ...] = ("weights", "gradients", "optimizer_state", "activations", "temporaries")
LAYER_LABELS: dict[str, str] = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations (saved)",
    "temporaries": "temporaries and other",
}
# Before the first phase: what was resident when the tracker started.
RESIDENT = "resident at batch_start"
# The key of :meth:`TimelineRecorder.mark`'s tenants that holds autocast's saved casts of weights: in the
# activations layer of the stack, but a named part (``autocast_cache``) of the census, not the activations tenant.
CASTS = "autocast_cache"
# The key of :meth:`TimelineRecorder.mark`'s tenants that holds, at ``batch_start``, the batch's own storages: they grow
# with the batch (:attr:`StepTimeline.scaling`), though the stack draws them with the temporaries.
BATCH = "batch"
# The key of :meth:`TimelineRecorder.mark`'s tenants that holds storages the census counts in no tenant even where
# autograd saved them (FSDP2's gathered parameters): drawn with the temporaries, never as activations.
UNTENANTED = "untenanted"
# The marks that end a micro-batch's forward and backward: what is allocated from its ``batch_start`` to the first of
# them, and is no tenant, is a temporary of the forward or backward, which grows with the batch.
_END_OF_BACKWARD = ("after_backward", "before_optimizer_step", "batch_end")
_STAMP = "memtenants_module"
_ACCUMULATE = "torch::autograd::AccumulateGrad"
# The owner of an activation allocated while no module's forward ran (a loss computed outside the model).
OUTSIDE_MODULES = "(outside any module)"
# The entry for every module past the largest ones, so that a report's split still adds up to the tenant.
OTHER_MODULES = "(other modules)"
# How many modules a report names, largest first.
TOP_MODULES = 10
# The moments the activations are split at (``StepReport.activations_by_module_at``).
AT_PEAK = "peak"
AT_BEFORE_BACKWARD = "before_backward"


@dataclass
class StepTimeline:
    """Allocated bytes over one step's operators, stacked by tenant, with the phases and the peak.

    Args:
        step: the optimizer step.
        op_index: per point, how many operators had been dispatched in the step (the x axis).
        layers: per layer of :data:`LAYERS`, its bytes at each point.
        total_bytes: the allocated bytes at each point (the sum of the layers).
        phases: each phase boundary, in order: ``(phase, op_index, allocated bytes)``.
        peak_bytes: the highest allocated bytes of the step: the report's ``peak_bytes``, to the byte.
        peak_op_index: the operator at the peak (its index in the step).
        peak_op: the operator that allocated at the peak (``aten.mul``), or what did (the tracker's start).
        peak_module: the module path running at the peak (``blocks.0.mlp.fc (backward)``), or the region
            (``optimizer step``); ``""`` where none.
        peak_phase: the phase whose window holds the peak.
        peak_point: the index of the peak among the points.
        ops: the operators dispatched in the step.
        events: the allocations and frees recorded.
        source: the memory source's status.
        trace: the raw events for a memory snapshot: ``(action, allocation, op_index)`` with action
            ``"alloc"`` or ``"free"``; empty if the step had more than the recorder's bound.
        allocations: per allocation: ``(bytes, operator, module path, op_index)``.
        resident: the allocations alive when the step's first phase began.
        peak_in_module: whether a module's forward or backward was running at the peak (``peak_module`` is a
            module path), rather than none (``peak_module`` is the region, or ``""``).
        activations_at_peak_bytes: the activations tenant alive at the peak event, by owning module (see
            :meth:`activations_by_module`), every module, largest first.
        activations_before_backward_bytes: the activations tenant at the last ``before_backward`` boundary, by
            owning module, every module, largest first; empty where the step had no ``before_backward``.
        module_paths: whether the recorder followed the model's modules (hooks on them); where it did not, no
            operator has a module path, and both splits by module are empty.
        phase_layers: per phase boundary of ``phases``, in order, each layer's bytes there: what the stack draws at
            the boundary, whose tenants are the phase table's (a tenant's storages at a boundary are filed under it).
        scaling: per phase window (named by the phase that ends it, ``batch_start`` for what was resident), the
            upper envelope of ``(fixed, scaling)`` byte pairs over the window's events: at each event the live bytes
            split into a part that stays at any batch size (weights, gradients, optimizer state, what was resident
            before the step but the batch, temporaries of the optimizer step) and a part that grows in proportion
            to the batch (the batch's own storages, the activations, the temporaries of the forward and backward).
            The step's peak at ``k`` times the batch is at most ``max(fixed + k * scaling)`` over every window's
            points, and it is the measured peak at ``k = 1``; only the few points that can lead at some ``k > 0``
            are kept. Empty where no phase window was recorded.
    """

    step: int
    op_index: list[int]
    layers: dict[str, list[int]]
    total_bytes: list[int]
    phases: list[tuple[str, int, int]]
    peak_bytes: int
    peak_op_index: int
    peak_op: str
    peak_module: str
    peak_phase: str | None
    peak_point: int
    ops: int
    events: int
    source: str = ""
    trace: list[tuple[str, int, int]] = field(default_factory=list, repr=False)
    allocations: list[tuple[int, str, str, int]] = field(default_factory=list, repr=False)
    resident: list[int] = field(default_factory=list, repr=False)
    peak_in_module: bool = False
    activations_at_peak_bytes: dict[str, int] = field(default_factory=dict)
    activations_before_backward_bytes: dict[str, int] = field(default_factory=dict)
    module_paths: bool = False
    scaling: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    phase_layers: list[dict[str, int]] = field(default_factory=list)

    @property
    def peak_label(self) -> str:
        """The operator at the peak and where it ran: ``aten.mm in blocks.0.fc (backward)``."""
        return f"{self.peak_op} in {self.peak_module}" if self.peak_module else self.peak_op

    def activations_by_module(self, top: int = TOP_MODULES) -> tuple[str, dict[str, int]]:
        """The activations tenant split by the module that owns each storage, at the moment they weigh on the peak.

        A storage is an activation as the census counts one: autograd saved it for backward (read from the loss's
        graph at ``before_backward``), and it is no weight, gradient, optimizer state or autocast cast at that
        boundary. Its owner is the innermost module whose forward was running when the storage was allocated
        (``OUTSIDE_MODULES`` where none was): the last ``Linear``'s output, which the loss's ``pow`` saves, is the
        ``Linear``'s; a ``Tanh``'s output, saved by it and by the ``Linear`` after it, is the ``Tanh``'s. The moment
        is the step's peak where any activation is alive at it (a peak in the forward pass, or in backward before
        the last saved tensor is freed), so that the split shows what holds memory at the peak; elsewhere (a peak in
        the optimizer step, or at the end of backward, when autograd holds nothing) it is the last
        ``before_backward`` boundary, where all of the micro-batch's activations are alive, and the split sums to
        that phase's activations tenant to the byte.

        Args:
            top: how many modules to name, largest first (ties by path); the rest are summed under
                ``OTHER_MODULES``, so the values still add up to the whole.

        Returns:
            The moment (``AT_PEAK`` or ``AT_BEFORE_BACKWARD``) and the bytes by module, largest first; the dict is
            empty where no activation was alive then, or where the step was recorded without module paths.

        Raises:
            ValueError: if ``top`` is not a positive int.
        """
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise ValueError(f"top must be a positive int, got {top!r}")
        if self.activations_at_peak_bytes:
            return AT_PEAK, top_modules(self.activations_at_peak_bytes, top)
        return AT_BEFORE_BACKWARD, top_modules(self.activations_before_backward_bytes, top)


def top_modules(by_module: dict[str, int], top: int = TOP_MODULES) -> dict[str, int]:
    """The ``top`` largest entries of a split by module, largest first, and the rest under ``OTHER_MODULES``.

    Args:
        by_module: bytes by module path.
        top: how many modules to name.

    Returns:
        A dict whose values add up to those of ``by_module``; entries of 0 bytes are left out.
    """
    ranked = sorted(((name, value) for name, value in by_module.items() if value), key=lambda kv: (-kv[1], kv[0]))
    out = dict(ranked[:top])
    rest = sum(value for _, value in ranked[top:])
    if rest:
        out[OTHER_MODULES] = rest
    return out


class TimelineRecorder:
    """Records one step's allocations and frees as a tracker sees them; the tracker calls it.

    Args:
        module: the model, whose module paths name the operators; ``None`` names none.
        max_events: the raw events kept for a memory snapshot; past it, the snapshot is left out
            (the timeline itself is still exact).
        max_points: about how many points the timeline keeps (two per bucket: its highest and lowest).
    """

    def __init__(self, module: nn.Module | None = None, *, max_events: int = 200_000, max_points: int = 2000) -> None:
        self.max_events = max_events
        self.max_points = max_points
        self.ops = 0
        self.op: Any = None
        self.where = ""
        self._allocs: list[tuple[int, int, int, int]] = []  # (key, bytes, label id, op index)
        # allocation -> the storage's own bytes, where an allocator model rounded them up (the census counts these)
        self._exact: dict[int, int] = {}
        self._trace: list[int] = []  # allocation i as i + 1, its free as -(i + 1)
        self._trace_ops: list[int] = []
        self._live: dict[int, int] = {}  # storage key -> allocation
        self._labels: dict[tuple[Any, str], int] = {}
        self._marks: list[tuple[str, int, int, dict[str, set[int]]]] = []  # (phase, events, op index, tenant keys)
        self._modules = list(module.named_modules()) if module is not None else []
        self._module_paths = module is not None
        self._names = {id(m): name for name, m in self._modules}
        self._stack: list[tuple[str, list[Any]]] = []
        self._hooks: list[Any] = []
        self._tracker: Any = None
        self._batch_indices: set[int] = set()

    # -- the tracker's side ---------------------------------------------------------------------

    def attach(self, tracker: Any) -> None:
        """Follow ``tracker`` from now on; the storages it already knows are resident."""
        self._tracker = tracker
        for key, (_, nbytes) in list(tracker._live.items()):
            self.alloc(key, nbytes)
        tracker.recorder = self
        for _, module in self._modules:  # the model's own modules, not global hooks (torch.compile warns of those)
            self._hooks.append(module.register_forward_pre_hook(self._forward_in))
            self._hooks.append(module.register_forward_hook(self._forward_out))

    def detach(self) -> None:
        """Stop following the tracker and remove the module hooks; safe to call twice."""
        if self._tracker is not None and self._tracker.recorder is self:
            self._tracker.recorder = None
        self._tracker = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._stack = []

    def begin_op(self, func: Any) -> None:
        """An operator is dispatched: what it allocates is its."""
        self.ops += 1
        self.op = func

    def alloc(self, key: int, nbytes: int) -> None:
        """A storage the tracker counts from now on, of ``nbytes`` (or a resize to them)."""
        old = self._live.get(key)
        if old is not None:
            self._event(-(old + 1))
        label = (self.op, self.where)
        ident = self._labels.get(label)
        if ident is None:
            ident = self._labels[label] = len(self._labels)
        index = len(self._allocs)
        self._allocs.append((key, nbytes, ident, self.ops))
        pads = getattr(self._tracker, "_pad", None)  # the tracker's allocator model's rounding, by storage
        pad = pads.get(key, 0) if pads else 0
        if pad:
            self._exact[index] = nbytes - pad
        self._live[key] = index
        self._event(index + 1)

    def free(self, key: int) -> None:
        """A storage the tracker counted is freed."""
        index = self._live.pop(key, None)
        if index is not None:
            self._event(-(index + 1))

    def _event(self, code: int) -> None:
        self._trace.append(code)
        self._trace_ops.append(self.ops)

    # -- the monitor's side ---------------------------------------------------------------------

    def mark(self, phase: str, tenants: dict[str, Iterable[int]]) -> None:
        """A phase boundary (right after the memory source was read), with the storage keys of each tenant.

        Args:
            phase: the phase boundary.
            tenants: the storage keys by tenant (:func:`tenant_keys`), autocast's casts under ``CASTS``.
        """
        self._marks.append((phase, len(self._trace), self.ops, {t: set(keys) for t, keys in tenants.items()}))
        if phase in ("after_backward", "before_optimizer_step") or phase == "batch_end":
            self.where = ""

    def finish(self, step: int, source: str = "") -> StepTimeline | None:
        """The step's timeline; ``None`` where no phase was marked."""
        self.detach()
        if not self._marks:
            return None
        n = len(self._trace)
        codes = np.asarray(self._trace, dtype=np.int64)
        ops = np.asarray(self._trace_ops, dtype=np.int64)
        sizes = np.asarray([a[1] for a in self._allocs], dtype=np.int64)
        layer, saved, casts = self._classify()
        index = np.abs(codes) - 1
        signs = np.where(codes > 0, 1, -1)
        deltas = np.zeros((n, len(LAYERS)), dtype=np.int64)
        if n:
            deltas[np.arange(n), layer[index]] = signs * sizes[index]
        stacked = np.cumsum(deltas, axis=0)
        totals = stacked.sum(axis=1)
        first, last = self._marks[0][1], self._marks[-1][1]
        # the report's peak: the windows from each batch_start to the phases after it
        windows = np.zeros(n, dtype=bool)
        start = None
        for phase, position, _, _ in self._marks:
            if phase == "batch_start":
                start = position
            elif start is not None:
                windows[start:position] = True
        at_marks = [p - 1 for _, p, _, _ in self._marks if p > 0]
        candidates = np.flatnonzero(windows)
        candidates = np.union1d(candidates, np.asarray(at_marks, dtype=np.int64))
        if len(candidates):
            best = int(candidates[np.argmax(totals[candidates])])
            peak = int(totals[best])
        else:
            best, peak = -1, 0
        # the points: the state at the first mark, then every event up to the last, subsampled
        keep = _subsample(totals, first, last, self.max_points, best)
        base = stacked[first - 1] if first > 0 else np.zeros(len(LAYERS), dtype=np.int64)
        xs = [self._marks[0][2]] + [int(ops[i]) for i in keep]
        layers = {name: [int(base[j])] + [int(stacked[i, j]) for i in keep] for j, name in enumerate(LAYERS)}
        total = [int(base.sum())] + [int(totals[i]) for i in keep]
        labels = {ident: label for label, ident in self._labels.items()}
        peak_op, peak_where, peak_index = "tracker start", "", self._marks[0][2]
        if best >= first and codes[best] > 0:
            _, _, ident, peak_index = self._allocs[int(codes[best]) - 1]
            func, peak_where = labels[ident]
            peak_op = op_name(func)
        peak_phase = None
        for phase, position, _, _ in self._marks:
            if best < position:
                peak_phase = phase
                break
        region = _region(self._marks, peak_index)
        peak_in_module = bool(peak_where)
        if not peak_where and region:
            peak_where = region
        at_peak: dict[str, int] = {}
        before_backward: dict[str, int] = {}
        if self._module_paths:  # without them every storage would read as made outside any module
            at_peak, before_backward = self._activations_by_module(codes, saved, best, labels)
        phases = [(phase, op_at, int(totals[p - 1]) if p > 0 else 0) for phase, p, op_at, _ in self._marks]
        zero = np.zeros(len(LAYERS), dtype=np.int64)
        phase_layers = [
            dict(zip(LAYERS, (stacked[p - 1] if p > 0 else zero).tolist(), strict=True)) for _, p, _, _ in self._marks
        ]
        scaling = self._scaling(codes, sizes, layer, casts, candidates)
        trace: list[tuple[str, int, int]] = []
        allocations: list[tuple[int, str, str, int]] = []
        resident: list[int] = []
        if n <= self.max_events:
            names = {ident: (op_name(func), where) for ident, (func, where) in labels.items()}
            allocations = [(nbytes, *names[ident], at) for _, nbytes, ident, at in self._allocs]
            trace = [
                ("alloc" if c > 0 else "free", abs(c) - 1, int(o))
                for c, o in zip(self._trace, self._trace_ops, strict=True)
            ]
            alive: set[int] = set()
            for code in self._trace[:first]:
                (alive.add if code > 0 else alive.discard)(abs(code) - 1)
            resident = sorted(alive)
            trace = trace[first:last]
        return StepTimeline(
            step=step,
            op_index=xs,
            layers=layers,
            total_bytes=total,
            phases=phases,
            peak_bytes=peak,
            peak_op_index=int(peak_index),
            peak_op=peak_op,
            peak_module=peak_where,
            peak_phase=peak_phase,
            peak_point=keep.index(best) + 1 if best in keep else 0,
            ops=self.ops,
            events=n,
            source=source,
            trace=trace,
            allocations=allocations,
            resident=resident,
            peak_in_module=peak_in_module,
            activations_at_peak_bytes=at_peak,
            activations_before_backward_bytes=before_backward,
            module_paths=self._module_paths,
            scaling=scaling,
            phase_layers=phase_layers,
        )

    def _scaling(
        self, codes: np.ndarray, sizes: np.ndarray, layer: np.ndarray, casts: np.ndarray, candidates: np.ndarray
    ) -> dict[str, list[tuple[int, int]]]:
        """Per phase window, the upper envelope of the ``(fixed, scaling)`` live bytes at its candidate events.

        An allocation grows with the batch where it is the batch's own storage (marked at a ``batch_start``), an
        activation, or a temporary (no tenant at any boundary) allocated between a ``batch_start`` and the end of
        that micro-batch's backward; every other allocation (a weight, a gradient, the optimizer state, autocast's
        casts of weights, what was resident before the step, a temporary of the optimizer step) is fixed. An
        allocation wrongly read as growing (a parameter-sized temporary of backward) only raises the projection
        above the measured batch: the answers it gives stay on the safe side.
        """
        n = len(codes)
        if not n or not len(candidates) or not self._allocs:
            return {}
        positions = np.arange(n, dtype=np.int64)
        allocated = np.full(len(self._allocs), n, dtype=np.int64)
        allocated[codes[codes > 0] - 1] = positions[codes > 0]
        forward_backward = np.zeros(n + 1, dtype=bool)
        start = None
        for phase, position, _, _ in self._marks:
            if phase == "batch_start":
                start = position
            elif start is not None and phase in _END_OF_BACKWARD:
                forward_backward[start:position] = True
                start = None
        temporaries = layer == len(LAYERS) - 1
        grows = (layer == LAYERS.index("activations")) | (temporaries & forward_backward[allocated])
        grows = (grows & ~casts) | self._batch_allocations()
        index = np.abs(codes) - 1
        signs = np.where(codes > 0, 1, -1) * sizes[index]
        growing = grows[index]
        scaling = np.cumsum(np.where(growing, signs, 0))
        steady = np.cumsum(np.where(growing, 0, signs))
        bounds = np.asarray([position for _, position, _, _ in self._marks], dtype=np.int64)
        window = np.searchsorted(bounds, candidates, side="right")  # the first mark after each event
        out: dict[str, list[tuple[int, int]]] = {}
        for mark in np.unique(window):
            if mark >= len(self._marks):
                continue
            chosen = candidates[window == mark]
            name = self._marks[int(mark)][0]
            points = [*out.get(name, []), *zip(steady[chosen].tolist(), scaling[chosen].tolist(), strict=True)]
            out[name] = upper_envelope(points)
        return out

    def _batch_allocations(self) -> np.ndarray:
        """Whether each allocation is a batch's own storage: live at a ``batch_start`` under the ``BATCH`` key."""
        out = np.zeros(len(self._allocs), dtype=bool)
        for index in self._batch_indices:
            out[index] = True
        return out

    def _activations_by_module(
        self, codes: np.ndarray, saved: list[list[int]], best: int, labels: dict[int, tuple[Any, str]]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """The activations by owning module at the peak event ``best`` and at the last ``before_backward``."""
        before: list[int] = []
        for (phase, _, _, _), indices in zip(self._marks, saved, strict=True):
            if phase == "before_backward":
                before = indices
        at_peak: list[int] = []
        every = sorted({index for indices in saved for index in indices})
        if every and best >= 0:
            # alive after event ``best``: allocated at or before it, and not freed by it
            allocated = np.full(len(self._allocs), len(codes), dtype=np.int64)
            freed = np.full(len(self._allocs), len(codes), dtype=np.int64)
            positions = np.arange(len(codes), dtype=np.int64)
            allocated[codes[codes > 0] - 1] = positions[codes > 0]
            freed[-codes[codes < 0] - 1] = positions[codes < 0]
            chosen = np.asarray(every, dtype=np.int64)
            alive = (allocated[chosen] <= best) & (freed[chosen] > best)
            at_peak = chosen[alive].tolist()
        return self._by_module(at_peak, labels), self._by_module(before, labels)

    def _by_module(self, indices: Iterable[int], labels: dict[int, tuple[Any, str]]) -> dict[str, int]:
        """The bytes of these allocations by the module path they were made in, largest first.

        The bytes are the storages' own, as the census counts them, not an allocator model's rounded blocks.
        """
        out: dict[str, int] = {}
        for index in indices:
            _, nbytes, ident, _ = self._allocs[index]
            owner = labels[ident][1] or OUTSIDE_MODULES
            out[owner] = out.get(owner, 0) + self._exact.get(index, nbytes)
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def _classify(self) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
        """Each allocation's layer: a tenant whose tensors held it at a phase boundary, else temporaries; per
        mark, the allocations that were the activations tenant there, as the census counts it (saved for backward,
        and none of the other tenants' storages nor autocast's casts at that boundary); and whether each allocation
        was one of autocast's casts of weights at a boundary (a fixed size, whatever the batch). The batch's own
        storages at each ``batch_start`` go to ``_batch_indices``."""
        layer = np.full(len(self._allocs), len(LAYERS) - 1, dtype=np.int64)
        casts = np.zeros(len(self._allocs), dtype=bool)
        self._batch_indices = set()
        saved: list[list[int]] = []
        marks = iter(self._marks)
        mark = next(marks, None)
        live: dict[int, int] = {}
        for position in range(len(self._trace) + 1):
            while mark is not None and mark[1] == position:
                tenants = mark[3]
                untenanted = tenants.get(UNTENANTED, set())
                for rank, name in enumerate(LAYERS[:-1]):
                    for key in tenants.get(name, ()):
                        index = live.get(key)
                        if index is not None and layer[index] > rank and key not in untenanted:
                            layer[index] = rank
                others = set().union(*(tenants.get(name, ()) for name in (*LAYERS[:3], CASTS, UNTENANTED)))
                found = {live[key] for key in tenants.get("activations", ()) if key in live and key not in others}
                saved.append(sorted(found))
                for key in tenants.get(CASTS, ()):
                    if key in live:
                        casts[live[key]] = True
                self._batch_indices.update(live[key] for key in tenants.get(BATCH, ()) if key in live)
                mark = next(marks, None)
            if position == len(self._trace):
                break
            code = self._trace[position]
            if code > 0:
                live[self._allocs[code - 1][0]] = code - 1
            else:
                key = self._allocs[-code - 1][0]
                if live.get(key) == -code - 1:
                    del live[key]
        return layer, saved, casts

    # -- module paths ---------------------------------------------------------------------------

    def _forward_in(self, module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:  # a checkpointed region recomputed inside backward: left alone
            return
        path = self._names.get(id(module))
        if path is None:
            path = (self._stack[-1][0] + "." if self._stack else "") + type(module).__name__
        path = path or type(module).__name__
        with hidden_from_function_modes():  # ``grad_fn`` reads a user's TorchFunctionMode would see
            self._stack.append((path, [t.grad_fn for t in _tensors(args) if t.grad_fn is not None]))
        self.where = path

    def _forward_out(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack or torch._C._current_graph_task_id() != -1:
            return
        path, boundary = self._stack.pop()
        self.where = self._stack[-1][0] if self._stack else ""
        if torch.is_grad_enabled():
            with hidden_from_function_modes():
                self._stamp([t.grad_fn for t in _tensors(output) if t.grad_fn is not None], path, boundary)

    def _stamp(self, roots: list[Any], path: str, boundary: list[Any]) -> None:
        """Name the autograd nodes this module's forward made (back to its inputs' nodes) for backward."""
        stop = {id(node) for node in boundary}
        label = f"{path} (backward)"
        enter = functools.partial(_enter_backward, weakref.ref(self), label)
        todo = [node for node in roots if id(node) not in stop]
        while todo:
            node = todo.pop()
            if node.name() == _ACCUMULATE:
                continue
            metadata = node.metadata
            if _STAMP in metadata:
                continue
            metadata[_STAMP] = label
            node.register_prehook(enter)
            for child, _ in node.next_functions:
                if child is not None and id(child) not in stop:
                    todo.append(child)


def _enter_backward(recorder: weakref.ref, label: str, grad_outputs: Any) -> None:
    """A stamped node's pre-hook: the operators that follow run for its module's backward."""
    found = recorder()
    if found is not None:
        found.where = label


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors at the top of a module's inputs or outputs (a tensor, a sequence, a mapping's values)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        yield from (v for v in value if isinstance(v, Tensor))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, Tensor))


def _region(marks: Sequence[tuple[str, int, int, Any]], op_index: int) -> str:
    """The part of the step an operator outside every module ran in."""
    previous = None
    for phase, _, at, _ in marks:
        if op_index <= at:
            break
        previous = phase
    return {
        "batch_start": "forward",
        "before_backward": "backward",
        "after_backward": "between backward and the optimizer",
        "before_optimizer_step": "optimizer step",
    }.get(previous or "", "")


def op_name(func: Any) -> str:
    """``aten.mm`` for ``aten.mm.default``; what the tracker started with where no operator ran."""
    if func is None:
        return RESIDENT
    name = str(func)
    return name.removesuffix(".default")


def _subsample(totals: np.ndarray, first: int, last: int, points: int, peak: int) -> list[int]:
    """Event indices in ``[first, last)`` to draw: all if few, else each bucket's lowest and highest."""
    span = np.arange(first, last)
    if len(span) <= 2 * points:
        return span.tolist()
    keep: set[int] = {peak} if first <= peak < last else set()
    for chunk in np.array_split(span, points):
        values = totals[chunk]
        keep.add(int(chunk[np.argmax(values)]))
        keep.add(int(chunk[np.argmin(values)]))
    keep.add(int(span[-1]))
    return sorted(keep)


# The timeline of each report, kept as long as the report lives.
_TIMELINES: dict[int, tuple[weakref.ref, StepTimeline]] = {}


def keep_timeline(report: Any, timeline: StepTimeline) -> None:
    """Keep ``timeline`` as the timeline of ``report``, for as long as the report lives."""
    key = id(report)
    # the callback is ``dict.pop(key, ref)``, in C: no Python code runs in it, where a Ctrl+C would be swallowed
    _TIMELINES[key] = (weakref.ref(report, functools.partial(_TIMELINES.pop, key)), timeline)


def timeline_of(report: Any) -> StepTimeline | None:
    """The timeline recorded for ``report`` (a tracked step or a prediction), or ``None``."""
    found = _TIMELINES.get(id(report))
    if found is None or found[0]() is not report:
        return None
    return found[1]


def tenant_keys(
    weights: Iterable[Tensor],
    gradients: Iterable[Tensor],
    state: Iterable[Tensor],
    saved: Iterable[Any],
    casts: Iterable[Any] = (),
    batch: Iterable[Tensor] = (),
    untenanted: Iterable[Tensor] = (),
) -> dict[str, list[int]]:
    """The storage keys (as the tracker keys them) of each known tenant, for :meth:`TimelineRecorder.mark`.

    The keys are those the census counts (:func:`~lightning_memtenants.core.storage.storage_keys`): a DTensor's
    (FSDP2's sharded parameters, their gradients and their optimizer state) are its local shard's, so the timeline
    files every storage under the tenant the phase table counts it in.

    Args:
        weights: the parameters and buffers.
        gradients: their gradients.
        state: the optimizer state's tensors.
        saved: the storages autograd saved for backward, autocast's casts included (the stack's activations).
        casts: of those, autocast's casts of weights: the ``autocast_cache`` part, left out of the activations
            split by module.
        batch: at ``batch_start``, the batch's tensors, whose storages grow with the batch
            (:attr:`StepTimeline.scaling`).
        untenanted: tensors the census counts in no tenant though autograd may save them (FSDP2's gathered
            parameters): never activations, so temporaries on the stack.

    Returns:
        The keys by tenant, the casts' under ``CASTS``, the batch's under ``BATCH`` and the untenanted under
        ``UNTENANTED``.

    Raises:
        ValueError: if a tensor has a layout whose storages cannot be counted (see ``storages_of``).
    """
    return {
        "weights": storage_keys(weights),
        "gradients": storage_keys(gradients),
        "optimizer_state": storage_keys(state),
        "activations": [id(s) for s in saved],
        CASTS: [id(s) for s in casts],
        BATCH: storage_keys(batch),
        UNTENANTED: storage_keys(untenanted),
    }


def upper_envelope(points: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pairs ``(fixed, scaling)`` whose line ``fixed + k * scaling`` is the highest for some ``k >= 0``.

    ``max(fixed + k * scaling)`` over the kept pairs equals the maximum over all of them, for every ``k >= 0``.

    Args:
        points: ``(fixed, scaling)`` pairs of bytes.

    Returns:
        The kept pairs, by ``scaling`` ascending (and ``fixed`` descending): a handful where the input has thousands.
    """
    pairs = np.asarray(list(points), dtype=np.int64).reshape(-1, 2)
    if not len(pairs):
        return []
    order = np.lexsort((-pairs[:, 0], -pairs[:, 1]))  # scaling descending, then fixed descending
    ranked = pairs[order]
    before = np.maximum.accumulate(np.concatenate(([np.iinfo(np.int64).min], ranked[:-1, 0])))
    front = ranked[ranked[:, 0] > before][::-1]  # no pair has both more fixed and at least as much scaling bytes
    hull: list[tuple[int, int]] = []
    for fixed, scaling in front.tolist():
        while len(hull) >= 2:
            (f1, s1), (f2, s2) = hull[-2], hull[-1]
            # the middle line leads nowhere where the outer two cross before it overtakes the first
            if (f1 - fixed) * (s2 - s1) <= (f1 - f2) * (scaling - s1):
                hull.pop()
            else:
                break
        hull.append((int(fixed), int(scaling)))
    return hull

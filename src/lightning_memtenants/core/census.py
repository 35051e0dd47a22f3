"""Tenant census: the bytes each tenant holds, counted from the tensors themselves.

Counting from tensors (not from an allocator) makes the census exact on any device, fake and
meta tensors included. The activations are read from the loss's autograd graph, with no hook.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants._private import (
    SAVED_PREFIX,
    SavedTensor,
    TorchDispatchMode,
    cast_source,
    fsdp_pairs,
    fsdp_params,
    inner_tensors,
    local_tensor,
)
from lightning_memtenants.core.record import GraphCounts
from lightning_memtenants.core.storage import (
    PLAIN,
    TWIN,
    HostState,
    optimizer_state_tensors,
    storages_of,
    tensors_in,
    unique_storage_bytes,
)
from lightning_memtenants.names import Tenant


class ActivationTracker:
    """What autograd keeps for backward, read from the graph of the loss: no hook is installed.

    Every node of the graph holds its saved tensors, and ``SavedTensor.data`` gives what is
    stored without unpacking it: the tensor itself or, where the user's ``saved_tensors_hooks``
    packed it, whatever their pack returned (``save_on_cpu``'s host copy, a compressed tensor),
    which is what really stays in memory. So the user's hooks run exactly as often as without
    us, ``torch.compile`` sees nothing of ours, and checkpointed regions are not recomputed.
    The tracker holds only weak references to storages.

    Args:
        device_type: count saved storages on this device type only; others (a hook's offload to
            the host, say) are tallied in ``offloaded_bytes``. ``None`` counts every device.

    Example::

        tracker = ActivationTracker()
        loss = model(x).pow(2).mean()
        tracker.observe(loss)
        tracker.live_bytes()  # bytes autograd holds for backward
    """

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = device_type
        self._saved: dict[int, tuple[weakref.ref, int]] = {}
        self._casts: dict[int, tuple[weakref.ref, int]] = {}
        self._ignored: dict[int, weakref.ref] = {}
        # ids of the parameters: a saved tensor made from one of them by a dtype cast is autocast's
        # half copy of a weight, reported as ``autocast_cache`` rather than as an activation
        self.params: frozenset[int] = frozenset()
        # where set, read again at each observe: FSDP2 makes a root's gathered parameters at its first forward
        self.params_of: Callable[[], frozenset[int]] | None = None
        # which storages stand for host memory in a model of another device (the memory source's say), never counted
        self.host_memory: Callable[[torch.UntypedStorage], bool] | None = None
        # of those, the ones a saved-tensor hook moved off the device modelled (``save_on_cpu`` in a dry run for a
        # GPU): tallied in ``offloaded_bytes``
        self.offloaded_memory: Callable[[torch.UntypedStorage], bool] | None = None
        self.error: Exception | None = None
        self.reset_counts()

    def ignore(self, tensors: Iterable[Tensor]) -> None:
        """Never count these storages (the input batch, say) as activations.

        Args:
            tensors: the tensors whose storages are ignored (a DTensor's local shard).

        Raises:
            ValueError: if a tensor has a layout whose storages cannot be counted (see :func:`storages_of`).
        """
        for tensor in tensors:
            for storage in storages_of(local_tensor(tensor)):
                self._ignored[id(storage)] = weakref.ref(storage)

    def clear(self) -> None:
        """Forget every recorded storage: the next micro-batch starts from nothing (the counts stay)."""
        self._saved.clear()
        self._casts.clear()
        self._ignored.clear()

    def reset_counts(self) -> None:
        """Zero what the walks found since the last reset (an optimizer step's micro-batches together)."""
        # checkpointed regions in the largest graph observed, and whether torch.compile's code made it
        self.checkpointed = 0
        self.selective = 0
        self.compiled = False
        # saved tensors that another hook packed, of those packed into something that holds no tensor, and the
        # bytes a hook moved to another device
        self.hooked = 0
        self.opaque = 0
        self.offloaded_bytes = 0

    def counts(self) -> GraphCounts:
        """What the walks found since the last ``reset_counts``, as a record."""
        return GraphCounts(
            checkpointed_regions=self.checkpointed,
            selective_regions=self.selective,
            hooked=self.hooked,
            opaque=self.opaque,
            offloaded_bytes=self.offloaded_bytes,
            compiled=self.compiled,
        )

    def add_counts(self, counts: GraphCounts) -> None:
        """Add what one micro-batch's walks found (a micro-batch carried rather than walked).

        Args:
            counts: what its walks added (see ``carry.graph_delta``).
        """
        self.checkpointed = max(self.checkpointed, counts.checkpointed_regions)
        self.selective = max(self.selective, counts.selective_regions)
        self.compiled = self.compiled or counts.compiled
        self.hooked += counts.hooked
        self.opaque += counts.opaque
        self.offloaded_bytes += counts.offloaded_bytes

    def observe(self, output: Any) -> None:
        """Record the saved tensors of every node in the graph of ``output`` (a tensor or a collection).

        A failure is kept in ``error``, never raised: the user's forward has run, and the census
        reports the activations as not measured.

        Args:
            output: the forward's output: a tensor, or a collection holding tensors.
        """
        if self.error is not None:
            return
        try:
            if self.params_of is not None:
                self.params = self.params_of()
            self._walk([t.grad_fn for t in tensors_in(output) if t.grad_fn is not None])
        except Exception as error:  # reading the graph must never fail the user's step
            self.error = error

    def storages(self) -> list[torch.UntypedStorage]:
        """The recorded storages still alive (the activations and autocast's casts)."""
        found = [ref() for ref, _ in (*self._saved.values(), *self._casts.values())]
        return [storage for storage in found if storage is not None]

    def live_bytes(self, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """Bytes of recorded storages that are still alive and not in ``exclude``.

        Args:
            exclude: the storage keys already counted in another tenant.

        Returns:
            The bytes of the activations autograd still holds.
        """
        return _live(self._saved, exclude)

    def cast_bytes(self) -> int:
        """Bytes of half copies of parameters (autocast's casts) that autograd still holds for backward."""
        return _live(self._casts, frozenset()) if self._casts else 0

    def _walk(self, roots: list[Any]) -> None:
        seen: set[Any] = set()  # the node objects themselves, so that no id is reused during the walk
        stack = roots
        checkpoint_hooks: set[int] = set()
        reentrant = selective = 0
        offloaded: set[int] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            kind = _NODE_KINDS.get(type(node))
            if kind is None:
                names = tuple(n for n in dir(node) if n.startswith(SAVED_PREFIX))
                kind = _NODE_KINDS[type(node)] = (names, _special(type(node).__name__))
            names, special = kind
            if special == "reentrant":
                reentrant += 1
            elif special == "compiled":
                self.compiled = True
            for name in names:
                saved = getattr(node, name)
                for item in saved if isinstance(saved, (list, tuple)) else (saved,):
                    hook = item.unpack_hook
                    if hook is None:  # stored as it is: by far the most common case
                        data = item.data
                        if data is not None:
                            self._record(data, offloaded)
                    elif getattr(hook, "__module__", "") == "torch.utils.checkpoint":
                        if id(hook) not in checkpoint_hooks:
                            checkpoint_hooks.add(id(hook))
                            # the region keeps its inputs, saved by its frame, which the hook closes over, and under
                            # selective checkpointing the outputs its policy saves, in the cache its recomputation reads
                            frame = _checkpoint_frame(hook)
                            for inputs in _checkpoint_inputs(frame):
                                self._saved_item(inputs, offloaded)
                            cache = selective_cache(frame)
                            selective += bool(cache)
                            for cached in cache:
                                self._record(cached, offloaded)
                    else:
                        self._hooked_item(item, offloaded)
            stack.extend(child for child, _ in node.next_functions if child is not None)
        self.checkpointed = max(self.checkpointed, reentrant + len(checkpoint_hooks))
        self.selective = max(self.selective, selective)

    def _saved_item(self, item: Any, offloaded: set[int]) -> None:
        """One ``SavedTensor``: the tensor it stores, or what a user's pack hook made of it."""
        if item.unpack_hook is None:
            data = item.data
            if data is not None:
                self._record(data, offloaded)
        else:
            self._hooked_item(item, offloaded)

    def _hooked_item(self, item: Any, offloaded: set[int]) -> None:
        """A ``SavedTensor`` a user's pack hook packed: the tensors in what it returned are what is kept."""
        self.hooked += 1
        packed = list(tensors_in(item.data))
        if not packed:
            self.opaque += 1
        for tensor in packed:
            self._record(tensor, offloaded)

    def _record(self, tensor: Tensor, offloaded: set[int]) -> None:
        tensor = getattr(tensor, TWIN, tensor)  # a dry run's known tensor counts as its fake twin
        if type(tensor) not in PLAIN:
            tensor = local_tensor(tensor)
            inner = list(inner_tensors(tensor))
            if len(inner) != 1 or inner[0] is not tensor:  # a wrapper (AsyncCollectiveTensor) holds no memory itself
                for each in inner:
                    self._record(each, offloaded)
                return
        elsewhere = self.device_type is not None and tensor.device.type != self.device_type
        for storage in storages_of(tensor):
            key = id(storage)
            if key in self._ignored:
                continue
            if self.host_memory is not None and self.host_memory(storage):
                offload = self.offloaded_memory is not None and self.offloaded_memory(storage)
                if offload and key not in offloaded:
                    offloaded.add(key)
                    self.offloaded_bytes += storage.nbytes()
                continue
            if elsewhere:
                if key not in offloaded:
                    offloaded.add(key)
                    self.offloaded_bytes += storage.nbytes()
                continue
            known = self._saved.get(key) or self._casts.get(key)
            if known is None or known[0]() is not storage:
                target = self._casts if self.params and is_param_cast(tensor, self.params) else self._saved
                target[key] = (weakref.ref(storage), storage.nbytes())


def _checkpoint_frame(hook: Any) -> Any:
    """The frame of the non-reentrant checkpoint region whose unpack hook this is, or None.

    ``torch.utils.checkpoint``'s hooks close over the region's ``_CheckpointFrame``, known by its ``saved_args``.
    """
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(getattr(value, "saved_args", None), list):
            return value
    return None


def _checkpoint_inputs(frame: Any) -> list[Any]:
    """The ``SavedTensor`` inputs a non-reentrant checkpoint region's frame keeps (``saved_args``); none where the
    frame was not found (another torch): the region's inputs are then not counted."""
    saved = getattr(frame, "saved_args", None)
    if not isinstance(saved, list):
        return []
    return [arg for arg in saved if isinstance(arg, SavedTensor)]


def selective_cache(frame: Any) -> list[Tensor]:
    """The tensors selective activation checkpointing keeps for a region: the outputs of the ops its policy saves.

    ``create_selective_checkpoint_contexts`` caches them outside autograd's saved tensors, in the ``storage`` of the
    dispatch mode the region's recomputation runs under (``_CachedTorchDispatchMode``, shared with the caching mode
    of the forward): the frame's ``recompute_fn`` closes over that mode (``recompute_context``), and each entry is
    a pytree of ``_VersionWrapper`` whose ``val`` is the tensor. An entry backward has consumed is a marker and
    holds nothing. Private layout, read here alone: on a torch where it differs nothing is found (the cache is
    then not counted, never mistaken for something else).

    Args:
        frame: the region's checkpoint frame (``None`` finds nothing).

    Returns:
        The cached tensors still held; empty for a region without a selective policy (full checkpointing).
    """
    try:
        recompute = getattr(frame, "recompute_fn", None)
        found: list[Tensor] = []
        for cell in getattr(recompute, "__closure__", None) or ():
            try:
                mode = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            cache = getattr(mode, "storage", None)
            if not isinstance(mode, TorchDispatchMode) or not isinstance(cache, Mapping):
                continue
            for entries in cache.values():
                for entry in entries.values() if isinstance(entries, Mapping) else ():
                    _cached_tensors(entry, found)
        return found
    except Exception:  # another torch's layout: the cache is left out
        return []


def _cached_tensors(entry: Any, found: list[Tensor]) -> None:
    """The tensors in one entry of the selective cache: ``_VersionWrapper``s' ``val`` inside tuples, lists, dicts."""
    if isinstance(entry, (list, tuple)):
        for item in entry:
            _cached_tensors(item, found)
    elif isinstance(entry, Mapping):
        for item in entry.values():
            _cached_tensors(item, found)
    else:
        value = getattr(entry, "val", None)
        if isinstance(value, Tensor):
            found.append(value)


def _special(name: str) -> str:
    """What a node's class says about the graph: a reentrant checkpoint, torch.compile's code, or nothing."""
    if name == "CheckpointFunctionBackward":
        return "reentrant"
    if name == "CompiledFunctionBackward":  # AOT autograd: a torch.compile'd forward
        return "compiled"
    return ""


def _live(records: dict[int, tuple[weakref.ref, int]], exclude: set[int] | frozenset[int]) -> int:
    total = 0
    dead = []
    for key, (ref, _) in records.items():
        storage = ref()
        if storage is None:
            dead.append(key)
        elif key not in exclude:
            # read now, not when saved: FSDP frees a gathered parameter by resizing its storage to 0
            total += storage.nbytes()
    for key in dead:
        del records[key]
    return total


def is_param_cast(tensor: Tensor, params: frozenset[int] | set[int]) -> bool:
    """Whether ``tensor`` (or the base it views) is a dtype cast of a parameter: ``_to_copy`` of a leaf.

    Args:
        tensor: a tensor saved for backward.
        params: the ids of the parameters.

    Returns:
        True where it is a cast copy of one of them.
    """
    return id(cast_source(tensor)) in params


def checkpointed_regions(output: Tensor) -> int:
    """How many activation-checkpointed regions (``torch.utils.checkpoint``) the graph of ``output`` holds.

    A reentrant region is one ``CheckpointFunctionBackward`` node; a non-reentrant region packs the
    tensors its nodes save with its own saved-tensors hook, one per region, which the walk recognises
    by the hook's module. Nothing is unpacked, so nothing is recomputed.

    Args:
        output: a tensor whose graph is walked (the loss, say).

    Returns:
        The number of checkpointed regions.

    Raises:
        Exception: whatever reading the graph failed with.
    """
    tracker = ActivationTracker()
    tracker.observe(output)
    if tracker.error is not None:
        raise tracker.error
    return tracker.checkpointed


# Per node class: the names of its saved tensors (``_raw_saved_*``), and what it says of the graph (``_special``).
_NODE_KINDS: dict[type, tuple[tuple[str, ...], str]] = {}


class TenantCounter:
    """Counts the tenants of one module and its optimizers, phase after phase.

    Parameters and buffers, and so the weights tenant, are read when ``refresh`` is called
    (the monitor does so at ``batch_start`` of measured steps): training steps do not replace
    them. Optimizer state can be carried over
    between phases where no optimizer step can have run.

    Args:
        module: the model whose parameters, buffers and gradients are counted.
        optimizers: its optimizers, whose state is the optimizer-state tenant.
        host_state: the state entries each optimizer keeps on the host (see :data:`HostState`),
            left out of the optimizer-state tenant; ``None`` counts every entry.
    """

    def __init__(
        self, module: nn.Module, optimizers: Sequence[Optimizer] = (), host_state: HostState | None = None
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.host_state = host_state
        self.tensors: list[Tensor] = []
        self._weight_keys: set[int] = set()
        self._weights = 0
        self._fsdp: list[Any] = []  # FSDP2's records of its parameters (see ``refresh``)
        self.refresh()

    def param_ids(self) -> frozenset[int]:
        """The ids of the tensors autocast may cast as weights: the parameters and buffers, and FSDP2's gathered
        parameters (a cast of the root's, gathered from its forward to its backward, is a weight cast too).

        Returns:
            The ids, for :attr:`ActivationTracker.params`.
        """
        if not self._fsdp:
            return self._ids
        return self._ids.union(id(g) for _, g in fsdp_pairs(self._fsdp) if g is not None)

    def untenanted(self) -> list[Tensor]:
        """The tensors the census counts in no tenant, though autograd may save them: FSDP2's gathered parameters.

        Returns:
            Each gathered parameter FSDP2 holds now (its storage is empty once the unit resharded).
        """
        return [g for _, g in fsdp_pairs(self._fsdp) if g is not None] if self._fsdp else []

    def refresh(self) -> None:
        """Read the module's parameters and buffers again, and the bytes of the weights tenant.

        Raises:
            ValueError: if a tensor has a layout whose storages cannot be counted (see :func:`storages_of`).
        """
        # a parameter FSDP2 holds gathered now (a root's, from its forward to its backward) counts as its shard:
        # FSDP2 swaps them back without registering, so a gathered one read here would be counted after its reshard
        self._fsdp = fsdp_params(self.module)
        sharded = {id(gathered): shard for shard, gathered in fsdp_pairs(self._fsdp) if gathered is not None}
        params = [sharded.get(id(p), p) for p in self.module.parameters()]
        self.tensors = list(chain(params, self.module.buffers()))
        self._ids = frozenset(id(t) for t in self.tensors)
        self._weight_keys = set()
        self._weights = unique_storage_bytes(self.tensors, self._weight_keys)

    def count(
        self, activations: ActivationTracker | None = None, optimizer_state_bytes: int | None = None
    ) -> dict[Tenant, int]:
        """Bytes of each tenant now; ``optimizer_state_bytes`` skips the walk of the optimizer state.

        Args:
            activations: the tracker of the saved tensors; ``None`` counts no activations.
            optimizer_state_bytes: the optimizer state's bytes carried over from an earlier phase, if any.

        Returns:
            The bytes of ``weights``, ``gradients``, ``optimizer_state`` and ``activations``.

        Raises:
            ValueError: if a tensor has a layout whose storages cannot be counted (see :func:`storages_of`).
        """
        seen = set(self._weight_keys)
        weights = self._weights
        if self._fsdp:  # FSDP2's gathered parameters (the root's, after its forward) are no tenant: no activation
            unique_storage_bytes(self.untenanted(), seen)
        gradients = unique_storage_bytes([t.grad for t in self.tensors if t.grad is not None], seen)
        if optimizer_state_bytes is None:
            optimizer_state = unique_storage_bytes(optimizer_state_tensors(self.optimizers, self.host_state), seen)
        else:
            optimizer_state = optimizer_state_bytes
        saved = activations.live_bytes(exclude=seen) if activations is not None else 0
        return {
            "weights": weights,
            "gradients": gradients,
            "optimizer_state": optimizer_state,
            "activations": saved,
        }


def take_census(
    module: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    activations: ActivationTracker | None = None,
) -> dict[Tenant, int]:
    """Bytes of each tenant right now; a storage shared by two tenants counts for the first.

    The order of precedence is weights, gradients, optimizer state, activations.

    Args:
        module: the model whose parameters, buffers and gradients are counted.
        optimizers: its optimizers, whose state is the optimizer-state tenant.
        activations: the tracker of the saved tensors; ``None`` counts no activations.

    Returns:
        The bytes of ``weights``, ``gradients``, ``optimizer_state`` and ``activations``.

    Raises:
        ValueError: if a tensor has a layout whose storages cannot be counted (see :func:`storages_of`).
    """
    return TenantCounter(module, optimizers).count(activations)

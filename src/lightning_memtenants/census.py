"""Tenant census: the bytes each tenant holds, counted from the tensors themselves.

Counting from tensors (not from an allocator) makes the census exact on any device,
fake and meta tensors included. Each storage is counted once, keyed by the identity of
its ``StorageImpl``; ``data_ptr()`` would be 0 for every fake tensor.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants.formulas import local_optimizer

TENANTS: tuple[str, ...] = ("weights", "gradients", "optimizer_state", "activations")


_SPARSE_PARTS: dict[torch.layout, tuple[str, ...]] = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def storages_of(tensor: Tensor) -> tuple[torch.UntypedStorage, ...]:
    """The storages behind a tensor: its own, or a sparse tensor's indices and values.

    Another layout raises ``ValueError``: a measurement that cannot count a tensor says so (and is
    disabled with a warning) rather than leaving it out.
    """
    if tensor.layout is torch.strided:
        return (tensor.untyped_storage(),)
    parts = _SPARSE_PARTS.get(tensor.layout)
    if parts is None:
        raise ValueError(f"cannot count the storage of a tensor with layout {tensor.layout}")
    return tuple(getattr(tensor, name)().untyped_storage() for name in parts)


def storage_key(tensor: Tensor) -> int:
    """Identity of the storage behind ``tensor``, valid for as long as the storage lives.

    PyTorch keeps one Python object per live storage, shared by every view of it, so its
    ``id`` is the storage's identity; it works where ``data_ptr()`` is 0 (fake and meta tensors).
    """
    return id(tensor.untyped_storage())


_PLAIN = (Tensor, nn.Parameter)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallel), else the tensor itself.

    A DTensor is a wrapper whose own storage has the global size; what this rank holds is its local shard.
    """
    return getattr(tensor, "_local_tensor", tensor)


def unique_storage_bytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen``; adds them to ``seen``."""
    total = 0
    add = seen.add
    for tensor in tensors:
        if type(tensor) not in _PLAIN:
            tensor = local_tensor(tensor)
        for storage in storages_of(tensor):
            key = id(storage)
            if key not in seen:
                add(key)
                total += storage.nbytes()
    return total


def _tensors_in(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def batch_tensors(batch: Any) -> list[Tensor]:
    """The tensors inside a batch of any nesting (tuples, lists, dicts, dataclasses)."""
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    return found


def optimizer_state_tensors(optimizers: Iterable[Optimizer]) -> Iterator[Tensor]:
    """Every tensor in every optimizer's ``state``, scalar ``step`` counters included.

    A ZeroRedundancyOptimizer's state is read from the local optimizer that holds this rank's shard.
    """
    for optimizer in map(local_optimizer, optimizers):
        for state in optimizer.state.values():
            for value in state.values() if isinstance(state, dict) else (state,):
                if isinstance(value, Tensor):
                    yield value
                else:
                    yield from _tensors_in(value)


class ActivationTracker:
    """Records the storages autograd saves for backward, through ``saved_tensors_hooks``.

    The pack hook returns the tensor it is given, so autograd keeps exactly what it would
    keep without us; the tracker itself holds only weak references to storages.

    Example::

        tracker = ActivationTracker()
        with tracker:
            loss = model(x).sum()
        tracker.live_bytes()  # bytes autograd holds for backward
    """

    def __init__(self) -> None:
        self._saved: dict[int, tuple[weakref.ref, int]] = {}
        self._casts: dict[int, tuple[weakref.ref, int]] = {}
        self._ignored: dict[int, weakref.ref] = {}
        # ids of the parameters: a saved tensor made from one of them by a dtype cast is autocast's
        # half copy of a weight, reported as ``autocast_cache`` rather than as an activation
        self.params: frozenset[int] = frozenset()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.error: Exception | None = None

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def ignore(self, tensors: Iterable[Tensor]) -> None:
        """Never count these storages (the input batch, say) as activations."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._ignored[id(storage)] = weakref.ref(storage)

    def start(self) -> None:
        if self._hooks is None:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks.__enter__()

    def stop(self) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def clear(self) -> None:
        """Forget every recorded storage; the next batch starts from nothing."""
        self._saved.clear()
        self._casts.clear()
        self._ignored.clear()

    def __enter__(self) -> ActivationTracker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def live_bytes(self, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """Bytes of recorded storages that are still alive and not in ``exclude``."""
        return _live(self._saved, exclude)

    def cast_bytes(self) -> int:
        """Bytes of half copies of parameters (autocast's casts) that autograd still holds for backward."""
        return _live(self._casts, frozenset()) if self._casts else 0

    def _pack(self, tensor: Tensor) -> Tensor:
        if self.error is None:
            try:
                for storage in storages_of(tensor):
                    key = id(storage)
                    known = self._saved.get(key)
                    if (known is None or known[0]() is not storage) and key not in self._ignored:
                        target = self._casts if self.params and is_param_cast(tensor, self.params) else self._saved
                        target[key] = (weakref.ref(storage), storage.nbytes())
            except Exception as error:  # a failed measurement must never fail the forward
                self.error = error
        return tensor


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


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
    """Whether ``tensor`` (or the base it views) is a dtype cast of a parameter: ``_to_copy`` of a leaf."""
    base = tensor._base if tensor._is_view() else tensor
    fn = base.grad_fn if base is not None else None
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    source = fn.next_functions[0][0] if fn.next_functions else None
    return id(getattr(source, "variable", None)) in params


def checkpointed_regions(output: Tensor) -> int:
    """How many activation-checkpointed regions (``torch.utils.checkpoint``) the graph of ``output`` holds.

    A reentrant region is one ``CheckpointFunctionBackward`` node; a non-reentrant region packs the
    tensors its nodes save with its own saved-tensors hook, one per region, which the walk recognises
    by the hook's module. Nothing is unpacked, so nothing is recomputed.
    """
    fn = output.grad_fn
    if fn is None:
        return 0
    reentrant = 0
    hooks: set[int] = set()
    seen: set[int] = set()
    stack = [fn]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        kind = type(node)
        if kind.__name__ == "CheckpointFunctionBackward":
            reentrant += 1
        names = _SAVED_NAMES.get(kind)
        if names is None:
            names = _SAVED_NAMES[kind] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
        for name in names:
            saved = getattr(node, name, None)
            for item in saved if isinstance(saved, (list, tuple)) else (saved,):
                hook = getattr(item, "unpack_hook", None)
                if hook is not None and getattr(hook, "__module__", "") == "torch.utils.checkpoint":
                    hooks.add(id(hook))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return reentrant + len(hooks)


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


class TenantCounter:
    """Counts the tenants of one module and its optimizers, phase after phase.

    Parameters and buffers, and so the weights tenant, are read when ``refresh`` is called
    (the monitor does so at ``batch_start`` of measured steps): training steps do not replace
    them. Optimizer state can be carried over
    between phases where no optimizer step can have run.
    """

    def __init__(self, module: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.tensors: list[Tensor] = []
        self._weight_keys: set[int] = set()
        self._weights = 0
        self.refresh()

    def refresh(self) -> None:
        self.tensors = list(chain(self.module.parameters(), self.module.buffers()))
        self._weight_keys = set()
        self._weights = unique_storage_bytes(self.tensors, self._weight_keys)

    def count(
        self, activations: ActivationTracker | None = None, optimizer_state_bytes: int | None = None
    ) -> dict[str, int]:
        """Bytes of each tenant now; ``optimizer_state_bytes`` skips the walk of the optimizer state."""
        seen = set(self._weight_keys)
        weights = self._weights
        gradients = unique_storage_bytes([t.grad for t in self.tensors if t.grad is not None], seen)
        if optimizer_state_bytes is None:
            optimizer_state = unique_storage_bytes(optimizer_state_tensors(self.optimizers), seen)
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
) -> dict[str, int]:
    """Bytes of each tenant right now; a storage shared by two tenants counts for the first.

    The order of precedence is weights, gradients, optimizer state, activations.
    """
    return TenantCounter(module, optimizers).count(activations)

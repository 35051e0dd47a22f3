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

TENANTS: tuple[str, ...] = ("weights", "gradients", "optimizer_state", "activations")


def storage_key(tensor: Tensor) -> int:
    """Identity of the storage behind ``tensor``, valid for as long as the storage lives.

    PyTorch keeps one Python object per live storage, shared by every view of it, so its
    ``id`` is the storage's identity; it works where ``data_ptr()`` is 0 (fake and meta tensors).
    """
    return id(tensor.untyped_storage())


def unique_storage_bytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen``; adds them to ``seen``."""
    total = 0
    add = seen.add
    for tensor in tensors:
        storage = tensor.untyped_storage()
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
    """Every tensor in every optimizer's ``state``, scalar ``step`` counters included."""
    for optimizer in optimizers:
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
        self._ignored: dict[int, weakref.ref] = {}
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
        self._ignored.clear()

    def __enter__(self) -> ActivationTracker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def live_bytes(self, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """Bytes of recorded storages that are still alive and not in ``exclude``."""
        total = 0
        dead = []
        for key, (ref, nbytes) in self._saved.items():
            if ref() is None:
                dead.append(key)
            elif key not in exclude:
                total += nbytes
        for key in dead:
            del self._saved[key]
        return total

    def _pack(self, tensor: Tensor) -> Tensor:
        if self.error is None:
            try:
                storage = tensor.untyped_storage()
                key = id(storage)
                known = self._saved.get(key)
                if (known is None or known[0]() is not storage) and key not in self._ignored:
                    self._saved[key] = (weakref.ref(storage), storage.nbytes())
            except Exception as error:  # a failed measurement must never fail the forward
                self.error = error
        return tensor


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


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

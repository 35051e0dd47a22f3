"""Storages and the tensors behind a value: the one walker every count in the package goes through.

A storage is counted once, keyed by the identity of its Python object, which PyTorch keeps one of
per live storage; ``data_ptr()`` would be 0 for every fake tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from itertools import chain, repeat
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants._private import local_tensor
from lightning_memtenants.checks import brief

__all__ = [
    "HostState",
    "batch_elements",
    "batch_tensors",
    "local_optimizer",
    "local_tensor",
    "optimizer_state_tensors",
    "storage_key",
    "storage_keys",
    "storages_of",
    "tensors_in",
    "unique_storage_bytes",
]

_SPARSE_PARTS: dict[torch.layout, tuple[str, ...]] = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}
# Given an optimizer, the names of its state entries kept in host memory (its ``step`` counters on a GPU), which
# are in no device figure: the census and the fixed-cost formula leave them out.
HostState = Callable[[Optimizer], Collection[str]]
PLAIN = (Tensor, nn.Parameter)
# In a dry run, a real tensor computed from known values carries the fake copy that is counted in its stead (its
# "twin"): whatever holds the real tensor (a checkpoint's saved inputs, say) holds the memory of the twin.
TWIN = "_memtenants_twin"


def storages_of(tensor: Tensor) -> tuple[torch.UntypedStorage, ...]:
    """The storages behind a tensor: its own, or a sparse tensor's indices and values.

    A measurement that cannot count a tensor says so (and is disabled with a warning) rather than
    leaving it out.

    Args:
        tensor: a strided or sparse (COO, CSR, CSC, BSR, BSC) tensor.

    Returns:
        One storage for a strided tensor, one per part for a sparse one.

    Raises:
        ValueError: if ``tensor`` has another layout.
    """
    if tensor.layout is torch.strided:
        return (tensor.untyped_storage(),)
    parts = _SPARSE_PARTS.get(tensor.layout)
    if parts is None:
        raise ValueError(f"cannot count the storage of a tensor with layout {tensor.layout}")
    return tuple(getattr(tensor, name)().untyped_storage() for name in parts)


def storage_key(tensor: Tensor) -> int:
    """Identity of the storage behind ``tensor``, valid for as long as the storage lives.

    Args:
        tensor: a strided tensor.

    Returns:
        A key that two tensors sharing one storage (views) have in common.
    """
    return id(tensor.untyped_storage())


def storage_keys(tensors: Iterable[Tensor]) -> list[int]:
    """The keys of the storages behind ``tensors``, as the live-tensor tracker keys them: a DTensor's are its local
    shard's, a sparse tensor's its parts', a dry run's known tensor's its fake twin's.

    The timeline files each allocation under a tenant by these keys, so that it names the storages the census
    counted in that tenant.

    Args:
        tensors: the tensors.

    Returns:
        One key per storage, in order (a storage shared by two tensors appears twice).

    Raises:
        ValueError: if a tensor has a layout whose storages cannot be counted (see :func:`storages_of`).
    """
    keys: list[int] = []
    for tensor in tensors:
        tensor = getattr(tensor, TWIN, tensor)  # a dry run's known tensor is tracked as its fake twin
        if type(tensor) not in PLAIN:
            tensor = local_tensor(tensor)
        if tensor.layout is torch.strided:
            keys.append(id(tensor.untyped_storage()))
        else:
            keys.extend(id(storage) for storage in storages_of(tensor))
    return keys


def unique_storage_bytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen``; adds them to ``seen``.

    Sharing ``seen`` between calls counts a storage once across tenants (a view is never counted twice),
    and a DTensor counts as its local shard.

    Args:
        tensors: the tensors to count.
        seen: the storage keys counted so far; updated in place.

    Returns:
        The bytes of the storages first seen here.

    Raises:
        ValueError: if a tensor has a layout whose storages cannot be counted (see :func:`storages_of`).
    """
    total = 0
    add = seen.add
    strided = torch.strided
    for tensor in tensors:
        if type(tensor) not in PLAIN:
            tensor = local_tensor(tensor)
        if tensor.layout is strided:  # by far the most common case: one storage, no tuple built
            storage = tensor.untyped_storage()
            key = id(storage)
            if key not in seen:
                add(key)
                total += storage.nbytes()
            continue
        for storage in storages_of(tensor):
            key = id(storage)
            if key not in seen:
                add(key)
                total += storage.nbytes()
    return total


def tensors_in(value: Any, _seen: set[int] | None = None) -> Iterator[Tensor]:
    """The tensors inside ``value``: mappings, lists, tuples and dataclasses, read without rebuilding them.

    Args:
        value: a tensor, or any nesting of those containers; other objects hold no tensor here, and a
            container met twice (one that contains itself, say) is read once.

    Yields:
        Each tensor found, depth first (a mapping's values, not its keys).
    """
    if isinstance(value, Tensor):
        yield value
        return
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return
    if isinstance(value, Mapping):
        items: Iterable[Any] = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    else:
        return
    seen = set() if _seen is None else _seen
    if id(value) in seen:  # a collection that contains itself
        return
    seen.add(id(value))
    for item in items:
        yield from tensors_in(item, seen)


def batch_tensors(batch: Any) -> list[Tensor]:
    """The tensors inside a batch of any nesting (tuples, lists, dicts, dataclasses); other objects hold none.

    Args:
        batch: what the dataloader gave.

    Returns:
        The tensors, in the order :func:`tensors_in` finds them.
    """
    if isinstance(batch, Tensor):
        return [batch]
    if type(batch) in (tuple, list) and all(map(isinstance, batch, repeat(Tensor))):  # the common case, in C
        return list(batch)
    return list(tensors_in(batch))


def batch_elements(batch: Any) -> tuple[int, int]:
    """Elements and bytes of the tensors in ``batch``: the forecast's measure of its size.

    Args:
        batch: what the dataloader gave.

    Returns:
        The total number of elements and the total bytes of its tensors (0, 0 where it holds none).
    """
    tensors = batch_tensors(batch)
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer that holds state on this rank: ZeroRedundancyOptimizer's local ``optim``, else itself.

    ZeroRedundancyOptimizer keeps its ``state`` empty and its ``param_groups`` global; the state of
    this rank's shard lives in the wrapped optimizer, whose groups hold only this rank's parameters.

    Args:
        optimizer: any optimizer.

    Returns:
        The wrapped optimizer, or ``optimizer`` itself where it wraps none.
    """
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, Optimizer) and inner is not optimizer else optimizer


def optimizer_state_tensors(optimizers: Iterable[Optimizer], host_state: HostState | None = None) -> Iterator[Tensor]:
    """Every tensor in every optimizer's ``state``, scalar ``step`` counters included, but those kept on the host.

    Args:
        optimizers: the optimizers; each is read through :func:`local_optimizer`.
        host_state: the state entries each optimizer keeps on the host, left out; ``None`` leaves out none.

    Yields:
        Each state tensor, also those nested in containers inside the state.
    """
    for optimizer in optimizers:
        host = host_state(optimizer) if host_state is not None else ()
        for state in local_optimizer(optimizer).state.values():
            entries = state.items() if isinstance(state, dict) else (("", state),)
            for name, value in entries:
                if name in host:
                    continue
                if isinstance(value, Tensor):
                    yield value
                else:
                    yield from tensors_in(value)


def module_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    """``device`` checked, or where ``module`` lives (its first parameter or buffer), else the CPU.

    Args:
        module: the model.
        device: a device, a name like ``"cuda:0"``, or None.

    Returns:
        The device.

    Raises:
        ValueError: if ``device`` names no device.
    """
    if device is None:
        first = next(chain(module.parameters(), module.buffers()), None)
        device = first.device if first is not None else torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be None, a torch.device or a name like 'cuda:0', got {brief(device)}") from None

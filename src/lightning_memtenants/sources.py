"""Memory sources: allocated bytes and window peaks, one source per device kind.

CUDA and other accelerators expose their allocator's own counters, which are cheap enough
for every step. CPU and fake devices have none worth trusting, so they get the exact
:class:`LiveTensorTracker`. A source that cannot measure returns ``None``, never 0: on a
CPU-only build ``torch.cuda.memory_allocated()`` silently returns 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_memtenants.tracker import LiveTensorTracker


@dataclass(frozen=True)
class Reading:
    """What a source saw at one phase boundary; ``None`` means not measured."""

    allocated_bytes: int | None = None
    window_peak_bytes: int | None = None
    reserved_bytes: int | None = None


class MemorySource:
    """The interface, and the source of last resort: it measures nothing."""

    name = "none"
    every_step = True

    @property
    def status(self) -> str:
        return "not measured"

    def start(self, roots: Iterable[Tensor] = ()) -> None:
        """Begin a measured window; ``roots`` are tensors that already exist."""

    def read(self) -> Reading:
        """Allocated bytes now and the peak since the previous read; opens a new window."""
        return Reading()

    def pause(self) -> None:
        """Stop measuring until the next start (cheap sources ignore this)."""

    def stop(self) -> None:
        """Remove everything the source registered."""

    def total_bytes(self) -> int | None:
        """The device's capacity, where the source knows it."""
        return None


class CudaSource(MemorySource):
    """The CUDA caching allocator's counters: ``memory_allocated`` and a reset peak per window."""

    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)

    @property
    def available(self) -> bool:
        return torch.cuda.is_available()

    @property
    def status(self) -> str:
        return "cuda allocator counters" if self.available else "not available: this torch has no CUDA device"

    def start(self, roots: Iterable[Tensor] = ()) -> None:
        if self.available:
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> Reading:
        if not self.available:
            return Reading()
        allocated = torch.cuda.memory_allocated(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return Reading(allocated, max(peak, allocated), reserved)

    def total_bytes(self) -> int | None:
        if not self.available:
            return None
        return int(torch.cuda.mem_get_info(self.device)[1])


class AcceleratorSource(MemorySource):
    """``torch.accelerator``'s device-generic counters (XPU and others), where they exist."""

    name = "accelerator"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        api = getattr(torch, "accelerator", None)
        needed = ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")
        self._api = api if api is not None and all(hasattr(api, n) for n in needed) else None

    @property
    def status(self) -> str:
        return f"torch.accelerator counters on {self.device}" if self._api else "not measured"

    def start(self, roots: Iterable[Tensor] = ()) -> None:
        if self._api is not None:
            self._api.reset_peak_memory_stats(self.device)

    def read(self) -> Reading:
        if self._api is None:
            return Reading()
        allocated = int(self._api.memory_allocated(self.device))
        peak = int(self._api.max_memory_allocated(self.device))
        reserved = int(self._api.memory_reserved(self.device)) if hasattr(self._api, "memory_reserved") else None
        self._api.reset_peak_memory_stats(self.device)
        return Reading(allocated, max(peak, allocated), reserved)

    def total_bytes(self) -> int | None:
        if self._api is None or not hasattr(self._api, "get_memory_info"):
            return None
        return int(self._api.get_memory_info(self.device)[1])


class MpsSource(MemorySource):
    """Apple's MPS: current allocated bytes only, so window peaks are not measured."""

    name = "mps"

    @property
    def status(self) -> str:
        return "torch.mps.current_allocated_memory (no peaks)"

    def read(self) -> Reading:
        return Reading(allocated_bytes=int(torch.mps.current_allocated_memory()))

    def total_bytes(self) -> int | None:
        return int(torch.mps.recommended_max_memory())


class TrackerSource(MemorySource):
    """The live-tensor tracker as a source: exact, but a Python call per operator."""

    name = "tracker"
    every_step = False

    def __init__(
        self,
        device_type: str = "cpu",
        *,
        scan: bool = True,
        limit_bytes: int | None = None,
        host_ops: frozenset[str] = frozenset(),
        label: str | None = None,
        allocator: Any = None,
    ) -> None:
        self.label = label
        self.tracker = LiveTensorTracker(
            device_type,
            scan=scan,
            limit_bytes=limit_bytes,
            host_ops=host_ops,
            allocator=allocator,
        )

    @property
    def status(self) -> str:
        return self.label or f"live-tensor tracker ({self.tracker.device_type})"

    def start(self, roots: Iterable[Tensor] = ()) -> None:
        self.tracker.start(roots)

    def read(self) -> Reading:
        if self.tracker.error is not None:
            raise RuntimeError(f"the tracker failed inside an operator: {self.tracker.error!r}")
        if not self.tracker.active:
            return Reading()
        allocated, peak = self.tracker.read()
        allocator = self.tracker.allocator
        return Reading(allocated, peak, allocator.reserved_bytes if allocator is not None else None)

    def pause(self) -> None:
        self.tracker.pause()

    def stop(self) -> None:
        self.tracker.stop()


def source_for(device: torch.device | str) -> MemorySource:
    """The best source for ``device``: allocator counters where they exist, else the tracker."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaSource(device) if torch.cuda.is_available() else MemorySource()
    if device.type in ("cpu", "meta"):
        return TrackerSource(device.type)
    if device.type == "mps":
        return MpsSource()
    return AcceleratorSource(device)

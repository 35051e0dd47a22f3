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

from lightning_memtenants.core.tracker import LiveTensorTracker


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
    # whether allocations made by torch.compile'd kernels show in this source's figures
    sees_compiled_code = True

    def __init__(self) -> None:
        # the highest allocated bytes this source has seen since it was made
        self.run_peak_bytes: int | None = None

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

    def adopt(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Storages found alive by other means (the graph's saved tensors), in case the source missed them.

        A counting source ignores this; the tracker counts those made outside the dispatcher (the 0-d
        tensor autograd keeps for ``loss / 2``, the outputs of compiled code) from now on.
        """

    def total_bytes(self) -> int | None:
        """The device's capacity, where the source knows it."""
        return None

    def _saw(self, nbytes: int | None) -> None:
        if nbytes is not None and (self.run_peak_bytes is None or nbytes > self.run_peak_bytes):
            self.run_peak_bytes = nbytes


class _PeakCounters(MemorySource):
    """An allocator's counters: allocated bytes, and the peak since the last reset of the peak counter.

    With ``reset_peaks`` (the default) the peak counter is reset at every phase boundary, so each
    window's peak is exact; that also resets it for every other reader in the process (a script's own
    ``max_memory_allocated()``), so the run's highest reading, including what the counter held when
    we first reset it, is kept in ``run_peak_bytes``. Without it the counter is left alone, and a
    window's peak is known only where the counter rose in that window (it set a new high).
    """

    def __init__(self, reset_peaks: bool = True) -> None:
        super().__init__()
        if not isinstance(reset_peaks, bool):
            raise ValueError(f"reset_peaks must be True or False, got {reset_peaks!r}")
        self.reset_peaks = reset_peaks
        self._started = False
        self._last_max = 0

    def _counters(self) -> tuple[int, int, int | None] | None:
        """(allocated, max allocated, reserved) now, or None where the device is absent."""
        raise NotImplementedError

    def _reset(self) -> None:
        raise NotImplementedError

    def start(self, roots: Iterable[Tensor] = ()) -> None:
        counters = self._counters()
        if counters is None:
            return
        if not self._started:
            self._started = True
            self._saw(counters[1])
        if self.reset_peaks:
            self._reset()
        else:
            self._last_max = counters[1]

    def read(self) -> Reading:
        counters = self._counters()
        if counters is None:
            return Reading()
        allocated, peak, reserved = counters
        if self.reset_peaks:
            window: int | None = max(peak, allocated)
            self._reset()
        else:
            window = peak if peak > self._last_max else None
            self._last_max = max(self._last_max, peak)
        self._saw(window if window is not None else allocated)
        return Reading(allocated, window, reserved)

    @property
    def _how(self) -> str:
        return "" if self.reset_peaks else " (peak counter not reset: a window's peak only where it set a new high)"


class CudaSource(_PeakCounters):
    """The CUDA caching allocator's counters: ``memory_allocated`` and a peak per window.

    Args:
        device: the CUDA device; ``None`` is the current one.
        reset_peaks: reset ``max_memory_allocated`` at every phase boundary (exact window peaks)
            or leave it to the rest of the process (see ``run_peak_bytes``).
    """

    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None, *, reset_peaks: bool = True) -> None:
        super().__init__(reset_peaks)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)

    @property
    def available(self) -> bool:
        return torch.cuda.is_available()

    @property
    def status(self) -> str:
        if not self.available:
            return "not available: this torch has no CUDA device"
        return "cuda allocator counters" + self._how

    def _counters(self) -> tuple[int, int, int | None] | None:
        if not self.available:
            return None
        allocated = int(torch.cuda.memory_allocated(self.device))
        peak = int(torch.cuda.max_memory_allocated(self.device))
        return allocated, peak, int(torch.cuda.memory_reserved(self.device))

    def _reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def total_bytes(self) -> int | None:
        if not self.available:
            return None
        return int(torch.cuda.mem_get_info(self.device)[1])


class AcceleratorSource(_PeakCounters):
    """``torch.accelerator``'s device-generic counters (XPU and others), where they exist."""

    name = "accelerator"

    def __init__(self, device: torch.device, *, reset_peaks: bool = True) -> None:
        super().__init__(reset_peaks)
        self.device = device
        api = getattr(torch, "accelerator", None)
        needed = ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")
        self._api = api if api is not None and all(hasattr(api, n) for n in needed) else None

    @property
    def status(self) -> str:
        return f"torch.accelerator counters on {self.device}{self._how}" if self._api else "not measured"

    def _counters(self) -> tuple[int, int, int | None] | None:
        if self._api is None:
            return None
        allocated = int(self._api.memory_allocated(self.device))
        peak = int(self._api.max_memory_allocated(self.device))
        reserved = int(self._api.memory_reserved(self.device)) if hasattr(self._api, "memory_reserved") else None
        return allocated, peak, reserved

    def _reset(self) -> None:
        assert self._api is not None
        self._api.reset_peak_memory_stats(self.device)

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
    sees_compiled_code = False  # inductor's kernels allocate outside the dispatcher

    def __init__(
        self,
        device_type: str = "cpu",
        *,
        scan: bool = True,
        limit_bytes: int | None = None,
        host_ops: frozenset[str] = frozenset(),
        label: str | None = None,
        allocator: Any = None,
        count_fake: bool = False,
    ) -> None:
        super().__init__()
        self.label = label
        self.tracker = LiveTensorTracker(
            device_type,
            scan=scan,
            limit_bytes=limit_bytes,
            host_ops=host_ops,
            allocator=allocator,
            count_fake=count_fake,
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
        self._saw(peak)
        allocator = self.tracker.allocator
        return Reading(allocated, peak, allocator.reserved_bytes if allocator is not None else None)

    def pause(self) -> None:
        self.tracker.pause()

    def stop(self) -> None:
        self.tracker.stop()

    def adopt(self, storages: Iterable[torch.UntypedStorage]) -> None:
        if self.tracker.active:
            self.tracker.adopt(storages)


def source_for(device: torch.device | str, *, reset_peaks: bool = True) -> MemorySource:
    """The best source for ``device``: allocator counters where they exist, else the tracker.

    Args:
        device: the device trained on.
        reset_peaks: on CUDA and other accelerators, whether the peak counter is reset at each
            phase boundary (see :class:`CudaSource`).

    Returns:
        The source; a :class:`MemorySource` that measures nothing where the device is absent.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return CudaSource(device, reset_peaks=reset_peaks) if torch.cuda.is_available() else MemorySource()
    if device.type in ("cpu", "meta"):
        return TrackerSource(device.type)
    if device.type == "mps":
        return MpsSource()
    return AcceleratorSource(device, reset_peaks=reset_peaks)


def device_budget_bytes(device: torch.device) -> int | None:
    """The device's capacity, reduced by ``set_per_process_memory_fraction`` on CUDA; None elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    total = int(torch.cuda.mem_get_info(device)[1])
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    return int(total * fraction)

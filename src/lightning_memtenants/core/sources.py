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
    """What a source saw at one phase boundary; ``None`` means not measured.

    Args:
        allocated_bytes: the bytes allocated now.
        window_peak_bytes: the highest allocated bytes since the previous reading.
        reserved_bytes: what the allocator holds from the device, allocated or not.
        reserved_peak_bytes: the highest reserved bytes since the previous reading (``max_memory_reserved``), where
            the source resets its peak counters at each reading.
    """

    allocated_bytes: int | None = None
    window_peak_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_peak_bytes: int | None = None


class MemorySource:
    """The interface, and the source of last resort: it measures nothing.

    Attributes:
        name: the source's kind, for the report.
        every_step: whether it is cheap enough to run on every step, not only on logged ones.
        sees_compiled_code: whether allocations made by ``torch.compile``'d kernels show in its figures.
        run_peak_bytes: the highest allocated bytes this source has seen since it was made, or None.
    """

    name = "none"
    every_step = True
    # whether allocations made by torch.compile'd kernels show in this source's figures
    sees_compiled_code = True

    def __init__(self) -> None:
        # the highest allocated bytes this source has seen since it was made
        self.run_peak_bytes: int | None = None

    @property
    def status(self) -> str:
        """What the source measures, in words, for the report's ``memory_source``."""
        return "not measured"

    def start(self, roots: Iterable[Tensor] = ()) -> None:
        """Begin a measured window.

        Args:
            roots: tensors that already exist, for a source that must be told of them.
        """

    def read(self) -> Reading:
        """Allocated bytes now and the peak since the previous read; opens a new window.

        Returns:
            The reading; here every figure is None.
        """
        return Reading()

    def pause(self) -> None:
        """Stop measuring until the next start (cheap sources ignore this)."""

    def stop(self) -> None:
        """Remove everything the source registered."""

    def adopt(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Storages found alive by other means (the graph's saved tensors), in case the source missed them.

        A counting source ignores this; the tracker counts those made outside the dispatcher (the 0-d
        tensor autograd keeps for ``loss / 2``, the outputs of compiled code) from now on.

        Args:
            storages: the storages found alive.
        """

    def total_bytes(self) -> int | None:
        """The device's capacity, where the source knows it.

        Returns:
            The device's total bytes, or None (always here).
        """
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

    Args:
        reset_peaks: reset the peak counter at every phase boundary (see above).

    Raises:
        ValueError: if ``reset_peaks`` is not a bool.
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

    def _reserved_peak(self) -> int | None:
        """The peak counter of reserved bytes (``max_memory_reserved``), where the device has one."""
        return None

    def _reset(self) -> None:
        raise NotImplementedError

    def start(self, roots: Iterable[Tensor] = ()) -> None:
        """Begin a window: reset the peak counter, or remember its value; the first start records the old peak.

        Args:
            roots: tensors that already exist; the counters see them already, so they are not used.
        """
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
        """The counters now; the window's peak is None without ``reset_peaks`` unless the counter set a new high."""
        counters = self._counters()
        if counters is None:
            return Reading()
        allocated, peak, reserved = counters
        reserved_peak = None
        if self.reset_peaks:
            window: int | None = max(peak, allocated)
            # the same reset clears the reserved peak: read it first (nothing else is reset for it)
            reserved_peak = self._reserved_peak()
            if reserved_peak is not None and reserved is not None:
                reserved_peak = max(reserved_peak, reserved)
            self._reset()
        else:
            window = peak if peak > self._last_max else None
            self._last_max = max(self._last_max, peak)
        self._saw(window if window is not None else allocated)
        return Reading(allocated, window, reserved, reserved_peak)

    @property
    def _how(self) -> str:
        return "" if self.reset_peaks else " (peak counter not reset: a window's peak only where it set a new high)"


class CudaSource(_PeakCounters):
    """The CUDA caching allocator's counters: ``memory_allocated`` and a peak per window.

    ``memory_reserved`` is read at each boundary, and, where the peak counters are reset there, the window's
    ``max_memory_reserved`` too (``reset_peak_memory_stats`` resets both; nothing else is reset for it).

    Args:
        device: the CUDA device; ``None`` is the current one.
        reset_peaks: reset ``max_memory_allocated`` at every phase boundary (exact window peaks)
            or leave it to the rest of the process (see ``run_peak_bytes``).

    Raises:
        ValueError: if ``reset_peaks`` is not a bool.
    """

    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None, *, reset_peaks: bool = True) -> None:
        super().__init__(reset_peaks)
        if device is None:  # the current device, where there is one; a CPU-only torch has none to ask
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cuda"
        self.device = torch.device(device)

    @property
    def available(self) -> bool:
        """Whether this torch sees a CUDA device."""
        return torch.cuda.is_available()

    @property
    def status(self) -> str:
        """The allocator's counters and whether the peak counter is reset, or why nothing is measured."""
        if not self.available:
            return "not available: this torch has no CUDA device"
        return "cuda allocator counters" + self._how

    def _counters(self) -> tuple[int, int, int | None] | None:
        if not self.available:
            return None
        allocated = int(torch.cuda.memory_allocated(self.device))
        peak = int(torch.cuda.max_memory_allocated(self.device))
        return allocated, peak, int(torch.cuda.memory_reserved(self.device))

    def _reserved_peak(self) -> int | None:
        return int(torch.cuda.max_memory_reserved(self.device))

    def _reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def total_bytes(self) -> int | None:
        """The device's total memory (``mem_get_info``), or None without CUDA."""
        if not self.available:
            return None
        return int(torch.cuda.mem_get_info(self.device)[1])


class AcceleratorSource(_PeakCounters):
    """``torch.accelerator``'s device-generic counters (XPU and others), where they exist.

    Args:
        device: the accelerator device.
        reset_peaks: reset the peak counter at every phase boundary (exact window peaks) or leave it to the
            rest of the process (see ``run_peak_bytes``).

    Raises:
        ValueError: if ``reset_peaks`` is not a bool.
    """

    name = "accelerator"

    def __init__(self, device: torch.device, *, reset_peaks: bool = True) -> None:
        super().__init__(reset_peaks)
        self.device = device
        api = getattr(torch, "accelerator", None)
        needed = ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")
        self._api = api if api is not None and all(hasattr(api, n) for n in needed) else None

    @property
    def status(self) -> str:
        """The counters in use and whether the peak counter is reset, or ``"not measured"`` without them."""
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
        """The device's total memory, where ``torch.accelerator`` reports it; else None."""
        if self._api is None or not hasattr(self._api, "get_memory_info"):
            return None
        return int(self._api.get_memory_info(self.device)[1])


class MpsSource(MemorySource):
    """Apple's MPS: current allocated bytes only, so window peaks are not measured."""

    name = "mps"

    @property
    def status(self) -> str:
        """What MPS measures: allocated bytes, no peaks."""
        return "torch.mps.current_allocated_memory (no peaks)"

    def read(self) -> Reading:
        """The allocated bytes now; no window peak, no reserved bytes."""
        allocated = int(torch.mps.current_allocated_memory())
        self._saw(allocated)
        return Reading(allocated_bytes=allocated)

    def total_bytes(self) -> int | None:
        """Metal's recommended maximum working set for the GPU (``recommended_max_memory``), in bytes."""
        return int(torch.mps.recommended_max_memory())


class TrackerSource(MemorySource):
    """The live-tensor tracker as a source: exact, but a Python call per operator.

    Args:
        device_type: the device type whose storages are counted.
        scan: on the first start, find the tensors that already exist with a ``gc`` scan.
        limit_bytes: a simulated device's size: an operator that passes it raises a CUDA-style OOM.
        host_ops: operators whose outputs stand for host memory in a model of another device.
        label: the status to report instead of the default.
        allocator: a model of a caching allocator, whose blocks are counted (and its reserved bytes read).
        count_fake: count fake tensors as the memory they stand for (a prediction).

    Attributes:
        tracker: the :class:`LiveTensorTracker` behind the source.

    Raises:
        ValueError: if ``count_fake`` is not a bool.
    """

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
        count_fake: bool = False,
    ) -> None:
        super().__init__()
        self.label = label
        # inductor's compiled CPU code allocates outside the dispatcher, through functions the tracker wraps while it
        # runs; compiled code for another device allocates where no tracker looks
        self.sees_compiled_code = device_type == "cpu"
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
        """The label, else the tracker and its device type."""
        return self.label or f"live-tensor tracker ({self.tracker.device_type})"

    def start(self, roots: Iterable[Tensor] = ()) -> None:
        """Start the tracker; ``roots`` are counted as well as what its scan finds.

        Args:
            roots: tensors that already exist and that a scan may not find (gradients held only by C++).

        Raises:
            ValueError: if a tensor's layout cannot be counted (see ``storages_of``).
        """
        self.tracker.start(roots)
        allocator = self.tracker.allocator
        if allocator is not None and hasattr(allocator, "reset_peak"):  # a window opens: its reserved peak too
            allocator.reset_peak()

    def read(self) -> Reading:
        """The tracker's current bytes and window peak (and the allocator model's reserved bytes and their peak).

        Returns:
            The reading; every figure is None while the tracker is paused.

        Raises:
            RuntimeError: if the tracker failed inside an operator, so that its figures cannot be trusted.
        """
        if self.tracker.error is not None:
            raise RuntimeError(f"the tracker failed inside an operator: {self.tracker.error!r}")
        if not self.tracker.active:
            return Reading()
        allocated, peak = self.tracker.read()  # the frees it held back reach the allocator model first
        self._saw(peak)
        allocator = self.tracker.allocator
        if allocator is None:
            return Reading(allocated, peak)
        reserved_peak = getattr(allocator, "reserved_peak_bytes", None)
        if reserved_peak is not None:
            allocator.reset_peak()  # the next window starts from what is reserved now
        return Reading(allocated, peak, allocator.reserved_bytes, reserved_peak)

    def pause(self) -> None:
        """Pause the tracker: the per-operator cost stops until the next start."""
        self.tracker.pause()

    def stop(self) -> None:
        """Stop the tracker and forget every storage it counted."""
        self.tracker.stop()

    def adopt(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Have the running tracker count ``storages`` it has not seen; ignored while it is paused.

        Args:
            storages: the storages found alive (the graph's saved tensors).
        """
        if self.tracker.active:
            self.tracker.adopt(storages)


def source_for(device: torch.device | str, *, reset_peaks: bool = True) -> MemorySource:
    """The best source for ``device``: allocator counters where they exist, else the tracker.

    Args:
        device: the device trained on.
        reset_peaks: on CUDA and other accelerators, whether the peak counter is reset at each
            phase boundary (see :class:`CudaSource`).

    Returns:
        The source: a :class:`TrackerSource` on CPU and meta (without a scan: it counts the roots it is started
        with and what operators make), :class:`MpsSource` on MPS, allocator counters
        elsewhere; a :class:`MemorySource` that measures nothing where CUDA is absent.

    Raises:
        ValueError: if ``reset_peaks`` is not a bool (CUDA and other accelerators only).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return CudaSource(device, reset_peaks=reset_peaks) if torch.cuda.is_available() else MemorySource()
    if device.type in ("cpu", "meta"):
        return TrackerSource(device.type, scan=False)
    if device.type == "mps":
        return MpsSource() if torch.backends.mps.is_available() else MemorySource()
    return AcceleratorSource(device, reset_peaks=reset_peaks)


def device_budget_bytes(device: torch.device) -> int | None:
    """The device's capacity, reduced by ``set_per_process_memory_fraction`` on CUDA; None elsewhere.

    It is the budget a run checks against when the user gives none.

    Args:
        device: the device trained on.

    Returns:
        The bytes this process may use, or None off CUDA.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    total = int(torch.cuda.mem_get_info(device)[1])
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    return int(total * fraction)

"""A simulated CUDA device for CI: the few ``torch.cuda`` functions the package calls, driven by a model of the
caching allocator that real CPU allocations feed.

Inside ``simulated_cuda()`` every storage allocated on the CPU is a block of ``CachingAllocatorModel`` (through the
package's ``LiveTensorTracker``, whose weak references free it again), so ``torch.cuda.memory_allocated`` is the
blocks' bytes, ``memory_reserved`` the segments', and ``max_memory_allocated`` and ``max_memory_reserved`` the true
peaks since the last ``reset_peak_memory_stats``, which resets them to the bytes now, as CUDA does. The allocator
takes the settings given to ``simulated_cuda`` (``PYTORCH_CUDA_ALLOC_CONF``'s, as ``AllocatorSettings``) and keeps a
pool per stream: the stream current when a storage is allocated is ``torch.cpu.current_stream()``, which
``torch.cpu.stream(...)`` contexts set (FSDP2 uses them on the CPU); ``synchronize`` completes every stream's
events. ``mem_get_info`` is ``(total - reserved, total)``; an operator that takes ``memory_reserved`` past the total
raises a CUDA-style ``torch.OutOfMemoryError`` (once: the failed allocation's segment stays reserved, where CUDA would
not reserve it).
``_record_memory_history`` and ``_dump_snapshot`` record their calls and write a pickle of the snapshot's shape
(``segments``, one per reserved segment, and ``device_traces``, the events since recording began).

Tensors stay on the CPU: code that decides "CUDA" from a tensor's device must be pointed at ``torch.device("cuda")``
by the test. Not simulated: kernels, ``torch.cuda`` streams and events, ``empty_cache``.

The functions patched are exactly those ``src/`` calls (``grep -rn "torch\\.cuda\\." src/``), plus ``synchronize``
for the tests' own independent readers; ``device_count`` is left alone, so Lightning still finds no GPU.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from lightning_memtenants.core.tracker import LiveTensorTracker
from lightning_memtenants.predict.allocator import AllocatorSettings, CachingAllocatorModel

GiB = 1 << 30


def _check_device(device: Any) -> None:
    """Refuse what real ``torch.cuda`` refuses: a device that is not CUDA device 0 (the only one simulated)."""
    if device is None:
        return
    if isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        index = 0 if device.index is None else device.index
    if index != 0:
        raise ValueError(f"simulated CUDA has one device, 0; got {index}")


class _Allocator(CachingAllocatorModel):
    """The allocator model, plus the peak counter and the history a real allocator keeps."""

    def __init__(self, device: SimulatedCuda, settings: AllocatorSettings | None = None) -> None:
        super().__init__(settings, stream=torch.cpu.current_stream, device_bytes=device.total_bytes)
        self.sim = device
        self.segment_sizes: list[tuple[int, bool]] = []  # (bytes, small pool) of each reserved segment
        self._sizes: dict[int, int] = {}

    def malloc(self, key: int, nbytes: int) -> int:
        reserved = self.reserved_bytes
        size = super().malloc(key, nbytes)
        if self.reserved_bytes > reserved:
            segment = self.reserved_bytes - reserved
            self.segment_sizes.append((segment, size <= self.SMALL_SIZE))
            self.sim.trace("segment_alloc", len(self.segment_sizes), segment)
        self._sizes[key] = size
        self.sim.trace("alloc", key, size)
        return size

    def free(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        super().free(key)
        if size is not None:
            self.sim.trace("free_requested", key, size)
            self.sim.trace("free_completed", key, size)


class _Tracker(LiveTensorTracker):
    """The live-tensor tracker whose limit is the device's: an operator that takes the reserved bytes past the
    total raises a CUDA-style OOM (once)."""

    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__("cpu", scan=False, allocator=sim.allocator, limit_bytes=sim.total_bytes)
        self.sim = sim

    def check_limit(self, before: int) -> None:
        allocator = self.sim.allocator
        if self.sim.oom_armed and allocator.reserved_bytes > self.sim.total_bytes:
            self.sim.oom_armed = False
            self.sim.ooms += 1
            asked = self.current_bytes - before
            self.sim.trace("oom", 0, asked)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {asked} bytes. GPU 0 has a total capacity of"
                f" {self.sim.total_bytes} bytes (simulated); {allocator.allocated_bytes} bytes allocated by PyTorch"
            )


class SimulatedCuda:
    """CUDA device 0 as ``torch.cuda`` reports it, while ``install``ed; see the module's docstring.

    Args:
        total_bytes: the device's memory, ``mem_get_info()[1]``.
        capability: ``get_device_capability()``.
        fraction: ``get_per_process_memory_fraction()``.
        settings: the allocator's settings; ``None`` for torch's defaults.

    Attributes:
        allocator: the allocator model behind every figure.
        history_calls: the ``enabled`` argument of each ``_record_memory_history`` call, in order.
        snapshots: the path of each ``_dump_snapshot`` call, in order.
        resets: how many times ``reset_peak_memory_stats`` was called.
        ooms: how many out-of-memory errors were raised.
    """

    def __init__(
        self,
        total_bytes: int = 8 * GiB,
        capability: tuple[int, int] = (8, 0),
        fraction: float = 1.0,
        settings: AllocatorSettings | None = None,
    ):
        self.total_bytes = int(total_bytes)
        self.capability = capability
        self.fraction = fraction
        self.allocator = _Allocator(self, settings)
        self.tracker = _Tracker(self)
        self.history_calls: list[str | None] = []
        self.snapshots: list[str] = []
        self.resets = 0
        self.ooms = 0
        self.oom_armed = True
        self._recording = False
        self._max_entries = sys.maxsize
        self._traces: list[dict[str, Any]] = []

    # -- the torch.cuda functions ------------------------------------------------------------------

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: Any = None) -> None:
        _check_device(device)
        self.tracker.settle()
        self.allocator.synchronize()  # every stream's work is done: frees waiting for their events happen

    def memory_allocated(self, device: Any = None) -> int:
        _check_device(device)
        self.tracker.settle()  # a real allocator frees at once; the tracker takes frees off at its next operator
        return self.allocator.allocated_bytes

    def max_memory_allocated(self, device: Any = None) -> int:
        _check_device(device)
        self.tracker.settle()  # a real allocator frees at once; the tracker takes frees off at its next operator
        return self.allocator.allocated_peak_bytes

    def memory_reserved(self, device: Any = None) -> int:
        _check_device(device)
        self.tracker.settle()  # a real allocator frees at once; the tracker takes frees off at its next operator
        return self.allocator.reserved_bytes

    def max_memory_reserved(self, device: Any = None) -> int:
        _check_device(device)
        self.tracker.settle()  # a real allocator frees at once; the tracker takes frees off at its next operator
        return self.allocator.reserved_peak_bytes

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        _check_device(device)
        self.resets += 1
        self.tracker.settle()
        self.allocator.reset_peak()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        _check_device(device)
        self.tracker.settle()
        return self.total_bytes - self.allocator.reserved_bytes, self.total_bytes

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        _check_device(device)
        return self.capability

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        _check_device(device)
        return self.fraction

    def _record_memory_history(
        self,
        enabled: str | None = "all",
        context: str | None = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        device: Any = None,
        **_: Any,
    ) -> None:
        _check_device(device)
        if enabled not in (None, "state", "all"):
            raise ValueError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
        self.history_calls.append(enabled)
        self.tracker.settle()  # the frees before this call are in the history as it was
        self._recording = enabled == "all"
        self._max_entries = max_entries

    def _dump_snapshot(self, filename: str = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
        self.snapshots.append(str(filename))
        with open(filename, "wb") as f:
            pickle.dump(self.snapshot(), f)

    # -- the simulation ----------------------------------------------------------------------------

    @property
    def recording(self) -> bool:
        """Whether the allocator's history is being recorded."""
        return self._recording

    def trace(self, action: str, addr: int, size: int) -> None:
        """Record one allocator event, while the history is on (the last ``max_entries``)."""
        if self._recording:
            self._traces.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": []})
            if len(self._traces) > self._max_entries:
                del self._traces[0]

    def snapshot(self) -> dict[str, Any]:
        """What ``torch.cuda.memory._snapshot()`` returns, in shape: the segments now and the events recorded."""
        self.tracker.settle()
        segments = [
            {
                "device": 0,
                "address": i,
                "total_size": size,
                "stream": 0,
                "segment_type": "small" if small else "large",
                "segment_pool_id": (0, 0),
                "blocks": [],
                "frames": [],
            }
            for i, (size, small) in enumerate(self.allocator.segment_sizes, 1)
        ]
        return {"segments": segments, "device_traces": [list(self._traces)], "allocator_settings": {}}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Patch ``torch.cuda`` (undone with ``monkeypatch``) and start counting the CPU's allocations."""
        for name in (
            "is_available",
            "current_device",
            "synchronize",
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
            "reset_peak_memory_stats",
            "mem_get_info",
            "get_device_capability",
            "get_per_process_memory_fraction",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self._record_memory_history)
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", self._dump_snapshot)
        self.tracker.start()

    def uninstall(self) -> None:
        """Stop counting (``monkeypatch`` undoes the patches)."""
        self.tracker.stop()


@contextmanager
def simulated_cuda(
    total_bytes: int = 8 * GiB,
    capability: tuple[int, int] = (8, 0),
    fraction: float = 1.0,
    settings: AllocatorSettings | None = None,
) -> Iterator[SimulatedCuda]:
    """CUDA device 0 simulated inside the block; every patch and the tracker's mode are undone on exit.

    Args:
        total_bytes: the device's memory.
        capability: its compute capability.
        fraction: what ``get_per_process_memory_fraction`` answers.
        settings: the allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``); ``None`` for torch's defaults.

    Yields:
        The simulated device.
    """
    sim = SimulatedCuda(total_bytes, capability, fraction, settings)
    with pytest.MonkeyPatch.context() as monkeypatch:
        sim.install(monkeypatch)
        try:
            yield sim
        finally:
            sim.uninstall()


@pytest.fixture
def sim_cuda() -> Iterator[SimulatedCuda]:
    """A simulated 8 GiB A100-like device (capability 8.0) for the test."""
    with simulated_cuda() as sim:
        yield sim

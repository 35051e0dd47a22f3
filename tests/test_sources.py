from __future__ import annotations

import gc

import pytest
import torch

from lightning_memtenants.core.sources import (
    AcceleratorSource,
    CudaSource,
    MemorySource,
    Reading,
    TrackerSource,
    source_for,
)


def test_cpu_gets_the_tracker() -> None:
    source = source_for("cpu")
    assert isinstance(source, TrackerSource) and not source.every_step
    assert source.read() == Reading()  # not started: not measured, not 0
    earlier = torch.zeros(250)  # alive before the start, and none of the roots: not the training's
    source.start()
    assert source.read() == Reading(0, 0, None)  # no scan: the callback names its roots, this test none
    a = torch.zeros(1000)
    b = torch.zeros(500)
    del b  # freed inside the window: it sets the window's peak
    assert source.read() == Reading(4000, 6000, None)
    assert source.read() == Reading(4000, 4000, None)
    source.stop()
    gc.collect()  # with a scan every CPU tensor alive counts: none may be freed by a collection meanwhile
    scanning = TrackerSource(scan=True)
    scanning.start()
    base = scanning.read().allocated_bytes
    assert base is not None and base >= 4000 + 1000  # a and earlier, found by the scan, and what else is alive
    del earlier
    assert scanning.read().allocated_bytes == base - 1000
    scanning.stop()
    assert a.numel() == 1000
    del a


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build")
def test_cuda_source_on_a_cpu_only_build_says_not_available() -> None:
    source = CudaSource(torch.device("cuda", 0))
    assert source.status == "not available: this torch has no CUDA device"
    assert source.read() == Reading(None, None, None)
    assert source.total_bytes() is None
    assert torch.cuda.memory_allocated() == 0  # the trap: 0 here is not a measurement
    assert type(source_for("cuda")) is MemorySource
    assert source_for("cuda").status == "not measured"


def test_unknown_accelerator_is_not_measured_when_counters_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "accelerator", object(), raising=False)
    source = AcceleratorSource(torch.device("xpu"))
    assert source.status == "not measured" and source.read() == Reading() and source.total_bytes() is None


def test_accelerator_source_reads_generic_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeAccelerator:
        allocated, peak, reserved = 1000, 5000, 8192

        def memory_allocated(self, device):
            return self.allocated

        def max_memory_allocated(self, device):
            return self.peak

        def memory_reserved(self, device):
            return self.reserved

        def reset_peak_memory_stats(self, device):
            self.peak = self.allocated

        def get_memory_info(self, device):
            return (100, 1 << 30)

    monkeypatch.setattr(torch, "accelerator", FakeAccelerator(), raising=False)
    source = AcceleratorSource(torch.device("xpu", 0))
    assert source.read() == Reading(1000, 5000, 8192)
    assert source.read() == Reading(1000, 1000, 8192)  # the peak was reset for the next window
    assert source.total_bytes() == 1 << 30


@pytest.mark.cuda
def test_cuda_source_window_peaks() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    source = CudaSource(device)
    source.start()
    base = torch.cuda.memory_allocated(device)
    keep = torch.empty(1 << 20, device=device)  # 4 MiB
    temporary = torch.empty(4 << 20, device=device)  # 16 MiB, freed inside the window
    del temporary
    reading = source.read()
    assert reading.allocated_bytes == base + (4 << 20)
    assert reading.window_peak_bytes == base + (20 << 20)
    assert reading.reserved_bytes >= reading.allocated_bytes
    assert source.read().window_peak_bytes == base + (4 << 20)
    assert source.total_bytes() == torch.cuda.mem_get_info(device)[1]
    del keep


@pytest.mark.cuda
def test_callback_peak_on_cuda_matches_max_memory_allocated() -> None:
    import lightning as L
    from conftest import make_trainer
    from seed_mlp import SeedMLP, seed_loader

    from lightning_memtenants import MemoryTenantsCallback

    class Window(L.Callback):
        def on_train_batch_start(self, *args):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_train_batch_end(self, *args):
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()

    ours, window = MemoryTenantsCallback(print_summary=False), Window()
    # the window reads first at batch end: ours resets the peak counter when it reads (the simulated device shows it)
    make_trainer([window, ours], steps=1, accelerator="gpu", devices=1).fit(SeedMLP(), seed_loader(2048, 1))
    report = ours.latest
    assert report.memory_source == "cuda allocator counters"
    assert report.peak_bytes == window.peak
    assert report.tenants_bytes["optimizer_state"] == 201_400_344
    for phase in report.phases.values():
        assert phase.other_bytes is not None and phase.fragmentation_bytes is not None


class FakeCudaCounters:
    """``torch.cuda``'s counters over a list of allocations, enough for CudaSource: allocate, free, read, reset."""

    def __init__(self, before: int = 0) -> None:
        self.allocated = 0
        self.peak = before  # whatever the process reached before the callback started
        self.reserved_peak = before + 512  # reserved is allocated + 512 here
        self.resets = 0

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.allocated + 512)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.allocated + 512)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.reserved_peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)

    def reset(self, device: object = None) -> None:
        self.resets += 1
        self.peak = self.allocated
        self.reserved_peak = self.allocated + 512


def windows(counters: FakeCudaCounters, source: CudaSource) -> list[Reading]:
    """Three windows: a 10 kB temporary, then 1 kB kept, then a 3 kB temporary."""
    source.start()
    readings = []
    for keep, temporary in ((0, 10_000), (1_000, 0), (0, 3_000)):
        counters.alloc(keep + temporary)
        counters.free(temporary)
        readings.append(source.read())
    return readings


def test_cuda_window_peaks_reset_the_counter_and_keep_the_run_s_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = FakeCudaCounters(before=50_000)  # the user's own code peaked at 50 kB before fit
    counters.install(monkeypatch)
    source = CudaSource("cuda:0")
    # the same reset clears max_memory_reserved: each window's reserved peak is read before it
    assert windows(counters, source) == [
        Reading(0, 10_000, 512, 10_512),
        Reading(1_000, 1_000, 1_512, 1_512),
        Reading(1_000, 4_000, 1_512, 4_512),
    ]
    assert counters.resets == 4  # at start and after each window: max_memory_allocated() now reads our last window
    assert torch.cuda.max_memory_allocated() == 1_000
    assert source.run_peak_bytes == 50_000  # what the counter held when we first reset it


def test_cuda_peak_counter_left_alone_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = FakeCudaCounters(before=5_000)
    counters.install(monkeypatch)
    source = CudaSource("cuda:0", reset_peaks=False)
    # the first window set a new high (10 kB over 5 kB): measured; the others stayed below it: unknown, not guessed
    assert windows(counters, source) == [
        Reading(0, 10_000, 512),
        Reading(1_000, None, 1_512),
        Reading(1_000, None, 1_512),
    ]
    assert counters.resets == 0 and torch.cuda.max_memory_allocated() == 10_000
    assert source.run_peak_bytes == 10_000
    assert source.status.endswith("(peak counter not reset: a window's peak only where it set a new high)")
    assert source_for("cuda:0", reset_peaks=False).reset_peaks is False


@pytest.mark.cuda
@pytest.mark.parametrize("reset", [True, False])
def test_the_run_s_peak_stands_in_for_max_memory_allocated(reset: bool) -> None:
    from conftest import make_trainer
    from seed_mlp import SeedMLP, seed_loader

    from lightning_memtenants import MemoryTenantsCallback

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ours = MemoryTenantsCallback(print_summary=False, reset_peak_stats=reset)
    make_trainer([ours], steps=2, accelerator="gpu", devices=1).fit(SeedMLP(), seed_loader(2048, 2))
    torch.cuda.synchronize()
    if reset:  # the counter holds our last window; the run's peak is ours to give
        assert torch.cuda.max_memory_allocated() <= ours.run_peak_bytes
        assert ours.run_peak_bytes == max(ours.first.peak_bytes, ours.latest.peak_bytes)
    else:  # the user's counter is untouched, and the step that set the high was measured
        assert torch.cuda.max_memory_allocated() == ours.run_peak_bytes == ours.first.peak_bytes

from __future__ import annotations

import pytest
import torch

from lightning_memtenants.sources import (
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
    source.start()
    a = torch.zeros(1000)
    allocated, peak, reserved = (
        source.read().allocated_bytes,
        source.read().window_peak_bytes,
        source.read().reserved_bytes,
    )
    assert allocated is not None and allocated >= 4000 and peak == allocated and reserved is None
    source.stop()
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
    make_trainer([ours, window], steps=1, accelerator="gpu", devices=1).fit(SeedMLP(), seed_loader(2048, 1))
    report = ours.latest
    assert report.memory_source == "cuda allocator counters"
    assert report.peak_bytes == window.peak
    assert report.tenants_bytes["optimizer_state"] == 201_400_344
    for phase in report.phases.values():
        assert phase.other_bytes is not None and phase.fragmentation_bytes is not None

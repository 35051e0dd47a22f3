"""The CUDA code path on a simulated CUDA device (``simcuda``), so that it runs in CI without a GPU.

``CudaSource``, ``source_for``, ``device_budget_bytes``, the compute capability, ``record_history`` and the OOM
snapshot run against ``torch.cuda`` functions driven by the caching-allocator model, fed by the CPU's real
allocations. Every expected figure is worked out here from the allocator's rules (512-byte blocks; a 2 MiB segment
for requests up to 1 MiB, 20 MiB below 10 MiB, else the request rounded up to 2 MiB). The ``cuda``-marked tests in
``test_sources.py`` still run on real hardware.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import make_trainer
from simcuda import GiB, SimulatedCuda, simulated_cuda
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback
from lightning_memtenants._private import dump_snapshot, record_history
from lightning_memtenants.core.sources import CudaSource, Reading, device_budget_bytes, source_for
from lightning_memtenants.lightning.alerts import _target

MiB = 1 << 20
TOTAL = 8 * GiB
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def sim() -> Iterator[SimulatedCuda]:
    with simulated_cuda(total_bytes=TOTAL) as device:
        yield device


def u8(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


# -- the simulation itself ---------------------------------------------------------------------


def test_the_simulation_patches_torch_cuda_and_puts_it_back() -> None:
    before = torch.cuda.is_available, torch.cuda.memory_allocated, torch.cuda.memory._dump_snapshot
    available = torch.cuda.is_available()
    with simulated_cuda(total_bytes=TOTAL, capability=(9, 0)) as sim:
        assert torch.cuda.is_available() and torch.cuda.current_device() == 0
        assert torch.cuda.get_device_capability(CUDA0) == (9, 0)
        assert torch.cuda.mem_get_info() == (TOTAL, TOTAL)  # nothing reserved yet
        kept = u8(100)
        assert torch.cuda.memory_allocated(CUDA0) == 512 and torch.cuda.memory_reserved(0) == 2 * MiB
        assert torch.cuda.mem_get_info("cuda:0") == (TOTAL - 2 * MiB, TOTAL)
        with pytest.raises(ValueError, match="Expected a cuda device"):  # as real torch.cuda refuses the CPU
            torch.cuda.memory_allocated(torch.device("cpu"))
        assert sim.ooms == 0
        del kept
    assert (torch.cuda.is_available, torch.cuda.memory_allocated, torch.cuda.memory._dump_snapshot) == before
    assert torch.cuda.is_available() == available


def test_an_allocation_past_the_device_raises_a_cuda_oom() -> None:
    with simulated_cuda(total_bytes=64 * MiB) as sim:
        kept = u8(40 * MiB)  # a 40 MiB segment
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
            u8(30 * MiB)  # another 30 MiB segment: 70 MiB reserved on a 64 MiB device
        assert sim.ooms == 1
        del kept


# -- CudaSource, source_for, device_budget_bytes ---------------------------------------------------


def test_cuda_source_readings_are_the_allocator_s_blocks_and_segments(sim: SimulatedCuda) -> None:
    source = CudaSource(CUDA0)
    source.start()
    small = u8(1000)  # a 1024-byte block from a new 2 MiB segment (small pool)
    floats = torch.empty(1000)  # 4000 bytes: a 4096-byte block from the same segment
    temporary = u8(3 * MiB)  # 3 MiB, under 10 MiB: a block from a new 20 MiB segment
    del temporary  # freed inside the window: it sets the window's peak, and its segment stays reserved
    kept = 1024 + 4096
    assert source.read() == Reading(kept, kept + 3 * MiB, 22 * MiB, 22 * MiB)
    assert source.read() == Reading(kept, kept, 22 * MiB, 22 * MiB)  # the peak counter was reset for the next window
    # 25 MiB + 512 rounded up to 2 MiB: a new 26 MiB segment; the 1 MiB - 512 left is too small to split off in
    # the large pool (it must be over 1 MiB), so the whole segment is the block, and allocated counts it whole
    big = u8(25 * MiB + 1)
    assert source.read() == Reading(kept + 26 * MiB, kept + 26 * MiB, 48 * MiB, 48 * MiB)
    del big
    # best fit among the free large blocks (20 and 26 MiB): the 20 MiB one, split (8 MiB left); nothing new reserved
    medium = u8(12 * MiB)
    # the window opened with ``big`` alive: the reset set the counter to what was allocated then, as CUDA's does
    assert source.read() == Reading(kept + 12 * MiB, kept + 26 * MiB, 48 * MiB, 48 * MiB)
    assert sim.resets == 5  # at start and after each of the four reads
    assert torch.cuda.max_memory_allocated() == kept + 12 * MiB  # the counter now reads our last window
    assert source.run_peak_bytes == kept + 26 * MiB
    assert source.total_bytes() == TOTAL and torch.cuda.mem_get_info()[0] == TOTAL - 48 * MiB
    del small, floats, medium


def test_cuda_source_leaves_the_counter_alone_when_asked(sim: SimulatedCuda) -> None:
    source = CudaSource(CUDA0, reset_peaks=False)
    source.start()
    temporary = u8(8192)
    del temporary
    assert source.read() == Reading(0, 8192, 2 * MiB)  # a new high: measured
    temporary = u8(4096)
    del temporary
    assert source.read() == Reading(0, None, 2 * MiB)  # below the high: not measured, not guessed
    assert sim.resets == 0 and torch.cuda.max_memory_allocated() == 8192


def test_source_for_cuda_and_the_device_budget() -> None:
    with simulated_cuda(total_bytes=TOTAL) as sim:
        source = source_for(CUDA0)
        assert type(source) is CudaSource and source.status == "cuda allocator counters"
        assert source_for("cuda:0", reset_peaks=False).reset_peaks is False
        assert CudaSource().device == CUDA0  # no device: the current one
        assert device_budget_bytes(CUDA0) == TOTAL
        assert device_budget_bytes(torch.device("cpu")) is None
        sim.fraction = 0.25  # set_per_process_memory_fraction(0.25)
        assert device_budget_bytes(CUDA0) == TOTAL // 4
    assert CudaSource(CUDA0).status == (
        "cuda allocator counters" if torch.cuda.is_available() else "not available: this torch has no CUDA device"
    )


@pytest.mark.parametrize(("capability", "target"), [((8, 6), "8.6"), ((9, 0), "9.0"), ((99, 0), "cuda")])
def test_the_dry_run_s_target_is_the_device_s_capability(capability: tuple[int, int], target: str) -> None:
    with simulated_cuda(capability=capability):
        assert _target(CUDA0) == target  # a capability the model does not know: the default GPU


# -- the allocator's history --------------------------------------------------------------------


def test_record_history_turns_the_allocator_s_history_on_and_off(sim: SimulatedCuda, tmp_path: Path) -> None:
    record_history(True)
    assert sim.history_calls == ["all"] and sim.recording
    seen = torch.empty(100)  # 400 bytes: a 512-byte block from a new 2 MiB segment
    del seen
    record_history(False)
    assert sim.history_calls == ["all", None] and not sim.recording
    unseen = u8(4 * MiB)  # after the history stopped: in the segments, not in the trace
    dump_snapshot(str(tmp_path / "snapshot.pickle"))
    assert sim.snapshots == [str(tmp_path / "snapshot.pickle")]
    snapshot = pickle.loads((tmp_path / "snapshot.pickle").read_bytes())
    assert [(s["total_size"], s["segment_type"]) for s in snapshot["segments"]] == [
        (2 * MiB, "small"),
        (20 * MiB, "large"),
    ]
    assert sum(s["total_size"] for s in snapshot["segments"]) == torch.cuda.memory_reserved()
    trace = snapshot["device_traces"][0]
    assert [(e["action"], e["size"]) for e in trace] == [
        ("segment_alloc", 2 * MiB),
        ("alloc", 512),
        ("free_requested", 512),
        ("free_completed", 512),
    ]
    del unseen


# -- the callback in a fit -------------------------------------------------------------------------


class Tiny(L.LightningModule):
    """64 -> 256 -> 64 with Adam: 33,088 parameters, 132,352 bytes of weights."""

    def __init__(self, grow_at_step: int | None = None, grow_bytes: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        self.grow_at_step, self.grow_bytes = grow_at_step, grow_bytes

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        if self.global_step == self.grow_at_step:
            x = x + u8(self.grow_bytes)[:1].float()  # a forward temporary the device cannot hold
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def loader(batches: int = 2) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(32 * batches, 64)), batch_size=32)


class Window(L.Callback):
    """An independent reading of each step's peak, as ``benchmarks/gpu_check.py`` takes it."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, *args: object) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, *args: object) -> None:
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated())


class Reports(L.Callback):
    """The callback's report of each step, kept as each step ends."""

    def __init__(self, ours: MemoryTenantsCallback) -> None:
        self.ours, self.reports = ours, []

    def on_train_batch_end(self, *args: object) -> None:
        self.reports.append(self.ours.latest)


def test_callback_step_peak_equals_max_memory_allocated_over_the_same_window(sim: SimulatedCuda) -> None:
    ours = MemoryTenantsCallback(print_summary=False, memory_source=source_for(CUDA0))
    window, reports = Window(), Reports(ours)
    # the independent reader comes first: ours resets the counter at every boundary, batch_end included
    make_trainer([window, ours, reports], steps=2).fit(Tiny(), loader())
    assert [r.step for r in reports.reports] == [0, 1]
    assert [r.peak_bytes for r in reports.reports] == window.peaks
    assert all(peak > 0 for peak in window.peaks)
    report = ours.latest
    assert report.memory_source == "cuda allocator counters"
    assert report.tenants_bytes["weights"] == 33_088 * 4
    for phase in report.phases.values():
        assert phase.reserved_bytes is not None and phase.reserved_bytes % (2 * MiB) == 0
        assert phase.fragmentation_bytes == phase.reserved_bytes - phase.allocated_bytes >= 0
    assert ours.run_peak_bytes == max(window.peaks)


def test_a_reader_after_the_callback_sees_only_what_is_allocated_at_batch_end(sim: SimulatedCuda) -> None:
    """The reset is global (docs/sources.md): a reader whose hook runs after ours reads our last window."""
    ours = MemoryTenantsCallback(print_summary=False, memory_source=source_for(CUDA0))
    window, reports = Window(), Reports(ours)
    make_trainer([ours, window, reports], steps=2).fit(Tiny(), loader())
    ends = [r.phases["batch_end"].allocated_bytes for r in reports.reports]
    assert window.peaks == ends
    assert all(end < r.peak_bytes for end, r in zip(ends, reports.reports, strict=True))


COUNTERS = ("is_available", "memory_allocated", "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats")


class CountedCalls(L.Callback):
    """The ``torch.cuda`` calls made from its ``on_train_batch_start`` (put it before ours) to ``end``'s
    ``on_train_batch_end`` (put that one after ours): what our hooks called in each step."""

    def __init__(self, calls: dict[str, int]) -> None:
        self.calls, self.per_step, self.at = calls, [], 0
        self.end = _CallsAtEnd(self)

    def on_train_batch_start(self, *args: object) -> None:
        self.at = sum(self.calls.values())


class _CallsAtEnd(L.Callback):
    def __init__(self, start: CountedCalls) -> None:
        self.start = start

    def on_train_batch_end(self, *args: object) -> None:
        self.start.per_step.append(sum(self.start.calls.values()) - self.start.at)


def test_a_step_that_carries_its_tenants_costs_a_few_counter_reads_on_cuda(sim: SimulatedCuda) -> None:
    # a patch of our own, undone here, before the simulation's: the ``monkeypatch`` fixture would be undone after it,
    # and put the simulated functions back into torch.cuda for the tests that follow
    with pytest.MonkeyPatch.context() as monkeypatch:
        counts_calls(monkeypatch)


def counts_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = dict.fromkeys(COUNTERS, 0)

    def counted(name: str) -> Any:
        real = getattr(torch.cuda, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    for name in COUNTERS:
        monkeypatch.setattr(torch.cuda, name, counted(name))
    one_read = CudaSource(CUDA0)
    before = sum(calls.values())
    one_read.read()
    per_read = sum(calls.values()) - before
    ours = MemoryTenantsCallback(print_summary=False, memory_source=source_for(CUDA0))
    counter, reports = CountedCalls(calls), Reports(ours)
    make_trainer([counter, ours, counter.end, reports], steps=6, log_every_n_steps=3).fit(Tiny(), loader(6))
    # steps 0 and 2 are logged (counted), 1 is new (Adam's state exists), 3 and 4 carry step 2's, 5 is logged
    assert [r.tenants_from_step for r in reports.reports] == [None, None, None, 2, 2, None]
    # a carried step reads the counters where its window opens and at its five phases, and calls nothing else on
    # the device; the first of them also asks is_available once for the report's memory_source, which the next reuses
    assert per_read == 5  # is_available, allocated, peak, reserved, and the peak's reset
    assert counter.per_step[4] == 6 * per_read
    assert counter.per_step[3] == 6 * per_read + 1
    assert all(r.peak_bytes is not None for r in reports.reports)  # every step's peak is its own reading
    assert reports.reports[3].tenants_bytes == reports.reports[2].tenants_bytes


class OnSimulatedCuda(MemoryTenantsCallback):
    """The callback as it starts on a CUDA device: ``pl_module.device`` reads ``cuda:0`` while ``on_train_start``
    picks the source, the budget and the allocator's history; Lightning's own logging keeps the real CPU device.
    The monitor built there is told ``cuda`` too, so its activation tracker finds no (CPU) activation: the test
    that uses it asserts no tenant."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(type(pl_module), "device", property(lambda _: CUDA0))
            super().on_train_start(trainer, pl_module)


@pytest.mark.parametrize("history", [True, False])
def test_oom_on_the_simulated_device_writes_the_postmortem_and_the_snapshot(tmp_path: Path, history: bool) -> None:
    total = 48 * MiB
    with simulated_cuda(total_bytes=total) as sim:
        ours = OnSimulatedCuda(print_summary=False, record_history=history, postmortem_dir=tmp_path)
        module = Tiny(grow_at_step=1, grow_bytes=64 * MiB)
        with (
            pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory") as caught,
            pytest.warns(UserWarning, match="postmortem written to"),
        ):
            # step 1 asks for a 64 MiB temporary: a 64 MiB segment beside the 2 MiB one, on a 48 MiB device
            make_trainer([ours], steps=3).fit(module, loader(3))
        assert sim.ooms == 1
        assert isinstance(ours._source, CudaSource) and ours.first.memory_source == "cuda allocator counters"
        assert ours.budget == total  # device_budget_bytes: mem_get_info's total
        record = json.loads((tmp_path / "memtenants_oom.json").read_text())
        assert record["step"] == 1 and record["phase"] == "forward"
        assert record["error"] == f"OutOfMemoryError: {caught.value}"
        snapshot_path = tmp_path / "memtenants_oom_snapshot.pickle"
        if not history:
            assert sim.history_calls == [] and not snapshot_path.exists()
            return
        assert sim.history_calls == ["all", None]  # started with fit, stopped when the callback let go
        assert sim.snapshots == [str(snapshot_path)]
        snapshot = pickle.loads(snapshot_path.read_bytes())
        assert [(s["total_size"], s["segment_type"]) for s in snapshot["segments"]] == [
            (2 * MiB, "small"),
            (64 * MiB, "large"),
        ]
        trace = snapshot["device_traces"][0]
        # the history began at the start of fit: the model's 2 MiB segment is older, in the segments but not the trace
        assert [(e["action"], e["size"]) for e in trace if e["action"] in ("oom", "segment_alloc")] == [
            ("segment_alloc", 64 * MiB),
            ("oom", 64 * MiB),
        ]


def test_a_fit_with_record_history_links_the_allocators_snapshot_in_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with simulated_cuda(total_bytes=1 << 30) as sim:
        ours = OnSimulatedCuda(record_history=True, postmortem_dir=tmp_path)
        make_trainer([ours], steps=2).fit(Tiny(), loader(2))
        path = tmp_path / "memtenants_snapshot.pickle"
        assert sim.snapshots == [str(path)]  # dumped once, at the end of fit, while the history was on
        assert sim.history_calls == ["all", None]
        snapshot = pickle.loads(path.read_bytes())
        assert sum(s["total_size"] for s in snapshot["segments"]) == torch.cuda.memory_reserved()
    printed = capsys.readouterr().out
    assert f"the allocator's history (record_history): {path}" in printed
    assert f"trace_plot {path} -o memory.html" in printed


def test_the_largest_batch_on_a_gpu_is_searched_with_cudas_kernels_beside_the_users_saved_tensor_hooks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On a GPU the summary's largest batch comes from dry runs for its compute capability, which enter the CUDA
    kernels' mode inside the user's fit: the user's own saved-tensor hooks run as often as without us, and no
    mode is left behind."""
    packed: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor.numel())
        return tensor

    def fit(callbacks: list[L.Callback]) -> None:
        torch.manual_seed(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            make_trainer(callbacks, steps=2).fit(Tiny(), loader(2))

    with simulated_cuda(total_bytes=1 << 30):
        fit([])
        alone = list(packed)
        packed.clear()
        ours = OnSimulatedCuda(budget_bytes="64MiB")
        fit([ours])
    assert packed == alone and len(alone) > 0
    assert "the largest batch is" in capsys.readouterr().out
    assert not torch._C._is_torch_function_mode_enabled()

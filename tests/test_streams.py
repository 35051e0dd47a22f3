"""A dry run for a GPU follows the stream of every allocation, and the reserved peak is a figure of its own.

The caching allocator keeps a pool per stream: a block freed on one stream is not reused by another. Each figure
below is counted by hand from the allocator's rules (sizes rounded to 512 bytes; up to 1 MiB from 2 MiB segments of
the small pool, 1 to 10 MiB from 20 MiB segments, larger requests rounded up to 2 MiB; with expandable segments, one
segment per stream and pool that grows by 2 MiB pages in the small pool and 20 MiB pages in the large).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from lightning_memtenants import StepReport
from lightning_memtenants.core.sources import CudaSource
from lightning_memtenants.predict import dryrun
from lightning_memtenants.predict.allocator import AllocatorSettings, CachingAllocatorModel
from lightning_memtenants.predict.dryrun import Prediction, dry_run, predict
from lightning_memtenants.units import MiB

# what a dry run routes to the CPU's stream stubs while it runs, and must leave as it found it
CUDA_STREAM_API = ("Stream", "Event", "StreamContext", "stream", "current_stream", "default_stream", "set_stream")
FLOATS_4_MIB = MiB  # 2**20 fp32 elements: a 4 MiB request, served from a 20 MiB segment of the large pool
BATCH = (torch.Size([8, 256]),)  # 8 KiB: the batch and everything the tiny model makes stay in one 2 MiB segment


class Tiny(nn.Module):
    """A model whose own tensors (a 1 KiB weight, its gradient, Adam's two moments) need no more than 2 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(256))


def side_stream_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """4 MiB made and freed on a side stream, then 4 MiB on the default stream."""
    (x,) = batch
    with torch.cuda.stream(torch.cuda.Stream()):
        side = torch.ones(FLOATS_4_MIB)
        del side
    here = torch.ones(FLOATS_4_MIB)
    return (x * model.w).sum() + here.sum()


def regrowing_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """6 MiB made and freed, then 30 MiB, all on the default stream."""
    (x,) = batch
    first = torch.ones(6 * MiB // 4)
    del first
    second = torch.ones(30 * MiB // 4)
    return (x * model.w).sum() + second.sum()


@pytest.fixture(scope="module")
def side_stream() -> Prediction:
    with pytest.MonkeyPatch.context() as patch:
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            patch.delenv(name, raising=False)
        return dry_run(Tiny(), BATCH, loss_fn=side_stream_step, target="H100")


@pytest.fixture
def no_conf(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def one_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay the dry runs with an allocator model of one stream, as the package had before."""
    monkeypatch.setattr(dryrun, "_allocator_model", lambda settings: CachingAllocatorModel(settings, stream=None))


def test_a_side_stream_s_freed_block_is_not_reused_by_the_default_stream(
    side_stream: Prediction, no_conf: pytest.MonkeyPatch
) -> None:
    small = 2 * MiB  # the default stream's small pool: batch, weight, gradient, Adam's moments, the step's scalars
    large = 20 * MiB  # a 4 MiB request's segment
    report = side_stream.report
    assert side_stream.reserved_by_stream_bytes == {"default": small + large, "side stream 1": large}
    assert report.peak_reserved_bytes == small + large + large == 42 * MiB
    assert report.phases["batch_end"].reserved_peak_bytes == 42 * MiB  # nothing more since before_backward
    assert report.phases["before_backward"].reserved_peak_bytes == 42 * MiB
    assert any(note.startswith("streams: default 22.00 MiB, side stream 1 20.00 MiB") for note in report.notes)
    footprint = side_stream.footprint  # what nvidia-smi will show: one process, no NCCL
    assert footprint is not None and side_stream.footprints == [footprint]
    assert (footprint.reserved_peak_bytes, footprint.nccl_bytes) == (42 * MiB, 0)
    assert footprint.total_bytes == 42 * MiB + footprint.context_bytes
    # one pool for every stream: the default stream's 4 MiB reuses the side stream's freed block
    one_pool(no_conf)
    single = predict(Tiny(), BATCH, loss_fn=side_stream_step, target="H100")
    assert single.peak_reserved_bytes == small + large


def test_the_step_s_streams_are_routed_for_the_dry_run_only(no_conf: pytest.MonkeyPatch) -> None:
    before = {name: getattr(torch.cuda, name) for name in (*CUDA_STREAM_API, "synchronize")}
    current = torch.cpu.current_stream()

    def failing(model: nn.Module, batch: Any) -> torch.Tensor:
        torch.cuda.set_stream(torch.cuda.Stream())
        with torch.cuda.stream(torch.cuda.Stream()):
            raise RuntimeError("the step fails inside its side stream")

    with pytest.raises(RuntimeError, match="inside its side stream"):
        dry_run(Tiny(), BATCH, loss_fn=failing, target="H100")
    dry_run(Tiny(), BATCH, loss_fn=side_stream_step, target="H100", allocator="expandable_segments:True")
    assert {name: getattr(torch.cuda, name) for name in before} == before
    assert "record_stream" not in vars(torch.Tensor)
    assert not {"synchronize", "query"} & set(vars(torch.cpu.Stream))
    assert torch.cpu.current_stream() is current
    with pytest.raises(RuntimeError):  # this CPU build's own torch.cuda.Stream, as before the dry run
        torch.cuda.Stream()


@pytest.mark.parametrize(("record", "synchronize", "segments"), [(True, False, 2), (True, True, 1), (False, False, 1)])
def test_a_block_recorded_on_another_stream_is_reused_once_that_stream_is_synchronized(
    record: bool, synchronize: bool, segments: int, no_conf: pytest.MonkeyPatch
) -> None:
    twelve = 12 * MiB // 4  # fp32 elements of a 12 MiB request: a segment of its own (10 MiB and more), not split

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        side = torch.cuda.Stream()
        first = torch.ones(twelve)
        if record:
            first.record_stream(side)  # used on the side stream: its block waits for that stream's work
        del first
        if synchronize:
            side.synchronize()
        second = torch.ones(twelve)
        return (batch[0] * model.w).sum() + second.sum()

    report = predict(Tiny(), BATCH, loss_fn=step, target="H100")
    assert report.peak_reserved_bytes == 2 * MiB + segments * 12 * MiB


def test_fsdp2_allocates_on_its_all_gather_and_reduce_scatter_streams(no_conf: pytest.MonkeyPatch) -> None:
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(512, 512) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        return model(batch[0]).pow(2).mean()

    options: Any = {"loss_fn": loss, "target": "H100", "strategy": "fsdp", "world_size": 2}
    streams = dry_run(MLP(), (torch.Size([8, 512]),), **options)
    by_stream = streams.reserved_by_stream_bytes
    # a layer gathered whole is (512 x 512 + 512) fp32 = 1,050,624 bytes, over 1 MiB: one 20 MiB segment of the
    # copy-in stream's large pool; its reduce-scattered gradient, half of it (525,312 bytes, both layers' together
    # 1,050,624), one 2 MiB segment of the reduce-scatter stream's small pool
    assert (512 * 512 + 512) * 4 == 1_050_624 > MiB and 2 * MiB > 2 * (1_050_624 // 2)
    assert by_stream["FSDP all-gather copy-in"] == 20 * MiB
    assert by_stream["FSDP reduce-scatter"] == 2 * MiB
    assert len(by_stream) >= 3 and next(iter(by_stream)) == "default"
    note = next(n for n in streams.report.notes if n.startswith("streams: "))
    assert "FSDP all-gather copy-in 20.00 MiB" in note and "FSDP reduce-scatter 2.00 MiB" in note
    one_pool(no_conf)
    single = dry_run(MLP(), (torch.Size([8, 512]),), **options)
    with_streams, pooled = streams.report.peak_reserved_bytes, single.report.peak_reserved_bytes
    print(f"FSDP2 over 2 ranks, H100: peak reserved {with_streams:,} bytes with streams, {pooled:,} in one pool")
    assert with_streams is not None and pooled is not None and with_streams > pooled
    assert streams.report.peak_bytes == single.report.peak_bytes  # here the streams change what is reserved alone
    assert [r.peak_reserved_bytes for r in streams.ranks] == [with_streams, with_streams]


def test_expandable_segments_grow_the_segment_a_freed_block_ends(no_conf: pytest.MonkeyPatch) -> None:
    # defaults: 6 MiB takes a 20 MiB segment; freed, it cannot hold 30 MiB, which takes a new 30 MiB segment
    # expandable: the free 20 MiB at the segment's end grows by one 20 MiB page to hold 30 MiB
    small = 2 * MiB
    defaults = predict(Tiny(), BATCH, loss_fn=regrowing_step, target="H100")
    assert defaults.peak_reserved_bytes == small + 20 * MiB + 30 * MiB
    expandable = predict(Tiny(), BATCH, loss_fn=regrowing_step, target="H100", allocator="expandable_segments:True")
    assert expandable.peak_reserved_bytes == small + 2 * 20 * MiB
    assert defaults.peak_reserved_bytes - expandable.peak_reserved_bytes == 10 * MiB
    assert any("expandable_segments:True (given as allocator=" in note for note in expandable.notes)
    settings = AllocatorSettings(expandable_segments=True)
    given = predict(Tiny(), BATCH, loss_fn=regrowing_step, target="H100", allocator=settings)
    assert given.peak_reserved_bytes == expandable.peak_reserved_bytes
    assert any("expandable_segments:True (given as an AllocatorSettings)" in note for note in given.notes)
    # None reads the environment, as torch does
    no_conf.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    environ = predict(Tiny(), BATCH, loss_fn=regrowing_step, target="H100")
    assert environ.peak_reserved_bytes == expandable.peak_reserved_bytes
    assert any("read from the environment's PYTORCH_CUDA_ALLOC_CONF" in note for note in environ.notes)


def test_a_bad_allocator_is_refused_naming_it(cli: Any, no_conf: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"^allocator: .*'maybe'"):
        predict(Tiny(), BATCH, loss_fn=side_stream_step, target="H100", allocator="expandable_segments:maybe")
    with pytest.raises(ValueError, match="allocator applies to a GPU target"):
        predict(Tiny(), BATCH, loss_fn=side_stream_step, allocator="expandable_segments:True")
    cpu = dry_run(Tiny(), BATCH, loss_fn=lambda m, b: (b[0] * m.w).sum())
    assert (cpu.footprint, cpu.footprints, cpu.reserved_by_stream_bytes, cpu.report.peak_reserved_bytes) == (
        None,
        [],
        {},
        None,
    )
    with pytest.raises(ValueError, match="allocator must be a PYTORCH_CUDA_ALLOC_CONF string"):
        predict(Tiny(), BATCH, loss_fn=side_stream_step, target="H100", allocator=3)  # type: ignore[typeddict-item]
    for args, said in (
        (("--target", "H100", "--allocator", "max_split_size_mb:lots"), "--allocator: "),
        (("--allocator", "expandable_segments:True"), "--allocator applies to a GPU target"),
    ):
        run = cli("predict", "nowhere.py:Model", *args)
        assert run.returncode == 2 and run.stdout == ""
        assert run.stderr.startswith(f"memtenants: error: {said}") and run.stderr.count("\n") == 1, run.stderr


def test_the_reserved_peak_round_trips_through_json_and_old_reports_still_load(side_stream: Prediction) -> None:
    report = side_stream.report
    data = json.loads(json.dumps(report.to_dict()))
    assert data["peak_reserved_bytes"] == 42 * MiB
    assert data["phases"]["before_backward"]["reserved_peak_bytes"] == 42 * MiB
    back = StepReport.from_dict(data)
    assert back == report and back.peak_reserved_bytes == 42 * MiB
    for phases in [data["phases"], *data["micro_batches"]]:  # a report written before the figure existed
        for phase in phases.values():
            del phase["reserved_peak_bytes"]
    old = StepReport.from_dict(data)
    assert old.peak_reserved_bytes is None and old.phases["batch_end"].reserved_bytes == 42 * MiB


def test_a_gpu_s_reserved_peak_is_read_only_where_its_peak_counters_are_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = {"allocated": 5 * MiB, "peak": 7 * MiB, "reserved": 20 * MiB, "reserved_peak": 40 * MiB, "resets": 0}

    def reset(device: Any = None) -> None:
        counters["resets"] += 1

    for name, value in {
        "is_available": lambda: True,
        "current_device": lambda: 0,
        "memory_allocated": lambda device=None: counters["allocated"],
        "max_memory_allocated": lambda device=None: counters["peak"],
        "memory_reserved": lambda device=None: counters["reserved"],
        "max_memory_reserved": lambda device=None: counters["reserved_peak"],
        "reset_peak_memory_stats": reset,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    source = CudaSource()
    source.start()
    reading = source.read()
    assert (reading.reserved_bytes, reading.reserved_peak_bytes, counters["resets"]) == (20 * MiB, 40 * MiB, 2)
    shared = CudaSource(reset_peaks=False)  # the counters are the rest of the process's: no reset, no window peak
    shared.start()
    reading = shared.read()
    assert (reading.reserved_bytes, reading.reserved_peak_bytes, counters["resets"]) == (20 * MiB, None, 2)


USER_MODULE = """
import torch
from torch import nn
import lightning as L


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(512, 512) for _ in range(2)])

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())

    def example_batch(self, batch_size):
        return (torch.randn(batch_size, 512),)
"""


def test_the_command_prints_the_reserved_peak_and_what_nvidia_smi_shows_per_rank(
    tmp_path: Any, cli: Any, no_conf: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "two_layers.py"
    module.write_text(USER_MODULE)
    out = tmp_path / "r.json"
    args = ("--target", "H100", "--strategy", "fsdp", "--world-size", "2", "--json", str(out))
    run = cli("predict", f"{module}:Model", "--batch-size", "8", *args)
    assert run.returncode == 0, run.stderr
    document = json.loads(out.read_text())
    report = document["report"]
    reserved = report["peak_reserved_bytes"]
    assert reserved == max(p["reserved_peak_bytes"] for p in report["phases"].values()) > report["peak_bytes"]
    assert document["reserved_by_stream_bytes"]["FSDP all-gather copy-in"] == 20 * MiB
    footprint = document["footprint"]
    assert footprint["reserved_peak_bytes"] == reserved
    assert footprint["total_bytes"] == reserved + footprint["context_bytes"] + footprint["nccl_bytes"]
    assert footprint["nccl_bytes"] > 0  # two ranks hold NCCL's buffers
    assert [(r["peak_reserved_bytes"], r["footprint"]) for r in document["ranks"]] == [(reserved, footprint)] * 2
    assert f"peak reserved {reserved / MiB:,.2f} MiB" in run.stdout
    assert f"nvidia-smi will show about {footprint['total_bytes'] / MiB:,.2f} MiB" in run.stdout
    line = next(line for line in run.stdout.splitlines() if line.startswith("  ranks 0-1: "))
    assert f", peak reserved {reserved / MiB:,.2f} MiB, nvidia-smi {footprint['total_bytes'] / MiB:,.2f} MiB" in line

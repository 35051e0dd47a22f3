"""The memory timeline of a step: recorded by the tracker on tracked steps and in dry runs, drawn, and exported."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch
import torch.cuda._memory_viz as memory_viz
from conftest import no_collection, plain_step
from torch import nn

from lightning_memtenants import TenantMonitor, dry_run
from lightning_memtenants.cli import main
from lightning_memtenants.core.timeline import LAYERS, timeline_of
from lightning_memtenants.render.timeline import snapshot, spread, timeline, timeline_figure, write_snapshot
from lightning_memtenants.units import MiB


def wide_pair() -> nn.Module:
    """16 -> 65536 -> 16: the 64 MiB hidden activation and its gradient meet in the second layer's backward."""
    return nn.Sequential(nn.Linear(16, 65536), nn.Linear(65536, 16))


def mean_square(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.fixture(scope="module")
def predicted():
    return dry_run(wide_pair(), torch.Size([256, 16]), loss_fn=mean_square, optimizer=sgd, steps=2)


def test_the_timeline_peaks_at_the_reports_peak_to_the_byte(predicted) -> None:
    line, report = predicted.timeline, predicted.report
    assert line is timeline(predicted) is timeline(report) is timeline_of(report)
    assert line.peak_bytes == report.peak_bytes == max(line.total_bytes)
    assert line.total_bytes[line.peak_point] == line.peak_bytes
    assert line.peak_phase == report.peak_phase == "after_backward"
    # in the second layer's backward, its bias gradient (a sum) on top of the 64 MiB hidden activation (saved)
    # and the 64 MiB gradient of it (aten.mm) just made
    assert (line.peak_op, line.peak_module) == ("aten.sum.dim_IntList", "1 (backward)")
    assert line.peak_label == "aten.sum.dim_IntList in 1 (backward)"
    assert line.peak_bytes - line.total_bytes[line.peak_point - 1] == 16 * 4  # 16 floats


def test_each_phase_boundary_holds_the_phases_figures(predicted) -> None:
    line, report = predicted.timeline, predicted.report
    assert [name for name, _, _ in line.phases] == list(report.phases)
    for name, at, allocated in line.phases:
        assert allocated == report.phases[name].allocated_bytes, name
        assert 0 <= at <= line.ops
    # the stack at batch_start: the weights tenant to the byte, and the previous step's gradients
    start = {name: line.layers[name][0] for name in LAYERS}
    assert start["weights"] == report.phases["batch_start"].tenants_bytes["weights"]
    assert sum(start.values()) == line.total_bytes[0] == report.phases["batch_start"].allocated_bytes
    for i in range(len(line.total_bytes)):
        assert sum(line.layers[name][i] for name in LAYERS) == line.total_bytes[i]
    # the gradients at the end are the gradients tenant at batch_end
    assert line.layers["gradients"][-1] == report.phases["batch_end"].tenants_bytes["gradients"]


def test_a_long_step_is_subsampled_and_keeps_its_peak() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(300)])
    prediction = dry_run(model, torch.Size([8, 32]), loss_fn=mean_square, steps=1)
    line = prediction.timeline
    assert line.events > 4000
    assert len(line.total_bytes) <= 2 * 2000 + 3
    assert max(line.total_bytes) == line.peak_bytes == prediction.report.peak_bytes


def test_a_tracked_step_records_and_an_untracked_one_does_not() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters())
    monitor = TenantMonitor(model, [optimizer])
    with no_collection():
        first, _ = plain_step(monitor, model, optimizer, torch.randn(32, 64))
        monitor.measure = False
        untracked, _ = plain_step(monitor, model, optimizer, torch.randn(32, 64))
    line = timeline(first)
    assert line.peak_bytes == first.peak_bytes
    assert "optimizer step" in line.peak_module  # Adam's single-tensor temporaries
    assert timeline_of(untracked) is None
    with pytest.raises(ValueError, match="no timeline was recorded"):
        timeline(untracked)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # the hooks left with the step


def test_recording_changes_no_figure() -> None:
    reports = []
    for record in (False, True):
        gc.collect()  # what earlier tests left in cycles: the tracker's first scan would count it
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        optimizer = torch.optim.Adam(model.parameters())
        monitor = TenantMonitor(model, [optimizer])
        monitor.record_timeline = record
        with no_collection():
            steps = [plain_step(monitor, model, optimizer, torch.randn(32, 64))[0] for _ in range(2)]
        monitor.close()
        reports.append(
            [(r.peak_bytes, r.tenants_bytes, {n: p.allocated_bytes for n, p in r.phases.items()}) for r in steps]
        )
        del model, optimizer, monitor, steps
    assert reports[0] == reports[1]


def test_the_snapshot_renders_in_memory_viz(predicted, tmp_path) -> None:
    path = write_snapshot(predicted, tmp_path / "step.pickle")
    with path.open("rb") as file:
        data = pickle.load(file)
    assert set(data) == {"segments", "device_traces"}
    (events,) = data["device_traces"]
    assert {e["action"] for e in events} == {"alloc", "free_requested", "free_completed"}
    assert all(e["stream"] == 0 and e["frames"][0].keys() == {"filename", "line", "name"} for e in events)
    live, high = 0, 0
    for event in events:
        live += (
            event["size"]
            if event["action"] == "alloc"
            else -event["size"]
            if event["action"] == "free_completed"
            else 0
        )
        high = max(high, live)
    assert high == predicted.report.peak_bytes  # memory_viz's top of the chart is the report's peak
    assert live == sum(block["requested_size"] for s in data["segments"] for block in s["blocks"])
    html = memory_viz.trace_plot(data)
    assert html.startswith("<!DOCTYPE html>") or "<html" in html[:500]
    assert any(
        e["frames"][0]
        == {"filename": "1 (backward)", "line": predicted.timeline.peak_op_index, "name": "aten.sum.dim_IntList"}
        for e in events
    )
    assert snapshot(predicted.timeline) == data


def test_the_predict_command_writes_the_snapshot(tmp_path, capsys) -> None:
    path = tmp_path / "step.pickle"
    code = main(["predict", "examples/seed_mlp.py:SeedMLP", "--input-shape", "64,1024", "--snapshot", str(path)])
    assert code == 0
    with path.open("rb") as file:
        memory_viz.trace_plot(pickle.load(file))


def test_the_figure_marks_the_peak_and_the_phases(predicted) -> None:
    line = predicted.timeline
    axes = timeline_figure(line, budget_bytes=1 << 30).axes[0]
    star = {mark.get_label(): mark for mark in axes.lines}["step peak"]
    assert star.get_ydata()[0] == pytest.approx(line.peak_bytes / MiB)
    texts = [t.get_text().strip() for t in axes.texts]
    assert [t for t in texts if t in predicted.report.phases] == list(predicted.report.phases)
    assert any("aten.sum.dim_IntList in 1 (backward)" in t for t in texts)
    labels = axes.get_legend_handles_labels()[1]
    assert "temporaries and other" in labels and "weights" in labels


def test_an_operators_events_sit_side_by_side() -> None:
    assert spread([0, 3, 3, 3, 4]).tolist() == [0, 3, 3 + 1 / 3, 3 + 2 / 3, 4]

"""Conventions the redesign promised: the logger's separator, @override, one serialisation, names that are checked."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import RecordingLogger, make_trainer, plain_step
from lightning.pytorch.callbacks.callback import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_memtenants.monitor as monitor_module
from lightning_memtenants import MemoryTenantsCallback, StepReport, TenantMonitor, TrackerSource, format_table
from lightning_memtenants.render.tags import metrics

SOURCE = Path(__file__).resolve().parents[1] / "src" / "lightning_memtenants"


class Small(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


class DottedLogger(RecordingLogger):
    @property
    def group_separator(self) -> str:
        return "."


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)


def test_tags_follow_each_loggers_group_separator() -> None:
    slashed, dotted = RecordingLogger(), DottedLogger()
    cb = MemoryTenantsCallback(print_summary=False, budget_bytes="1GiB")
    make_trainer([cb], steps=2, logger=[slashed, dotted]).fit(Small(), loader())
    for (step_a, a), (step_b, b) in zip(slashed.logged, dotted.logged, strict=True):
        assert step_a == step_b
        assert sorted(a) == sorted(key.replace(".", "/") for key in b)
        assert all(key.startswith("memtenants.") and "/" not in key for key in b)
        assert a["memtenants/weights_MiB"] == b["memtenants.weights_MiB"] == 60 / 2**20  # 15 fp32 parameters
        assert "memtenants.allocated.batch_end_MiB" in b and "memtenants.headroom_MiB" in b


def test_every_hook_is_marked_as_an_override() -> None:
    hooks = [name for name, value in vars(MemoryTenantsCallback).items() if name in vars(Callback) and callable(value)]
    assert {"on_train_batch_start", "on_before_backward", "on_exception", "state_dict", "setup"} <= set(hooks)
    assert [name for name in hooks if not getattr(vars(MemoryTenantsCallback)[name], "__override__", False)] == []
    assert getattr(MemoryTenantsCallback.state_key.fget, "__override__", False)


def measured_report() -> StepReport:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    monitor = TenantMonitor(model, [optimizer], source=TrackerSource("cpu"))
    try:
        report, _ = plain_step(monitor, model, optimizer, torch.randn(2, 4))
    finally:
        monitor.close()
    return report


def test_the_record_round_trips_through_to_dict_with_its_computed_fields() -> None:
    report = measured_report()
    data = json.loads(json.dumps(report.to_dict()))
    # Adam after its first step: weights, gradients, two moments and a 4-byte step counter per tensor; pow keeps
    # the Linear's 2 x 3 fp32 output for backward (the input is the batch, the weight a weight)
    assert data["tenants_bytes"] == {"weights": 60, "gradients": 60, "optimizer_state": 128, "activations": 24}
    assert data["tenant_sum_bytes"] == 60 + 60 + 128 + 24
    assert data["peak_minus_sum_bytes"] == data["peak_bytes"] - 272
    assert data["expected_fixed_bytes"] == data["measured_fixed_bytes"] == 248 and data["fixed_deviation_bytes"] == 0
    for name, phase in data["phases"].items():
        assert phase["other_bytes"] == phase["allocated_bytes"] - sum(phase["tenants_bytes"].values()), name
        assert phase["fragmentation_bytes"] is None  # the tracker has no allocator
    assert StepReport.from_dict(data) == report
    with pytest.raises(ValueError, match=r"data must be a dict written by StepReport\.to_dict"):
        StepReport.from_dict({"step": 1})


def test_expected_fixed_bytes_is_none_never_zero_when_the_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("formula exploded")

    monkeypatch.setattr(monitor_module, "expected_fixed_cost", broken)
    with pytest.warns(UserWarning, match="measuring fixed cost failed"):
        report = measured_report()
    assert report.expected_fixed_bytes is None and report.fixed_deviation_bytes is None
    assert report.measured_fixed_bytes == 248
    tags = set(metrics(report))
    assert "memtenants/fixed_measured_MiB" in tags
    assert not tags & {"memtenants/fixed_expected_MiB", "memtenants/fixed_deviation_MiB"}
    assert "measured 248 bytes (0.00 MiB); the formula was not checked" in format_table(report)


def test_names_are_checked_where_they_enter() -> None:
    model = nn.Linear(2, 1)
    monitor = TenantMonitor(model, source=None)
    with pytest.raises(ValueError, match="name must be one of"):
        monitor.add_part("ddp_bucket", lambda: 0)  # a typo of ddp_buckets
    with pytest.raises(ValueError, match="phase must be one of"):
        monitor.phase("batch_stat")  # type: ignore[arg-type]
    monitor.add_part("ddp_buckets", lambda: 7)
    assert monitor.phase("batch_start").parts_bytes == {"ddp_buckets": 7}


def test_the_lightning_wiring_never_reaches_into_the_monitor() -> None:
    reached = []
    for path in sorted((SOURCE / "lightning").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = ast.unparse(node.value)
                if owner in ("monitor", "self._monitor"):
                    reached.append(f"{path.name}: {ast.unparse(node)}")
    assert reached == []


def test_the_sources_and_detectors_refuse_or_survive_what_they_cannot_measure() -> None:
    from lightning_memtenants import CudaSource, LeakDetector, MemorySource, MpsSource, source_for

    if not torch.cuda.is_available():
        source = CudaSource()  # no current device to ask on a CPU-only torch: it measures nothing, never raises
        assert source.device == torch.device("cuda") and source.read().allocated_bytes is None
    if not torch.backends.mps.is_available():
        assert type(source_for("mps")) is MemorySource and not isinstance(source_for("mps"), MpsSource)
    for window in (0, 2, 2.5, True):
        with pytest.raises(ValueError, match="window must be an int of 3 or more"):
            LeakDetector(window=window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_bytes_per_step must be an int of 0 or more"):
        LeakDetector(min_bytes_per_step=-1)


def test_a_meta_tracker_counts_meta_parameters_like_meta_tensors() -> None:
    from lightning_memtenants import LiveTensorTracker

    tracker = LiveTensorTracker("meta", scan=False)
    plain = torch.empty(1000, device="meta")
    param = nn.Parameter(torch.empty(500, device="meta"))
    tracker.start([plain, param])
    try:
        assert tracker.current_bytes == 4000 + 2000
    finally:
        tracker.stop()


def test_the_public_api_imports_and_the_calculators_are_in_it() -> None:
    import lightning_memtenants as package

    assert [name for name in package.__all__ if not hasattr(package, name)] == []
    # ZeRO, FSDP and DeepSpeed figures for 1,000 fp32 Adam parameters over 4 ranks
    assert package.fsdp_fixed_cost_bytes(1000, 4) == 16 * 1000 // 4
    assert package.deepspeed_zero_bytes(3, 1000, 4) == 16 * 1000 // 4
    assert package.deepspeed_estimator_bytes(2, 1000, 4) == 4 * 1000 + 16 * 1000 // 4
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        package.deepspeed_estimator_bytes(2, 1000, 0)


def test_notes_are_carried_once_and_a_skipped_step_leaves_no_trace() -> None:
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TenantMonitor(model, [optimizer], source=None)
    monitor.add_note("a note about this run")
    monitor.add_note("a note about this run")
    monitor.phase("batch_start", batch=torch.randn(2, 4))
    assert monitor.pending_micro_batches == 1
    monitor.skip_step()
    assert monitor.pending_micro_batches == 0
    report, _ = plain_step(monitor, model, optimizer, torch.randn(2, 4))
    assert report.notes.count("a note about this run") == 1
    assert len(report.micro_batches) == 1 and report.step == 0  # the skipped step was not counted

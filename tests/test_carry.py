"""Steps the memory source does not measure carry the tenants of the counted micro-batch they repeat."""

from __future__ import annotations

import json
import warnings

import lightning as L
import pytest
import torch
from conftest import CLOSURE_DIVISOR, make_trainer, plain_step
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback, StepReport, TenantMonitor
from lightning_memtenants.analysis.explain import DIVERGED
from lightning_memtenants.core.carry import batch_key

F32 = 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def saved_bytes(batch: int) -> int:
    """What the MLP's graph saves for backward, worked out by hand: tanh's output (batch x 8), which is also the last
    linear's input; the first linear's input is the batch itself (not an activation); and the output (batch x 1),
    which the loss's ``pow`` (the article's loop) or ``mse_loss`` (the LightningModule) saves."""
    return batch * 8 * F32 + batch * 1 * F32


def loop(monitor: TenantMonitor, model: nn.Module, sizes: list[int], measured: set[int]) -> list[StepReport]:
    reports = []
    for step, size in enumerate(sizes):
        monitor.measure = step in measured
        report, _ = plain_step(monitor, model, monitor.optimizers[0], torch.randn(size, 6))
        assert report is not None
        reports.append(report)
    return reports


def run(sizes: list[int], measured: set[int], every: bool) -> list[StepReport]:
    model = mlp()
    monitor = TenantMonitor(model, [torch.optim.Adam(model.parameters())], source=None)
    monitor.count_every_step = every
    return loop(monitor, model, sizes, measured)


def tenants(report: StepReport) -> list[dict[str, int]]:
    return [dict(p.tenants_bytes) for mb in report.micro_batches for p in mb.values()]


def test_carried_steps_report_what_counting_every_step_reports() -> None:
    sizes = [4, 4, 4, 8, 4, 8, 8]
    carried = run(sizes, measured={0}, every=False)
    counted = run(sizes, measured={0}, every=True)
    assert [tenants(r) for r in carried] == [tenants(r) for r in counted]
    # step 0 starts with no optimizer state, step 1 with Adam's: both new; a batch of 8 is new at step 3
    assert [r.tenants_from_step for r in carried] == [None, None, 1, None, 1, 3, 3]  # from the counted ones
    assert all(r.tenants_from_step is None for r in counted)
    for report, size in zip(carried, sizes, strict=True):
        assert report.phases["before_backward"].tenants_bytes["activations"] == saved_bytes(size)
        assert report.phases["after_backward"].tenants_bytes["activations"] == 0
    weights = (6 * 8 + 8 + 8 + 1) * F32
    assert carried[4].tenants_bytes == {
        "weights": weights,
        "gradients": weights,
        "optimizer_state": 2 * weights + 4 * F32,  # exp_avg and exp_avg_sq, and a 0-d step per parameter
        "activations": saved_bytes(4),
    }
    assert carried[4].to_dict()["tenants_from_step"] == 1
    assert StepReport.from_dict(carried[4].to_dict()) == carried[4]


def test_a_measured_step_always_counts() -> None:
    reports = run([4] * 5, measured={0, 3}, every=False)
    assert [r.tenants_from_step for r in reports] == [None, None, 1, None, 3]


def test_the_key_sees_what_decides_the_saved_tensors() -> None:
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    tensors = list(model.parameters())
    x = torch.randn(4, 6)
    key = batch_key(0, (x,), model, [optimizer], tensors)
    assert key == batch_key(0, (torch.randn(4, 6),), model, [optimizer], tensors)  # values do not count
    assert key != batch_key(1, (x,), model, [optimizer], tensors)  # another micro-batch of the step
    assert key != batch_key(0, (x.double(),), model, [optimizer], tensors)
    assert key != batch_key(0, (torch.randn(5, 6),), model, [optimizer], tensors)
    model.eval()
    assert key != batch_key(0, (x,), model, [optimizer], tensors)
    model.train()
    with torch.no_grad():
        assert key != batch_key(0, (x,), model, [optimizer], tensors)
    model(x).sum().backward()
    assert key != batch_key(0, (x,), model, [optimizer], tensors)  # gradients present
    model.zero_grad()
    optimizer.step()  # no gradient: Adam keeps no state
    assert key == batch_key(0, (x,), model, [optimizer], tensors)
    model(x).sum().backward()
    optimizer.step()
    model.zero_grad()
    assert key != batch_key(0, (x,), model, [optimizer], tensors)  # Adam's state now exists


def test_a_phase_the_counted_batch_never_had_is_counted_and_said() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TenantMonitor(model, [optimizer], source=None)
    x = torch.randn(4, 6)

    def step(measure: bool, stepped: bool) -> StepReport:
        monitor.measure = measure
        monitor.phase("batch_start", batch=(x,))
        loss = model(x).pow(2).mean()
        monitor.phase("before_backward", output=loss)
        loss.backward()
        monitor.phase("after_backward")
        if stepped:
            monitor.phase("before_optimizer_step")
            optimizer.step()
        monitor.phase("batch_end")
        report = monitor.end_step()
        assert report is not None
        model.zero_grad()
        return report

    step(True, stepped=False)
    same = step(False, stepped=False)
    assert same.tenants_from_step == 0 and DIVERGED not in same.notes
    other = step(False, stepped=True)
    assert other.tenants_from_step is None and DIVERGED in other.notes
    weights = (6 * 8 + 8 + 8 + 1) * F32
    assert other.phases["before_optimizer_step"].tenants_bytes["gradients"] == weights  # counted there
    assert other.phases["before_backward"].tenants_bytes["activations"] == 4 * 8 * F32 + 4 * F32  # carried
    again = step(False, stepped=True)
    assert again.tenants_from_step is None  # the diverged micro-batch was not kept: counted again


class Steps(L.Callback):
    """Keeps every step's report, read after the callback's own batch end (it comes before this one)."""

    def __init__(self, source: MemoryTenantsCallback) -> None:
        self.source, self.reports = source, []

    def on_train_batch_end(self, *args: object) -> None:
        self.reports.append(self.source.latest)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


def fit(cb: MemoryTenantsCallback, accumulate: int = 1) -> list[StepReport]:
    steps = Steps(cb)
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(64, 6), torch.randn(64, 1))
    trainer = make_trainer([cb, steps], steps=6, log_every_n_steps=3, accumulate_grad_batches=accumulate)
    trainer.fit(Module(), DataLoader(data, batch_size=4))
    return [r for i, r in enumerate(steps.reports) if (i + 1) % accumulate == 0]


def test_a_fit_carries_between_its_logging_steps_what_tracking_every_step_counts() -> None:
    default = fit(MemoryTenantsCallback(print_summary=False))
    every = fit(MemoryTenantsCallback(track_every_step=True, print_summary=False))
    assert [tenants(r) for r in default] == [tenants(r) for r in every]
    # logged: steps 0 and 2 (measured, counted); step 1 is new (Adam's state); 3 and 4 repeat 2; 5 is logged
    assert [r.tenants_from_step for r in default] == [None, None, None, 2, 2, None]
    assert [r.peak_bytes is not None for r in default] == [True, False, True, False, False, True]
    assert default[3].phases["before_backward"].tenants_bytes["activations"] == saved_bytes(4) + CLOSURE_DIVISOR


def test_accumulated_micro_batches_are_carried_one_by_one() -> None:
    default = fit(MemoryTenantsCallback(print_summary=False), accumulate=2)
    every = fit(MemoryTenantsCallback(track_every_step=True, print_summary=False), accumulate=2)
    assert [tenants(r) for r in default] == [tenants(r) for r in every]
    assert all(len(r.micro_batches) == 2 for r in default)
    assert [r.tenants_from_step for r in default] == [None, None, None, 2, 2, None]


class FailsInForward(Module):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if batch_idx == 3:  # a step that carries: neither measured nor new
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return loss


def test_a_postmortem_on_a_carried_step_reads_its_graph_without_the_batch(tmp_path) -> None:
    cb = MemoryTenantsCallback(print_summary=False, postmortem_dir=tmp_path)
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(64, 6), torch.randn(64, 1))
    with pytest.raises(torch.OutOfMemoryError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the postmortem's own warning
        make_trainer([cb], steps=6, log_every_n_steps=3).fit(FailsInForward(), DataLoader(data, batch_size=4))
    record = json.loads((tmp_path / "memtenants_oom.json").read_text())
    assert record["step"] == 3
    assert record["tenants_at_failure_bytes"]["activations"] == saved_bytes(4)  # the graph so far: not x, not y

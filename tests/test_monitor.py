from __future__ import annotations

import pytest
import torch
from conftest import SEED_SAVED_PER_SAMPLE, SEED_WEIGHTS, no_collection, nothing_registered, plain_step
from seed_mlp import seed_model

from lightning_memtenants import PHASES, TenantMonitor


def test_plain_loop_seed_model_exact() -> None:
    torch.manual_seed(0)
    model = seed_model()
    optimizer = torch.optim.Adam(model.parameters())
    monitor = TenantMonitor(model, [optimizer])
    with no_collection():  # earlier tests' garbage, collected mid-step, would lower the readings after it
        report, _ = plain_step(monitor, model, optimizer, torch.randn(16, 1024))
    assert list(report.phases) == list(PHASES)
    assert report.phases["batch_start"].tenants_bytes == {
        "weights": SEED_WEIGHTS,
        "gradients": 0,
        "optimizer_state": 0,
        "activations": 0,
    }
    assert report.phases["before_backward"].tenants_bytes["activations"] == 16 * SEED_SAVED_PER_SAMPLE
    assert report.phases["after_backward"].tenants_bytes["activations"] == 0
    assert report.phases["before_optimizer_step"].tenants_bytes["optimizer_state"] == 0
    assert report.tenants_bytes == {
        "weights": SEED_WEIGHTS,
        "gradients": SEED_WEIGHTS,
        "optimizer_state": 201_400_344,
        "activations": 16 * SEED_SAVED_PER_SAMPLE,
    }
    assert report.expected_fixed_bytes == report.measured_fixed_bytes == 402_800_664
    assert report.fixed_cost_notes == []
    # The tracker counts the training's tensors (the batch among them); measure from the batch's start.
    base = report.phases["batch_start"].allocated_bytes
    gradients, adam_state, temporaries = 100_700_160, 201_400_344, 2 * 4096 * 4096 * 4
    assert report.peak_bytes - base == gradients + adam_state + temporaries + 4096 * 4 + 4  # + a bias temporary, loss
    assert report.peak_phase == "batch_end"
    assert report.step == 0
    assert nothing_registered()


def test_unknown_phase_is_refused() -> None:
    monitor = TenantMonitor(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="phase must be one of"):
        monitor.phase("forward")


def test_failing_census_warns_once_and_training_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_memtenants.core.census import TenantCounter

    def broken(*args, **kwargs):
        raise RuntimeError("census exploded")

    monkeypatch.setattr(TenantCounter, "count", broken)
    warnings: list[str] = []
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TenantMonitor(model, [optimizer], warn=warnings.append)
    for _ in range(3):
        report, _loss = plain_step(monitor, model, optimizer, torch.randn(2, 4))
        assert report is None
    assert warnings == [
        "memtenants: measuring census failed (RuntimeError: census exploded); census is disabled from now on"
    ]
    assert nothing_registered()


def test_failing_activation_tracker_disables_only_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TenantMonitor(model, [optimizer], warn=warnings.append)

    import types

    import lightning_memtenants.core.census as census_module

    def broken(storage):
        raise RuntimeError("graph walk exploded")

    monkeypatch.setattr(census_module, "weakref", types.SimpleNamespace(ref=broken))
    for _ in range(2):
        report, _ = plain_step(monitor, model, optimizer, torch.randn(2, 4))
        assert report is not None
        assert report.tenants_bytes["weights"] == 80
        assert report.tenants_bytes["activations"] == 0
    assert len(warnings) == 1 and "activations is disabled" in warnings[0]
    assert not monitor.measures("activations") and monitor.measures("census")


def test_identical_numerics_with_and_without_monitor() -> None:
    def run(with_monitor: bool) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        optimizer = torch.optim.Adam(model.parameters())
        monitor = TenantMonitor(model, [optimizer] if with_monitor else [], track_activations=with_monitor)
        losses = []
        for i in range(5):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
            if with_monitor:
                losses.append(plain_step(monitor, model, optimizer, x)[1])
            else:
                loss = model(x).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        return losses

    assert run(True) == run(False)


@pytest.mark.slow
def test_plain_loop_example_runs() -> None:
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plain_loop.py")], capture_output=True, text=True, check=True
    ).stdout
    assert out.count("matches the formula to the byte") == 2
    assert "before_backward                 96.04            0.00            0.00            2.25" in out

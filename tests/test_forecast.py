from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memtenants import TenantMonitor
from lightning_memtenants.analysis.forecast import PeakForecast
from lightning_memtenants.core.sources import TrackerSource
from lightning_memtenants.core.storage import batch_elements
from lightning_memtenants.core.tracker import LiveTensorTracker
from lightning_memtenants.units import parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("100kb", 100_000),
        ("4096", 4096),
        (1000, 1000),
        (2.5e9, 2_500_000_000),
    ],
)
def test_parse_bytes(text, expected) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "GiB", "-5GiB", "", 0, -1, True, None, [1], float("nan")])
def test_parse_bytes_rejects_nonsense_naming_the_argument(bad) -> None:
    with pytest.raises(ValueError, match="budget_bytes must be"):
        parse_bytes(bad)


def test_batch_elements() -> None:
    assert batch_elements({"x": torch.zeros(4, 10), "y": [torch.zeros(4, dtype=torch.int64)], "n": 3}) == (44, 192)


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int, monitor: TenantMonitor | None = None):
    x = torch.randn(batch, 64)
    if monitor:
        monitor.phase("batch_start", batch=x)
    loss = model(x).pow(2).mean()
    if monitor:
        monitor.phase("before_backward", output=loss)
    loss.backward()
    if monitor:
        monitor.phase("after_backward")
        monitor.phase("before_optimizer_step")
    optimizer.step()
    if monitor:
        monitor.phase("batch_end")
    optimizer.zero_grad()
    return (monitor.end_step(), x) if monitor else None


def fits(batch: int, budget: int) -> bool:
    """A real step under a simulated device of ``budget`` bytes: does it run out of memory?"""
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = LiveTensorTracker(scan=False, limit_bytes=budget)
    tracker.start(roots=list(model.parameters()))
    try:
        one_step(model, optimizer, batch)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        tracker.stop()


def forecast_from(sizes: list[int]) -> PeakForecast:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TenantMonitor(model, [optimizer], source=TrackerSource(scan=False))
    forecast = PeakForecast()
    for size in sizes:
        report, x = one_step(model, optimizer, size, monitor)
        forecast.observe(report, *batch_elements(x), size)
        del x  # the next step must not find this batch alive
    monitor.close()
    return forecast


def test_max_batch_size_matches_bisection_with_real_runs() -> None:
    budget = 12 * 2**20
    low, high = 1, 1
    while fits(high, budget):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid, budget) else (low, mid)
    predicted = forecast_from([256, 512]).max_batch_size(budget, margin=0.0)  # the OOM comes at the budget itself
    assert abs(predicted - low) <= 0.05 * low, (predicted, low)


def test_one_size_uses_the_tenants_and_two_sizes_fit_a_line() -> None:
    one = forecast_from([512])
    two = forecast_from([256, 512])
    assert one.sizes_seen == 1 and two.sizes_seen == 2
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TenantMonitor(model, [optimizer], source=TrackerSource(scan=False))
    report, _ = one_step(model, optimizer, 1024, monitor)
    monitor.close()
    measured = report.peak_bytes
    assert abs(two.predict_peak_bytes(1024) - measured) <= 0.01 * measured
    # from one size, the slope comes from the tenants: activations, their gradients in backward, the batch
    assert abs(one.predict_peak_bytes(1024) - measured) <= 0.05 * measured


def test_state_dict_round_trip() -> None:
    forecast = forecast_from([64, 128])
    again = PeakForecast()
    again.load_state_dict(forecast.state_dict())
    assert again.predict_peak_bytes(300) == forecast.predict_peak_bytes(300)
    assert again.max_batch_size(2**24) == forecast.max_batch_size(2**24)
    assert PeakForecast().predict_peak_bytes(10) is None and PeakForecast().max_batch_size(10) is None

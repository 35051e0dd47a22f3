"""Bad input anywhere gets one ValueError that names the argument and what it accepts: never a deep error, never a
wrong answer. The command line's own cases are in ``tests/test_cli.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_trainer
from seed_mlp import SeedMLP, seed_loader
from torch import nn

from lightning_memtenants import MemoryTenantsCallback, parse_bytes, predict


@pytest.fixture(scope="module")
def trained() -> MemoryTenantsCallback:
    """A callback whose forecast has seen a step, and a budget to fit batches into."""
    cb = MemoryTenantsCallback(print_summary=False, budget_bytes="1GiB", track_every_step=True)
    make_trainer([cb], steps=2).fit(SeedMLP(), seed_loader(batch_size=8, steps=2))
    assert cb.forecast.ready
    return cb


@pytest.mark.parametrize("value", [-5, 0, math.nan, math.inf, "8", True])
def test_max_batch_size_refuses_elements_per_sample_that_is_not_a_positive_number(trained, value) -> None:
    with pytest.raises(ValueError, match=r"^elements_per_sample must be a finite number above 0, got"):
        trained.max_batch_size(elements_per_sample=value)


def test_max_batch_size_answers_for_a_real_sample_size(trained) -> None:
    assert trained.max_batch_size(elements_per_sample=1024) == trained.max_batch_size() > 8


@pytest.mark.parametrize("value", [-1, 0, "8", None, math.nan, 10**400, 2.0, True])
def test_predict_peak_bytes_refuses_what_is_not_a_batch_size(trained, value) -> None:
    with pytest.raises(ValueError, match=r"^batch_size must be a positive integer up to 9,007,199,254,740,992, got"):
        trained.predict_peak_bytes(value)


def test_predict_peak_bytes_grows_with_the_batch(trained) -> None:
    assert trained.predict_peak_bytes(16) > trained.predict_peak_bytes(8) > 0


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (None, r"^state_dict must be a dict saved by MemoryTenantsCallback.state_dict\(\), got None"),
        ({"forecast": "junk"}, r"^state_dict\['forecast'\] must be a dict, got 'junk'"),
        ({"leaks": {"points": [[1, 2]]}}, r"^the leak detector's state must be a dict saved by LeakDetector"),
        ({"forecast": {"lines": {"x": {"points": 5}}}}, r"^the forecast's state must be a dict saved by PeakForecast"),
    ],
)
def test_load_state_dict_refuses_what_state_dict_did_not_save(state, message) -> None:
    cb = MemoryTenantsCallback()
    with pytest.raises(ValueError, match=message):
        cb.load_state_dict(state)
    assert not cb.forecast.ready  # nothing was half loaded


@pytest.mark.parametrize("value", [0.5, "0.1B", "0.5 B", 0, -3, "0GiB", math.nan, "1e3"])
def test_a_budget_below_one_byte_is_refused_not_read_as_no_budget(value) -> None:
    with pytest.raises(ValueError, match=r"^budget_bytes must be"):
        MemoryTenantsCallback(budget_bytes=value)


def test_budgets_are_read_exactly() -> None:
    assert MemoryTenantsCallback(budget_bytes=10**30).budget_bytes == 10**30  # no float on the way
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("0.1 KiB") == 102  # 102.4 bytes: whole bytes
    assert parse_bytes(2.5) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"postmortem_dir": ""}, r"^postmortem_dir must be None or a non-empty path, got ''"),
        ({"memory_source": np.zeros((3, 3))}, r"^memory_source must be one of \('auto', 'tracker', 'none'\)"),
        ({"memory_source": ["auto"]}, r"^memory_source must be one of"),
        ({"reset_peak_stats": "no"}, r"^reset_peak_stats must be True or False, got 'no'"),
    ],
)
def test_constructor_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryTenantsCallback(**kwargs)


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch": torch.Size([-1, 8])}, r"^batch sizes must be 0 or more, got torch.Size\(\[-1, 8\]\)"),
        ({"batch": lambda model, size: torch.Size([size, 8])}, r"^batch must be a callable of no argument or of one"),
        ({"batch": lambda: None}, r"^batch must contain at least one tensor or torch.Size, got None"),
        ({"loss_fn": lambda model, batch: 1.0}, r"^loss_fn\(model, batch\) must return a loss tensor"),
        ({"loss_fn": lambda m, b: m(b).sum().detach()}, r"^loss_fn\(model, batch\) returned a loss that does not"),
        ({"optimizer": lambda params: 5}, r"^optimizer\(params\) must return a torch.optim.Optimizer, got 5"),
        ({"precision": ["bf16-mixed"]}, r"^precision must be one of"),
        ({"target": ("cuda",)}, r"^target must be one of"),
        ({"target": "TPU"}, r"^target must be one of 'cpu', 'cuda' \(an A100\), or a GPU: .*, got 'TPU'$"),
        ({"target": 3}, r"^target must be one of 'cpu', 'cuda' .*, got 3$"),
        ({"target": "sm_99"}, r"^target must be one of .* compute capability like '8.6' or 'sm_90'.*, got 'sm_99'$"),
        ({"target": "cuda:Voodoo3"}, r"^target must be one of .*, got 'cuda:Voodoo3'$"),
        ({"target": "A100", "gpu": "H100"}, r"^gpu \(deprecated\) names a CUDA architecture and needs target='cuda'"),
        ({"target": "cuda", "gpu": "sm_999"}, r"^gpu must be one of .* or a compute capability"),
        ({"target": "cuda", "gpu": 8.6}, r"^gpu must be one of .* \(a string\), got 8.6"),
    ],
)
def test_predict_refuses_bad_input_at_the_door(kwargs, message) -> None:
    arguments = {"batch": torch.Size([2, 8]), "loss_fn": loss, **kwargs}
    with pytest.raises(ValueError, match=message):
        predict(nn.Linear(8, 2), arguments.pop("batch"), **arguments)


def test_precision_is_checked_by_one_function_with_one_message() -> None:
    from lightning_memtenants import activation_check

    messages = []
    for check in (
        lambda: predict(nn.Linear(8, 2), torch.Size([2, 8]), loss_fn=loss, precision="fp8"),
        lambda: activation_check(nn.Linear(8, 2), torch.Size([2, 8]), precision="fp8"),
    ):
        with pytest.raises(ValueError) as raised:
            check()
        messages.append(str(raised.value))
    expected = "precision must be one of ['16-mixed', '16-true', '32-true', '64-true', 'bf16-mixed', 'bf16-true']"
    assert messages == [f"{expected}, got 'fp8'"] * 2


def test_an_unknown_option_is_a_type_error_listing_the_options() -> None:
    with pytest.raises(TypeError, match=r"^unexpected keyword argument 'gpus': the options are \['loss_fn', "):
        predict(nn.Linear(8, 2), torch.Size([2, 8]), loss_fn=loss, gpus="A100")  # type: ignore[call-arg]


def test_a_model_on_the_meta_device_is_predicted_like_a_real_one() -> None:
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    a, b = predict(meta, torch.Size([4, 8]), loss_fn=loss), predict(real, torch.Size([4, 8]), loss_fn=loss)
    assert a.tenants_bytes == b.tenants_bytes and a.peak_bytes == b.peak_bytes
    p = 8 * 32 + 32 + 32 * 2 + 2
    assert a.tenants_bytes["weights"] == 4 * p and a.tenants_bytes["activations"] == (4 * 32 + 4 * 2) * 4


def test_the_new_core_arguments_are_checked(monkeypatch) -> None:
    from lightning_memtenants import CudaSource, LiveTensorTracker, TenantMonitor

    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"^device must be None, a torch.device or a name like 'cuda:0', got 'gpu0'"):
        TenantMonitor(model, device="gpu0")
    monitor = TenantMonitor(model, source=None)
    monitor.phase("batch_start")
    with pytest.raises(ValueError, match=r"^step must be None or a step number \(an int, 0 or more\), got -1"):
        monitor.end_step(step=-1)
    assert monitor.end_step(step=7).step == 7
    with pytest.raises(ValueError, match=r"^reset_peaks must be True or False, got 'no'"):
        CudaSource("cuda:0", reset_peaks="no")
    with pytest.raises(ValueError, match=r"^count_fake must be True or False, got 1"):
        LiveTensorTracker(count_fake=1)

from __future__ import annotations

import contextlib
import gc
import io
import json
import re
import subprocess
import sys
import weakref
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import (
    CLOSURE_DIVISOR,
    SEED_SAVED_PER_SAMPLE,
    SEED_WEIGHTS,
    RecordingLogger,
    adam_that_fails,
    fail_in_backward,
    make_trainer,
    no_collection,
)
from seed_mlp import SeedMLP, seed_loader
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import PHASES, MemoryTenantsCallback
from lightning_memtenants.units import MiB

TAGS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "tags.md"  # the reference of every logged tag


def no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def no_dispatch_mode() -> bool:
    return _get_current_dispatch_mode() is None


@pytest.fixture(scope="module")
def seed_run() -> tuple[MemoryTenantsCallback, RecordingLogger, list[str]]:
    gc.collect()  # the CPU tracker counts every live tensor: free what earlier tests left in cycles
    printed: list[str] = []
    with pytest.MonkeyPatch.context() as patch:  # undone when the fit is done: nothing leaks into later tests
        for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything sets them: not past this fit
            patch.delenv(name, raising=False)
        L.seed_everything(0, verbose=False)
        cb, logger = MemoryTenantsCallback(), RecordingLogger()
        assert cb.latest is None
        with no_collection(), contextlib.redirect_stdout(io.StringIO()) as stdout:
            make_trainer([cb], steps=2, logger=logger).fit(SeedMLP(), seed_loader(batch_size=8, steps=2))
    printed.append(stdout.getvalue())  # the summary is printed to stdout; a RecordingLogger gets no notice
    return cb, logger, printed


def test_seed_model_tenants_exact(seed_run) -> None:
    cb, _, _ = seed_run
    report = cb.latest
    assert report is not None and report.step == 1
    assert report.tenants_bytes == {
        "weights": SEED_WEIGHTS,
        "gradients": SEED_WEIGHTS,
        "optimizer_state": 201_400_344,
        "activations": 8 * SEED_SAVED_PER_SAMPLE + CLOSURE_DIVISOR,
    }
    assert all(type(v) is int for v in report.tenants_bytes.values())
    assert list(report.phases) == list(PHASES)
    assert report.phases["before_backward"].tenants_bytes["activations"] == 8 * SEED_SAVED_PER_SAMPLE + CLOSURE_DIVISOR
    assert report.expected_fixed_bytes == report.measured_fixed_bytes == 16 * 25_175_040 + 24
    assert report.fixed_cost_notes == []


def test_step_peak_and_the_desk_adds_up(seed_run) -> None:
    cb, _, _ = seed_run
    batch = 8 * 1024 * 4
    # The CPU tracker counts the training's tensors: the module's, the optimizer's, the batch and what the
    # step allocates; not the dataset (16 x 1024 floats), which a GPU run keeps on the host.
    baseline = cb.first.phases["batch_start"].other_bytes
    assert baseline == batch
    largest, adam_state = 4096 * 4096 * 4, 201_400_344
    for report in (cb.first, cb.latest):
        assert report.memory_source == "live-tensor tracker (cpu)"
        # no named part on one CPU device: other is what the tracker saw minus the four tenants
        assert all(phase.parts_bytes == {} for phase in report.phases.values())
        # other: the batch; from the forward on, Lightning's closure loss and its detached copy
        # (4 bytes each); at batch_end only the copy
        assert [phase.other_bytes - baseline for phase in report.phases.values()] == [0, 8, 8, 8, 4]
        # the peak: Adam's two temporaries the size of the largest weight and a bias-sized one, on top of the
        # optimizer state that the first step creates
        start = report.phases["before_optimizer_step"].allocated_bytes
        created = adam_state if report is cb.first else 0
        assert report.peak_phase == "batch_end"
        assert report.peak_bytes == report.phases["batch_end"].window_peak_bytes
        assert report.peak_bytes == start + created + 2 * largest + 4096 * 4
    # both steps peak at the same height: weights, gradients, Adam's state and temporaries, and other
    fixed = 2 * SEED_WEIGHTS + adam_state
    assert cb.first.peak_bytes == cb.latest.peak_bytes == fixed + 2 * largest + 4096 * 4 + baseline + 8
    assert cb.latest.tenant_sum_bytes == fixed + 8 * SEED_SAVED_PER_SAMPLE + CLOSURE_DIVISOR


def test_first_step_peak_is_inside_the_optimizer_step(seed_run) -> None:
    cb, _, _ = seed_run
    first = cb.first
    assert first.peak_phase == "batch_end"
    start = first.phases["before_optimizer_step"].allocated_bytes
    temporaries = first.peak_bytes - start - 201_400_344
    largest = 4096 * 4096 * 4
    assert temporaries == 2 * largest + 4096 * 4  # two the size of the largest weight, and a bias-sized one
    assert first.peak_explanation.startswith(
        "peak inside the optimizer step: Adam (single-tensor) temporaries of 128.02 MiB"
        " (about 2.0 x the largest parameter, 64.00 MiB), on top of 192.07 MiB of optimizer state the step created"
    )
    # the article's point: the peak lies above the largest tenant and, with Adam's temporaries, above the sum
    assert first.peak_bytes > max(first.tenants_bytes.values())
    assert first.peak_minus_sum_bytes > 0


@pytest.mark.slow
def test_peak_matches_pytorch_memtracker() -> None:
    script = Path(__file__).resolve().parent / "memtracker_oracle.py"
    out = subprocess.run([sys.executable, str(script), "256"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # with a scan, every CPU tensor of the process, as MemTracker counts: the same peak, to a few bytes
    assert abs(result["ours_scanning"] - result["memtracker"]) <= 8
    # by default, the training's tensors: the dataset (768 x 1024 floats), which a GPU run keeps on the host, is not
    assert result["dataset"] == 768 * 1024 * 4
    assert 0 <= result["ours_scanning"] - result["ours"] - result["dataset"] <= 8  # and a scalar or two
    assert result["phase"] == "batch_end"


class LoggingTinyModule(L.LightningModule):
    """TinyModule's net, logging its loss the way a user does, to see where Lightning puts the user's scalars."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).pow(2).mean()
        self.log("user_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


@pytest.mark.parametrize(("steps", "every", "accumulate"), [(7, 3, 1), (6, 2, 2), (4, 1, 1)])
def test_scalars_land_on_the_users_own_logging_steps(steps: int, every: int, accumulate: int) -> None:
    cb, logger = MemoryTenantsCallback(print_summary=False), RecordingLogger()
    trainer = make_trainer(
        [cb], steps=steps, log_every_n_steps=every, logger=logger, accumulate_grad_batches=accumulate
    )
    trainer.fit(LoggingTinyModule(), tiny_loader(n=64))
    users = [step for step, metrics in logger.logged if "user_loss" in metrics]
    ours = [step for step, metrics in logger.logged if "memtenants/weights_MiB" in metrics]
    # Lightning logs the step b (optimizer steps taken before it) where (b + 1) % every == 0; the first is ours too
    expected = [b for b in range(steps) if (b + 1) % every == 0]
    assert users == expected
    assert ours == sorted({0, *expected})
    measured = [step for step, metrics in logger.logged if "memtenants/peak_MiB" in metrics]
    assert measured == ours  # the tracker measured exactly the logged steps


def test_tracker_runs_on_logging_steps_by_default() -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    make_trainer([cb], steps=4, log_every_n_steps=3).fit(TinyModule(), tiny_loader())
    # steps 0 (the first) and 2 ((2 + 1) % 3 == 0) are measured; 3 is not
    assert cb.latest.step == 3 and cb.latest.peak_bytes is None
    assert cb.latest.peak_explanation == "peak not measured: no memory source measured this step"
    assert cb.latest.phases["batch_end"].allocated_bytes is None
    assert cb.latest_measured.step == 2 and cb.latest_measured.peak_bytes > 0
    every = MemoryTenantsCallback(track_every_step=True, print_summary=False)
    make_trainer([every], steps=4, log_every_n_steps=3).fit(TinyModule(), tiny_loader())
    assert every.latest.step == 3 and every.latest.peak_bytes is not None
    none = MemoryTenantsCallback(memory_source="none", print_summary=False)
    make_trainer([none], steps=1).fit(TinyModule(), tiny_loader())
    assert none.latest.peak_bytes is None and none.latest.memory_source == "not measured"


def test_first_step_shows_adam_creating_its_state(seed_run) -> None:
    cb, _, _ = seed_run
    first = cb.first
    assert first is not None and first.step == 0
    assert first.phases["before_optimizer_step"].tenants_bytes["optimizer_state"] == 0
    assert first.phases["batch_end"].tenants_bytes["optimizer_state"] == 201_400_344
    # Lightning zeroes gradients after the forward: the second step starts with them resident.
    assert first.phases["batch_start"].tenants_bytes["gradients"] == 0
    assert cb.latest.phases["batch_start"].tenants_bytes["gradients"] == SEED_WEIGHTS


def test_scalars_go_to_any_logger_with_units(seed_run) -> None:
    _, logger, _ = seed_run
    assert len(logger.logged) == 2
    _step, metrics = logger.logged[-1]
    assert metrics["memtenants/weights_MiB"] == pytest.approx(SEED_WEIGHTS / MiB)
    assert round(metrics["memtenants/weights_MiB"], 2) == 96.04
    assert metrics["memtenants/optimizer_state_MiB"] == 201_400_344 / MiB
    assert metrics["memtenants/fixed_deviation_MiB"] == 0
    assert all(tag.startswith("memtenants/") and tag.endswith("_MiB") for tag in metrics)


def test_every_logged_tag_is_in_the_tags_page(seed_run) -> None:
    _, logger, _ = seed_run
    documented = set(re.findall(r"`(memtenants/[A-Za-z0-9_/]+)`", TAGS_PAGE.read_text()))
    logged = {tag for _, metrics in logger.logged for tag in metrics}
    assert logged <= documented


def test_summary_table_is_printed_at_the_end(seed_run) -> None:
    _, _, printed = seed_run
    assert len(printed) == 1  # stdout, and no notice: the summary is not logged
    printed = printed[0].split("\n\nmemtenants: optimizer step ")
    assert len(printed) == 3  # the headline, the first step, then the last
    assert printed[0].startswith("memtenants: at a glance\n- peak: training ")
    assert printed[1].startswith("0 (memory source: live-tensor tracker (cpu))")
    assert printed[-1].startswith("1 (memory source: live-tensor tracker (cpu))")
    assert re.search(r"batch_end\s+96\.04\s+96\.04\s+192\.07\s+0\.00\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+", printed[-1])
    assert "peak inside the optimizer step" in printed[-1]
    assert "expected 402,800,664 bytes" in printed[-1]
    assert "matches the formula to the byte" in printed[-1]


def test_no_hooks_left_after_fit(seed_run) -> None:
    cb, _, _ = seed_run
    assert no_saved_tensor_hooks()
    assert no_dispatch_mode()
    assert cb._monitor is None  # released at teardown: no module, optimizer or tensor is kept


@pytest.mark.slow
def test_bitwise_identical_losses_with_and_without_callback() -> None:
    def losses(callbacks: list[L.Callback]) -> list[float]:
        L.seed_everything(0, verbose=False)
        module = SeedMLP()
        make_trainer(callbacks, steps=5).fit(module, seed_loader(batch_size=4, steps=5))
        return module.losses

    with_cb = losses([MemoryTenantsCallback()])
    assert len(with_cb) == 5
    assert with_cb == losses([])


class TinyModule(L.LightningModule):
    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))  # 65 parameters
        self.optimizer = optimizer
        self.activation_refs: list[weakref.ref] = []
        self.batch_refs: list[weakref.ref] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        hidden = self.net[1](self.net[0](x))
        self.activation_refs.append(weakref.ref(hidden))
        self.batch_refs.append(weakref.ref(x))
        return self.net[2](hidden).pow(2).mean()

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.Adam(self.parameters())


def tiny_loader(n: int = 8, batch_size: int = 2) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 6)), batch_size=batch_size)


def test_gradient_accumulation_reports_per_optimizer_step() -> None:
    cb = MemoryTenantsCallback()
    make_trainer([cb], steps=2, accumulate_grad_batches=2).fit(TinyModule(), tiny_loader())
    report = cb.latest
    assert report is not None and report.step == 1
    assert len(report.micro_batches) == 2
    assert "before_optimizer_step" not in report.micro_batches[0]
    assert list(report.micro_batches[1]) == list(PHASES)
    assert report.expected_fixed_bytes == report.measured_fixed_bytes == 65 * 16 + 4 * 4
    # tanh saves its output (2 x 8 floats); the second Linear saves it too; pow saves the 2 x 1 output;
    # Lightning's closure divides the loss by 2 and keeps the divisor.
    assert report.tenants_bytes["activations"] == 2 * 8 * 4 + 2 * 1 * 4 + CLOSURE_DIVISOR


class ManualModule(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def test_manual_optimization() -> None:
    cb = MemoryTenantsCallback()
    make_trainer([cb], steps=3).fit(ManualModule(), tiny_loader())
    report = cb.latest
    assert report is not None and report.step == 2
    assert set(report.phases) == set(PHASES)
    assert report.phases["after_backward"].tenants_bytes["gradients"] == 65 * 4
    assert report.tenants_bytes["optimizer_state"] == 65 * 8 + 4 * 4
    assert no_saved_tensor_hooks()


def test_frozen_layer_in_trainer_is_explained() -> None:
    module = TinyModule(optimizer="sgd")
    module.net[0].requires_grad_(False)  # 56 frozen parameters
    cb = MemoryTenantsCallback()
    make_trainer([cb], steps=1).fit(module, tiny_loader())
    report = cb.latest
    assert report.tenants_bytes["gradients"] == 9 * 4
    assert report.expected_fixed_bytes == report.measured_fixed_bytes == 65 * 4 + 9 * 4
    assert report.fixed_cost_notes == ["56 frozen parameters have no gradient and no optimizer state"]


def test_callback_keeps_no_tensor_after_the_step() -> None:
    module = TinyModule()
    make_trainer([MemoryTenantsCallback()], steps=3).fit(module, tiny_loader())
    assert len(module.activation_refs) == 3
    assert all(ref() is None for ref in module.activation_refs)
    assert all(ref() is None for ref in module.batch_refs[:-1])


def test_callback_is_reusable_across_fits() -> None:
    cb = MemoryTenantsCallback()
    make_trainer([cb], steps=2).fit(TinyModule(), tiny_loader())
    make_trainer([cb], steps=1).fit(TinyModule(optimizer="sgd"), tiny_loader())
    assert cb.latest is not None and cb.latest.step == 0
    assert cb.latest.tenants_bytes["optimizer_state"] == 0


class Boom(TinyModule):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.error = ValueError(f"user error in {where}")

    def training_step(self, batch, batch_idx):
        if self.where == "training_step":
            raise self.error
        loss = super().training_step(batch, batch_idx)
        if self.where == "backward":
            loss = fail_in_backward(loss, self.error)
        return loss

    def configure_optimizers(self):
        boom = self
        return adam_that_fails(self.parameters(), lambda: boom.where == "optimizer_step", boom.error)


@pytest.mark.parametrize("where", ["training_step", "backward", "optimizer_step"])
def test_user_exceptions_pass_through_unchanged(where: str) -> None:
    module = Boom(where)
    with pytest.raises(ValueError) as caught:
        make_trainer([MemoryTenantsCallback()], steps=1).fit(module, tiny_loader())
    assert caught.value is module.error
    assert no_saved_tensor_hooks()
    assert no_dispatch_mode()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"track_activations": "yes"}, "track_activations must be True or False"),
        ({"print_summary": 1}, "print_summary must be True or False"),
        ({"track_every_step": None}, "track_every_step must be True or False"),
        ({"memory_source": "gpu"}, "memory_source must be one of"),
        ({"memory_source": 3}, "memory_source must be one of"),
        ({"log_every_n_steps": 0}, "log_every_n_steps must be None or a positive int"),
        ({"log_every_n_steps": -3}, "log_every_n_steps must be None or a positive int"),
        ({"log_every_n_steps": 2.5}, "log_every_n_steps must be None or a positive int"),
        ({"log_every_n_steps": True}, "log_every_n_steps must be None or a positive int"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryTenantsCallback(**kwargs)


def test_log_every_n_steps_option() -> None:
    logger = RecordingLogger()
    cb = MemoryTenantsCallback(log_every_n_steps=2)
    make_trainer([cb], steps=4, logger=logger, log_every_n_steps=50).fit(TinyModule(), tiny_loader())
    # ours every 2 steps (b + 1) % 2 == 0, and the first; the trainer's 50 governs only Lightning's own scalars
    assert [step for step, _ in logger.logged] == [0, 1, 3]
    assert all("memtenants/peak_MiB" in metrics for _, metrics in logger.logged)

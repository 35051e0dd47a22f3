from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import RecordingLogger, adam_that_fails, fail_in_backward, make_trainer
from seed_mlp import SeedMLP, seed_loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback
from lightning_memtenants.analysis.budget import MemoryBudgetError
from lightning_memtenants.analysis.fixes import ranked_fixes
from lightning_memtenants.units import MiB

SEED_FIXED = 402_800_664


def watch_adam_body(monkeypatch: pytest.MonkeyPatch, record: Callable[[], None]) -> None:
    """Call ``record`` when Adam's update itself runs (its pre-hook fires before Lightning's closure)."""
    adam_module = importlib.import_module("torch.optim.adam")
    body = adam_module.adam

    def watched(*args, **kwargs):
        record()
        return body(*args, **kwargs)

    monkeypatch.setattr(adam_module, "adam", watched)


def test_first_step_jump_warning_fires_before_the_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    seen_at_step: list[int] = []
    watch_adam_body(monkeypatch, lambda: seen_at_step.append(len(caught)))
    # census only: the projection is weights + gradients + Adam's state (8P + 24) + two 64 MiB temporaries
    cb = MemoryTenantsCallback(budget_bytes="480MiB", memory_source="none", print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], steps=1).fit(SeedMLP(), seed_loader(8, 1))
    texts = [str(w.message) for w in caught if "memtenants" in str(w.message)]
    first = [t for t in texts if "first optimizer step" in t]
    assert len(first) == 1
    assert "adds 192.07 MiB of optimizer state and about 128.00 MiB of temporaries" in first[0]
    assert "its projected peak is 512.14 MiB, over the budget of 456.00 MiB (480.00 MiB less a 5% margin)" in first[0]
    assert "Fix: shard the optimizer state" in first[0]
    assert seen_at_step and seen_at_step[0] >= 1 + texts.index(first[0])  # warned before step() ran


def test_strict_raises_before_the_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    stepped: list[bool] = []
    watch_adam_body(monkeypatch, lambda: stepped.append(True))
    cb = MemoryTenantsCallback(budget_bytes=480 * MiB, memory_source="none", strict=True, print_summary=False)
    with pytest.raises(MemoryBudgetError, match="first optimizer step"):
        make_trainer([cb], steps=1).fit(SeedMLP(), seed_loader(8, 1))
    assert stepped == []


def test_no_warning_when_the_budget_is_ample() -> None:
    cb = MemoryTenantsCallback(budget_bytes="2GiB", memory_source="none", print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], steps=2).fit(SeedMLP(), seed_loader(8, 2))
    assert not [w for w in caught if "memtenants" in str(w.message)]


@pytest.mark.slow
def test_forecast_from_batch_64_predicts_batch_256_within_3_percent() -> None:
    script = Path(__file__).resolve().parent / "forecast_check.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert abs(result["predicted"] - result["measured"]) <= 0.03 * result["measured"], result


class Wide(L.LightningModule):
    """Activations dominate: 4 MiB of them against 1 MiB of weights at batch 1024."""

    def __init__(self, fail: str | None = None, fail_step: int = 0, keep_graphs: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
        self.fail, self.fail_step, self.keep_graphs = fail, fail_step, keep_graphs
        self.kept: list[torch.Tensor] = []
        self.error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    def training_step(self, batch, batch_idx):
        (x,) = batch
        now = self.global_step == self.fail_step
        hidden = self.net[:4](x)
        if self.fail == "forward" and now:
            raise self.error
        loss = self.net[4](hidden).pow(2).mean()
        if self.keep_graphs:  # the classic leak: a result kept with a graph that backward never frees
            self.kept.append(self.net[:2](x).sum())
        if self.fail == "backward" and now:
            loss = fail_in_backward(loss, self.error)
        return loss

    def configure_optimizers(self):
        module = self
        return adam_that_fails(
            self.parameters(),
            lambda: module.fail == "optimizer_step" and module.global_step == module.fail_step,
            module.error,
        )


def wide_loader(batches: int = 4, batch_size: int = 1024) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(batches * batch_size, 8)), batch_size=batch_size)


@pytest.mark.parametrize(
    ("fail", "fail_step", "phase", "fattest"),
    [
        ("forward", 0, "forward", "activations"),
        ("backward", 0, "backward", "activations"),
        ("optimizer_step", 1, "optimizer_step", "optimizer_state"),
    ],
)
def test_oom_postmortem_names_the_phase_and_the_fat_tenant(tmp_path, fail, fail_step, phase, fattest) -> None:
    module = Wide(fail, fail_step)
    cb = MemoryTenantsCallback(postmortem_dir=tmp_path, memory_source="none", print_summary=False)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        make_trainer([cb], steps=3).fit(module, wide_loader())
    assert caught.value is module.error
    record = json.loads((tmp_path / "memtenants_oom.json").read_text())
    assert record["phase"] == phase
    assert record["fattest_tenant"] == fattest
    assert record["step"] == fail_step
    assert record["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert record["fixes"] and record["fixes"] == sorted(record["fixes"], key=lambda f: -f["saves_bytes"])
    text = (tmp_path / "memtenants_oom.txt").read_text()
    assert f"fattest tenant: {fattest}" in text
    assert cb.postmortem_path == tmp_path / "memtenants_oom.json"


def test_real_oom_on_a_simulated_small_device(tmp_path) -> None:
    from lightning_memtenants.core.sources import TrackerSource

    source = TrackerSource(scan=False, limit_bytes=12 * MiB)  # fits the fixed 4 MiB, not a 1024-batch step
    cb = MemoryTenantsCallback(memory_source=source, postmortem_dir=tmp_path, print_summary=False)
    with pytest.raises(torch.OutOfMemoryError, match="simulated device"):
        make_trainer([cb], steps=1).fit(Wide(), wide_loader(batch_size=4096))
    record = json.loads((tmp_path / "memtenants_oom.json").read_text())
    # at batch 4096 the first layer's 8 MiB output fits; the ReLU's output of the same size is the allocation
    # that fails (made, then refused): beside the 128 KiB batch, forward temporaries are "other"
    assert record["phase"] == "forward" and record["fattest_tenant"] == "other"
    assert record["other_at_failure_bytes"] == 4096 * 8 * 4 + 2 * 4096 * 512 * 4
    assert record["fixes"][0]["action"].startswith("halve the batch size")


def test_ranked_fixes_bytes() -> None:
    model = nn.Linear(4, 4)
    fixes = ranked_fixes(
        {"activations": 1000, "optimizer_state": 800, "gradients": 400, "weights": 400},
        model,
        [torch.optim.Adam(model.parameters())],
        world_size=4,
    )
    saves = {f.action.split(" ")[0]: f.saves_bytes for f in fixes}
    assert saves["halve"] == 500 and saves["activation"] == 700 and saves["shard"] == 600


def test_leak_is_flagged_within_20_steps() -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], steps=20).fit(Wide(keep_graphs=True), wide_loader(batches=20, batch_size=256))
    leaks = [str(w.message) for w in caught if "grows by" in str(w.message)]
    assert len(leaks) == 1
    assert "mostly in other" in leaks[0] and "loss.detach()" in leaks[0]


@pytest.mark.slow
def test_healthy_seed_model_over_50_steps_has_no_leak_warning() -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], steps=50).fit(SeedMLP(), seed_loader(4, 50))
    assert not [w for w in caught if "grows by" in str(w.message)]
    assert cb.leaks.state_dict()["seen"] == 50


def test_headroom_and_max_batch_are_logged_and_shown() -> None:
    logger = RecordingLogger()
    cb = MemoryTenantsCallback(budget_bytes="64MiB", memory_source=_fresh_tracker(), print_summary=False)
    trainer = make_trainer([cb], steps=2, logger=logger)
    trainer.fit(Wide(), wide_loader(batch_size=256))
    _, metrics = logger.logged[-1]
    assert metrics["memtenants/headroom_MiB"] == pytest.approx((64 * MiB - cb.latest.peak_bytes) / MiB)
    assert metrics["memtenants/max_batch_size"] == cb.max_batch_size() > 256
    assert trainer.progress_bar_metrics["headroom_MiB"] == pytest.approx(metrics["memtenants/headroom_MiB"])
    assert cb.max_batch_size("1GiB") > cb.max_batch_size()


def test_variable_size_batches_warn_when_a_larger_one_would_not_fit() -> None:
    sizes = [256, 256, 256, 4096]
    data = TensorDataset(torch.randn(sum(sizes), 8))
    batches, start = [], 0
    for size in sizes:
        batches.append(list(range(start, start + size)))
        start += size
    loader = DataLoader(data, batch_sampler=batches)
    cb = MemoryTenantsCallback(budget_bytes="16MiB", memory_source=_fresh_tracker(), print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], steps=4).fit(Wide(), loader)
    larger = [str(w.message) for w in caught if "largest yet" in str(w.message)]
    assert len(larger) == 1 and "batch 3 is the largest yet (4096 samples" in larger[0]


def _fresh_tracker():
    from lightning_memtenants.core.sources import TrackerSource

    return TrackerSource(scan=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_bytes": "12 parsecs"}, "budget_bytes must be"),
        ({"budget_bytes": -1}, "budget_bytes must be"),
        ({"margin": 1.5}, "margin must be a fraction"),
        ({"margin": -0.1}, "margin must be a fraction"),
        ({"margin": "5%"}, "margin must be a fraction"),
        ({"strict": "yes"}, "strict must be True or False"),
        ({"record_history": 1}, "record_history must be True or False"),
        ({"postmortem_dir": 5}, "postmortem_dir must be None or a non-empty path"),
    ],
)
def test_bad_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryTenantsCallback(**kwargs)


def test_state_dict_keeps_forecast_and_leak_baseline() -> None:
    cb = MemoryTenantsCallback(budget_bytes="64MiB", memory_source=_fresh_tracker(), print_summary=False)
    make_trainer([cb], steps=4).fit(Wide(), wide_loader(batch_size=256))
    again = MemoryTenantsCallback(budget_bytes="64MiB")
    again.load_state_dict(cb.state_dict())
    # the lines come back; the scaled step (a measured step's timeline) belongs to the run that measured it
    assert again.forecast.exact is None and cb.forecast.exact is not None
    assert again.predict_peak_bytes(512) == cb.forecast.predict_for_elements(512 * 8)
    assert again.forecast.line_batch_size("64MiB") == cb.forecast.line_batch_size("64MiB")
    assert again.leaks.state_dict() == cb.leaks.state_dict()


def test_optimizer_step_oom_does_not_blame_the_batch(tmp_path) -> None:
    cb = MemoryTenantsCallback(memory_source=_fresh_tracker(), postmortem_dir=tmp_path, print_summary=False)
    with pytest.raises(torch.OutOfMemoryError):
        make_trainer([cb], steps=3).fit(Wide("optimizer_step", 1), wide_loader())
    record = json.loads((tmp_path / "memtenants_oom.json").read_text())
    # other: the batch of 1024 x 8 fp32 numbers, and Lightning's closure loss and its detached copy
    assert record["phase"] == "optimizer_step" and record["other_at_failure_bytes"] == 1024 * 8 * 4 + 8
    state = 8 * (8 * 512 + 512 + 512 * 512 + 512 + 512 + 1) + 6 * 4  # Adam's moments and a step per tensor
    assert record["tenants_at_failure_bytes"]["optimizer_state"] == state
    # no fix that halves the batch: the one fix is sharding the state, which saves half of it on 2 devices
    assert record["fixes"] == [
        {
            "action": "shard the optimizer state with ZeRO or FSDP across 2 devices: saves (N-1)/N of it",
            "saves_bytes": state // 2,
        }
    ]


@pytest.mark.cuda
def test_record_history_dumps_a_snapshot_for_memory_viz(tmp_path) -> None:
    cb = MemoryTenantsCallback(record_history=True, postmortem_dir=tmp_path, print_summary=False)
    with pytest.raises(torch.OutOfMemoryError):
        make_trainer([cb], steps=2, accelerator="gpu", devices=1).fit(Wide("forward", 1), wide_loader())
    assert (tmp_path / "memtenants_oom_snapshot.pickle").stat().st_size > 0
    assert json.loads((tmp_path / "memtenants_oom.json").read_text())["phase"] == "forward"

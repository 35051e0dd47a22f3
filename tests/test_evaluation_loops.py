"""Validation, test and predict loops measured: exact tenants and peaks against counts made here by hand, the
budget's warning before an evaluation OOM and the postmortem after it, the leak detector across batches, the tags.

The model is two linear layers around a ReLU. Under ``no_grad`` its step's peak is the first layer's output and
the ReLU's output alive together (``2 x B x hidden x 4`` bytes) on top of what the loop holds at the batch's start:
the weights, the optimizer state training left, and the batch. Lightning frees the gradients before validation
(``on_validation_model_zero_grad``), so the gradients tenant is 0 there.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from conftest import RecordingLogger, make_trainer, nothing_registered
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback
from lightning_memtenants.core.sources import TrackerSource
from lightning_memtenants.units import MiB

IN = 64


def weights_bytes(hidden: int) -> int:
    return (IN * hidden + hidden + hidden * IN + IN) * 4


def adam_bytes(hidden: int) -> int:
    return 2 * weights_bytes(hidden) + 4 * 4  # two moments, and a 4-byte step counter per parameter


def batch_bytes(samples: int) -> int:
    return 2 * samples * IN * 4  # x and y


class Net(L.LightningModule):
    """Two linear layers; ``keep`` appends each validation output (with its graph where grad is on) to a list."""

    def __init__(self, hidden: int = 256, keep: bool = False, grad: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, IN))
        self.keep, self.grad, self.kept = keep, grad, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, _ = batch
        with torch.enable_grad() if self.grad else contextlib.nullcontext():
            out = self.net(x).sum()
        if self.keep:
            self.kept.append(out)
        return out if self.grad else None

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.net(batch[0])

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum(1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def loader(samples: int, batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(samples, IN, generator=g), torch.randn(samples, IN, generator=g)),
        batch_size=batch_size,
    )


@pytest.fixture(scope="module")
def fitted() -> tuple[MemoryTenantsCallback, RecordingLogger]:
    """A fit of 2 steps of batch 4, validated once on 3 batches of 32 (8x the training batch), after a sanity check."""
    cb, logger = MemoryTenantsCallback(print_summary=False, budget_bytes="64MiB"), RecordingLogger()
    trainer = make_trainer([cb], steps=2, logger=logger, num_sanity_val_steps=1)
    trainer.fit(Net(), loader(8, 4), loader(96, 32))
    return cb, logger


def test_the_validation_peak_is_exact_inside_a_fit(fitted) -> None:
    cb, _ = fitted
    report = cb.latest_validation
    assert report is not None and (report.stage, report.batch_index, report.step) == ("validate", 2, 2)
    assert report.tenants_bytes == {
        "weights": weights_bytes(256),
        "gradients": 0,  # Lightning freed them before validation
        "optimizer_state": adam_bytes(256),
        "activations": 0,  # no_grad: nothing saved
    }
    held = weights_bytes(256) + adam_bytes(256) + batch_bytes(32)
    assert report.phases["batch_start"].allocated_bytes == held
    assert report.peak_bytes == held + 2 * 32 * 256 * 4
    assert report.phases["batch_end"].allocated_bytes == held  # the step returned nothing: nothing outlives it
    assert report.peak_explanation.startswith("peak inside the validation step: 0.06 MiB of working memory")
    assert not any("sanity" in note for note in report.notes)  # the sanity check's batch was replaced
    assert cb.evaluation_peak("validate").peak_bytes == report.peak_bytes
    assert nothing_registered()


def test_the_validation_figures_are_logged_once_per_run_not_for_the_sanity_check(fitted) -> None:
    cb, logger = fitted
    rows = [metrics for _, metrics in logger.logged if any(k.startswith("memtenants/validation/") for k in metrics)]
    assert len(rows) == 1
    (row,) = rows
    peak = cb.latest_validation.peak_bytes
    assert row["memtenants/validation/peak_MiB"] == pytest.approx(peak / MiB)
    assert row["memtenants/validation/optimizer_state_MiB"] == pytest.approx(adam_bytes(256) / MiB)
    assert row["memtenants/validation/headroom_MiB"] == pytest.approx((64 * MiB - peak) / MiB)
    assert row["memtenants/validation/max_batch_size"] == cb.max_batch_size(stage="validate")


def test_the_largest_validation_batch_is_the_measured_line(fitted) -> None:
    cb, _ = fitted
    fixed = weights_bytes(256) + adam_bytes(256)
    per_sample = batch_bytes(1) + 2 * 256 * 4
    assert cb.max_batch_size(stage="validate") == (int(64 * MiB * 0.95) - fixed) // per_sample
    assert cb.max_batch_size("1GiB", stage="validate") == (int(2**30 * 0.95) - fixed) // per_sample
    assert cb.predict_peak_bytes(64, stage="validate") == fixed + 64 * per_sample


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda cb: cb.max_batch_size(stage="eval"), r"^stage must be one of \('train', 'validate', 'test'"),
        (lambda cb: cb.max_batch_size(stage="validate", exact=True), r"^exact=True answers for stage='train' only"),
        (lambda cb: cb.max_batch_size(elements_per_sample=8, stage="test"), r"^elements_per_sample is for stage="),
        (lambda cb: cb.predict_peak_bytes(8, stage=None), r"^stage must be one of"),
        (lambda cb: cb.evaluation_peak("train"), r"^stage must be one of \('validate', 'test', 'predict'\)"),
    ],
)
def test_a_bad_stage_is_one_clear_error(fitted, call, message) -> None:
    with pytest.raises(ValueError, match=message):
        call(fitted[0])


def test_validate_test_and_predict_alone_are_measured_and_printed() -> None:
    cb = MemoryTenantsCallback(budget_bytes="64MiB")
    trainer = make_trainer([cb])
    model = Net()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        trainer.validate(model, loader(64, 32), verbose=False)
        trainer.test(model, loader(16, 16), verbose=False)
        predictions = trainer.predict(model, loader(48, 16))
    held = weights_bytes(256) + batch_bytes(32)  # no optimizer outside a fit
    assert cb.latest_validation.tenants_bytes == {
        "weights": weights_bytes(256),
        "gradients": 0,
        "optimizer_state": 0,
        "activations": 0,
    }
    assert cb.latest_validation.peak_bytes == held + 2 * 32 * 256 * 4
    assert (cb.latest_test.stage, cb.latest_test.batch_index) == ("test", 0)
    assert cb.latest_test.peak_bytes == weights_bytes(256) + batch_bytes(16) + 2 * 16 * 256 * 4
    assert (cb.latest_predict.stage, cb.latest_predict.batch_index) == ("predict", 2)
    # trainer.predict keeps every batch's predictions: two earlier batches' (16 floats each) are alive at the third
    kept = 2 * 16 * 4
    start = cb.latest_predict.phases["batch_start"].allocated_bytes
    assert start == weights_bytes(256) + batch_bytes(16) + kept
    assert cb.latest_predict.phases["batch_end"].allocated_bytes == start + 16 * 4  # its own, returned
    assert len(predictions) == 3
    printed = out.getvalue()
    assert "memtenants: validation batch 0" in printed and "memtenants: test batch 0" in printed
    assert "memtenants: predict batch" in printed
    assert cb.max_batch_size(stage="validate") == (int(64 * MiB * 0.95) - weights_bytes(256)) // (
        batch_bytes(1) + 2 * 256 * 4
    )


def test_a_validation_step_with_grad_enabled_keeps_activations_and_the_leak_is_flagged() -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    trainer = make_trainer([cb], steps=1, inference_mode=False, num_sanity_val_steps=0, limit_val_batches=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Net(keep=True, grad=True), loader(4, 4), loader(5 * 256, 256))
    report = cb.latest_validation
    # the output's graph saved the ReLU's output (Linear 2's input, the same storage); x is the batch, not counted
    assert report.tenants_bytes["activations"] == 256 * 256 * 4
    assert any("ran with grad enabled" in note for note in report.notes)
    leaks = [str(w.message) for w in caught if "per validation batch" in str(w.message)]
    assert len(leaks) == 1
    # each batch keeps its graph: the batch's x and the ReLU's output
    per_batch = (256 * IN + 256 * 256) * 4
    assert f"grows by {per_batch / MiB:.2f} MiB per validation batch" in leaks[0]
    assert ".detach().cpu()" in leaks[0]


def test_the_warning_comes_before_a_validation_oom_and_the_postmortem_names_the_loop(tmp_path) -> None:
    # a simulated 12 MiB device: training at batch 32 fits, a validation batch 8x larger does not
    hidden, limit = 4096, 12 * MiB
    source = TrackerSource(scan=False, limit_bytes=limit)
    cb = MemoryTenantsCallback(memory_source=source, budget_bytes=limit, postmortem_dir=tmp_path, print_summary=False)
    trainer = make_trainer([cb], steps=1, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(torch.OutOfMemoryError) as failed:
        warnings.simplefilter("always")
        trainer.fit(Net(hidden=hidden), loader(32, 32), loader(256, 256))
    assert "simulated device" in str(failed.value)
    messages = [str(w.message) for w in caught]
    warned = next(i for i, m in enumerate(messages) if "validation batch 0 (256 samples) may not fit" in m)
    failed_at = next(i for i, m in enumerate(messages) if "out of memory in the validation loop (batch 0)" in m)
    assert warned < failed_at
    assert "from the training forward of step 0 (32 samples)" in messages[warned]
    record = json.loads((tmp_path / "memtenants_oom.json").read_text())
    assert (record["loop"], record["batch_index"], record["phase"]) == ("validation", 0, "validation_step")
    assert record["phase_description"] == "the validation step"
    assert record["tenants_at_failure_bytes"]["optimizer_state"] == adam_bytes(hidden)
    # the first layer's output (256 x 4096 floats) fits; the ReLU's, of the same size, is the allocation that fails
    # (made, then refused): beside the batch, both are "other" at the failure
    assert record["other_at_failure_bytes"] == batch_bytes(256) + 2 * 256 * hidden * 4
    assert record["fixes"][0]["action"].startswith("halve the validation batch size")
    assert "validation loop, batch 0, at step 1" in (tmp_path / "memtenants_oom.txt").read_text()
    assert nothing_registered()


class FailsInTheSanityCheck(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise torch.OutOfMemoryError("out of memory in the sanity check (injected)")


def test_an_oom_in_a_fit_s_sanity_check_leaves_its_postmortem_in_the_log_dir(tmp_path) -> None:
    """The sanity check runs before ``on_train_start``, which reads the log dir for training: the evaluation loop
    reads it too, so that the postmortem is where the fit's logs are, not in the working directory."""
    from lightning.pytorch.loggers import CSVLogger

    cb = MemoryTenantsCallback(print_summary=False)
    trainer = make_trainer([cb], steps=1, logger=CSVLogger(tmp_path), num_sanity_val_steps=1)
    with warnings.catch_warnings(), pytest.raises(torch.OutOfMemoryError):
        warnings.simplefilter("ignore")
        trainer.fit(FailsInTheSanityCheck(), loader(8, 4), loader(8, 4))
    record = json.loads((tmp_path / "lightning_logs" / "version_0" / "memtenants_oom.json").read_text())
    assert (record["loop"], record["batch_index"], record["step"]) == ("validation", 0, 0)
    assert nothing_registered()


def test_the_summary_sets_the_validation_loop_s_peak_batch_beside_training(capsys) -> None:
    """Validation on 80 samples in batches of 32 ends with a batch of 16: the headline and the side-by-side table
    show the peak of a batch of 32, not the last batch's."""
    cb = MemoryTenantsCallback(budget_bytes="64MiB")
    make_trainer([cb], steps=1, num_sanity_val_steps=0).fit(Net(), loader(4, 4), loader(80, 32))
    out = capsys.readouterr().out
    held = weights_bytes(256) + adam_bytes(256)
    last = cb.latest_validation
    assert last.batch_index == 2 and last.peak_bytes == held + batch_bytes(16) + 2 * 16 * 256 * 4
    peak = held + batch_bytes(32) + 2 * 32 * 256 * 4
    assert cb.evaluation_peak("validate").peak_bytes == peak
    assert f"| validation {peak / MiB:.2f} MiB (batch 0)" in out
    # a sample costs its x and y and two rows of 256 floats; the loop holds the weights and Adam's state
    largest = (int(64 * MiB * 0.95) - held) // (batch_bytes(1) + 2 * 256 * 4)
    assert cb.max_batch_size(stage="validate") == largest
    assert (
        f"- the largest validation batch is {largest:,} samples: its peak fits 64 MiB less a 5% margin (60.80 MiB);"
        " scaled from its measured batches (max_batch_size(stage='validate'))"
    ) in out


def test_where_validation_peaks_highest_the_headline_s_fix_is_validation_s(capsys) -> None:
    """Validation at 8x the training batch of 64 peaks above training: the fix named lowers that peak, by halving
    the validation batch (half of 2 x 512 x 256 floats of working memory), which saves more than dropping Adam's
    state (the other tenant the loop holds)."""
    cb = MemoryTenantsCallback()
    make_trainer([cb], steps=1, num_sanity_val_steps=0).fit(Net(), loader(64, 64), loader(512, 512))
    out = capsys.readouterr().out
    working = 2 * 512 * 256 * 4
    assert working // 2 > adam_bytes(256)
    peak = weights_bytes(256) + adam_bytes(256) + batch_bytes(512) + working
    assert cb.evaluation_peak("validate").peak_bytes == peak > (cb.latest.peak_bytes or 0)
    lines = out.split("\n\n")[0].splitlines()
    assert lines[1].endswith(f"| validation {peak / MiB:.2f} MiB (batch 0)")
    assert lines[3] == (
        "- to lower the peak most: for the validation peak, halve the validation batch size (the validation"
        f" DataLoader's batch_size) (saves about {working // 2 / MiB:.2f} MiB, an estimate)"
    )


def test_the_evaluation_monitor_measures_a_hand_written_loop_to_the_byte() -> None:
    """The core without Lightning: three batches of 32 under ``no_grad``, each made in the loop and dropped after."""
    from lightning_memtenants import EvaluationMonitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 256), nn.ReLU(), nn.Linear(256, IN))
    monitor = EvaluationMonitor(model, source=TrackerSource("cpu", scan=False), owns_source=True)
    reports, kept = [], []
    with torch.no_grad():
        for index in range(3):
            x, y = torch.randn(32, IN), torch.randn(32, IN)
            monitor.batch_start("validate", (x, y), index)
            loss = nn.functional.mse_loss(model(x), y)
            reports.append(monitor.batch_end(loss))
            kept.append(loss.untyped_storage().nbytes())
            del x, y, loss
    monitor.close()
    assert nothing_registered()
    start = weights_bytes(256) + batch_bytes(32)
    # ATen's mse_loss returns a 0-d view of its 32 x 64 buffer of squared errors: the loss holds that whole storage
    assert kept == [32 * IN * 4] * 3
    for index, report in enumerate(reports):
        assert (report.stage, report.batch_index, report.step) == ("validate", index, 0)
        assert report.tenants_bytes == {"weights": weights_bytes(256), "gradients": 0, "optimizer_state": 0,
                                        "activations": 0}  # fmt: skip
        assert report.phases["batch_start"].allocated_bytes == start
        assert report.peak_bytes == start + 2 * 32 * 256 * 4
        assert report.phases["batch_end"].allocated_bytes == start + 32 * IN * 4
    assert monitor.batch_end() is None  # no batch open


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "tracker"}, "source must be None or a MemorySource, got 'tracker'"),
        ({"guard": "once"}, "guard must be None or a Guard, got 'once'"),
        ({"device": "gpu0"}, "device must be None, a torch.device or a name like 'cuda:0', got 'gpu0'"),
    ],
)
def test_the_evaluation_monitor_refuses_bad_arguments_in_one_line(kwargs, message) -> None:
    from lightning_memtenants import EvaluationMonitor

    with pytest.raises(ValueError, match=message):
        EvaluationMonitor(nn.Linear(2, 2), **kwargs)
    monitor = EvaluationMonitor(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"stage must be one of \('validate', 'test', 'predict'\), got 'train'"):
        monitor.batch_start("train", torch.zeros(1, 2), 0)


class KeepsLogits(Net):
    """The common pattern: each validation batch's logits appended to a list, on the device, without a graph."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.kept.append(self.net(batch[0]))


def test_logits_kept_on_the_device_across_validation_batches_are_flagged() -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    trainer = make_trainer([cb], steps=1, num_sanity_val_steps=0, limit_val_batches=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(KeepsLogits(), loader(4, 4), loader(5 * 256, 256))
    report = cb.latest_validation
    assert report.tenants_bytes["activations"] == 0  # no graph: inference mode
    start, end = report.phases["batch_start"].allocated_bytes, report.phases["batch_end"].allocated_bytes
    assert end - start == 256 * IN * 4  # the batch's logits outlive its step
    leaks = [str(w.message) for w in caught if "per validation batch" in str(w.message)]
    assert len(leaks) == 1
    assert f"grows by {256 * IN * 4 / MiB:.2f} MiB per validation batch" in leaks[0]
    assert ".detach().cpu()" in leaks[0]

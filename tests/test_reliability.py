"""The callback never costs a training run: injected faults, user exceptions, entry points, resume."""

from __future__ import annotations

import dataclasses
import signal
import traceback
import warnings

import lightning as L
import pytest
import torch
from conftest import adam_that_fails, fail_in_backward, make_trainer, nothing_registered
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_memtenants.monitor as monitor_module
from lightning_memtenants import PHASES, MemoryTenantsCallback, TenantMonitor
from lightning_memtenants.core.census import TenantCounter
from lightning_memtenants.core.sources import TrackerSource


class Net(L.LightningModule):
    def __init__(self, fail: str | None = None, error: BaseException | None = None, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))  # 129 parameters
        self.fail, self.error = fail, error
        self.automatic_optimization = not manual
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if self.fail == "training_step":
            raise self.error
        loss = self.net(x).pow(2).mean()
        if self.fail == "backward":
            loss = fail_in_backward(loss, self.error)
        self.losses.append(loss.item())
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return None
        return loss

    def validation_step(self, batch, batch_idx):
        if self.fail == "validation_step":
            raise self.error
        return self.net(batch[0]).sum()

    def test_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        module = self
        return adam_that_fails(self.parameters(), lambda: module.fail == "optimizer_step", self.error)


def loader(n: int = 16) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 6, generator=torch.Generator().manual_seed(0))), batch_size=2)


@pytest.mark.parametrize("part", ["census", "memory source"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_fault_at_each_hook_disables_one_part_and_training_completes(monkeypatch, part, phase) -> None:
    current = {"phase": None}
    original_phase = TenantMonitor.phase

    def tracking_phase(self, name, *args, **kwargs):
        current["phase"] = name
        return original_phase(self, name, *args, **kwargs)

    def faulty(original):
        def run(*args, **kwargs):
            if current["phase"] == phase:
                raise RuntimeError(f"injected fault at {phase}")
            return original(*args, **kwargs)

        return run

    monkeypatch.setattr(monitor_module.TenantMonitor, "phase", tracking_phase)
    if part == "census":
        monkeypatch.setattr(TenantCounter, "count", faulty(TenantCounter.count))
    else:
        monkeypatch.setattr(TrackerSource, "read", faulty(TrackerSource.read))
    cb = MemoryTenantsCallback(print_summary=False)
    module = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], steps=4).fit(module, loader())
    ours = [str(w.message) for w in caught if "memtenants" in str(w.message)]
    assert len(module.losses) == 4  # training completed
    assert ours == [
        f"memtenants: measuring {part} failed (RuntimeError: injected fault at {phase}); {part} is disabled from now on"
    ]
    assert nothing_registered()
    if part == "memory source":  # the census goes on, exact, without the source
        assert cb.latest.step == 3 and cb.latest.peak_bytes is None
        assert cb.latest.tenants_bytes["weights"] == 129 * 4
        assert cb.latest.tenants_bytes["optimizer_state"] == 129 * 8 + 4 * 4


@pytest.mark.parametrize("part", ["census", "memory source"])
def test_a_fault_in_every_validation_run_warns_once_and_training_is_untouched(monkeypatch, part) -> None:
    """The fault strikes in the sanity check and in each of three validation runs: one warning for the fit, the
    part stays off in the later runs, and training measures its steps as before."""
    trainer = make_trainer([], steps=6, limit_val_batches=2, val_check_interval=2)
    current = {"trainer": trainer}

    def faulty(original):
        def run(*args, **kwargs):
            if current["trainer"].validating or current["trainer"].sanity_checking:
                raise RuntimeError("injected fault in validation")
            return original(*args, **kwargs)

        return run

    if part == "census":
        monkeypatch.setattr(TenantCounter, "count", faulty(TenantCounter.count))
    else:
        monkeypatch.setattr(TrackerSource, "read", faulty(TrackerSource.read))
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    trainer.callbacks.append(cb)
    module, plain = (torch.manual_seed(0) and Net()), (torch.manual_seed(0) and Net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(), loader())
    make_trainer([], steps=6, limit_val_batches=2, val_check_interval=2).fit(plain, loader(), loader())
    ours = [str(w.message) for w in caught if "memtenants" in str(w.message)]
    assert ours == [
        f"memtenants: measuring the evaluation {part} failed (RuntimeError: injected fault in validation); {part} is"
        " disabled from now on"
    ]
    assert module.losses == plain.losses and len(module.losses) == 6
    assert cb.latest.step == 5 and cb.latest.peak_bytes is not None  # training's own measurements go on
    if part == "census":
        assert cb.latest_validation is None
    else:  # the tenants go on, without a peak
        assert cb.latest_validation.peak_bytes is None and cb.latest_validation.tenants_bytes["weights"] == 129 * 4
    assert nothing_registered()
    # a validate of its own, on a source of its own: one warning again (a new entry point starts afresh), and the
    # source it started is stopped although it failed
    current["trainer"] = alone = make_trainer([cb], limit_val_batches=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alone.validate(module, loader())
    assert [str(w.message) for w in caught if "memtenants" in str(w.message)] == ours
    assert nothing_registered()


@pytest.mark.parametrize("where", ["training_step", "backward", "optimizer_step", "validation_step"])
@pytest.mark.parametrize(
    "make_error",
    [lambda: ValueError("user error"), lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")],
)
def test_user_exceptions_keep_their_identity_and_traceback(tmp_path, where, make_error) -> None:
    error = make_error()
    module = Net(where, error)
    cb = MemoryTenantsCallback(postmortem_dir=tmp_path, print_summary=False)
    with pytest.raises(type(error)) as caught:
        make_trainer([cb], steps=2).fit(module, loader(), loader())  # validation in the sanity check, first
    assert caught.value is error
    frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert {"optimizer_step": "step"}.get(where, where) in frames
    assert nothing_registered()
    assert (tmp_path / "memtenants_oom.json").exists() == isinstance(error, torch.OutOfMemoryError)


@pytest.mark.parametrize("where", ["training_step", "backward", "optimizer_step"])
def test_keyboard_interrupt(where) -> None:
    # Lightning turns Ctrl+C into a graceful shutdown and sys.exit(1); our hooks must be gone by then.
    module = Net(where, KeyboardInterrupt())
    try:
        with pytest.raises(SystemExit) as caught:
            make_trainer([MemoryTenantsCallback(print_summary=False)], steps=2).fit(module, loader())
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert caught.value.code == 1
    assert nothing_registered()


def test_keyboard_interrupt_passes_the_plain_core_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(3, 1)
    monitor = TenantMonitor(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    monitor.phase("batch_start")
    interrupt = KeyboardInterrupt()

    def interrupted(*_: object) -> None:
        raise interrupt

    monkeypatch.setattr(TenantCounter, "count", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:
        monitor.phase("batch_end")
    assert caught.value is interrupt
    assert monitor.measures("census")  # an interrupt is the user's, not a failure of ours
    monitor.close()
    assert nothing_registered()


def test_every_entry_point_and_reuse() -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    trainer = make_trainer([cb], steps=3, limit_val_batches=2, val_check_interval=2)
    trainer.fit(Net(), loader(), loader())
    assert cb.latest.step == 2
    trainer.validate(Net(), loader())
    trainer.test(Net(), loader())
    predictions = trainer.predict(Net(), loader())
    assert len(predictions) == 8
    make_trainer([cb], steps=3, fast_dev_run=True).fit(Net(), loader(), loader())
    assert cb.latest.step == 0  # fast_dev_run: one step, reported afresh
    make_trainer([cb], steps=2).fit(Net(manual=True), loader())
    assert cb.latest.step == 1
    assert nothing_registered()


def test_resume_keeps_the_forecast_and_raises_no_false_leak_warning(tmp_path) -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    trainer = make_trainer([cb], steps=8, default_root_dir=tmp_path)
    trainer.fit(Net(), loader())
    checkpoint = tmp_path / "resume.ckpt"
    trainer.save_checkpoint(checkpoint)
    resumed = MemoryTenantsCallback(print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([resumed], steps=20, default_root_dir=tmp_path).fit(Net(), loader(), ckpt_path=checkpoint)
    assert not [w for w in caught if "grows by" in str(w.message)]
    assert resumed.leaks.state_dict()["seen"] == cb.leaks.state_dict()["seen"] + 12
    assert resumed.forecast.sizes_seen == 1  # every batch holds 2 samples


CONFIGS = [
    (precision, accumulate, manual, optimizer)
    for precision in ("32-true", "bf16-mixed")
    for accumulate in (1, 2)
    for manual in (False, True)
    for optimizer in ("adam", "sgd")
    if not (manual and accumulate > 1)  # manual optimization does not accumulate through the Trainer
]


@pytest.mark.parametrize(("precision", "accumulate", "manual", "optimizer"), CONFIGS)
def test_losses_are_bitwise_identical_across_configurations(precision, accumulate, manual, optimizer) -> None:
    class Configured(Net):
        def configure_optimizers(self):
            if optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return torch.optim.Adam(self.parameters())

    def losses(callbacks: list[L.Callback]) -> list[float]:
        L.seed_everything(0, verbose=False)
        module = Configured(manual=manual)
        make_trainer(callbacks, steps=3, precision=precision, accumulate_grad_batches=accumulate).fit(module, loader())
        return module.losses

    with_callback = losses([MemoryTenantsCallback(track_every_step=True, print_summary=False)])
    assert len(with_callback) == 3 * accumulate  # 3 optimizer steps of `accumulate` batches each
    assert with_callback == losses([])


class SparseNet(L.LightningModule):
    """Embedding(100, 8, sparse=True) under SparseAdam: sparse COO gradients have no single storage."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 8, sparse=True)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.emb(batch[0]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SparseAdam(self.parameters())


def test_sparse_gradients_are_counted_by_their_indices_and_values() -> None:
    data = TensorDataset(torch.randint(0, 100, (12, 3), generator=torch.Generator().manual_seed(0)))
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="memtenants.*")
        model = SparseNet()
        make_trainer([cb], steps=3).fit(model, DataLoader(data, batch_size=4))
    plain = SparseNet()
    make_trainer([], steps=3).fit(plain, DataLoader(data, batch_size=4))
    assert model.losses == plain.losses
    # a batch of 4 x 3 indices: the gradient keeps (1, 12) int64 indices and (12, 8) fp32 values
    assert cb.latest.phases["after_backward"].tenants_bytes["gradients"] == 12 * 8 + 12 * 8 * 4
    assert cb.latest.tenants_bytes["optimizer_state"] == 2 * 100 * 8 * 4  # SparseAdam's dense moments
    assert cb.latest.peak_bytes is not None
    assert nothing_registered()


def test_a_tracker_failure_inside_backward_costs_one_warning_not_the_run(monkeypatch) -> None:
    from lightning_memtenants.core.tracker import LiveTensorTracker

    seen = LiveTensorTracker.seen  # what each operator's outputs go through on a real CPU run
    calls = {"n": 0}

    def failing_seen(self, storage):
        calls["n"] += 1
        if calls["n"] == 100:  # somewhere inside a step, after the first (a step makes about 70 storages)
            raise ZeroDivisionError("injected inside an operator")
        return seen(self, storage)

    monkeypatch.setattr(LiveTensorTracker, "seen", failing_seen)
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    torch.manual_seed(0)
    module = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], steps=4).fit(module, loader())
    torch.manual_seed(0)
    plain = Net()
    make_trainer([], steps=4).fit(plain, loader())
    ours = [str(w.message) for w in caught if "memtenants" in str(w.message)]
    assert calls["n"] == 100  # the source is disabled at the failure and never called again
    assert module.losses == plain.losses
    assert len(ours) == 1 and "memory source is disabled from now on" in ours[0]
    assert "injected inside an operator" in ours[0]
    assert cb.latest.step == 3 and cb.latest.tenants_bytes["weights"] == 129 * 4
    assert nothing_registered()


@pytest.mark.parametrize("path", ["seen", "add"])  # a real CPU run's short path; a dry run's (fake tensors)
def test_a_tracker_failure_inside_an_operator_never_reaches_the_operator(monkeypatch, path: str) -> None:
    source = TrackerSource(scan=False)
    source.start()
    if path == "add":
        source.tracker.plain = False  # as under a rewrite, a recorder, a limit or an allocator model
    monkeypatch.setattr(type(source.tracker), path, lambda self, value: 1 / 0)
    try:
        y = torch.ones(3) * 2
    finally:
        source.pause()
    assert y.tolist() == [2.0, 2.0, 2.0]
    assert isinstance(source.tracker.error, ZeroDivisionError)
    with pytest.raises(RuntimeError, match="the tracker failed inside an operator"):
        source.read()  # the monitor's guard turns this into one warning and disables the source


# ------------------------------------------------------------------------------------------------------------------
# Real programs, item by item: reuse, optimizers Lightning never sees, skipped batches, two instances, any batch,
# global step numbers, modules without parameters, the CUDA peak counter.


def big_loader(n: int = 64, batch_size: int = 8) -> DataLoader:
    return DataLoader(
        TensorDataset(torch.randn(n, 6, generator=torch.Generator().manual_seed(2))), batch_size=batch_size
    )


def test_one_callback_across_two_trainers_starts_each_fit_afresh() -> None:
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    make_trainer([cb], steps=8).fit(Net(), big_loader(batch_size=8))
    assert cb.forecast.largest_elements == 8 * 6 and cb.leaks.state_dict()["seen"] == 8
    make_trainer([cb], steps=3).fit(Net(), loader())
    # the second fit's forecast knows only its own batches of 2, and its leak baseline only its own 3 steps
    assert cb.forecast.largest_elements == 2 * 6 and cb.forecast.sizes_seen == 1
    assert cb.leaks.state_dict()["seen"] == 3


class RawOptimizer(Net):
    """Manual optimization whose optimizer Lightning never wraps: ``self.optimizers(use_pl_optimizer=False)``."""

    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers(use_pl_optimizer=False)
        loss = self.net(batch[0]).pow(2).mean()
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()


class HiddenOptimizer(Net):
    """Manual optimization with an optimizer of its own; ``configure_optimizers`` gives Lightning none."""

    def __init__(self) -> None:
        super().__init__(manual=True)
        self.hidden = torch.optim.SGD(self.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).pow(2).mean()
        self.manual_backward(loss)
        self.hidden.step()
        self.hidden.zero_grad()

    def configure_optimizers(self):
        return None


@pytest.mark.parametrize("module", [RawOptimizer, HiddenOptimizer])
def test_a_step_ends_at_batch_end_when_lightning_sees_no_optimizer_step(monkeypatch, module) -> None:
    starts = []
    start = TrackerSource.start
    monkeypatch.setattr(TrackerSource, "start", lambda self, roots=(): starts.append(1) or start(self, roots))
    cb = MemoryTenantsCallback(print_summary=False, log_every_n_steps=5)
    reports = []

    class Collect(L.Callback):
        def on_train_batch_end(self, *args) -> None:
            reports.append(cb.latest)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # configure_optimizers returned None
        # Lightning counts no global step here, so max_steps never ends the fit: 2 epochs of 12 batches do
        make_trainer([cb, Collect()], steps=-1, max_epochs=2).fit(module(), big_loader(n=48, batch_size=4))
    assert [r.step for r in reports] == list(range(24))
    assert all(len(r.micro_batches) == 1 for r in reports)
    assert len(starts) == 5  # the tracker ran on the logging steps only
    assert [r.step for r in reports if r.peak_bytes is not None] == [0, 4, 9, 14, 19]  # (b + 1) % 5 == 0
    last = reports[-1]
    assert last.tenants_bytes["weights"] == last.tenants_bytes["gradients"] == 129 * 4
    assert last.phases["batch_end"].tenants_bytes["gradients"] == 0  # the step zeroes them itself
    # Adam's state is counted where Lightning knows the optimizer; SGD without momentum keeps none
    assert last.tenants_bytes["optimizer_state"] == (129 * 8 + 4 * 4 if module is RawOptimizer else 0)
    assert nothing_registered()


class SkipsABatch(Net):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if self.current_epoch == 0 and batch_idx == 1 else None


def test_a_batch_skipped_by_on_train_batch_start_leaves_no_mode_behind() -> None:
    seen = []

    class Watch(L.Callback):
        def on_train_epoch_start(self, *args) -> None:
            seen.append(_current_mode())

        def on_validation_start(self, *args) -> None:
            seen.append(_current_mode())

    from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    trainer = make_trainer([cb, Watch()], steps=10, max_epochs=2, limit_val_batches=1)
    trainer.fit(SkipsABatch(), loader(), loader())
    # the sanity check, two epoch starts, and epoch 1's validation (the skip ends epoch 0 before its validation)
    assert seen == [None] * 4
    # epoch 0 stepped once before the skip; every report holds one batch, none holds the skipped one
    assert trainer.global_step == 1 + 8
    assert len(cb.latest.micro_batches) == 1 and cb.latest.step == 8
    assert nothing_registered()


def test_two_differently_set_up_instances_share_a_trainer_and_its_checkpoints(tmp_path) -> None:
    every, default = (
        MemoryTenantsCallback(print_summary=False, track_every_step=True),
        MemoryTenantsCallback(print_summary=False),
    )
    assert every.state_key != default.state_key
    trainer = make_trainer([every, default], steps=4, log_every_n_steps=3, default_root_dir=tmp_path)
    trainer.fit(Net(), loader())
    assert every.latest.step == default.latest.step == 3
    assert every.latest.peak_bytes is not None and default.latest.peak_bytes is None  # step 3 is not logged
    assert every.latest.tenants_bytes == default.latest.tenants_bytes
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    states = torch.load(tmp_path / "two.ckpt", weights_only=False)["callbacks"]
    assert {every.state_key, default.state_key} <= set(states)
    assert states[every.state_key]["leaks"]["seen"] == 4 and states[default.state_key]["leaks"]["seen"] == 2


@dataclasses.dataclass
class Tagged:
    x: torch.Tensor
    source: str


class Opaque:
    """A batch type of the user's own that holds its tensor in an attribute."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class AnyBatch(Net):
    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):  # no tensor at all: the step makes its own
            x = torch.randn(2, 6, generator=torch.Generator().manual_seed(batch_idx))
        else:
            x = batch.x
        return self.net(x).pow(2).mean()


@pytest.mark.parametrize(
    "make",
    [lambda x: Tagged(x, "train"), Opaque, lambda x: {"text": ["a", "b"]}],
    ids=["dataclass", "object", "no-tensor"],
)
def test_any_valid_batch_trains_without_a_warning(make) -> None:
    data = [make(torch.randn(2, 6, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True, budget_bytes="1GiB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], steps=4).fit(AnyBatch(), DataLoader(data, batch_size=None))
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "memtenants" in m or "batch_size" in m or "batch size" in m], messages
    assert cb.latest.step == 3 and cb.latest.peak_bytes is not None
    sized = isinstance(data[0], Tagged)
    assert cb.forecast.ready is sized  # a batch we cannot size gives the forecast no data point, and no warning
    if sized:
        assert cb.forecast.largest_elements == 12


def test_step_numbers_are_the_trainer_s_global_step_after_a_resume(tmp_path) -> None:
    first = MemoryTenantsCallback(print_summary=False)
    trainer = make_trainer([first], steps=15, max_epochs=-1, default_root_dir=tmp_path)
    trainer.fit(Net(), loader())
    trainer.save_checkpoint(tmp_path / "at15.ckpt")
    resumed = MemoryTenantsCallback(print_summary=False)
    make_trainer([resumed], steps=30, max_epochs=-1, default_root_dir=tmp_path).fit(
        Net(), loader(), ckpt_path=tmp_path / "at15.ckpt"
    )
    assert first.latest.step == 14
    assert resumed.first.step == 15 and resumed.latest.step == 29


class NoParameters(L.LightningModule):
    """A module without parameters: its step makes the tensor it trains."""

    def training_step(self, batch, batch_idx):
        weight = torch.ones(6, 1, requires_grad=True)
        return (batch[0] @ weight).pow(2).mean()

    def configure_optimizers(self):
        return None


def test_a_module_without_parameters_gets_the_tracker_on_cpu() -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([cb], steps=2).fit(NoParameters(), loader())
    assert cb.latest.memory_source == "live-tensor tracker (cpu)"
    assert cb.latest.peak_bytes is not None and cb.latest.tenants_bytes["weights"] == 0

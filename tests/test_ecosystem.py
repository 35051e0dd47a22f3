"""The callback among Lightning's neighbours: the ``pytorch_lightning`` package, LightningCLI, the progress bars."""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as lp
import pytest
import pytorch_lightning as ptl
import torch
from conftest import recording_logger_class
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_memtenants
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.lightning.logs import is_tensorboard_logger
from lightning_memtenants.pl import MemoryTenantsCallback as PlMemoryTenantsCallback
from lightning_memtenants.units import MiB

ROOT = Path(__file__).resolve().parents[1]

MemoryTenantsCallback = lightning_memtenants.MemoryTenantsCallback
GiB = 2**30
PACKAGES = {"lightning.pytorch": lp, "pytorch_lightning": ptl}
CALLBACKS = {"lightning.pytorch": MemoryTenantsCallback, "pytorch_lightning": PlMemoryTenantsCallback}
# Linear 32 -> 64 -> 8: P = 32 * 64 + 64 + 64 * 8 + 8 = 2,632 fp32 parameters in 4 tensors
P, TENSORS = 2_632, 4


def module_class(package: ModuleType) -> type:
    """The same tiny LightningModule, subclassing ``package``'s LightningModule."""

    class Tiny(package.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self, width: int = 64) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 8))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters())

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g))
            return DataLoader(data, batch_size=4)

    return Tiny


def recording_logger(package: ModuleType) -> Any:
    """A logger of ``package``'s that keeps every logged metric."""
    return recording_logger_class(package.loggers.Logger)()


def fit(package_name: str, tmp_path: Path, callbacks: list[Any] = (), **options: Any) -> tuple[Any, Any, Any]:  # type: ignore[assignment]
    """Two optimizer steps of the tiny model under ``package_name``'s Trainer, with its callback (1 GiB budget)."""
    package = PACKAGES[package_name]
    torch.manual_seed(0)
    model = module_class(package)()
    cb = CALLBACKS[package_name](budget_bytes="1GiB", memory_source="tracker")
    recording = recording_logger(package)
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": 2,
        "log_every_n_steps": 1,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": False,
        "logger": [package.loggers.TensorBoardLogger(tmp_path / package_name), recording],
        "default_root_dir": tmp_path,
    }
    settings.update(options)
    trainer = package.Trainer(callbacks=[cb, *callbacks], **settings)
    trainer.fit(model)
    return cb, trainer, recording


# -- pytorch_lightning -----------------------------------------------------------------------------------------------


def test_the_pl_callback_is_a_callback_of_both_packages_with_the_same_arguments() -> None:
    cb = PlMemoryTenantsCallback(budget_bytes="24GiB", margin=0.1)
    assert isinstance(cb, ptl.Callback) and isinstance(cb, lp.Callback) and isinstance(cb, MemoryTenantsCallback)
    assert cb.budget_bytes == 24 * GiB and cb.margin == 0.1
    # the same configuration keeps the same state key, so checkpoints move between the two packages
    assert cb.state_key == MemoryTenantsCallback(budget_bytes="24GiB", margin=0.1).state_key
    assert "from pytorch_lightning import Trainer" in (PlMemoryTenantsCallback.__doc__ or "")
    # what pytorch_lightning refuses from lightning.pytorch's callback: a lone callback, and the CLI's class paths
    with pytest.raises(TypeError, match="not iterable"):
        ptl.Trainer(callbacks=MemoryTenantsCallback(), logger=False, enable_progress_bar=False)
    trainer = ptl.Trainer(callbacks=cb, logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert trainer.callbacks[0] is cb


def outcome(package_name: str, tmp_path: Path) -> dict[str, Any]:
    """What a fit under ``package_name`` reported, logged and wrote; its Trainer and model are gone on return.

    The live-tensor tracker counts every tensor the process holds, as the CUDA allocator would, so the second fit
    measures the same peak only where the first let its model go.
    """
    cb, trainer, recording = fit(package_name, tmp_path)
    board = trainer.loggers[0]
    log_dir = Path(board.log_dir)
    done = {
        "first": cb.first,
        "latest": cb.latest,
        "run_peak_bytes": cb.run_peak_bytes,
        "logged": recording.logged,
        "bar": dict(trainer.progress_bar_metrics),
        "trainer_is": (isinstance(trainer, ptl.Trainer), isinstance(trainer, lp.Trainer)),
        "board_is": (is_tensorboard_logger(board), isinstance(board, lp.loggers.TensorBoardLogger)),
        "desk_bytes": (log_dir / "memtenants_desk.png").stat().st_size,
        "summary": (log_dir / "memtenants_summary.md").read_text(),
    }
    del cb, trainer, recording, board
    gc.collect()
    return done


@pytest.mark.slow
def test_a_pytorch_lightning_fit_reports_and_logs_what_a_lightning_fit_does(tmp_path: Path) -> None:
    ours, theirs = (in_a_fresh_process(name, tmp_path / name) for name in ("lightning.pytorch", "pytorch_lightning"))
    assert theirs["trainer_is"] == (True, False) and ours["trainer_is"] == (False, True)
    for key in ("first", "latest"):
        a, b = ours[key], theirs[key]
        assert a is not None and b is not None
        assert b.step == a.step
        assert b.tenants_bytes == a.tenants_bytes
        assert b.peak_bytes == a.peak_bytes and b.peak_bytes is not None and b.peak_bytes > b.tenant_sum_bytes
        assert b.peak_phase == a.peak_phase
        assert b.expected_fixed_bytes == a.expected_fixed_bytes == b.measured_fixed_bytes
        assert {k: p.tenants_bytes for k, p in b.phases.items()} == {k: p.tenants_bytes for k, p in a.phases.items()}
    assert [ours["first"].step, ours["latest"].step] == [0, 1]
    latest = theirs["latest"]
    # fp32 Adam: 16 bytes a parameter, and a 4-byte step per parameter tensor
    assert latest.tenants_bytes["weights"] == latest.tenants_bytes["gradients"] == 4 * P
    assert latest.tenants_bytes["optimizer_state"] == 8 * P + 4 * TENSORS
    assert latest.expected_fixed_bytes == 16 * P + 4 * TENSORS
    assert theirs["run_peak_bytes"] == ours["run_peak_bytes"] == latest.peak_bytes
    # the same tags and values, to the byte, on the same steps
    assert [step for step, _ in theirs["logged"]] == [step for step, _ in ours["logged"]] == [0, 1]
    assert theirs["logged"] == ours["logged"]
    last = theirs["logged"][-1][1]
    assert {"memtenants/weights_MiB", "memtenants/headroom_MiB", "memtenants/max_batch_size"} <= set(last)
    assert last["memtenants/weights_MiB"] == 4 * P / MiB
    assert last["memtenants/headroom_MiB"] == (GiB - latest.peak_bytes) / MiB
    # the bar holds what Lightning logged: a float32 tensor's value
    # the bar gets the headroom as a Python float, not a logged tensor: no operator a user's mode would see
    assert theirs["bar"] == ours["bar"] == {"headroom_MiB": last["memtenants/headroom_MiB"]}
    # pytorch_lightning's TensorBoardLogger is one, and gets the summary and the desk picture at the end of fit
    assert theirs["board_is"] == (True, False)
    assert theirs["desk_bytes"] > 0
    assert theirs["summary"] == ours["summary"] and f"{16 * P + 4 * TENSORS:,}" in theirs["summary"]


def in_a_fresh_process(package_name: str, directory: Path) -> dict[str, Any]:
    """:func:`outcome` in a fresh process (``tests/ecosystem_check.py``), its reports rebuilt from their JSON."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "examples")]),
    }
    script = ROOT / "tests" / "ecosystem_check.py"
    done = subprocess.run(
        [sys.executable, str(script), package_name, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("first", "latest"):
        result[key] = StepReport.from_dict(result[key])
    result["logged"] = [(step, values) for step, values in result["logged"]]
    result["trainer_is"], result["board_is"] = tuple(result["trainer_is"]), tuple(result["board_is"])
    return result


def test_the_recording_logger_is_no_tensorboard_logger() -> None:
    assert not is_tensorboard_logger(recording_logger(ptl))
    assert not is_tensorboard_logger(recording_logger(lp))
    assert is_tensorboard_logger(lp.loggers.TensorBoardLogger("unused"))


def test_the_package_imports_without_pytorch_lightning_and_the_pl_module_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)  # what ``import`` does where it is not installed
    monkeypatch.delitem(sys.modules, "lightning_memtenants.pl")
    with pytest.raises(ImportError, match=r"needs the pytorch-lightning package \(pip install pytorch-lightning\)"):
        importlib.import_module("lightning_memtenants.pl")


@pytest.mark.slow
def test_a_fresh_process_without_pytorch_lightning_imports_the_package_and_its_callback() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["pytorch_lightning"] = None  # not installed
        import lightning_memtenants
        cb = lightning_memtenants.MemoryTenantsCallback(budget_bytes="24GiB")
        assert cb.budget_bytes == 24 * 2**30
        assert not [m for m in sys.modules if m.startswith("pytorch_lightning.")]
        try:
            import lightning_memtenants.pl
        except ImportError as error:
            print("refused:", error)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: lightning_memtenants.pl is the callback for pytorch_lightning.Trainer")


# -- LightningCLI ----------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_command_line_of_pytests(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns where ``args`` and a command line are both given: the tests give ``args`` only."""
    monkeypatch.setattr(sys, "argv", ["test_ecosystem"])


CLI_TRAINER = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_progress_bar=false"]


def ours_in(trainer: Any, cls: type = MemoryTenantsCallback) -> Any:
    found = [c for c in trainer.callbacks if isinstance(c, cls)]
    assert len(found) == 1, trainer.callbacks
    return found[0]


def test_lightning_cli_takes_the_callback_and_a_budget_with_a_unit_on_the_command_line(tmp_path: Path) -> None:
    args = [
        "fit",
        "--trainer.callbacks+=lightning_memtenants.MemoryTenantsCallback",
        "--trainer.callbacks.budget_bytes=24GiB",
        "--trainer.callbacks.print_summary=false",
        "--trainer.max_steps=1",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tmp_path}",
        *CLI_TRAINER,
    ]
    cli = LightningCLI(module_class(lp), args=args, save_config_callback=None)
    cb = ours_in(cli.trainer)
    assert cb.budget_bytes == 24 * 2**30 and isinstance(cb.budget_bytes, int)
    assert cb.print_summary is False and cb.margin == 0.05
    assert cli.trainer.global_step == 1
    assert cb.latest is not None and cb.latest.tenants_bytes["weights"] == 4 * P
    assert cb.budget == 24 * 2**30
    headroom = (24 * GiB - cb.latest.peak_bytes) / MiB
    assert cli.trainer.progress_bar_metrics["headroom_MiB"] == headroom


def test_lightning_cli_takes_the_callback_from_a_yaml_config(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            trainer:
              callbacks:
                - class_path: lightning_memtenants.MemoryTenantsCallback
                  init_args:
                    budget_bytes: 24GiB
                    margin: 0.1
                    memory_source: tracker
                    postmortem_dir: {tmp_path / "oom"}
            """
        )
    )
    cli = LightningCLI(module_class(lp), args=["--config", str(config), *CLI_TRAINER], run=False)
    cb = ours_in(cli.trainer)
    assert cb.budget_bytes == 24 * 2**30
    assert cb.margin == 0.1 and cb.memory_source == "tracker" and str(cb.postmortem_dir) == str(tmp_path / "oom")
    # a plain byte count stays an int
    args = ["--trainer.callbacks+=lightning_memtenants.MemoryTenantsCallback", "--trainer.callbacks.budget_bytes=1000"]
    cli = LightningCLI(module_class(lp), args=[*args, *CLI_TRAINER], run=False)
    assert ours_in(cli.trainer).budget_bytes == 1000


def test_lightning_cli_refuses_a_budget_without_a_known_unit() -> None:
    # jsonargparse takes any string for ``int | str``; the callback's own check names the argument and the units
    args = ["--trainer.callbacks+=lightning_memtenants.MemoryTenantsCallback", "--trainer.callbacks.budget_bytes=24XB"]
    with pytest.raises(
        ValueError, match=r"budget_bytes must be a number with an optional unit \(B, .*GiB.*\), got '24XB'"
    ):
        LightningCLI(module_class(lp), args=[*args, *CLI_TRAINER], run=False)


def test_pytorch_lightnings_cli_takes_the_pl_callback_and_refuses_lightnings() -> None:
    from pytorch_lightning.cli import LightningCLI as PlLightningCLI

    args = [
        "--trainer.callbacks+=lightning_memtenants.pl.MemoryTenantsCallback",
        "--trainer.callbacks.budget_bytes=24GiB",
    ]
    cli = PlLightningCLI(module_class(ptl), args=[*args, *CLI_TRAINER], run=False)
    assert ours_in(cli.trainer, PlMemoryTenantsCallback).budget_bytes == 24 * 2**30
    with pytest.raises(SystemExit):
        PlLightningCLI(module_class(ptl), args=[args[0].replace(".pl.", "."), *CLI_TRAINER], run=False)


# -- the progress bars -----------------------------------------------------------------------------------------------


class BarProbe:
    """Reads what the progress bar shows, after the bar's own ``on_train_batch_end`` (it runs after the bar)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.shown: list[Any] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        bar = self.bar
        if type(bar).__name__ == "RichProgressBar":  # the metrics column
            self.shown.append(dict(bar._metric_component._metrics))
        else:  # TQDM: the postfix as printed
            self.shown.append(bar.train_progress_bar.postfix)


def probe(package: ModuleType, bar: Any) -> Any:
    return type("Probe", (BarProbe, package.Callback), {})(bar)


@pytest.mark.parametrize("package_name", list(PACKAGES))
@pytest.mark.parametrize("bar_name", ["TQDMProgressBar", "RichProgressBar"])
def test_the_headroom_shows_in_the_progress_bar_not_in_the_loggers(
    package_name: str, bar_name: str, tmp_path: Path
) -> None:
    package = PACKAGES[package_name]
    bar = getattr(package.callbacks, bar_name)()
    seen = probe(package, bar)
    cb, trainer, recording = fit(package_name, tmp_path, [bar, seen], enable_progress_bar=True)
    assert cb.latest is not None and cb.latest.peak_bytes is not None
    headroom = (GiB - cb.latest.peak_bytes) / MiB
    assert 0 < headroom < GiB / MiB  # the peak counts every tensor of the process (a test worker holds others)
    assert trainer.progress_bar_metrics == {"headroom_MiB": headroom}
    assert bar.get_metrics(trainer, trainer.lightning_module)["headroom_MiB"] == headroom
    assert len(seen.shown) == 2
    if bar_name == "TQDMProgressBar":
        from tqdm import tqdm  # the bar prints the value as tqdm formats a number (the process's tensors move it)

        assert all(f"headroom_MiB={tqdm.format_num(headroom)}" in postfix for postfix in seen.shown), seen.shown
    else:
        assert seen.shown[-1]["headroom_MiB"] == headroom
    # the loggers get the headroom once, under the package's tag, not the bar's name
    logged = {tag for _, metrics in recording.logged for tag in metrics}
    assert "headroom_MiB" not in logged and "memtenants/headroom_MiB" in logged


def test_without_a_budget_on_cpu_the_bar_shows_no_headroom(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cb = MemoryTenantsCallback(memory_source="tracker", print_summary=False)
    bar = lp.callbacks.TQDMProgressBar()
    seen = probe(lp, bar)
    trainer = lp.Trainer(
        accelerator="cpu",
        max_steps=2,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[cb, bar, seen],
        default_root_dir=tmp_path,
    )
    trainer.fit(module_class(lp)())
    assert cb.budget is None and cb.latest is not None and cb.latest.peak_bytes is not None
    assert trainer.progress_bar_metrics == {}
    assert all("headroom" not in str(postfix) for postfix in seen.shown) and len(seen.shown) == 2

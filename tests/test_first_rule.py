"""The first rule, in real fits: measuring never changes the user's program.

Each fit (with its validation loop, whose batches are measured too) runs twice, the same seeded program, without
the callback and with it, every option on at once (a
budget tight enough to warn, ``measure_fixes``, every step tracked, a TensorBoard logger logging every step,
gradient accumulation). What the user's program sees must be the same: how often Lightning calls its code, the
operators its own dispatch and function modes see, what it keeps (no fake tensor), the random generators' states
after fit, and the process's memory beside a module that holds a large non-tensor attribute.
"""

from __future__ import annotations

import gc
import random
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import psutil
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback
from lightning_memtenants._private import FakeTensor

pytestmark = pytest.mark.slow

STEPS = 4
MiB = 2**20


class Dispatched(TorchDispatchMode):
    """The user's own dispatch mode: it counts every operator by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class Functions(TorchFunctionMode):
    """The user's own function mode: it counts every torch function and tensor method called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)] += 1
        return func(*args, **(kwargs or {}))


class Counted(L.LightningModule):
    """A user's module with side effects in every hook Lightning calls: counters, a list of losses, a log file."""

    def __init__(self, log_file: Path, table_bytes: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
        self.example_input_array = torch.zeros(2, 16)  # a plain tensor attribute, as Lightning's own
        self.table = np.ones(table_bytes // 4, dtype=np.float32) if table_bytes else None  # not a tensor
        self.calls: Counter[str] = Counter()
        self.losses: list[torch.Tensor] = []
        self.log_file = log_file

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["forward"] += 1
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls["training_step"] += 1
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.detach())
        with self.log_file.open("a") as file:
            file.write(f"step {batch_idx} x {tuple(x.shape)}\n")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.calls["validation_step"] += 1
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.calls["configure_optimizers"] += 1
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.calls["on_train_batch_start"] += 1

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.calls["on_before_backward"] += 1

    def on_after_backward(self) -> None:
        self.calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.calls["on_before_optimizer_step"] += 1

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls["on_train_batch_end"] += 1


def fit(tmp_path: Path, name: str, callback: MemoryTenantsCallback | None, table_bytes: int = 0) -> dict[str, Any]:
    """One seeded fit inside the user's modes; what the user's program saw and kept."""
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    model = Counted(tmp_path / f"{name}.log", table_bytes)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        callbacks=[callback] if callback is not None else [],
        logger=TensorBoardLogger(tmp_path, name=name),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dispatched, functions = Dispatched(), Functions()
    rss = psutil.Process().memory_info().rss
    with warnings.catch_warnings(record=True) as caught, functions, dispatched:
        warnings.simplefilter("always")
        validation = DataLoader(TensorDataset(*data[:48]), batch_size=16)
        trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), validation)
    grown = psutil.Process().memory_info().rss - rss
    return {
        "calls": dict(model.calls),
        "ops": dispatched.ops,
        "functions": functions.calls,
        "losses": model.losses,
        "log": (tmp_path / f"{name}.log").read_text(),
        "random": (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()),
        "rss_grown": grown,
        "warnings": [str(w.message) for w in caught],
        "model": model,
        "callback": callback,
    }


def everything_on(**kwargs: Any) -> MemoryTenantsCallback:
    options: dict[str, Any] = {
        "budget_bytes": 20_000,  # below the peak (about 25 KB): the budget's warnings fire
        "measure_fixes": True,
        "track_every_step": True,
        "print_summary": False,
    }
    options.update(kwargs)
    return MemoryTenantsCallback(**options)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp_path = tmp_path_factory.mktemp("first_rule")
    return {
        "without": fit(tmp_path, "without", None),
        "default": fit(tmp_path, "default", MemoryTenantsCallback(print_summary=False)),
        "everything": fit(tmp_path, "everything", everything_on()),
    }


@pytest.mark.parametrize("arm", ["default", "everything"])
def test_lightning_calls_the_users_code_as_often_as_without_the_callback(runs: dict[str, Any], arm: str) -> None:
    without, with_ = runs["without"], runs[arm]
    # 4 optimizer steps of 2 micro-batches each: 8 batches, 4 optimizer steps, one configure_optimizers; the
    # sanity check's 2 validation batches and the epoch's 3
    assert without["calls"] == {
        "configure_optimizers": 1,
        "validation_step": 5,
        "on_train_batch_start": 8,
        "training_step": 8,
        "forward": 13,
        "on_before_backward": 8,
        "on_after_backward": 8,
        "on_before_optimizer_step": 4,
        "on_train_batch_end": 8,
    }
    assert with_["calls"] == without["calls"]
    assert with_["log"] == without["log"]  # the user's own log file: the same 8 lines, the real batch shapes


@pytest.mark.parametrize("arm", ["default", "everything"])
def test_the_users_modes_see_exactly_the_operators_they_see_without_the_callback(
    runs: dict[str, Any], arm: str
) -> None:
    without, with_ = runs["without"], runs[arm]
    assert sum(without["ops"].values()) > 300  # the modes did see the training
    assert with_["ops"] == without["ops"], (with_["ops"] - without["ops"], without["ops"] - with_["ops"])
    assert with_["functions"] == without["functions"], (
        with_["functions"] - without["functions"],
        without["functions"] - with_["functions"],
    )


@pytest.mark.parametrize("arm", ["default", "everything"])
def test_no_fake_tensor_reaches_the_users_objects(runs: dict[str, Any], arm: str) -> None:
    with_ = runs[arm]
    assert len(with_["losses"]) == 8
    assert not any(isinstance(loss, FakeTensor) for loss in with_["losses"])
    assert [float(loss) for loss in with_["losses"]] == [float(loss) for loss in runs["without"]["losses"]]
    model = with_["model"]
    assert not any(isinstance(t, FakeTensor) for t in (*model.parameters(), model.example_input_array))


@pytest.mark.parametrize("arm", ["default", "everything"])
def test_the_random_generators_are_where_the_program_left_them(runs: dict[str, Any], arm: str) -> None:
    without, with_ = runs["without"], runs[arm]
    assert with_["random"][0] == without["random"][0]  # Python's random
    assert with_["random"][1] == without["random"][1]  # numpy's global generator
    assert torch.equal(with_["random"][2], without["random"][2])  # torch's CPU generator


def test_the_budgets_warnings_fired_in_the_fit_with_everything_on(runs: dict[str, Any]) -> None:
    warned = [w for w in runs["everything"]["warnings"] if w.startswith("memtenants:")]
    assert any("projected peak" in w for w in warned), warned
    assert not [w for w in runs["without"]["warnings"] if w.startswith("memtenants:")]


def test_a_module_holding_a_large_non_tensor_attribute_costs_no_copy(tmp_path: Path) -> None:
    table = 400 * MiB
    without = fit(tmp_path, "table_without", None, table_bytes=table)
    gc.collect()
    with_ = fit(tmp_path, "table_with", everything_on(), table_bytes=table)
    # the fit itself grows the process by a few MiB (Lightning, TensorBoard's writer); a copy of the table is 400 MiB
    assert with_["rss_grown"] - without["rss_grown"] < 64 * MiB, (with_["rss_grown"], without["rss_grown"])
    assert with_["calls"] == without["calls"]


def test_an_exact_answer_asked_after_fit_runs_dry_runs_that_leave_the_users_objects_alone(
    runs: dict[str, Any],
) -> None:
    """``max_batch_size(exact=True)`` runs the step under fake tensors, outside the fit: the user's counters, lists
    and generators are the copy's, not the user's."""
    everything = runs["everything"]
    model, callback = everything["model"], everything["callback"]
    calls, losses = dict(model.calls), list(model.losses)
    state = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())
    in_fit = callback.max_batch_size("1MiB")
    exact = callback.max_batch_size("1MiB", exact=True)
    assert in_fit is not None and exact is not None and 0 < in_fit <= exact
    assert dict(model.calls) == calls
    assert model.losses == losses and not any(isinstance(loss, FakeTensor) for loss in model.losses)
    assert random.getstate() == state[0] and np.random.get_state()[1].tolist() == state[1]
    assert torch.equal(torch.get_rng_state(), state[2])


@pytest.mark.parametrize("name", ["gpt2/ones/32-true", "llama/padded/32-true", "demo/32-true"])
def test_third_party_models_as_users_write_them_see_the_same_program(name: str, tmp_path: Path) -> None:
    """Hugging Face GPT-2 and Llama called as ``self.model(**batch)`` in ``training_step``, and Lightning's demo
    Transformer, each validated after every epoch: every option on, the user's modes see the same operators and
    functions, the training and validation losses are the same."""
    from hf_models import Spec, build_module, loader

    spec = Spec.parse(name)

    def run(callback: MemoryTenantsCallback | None) -> tuple[Counter[str], Counter[str], list[float]]:
        module = build_module(spec, validate=True)
        losses: list[float] = []

        class Losses(L.Callback):
            def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
                losses.append(float(outputs["loss"]))

            def on_validation_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
                losses.append(float(outputs))

        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=3,
            accumulate_grad_batches=1,
            log_every_n_steps=1,
            callbacks=[Losses(), *([callback] if callback is not None else [])],
            logger=TensorBoardLogger(tmp_path, name="with" if callback else "without"),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        dispatched, functions = Dispatched(), Functions()
        with warnings.catch_warnings(), functions, dispatched:
            warnings.simplefilter("ignore")
            trainer.fit(module, loader(spec), loader(spec))  # one batch an epoch: three epochs, each validated
        return dispatched.ops, functions.calls, losses

    without = run(None)
    callback = everything_on(budget_bytes=1_000_000)  # under the peak: the budget's warnings run
    with_ = run(callback)
    assert sum(without[0].values()) > 1000
    assert with_[0] == without[0], (with_[0] - without[0], without[0] - with_[0])
    assert with_[1] == without[1], (with_[1] - without[1], without[1] - with_[1])
    # the sanity check's batch, then each epoch's training batch and validation batch
    assert with_[2] == without[2] and len(without[2]) == 7
    validation = callback.latest_validation
    assert validation is not None and validation.peak_bytes is not None and validation.step == 3
    fresh = build_module(spec)  # the weights tenant holds the buffers too (Llama's rotary frequencies, fp32)
    tensors = [*fresh.parameters(), *fresh.buffers()]
    assert validation.tenants_bytes["weights"] == sum(t.numel() * t.element_size() for t in tensors)

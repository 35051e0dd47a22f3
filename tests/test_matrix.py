"""Precision x optimizer x accumulation x manual optimization x strategy, in Lightning, on tiny models.

In every cell the callback must leave the losses bitwise identical, and after the first optimizer step
the measured fixed cost must equal the formula to the byte, or the deviation must be explained by the
sentence checked here. The strategy axis is Lightning's single-device engine and its DDP engine (one
process, gloo); two processes are in test_ddp.py.
"""

from __future__ import annotations

import logging
import warnings
from itertools import product
from typing import Any

import lightning as L
import pytest
import torch
from conftest import make_trainer, no_collection
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback

# Linear(6, 16), Tanh, Linear(16, 8), Tanh, Linear(8, 1): 112 + 136 + 9 = 257 parameters in 6 tensors.
P, TENSORS = 257, 6
# Under autocast the second and third weights are cast to half and kept for backward (the first layer's
# input needs no gradient, so its copy is not kept): 16 x 8 + 8 x 1 numbers of 2 bytes.
AUTOCAST_COPIES = (16 * 8 + 8) * 2


class Lion(torch.optim.Optimizer):
    """An optimizer the formulas do not know: one momentum buffer per parameter."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.add_(torch.sign(buf.mul_(0.9).add_(p.grad, alpha=0.1)), alpha=-group["lr"])
        return loss


# name -> (factory, state bytes per parameter in units of the parameter's element size, scalars per tensor)
OPTIMIZERS: dict[str, tuple[Any, int, int]] = {
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-3), 2, 1),
    "adamw-amsgrad": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True), 3, 1),
    "sgd-nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, nesterov=True), 1, 0),
    "rmsprop-centered-momentum": (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True, momentum=0.9), 3, 1),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.01), 1, 1),
    "adafactor": (lambda ps: torch.optim.Adafactor(ps, lr=0.01), -1, 1),
    "nadam-foreach": (lambda ps: torch.optim.NAdam(ps, lr=1e-3, foreach=True), 2, 2),
    "lion-unknown": (lambda ps: Lion(ps), 1, 0),
}
# the class and implementation the peak explanation names for each optimizer (ZeRO wraps a single-tensor Adam)
NAMED = {
    "adam": "Adam (single-tensor)",
    "adamw-amsgrad": "AdamW (single-tensor)",
    "sgd-nesterov": "SGD (single-tensor)",
    "rmsprop-centered-momentum": "RMSprop (single-tensor)",
    "adagrad": "Adagrad (single-tensor)",
    "adafactor": "Adafactor (single-tensor)",
    "nadam-foreach": "NAdam (foreach)",
    "lion-unknown": "Lion (single-tensor)",
    "zero-adam": "Adam (single-tensor)",
}
# optimizers whose step makes two temporaries the size of the largest weight (the others make about one)
TWO_TEMPORARIES = {"adam", "adamw-amsgrad", "nadam-foreach", "zero-adam"}
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "16-mixed+scaler")
SHAPES = list(product((1, 2), (False, True), ("auto", "ddp")))  # accumulation, manual, strategy
ELEMENT = {"16-true": 2, "bf16-true": 2, "64-true": 8}


def cells() -> list[tuple[str, str, int, bool, str]]:
    """Every precision x optimizer pair, each in one of the 8 training shapes; each precision sees all 8."""
    out = []
    for p, precision in enumerate(PRECISIONS):
        for o, optimizer in enumerate(OPTIMIZERS):
            accumulate, manual, strategy = SHAPES[(o + p) % len(SHAPES)]
            out.append((precision, optimizer, accumulate, manual, strategy))
    # ZeroRedundancyOptimizer needs a process group: Lightning's DDP engine gives it one
    out += [(precision, "zero-adam", 1, False, "ddp") for precision in ("32-true", "bf16-mixed", "bf16-true")]
    return out


CELLS = cells()


class Net(L.LightningModule):
    def __init__(self, optimizer: str, accumulate: int, manual: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
        self.optimizer, self.accumulate = optimizer, accumulate
        self.automatic_optimization = not manual
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.net(batch[0]).float().pow(2).mean()
        self.losses.append(loss.detach().clone())
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
        return None

    def configure_optimizers(self) -> Any:
        if self.optimizer == "zero-adam":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
        return OPTIMIZERS[self.optimizer][0](self.parameters())


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 6, generator=torch.Generator().manual_seed(1))), batch_size=2)


def fit(cell: tuple[str, str, int, bool, str], callbacks: list[L.Callback]) -> tuple[Net, L.Trainer]:
    precision, optimizer, accumulate, manual, strategy = cell
    options: dict[str, Any] = {"strategy": strategy, "devices": 1}
    if precision == "16-mixed+scaler":
        options["plugins"] = [MixedPrecision("16-mixed", "cpu")]  # fp16 autocast and a GradScaler, on CPU
    else:
        options["precision"] = precision
    if not manual:
        options["accumulate_grad_batches"] = accumulate
    model = Net(optimizer, accumulate, manual)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(callbacks, steps=2, **options)
        with no_collection():
            trainer.fit(model, loader())
    return model, trainer


def bits(losses: list[torch.Tensor]) -> list[bytes]:
    return [loss.numpy().tobytes() for loss in losses]


@pytest.fixture(autouse=True, scope="module")
def quiet_and_clean() -> Any:
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)
    # Lightning's DDP engine leaves its one-process group initialized: do not hand it to later tests
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(map(str, c)) for c in CELLS])
def test_cell(cell: tuple[str, str, int, bool, str]) -> None:
    precision, optimizer, accumulate, manual, strategy = cell
    plain, _ = fit(cell, [])
    cb = MemoryTenantsCallback(print_summary=False)
    model, trainer = fit(cell, [cb])
    assert bits(model.losses) == bits(plain.losses) and len(model.losses) == 2 * accumulate

    report = cb.latest
    assert cb.first.step == 0 and report.step == 1
    assert len(report.micro_batches) == accumulate
    # every micro-batch keeps its own phases; only the last one steps the optimizer
    assert ["before_optimizer_step" in mb for mb in report.micro_batches] == [False] * (accumulate - 1) + [True]
    always = {"batch_start", "before_backward", "after_backward", "batch_end"}
    assert all(always <= set(mb) for mb in report.micro_batches)
    element = ELEMENT.get(precision, 4)
    assert report.tenants_bytes["weights"] == element * P == report.phases["batch_end"].tenants_bytes["weights"]

    # the fixed cost after the first step: exact, or the deviation explained
    deviation, sentences = 0, []
    if optimizer == "lion-unknown":  # measured, and its bytes per parameter given
        deviation += element * P
        sentences.append(f"unknown optimizer Lion: measured {float(element):.1f} bytes per parameter")
    if manual:  # this module zeroes its gradients right after optimizer.step(), before batch_end
        deviation -= element * P
        sentences.append("gradients are 0: none exist before the first backward or after zero_grad()")
    assert report.fixed_deviation_bytes == deviation
    assert report.fixed_cost_notes == sentences
    if optimizer != "lion-unknown":
        factor, scalars = OPTIMIZERS.get(optimizer, OPTIMIZERS["adam"])[1:]
        state = report.phases["batch_end"].tenants_bytes["optimizer_state"]
        # step counters are fp32, but float64 where manual optimization steps inside 64-true's float64 context
        step = 8 if precision == "64-true" and manual else 4
        if factor >= 0:
            assert state == factor * element * P + scalars * step * TENSORS
        else:  # Adafactor: row and column factors for the three weights, a full variance for the biases
            assert state == element * ((16 + 6) + (8 + 16) + (1 + 8) + 16 + 8 + 1) + step * TENSORS

    # precision: what the report says, and the named parts it measured
    notes = " ".join(report.notes)
    parts = report.parts_bytes
    if precision in ("16-mixed", "bf16-mixed", "16-mixed+scaler"):
        assert parts["autocast_cache"] == AUTOCAST_COPIES
        assert "autocast computes in" in notes and "cache_enabled=False" in notes
    else:
        assert "autocast_cache" not in parts
    if precision == "16-mixed":
        assert trainer.precision == "bf16-mixed"
        assert "on CPU, Lightning runs a requested 16-mixed as bf16-mixed" in notes
    if precision == "16-mixed+scaler":
        assert parts["grad_scaler"] == 4 + 4 + 4  # scale, growth tracker, one found-inf flag from unscale_
        assert report.phases["batch_end"].parts_bytes["grad_scaler"] == 8  # update() dropped the flag
        assert "GradScaler: its scale and growth tracker" in notes
    else:
        assert "grad_scaler" not in parts
    if precision in ELEMENT:
        dtype = {2: "bfloat16" if precision.startswith("bf16") else "float16", 8: "float64"}[element]
        assert f"{precision}: parameters are {dtype}" in notes

    # strategy: DDP's buckets are a second copy of the gradients
    if strategy == "ddp":
        assert parts["ddp_buckets"] == report.phases["after_backward"].tenants_bytes["gradients"] == element * P
        assert "gradient_as_bucket_view=False" in notes
    else:
        assert "ddp_buckets" not in parts

    # where the step peaks. Two temporaries of the largest weight put it in the optimizer step; one does too,
    # unless gradients are accumulated: then the last micro-batch's backward makes each gradient beside the one
    # accumulated so far, with activations still alive. A step whose loss is not finite under a GradScaler is
    # skipped by the scaler (its gradients are not finite) and makes no temporaries at all.
    skipped = precision == "16-mixed+scaler" and not all(torch.isfinite(x) for x in model.losses[-accumulate:])
    in_backward = skipped or (optimizer not in TWO_TEMPORARIES and accumulate == 2)
    if in_backward:
        assert report.peak_phase == "after_backward"
        assert report.peak_explanation.startswith("peak inside backward: gradients (")
        assert report.peak_explanation.endswith(f"; the optimizer step ({NAMED[optimizer]}) stayed below it")
    else:
        assert report.peak_phase == "batch_end"
        assert report.peak_explanation.startswith(f"peak inside the optimizer step: {NAMED[optimizer]} temporaries")


class GAN(L.LightningModule):
    """Two optimizers, manual optimization: the generator and the discriminator step in turn."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))  # 182 parameters
        self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))  # 65 parameters
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        fake = self.generator(torch.randn(2, 4))
        d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(batch[0]).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_loss = -self.discriminator(fake).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.generator.parameters()), torch.optim.SGD(
            self.discriminator.parameters(), lr=0.01, momentum=0.9
        )


def test_gan_with_two_optimizers() -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    with no_collection():
        make_trainer([cb], steps=4).fit(GAN(), loader())
    report = cb.latest
    # Adam on the generator (8 bytes + a step per tensor), momentum SGD on the discriminator (4 bytes)
    assert report.phases["batch_end"].tenants_bytes["optimizer_state"] == 8 * 182 + 4 * 4 + 4 * 65
    assert report.fixed_deviation_bytes == 0 and report.fixed_cost_notes == []
    # the last window of the step holds the generator's Adam step: two temporaries the size of its largest weight
    assert report.peak_phase == "batch_end"
    assert report.peak_explanation.startswith(
        "peak inside the optimizer step: Adam (single-tensor), SGD (single-tensor) temporaries of"
    )


class Shapes(L.LightningModule):
    """A frozen embedding, an output layer tied to it, and two parameter groups with different options."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)  # 80 parameters, tied below
        self.frozen = nn.Linear(8, 8)  # 72 parameters, frozen
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))  # 552 parameters
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight
        self.checkpointed = checkpointed

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        h = self.frozen(self.embed(batch[0]))
        h = checkpoint(self.body, h, use_reentrant=False) if self.checkpointed else self.body(h)
        return self.head(h).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(
            [{"params": self.body.parameters(), "lr": 1e-3}, {"params": [self.embed.weight], "amsgrad": True}]
        )


def token_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randint(0, 10, (8, 5), generator=torch.Generator().manual_seed(0))), 4)


def test_frozen_tied_and_parameter_groups() -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    make_trainer([cb], steps=2).fit(Shapes(), token_loader())
    end = cb.latest.phases["batch_end"].tenants_bytes
    assert end["weights"] == 4 * (80 + 72 + 552)
    assert end["gradients"] == 4 * (80 + 552)
    assert end["optimizer_state"] == 8 * 552 + 4 * 4 + 12 * 80 + 4  # the embedding's group has amsgrad
    assert cb.latest.fixed_deviation_bytes == 0
    assert cb.latest.fixed_cost_notes == [
        "tied weights counted once: head.weight is embed.weight (80 parameters)",
        "72 frozen parameters have no gradient and no optimizer state",
    ]


def test_activation_checkpointing_shrinks_activations_and_says_why() -> None:
    sizes = {}
    for checkpointed in (False, True):
        cb = MemoryTenantsCallback(print_summary=False)
        make_trainer([cb], steps=2).fit(Shapes(checkpointed), token_loader())
        sizes[checkpointed] = cb.latest.tenants_bytes["activations"]
        sentence = (
            "activation checkpointing: 1 checkpointed region(s) keep only their inputs for backward and"
            " recompute the rest, so the activations tenant is smaller than the forward's"
        )
        assert (sentence in cb.latest.notes) is checkpointed
    # the Tanh output inside the body (4 x 5 x 32 numbers, saved by Tanh and the next Linear) is recomputed
    assert sizes[False] - sizes[True] == 4 * 5 * 32 * 4


def test_the_autocast_sentence_follows_the_plugin_s_cache() -> None:
    from lightning.pytorch.plugins.precision import FSDPPrecision

    from lightning_memtenants.analysis.engines import precision_notes

    model = nn.Linear(2, 2)
    mixed = precision_notes(MixedPrecision("bf16-mixed", "cpu"), model, "cpu")
    assert "with its cache off (Lightning passes cache_enabled=False)" in mixed[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.autocast("cuda") warns where CUDA is absent
        fsdp = precision_notes(FSDPPrecision("bf16-mixed"), model, "cuda")
    assert fsdp == [
        "bf16-mixed: weights, gradients and optimizer state stay float32; autocast computes in bfloat16 with its"
        " cache on, so each weight is cast once per forward and kept until autocast exits; the copies that"
        " autograd keeps for backward are the autocast_cache part"
    ]

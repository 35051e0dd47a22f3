"""Run in a fresh process, as ``python forecast_check.py [MODE ...]``: the CPU tracker counts every tensor alive in
the process, garbage from earlier tests included, so each measurement needs a process of its own.

Modes:

- (none): predict batch 256 from two steps at batch 64, then measure batch 256 (one JSON line).
- ``answers MODEL:BUDGET:SIZE ...``: train each ``MODEL`` two steps at ``SIZE`` with a callback under ``BUDGET``,
  and print what it logged as ``max_batch_size`` at each step, its forecast lines' answers, ``cb.max_batch_size()``
  after the fit and ``largest_batch_size``'s answer (one JSON line, by model).
- ``real MODEL:SIZE,SIZE... ...``: the peak of a real steady-state step of each model at each size (one JSON line).

The models: ``seed`` (``examples/seed_mlp.py``), ``gpt`` (``examples/gpt.py``'s TinyGPT, 2 layers of 128, on
128-token sequences), ``conv`` (:class:`ConvNet` on 32 x 32 RGB images).
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from conftest import RecordingLogger, make_trainer
from gpt import TinyGPT
from seed_mlp import SeedMLP, seed_loader

from lightning_memtenants import MemoryTenantsCallback, largest_batch_size


class ConvNet(L.LightningModule):
    """Two 3 x 3 convolutions (32 and 64 channels), a pooling, a linear head; cross-entropy over 10 classes, Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def seed_batch(size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor]:
    return (torch.randn(size, 1024, generator=generator),)


def gpt_batch(size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 1024, (size, 128), generator=generator)
    return tokens, torch.roll(tokens, -1, dims=1)


def conv_batch(size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 3, 32, 32, generator=generator), torch.randint(0, 10, (size,), generator=generator)


MODELS: dict[str, tuple[Callable[[], L.LightningModule], Callable[..., Any]]] = {
    "seed": (SeedMLP, seed_batch),
    "gpt": (TinyGPT, gpt_batch),
    "conv": (ConvNet, conv_batch),
}


class Batches:
    """A loader that holds nothing but the batch it gives: each is made when asked, as a GPU holds only its batch."""

    def __init__(self, make: Callable[..., Any], sizes: list[int]) -> None:
        self.make, self.sizes = make, sizes

    def __iter__(self) -> Iterator[Any]:
        generator = torch.Generator().manual_seed(0)
        for size in self.sizes:
            yield self.make(size, generator)

    def __len__(self) -> int:
        return len(self.sizes)


class Lines(L.Callback):
    """After each batch (and after the memtenants callback, listed before it), the forecast lines' answer."""

    def __init__(self, cb: MemoryTenantsCallback, budget: str) -> None:
        self.cb, self.budget, self.answers = cb, budget, []

    def on_train_batch_end(self, *args: Any) -> None:
        self.answers.append(self.cb.forecast.line_batch_size(self.budget))


def answers(name: str, budget: str, size: int) -> dict[str, Any]:
    """The callback's answers from two steps at ``size`` (the seed model on its own DataLoader, the others on
    ``Batches``), and ``largest_batch_size``'s."""
    build, make = MODELS[name]
    L.seed_everything(0, verbose=False)
    cb = MemoryTenantsCallback(print_summary=False, budget_bytes=budget)
    lines, logger = Lines(cb, budget), RecordingLogger()
    data = seed_loader(size, 2) if name == "seed" else Batches(make, [size, size])
    make_trainer([cb, lines], steps=2, logger=logger).fit(build(), data)
    return {
        "logged": [metrics.get("memtenants/max_batch_size") for _, metrics in logger.logged],
        "lines": lines.answers,
        "after": cb.max_batch_size(),
        "largest": largest_batch_size(build(), lambda n: make(n), budget),
    }


def real_peaks(name: str, sizes: list[int]) -> dict[int, int]:
    """The peak of a real steady-state step at each size: two steps, a small first one (it creates the optimizer
    state and the gradients, which are the same at any batch size), then the size; the process holds the model
    and the one batch."""
    build, make = MODELS[name]
    peaks = {}
    for size in sizes:
        gc.collect()  # the last Trainer and its model sit in reference cycles
        L.seed_everything(0, verbose=False)
        cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
        make_trainer([cb], steps=2).fit(build(), Batches(make, [1, size]))
        assert cb.latest is not None and cb.latest.step == 1 and cb.latest.peak_bytes is not None
        peaks[size] = cb.latest.peak_bytes
        del cb
    return peaks


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    mode = sys.argv[1] if len(sys.argv) > 1 else "predict"
    if mode == "answers":
        found = {}
        for spec in sys.argv[2:]:
            name, budget, size = spec.split(":")
            gc.collect()  # the last model's Trainer sits in reference cycles
            found[name] = answers(name, budget, int(size))
        print(json.dumps(found))
        return
    if mode == "real":
        peaks = {}
        for spec in sys.argv[2:]:
            name, sizes = spec.split(":")
            peaks[name] = real_peaks(name, [int(size) for size in sizes.split(",")])
        print(json.dumps(peaks))
        return
    small = MemoryTenantsCallback(print_summary=False)
    L.seed_everything(0, verbose=False)
    make_trainer([small], steps=2).fit(SeedMLP(), seed_loader(64, 2))
    predicted = small.predict_peak_bytes(256)
    gc.collect()  # the first Trainer and its model sit in reference cycles
    large = MemoryTenantsCallback(print_summary=False)
    L.seed_everything(0, verbose=False)
    make_trainer([large], steps=2).fit(SeedMLP(), seed_loader(256, 2))
    assert large.latest is not None
    print(json.dumps({"predicted": predicted, "measured": large.latest.peak_bytes}))


if __name__ == "__main__":
    main()

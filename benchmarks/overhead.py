"""Fit-time overhead of MemoryTenantsCallback, measured side by side in one process.

Arms: no callback; the default callback (tenants every step, the live-tensor tracker on
logging steps); the tracker on every step. The arms run interleaved, in a rotating order,
and the script prints the median over repeats of each arm's fit time divided by the
no-callback fit time of the same repeat.

Run: ``python benchmarks/overhead.py [--repeats 5] [--steps 100]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from seed_mlp import SeedMLP, seed_loader

from lightning_memtenants import MemoryTenantsCallback


class TinyTransformer(L.LightningModule):
    """A small transformer encoder language model: many small operators per step."""

    def __init__(self, vocab: int = 1000, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.head(self.encoder(self.embed(tokens[:, :-1])))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


class SmallTransformer(TinyTransformer):
    """A small transformer: 4 layers of width 256 over 128 tokens."""

    def __init__(self) -> None:
        super().__init__(width=256, layers=4, heads=8)


def transformer_loader(steps: int, batch_size: int = 16, seq_len: int = 65) -> DataLoader:
    tokens = torch.randint(0, 1000, (steps * batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens), batch_size=batch_size)


class TimedCallback(MemoryTenantsCallback):
    """The callback with a stopwatch around each of its hooks: its own cost, free of machine noise."""

    spent = 0.0


def _timed(name: str) -> Callable[..., object]:
    hook = getattr(MemoryTenantsCallback, name)

    def timed(self: TimedCallback, *args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            TimedCallback.spent += time.perf_counter() - start

    return timed


for _hook in (
    "on_train_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_end",
    "teardown",
):
    setattr(TimedCallback, _hook, _timed(_hook))


class NullLogger(Logger):
    """Takes every metric and keeps none: the same cheap logger for every arm."""

    name = "null"
    version = 0

    def log_hyperparams(self, *args: object, **kwargs: object) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


class MemTrackerArm(L.Callback):
    """PyTorch's MemTracker inside Lightning: enter at train start, reset per batch, exit at the end."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self.tracker = MemTracker()
        self.tracker.track_external(pl_module, *trainer.optimizers)
        self.tracker.__enter__()

    def on_train_batch_start(self, *args: object) -> None:
        self.tracker.reset_mod_stats()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.tracker.__exit__(None, None, None)


class ProfilerArm(L.Callback):
    """torch.profiler with profile_memory, record_shapes and with_stack: what its memory timeline needs."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
        )
        self.profiler.__enter__()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.profiler.__exit__(None, None, None)


ARMS: dict[str, Callable[[], list[L.Callback]]] = {
    "none": lambda: [],
    "default": lambda: [TimedCallback(print_summary=False)],
    "tracker every step": lambda: [MemoryTenantsCallback(track_every_step=True, print_summary=False)],
}
COMPARED: dict[str, Callable[[], list[L.Callback]]] = {
    "PyTorch MemTracker": lambda: [MemTrackerArm()],
    "profiler, profile_memory": lambda: [ProfilerArm()],
    "DeviceStatsMonitor": lambda: [DeviceStatsMonitor()],
}


def fit_seconds(make_module: Callable[[], L.LightningModule], loader: DataLoader, arm: str, steps: int) -> float:
    """Wall time of ``trainer.fit`` alone: the Trainer and the module are built outside the clock."""
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=ARMS[arm](),
        logger=NullLogger(),
        log_every_n_steps=50,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = make_module()
    TimedCallback.spent = 0.0
    start = time.perf_counter()
    trainer.fit(module, loader)
    return time.perf_counter() - start


def measure(
    name: str, make_module: Callable[[], L.LightningModule], loader: DataLoader, args: argparse.Namespace, steps: int
) -> None:
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    hooks: list[float] = []
    arms = list(ARMS)
    fit_seconds(make_module, loader, "default", 2)  # warm-up: imports, allocator, thread pools
    for repeat in range(args.repeats):
        order = arms[repeat % len(arms) :] + arms[: repeat % len(arms)]
        for arm in order:
            times[arm].append(fit_seconds(make_module, loader, arm, steps))
            if arm == "default":
                hooks.append(TimedCallback.spent / times[arm][-1])
    base = times["none"]
    median = statistics.median(base)
    print(f"\n{name}: {steps} steps, {args.repeats} repeats, median fit time of 'none' {median:.2f} s")
    for arm in arms:
        ratios = [t / b for t, b in zip(times[arm], base, strict=True)]
        if arm == "default":
            print(
                f"  {'default, own hooks':<20} share of fit time {statistics.median(hooks):.4f}"
                " (time inside the callback's hooks; the tracker's per-operator cost on logging steps is extra)"
            )
        print(
            f"  {arm:<20} fit-time ratio {statistics.median(ratios):.3f}  (per repeat: "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + ")"
        )


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="steps per fit of the tiny transformer (worst case)")
    parser.add_argument("--seed-steps", type=int, default=60, help="steps per fit of the seed MLP (~0.8 s each)")
    parser.add_argument("--models", default="seed,small,tiny")
    parser.add_argument("--small-steps", type=int, default=100, help="steps per fit of the small transformer")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    parser.add_argument("--compare", action="store_true", help="add MemTracker, the profiler and DeviceStatsMonitor")
    args = parser.parse_args()
    if args.compare:
        ARMS.update(COMPARED)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads")
    if "seed" in args.models:
        measure("seed MLP, batch 256", SeedMLP, seed_loader(256, args.seed_steps), args, args.seed_steps)
    if "small" in args.models:
        loader = transformer_loader(args.small_steps, seq_len=129)
        measure("small transformer, batch 16 x 128 tokens", SmallTransformer, loader, args, args.small_steps)
    if "tiny" in args.models:
        loader = transformer_loader(args.steps)
        measure("tiny transformer, batch 16 x 64 tokens", TinyTransformer, loader, args, args.steps)


if __name__ == "__main__":
    main()

"""Our forecast against Lightning's BatchSizeFinder, on the same model and the same (simulated) budget.

The device is simulated on the CPU: a live-tensor tracker with a byte limit raises
``torch.OutOfMemoryError("CUDA out of memory. ...")`` the moment live tensors pass the
budget, which BatchSizeFinder catches like a real OOM. The data is variable-length: most
sequences are short and a few are long, as in Lightning issues 20447, 21154 and 8028.

It prints the batch size each method finds, the training steps each ran and the wall time
each took, and whether each answer runs out of memory on the dataset's longest batch.

Run: ``python benchmarks/forecast.py``.
"""

from __future__ import annotations

import logging
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_memtenants import MemoryTenantsCallback
from lightning_memtenants.core.sources import TrackerSource
from lightning_memtenants.core.tracker import LiveTensorTracker

BUDGET = 48 * 2**20
SHORT, LONG, SAMPLES = 32, 256, 4096


class Sequences(Dataset):
    """Token sequences: 1 in 1024 is long (256 tokens), the rest short (32 tokens)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = [
            torch.randint(0, 1000, (LONG if i % 1024 == 1023 else SHORT,), generator=generator) for i in range(SAMPLES)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def pad(batch: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(batch, batch_first=True)


class TokenMLP(L.LightningModule):
    """Per-token MLP over a padded batch: activations grow with samples x length."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 10)
        self.steps = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return self.head(self.net(batch).mean(1)).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Sequences(), batch_size=self.batch_size, shuffle=True, collate_fn=pad)


def trainer(callbacks: list[L.Callback], steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def simulated_device(module: nn.Module) -> LiveTensorTracker:
    tracker = LiveTensorTracker(scan=False, limit_bytes=BUDGET)
    tracker.start(roots=list(module.parameters()))
    return tracker


def fits_longest_batch(batch_size: int) -> bool:
    """One training step on a batch of the longest sequences, under the budget."""
    torch.manual_seed(0)
    module = TokenMLP(batch_size)
    optimizer = module.configure_optimizers()
    batch = torch.randint(0, 1000, (batch_size, LONG))
    device = simulated_device(module)
    try:
        module.training_step(batch, 0).backward()
        optimizer.step()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        device.stop()


def with_batch_size_finder() -> tuple[int, int, float]:
    L.seed_everything(0, verbose=False)
    module = TokenMLP()
    finder = BatchSizeFinder(mode="binsearch", init_val=2, steps_per_trial=3, max_trials=25)
    device = simulated_device(module)
    start = time.perf_counter()
    try:
        trainer([finder], steps=1).fit(module)
    except torch.OutOfMemoryError:
        print("  (BatchSizeFinder's own first training step after the search ran out of memory)")
    finally:
        device.stop()
    return module.batch_size, module.steps, time.perf_counter() - start


def with_memtenants() -> tuple[int, int, float]:
    L.seed_everything(0, verbose=False)
    module = TokenMLP(batch_size=16)
    cb = MemoryTenantsCallback(
        budget_bytes=BUDGET, margin=0.0, memory_source=TrackerSource(scan=False), print_summary=False
    )
    device = simulated_device(module)
    start = time.perf_counter()
    try:
        trainer([cb], steps=2).fit(module)  # two ordinary training steps
    finally:
        device.stop()
    # The longest sample decides: ask for the batch whose longest-sequence step fits.
    answer = cb.max_batch_size(elements_per_sample=LONG)
    return int(answer or 0), module.steps, time.perf_counter() - start


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(
        f"simulated device: {BUDGET / 2**20:.0f} MiB; data: {SAMPLES} sequences, 1 in 1024 of {LONG} tokens, "
        f"the rest {SHORT}"
    )
    print(f"{'method':<34}{'batch size':>11}{'steps run':>11}{'wall s':>9}  longest batch at that size")
    for name, run in (
        ("BatchSizeFinder (binsearch)", with_batch_size_finder),
        ("memtenants forecast", with_memtenants),
    ):
        size, steps, seconds = run()
        verdict = "fits" if fits_longest_batch(size) else "OUT OF MEMORY"
        print(f"{name:<34}{size:>11}{steps:>11}{seconds:>9.2f}  {verdict}")


if __name__ == "__main__":
    main()

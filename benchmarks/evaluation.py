"""What measuring the validation loop costs: ``trainer.validate`` with and without the callback, side by side.

Arms, each a stand-alone ``trainer.validate`` of the same module over the same batches, with a fresh Trainer built
outside the clock:

- ``none``: no callback, the baseline;
- ``default``: ``MemoryTenantsCallback(print_summary=False)``: on the CPU the live-tensor tracker measures the first
  four batches of the run and its last; every other batch only passes through the callback's hooks;
- ``every batch``: ``MemoryTenantsCallback(track_every_step=True, print_summary=False)``: every batch tracked;
- ``null dispatch mode``: a callback that enters a ``TorchDispatchMode`` doing nothing but calling the operator at
  each batch's start and leaves it at its end: the floor of any tracker built on a dispatch mode.

Each arm first validates untimed (warm-up). Then every repeat runs each arm once, in ABBA order (the arm list
forward on even repeats, reversed on odd ones). Around ``trainer.validate`` alone the script reads
``time.process_time()`` (CPU time) and ``time.perf_counter()`` (wall time). Per arm it prints the CPU ratio
(fastest-of over fastest-of ``none``), the CPU ratio paired (median over repeats of the arm's CPU time over
``none``'s in the same repeat), the wall ratio (the same median, of wall times) and the extra CPU milliseconds per
batch (fastest-of).

The model is ``benchmarks/overhead.py``'s tiny transformer (2 layers of width 128, 4 heads), validated under
``inference_mode`` on batches of 16 x 64 tokens (``--batches``, 200 by default), one thread.

Run: ``python benchmarks/evaluation.py [--batches 200] [--repeats 6] [--threads 1] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import NullDispatchArm, TinyTransformer, transformer_loader

from lightning_memtenants import MemoryTenantsCallback


class ValidatedTiny(TinyTransformer):
    """The tiny transformer with a validation step: its loss, as a user's would be."""

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.head(self.encoder(self.embed(tokens[:, :-1])))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class NullModeArm(NullDispatchArm):
    """``overhead.py``'s null dispatch mode, entered at each validation batch's start and left at its end."""

    def on_validation_batch_start(self, *args: object) -> None:
        self.on_train_batch_start()

    def on_validation_batch_end(self, *args: object) -> None:
        self._leave()


ARMS: dict[str, Callable[[], list[L.Callback]]] = {
    "none": lambda: [],
    "default": lambda: [MemoryTenantsCallback(print_summary=False)],
    "every batch": lambda: [MemoryTenantsCallback(print_summary=False, track_every_step=True)],
    "null dispatch mode": lambda: [NullModeArm()],
}


def validate_seconds(module: L.LightningModule, loader: DataLoader, callbacks: list[L.Callback]) -> tuple[float, float]:
    """CPU and wall time of ``trainer.validate`` alone; the Trainer is built outside the clock."""
    trainer = L.Trainer(
        accelerator="cpu",
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.validate(module, loader, verbose=False)
    return time.process_time() - cpu, time.perf_counter() - wall


def measure(batches: int, repeats: int) -> dict[str, Any]:
    """Validate with every arm, ABBA; print the table and return the raw times and ratios."""
    L.seed_everything(0, verbose=False)
    module = ValidatedTiny()
    loader = transformer_loader(batches, batch_size=16, seq_len=65)
    names = list(ARMS)
    for name in names:
        validate_seconds(module, transformer_loader(4), ARMS[name]())
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            c, w = validate_seconds(module, loader, ARMS[name]())
            cpu[name].append(c)
            wall[name].append(w)
    base = min(cpu["none"])
    results: dict[str, Any] = {}
    for name in names:
        results[name] = {
            "cpu_s": cpu[name],
            "wall_s": wall[name],
            "cpu_ratio": min(cpu[name]) / base,
            "cpu_ratio_paired": statistics.median(c / b for c, b in zip(cpu[name], cpu["none"], strict=True)),
            "wall_ratio": statistics.median(w / b for w, b in zip(wall[name], wall["none"], strict=True)),
            "extra_ms_per_batch": 1000 * (min(cpu[name]) - base) / batches,
        }
    print(
        f"tiny transformer validated on {batches} batches of 16 x 64 tokens, {repeats} repeats (ABBA), fastest CPU"
        f" time of 'none' {base:.3f} s ({1000 * base / batches:.2f} ms/batch), median wall"
        f" {statistics.median(wall['none']):.3f} s"
    )
    width = max(len(n) for n in names)
    print(f"  {'arm':<{width}}  {'CPU ratio':>9}  {'CPU paired':>10}  {'wall ratio':>10}  {'extra ms/batch':>14}")
    for name in names:
        r = results[name]
        print(
            f"  {name:<{width}}  {r['cpu_ratio']:>9.3f}  {r['cpu_ratio_paired']:>10.3f}  {r['wall_ratio']:>10.3f}"
            f"  {r['extra_ms_per_batch']:>14.3f}"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="validation batches per timed run")
    parser.add_argument("--repeats", type=int, default=6, help="timed runs per arm, in ABBA order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, default=None, help="write the raw times and ratios here")
    args = parser.parse_args()
    for name, value in (("batches", args.batches), ("repeats", args.repeats), ("threads", args.threads)):
        if value < 1:
            parser.error(f"--{name} must be a positive integer, got {value}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results = measure(args.batches, args.repeats)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

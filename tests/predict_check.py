"""Run in a fresh process: real Trainer steps on the CPU, reported as ``predict`` reports them.

Prints one JSON line per run. The tracker counts the training's tensors, as a prediction does: the data set
the DataLoader holds is in neither.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from conftest import make_trainer
from gpt import TinyGPT
from seed_mlp import SeedMLP, seed_loader

from lightning_memtenants import MemoryTenantsCallback


def run(kind: str, batch_size: int) -> dict:
    L.seed_everything(0, verbose=False)
    kind, _, precision = kind.partition("@")
    if kind == "seed":
        module: L.LightningModule = SeedMLP()
        loader = seed_loader(batch_size, 1)
    else:
        module = TinyGPT(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64)
        idx, targets = module.example_batch(batch_size, 32)
        loader = DataLoader(TensorDataset(idx, targets), batch_size=batch_size)
    memtenants = MemoryTenantsCallback(memory_source="tracker", track_every_step=True, print_summary=False)
    make_trainer([memtenants], steps=1, logger=False, precision=precision or "32-true").fit(module, loader)
    report = memtenants.latest
    assert report is not None
    kind = f"{kind}@{precision}" if precision else kind
    return {"kind": kind, "batch_size": batch_size, "report": dataclasses.asdict(report)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for spec in sys.argv[1:]:
        kind, size = spec.split(":")
        print(json.dumps(run(kind, int(size))), flush=True)

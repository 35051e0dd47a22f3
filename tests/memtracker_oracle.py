"""Run in a fresh process: our step peak and PyTorch MemTracker's, for the seed model in a Trainer.

A fresh process matters on CPU: the live-tensor tracker counts every CPU tensor alive in the
process, as ``memory_allocated`` counts every tensor on a CUDA device.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import lightning as L
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from conftest import make_trainer
from seed_mlp import SeedMLP, seed_loader

from lightning_memtenants import MemoryTenantsCallback


class Oracle(L.Callback):
    """MemTracker inside Lightning: track the module and optimizer, reset stats at each batch."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.tracker = MemTracker()
        self.tracker.track_external(pl_module, *trainer.optimizers)
        self.tracker.__enter__()

    def on_train_batch_start(self, *args: object) -> None:
        self.tracker.reset_mod_stats()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak = max(d["Total"] for d in self.tracker.get_tracker_snapshot("peak").values())
        self.tracker.__exit__(None, None, None)


def together(batch_size: int) -> None:
    """MemTracker and our callback in one fit: both measure, the losses are a plain run's, nothing stays."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    L.seed_everything(0, verbose=False)
    plain = SeedMLP()
    make_trainer([], steps=1).fit(plain, seed_loader(batch_size, steps=3))
    plain_losses = plain.losses
    del plain  # our tracker counts every CPU tensor alive, as memory_allocated counts a GPU's
    gc.collect()
    ours, oracle = MemoryTenantsCallback(print_summary=False), Oracle()
    L.seed_everything(0, verbose=False)
    module = SeedMLP()
    make_trainer([oracle, ours], steps=1).fit(module, seed_loader(batch_size, steps=3))
    assert ours.latest is not None
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    result = {
        "ours": ours.latest.peak_bytes,
        "memtracker": oracle.peak,
        "losses_equal": module.losses == plain_losses,
        "nothing_left": hooks is None and _get_current_dispatch_mode() is None,
        "resize_restored": "resize_" not in torch.UntypedStorage.__dict__
        or torch.UntypedStorage.__dict__["resize_"] is torch._C.StorageBase.resize_,
    }
    print(json.dumps(result))


def main(batch_size: int) -> None:
    ours = MemoryTenantsCallback(print_summary=False)
    L.seed_everything(0, verbose=False)
    make_trainer([ours], steps=1).fit(SeedMLP(), seed_loader(batch_size, steps=3))
    gc.collect()
    oracle = Oracle()
    L.seed_everything(0, verbose=False)
    make_trainer([oracle], steps=1).fit(SeedMLP(), seed_loader(batch_size, steps=3))
    assert ours.latest is not None
    print(json.dumps({"ours": ours.latest.peak_bytes, "memtracker": oracle.peak, "phase": ours.latest.peak_phase}))


if __name__ == "__main__":
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    together(size) if sys.argv[2:] == ["together"] else main(size)

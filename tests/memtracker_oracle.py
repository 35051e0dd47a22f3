"""Run in a fresh process: our step peak and PyTorch MemTracker's, for the seed model in a Trainer.

MemTracker counts every tensor an operator touches, the dataset's included (the loader indexes it). Our
default counts the training's tensors, so it is below MemTracker by the dataset; with ``TrackerSource(scan=True)``
it counts every CPU tensor alive, as MemTracker does, and a fresh process keeps earlier tests' tensors out.
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
    del plain  # MemTracker counts every tensor an operator touches
    gc.collect()
    ours, oracle = MemoryTenantsCallback(print_summary=False), Oracle()
    L.seed_everything(0, verbose=False)
    module = SeedMLP()
    loader = seed_loader(batch_size, steps=3)
    make_trainer([oracle, ours], steps=1).fit(module, loader)
    assert ours.latest is not None
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    result = {
        "ours": ours.latest.peak_bytes,
        "memtracker": oracle.peak,
        "dataset": sum(t.untyped_storage().nbytes() for t in loader.dataset.tensors),  # type: ignore[attr-defined]
        "losses_equal": module.losses == plain_losses,
        "nothing_left": hooks is None and _get_current_dispatch_mode() is None,
        "resize_restored": "resize_" not in torch.UntypedStorage.__dict__
        or torch.UntypedStorage.__dict__["resize_"] is torch._C.StorageBase.resize_,
    }
    print(json.dumps(result))


def main(batch_size: int) -> None:
    """Our default (the training's tensors), ours with a scan (every CPU tensor, as MemTracker counts), MemTracker."""
    from lightning_memtenants import TrackerSource

    peaks: dict[str, int | None] = {}
    for name, source in (("ours", "auto"), ("ours_scanning", TrackerSource(scan=True))):
        cb = MemoryTenantsCallback(print_summary=False, memory_source=source)
        L.seed_everything(0, verbose=False)
        make_trainer([cb], steps=1).fit(SeedMLP(), seed_loader(batch_size, steps=3))
        assert cb.latest is not None
        peaks[name], peaks["phase"] = cb.latest.peak_bytes, cb.latest.peak_phase  # type: ignore[assignment]
        del cb
        gc.collect()
    oracle = Oracle()
    L.seed_everything(0, verbose=False)
    loader = seed_loader(batch_size, steps=3)
    make_trainer([oracle], steps=1).fit(SeedMLP(), loader)
    dataset = sum(t.untyped_storage().nbytes() for t in loader.dataset.tensors)  # type: ignore[attr-defined]
    print(json.dumps({**peaks, "memtracker": oracle.peak, "dataset": dataset}))


if __name__ == "__main__":
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    together(size) if sys.argv[2:] == ["together"] else main(size)

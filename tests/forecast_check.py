"""Run in a fresh process: predict batch 256 from two steps at batch 64, then measure batch 256.

A fresh process matters on CPU, where the live-tensor tracker counts every tensor alive in
the process, garbage from earlier tests included.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from conftest import make_trainer
from seed_mlp import SeedMLP, seed_loader

from lightning_memtenants import MemoryTenantsCallback


def main() -> None:
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

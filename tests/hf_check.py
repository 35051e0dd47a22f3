"""Run in a fresh process: real one-step Trainer fits of ``hf_models``' specs on the CPU, reported as ``predict`` does.

Prints one JSON line per spec named on the command line (every spec without one).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import make_trainer
from hf_models import SPECS, Spec, build_module, loader

from lightning_memtenants import MemoryTenantsCallback


def run(spec: Spec) -> dict:
    L.seed_everything(0, verbose=False)
    module = build_module(spec)
    data = loader(spec)
    memtenants = MemoryTenantsCallback(memory_source="tracker", track_every_step=True, print_summary=False)
    make_trainer([memtenants], steps=1, logger=False, precision=spec.precision).fit(module, data)
    report = memtenants.latest
    assert report is not None, spec.name
    return {"spec": spec.name, "report": dataclasses.asdict(report)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    specs = [Spec.parse(name) for name in sys.argv[1:]] or SPECS
    for spec in specs:
        print(json.dumps(run(spec)), flush=True)

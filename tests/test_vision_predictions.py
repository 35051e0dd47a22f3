"""Vision models built from their class, as the CLI builds them: a prediction equals a real CPU run to the byte.

torchvision's ResNet-18 (BatchNorm, whose running statistics are buffers updated in the step) and a small timm
ViT (``drop_path_rate`` > 0: its constructor reads ``torch.linspace(...)`` back with ``.item()``, and its
forward draws DropPath masks), each wrapped in one LightningModule, AdamW, at ``32-true`` and ``bf16-mixed``,
on a batch of 4 images of 3x32x32 with labels of 10 classes. ``predict`` is given a zero-argument callable
(``functools.partial(VisionModule, arch)``) and builds the module under fake tensors, as ``memtenants
predict`` does. The real runs are this file's own, run as a script in a fresh process (one per model), less
what that process held before training (the data set).

Both tests skip where torchvision or timm is not installed (CI has neither).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from functools import cache, partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memtenants import PHASES, predict

HERE = Path(__file__).resolve().parent
BATCH = 4
CLASSES = 10
PRECISIONS = ("32-true", "bf16-mixed")


def build_net(arch: str) -> nn.Module:
    if arch == "resnet18":
        from torchvision.models import resnet18

        return resnet18(num_classes=CLASSES)
    if arch == "vit":
        from timm.models.vision_transformer import VisionTransformer

        return VisionTransformer(
            img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=CLASSES, drop_path_rate=0.1
        )
    raise ValueError(f"arch must be 'resnet18' or 'vit', got {arch!r}")


class VisionModule(L.LightningModule):
    """An image classifier: cross-entropy over ``CLASSES`` labels, AdamW."""

    def __init__(self, arch: str = "resnet18", lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_net(arch)

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def example_batch(self, batch_size: int, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        """Images of 3x32x32 and their labels (random, as only shapes matter here)."""
        return torch.randn(batch_size, 3, 32, 32), torch.randint(0, CLASSES, (batch_size,))


@cache
def real_runs(arch: str) -> dict[str, dict]:
    """One real one-step Trainer fit per precision on the CPU, in a fresh process so the tracker sees only them."""
    specs = [f"{arch}@{precision}" for precision in PRECISIONS]
    out = subprocess.run([sys.executable, __file__, *specs], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {run["precision"]: run for run in runs}


def differences(predicted: Any, real: dict) -> list[str]:
    """Every field where the prediction differs from the real run, with the bytes by which it does."""
    report = real["report"]
    found: list[str] = []

    def compare(what: str, mine: Any, theirs: Any) -> None:
        if mine == theirs:
            return
        if isinstance(mine, int) and isinstance(theirs, int):
            found.append(f"{what}: predicted {mine:,}, real {theirs:,} (predicted - real = {mine - theirs:+,})")
        else:
            found.append(f"{what}: predicted {mine!r}, real {theirs!r}")

    def compare_tenants(what: str, mine: dict[str, int], theirs: dict[str, int]) -> None:
        for tenant in sorted(set(mine) | set(theirs)):
            compare(f"{what}[{tenant}]", mine.get(tenant), theirs.get(tenant))

    compare_tenants("tenants_bytes", predicted.tenants_bytes, report["tenants_bytes"])
    for name in PHASES:
        phase, mine = report["phases"][name], predicted.phases[name]
        compare_tenants(f"{name}.tenants_bytes", mine.tenants_bytes, phase["tenants_bytes"])
        compare(f"{name}.allocated_bytes", mine.allocated_bytes, phase["allocated_bytes"])
        compare(f"{name}.window_peak_bytes", mine.window_peak_bytes, phase["window_peak_bytes"])
        compare_tenants(f"{name}.parts_bytes", mine.parts_bytes, phase["parts_bytes"])  # the autocast cache
    compare("peak_bytes", predicted.peak_bytes, report["peak_bytes"])
    compare("peak_phase", predicted.peak_phase, report["peak_phase"])
    compare("expected_fixed_bytes", predicted.expected_fixed_bytes, report["expected_fixed_bytes"])
    return found


def check_prediction(arch: str, precision: str) -> None:
    real = real_runs(arch)[precision]
    build = partial(VisionModule, arch)  # built by predict under fake tensors, as the CLI builds its target
    predicted = predict(build, lambda module: module.example_batch(BATCH), precision=precision)
    found = differences(predicted, real)
    assert not found, f"{arch} at {precision}, batch {BATCH}:\n" + "\n".join(found)


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_resnet18_prediction_equals_a_real_cpu_run_to_the_byte(precision: str) -> None:
    pytest.importorskip("torchvision")
    check_prediction("resnet18", precision)


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_timm_vit_prediction_equals_a_real_cpu_run_to_the_byte(precision: str) -> None:
    pytest.importorskip("timm")
    check_prediction("vit", precision)


def run(arch: str, precision: str) -> dict:
    """A real one-step fit, reported as ``predict`` reports it (this file's subprocess side)."""
    from conftest import make_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memtenants import MemoryTenantsCallback

    L.seed_everything(0, verbose=False)
    module = VisionModule(arch)
    images, labels = module.example_batch(BATCH)
    loader = DataLoader(TensorDataset(images, labels), batch_size=BATCH)
    memtenants = MemoryTenantsCallback(memory_source="tracker", track_every_step=True, print_summary=False)
    make_trainer([memtenants], steps=1, logger=False, precision=precision).fit(module, loader)
    report = memtenants.latest
    assert report is not None, f"{arch}@{precision}"
    return {"arch": arch, "precision": precision, "report": dataclasses.asdict(report)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for spec in sys.argv[1:]:
        arch, _, precision = spec.partition("@")
        print(json.dumps(run(arch, precision)), flush=True)

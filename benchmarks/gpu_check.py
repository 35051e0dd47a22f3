"""The prepared CUDA check: the cuda-marked tests, the article's loop, and the seed model in a Trainer.

Run: ``make gpu-check`` (or ``python benchmarks/gpu_check.py``) on a machine with a CUDA device.
It prints our per-phase table next to the article's RTX A6000 table and checks the
callback's step peak against ``torch.cuda.max_memory_allocated`` over the same window.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from seed_mlp import SeedMLP, seed_loader  # noqa: E402

from lightning_memtenants import MemoryTenantsCallback, format_table  # noqa: E402

MiB = 1024**2
ARTICLE = {  # RTX A6000, torch 2.5.1, batch 2048 (the article's anatomy_gpu.py)
    "after model.cuda()": 96.0,
    "after forward": 184.2,
    "after backward": 216.3,
    "after first opt.step()": 408.4,
    "peak during all of this": 504.4,
}


def article_loop() -> dict[str, float]:
    """The article's script, verbatim in substance: a plain loop, one step, batch 2048."""
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rows = {}
    model = nn.Sequential(
        nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024)
    ).cuda()
    rows["after model.cuda()"] = (torch.cuda.memory_allocated() - base) / MiB
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(2048, 1024, device="cuda")
    loss = model(x).pow(2).mean()
    rows["after forward"] = (torch.cuda.memory_allocated() - base) / MiB
    loss.backward()
    rows["after backward"] = (torch.cuda.memory_allocated() - base) / MiB
    opt.step()
    rows["after first opt.step()"] = (torch.cuda.memory_allocated() - base) / MiB
    rows["peak during all of this"] = (torch.cuda.max_memory_allocated() - base) / MiB
    del model, opt, x, loss
    torch.cuda.empty_cache()
    return rows


class Window(L.Callback):
    """An independent reading of the step's peak: reset at batch start, read at batch end."""

    def on_train_batch_start(self, *args: object) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, *args: object) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check needs a CUDA device; none here, so nothing was checked.")
        return 2
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, lightning {L.__version__}")

    print("\n== cuda-marked tests")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(ROOT / "tests")], check=False)

    print("\n== the article's loop (MiB above the starting point)")
    ours = article_loop()
    print(f"{'row':<26}{'article (A6000)':>16}{'this device':>14}")
    for row, value in ARTICLE.items():
        print(f"{row:<26}{value:>16.1f}{ours[row]:>14.1f}")

    print("\n== the seed model in a Trainer, batch 2048, MemoryTenantsCallback")
    cb, window = MemoryTenantsCallback(print_summary=False), Window()
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=2,
        callbacks=[cb, window],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SeedMLP(), seed_loader(2048, 2))
    for report in (cb.first, cb.latest):
        assert report is not None
        print(format_table(report))
        print()
    peak_ok = cb.latest.peak_bytes == window.peak
    print(f"step peak: callback {cb.latest.peak_bytes:,} B, max_memory_allocated {window.peak:,} B:", end=" ")
    print("equal" if peak_ok else "DIFFERENT")
    fixed_ok = cb.latest.expected_fixed_bytes == cb.latest.measured_fixed_bytes == 402_800_664
    print(f"fixed cost 16P + 24 = 402,800,664 B: {'exact' if fixed_ok else 'DIFFERENT'}")
    return 0 if tests.returncode == 0 and peak_ok and fixed_ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The prepared CUDA check: the cuda-marked tests, the article's loop, the seed model in a Trainer, FSDP and 16-mixed.

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
    rows["reserved after the step"] = torch.cuda.memory_reserved() / MiB
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


def strategies_check() -> bool:
    """Lightning's FSDPStrategy (it refuses the CPU) and 16-mixed with a real GradScaler, on one device.

    With one device FSDP's shards are whole, so the fixed cost is fsdp_fixed_cost_bytes(P, 1) = 16P,
    plus Adam's 6 step counters; the GradScaler holds 8 bytes, 12 while it steps.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_memtenants.analysis.formulas import fsdp_fixed_cost_bytes

    ok = True
    runs = {
        "fsdp, 32-true": {"strategy": FSDPStrategy()},
        "16-mixed (GradScaler)": {"precision": "16-mixed"},
    }
    for name, options in runs.items():
        cb = MemoryTenantsCallback(print_summary=False)
        trainer = L.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=2,
            callbacks=[cb],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **options,
        )
        trainer.fit(SeedMLP(), seed_loader(256, 2))
        report = cb.latest
        assert report is not None
        print(f"\n== the seed model, {name}")
        print(format_table(report))
        fixed = fsdp_fixed_cost_bytes(25_175_040, 1) + 24
        exact = report.expected_fixed_bytes == report.measured_fixed_bytes == fixed
        measured = report.measured_fixed_bytes
        print(f"fixed cost {fixed:,} B expected: {'exact' if exact else 'DIFFERENT'} (measured {measured:,} B)")
        if name.startswith("fsdp"):
            ok = ok and exact
        else:  # a GradScaler may skip the first steps on inf gradients, and Adam's state with them: print only
            print("- " + "\n- ".join(report.fixed_cost_notes or ["no deviation"]))
        if name.startswith("16-mixed"):
            scaler, copies = report.parts_bytes.get("grad_scaler"), report.parts_bytes.get("autocast_cache")
            print(f"grad_scaler part {scaler} B (expected 12), autocast_cache {copies} B")
            ok = ok and scaler == 12
    return ok


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
    major, minor = torch.cuda.get_device_capability()
    sys.path.insert(0, str(ROOT / "examples"))
    from anatomy_predicted import predicted_rows

    predicted, report = predicted_rows(f"{major}.{minor}")
    predicted["reserved after the step"] = report.phases["batch_end"].reserved_bytes / MiB
    ARTICLE.setdefault("reserved after the step", float("nan"))
    print(f"{'row':<26}{'article (A6000)':>16}{'this device':>14}{f'predicted sm_{major}{minor}':>20}")
    for row, value in ARTICLE.items():
        print(f"{row:<26}{value:>16.1f}{ours[row]:>14.1f}{predicted[row]:>20.1f}")

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
    strategies_ok = strategies_check()
    return 0 if tests.returncode == 0 and peak_ok and fixed_ok and strategies_ok else 1


if __name__ == "__main__":
    sys.exit(main())

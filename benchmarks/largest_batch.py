"""The in-fit largest batch against the truth, found by bisection over real runs; and the exact answer after fit.

For each model, a real CPU fit of a few steps with ``MemoryTenantsCallback(budget_bytes=B)`` at a measured batch
``b0``; the budget is picked so that the answer is a few times ``b0``. Printed per model:

- ``in-fit``: ``cb.max_batch_size()`` as the fit left it: scaled from a measured step's own allocations (its
  timeline split into fixed and batch-proportional bytes), no dry run, nothing of the user's run again;
- ``truth``: the largest batch whose real steady-state step (the second optimizer step: Adam's state and the
  previous gradients resident) peaks at most at the budget less the margin, found by bisection over real fits of
  two steps, each peak read from ``cb.latest.peak_bytes`` (the live-tensor tracker, exact to the byte);
- ``ratio``: in-fit / truth (never above 1; the issue asks at least 0.97);
- ``exact``: ``cb.max_batch_size(exact=True)`` after fit (dry runs of the step under fake tensors, on a meta copy).

Models: the article's MLP (``examples/seed_mlp.py``: Linear 1024->4096->4096->1024, Adam), an activation-heavy
residual MLP (4 blocks of LayerNorm, Linear(256, 1024), GELU, Linear(1024, 256) and a residual add, Adam) and a
small GPT (``examples/gpt.py``: 2 layers of 128, 128-token sequences, AdamW).

Run: ``python benchmarks/largest_batch.py [--models seed,residual,gpt] [--json]``. The seed MLP's real runs at its
answer (about 3,600 samples) take about half a minute each on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import TinyGPT  # noqa: E402
from seed_mlp import SeedMLP  # noqa: E402

from lightning_memtenants import MemoryTenantsCallback  # noqa: E402
from lightning_memtenants.analysis.forecast import limit_bytes  # noqa: E402
from lightning_memtenants.core.sources import TrackerSource  # noqa: E402


class ResidualMLP(L.LightningModule):
    """Activation-heavy: ``blocks`` residual blocks of LayerNorm, Linear(width, hidden), GELU, Linear(hidden, width).

    Args:
        width: the residual stream's width.
        hidden: each block's inner width.
        blocks: how many blocks.
    """

    def __init__(self, width: int = 256, hidden: int = 1024, blocks: int = 4) -> None:
        super().__init__()
        self.width = width
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        return self(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _dense(width: int) -> Callable[[int, int], DataLoader]:
    def loader(batch_size: int, steps: int) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(batch_size * steps, width, generator=generator)), batch_size)

    return loader


def _tokens(vocab: int, seq: int) -> Callable[[int, int], DataLoader]:
    def loader(batch_size: int, steps: int) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        idx = torch.randint(0, vocab, (batch_size * steps, seq), generator=generator)
        return DataLoader(TensorDataset(idx, torch.roll(idx, -1, dims=1)), batch_size)

    return loader


# name: (model factory, loader(batch_size, steps), measured batch b0, budget)
MODELS: dict[str, tuple[Callable[[], L.LightningModule], Callable[[int, int], DataLoader], int, str]] = {
    "seed": (SeedMLP, _dense(1024), 1024, "600MiB"),
    "residual": (ResidualMLP, _dense(256), 256, "96MiB"),
    "gpt": (lambda: TinyGPT(block_size=128), _tokens(1024, 128), 8, "160MiB"),
}


def _fit(model: L.LightningModule, loader: DataLoader, cb: MemoryTenantsCallback, steps: int) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(model, loader)


def real_peak(name: str, batch_size: int) -> int:
    """The real steady-state step's peak at ``batch_size``: the second step of a real fit, read by the tracker."""
    factory, loader, _, _ = MODELS[name]
    torch.manual_seed(0)
    cb = MemoryTenantsCallback(memory_source=TrackerSource(scan=False), track_every_step=True, print_summary=False)
    _fit(factory(), loader(batch_size, 2), cb, steps=2)
    assert cb.latest is not None and cb.latest.step == 1 and cb.latest.peak_bytes is not None
    return cb.latest.peak_bytes


def truth_by_bisection(name: str, limit: int, start: int, runs: list[tuple[int, int]]) -> int:
    """The largest batch whose real steady-state peak is at most ``limit``, by bisection over real fits.

    The bracket starts at ``start`` (the in-fit answer): a size that fits below, one that does not above, each
    proven by a real run, and bisected down to neighbours. ``runs`` gets each ``(size, peak)``.
    """

    def fits(size: int) -> bool:
        peak = real_peak(name, size)
        runs.append((size, peak))
        return peak <= limit

    lo, hi = max(start, 1), max(start, 1) + 1
    while not fits(lo):  # the answer passed the truth: walk down
        hi, lo = lo, max(lo // 2, 1)
        if hi == 1:
            return 0
    step = 1
    while fits(hi):  # walk up until a size does not fit
        lo, hi = hi, hi + step
        step *= 2
    while hi - lo > 1:
        middle = (lo + hi) // 2
        lo, hi = (middle, hi) if fits(middle) else (lo, middle)
    return lo


def measure(name: str) -> dict[str, Any]:
    """One model's row: the in-fit answer, the truth by bisection over real runs, their ratio, the exact answer."""
    factory, loader, b0, budget = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    cb = MemoryTenantsCallback(budget_bytes=budget, print_summary=False)
    started = time.perf_counter()
    _fit(model, loader(b0, 3), cb, steps=3)
    fit_s = time.perf_counter() - started
    in_fit = cb.max_batch_size()
    how = cb._alerts.how_found()
    started = time.perf_counter()
    exact = cb.max_batch_size(exact=True)
    exact_s = time.perf_counter() - started
    limit = limit_bytes(budget)
    runs: list[tuple[int, int]] = []
    started = time.perf_counter()
    truth = truth_by_bisection(name, limit, in_fit or 1, runs)
    truth_s = time.perf_counter() - started
    return {
        "model": name,
        "measured_batch": b0,
        "budget": budget,
        "limit_bytes": limit,
        "in_fit": in_fit,
        "how": how,
        "truth": truth,
        "ratio": (in_fit or 0) / truth if truth else None,
        "exact": exact,
        "real_runs": runs,
        "fit_s": round(fit_s, 2),
        "exact_s": round(exact_s, 2),
        "truth_s": round(truth_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()
    names = [name for name in args.models.split(",") if name]
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose among {list(MODELS)}")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    rows = [measure(name) for name in names]
    print(f"{'model':<10} {'b0':>5} {'budget':>8} {'in-fit':>8} {'truth':>8} {'ratio':>7} {'exact':>8}  real runs")
    for row in rows:
        ratio = f"{row['ratio']:.4f}" if row["ratio"] is not None else "-"
        sizes = ", ".join(
            f"{size}:{'fits' if peak <= row['limit_bytes'] else 'over'}" for size, peak in row["real_runs"]
        )
        print(
            f"{row['model']:<10} {row['measured_batch']:>5} {row['budget']:>8} {row['in_fit']:>8,} {row['truth']:>8,}"
            f" {ratio:>7} {row['exact']:>8,}  {sizes}"
        )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()

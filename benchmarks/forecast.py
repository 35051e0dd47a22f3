"""The largest batch: our answers against the truth, found by bisection with real runs, and beside BatchSizeFinder's.

The truth is the largest batch whose steady-state training step (the second: Adam's state and the previous
gradients resident) really fits the budget less the margin, found by bisection over real CPU runs, each in a
fresh process (``tests/forecast_check.py real``: the CPU tracker counts every live tensor, the process holding
the model and the one batch, as a GPU holds them). Every answer is printed with its distance from the truth:

- ``cb.max_batch_size()`` at step 0 and at step 1 (a callback training two steps at a small batch): scaled from
  the measured step's own allocations, no dry run (``analysis.forecast.ScaledStep``);
- the forecast's lines at step 0 and step 1 (what the callback answers with where no timeline is recorded: CUDA);
- ``largest_batch_size`` (dry runs, no training);
- Lightning's ``BatchSizeFinder`` (``mode="binsearch"``, 3 steps a trial) on a simulated device of the budget
  less the margin: a live-tensor tracker with a byte limit raises ``torch.OutOfMemoryError("CUDA out of
  memory. ...")`` the moment live tensors pass it, which BatchSizeFinder catches like a real OOM. Its data is
  made sample by sample; the batch Lightning prefetches counts on that device (on a GPU it stays on the host).

Models: the seed MLP under 1 GiB, TinyGPT (2 layers of 128, 128-token sequences) under 256 MiB, a small convnet
under 64 MiB. A real seed step at its answer takes a minute on 2 cores; its BatchSizeFinder run (dozens of them)
runs only with ``--all``.

Then the variable-length case of Lightning issues 20447, 21154 and 8028: most sequences short, a few long, a
48 MiB device and no margin; the question is the largest batch whose longest-sequence step fits.

Run: ``python benchmarks/forecast.py [--all] [--models seed,gpt,conv] [--skip-variable]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder
from torch import nn
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "forecast_check.py"
sys.path.insert(0, str(ROOT / "tests"))

from forecast_check import MODELS  # noqa: E402

from lightning_memtenants import MemoryTenantsCallback, largest_batch_size  # noqa: E402
from lightning_memtenants.analysis.forecast import limit_bytes  # noqa: E402
from lightning_memtenants.core.sources import TrackerSource  # noqa: E402
from lightning_memtenants.core.tracker import LiveTensorTracker  # noqa: E402

BUDGETS = {"seed": "1GiB", "gpt": "256MiB", "conv": "64MiB"}
SIZES = {"seed": 64, "gpt": 8, "conv": 16}  # the batch the callback trains at


def check(*args: str) -> Any:
    done = subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def real_fits(name: str, size: int, limit: int, seen: dict[int, int]) -> bool:
    """Whether a real steady-state step of ``size`` samples fits ``limit`` bytes: one fresh process."""
    if size not in seen:
        seen[size] = int(check("real", f"{name}:{size}")[name][str(size)])
        print(f"    real step at {size:,}: {seen[size]:,} bytes, {'fits' if seen[size] <= limit else 'over'}")
    return seen[size] <= limit


def truth(fits: Callable[[int], bool], start: int) -> int:
    """The largest size that fits, by bisection: from ``start`` out by doubling steps until one side changes, then
    halving. Right for any ``start`` (peaks grow with the batch); a good one takes two runs."""
    lo, hi = 0, None
    if fits(start):
        lo, step = start, 1
        while hi is None:
            hi = lo + step if not fits(lo + step) else None
            if hi is None:
                lo, step = lo + step, 2 * step
    else:
        hi, step = start, 1
        while lo == 0 and hi - step > 0:
            if fits(hi - step):
                lo = hi - step
            else:
                hi, step = hi - step, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# -- BatchSizeFinder on a simulated device -------------------------------------------------------------------------


class Samples(Dataset):
    """Samples made when asked (no data set held in memory): one row of the model's batch each."""

    def __init__(self, make: Callable[..., Any], count: int = 1 << 20) -> None:
        self.make, self.count = make, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        generator = torch.Generator().manual_seed(index)
        return tuple(t[0] for t in self.make(1, generator))


def finder_module(name: str) -> L.LightningModule:
    build, make = MODELS[name]

    class Tuned(build):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2
            self.steps_run = 0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.steps_run += 1
            return super().training_step(batch, batch_idx)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Samples(make), batch_size=self.batch_size)

    return Tuned()


def trainer(callbacks: list[L.Callback], steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def with_batch_size_finder(build: Callable[[], L.LightningModule], limit: int) -> tuple[int, int, float]:
    """BatchSizeFinder's answer on a device of ``limit`` bytes, the training steps it ran, and its wall time.

    Seeded before the model is built, so that the data's order is the same on every run: which batches hold a long
    sequence decides its answer on variable-length data."""
    L.seed_everything(0, verbose=False)
    module = build()
    finder = BatchSizeFinder(mode="binsearch", init_val=2, steps_per_trial=3, max_trials=25)
    device = LiveTensorTracker(scan=False, limit_bytes=limit)
    device.start(roots=list(module.parameters()))
    start = time.perf_counter()
    try:
        trainer([finder], steps=1).fit(module)
    except torch.OutOfMemoryError:
        print("  (BatchSizeFinder's own first training step after the search ran out of memory)")
    finally:
        device.stop()
    return module.batch_size, module.steps_run, time.perf_counter() - start


def distance(answer: int | None, truth_size: int) -> str:
    if answer is None:
        return "-"
    verdict = "fits" if answer <= truth_size else "TOO LARGE"
    return f"{answer:>8,}  {100 * (answer - truth_size) / truth_size:+7.2f}%  {verdict:<9}"


def models(names: list[str], all_runs: bool) -> None:
    print("the largest batch whose steady-state step fits the budget less a 5% margin")
    for name in names:
        budget, limit = BUDGETS[name], limit_bytes(BUDGETS[name])
        print(f"\n{name}: budget {budget}, limit {limit:,} bytes")
        started = time.perf_counter()
        got = check("answers", f"{name}:{budget}:{SIZES[name]}")[name]
        build, make = MODELS[name]
        largest = largest_batch_size(build(), lambda n, make=make: make(n), budget)
        ours = time.perf_counter() - started
        seen: dict[int, int] = {}
        started = time.perf_counter()
        real = truth(lambda n, name=name, limit=limit, seen=seen: real_fits(name, n, limit, seen), largest)
        took = time.perf_counter() - started
        print(f"  truth by bisection with real runs: {real:,} ({len(seen)} real runs, {took:.0f} s)")
        rows = [
            ("cb.max_batch_size() at step 0", got["logged"][0]),
            ("cb.max_batch_size() at step 1", got["logged"][1]),
            ("forecast lines at step 0", got["lines"][0]),
            ("forecast lines at step 1", got["lines"][1]),
            ("largest_batch_size (dry runs)", largest),
        ]
        print(f"  (our answers: {ours:.1f} s, two training steps at {SIZES[name]} included)")
        if name != "seed" or all_runs:
            size, steps, seconds = with_batch_size_finder(lambda name=name: finder_module(name), limit)
            rows.append((f"BatchSizeFinder ({steps} steps, {seconds:.0f} s)", size))
        for label, answer in rows:
            print(f"  {label:<42}{distance(None if answer is None else int(answer), real)}".rstrip())


# -- the variable-length case --------------------------------------------------------------------------------------

BUDGET = 48 * 2**20
SHORT, LONG, SAMPLES = 32, 256, 4096


class Sequences(Dataset):
    """Token sequences: 1 in 1024 is long (256 tokens), the rest short (32 tokens)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = [
            torch.randint(0, 1000, (LONG if i % 1024 == 1023 else SHORT,), generator=generator) for i in range(SAMPLES)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def pad(batch: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(batch, batch_first=True)


class TokenMLP(L.LightningModule):
    """Per-token MLP over a padded batch: activations grow with samples x length."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 10)
        self.steps_run = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        return self.head(self.net(batch).mean(1)).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Sequences(), batch_size=self.batch_size, shuffle=True, collate_fn=pad)


def fits_longest_batch(batch_size: int) -> bool:
    """A steady-state step on a batch of the longest sequences, under the budget: a first step at batch 1 creates
    Adam's state and the gradients, then Lightning's order (forward with the gradients resident, zero them,
    backward, step)."""
    torch.manual_seed(0)
    module = TokenMLP(batch_size)
    optimizer = module.configure_optimizers()
    device = LiveTensorTracker(scan=False, limit_bytes=BUDGET)
    device.start(roots=list(module.parameters()))
    try:
        for size in (1, batch_size):
            loss = module.training_step(torch.randint(0, 1000, (size, LONG)), 0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            del loss
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        device.stop()


def with_memtenants() -> tuple[int, int, float]:
    L.seed_everything(0, verbose=False)
    module = TokenMLP(batch_size=16)
    cb = MemoryTenantsCallback(
        budget_bytes=BUDGET, margin=0.0, memory_source=TrackerSource(scan=False), print_summary=False
    )
    device = LiveTensorTracker(scan=False, limit_bytes=BUDGET)
    device.start(roots=list(module.parameters()))
    start = time.perf_counter()
    try:
        trainer([cb], steps=2).fit(module)  # two ordinary training steps
    finally:
        device.stop()
    # The longest sample decides: ask for the batch whose longest-sequence step fits (the forecast's lines: the
    # batches measured were short, and a dry run resizes the batch, not its sequences).
    answer = cb.max_batch_size(elements_per_sample=LONG)
    return int(answer or 0), module.steps_run, time.perf_counter() - start


def variable_length() -> None:
    print(
        f"\nvariable-length data: {SAMPLES} sequences, 1 in 1024 of {LONG} tokens, the rest {SHORT}; a simulated"
        f" {BUDGET / 2**20:.0f} MiB device, no margin; the question: the largest batch of the longest sequences"
    )
    real = truth(fits_longest_batch, 32)
    print(f"  truth by bisection with real steady-state steps on the longest batch: {real}")
    exact = largest_batch_size(TokenMLP(), lambda b: torch.randint(0, 1000, (b, LONG)), BUDGET, margin=0.0)
    print(f"  {'method':<42}{'batch':>8}  {'vs truth':>8}  {'':<9}{'steps run':>10}{'wall s':>8}")
    size, steps, seconds = with_batch_size_finder(TokenMLP, BUDGET)
    print(f"  {'BatchSizeFinder (binsearch)':<42}{distance(size, real)}{steps:>10}{seconds:>8.2f}")
    size, steps, seconds = with_memtenants()
    print(f"  {'memtenants forecast lines (2 steps at 16)':<42}{distance(size, real)}{steps:>10}{seconds:>8.2f}")
    print(f"  {'largest_batch_size, longest batch':<42}{distance(exact, real)}{0:>10}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="seed,gpt,conv")
    parser.add_argument("--all", action="store_true", help="also BatchSizeFinder on the seed model (slow)")
    parser.add_argument("--skip-variable", action="store_true")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    models([name for name in args.models.split(",") if name], args.all)
    if not args.skip_variable:
        variable_length()


if __name__ == "__main__":
    main()

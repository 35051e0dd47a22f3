"""Under gradient accumulation a step counts what a device would hold: the batch in use, never the data set.

Between two micro-batches of a step Lightning fetches the next batches: a ``TensorDataset``'s sample is a view of
the whole data set's storage, and the collate and the prefetch of the batch after run there too. The live-tensor
tracker is paused from each micro-batch's ``batch_end`` to the next one's ``batch_start``, which starts it again
with that batch among the roots, so none of it is counted.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import lightning as L
import torch
from conftest import assert_equals_the_real_run, make_trainer, no_collection
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback, StepReport, dry_run

F32 = 4
SAMPLES = 40_000  # 40,000 x (4 + 1) floats: an 800,000-byte data set
DATA_SET_BYTES = SAMPLES * 5 * F32


class Mlp(L.LightningModule):
    """4 -> 8 -> ReLU -> 1, mean squared error, Adam."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


class Steps(L.Callback):
    def __init__(self, cb: MemoryTenantsCallback) -> None:
        self.cb, self.reports = cb, []

    def on_train_batch_end(self, *args: object) -> None:
        if self.cb.latest is not None and (not self.reports or self.reports[-1] is not self.cb.latest):
            self.reports.append(self.cb.latest)


def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 4, generator=generator), torch.randn(SAMPLES, 1, generator=generator)


def fit(data: Any, steps: int = 3) -> tuple[MemoryTenantsCallback, list[StepReport]]:
    """A real fit of ``steps`` optimizer steps of two micro-batches of 4 samples, every step measured."""
    cb = MemoryTenantsCallback(track_every_step=True, print_summary=False)
    seen = Steps(cb)
    with warnings.catch_warnings(), no_collection():
        warnings.simplefilter("ignore")  # Lightning's: no logger, few batches
        trainer = make_trainer([cb, seen], steps=steps, accumulate_grad_batches=2)
        trainer.fit(Mlp(), DataLoader(data, batch_size=4))
    assert [r.step for r in seen.reports] == list(range(steps))
    return cb, seen.reports


def readings(reports: list[StepReport]) -> list[list[dict[str, tuple[int | None, int | None]]]]:
    return [
        [{name: (p.allocated_bytes, p.window_peak_bytes) for name, p in mb.items()} for mb in r.micro_batches]
        for r in reports
    ]


def test_an_accumulated_step_never_counts_the_tensor_dataset() -> None:
    x, y = tensors()
    cb, reports = fit(TensorDataset(x, y))
    phases = [p for r in reports for mb in r.micro_batches for p in mb.values()]
    assert len(phases) == 3 * 9 and all(p.allocated_bytes < DATA_SET_BYTES for p in phases)
    # Worked out by hand. The fixed tenants: weights (4 x 8 + 8) + (8 x 1 + 1) = 49 floats, 196 bytes; gradients
    # as many; Adam's exp_avg and exp_avg_sq, 392 bytes, and a 0-d float step per parameter, 16 bytes. The batch in
    # use: x 4 x 4 and y 4 x 1 floats, 80 bytes. The second micro-batch starts with the first one's gradients.
    weights, adam, batch = 196, 2 * 196 + 4 * F32, (4 * 4 + 4 * 1) * F32
    start = weights + weights + adam + batch
    for report in reports[1:]:  # steady steps (step 0 has no optimizer state yet)
        assert report.micro_batches[1]["batch_start"].allocated_bytes == start == 880
        # The peak is in the second micro-batch's backward, at ReLU's backward: the ReLU output it saved, the
        # gradient of that output (linear 2's backward) and its own output, 4 x 8 floats each; the loss divided by
        # the accumulation and Lightning's detached copy of it, and the backward's root gradient, 4 bytes each
        assert report.peak_bytes == start + 3 * (4 * 8 * F32) + 3 * F32 == 1276
        assert report.peak_phase == "after_backward"
    assert cb.run_peak_bytes == 1276
    # samples that each own their storage are counted the same, phase by phase, micro-batch by micro-batch
    own, owned = fit([(x[i].clone(), y[i].clone()) for i in range(64)])
    assert readings(owned) == readings(reports)
    assert own.run_peak_bytes == 1276


def test_an_accumulated_step_reads_what_its_dry_run_predicts() -> None:
    """What ``advise``'s smaller micro-batch fix predicts (a dry run with ``accumulate_grad_batches``) is what a fit on
    a TensorDataset reads: every tenant at every phase, the allocated bytes, the window peaks and the peak."""
    x, y = tensors()
    _, reports = fit(TensorDataset(x, y), steps=2)
    prediction = dry_run(Mlp(), (torch.Size([4, 4]), torch.Size([4, 1])), steps=2, accumulate_grad_batches=2)
    for predicted, real in zip(prediction.reports, reports, strict=True):
        assert_equals_the_real_run(predicted, {"report": dataclasses.asdict(real)})
        assert readings([predicted]) == readings([real])
    assert max(r.peak_bytes for r in prediction.reports) == 1276  # type: ignore[type-var]

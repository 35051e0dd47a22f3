"""Two CPU processes under Lightning's DDP (gloo); run by tests/test_ddp.py as ``python ddp_script.py MODE OUT``.

Lightning's launcher starts rank 1 by running this script again. Each rank writes what its own callback
measured to ``OUT/rank<r>.json``; rank zero also writes what its logger received to ``OUT/logged.json``.

Modes: ``ddp`` (Adam; then ZeroRedundancyOptimizer with gradient_as_bucket_view=True, in a second fit),
``fsdp`` (FSDP2 ``fully_shard`` through Lightning's ModelParallelStrategy, which runs on CPU with gloo),
``fault`` (the census fails on rank 1 only: both ranks must finish), ``crash`` (rank 1's training_step
raises: the run must end, not hang), ``oom-one`` and ``oom-both`` (``torch.OutOfMemoryError`` on rank 1, or
on both: the run ends and each failing rank writes its own postmortem), ``oom-val-one`` (rank 1 runs out in
the sanity check's second validation batch, before training starts), ``validate-oom`` (the same batch fails in
a stand-alone ``trainer.validate``), ``oom-plain`` (``oom-one`` without the
callback, to time against), ``budget`` (ranks train on sequences of different lengths under a budget: the
largest batch logged is the minimum over ranks).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import RecordingLogger

from lightning_memtenants import MemoryTenantsCallback
from lightning_memtenants.core.census import TenantCounter


class Net(L.LightningModule):
    """Linear(32, 64), Tanh, Linear(64, 16): 3,152 parameters. Rank r trains on 2 + 2r samples of each batch."""

    def __init__(self, zero: bool = False, crash: bool = False, fsdp: bool = False, oom: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
        self.zero, self.crash, self.fsdp, self.oom = zero, crash, fsdp, oom

    def configure_model(self) -> None:
        """FSDP2 through Lightning's ModelParallelStrategy: each Linear is a unit, sharded over the 2 ranks."""
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2], self.net):
                fully_shard(layer, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.crash and self.global_rank == 1 and batch_idx == 2:
            raise RuntimeError("rank 1 fails on purpose")
        x = batch[0][: 2 + 2 * self.global_rank]
        loss = self.net(x).pow(2).mean()
        if self.oom and batch_idx == 2 and (self.oom == "both" or self.global_rank == 1):
            # out of memory in the forward of one rank, while the other goes on into backward's allreduce
            raise torch.OutOfMemoryError(f"CUDA out of memory on rank {self.global_rank} (injected)")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        if self.oom == "val-one" and batch_idx == 1 and self.global_rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory in validation on rank 1 (injected)")
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        if self.zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Tokens(L.LightningModule):
    """Embedding, Linear, head over token ids; rank r trains on sequences of 8 x (1 + r) tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.hidden, self.head = nn.Embedding(100, 64), nn.Linear(64, 64), nn.Linear(64, 100)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (tokens,) = batch
        logits = self.head(torch.tanh(self.hidden(self.embed(tokens))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        length = 8 * (1 + self.global_rank)
        tokens = torch.randint(0, 100, (64, length), generator=torch.Generator().manual_seed(self.global_rank))
        return DataLoader(TensorDataset(tokens), batch_size=8)


class OwnAnswers(L.Callback):
    """This rank's own largest batch after each step (listed after the callback, so its step has ended)."""

    def __init__(self, cb: MemoryTenantsCallback) -> None:
        self.cb, self.answers = cb, []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.answers.append(self.cb.max_batch_size(self.cb.budget))


def fit_budget() -> dict[str, Any]:
    """Both ranks under a 4 MiB budget: each rank's own largest batch, and what rank zero logged."""
    cb = MemoryTenantsCallback(print_summary=False, budget_bytes="4MiB")
    probe = OwnAnswers(cb)
    logger = RecordingLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=2,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[cb, probe],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tokens())
    return {
        "own": cb.max_batch_size(cb.budget),  # with an argument: this rank's answer
        "own_steps": probe.answers,  # this rank's answer after each step
        "all": cb.max_batch_size(),  # without: the minimum over ranks, logged last
        "logged": [metrics.get("memtenants/max_batch_size") for _, metrics in logger.logged],
    }


def fit(
    zero: bool = False,
    crash: bool = False,
    gradient_as_bucket_view: bool = False,
    fsdp: bool = False,
    oom: str = "",
    out: Path | None = None,
    ours: bool = True,
    validate_only: bool = False,
) -> tuple[MemoryTenantsCallback, RecordingLogger]:
    cb = MemoryTenantsCallback(print_summary=False, postmortem_dir=out)
    logger = RecordingLogger()
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if fsdp
        else DDPStrategy(process_group_backend="gloo", gradient_as_bucket_view=gradient_as_bucket_view)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        log_every_n_steps=2,
        logger=logger,
        callbacks=[cb] if ours else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)))
    val = DataLoader(data, batch_size=16) if oom == "val-one" else None  # the other runs have no validation loop
    if validate_only:  # a stand-alone trainer.validate: its loop reads the log dir and the ranks for itself
        trainer.validate(Net(zero, crash, fsdp, oom), val, verbose=False)
    else:
        trainer.fit(Net(zero, crash, fsdp, oom), DataLoader(data, batch_size=8), val)
    return cb, logger


def summary(cb: MemoryTenantsCallback, logger: RecordingLogger) -> dict[str, Any]:
    report = cb.latest
    return {
        "tenants": report.tenants_bytes,
        "end": report.phases["batch_end"].tenants_bytes,
        "parts": report.parts_bytes,
        "notes": report.notes,
        "expected_fixed": report.expected_fixed_bytes,
        "measured_fixed": report.measured_fixed_bytes,
        "fixed_notes": report.fixed_cost_notes,
        "logged": logger.logged,
        "measured": _measured(cb.latest_measured),
    }


def _measured(report: Any) -> dict[str, Any] | None:
    """The last step the tracker measured: allocated, window peak and other bytes per phase, and the peak's sentence."""
    if report is None:
        return None
    phases = {k: [v.allocated_bytes, v.window_peak_bytes, v.other_bytes] for k, v in report.phases.items()}
    return {"phases": phases, "explanation": report.peak_explanation}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if mode == "fault":
        count = TenantCounter.count

        def failing(self: TenantCounter, *args: Any, **kwargs: Any) -> dict[str, int]:
            if torch.distributed.get_rank() == 1:
                raise RuntimeError("census fails on rank 1")
            return count(self, *args, **kwargs)

        TenantCounter.count = failing  # type: ignore[method-assign]
    results: dict[str, Any] = {}
    if mode == "budget":
        results["budget"] = fit_budget()
        (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if mode == "validate-oom":
        fit(oom="val-one", validate_only=True)
    if mode.startswith("oom"):  # oom-one, oom-both, oom-val-one, oom-plain (oom-one without the callback): it ends
        # the postmortem goes to the default directory, the one ``trainer.log_dir`` names (here the working one)
        fit(oom="one" if mode == "oom-plain" else mode.removeprefix("oom-"), ours=mode != "oom-plain")
    cb, logger = fit(crash=mode == "crash", fsdp=mode == "fsdp")
    rank = torch.distributed.get_rank()
    results["ddp"] = summary(cb, logger) if cb.latest is not None else {"latest": None, "logged": logger.logged}
    if mode == "ddp":
        results["zero"] = summary(*fit(zero=True, gradient_as_bucket_view=True))
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    # Lightning leaves the gloo group and its TCP store up; C++ teardown at interpreter exit aborts some runs
    # ("terminate called without an active exception"), so both ranks leave together and skip that teardown.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

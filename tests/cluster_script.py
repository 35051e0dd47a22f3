"""Real gloo runs of Lightning's strategies for tests/test_cluster.py: ``python cluster_script.py N OUT``.

Lightning's launcher starts the other ranks by running this script again. Each rank fits the same model
three times, under DDPStrategy (with Adam, then ZeroRedundancyOptimizer) and under ModelParallelStrategy
(FSDP2), every step tracked, and writes every step's report to ``OUT/<ddp|zero|fsdp>_rank<r>.json``. On 2
ranks it also fits :class:`WrappedSharded` (its step calls ``self.model(x)``), FSDP2: ``OUT/model_rank<r>.json``.

``python cluster_script.py zoo OUT NAME...`` runs zoo configurations (``tests/zoo_models.py``) on 2 gloo
processes without Lightning: each block and then ``self.model`` sharded with ``fully_shard``, 2 steps of a
hand-written loop in Lightning's order, a ``TenantMonitor`` on the LightningModule; every step's report goes to
``OUT/zoo_<model>_rank<r>.json``.
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

from lightning_memtenants import MemoryTenantsCallback


class Blocks(L.LightningModule):
    """Three Linear blocks of 32 -> 64 -> 42 -> 16, Tanh after each; FSDP2 shards each block and the root.

    42 rows do not split evenly over 4 ranks (11, 11, 11, 9), so the ranks' shards differ. ``zero`` trains
    with ZeroRedundancyOptimizer, which gives each rank the Adam state of its own parameters.
    """

    def __init__(self, fsdp: bool = False, zero: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fsdp, self.zero = fsdp, zero
        self.blocks = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 42), nn.Linear(42, 16)])

    def configure_model(self) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x = batch[0]
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.pow(2).mean()

    def configure_optimizers(self) -> Any:
        if self.zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Inner(nn.Module):
    """The blocks of :class:`Wrapped`, a model as users hold it in ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 42), nn.Linear(42, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


class Wrapped(L.LightningModule):
    """A LightningModule as users write it: ``self.model``, and a ``training_step`` that calls ``self.model(x)``.

    It has no ``configure_model``: the prediction's FSDP2 default shards it (each block, then ``self.model``).
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Inner()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class WrappedSharded(Wrapped):
    """:class:`Wrapped` with the ``configure_model`` its user writes for ModelParallelStrategy: each block, then
    the model its step calls (``fully_shard(self)`` would leave ``self.model``'s own parameters as DTensors)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def fit(
    strategy: Any, fsdp: bool = False, zero: bool = False, module: L.LightningModule | None = None
) -> list[dict[str, Any]]:
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    reports: list[dict[str, Any]] = []

    class Keep(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            reports.append(cb.latest.to_dict())

    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(sys.argv[1]),
        strategy=strategy,
        max_steps=3,
        logger=False,
        callbacks=[cb, Keep()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)))
    trainer.fit(module if module is not None else Blocks(fsdp, zero), DataLoader(data, batch_size=8))
    return reports


def zoo_rank(rank: int, port: int, out: Path, names: list[str]) -> None:
    """One rank of the Lightning-less FSDP2 runs of ``names``: the reports of 2 steps of each, at fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from zoo_models import build

    from lightning_memtenants import TenantMonitor
    from lightning_memtenants.predict.cluster import named_blocks

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for name in names:
        module = build(name)
        for _, block in named_blocks(module.model):  # as the prediction's default: each block, then the root
            fully_shard(block, mesh=mesh)
        fully_shard(module.model, mesh=mesh)
        optimizer = module.configure_optimizers()
        batch = module.example_batch(2)
        monitor = TenantMonitor(module, [optimizer])

        def before_step(*_: Any, monitor: TenantMonitor = monitor) -> None:
            monitor.phase("before_optimizer_step")

        optimizer.register_step_pre_hook(before_step)
        reports = []
        for index in range(2):  # Lightning's closure: zero_grad after the forward, step after the backward
            monitor.phase("batch_start", batch=batch)
            loss = module.training_step(batch, index)
            optimizer.zero_grad(set_to_none=True)
            monitor.phase("before_backward", output=loss)
            loss.backward()
            monitor.phase("after_backward")
            optimizer.step()
            del loss
            monitor.phase("batch_end")
            reports.append(monitor.end_step().to_dict())
        monitor.close()
        (out / f"zoo_{name.split('/')[0]}_rank{rank}.json").write_text(json.dumps(reports))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def zoo_main(out: Path, names: list[str]) -> None:
    """Start the 2 ranks of :func:`zoo_rank` on a free port."""
    import socket

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    mp.spawn(zoo_rank, args=(port, out, names), nprocs=2)


def main() -> None:
    if sys.argv[1] == "zoo":
        zoo_main(Path(sys.argv[2]), sys.argv[3:])
        return
    n, out = int(sys.argv[1]), Path(sys.argv[2])
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    ddp = fit(DDPStrategy(process_group_backend="gloo"))
    rank = torch.distributed.get_rank()
    (out / f"ddp_rank{rank}.json").write_text(json.dumps(ddp))
    zero = fit(DDPStrategy(process_group_backend="gloo"), zero=True)
    (out / f"zero_rank{rank}.json").write_text(json.dumps(zero))
    fsdp = fit(ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1), fsdp=True)
    (out / f"fsdp_rank{rank}.json").write_text(json.dumps(fsdp))
    if n == 2:  # a LightningModule whose step calls self.model(x), sharded as the prediction's default assumes
        model = fit(ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1), module=WrappedSharded())
        (out / f"model_rank{rank}.json").write_text(json.dumps(model))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""A real 2 x 2 gloo run of tensor parallelism and FSDP2 for tests/test_tensor_parallel.py: ``python tp_script.py OUT``.

Lightning's launcher starts the other three ranks by running this script again. Each rank fits
:class:`TPBlocks` under ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)`` for two steps,
every step tracked, and writes every step's report to ``OUT/tp_rank<r>.json``.
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
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback

WIDTH, HEADS, HIDDEN, SEQUENCE, FEATURES = 32, 4, 48, 8, 12


class Attention(nn.Module):
    """Self-attention written with nn.Linear, so ColwiseParallel splits q, k and v by heads and RowwiseParallel o."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head = WIDTH // HEADS
        q, k, v = (layer(x).view(b, s, -1, head).transpose(1, 2) for layer in (self.q, self.k, self.v))
        weights = torch.softmax(q @ k.transpose(-2, -1) / head**0.5, dim=-1)
        return self.o((weights @ v).transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


class TPBlocks(L.LightningModule):
    """A small transformer in ``self.model``; ``configure_model`` applies torchtitan's Llama plan, then FSDP2.

    Tensor parallelism (Megatron's with sequence parallelism): q, k, v and the MLP's first Linear split by
    columns, o and the MLP's second by rows; the norms and the residual stream hold a slice of the sequence.
    Then ``fully_shard`` on each block and the model over the data-parallel mesh.
    """

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Transformer(blocks)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        parallelize_module(
            self.model,
            tp,
            {
                "inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
        for block in self.model.blocks:
            parallelize_module(
                block,
                tp,
                {
                    "norm1": SequenceParallel(),
                    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "attn.q": ColwiseParallel(),
                    "attn.k": ColwiseParallel(),
                    "attn.v": ColwiseParallel(),
                    "attn.o": RowwiseParallel(output_layouts=Shard(1)),
                    "norm2": SequenceParallel(),
                    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "mlp.0": ColwiseParallel(),
                    "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
                },
            )
            fully_shard(block, mesh=dp)
        fully_shard(self.model, mesh=dp)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    out = Path(sys.argv[1])
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    reports: list[dict[str, Any]] = []

    class Keep(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            reports.append(cb.latest.to_dict())

    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        max_steps=2,
        logger=False,
        callbacks=[cb, Keep()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(16, SEQUENCE, FEATURES, generator=torch.Generator().manual_seed(0)))
    trainer.fit(TPBlocks(), DataLoader(data, batch_size=2))
    rank = trainer.global_rank
    (out / f"tp_rank{rank}.json").write_text(json.dumps(reports))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""The compiled-model zoo of issue #31: blocks of LayerNorm, Linear 256->1024, GELU, a sigmoid gate, Linear 1024->256.

Each block computes ``x + fc2(gelu(fc1(ln(x))) * sigmoid(gate(ln(x))))`` with ``gate`` a ``Linear(256, 1024)``
and one LayerNorm call shared by both branches. At batch 64 in float32, measured on torch 2.13 CPU with the loss
``out.pow(2).mean()``, three blocks save 3,540,480 B for backward eagerly and 2,753,792 B under ``torch.compile``
(inductor's partitioner recomputes the cheap pointwise work). The block itself is ``benchmarks/compiled_defs.py``'s,
so that the benchmark's figures are the tests'.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from compiled_defs import HIDDEN, WIDTH, GatedBlock, gated_blocks

__all__ = ["HIDDEN", "WIDTH", "GatedBlock", "gated_blocks"]


def square_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The loss of the measurements above: the mean of the output squared."""
    return model(batch).pow(2).mean()


class CheckpointedBlock(GatedBlock):
    """A gated block whose forward runs under non-reentrant activation checkpointing: recomputed in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


def checkpointed_blocks(blocks: int = 3, seed: int = 0) -> nn.Sequential:
    """``blocks`` checkpointed gated blocks, their weights drawn from ``seed`` (those of :func:`gated_blocks`)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[CheckpointedBlock() for _ in range(blocks)])


class GatedLM(L.LightningModule):
    """Three gated blocks, compiled or not, trained on ``out.pow(2).mean()`` with Adam."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        blocks = gated_blocks()
        self.net: nn.Module = torch.compile(blocks) if compiled else blocks

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


class CheckpointedLM(GatedLM):
    """:class:`GatedLM` with each block's forward checkpointed (non-reentrant), compiled or not."""

    def __init__(self, compiled: bool) -> None:
        super().__init__(compiled=False)
        blocks = checkpointed_blocks()
        self.net = torch.compile(blocks) if compiled else blocks


class BrokenBlocks(nn.Module):
    """Three gated blocks with a graph break after the first: Dynamo compiles block 1, then blocks 2 and 3.

    The break is what users hit: ``"graph_break"`` calls ``torch._dynamo.graph_break()``, ``"item"`` keeps the
    largest activation as a float (``Tensor.item()``), ``"print"`` prints the activation's shape.
    """

    def __init__(self, breaks: str = "graph_break") -> None:
        super().__init__()
        self.blocks = gated_blocks()
        self.breaks = breaks
        self.largest = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        if self.breaks == "graph_break":
            torch._dynamo.graph_break()
        elif self.breaks == "item":
            self.largest = x.abs().max().item()
        else:
            print(f"block 1 out: {tuple(x.shape)}")
        return self.blocks[2](self.blocks[1](x))


class BrokenLM(L.LightningModule):
    """:class:`BrokenBlocks` compiled as a whole, trained on ``out.pow(2).mean()`` with Adam."""

    def __init__(self, breaks: str = "graph_break") -> None:
        super().__init__()
        self.net = torch.compile(BrokenBlocks(breaks))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


class LoggedLM(L.LightningModule):
    """Three gated blocks as ``forward``, whose ``training_step`` logs its loss: compiled the way users do with
    Lightning (``trainer.fit(torch.compile(module))``), Dynamo compiles the step too and breaks its graph at
    ``self.log``.
    """

    def __init__(self, log: bool = True) -> None:
        super().__init__()
        self.net = gated_blocks()
        self.logs = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch[0]).pow(2).mean()
        if self.logs:
            self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective-checkpointing policy: the matrix products' outputs are saved, everything else recomputed."""
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveBlock(GatedBlock):
    """A gated block checkpointed selectively (:func:`save_matmuls`): its Linears' outputs saved, the rest redone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        contexts = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
        return checkpoint(super().forward, x, use_reentrant=False, context_fn=contexts)


class ReentrantBlock(GatedBlock):
    """A gated block under reentrant checkpointing: eagerly its output requires grad only where its input does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=True)


class MixedCheckpointLM(GatedLM):
    """A reentrant, a selective and a plain checkpointed block, compiled (Dynamo runs each as its checkpoint op)."""

    def __init__(self) -> None:
        super().__init__(compiled=False)
        torch.manual_seed(0)
        self.net = torch.compile(nn.Sequential(ReentrantBlock(), SelectiveBlock(), CheckpointedBlock()))

"""The models of ``benchmarks/compiled.py``; ``tests/compiled_models.py`` imports the gated block from here.

Benchmarks do not import from ``tests/``; the rest are copies of ``tests/compiled_models.py`` and
``tests/hf_models.py`` that build the same modules with the same weights (the same seeds, layers and calls in the
same order), so the benchmark's figures are those of the tests' models.

The gated blocks: LayerNorm, Linear 256->1024, GELU, a sigmoid gate, Linear 1024->256 and a residual, three of
them, trained on ``out.pow(2).mean()`` with Adam; checkpointed (non-reentrant) per block, with a graph break
after the first block, or compiled the way Lightning users do (``torch.compile(module)``, ``self.log`` in the
step). The Hugging Face models: GPT-2 and Llama of 2 layers of width 64 built from their config classes, batch
4 x 32 tokens of a 256-token vocabulary, trained on their own causal-LM loss with AdamW.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

WIDTH = 256
HIDDEN = 1024

BATCH = 4
SEQ = 32
VOCAB = 256
HF_HIDDEN = 64


class GatedBlock(nn.Module):
    """One block: a LayerNorm, a GELU branch gated by a sigmoid branch, a projection back, a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.gate = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(x)
        return x + self.fc2(F.gelu(self.fc1(h)) * torch.sigmoid(self.gate(h)))


class CheckpointedBlock(GatedBlock):
    """A gated block whose forward runs under non-reentrant activation checkpointing: recomputed in backward."""

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


def gated_blocks(blocks: int = 3, seed: int = 0, block: type[GatedBlock] = GatedBlock) -> nn.Sequential:
    """``blocks`` blocks of class ``block``, their weights drawn from ``seed`` (the same for either class)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[block() for _ in range(blocks)])


class BrokenBlocks(nn.Module):
    """Three gated blocks with a graph break after the first: Dynamo compiles block 1, then blocks 2 and 3."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = gated_blocks()

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        return self.blocks[2](self.blocks[1](x))


class GatedLM(L.LightningModule):
    """A net of gated blocks, compiled or not, trained on ``out.pow(2).mean()`` with Adam.

    Args:
        compiled: wrap the net in ``torch.compile``.
        net: ``"gated"`` (three gated blocks), ``"checkpointed"`` (each block checkpointed) or ``"broken"``
            (a graph break after the first block).
    """

    def __init__(self, compiled: bool, net: str = "gated") -> None:
        super().__init__()
        builders = {
            "gated": gated_blocks,
            "checkpointed": lambda: gated_blocks(block=CheckpointedBlock),
            "broken": BrokenBlocks,
        }
        blocks = builders[net]()
        self.net: nn.Module = torch.compile(blocks) if compiled else blocks

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


class LoggedLM(L.LightningModule):
    """Three gated blocks as ``forward``, the step logging its loss: compiled as ``torch.compile(module)``, Dynamo
    compiles the step too and breaks its graph at ``self.log``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = gated_blocks()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        loss = self(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def hf_model(name: str) -> nn.Module:
    """GPT-2 (tied embeddings) or Llama (grouped-query attention, rotary embeddings), freshly initialised, sdpa."""
    import transformers as tf

    common: dict[str, Any] = {"attn_implementation": "sdpa"}
    if name == "gpt2":
        config = tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=2 * SEQ,
            n_embd=HF_HIDDEN,
            n_layer=2,
            n_head=4,
            bos_token_id=VOCAB - 1,  # GPT-2's 50256 is outside this vocabulary
            eos_token_id=VOCAB - 1,
            **common,
        )
        return tf.GPT2LMHeadModel(config)
    if name == "llama":
        config = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HF_HIDDEN,
            intermediate_size=2 * HF_HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2 * SEQ,
            **common,
        )
        return tf.LlamaForCausalLM(config)
    raise ValueError(f"no Hugging Face model named {name!r}")


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM, compiled or not, trained on its own loss with the cache off, as a compiled
    training step runs it; the batch's keys are the model's keyword arguments, the labels its input ids."""

    def __init__(self, name: str, compiled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        model = hf_model(name)
        self.model: nn.Module = torch.compile(model) if compiled else model

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch, labels=batch["input_ids"], use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def hf_samples(name: str) -> list[dict[str, Tensor]]:
    """One sample per row of the batch: random ids, and for GPT-2 an attention mask of ones."""
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": ids[i]} for i in range(BATCH)]
    if name == "gpt2":
        rows = [{**row, "attention_mask": torch.ones(SEQ, dtype=torch.long)} for row in rows]
    return rows

"""A small GPT as a LightningModule: the worked example for predictions and the transformer check.

Pre-norm blocks (LayerNorm, causal self-attention through ``scaled_dot_product_attention``,
a 4x GELU MLP), learned position embeddings, an untied head, AdamW. Its ``example_batch``
is what ``memtenants predict examples/gpt.py:TinyGPT`` feeds to the dry run.

Run a prediction: ``python examples/gpt.py --batch-size 8 --seq-len 256``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """One transformer layer; its saved activations are what Korthikanti et al. count per layer."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.n_head, h // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln_2(x)))))


class TinyGPT(L.LightningModule):
    """GPT-2 in miniature; sizes are constructor arguments so the same code is 7B-shaped on demand."""

    def __init__(
        self,
        vocab_size: int = 1024,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 512,
        dropout: float = 0.0,
        lr: float = 3e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def example_batch(self, batch_size: int, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        """Token ids and next-token targets of the given shape (random, as only shapes matter here)."""
        seq_len = seq_len or self.hparams.block_size
        if seq_len > self.hparams.block_size:
            raise ValueError(f"seq_len must be at most block_size={self.hparams.block_size}, got {seq_len}")
        idx = torch.randint(0, self.hparams.vocab_size, (batch_size, seq_len))
        return idx, torch.roll(idx, -1, dims=1)


def main() -> None:
    from lightning_memtenants import format_table, predict
    from lightning_memtenants.predict.transformer import activation_check

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    model = TinyGPT()
    report = predict(model, lambda m: m.example_batch(args.batch_size, args.seq_len), precision=args.precision)
    print(format_table(report))
    check = activation_check(model, model.example_batch(args.batch_size, args.seq_len), precision=args.precision)
    print(check.summary())


if __name__ == "__main__":
    main()

"""A 7B shape over 64 FSDP ranks, predicted in this process: the time, the memory, and each rank's figures.

The issue's target: under 60 s and 4 GiB of RAM on a 2-core machine. The model is Llama-7B's shape
(32 blocks of width 4096, SwiGLU 11008, 32,000 tokens, untied head: 6.74B parameters), one sequence of
2,048 tokens per rank, AdamW, sharded by FSDP2 per block and the root. Nothing is allocated: the
parameters are fake tensors. Run: ``python benchmarks/cluster.py [--world-size 64] [--target H100]``.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memtenants import dry_run

GiB = 2**30


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, head: int = 128) -> None:
        super().__init__()
        self.heads, self.head = width // head, head
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.up = nn.Linear(width, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, self.head).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, width))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama7B(nn.Module):
    def __init__(self, layers: int = 32, width: int = 4096, hidden: int = 11008, vocab: int = 32000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width, hidden) for _ in range(layers)])
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss(model: nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
    (tokens,) = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def _high_water_rss_bytes() -> int:
    """This process's own peak resident memory (``VmHWM``; ``ru_maxrss`` may report the parent it was forked from)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--target", default="cpu", help="cpu, or a GPU: H100, A100...")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(1)
    wall, cpu = time.perf_counter(), time.process_time()
    prediction = dry_run(
        Llama7B,
        (torch.zeros(1, args.seq_len, dtype=torch.long),),
        loss_fn=loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        strategy="fsdp",
        world_size=args.world_size,
        target=args.target,
        precision=args.precision,
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rss = _high_water_rss_bytes()
    ranks = prediction.ranks
    classes = len({id(report) for report in ranks})
    print(
        f"7B shape (Llama), FSDP2 over {args.world_size} ranks, target {args.target}, {args.precision}:"
        f" {wall:.1f} s wall, {cpu:.1f} s CPU, {rss / GiB:.2f} GiB max RSS, {classes} dry run(s) for"
        f" {len(ranks)} ranks"
    )
    report = ranks[0]
    tenants = ", ".join(f"{name} {value / GiB:.2f}" for name, value in report.tenants_bytes.items())
    print(f"rank 0: peak {(report.peak_bytes or 0) / GiB:.2f} GiB at {report.peak_phase}; {tenants} (GiB)")
    peaks = [(r.peak_bytes or 0) / GiB for r in ranks]
    print(f"all ranks' peaks: {min(peaks):.2f} to {max(peaks):.2f} GiB")
    for note in report.notes:
        if "attention" in note or note.startswith("FSDP"):
            print(f"note: {note}")


if __name__ == "__main__":
    main()

"""The article's model in a Lightning Trainer on the CPU, with MemoryTenantsCallback attached.

Linear 1024->4096->4096->1024, fp32, Adam, loss ``model(x).pow(2).mean()`` as in the article.
Run: ``python examples/seed_mlp.py [--batch-size 256] [--steps 4]``; then
``tensorboard --logdir lightning_logs`` shows the ``memtenants/`` scalars.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback


def seed_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(1024, 4096),
        nn.ReLU(),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Linear(4096, 1024),
    )


class SeedMLP(L.LightningModule):
    """The article's model; ``losses`` keeps each step's loss as a float for comparisons."""

    def __init__(self) -> None:
        super().__init__()
        self.net = seed_model()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def seed_loader(batch_size: int, steps: int, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(batch_size * steps, 1024, generator=generator)
    return DataLoader(TensorDataset(data), batch_size=batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--logdir", default="lightning_logs")
    parser.add_argument(
        "--budget", default=None, help='a memory budget such as "1GiB": adds headroom and max batch size'
    )
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    memtenants = MemoryTenantsCallback(budget_bytes=args.budget)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        log_every_n_steps=1,
        callbacks=[memtenants],
        logger=TensorBoardLogger(args.logdir, name="seed_mlp"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SeedMLP(), seed_loader(args.batch_size, args.steps))
    assert memtenants.latest is not None
    print(f"tenants_bytes of the last step: {memtenants.latest.tenants_bytes}")


if __name__ == "__main__":
    main()

"""The core without Lightning: TenantMonitor around a hand-written training loop.

Run: ``python examples/plain_loop.py``. It trains the article's model for two steps at
batch 64 with plain PyTorch and prints the same table the callback prints.
"""

from __future__ import annotations

import torch

from lightning_memtenants import TenantMonitor, format_table


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024),
    )
    optimizer = torch.optim.Adam(model.parameters())
    monitor = TenantMonitor(model, [optimizer])
    for _ in range(2):
        x = torch.randn(64, 1024)
        monitor.phase("batch_start", batch=x)
        loss = model(x).pow(2).mean()
        monitor.phase("before_backward", output=loss)
        loss.backward()
        monitor.phase("after_backward")
        monitor.phase("before_optimizer_step")
        optimizer.step()
        monitor.phase("batch_end")
        report = monitor.end_step()
        optimizer.zero_grad()
        assert report is not None
        print(format_table(report))
        print()


if __name__ == "__main__":
    main()

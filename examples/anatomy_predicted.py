"""The article's GPU table (RTX A6000, torch 2.5.1), predicted on a CPU with ``predict(..., target="A6000")``.

The article's loop: the seed model, batch 2048, ``loss = model(x).pow(2).mean()``, Adam with
defaults, one step. ``before_backward`` is "after forward", ``after_backward`` "after
backward", ``batch_end`` "after first opt.step()". Run: ``python examples/anatomy_predicted.py``.
"""

from __future__ import annotations

import torch
from seed_mlp import seed_model

from lightning_memtenants import StepReport, format_table, predict

MiB = 2**20
ARTICLE = {
    "after model.cuda()": 96.0,
    "after forward": 184.2,
    "after backward": 216.3,
    "after first opt.step()": 408.4,
    "peak during all of this": 504.4,
}


def article_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def predicted_rows(gpu: str = "A6000") -> tuple[dict[str, float], StepReport]:
    """Our five rows in MiB, with the report they come from."""
    report = predict(
        seed_model(), torch.Size([2048, 1024]), loss_fn=article_loss, optimizer=torch.optim.Adam, target=gpu
    )
    phases = report.phases
    rows = {
        "after model.cuda()": report.tenants_bytes["weights"] / MiB,
        "after forward": phases["before_backward"].allocated_bytes / MiB,  # type: ignore[operator]
        "after backward": phases["after_backward"].allocated_bytes / MiB,  # type: ignore[operator]
        "after first opt.step()": phases["batch_end"].allocated_bytes / MiB,  # type: ignore[operator]
        "peak during all of this": report.peak_bytes / MiB,  # type: ignore[operator]
    }
    return rows, report


def main() -> None:
    rows, report = predicted_rows()
    print(f"{'row':<26}{'article (A6000)':>16}{'predicted on CPU':>18}")
    for name, value in rows.items():
        print(f"{name:<26}{ARTICLE[name]:>16.1f}{value:>18.1f}")
    print()
    print(format_table(report))


if __name__ == "__main__":
    main()

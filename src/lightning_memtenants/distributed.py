"""Per-rank figures and their cross-rank max and min, gathered through the Lightning strategy.

Every rank measures its own tenants. On logging steps every rank hands one fixed-size vector to
``strategy.all_gather`` (Lightning's collective, whatever the backend), so rank zero can log each
rank's figures and their max and min. The vector has the same shape on every rank even where a
rank's measurement failed (its entries are NaN then), so no rank waits for another that skipped.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_memtenants.report import MiB, StepReport

RANK_FIELDS: tuple[str, ...] = (
    "weights",
    "gradients",
    "optimizer_state",
    "activations",
    "fixed_measured",
    "peak",
)


def rank_vector(report: StepReport | None) -> list[float]:
    """This rank's figures in MiB, in the order of ``RANK_FIELDS``; NaN where not measured."""
    if report is None:
        return [math.nan] * len(RANK_FIELDS)
    values: list[float] = []
    for name in RANK_FIELDS:
        if name == "fixed_measured":
            value: int | None = report.measured_fixed_bytes
        elif name == "peak":
            value = report.peak_bytes
        else:
            value = report.tenants_bytes.get(name)
        values.append(math.nan if value is None else value / MiB)
    return values


def rank_metrics(gathered: torch.Tensor) -> dict[str, float]:
    """Tags for a (world size x fields) table: each rank's figures, and their max and min over ranks."""
    table = gathered.reshape(-1, len(RANK_FIELDS)).double().cpu()
    metrics: dict[str, float] = {}
    for column, name in enumerate(RANK_FIELDS):
        values = table[:, column]
        for rank, value in enumerate(values.tolist()):
            if not math.isnan(value):
                metrics[f"memtenants/rank_{rank}/{name}_MiB"] = value
        known = values[~values.isnan()]
        if known.numel():
            metrics[f"memtenants/ranks_max/{name}_MiB"] = float(known.max())
            metrics[f"memtenants/ranks_min/{name}_MiB"] = float(known.min())
    return metrics


def gather_rank_metrics(strategy: Any, report: StepReport | None) -> dict[str, float]:
    """Gather every rank's figures through ``strategy.all_gather``; every rank must call it on the same steps."""
    try:
        vector = torch.tensor(rank_vector(report), dtype=torch.float64, device=strategy.root_device)
    except Exception:  # never skip the collective: a rank that cannot describe itself sends NaN
        vector = torch.full((len(RANK_FIELDS),), math.nan, dtype=torch.float64, device=strategy.root_device)
    return rank_metrics(strategy.all_gather(vector))
